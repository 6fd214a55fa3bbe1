"""The device kernels (``ringcomm/engines/kernels/allreduce.cu``: allreduce, reduce-scatter,
all-gather) played in numpy on the fake runtime's memory, flags included, so their
algorithm is tested on every CPU.

Why a mirror: no usable CUDA simulator exists, and NVRTC only proves the kernels compile.
Each function here is its kernel step by step: the same signal-pad slots and op numbers,
the same unit width, slices and grid-stride blocks (``ringcomm.core.device.kernel_geometry``),
the same accumulation type and rounding (float16 and bfloat16 in float32, rounded once; a
complex product rounded per operation; ``avg`` as one scale). On a GPU the tests that run
the kernel path on the test runtime run the real kernels (``kernels.cupy_launch``) and
compare them with numpy as the mirror's tests do.

How concurrency is modelled. Ranks are threads of one process sharing the fake's memory (a
peer's region is read and written at its own address, as a mapping would be). Every rank's
stream and every block of every launched kernel is a coroutine, and ``KernelMirror`` runs
them one step at a time in the order a schedule picks: the lowest rank that can move first,
the highest first, or a seeded random choice. A step is what a block's threads do together
between two points where another rank could act: one turn of the grid-stride loop (read
every rank's units, reduce, write), the stores of a meeting (flags into every peer's pad),
or a wait (it holds the block until its pad says every peer got there). A read reads what
the memory holds when the step runs, so a block that reads a peer's data before that peer
wrote it, because a wait was left out, reads the stale bytes: ``left_out`` takes a wait out,
and the tests show the result is then wrong. Memory is sequentially consistent between
steps; on the GPU the kernels get that from their release stores and acquire loads. Where
every coroutine waits, the fake reports the hang a GPU would spin in (``FakeDeviceFault``).

The fake's launch of the kernels for the ``cuda-kernel`` engine (``ringcomm.engines.kernel``)
is ``StreamLauncher``: each rank's launch is an item on its stream, and its blocks run
there, step by step, polling their pads (real shared memory between processes) as a GPU's
blocks spin on them; ranks may be threads or processes. Registering user memory in place is
not written yet.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.device import kernel_geometry as geometry
from ..core.device.runtime import Allocation
from ..core.dtypes import ReduceOp, dtype_name, reduce_op
from .fake_device import FakeDeviceFault, FakeRuntime, _Item

ALGORITHMS = ("one_shot", "two_shot")  # the allreduce kernels
#: every kernel: the allreduces, the reduce-scatter, the all-gather (of bytes)
KERNELS = (*ALGORITHMS, "reduce_scatter", "all_gather")
#: the waits each kernel makes, by the phase where its blocks meet
WAITS = geometry.PHASES
SCHEDULES = ("low_ranks_first", "high_ranks_first", "random")
#: what fresh data buffers hold before any input is copied in: what a read too early sees
STALE_BYTE = 0xA5


@dataclass(frozen=True)
class Launch:
    """One launch's arguments, as the launcher hands them to the kernel: every rank's data
    buffer and signal pad as this rank maps them (index = rank), and for the one-shot, the
    reduce-scatter and the all-gather this rank's output (never a data buffer: peers read
    those while it is written). ``count``: elements of each rank's data (the one-shot's,
    the two-shot's), of each rank's block (the reduce-scatter's: its data holds ``world``
    blocks), or bytes (the all-gather's, whose ``dtype`` is uint8 and ``op`` None; rank q's
    bytes land at ``out + q * stride``)."""

    algorithm: str  # one of KERNELS
    rank: int
    data: tuple[int, ...]
    pads: tuple[int, ...]
    count: int
    dtype: np.dtype
    op: ReduceOp | None
    op_number: int  # this op's number, the same on every rank: what the pads will say
    blocks: int = 2
    threads: int = 4
    out: int | None = None
    stride: int = 0  # the all-gather's: bytes between ranks' blocks in ``out``

    @property
    def world(self) -> int:
        return len(self.data)

    def check(self) -> None:
        """What the kernel takes for granted, refused here as the launcher will refuse it."""
        if self.algorithm not in KERNELS:
            raise ValueError(f"algorithm {self.algorithm!r}: one of {', '.join(KERNELS)}")
        geometry.check_launch(self.world, self.blocks, self.threads)
        if len(self.pads) != self.world or not 0 <= self.rank < self.world:
            raise ValueError("a launch names every rank's data and pad, and its own rank")
        if self.algorithm == "all_gather":
            if self.op is not None or self.dtype != np.uint8:
                raise ValueError("the all-gather copies bytes: dtype uint8, no op")
        else:  # the pairs the host path has; the kernels the same
            reduce_op(self.op, self.dtype)  # type: ignore[arg-type]
        geometry.check_output(self.algorithm, self.data, self.out, self.count, self.stride)
        if self.op_number < 1:
            raise ValueError("op numbers start at 1 (a fresh pad holds 0)")


# ----------------------------------------------------------------------------- numerics


def accumulation_dtype(dtype: np.dtype) -> np.dtype:
    """The type a kernel reduces ``dtype`` in (``Accumulate<T>::Acc``): float32 for
    float16 and bfloat16, the dtype itself otherwise."""
    return np.dtype(np.float32) if dtype_name(dtype) in ("float16", "bfloat16") else dtype


def _combine(op: ReduceOp, acc: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``Op::combine`` in the accumulation type: numpy's ufunc, which has the kernel's
    semantics (wrapping integers, bool as any/all, NaN-propagating min and max), except
    the complex product, whose formula the kernel fixes (each product and sum rounded)."""
    if op.name == "prod" and acc.dtype.kind == "c":
        real = acc.real * x.real - acc.imag * x.imag
        imag = acc.real * x.imag + acc.imag * x.real
        out = np.empty_like(acc)
        out.real, out.imag = real, imag
        return out
    result: np.ndarray = op.ufunc(acc, x)
    return result


def _average(acc: np.ndarray, world: int) -> np.ndarray:
    """``Math<A>::divide``: a float divided by the world size; a complex times 1/n per part
    (numpy's division by n + 0i comes to that)."""
    if acc.dtype.kind == "c":
        part = acc.real.dtype.type
        scale = part(1) / part(world)
        out = np.empty_like(acc)
        out.real, out.imag = acc.real * scale, acc.imag * scale
        return out
    quotient: np.ndarray = acc / acc.dtype.type(world)
    return quotient


def reduce_units(values: Sequence[np.ndarray], op: ReduceOp, world: int,
                 dtype: np.dtype) -> np.ndarray:
    """``reduce_unit``: the same elements of every rank's data, combined rank 0 first (so
    every rank gets the same bits), finished (``avg``) and rounded back to ``dtype`` once."""
    acc_dtype = accumulation_dtype(dtype)
    acc = values[0].astype(acc_dtype)
    for x in values[1:]:
        acc = _combine(op, acc, x.astype(acc_dtype))
    if op.divides:
        acc = _average(acc, world)
    return acc.astype(dtype)


# ----------------------------------------------------------------------------- the kernels


@dataclass
class _Wait:
    """A step that holds its coroutine until ``ready()``; ``what`` names it in a hang."""

    what: str
    ready: Callable[[], bool]


Steps = Generator["_Wait | None", None, None]


class _Memory:
    """Fake device memory as the kernels touch it: typed elements and pad words, resolved
    when a step runs (a freed or unmapped pointer faults as a GPU would)."""

    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt

    def elements(self, ptr: int, first: int, end: int, dtype: np.dtype) -> np.ndarray:
        nbytes = (end - first) * dtype.itemsize
        view = self.rt._view(ptr + first * dtype.itemsize, nbytes, "a mirrored kernel")
        return view.view(dtype)

    def pad(self, ptr: int) -> np.ndarray:
        return self.rt._view(ptr, geometry.PAD_BYTES, "a signal pad").view(np.uint32)


def _meet(mem: _Memory, launch: Launch, block: int, phase: str,
          left_out: frozenset[str]) -> Generator[_Wait | None, None, bool]:
    """``meet``: thread ``peer`` stores the op's number into slot (phase, block, rank) of
    peer ``peer``'s pad; then the block waits until its own pad's slots (phase, block, q)
    say every rank q got here in this op (unless the test left this wait out), or until its
    pad's abort word is set. Returns whether it was (the block then returns)."""
    number = launch.op_number % (1 << 32)
    for peer in range(launch.world):
        mem.pad(launch.pads[peer])[geometry.pad_slot(phase, block, launch.rank)] = number
    yield None
    if phase in left_out:
        return False
    slots = [geometry.pad_slot(phase, block, peer) for peer in range(launch.world)]
    mine = launch.pads[launch.rank]

    def everyone_here() -> bool:
        pad = mem.pad(mine)
        return all(geometry.reached(int(pad[slot]), number) for slot in slots)

    def aborted() -> bool:
        return int(mem.pad(mine)[geometry.ABORT_WORD]) != 0

    yield _Wait(f"rank {launch.rank} block {block} at {phase} of op {launch.op_number}",
                lambda: everyone_here() or aborted())
    return not everyone_here() and aborted()


def _reduce_turn(mem: _Memory, launch: Launch, first: int, end: int,
                 destinations: Sequence[int], shift: int = 0) -> None:
    """One grid-stride turn: elements [first, end) of every rank's data (``shift`` elements
    in), reduced, written to elements [first, end) of each of ``destinations``."""
    assert launch.op is not None
    values = [mem.elements(ptr, first + shift, end + shift, launch.dtype).copy()
              for ptr in launch.data]
    result = reduce_units(values, launch.op, launch.world, launch.dtype)
    for ptr in destinations:
        mem.elements(ptr, first, end, launch.dtype)[:] = result


def one_shot_block(mem: _Memory, launch: Launch, block: int,
                   left_out: frozenset[str] = frozenset()) -> Steps:
    """Block ``block`` of ``one_shot_allreduce``: meet, reduce its units of everything into
    ``out`` (16-byte vectors where every pointer is aligned, then what is left one element
    at a time), meet again."""
    if (yield from _meet(mem, launch, block, "start", left_out)):
        return
    assert launch.out is not None
    scalars_from = 0
    if all(geometry.aligned(ptr) for ptr in (*launch.data, launch.out)):
        width = geometry.vector_width(launch.dtype.itemsize)
        for lo, hi in geometry.grid_stride(0, launch.count // width, block, launch.blocks,
                                           launch.threads):
            _reduce_turn(mem, launch, lo * width, hi * width, (launch.out,))
            yield None
        scalars_from = launch.count // width * width
    for lo, hi in geometry.grid_stride(scalars_from, launch.count, block, launch.blocks,
                                       launch.threads):
        _reduce_turn(mem, launch, lo, hi, (launch.out,))
        yield None
    yield from _meet(mem, launch, block, "end", left_out)


def two_shot_block(mem: _Memory, launch: Launch, block: int,
                   left_out: frozenset[str] = frozenset()) -> Steps:
    """Block ``block`` of ``two_shot_allreduce``: meet, reduce its units of this rank's
    slice from every rank's buffer into every rank's buffer (the last rank also the
    elements after the last whole vector), meet again."""
    if (yield from _meet(mem, launch, block, "start", left_out)):
        return
    if all(geometry.aligned(ptr) for ptr in launch.data):
        width = geometry.vector_width(launch.dtype.itemsize)
        scalars_from = launch.count // width * width
    else:
        width, scalars_from = 1, launch.count
    first, end = geometry.two_shot_slice(launch.count // width, launch.rank, launch.world)
    for lo, hi in geometry.grid_stride(first, end, block, launch.blocks, launch.threads):
        _reduce_turn(mem, launch, lo * width, hi * width, launch.data)
        yield None
    if launch.rank == launch.world - 1:
        for lo, hi in geometry.grid_stride(scalars_from, launch.count, block, launch.blocks,
                                           launch.threads):
            _reduce_turn(mem, launch, lo, hi, launch.data)
            yield None
    yield from _meet(mem, launch, block, "end", left_out)


def reduce_scatter_block(mem: _Memory, launch: Launch, block: int,
                         left_out: frozenset[str] = frozenset()) -> Steps:
    """Block ``block`` of ``reduce_scatter``: meet, reduce its units of this rank's block of
    every rank's data into ``out`` (vectors where every pointer is aligned and a block is
    whole vectors, then one element at a time), meet again."""
    if (yield from _meet(mem, launch, block, "start", left_out)):
        return
    assert launch.out is not None
    shift = launch.rank * launch.count
    scalars_from = 0
    if all(geometry.aligned(ptr) for ptr in (*launch.data, launch.out)) and \
            launch.count * launch.dtype.itemsize % geometry.VECTOR_BYTES == 0:
        width = geometry.vector_width(launch.dtype.itemsize)
        for lo, hi in geometry.grid_stride(0, launch.count // width, block, launch.blocks,
                                           launch.threads):
            _reduce_turn(mem, launch, lo * width, hi * width, (launch.out,), shift)
            yield None
        scalars_from = launch.count // width * width
    for lo, hi in geometry.grid_stride(scalars_from, launch.count, block, launch.blocks,
                                       launch.threads):
        _reduce_turn(mem, launch, lo, hi, (launch.out,), shift)
        yield None
    yield from _meet(mem, launch, block, "end", left_out)


def all_gather_block(mem: _Memory, launch: Launch, block: int,
                     left_out: frozenset[str] = frozenset()) -> Steps:
    """Block ``block`` of ``all_gather``: meet, copy its units of every rank's bytes to
    ``out + q * stride`` (16 bytes at a time where every pointer and the stride allow, then
    byte by byte), meet again."""
    if (yield from _meet(mem, launch, block, "start", left_out)):
        return
    assert launch.out is not None
    out, stride, nbytes = launch.out, launch.stride, launch.count
    scalars_from, width = 0, geometry.VECTOR_BYTES
    byte = np.dtype(np.uint8)
    if all(geometry.aligned(ptr) for ptr in (*launch.data, out)) and \
            stride % geometry.VECTOR_BYTES == 0:
        scalars_from = nbytes // width * width
    turns = [(lo * width, hi * width) for lo, hi in geometry.grid_stride(
        0, scalars_from // width, block, launch.blocks, launch.threads)]
    turns += list(geometry.grid_stride(scalars_from, nbytes, block, launch.blocks,
                                       launch.threads))
    for lo, hi in turns:
        for q, ptr in enumerate(launch.data):
            mem.elements(out + q * stride, lo, hi, byte)[:] = mem.elements(ptr, lo, hi, byte)
        yield None
    yield from _meet(mem, launch, block, "end", left_out)


_BLOCKS = {"one_shot": one_shot_block, "two_shot": two_shot_block,
           "reduce_scatter": reduce_scatter_block, "all_gather": all_gather_block}


# ----------------------------------------------------------------------------- the device


@dataclass
class _Task:
    """A coroutine on the mirrored device: a rank's stream or one block of a kernel."""

    rank: int
    order: int
    name: str
    steps: Steps
    wait: _Wait | None = None
    done: bool = False


@dataclass
class _Copy:
    """A copy queued on a rank's stream, host to device or device to host."""

    rank: int
    ptr: int
    host: np.ndarray
    to_device: bool


class KernelMirror:
    """Rank streams and kernel blocks on the fake device, run step by step by a schedule.

    Queue work per rank in stream order (``copy_in``, ``launch``, ``copy_out``), then
    ``run()``: a rank's stream starts a kernel's blocks once the work before it is done and
    moves on once every block has finished, as a CUDA stream does. ``schedule`` picks the
    next step among those that can move: ``low_ranks_first`` (rank 0 runs as far as it can
    before anyone else, so a missing wait shows at once), ``high_ranks_first``, or
    ``random`` with ``seed``. ``left_out`` names waits every kernel skips (a test's
    mutation: each must then give a wrong result)."""

    def __init__(self, rt: FakeRuntime, *, schedule: str = "low_ranks_first", seed: int = 0,
                 left_out: Sequence[str] = ()) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r}: one of {', '.join(SCHEDULES)}")
        unknown = set(left_out) - set(WAITS)
        if unknown:
            raise ValueError(f"left_out {sorted(unknown)}: the waits are {', '.join(WAITS)}")
        self.memory = _Memory(rt)
        self.schedule = schedule
        self.random = random.Random(seed)
        self.left_out = frozenset(left_out)
        self._queued: dict[int, list[_Copy | Launch]] = {}
        self._tasks: list[_Task] = []
        self._order = 0
        self.steps = 0  # steps run so far: how much interleaving a run had

    def copy_in(self, rank: int, ptr: int, values: np.ndarray) -> None:
        """Queue ``values`` into device memory at ``ptr`` on ``rank``'s stream."""
        host = np.ascontiguousarray(values)
        self._queued.setdefault(rank, []).append(_Copy(rank, ptr, host, True))

    def copy_out(self, rank: int, ptr: int, count: int, dtype: np.dtype) -> np.ndarray:
        """Queue ``count`` elements at ``ptr`` back to the host on ``rank``'s stream; the
        array returned holds them once ``run()`` has returned."""
        host = np.zeros(count, dtype)
        self._queued.setdefault(rank, []).append(_Copy(rank, ptr, host, False))
        return host

    def launch(self, launch: Launch) -> None:
        """Queue a kernel on ``launch.rank``'s stream."""
        launch.check()
        self._queued.setdefault(launch.rank, []).append(launch)

    def run(self, max_steps: int = 1_000_000) -> None:
        """Run everything queued to its end; ``FakeDeviceFault`` where every coroutine
        left waits on a flag that no one can set any more (a GPU would spin for ever)."""
        queued, self._queued = self._queued, {}
        for rank in sorted(queued):
            self._spawn(rank, f"rank {rank}'s stream", self._stream(rank, queued[rank]))
        while self._tasks:
            ready = [t for t in self._tasks if t.wait is None or t.wait.ready()]
            if not ready:
                waits = "; ".join(t.wait.what for t in self._tasks if t.wait is not None)
                raise FakeDeviceFault(f"device hang: every block left waits on a flag no one "
                                      f"will set ({waits})")
            task = self._pick(ready)
            task.wait = None
            try:
                task.wait = next(task.steps)
            except StopIteration:
                task.done = True
                self._tasks.remove(task)
            self.steps += 1
            if self.steps > max_steps:
                raise FakeDeviceFault(f"the mirror ran {max_steps} steps without finishing")

    def _pick(self, ready: list[_Task]) -> _Task:
        if self.schedule == "random":
            return self.random.choice(ready)
        sign = 1 if self.schedule == "low_ranks_first" else -1
        return min(ready, key=lambda t: (sign * t.rank, t.order))

    def _spawn(self, rank: int, name: str, steps: Steps) -> _Task:
        task = _Task(rank, self._order, name, steps)
        self._order += 1
        self._tasks.append(task)
        return task

    def _stream(self, rank: int, items: list[_Copy | Launch]) -> Steps:
        """A rank's stream: each item once the one before it is done."""
        for item in items:
            if isinstance(item, _Copy):
                device = self.memory.elements(item.ptr, 0, item.host.size, item.host.dtype)
                if item.to_device:
                    device[:] = item.host
                else:
                    item.host[:] = device
                yield None
                continue
            blocks = [self._spawn(rank, f"rank {rank} block {b}",
                                  _BLOCKS[item.algorithm](self.memory, item, b, self.left_out))
                      for b in range(item.blocks)]

            def kernel_done(blocks: list[_Task] = blocks) -> bool:
                return all(block.done for block in blocks)

            yield _Wait(f"rank {rank}'s stream for its {item.algorithm} of op "
                        f"{item.op_number}", kernel_done)


# ----------------------------------------------------------------------------- memory


@dataclass
class MappedRegions:
    """Each rank's region of fake device memory, ``[signal pad | data]`` as the kernels
    expect it, and an output per rank (the one-shot's, the reduce-scatter's, the
    all-gather's). Ranks here are threads of one
    process, so every rank sees a region at the address it was allocated at; the pads start
    at 0 (as the host clears them once, when it maps them) and the data holds
    ``STALE_BYTE``s until an input is copied in.
    ``offset`` moves each data buffer off 16-byte alignment (the one-element path)."""

    rt: FakeRuntime
    world: int
    data_bytes: int
    offset: int = 0
    allocations: list[Allocation] = field(default_factory=list)

    def __post_init__(self) -> None:
        size = geometry.PAD_BYTES + self.offset + self.data_bytes
        for _ in range(2 * self.world):  # regions, then outputs
            allocation = self.rt.malloc(size)
            self.rt._view(allocation.ptr, size, "fresh memory")[:] = STALE_BYTE
            self.allocations.append(allocation)
        for region in self.allocations[:self.world]:
            self.pad_words(region.ptr)[:] = 0

    def pad_words(self, ptr: int) -> np.ndarray:
        """The flags of the pad at ``ptr``, live (what a test looks at)."""
        return _Memory(self.rt).pad(ptr)

    @property
    def pads(self) -> tuple[int, ...]:
        return tuple(a.ptr for a in self.allocations[:self.world])

    @property
    def data(self) -> tuple[int, ...]:
        return tuple(a.ptr + geometry.PAD_BYTES + self.offset
                     for a in self.allocations[:self.world])

    @property
    def outs(self) -> tuple[int, ...]:
        return tuple(a.ptr + geometry.PAD_BYTES + self.offset
                     for a in self.allocations[self.world:])

    def close(self) -> None:
        for allocation in self.allocations:
            self.rt.free(allocation)
        self.allocations.clear()


# ----------------------------------------------------------------------------- the launch


def _sizes(launch: Launch) -> tuple[int, int]:
    """Bytes a launch reads of each rank's data, and writes of its output."""
    block = launch.count * launch.dtype.itemsize
    if launch.algorithm == "reduce_scatter":
        return block * launch.world, block
    if launch.algorithm == "all_gather":
        return block, launch.stride * (launch.world - 1) + block
    return block, block


class _KernelItem(_Item):
    """One rank's kernel on its stream: its blocks, run a step at a time whenever the
    stream runs this item, each held while its pad says a peer has not got there yet. A
    peer's blocks run in that peer's thread or process, when its own stream runs: the
    ranks' kernels make progress together only while every rank's stream is being run,
    as on a GPU only kernels that run at once can meet."""

    __slots__ = ("launch", "memory", "blocks")

    def __init__(self, rt: FakeRuntime, launch: Launch) -> None:
        size, out_size = _sizes(launch)
        mine = [(launch.data[launch.rank], size), (launch.pads[launch.rank],
                                                   geometry.PAD_BYTES)]
        if launch.out is not None:
            mine.append((launch.out, out_size))
        super().__init__(f"{launch.algorithm} kernel of op {launch.op_number} on rank "
                         f"{launch.rank}", tuple(mine))
        self.launch = launch
        self.memory = _Memory(rt)
        self.blocks: list[list[Any]] | None = None  # [steps, wait] per block not done

    def run(self, rt: FakeRuntime, block: bool, deadline: float) -> bool:
        launch = self.launch
        if self.blocks is None:
            self.blocks = [[_BLOCKS[launch.algorithm](self.memory, launch, b), None]
                           for b in range(launch.blocks)]
        while True:
            moved = False
            for entry in list(self.blocks):
                wait = entry[1]
                if wait is not None and not wait.ready():
                    continue
                moved = True
                try:
                    entry[1] = next(entry[0])
                except StopIteration:
                    self.blocks.remove(entry)
            if not self.blocks:
                return True
            if moved:
                continue
            if not block:
                return False
            if time.monotonic() > deadline:
                waits = "; ".join(entry[1].what for entry in self.blocks)
                raise FakeDeviceFault(f"device hang: rank {launch.rank}'s kernel waits on "
                                      f"flags its peers never set ({waits})")
            time.sleep(_POLL_S)


_POLL_S = 0.0002  # how often a kernel whose every block waits looks at its pad again


class StreamLauncher:
    """The fake runtime's launch of the allreduce kernels (``DeviceRuntime
    .kernel_launcher``): a launch is queued on the rank's stream like any kernel (after
    the work before it, before the work after it) and runs as the kernels' numpy mirror
    when the stream runs (``_KernelItem``). Ranks may be threads of one process or
    processes: a peer's region is reached at the address this process maps it at."""

    def __init__(self, rt: FakeRuntime) -> None:
        self.rt = rt

    @classmethod
    def problem(cls, rt: FakeRuntime) -> str:
        """Nothing stops the mirror: ranks may be threads or processes."""
        return ""

    def launch_kernel(self, *, stream: Any, **launch: Any) -> None:
        """Queue the kernel ``Launch(**launch)`` names on ``stream`` (of the thread's
        current device, as CUDA launches kernels)."""
        kernel = Launch(**launch)
        kernel.check()
        what = f"the {kernel.algorithm} kernel of op {kernel.op_number}"
        self.rt._kernel_on(stream, what)
        size, out_size = _sizes(kernel)
        for ptr in kernel.data:
            self.rt._find(ptr, size, what)
        for ptr in kernel.pads:
            self.rt._find(ptr, geometry.PAD_BYTES, what)
        if kernel.out is not None:
            self.rt._find(kernel.out, out_size, what)
        self.rt._queue(stream, _KernelItem(self.rt, kernel))

    def release(self, *, free: bool = True) -> None:
        """Nothing to let go of: the fake compiles nothing and keeps no tables."""
