"""The kernel path's engine (``cuda-kernel``): an allreduce, reduce-scatter or all-gather of
device memory as one kernel per op over regions every rank of the group maps, the ranks
meeting through flags in those regions' signal pads (``ringcomm/engines/kernels/
allreduce.cu``).

One owner of its memory and launches (``KernelChannel``), made once per communicator at
set-up, where the group's verdict allows it (``ringcomm.plan.kernel_path``;
``ringcomm.runtime.devices.open_lanes``): each rank allocates its region (``[signal pad |
data]``, the pad cleared once and never again: its flags count ops), exports it once and
publishes its handle through the group's device exchange; every rank opens every peer's
once (a peer in its own process by pointer: CUDA IPC is between processes) and closes them
at close, before the owners free them (``peer_memory.close_in_order``).

An op: its kernel is compiled first where the runtime compiles on first use (while no peer
waits); the ranks swap the op's header over the group's transport (ranks that called
different ops get a ``DesyncError`` before any kernel starts, where the kernels themselves
would spin or reduce garbage); then, on the lane's stream in the caller's stream order,
the caller's input is copied into this rank's region (in pieces of the region's size, each
piece one launch with the next op number, the same on every rank since every rank runs the
same ops in the same order) and the kernel the selector chose is launched: the one-shot,
the reduce-scatter and the all-gather write straight into the caller's output (this rank's
own memory, which no peer reads), the two-shot into every rank's region, copied back from
this rank's. No byte of the op passes through the host. A rank whose own part fails after
the headers were swapped aborts its channel too, so its peers' kernels are not left
waiting for it. The host then watches the op to its
end, polling an event and the links (``device.watch``, as for NCCL): the kernels have no
timeout of their own, so only the host can end a wait for a peer that is lost or late. At
the deadline, or when a peer's failure arrives, it sets its pad's abort word (its blocks
stop waiting, the kernel ends), names the peers whose flags never came (read from its pad)
and raises; the channel is not used again.

Where it runs: on the fake runtime the launch is an item on the rank's stream that plays
the kernel in numpy (``ringcomm.testing.fake_kernels.StreamLauncher``), for ranks that are
threads or processes. On CuPy it is ``cupy.RawModule``'s (``kernels.cupy_launch``), not yet
run on a GPU, so taken only where ``RINGCOMM_DEVICE_ENGINE=cuda-kernel`` asks for it
(``runtime.devices.launch_problem``).

Registered memory (``registered``): where every rank's buffer of an op lies in memory its
rank registered (each says so in its header), the two-shot, the reduce-scatter and the
all-gather run on the callers' arrays where they lie, one launch whatever the size, with no
copy through the regions.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.algorithms import (
    ALLREDUCE_KERNELS,
    CUDA_KERNEL,
    KERNEL_COLLECTIVES,
    KERNEL_DIRECT,
)
from ..core.arrays import Buffer, DeviceBuffer
from ..core.device import kernel_geometry as geometry
from ..core.device.runtime import Allocation, DeviceRuntime, Stream
from ..core.dtypes import ReduceOp
from ..errors import CommAborted
from ..schedules.schedule import Schedule
from ..transport.base import Transport
from .base import Engine
from .context import OpContext
from .device import (
    DeviceLane,
    hear_headers,
    held,
    on_device,
    stage_in,
    stage_out,
    tell_headers,
    watch,
)
from .device_channel import Exchange
from .kernels import cupy_launch  # noqa: F401 - registers CuPy's launch of the kernels
from .peer_memory import AFTER_FAILURE_S, EXPORTS, LEFT_FOR_EXIT, close_in_order
from .registered import Registry

log = logging.getLogger("ringcomm")

#: data bytes of each rank's region: an op larger than this runs as several launches
REGION_BYTES = 1 << 20
#: the least a region holds: a 16-byte vector of each of the most ranks (a reduce-scatter's
#: piece holds every rank's block)
MIN_REGION_BYTES = geometry.MAX_RANKS * geometry.VECTOR_BYTES
_REGIONS_KEY = "kernel-regions"
_CLOSED_KEY = "kernel-regions/closed"
_THREADS = geometry.MAX_THREADS


class KernelChannel:
    """This rank's region, its view of every peer's, and the launcher (module docstring).
    Collective: every rank of the group makes it at set-up."""

    name = CUDA_KERNEL

    def __init__(self, runtime: DeviceRuntime, exchange: Exchange, rank: int, world: int,
                 deadline: float, region_bytes: int | None = None,
                 close_wait_s: float = 60.0) -> None:
        region_bytes = REGION_BYTES if region_bytes is None else region_bytes
        if region_bytes < MIN_REGION_BYTES or region_bytes % geometry.VECTOR_BYTES:
            raise ValueError(f"region_bytes {region_bytes}: a multiple of "
                             f"{geometry.VECTOR_BYTES}, at least {MIN_REGION_BYTES}")
        self.runtime = runtime
        self.exchange = exchange
        self.rank, self.world = rank, world
        self.capacity = region_bytes
        self.close_wait_s = close_wait_s
        self.op_number = 0  # launches so far: the next one's number is one more
        self._pieces: list[tuple[int, int]] = []  # the op's launches: (op number, blocks)
        self._held: list[Allocation] = []
        self._exported: list[bytes] = []
        self._opened: list[int] = []  # pointers open_memory returned, closed at close
        self._pids: dict[int, int] = {}  # the peers that read this rank's handle
        self._closed = False
        self.ended = ""  # why the channel cannot be used any more ("aborted: ...")
        self._side: Stream | None = None  # for the host's look at its pad during an op
        self.launcher: Any = None
        self.registry: Registry | None = None
        self.in_place = 0  # ops that ran on registered memory where it lies
        try:
            self.region = self._malloc(geometry.PAD_BYTES + region_bytes)
            self._side = stream = runtime.new_stream()
            runtime.from_host(self.region.ptr, np.zeros(geometry.PAD_WORDS, np.uint32), stream)
            runtime.synchronize(stream)
            self.pads = self._map_peers(deadline)
            self.data = tuple(pad + geometry.PAD_BYTES for pad in self.pads)
            self.registry = Registry(runtime, exchange, rank, world, self._pids,
                                     runtime.current_device())
            self.launcher = runtime.kernel_launcher()
        except BaseException:
            self._give_back()
            raise

    def _malloc(self, nbytes: int) -> Allocation:
        allocation = self.runtime.malloc(nbytes)
        self._held.append(allocation)
        return allocation

    def _map_peers(self, deadline: float) -> tuple[int, ...]:
        """Every rank's region as this process reaches it: its own, a peer's of this process
        by the pointer it exported, another process's opened from its handle."""
        runtime = self.runtime
        handle = runtime.export_memory(self.region)
        EXPORTS.add(handle, self.region.ptr)
        self._exported.append(handle)
        sms = runtime.multiprocessors(runtime.current_device())
        self.exchange.publish(_REGIONS_KEY, json.dumps(
            {"pid": os.getpid(), "region": handle.hex(), "sms": sms}).encode())
        regions = []
        self.multiprocessors = sms  # the least of every rank's: every grid is the same
        for peer in range(self.world):
            if peer == self.rank:
                regions.append(self.region.ptr)
                continue
            record = json.loads(self.exchange.read(_REGIONS_KEY, peer, deadline))
            self.multiprocessors = min(self.multiprocessors, int(record["sms"]))
            pid = self._pids[peer] = int(record["pid"])
            theirs = bytes.fromhex(record["region"])
            if pid == os.getpid():
                regions.append(int(EXPORTS.get(theirs)))
            else:
                regions.append(self.runtime.open_memory(theirs))
                self._opened.append(regions[-1])
        return tuple(regions)

    def _launch(self, stream: Stream, kernel: str, count: int, dtype: np.dtype,
                op: ReduceOp | None, out: int | None, stride: int = 0,
                data: tuple[int, ...] | None = None) -> None:
        """One launch with the next op number (the same on every rank: every rank runs the
        same ops in the same order) and the grid every rank computes alike, over the ranks'
        regions or ``data`` (registered memory)."""
        self.op_number += 1
        blocks = geometry.grid_blocks(kernel, count, dtype.itemsize, self.world, _THREADS,
                                      self.multiprocessors)
        self._pieces.append((self.op_number, blocks))
        self.launcher.launch_kernel(
            stream=stream, algorithm=kernel, rank=self.rank,
            data=self.data if data is None else data, pads=self.pads,
            count=count, dtype=dtype, op=op, op_number=self.op_number, blocks=blocks,
            threads=_THREADS, out=out, stride=stride)

    def prepare(self, kernel: str, dtype: np.dtype, op: ReduceOp | None) -> None:
        """Start an op: forget the last op's launches (``waiting_on`` reads this op's), and
        do what a launch of ``kernel`` needs before any rank's kernel waits for this one's
        (a runtime's first compile of it): the engine calls it before the op's headers are
        swapped, so no peer spins meanwhile."""
        self._pieces = []
        prepare = getattr(self.launcher, "prepare", None)
        if prepare is not None:
            prepare(kernel, dtype, op)

    def allreduce(self, algorithm: str, ptr: int, count: int, dtype: np.dtype, op: ReduceOp,
                  stream: Stream) -> None:
        """Queue on ``stream``: ``count`` elements at ``ptr`` reduced over the group in
        place, piece by piece: each piece copied into this rank's region, then one launch of
        ``algorithm``: the one-shot writes the result straight to ``ptr`` (this rank's own
        memory, which no peer reads), the two-shot into every rank's region, copied back
        from this rank's. A piece's copy into the region comes after the previous launch on
        the stream, and that kernel ended only once every rank's blocks had met at its end:
        no peer reads the region any more."""
        runtime, size = self.runtime, dtype.itemsize
        mine = self.data[self.rank]
        one_shot = algorithm == "kernel-oneshot"
        for first in range(0, count, self.capacity // size):
            n = min(self.capacity // size, count - first)
            at = ptr + first * size
            runtime.copy(mine, at, n * size, stream)
            self._launch(stream, "one_shot" if one_shot else "two_shot", n, dtype, op,
                         at if one_shot else None)
            if not one_shot:
                runtime.copy(at, mine, n * size, stream)

    def launch_where_they_lie(self, kernel: str, data: tuple[int, ...], count: int,
                              dtype: np.dtype, op: ReduceOp | None, out: int | None,
                              stream: Stream, stride: int = 0) -> None:
        """Queue on ``stream`` one launch of ``kernel`` over every rank's registered memory
        where it lies (``data``, as this process reaches it), whatever the size: the
        two-shot in place, or the reduce-scatter or all-gather into ``out``."""
        self.in_place += 1
        self._launch(stream, kernel, count, dtype, op, out, stride, data=data)

    def reduce_scatter(self, src: int, dst: int, count: int, dtype: np.dtype, op: ReduceOp,
                       stream: Stream) -> None:
        """Queue on ``stream``: block r (``count`` elements) of ``src``'s ``world`` blocks
        reduced over the group into ``dst`` on rank r, piece by piece: each piece of every
        block copied into this rank's region (block q's at q * piece), one launch writing
        this rank's piece of the result straight to ``dst``."""
        runtime, size = self.runtime, dtype.itemsize
        mine = self.data[self.rank]
        most = self.capacity // (self.world * size)  # at least 1: MIN_REGION_BYTES
        width = geometry.vector_width(size)
        per = most // width * width or most  # whole vectors: every block starts aligned
        for first in range(0, count, per):
            n = min(per, count - first)
            for q in range(self.world):
                runtime.copy(mine + q * n * size, src + (q * count + first) * size, n * size,
                             stream)
            self._launch(stream, "reduce_scatter", n, dtype, op, dst + first * size)

    def all_gather(self, src: int, dst: int, nbytes: int, stream: Stream) -> None:
        """Queue on ``stream``: every rank's ``nbytes`` at ``src`` into ``dst`` in rank
        order, piece by piece: each piece of this rank's bytes copied into its region, one
        launch copying every rank's piece straight to its place in ``dst``."""
        mine = self.data[self.rank]
        for first in range(0, nbytes, self.capacity):
            n = min(self.capacity, nbytes - first)
            self.runtime.copy(mine, src + first, n, stream)
            self._launch(stream, "all_gather", n, np.dtype(np.uint8), None, dst + first,
                         stride=nbytes)

    def abort(self, why: str) -> None:
        """Give up on the op in flight and on the channel: set this rank's abort word, so
        every block of its kernel that waits for a peer stops waiting and the kernel ends
        (without its result: the op raises), then refuse every later op (the ranks' op
        numbers no longer agree). A copy on a stream of its own, which runs beside the
        kernel (another process's under MPS, or another GPU's, could not stop it)."""
        if self.ended:
            return
        self.ended = f"aborted: {why}"
        if self._side is None or not self._held:
            return
        word = self.region.ptr + geometry.ABORT_WORD * geometry.FLAG_BYTES
        self.runtime.from_host(word, np.ones(1, np.uint32), self._side)
        self.runtime.synchronize(self._side)

    def waiting_on(self, peers: list[int]) -> list[int]:
        """The peers whose flags for the last op have not reached this rank's pad, read from
        the device (what a timed-out op names): those whose kernel has not started, else
        those that have not ended; ``peers`` where the pad cannot be read."""
        if self._side is None or not self._held:
            return peers
        flags = np.zeros(geometry.ABORT_WORD, np.uint32)
        try:
            self.runtime.to_host(flags, self.region.ptr, self._side)
            self.runtime.synchronize(self._side)
        except Exception:  # noqa: BLE001 - the device is in trouble: name every peer
            return peers
        for number, blocks in self._pieces:  # the first launch not every peer finished
            for phase in geometry.PHASES:  # first those whose kernel never started
                behind = [peer for peer in peers
                          if not all(geometry.reached(int(flags[geometry.pad_slot(
                              phase, block, peer)]), number % (1 << 32))
                              for block in range(blocks))]
                if behind:
                    return behind
        return peers

    def close(self, *, failed: bool = False) -> None:
        """Importers close, then owners free: close the peers' regions this rank opened, say
        so, wait (bounded) until every peer that opened this rank's has said the same, then
        free. A peer still running that never says so keeps the memory to the process's
        exit (freeing what it maps is undefined on a GPU)."""
        if self._closed:
            return
        self._closed = True
        registered = self.registry.close_all() if self.registry is not None else []
        self._close_opened()
        wait_s = min(self.close_wait_s, AFTER_FAILURE_S) if failed else self.close_wait_s
        safe = not self._pids or close_in_order(self.exchange, _CLOSED_KEY, self.rank,
                                                self._pids, wait_s, "kernel region")
        if self.registry is not None:
            self.registry.let_go(registered, safe)
        if not safe:
            self._leave_for_exit()
            return
        self._give_back()

    def abandon(self) -> None:
        """After a failure whose device work may never end: end the kernel waiting (the
        abort word), free and close nothing (a free would wait for device work), keep it to
        the process's exit, let the launcher go."""
        if self._closed:
            return
        self._closed = True
        try:
            self.abort("the group closed after a failure")
        except Exception as err:  # noqa: BLE001 - abandoning must not raise
            log.warning("rank %d could not set its kernel path's abort word: %s", self.rank,
                        err)
        if self.registry is not None:
            self.registry.abandon()
        self._leave_for_exit()

    def _close_opened(self) -> None:
        opened, self._opened = self._opened, []
        for ptr in opened:
            self.runtime.close_memory(ptr)

    def _leave_for_exit(self) -> None:
        EXPORTS.drop(self._exported)
        LEFT_FOR_EXIT.append((self._held, self._opened))
        self._exported, self._held, self._opened = [], [], []
        self._release_launcher(free=False)

    def _give_back(self) -> None:
        """Close what is open, free what this rank allocated (the end of close, or what a
        failed set-up made)."""
        try:
            self._close_opened()
            EXPORTS.drop(self._exported)  # first: a later channel may get the same handles
            self._exported = []
            held, self._held = self._held, []
            for allocation in held:
                self.runtime.free(allocation)
        finally:
            self._release_launcher()

    def _release_launcher(self, *, free: bool = True) -> None:
        if self.launcher is not None:
            self.launcher.release(free=free)
            self.launcher = None

    def describe(self) -> str:
        registered = 0 if self.registry is None else self.registry.live
        return (f"{self.name}: one kernel per allreduce, reduce-scatter or all-gather (per "
                f"piece of {self.capacity} B) over {self.world} mapped regions, "
                f"{self.op_number} launches so far; {registered} arrays registered, "
                f"{self.in_place} ops where they lie")


#: the kernels that run on registered memory where it lies (``registered``), and the
#: buffer of each that the peers read (its place is what the ranks agree on)
_READS = {"two_shot": "data", "reduce_scatter": "input", "all_gather": "input"}
#: what each rank adds to the op's header: its registration and offset, or (-1, 0)
_NOT_REGISTERED = np.array((-1, 0), np.int64)
_NOTE_BYTES = _NOT_REGISTERED.nbytes

#: the kernel each op launches, by allreduce algorithm or other collective
_KERNEL_OF = {"kernel-oneshot": "one_shot", "kernel-twoshot": "two_shot",
              "reduce_scatter": "reduce_scatter", "allgather": "all_gather"}


class KernelEngine(Engine):
    """Allreduces, reduce-scatters and all-gathers of device memory on the kernel path
    (module docstring): the schedule it is handed has no steps, only the algorithm
    (``kernel-oneshot``, ``kernel-twoshot``; ``kernel-direct``)."""

    name = CUDA_KERNEL

    def __init__(self, lane: DeviceLane, transport: Transport) -> None:
        assert isinstance(lane.channel, KernelChannel)
        self.lane = lane
        self.channel = lane.channel
        self.runtime = lane.runtime
        self.transport = transport
        self.moves = frozenset({lane.runtime.memory})
        self.rank = transport.rank
        self.world_size = transport.world_size
        self._peers = [q for q in range(self.world_size) if q != self.rank]

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        collective, algorithm = schedule.collective, schedule.algorithm
        if not ((collective == "allreduce" and algorithm in ALLREDUCE_KERNELS) or (
                collective in KERNEL_COLLECTIVES and algorithm == KERNEL_DIRECT)):
            raise ValueError(f"the {self.name} engine runs {', '.join(ALLREDUCE_KERNELS)} "
                             f"allreduces and {KERNEL_DIRECT} "
                             f"{' and '.join(sorted(KERNEL_COLLECTIVES))}, not {algorithm} "
                             f"{collective}")
        channel = self.channel
        if channel.ended:
            raise CommAborted(f"the {self.name} engine cannot be used: it was "
                              f"{channel.ended}; create a new communicator", rank=self.rank,
                              op=ctx.name)
        kernel = _KERNEL_OF[algorithm if collective == "allreduce" else collective]
        with on_device(self.runtime, self.lane.device):
            channel.prepare(kernel, ctx.dtype, None if kernel == "all_gather" else ctx.reduce)
        spot = self._registered(kernel, buffers)
        tell_headers(self.transport, self._peers, ctx,
                     _NOT_REGISTERED if spot is None else np.array(spot, np.int64))
        notes = hear_headers(self.transport, self._peers, ctx, _NOTE_BYTES)
        try:
            data = None if spot is None else self._where_they_lie(kernel, spot, notes, buffers)
            self._launched(collective, algorithm, buffers, ctx, data)
        except BaseException as err:  # peers' kernels may wait for this rank's: end them
            channel.abort(f"{type(err).__name__} on rank {self.rank} during {ctx.name}")
            raise

    def _launch_where_they_lie(self, collective: str, data: tuple[int, ...],
                               buffers: Mapping[str, Buffer], pointers: Mapping[str, int],
                               ctx: OpContext) -> None:
        """The op's one launch over the ranks' registered memory (``data``)."""
        stream = self.lane.stream
        if collective == "allreduce":
            self.channel.launch_where_they_lie("two_shot", data, buffers["data"].count,
                                               ctx.dtype, ctx.reduce, None, stream)
        elif collective == "reduce_scatter":
            self.channel.launch_where_they_lie("reduce_scatter", data,
                                               buffers["output"].count, ctx.dtype,
                                               ctx.reduce, pointers["output"], stream)
        else:  # bytes, whatever the dtype
            nbytes = buffers["input"].nbytes
            self.channel.launch_where_they_lie("all_gather", data, nbytes,
                                               np.dtype(np.uint8), None, pointers["output"],
                                               stream, stride=nbytes)

    def _registered(self, kernel: str, buffers: Mapping[str, Buffer]) -> tuple[int, int] | None:
        """Where the buffer the peers read lies in this rank's registered memory (the
        registration and the offset in it), for a kernel that can run there: the two-shot
        on its data, the reduce-scatter and all-gather on their input, whose output (this
        rank's, never read by a peer) must not overlap it. None: the op copies through the
        region."""
        registry = self.channel.registry
        if kernel not in _READS or registry is None or not registry.live:
            return None
        read = buffers[_READS[kernel]]
        if not (isinstance(read, DeviceBuffer) and read.memory == self.runtime.memory
                and read.device == self.lane.device):
            return None
        out = buffers.get("output")
        if isinstance(out, DeviceBuffer) and (out.pointer < read.pointer + read.nbytes
                                              and read.pointer < out.pointer + out.nbytes):
            return None
        return registry.find(read.pointer, read.nbytes)

    def _where_they_lie(self, kernel: str, spot: tuple[int, int], notes: list[bytes],
                        buffers: Mapping[str, Buffer]) -> tuple[int, ...] | None:
        """Every rank's buffer as this process reaches it, where every rank's header said
        it lies in a registration (agreed: each rank runs in place only if all do); else
        None."""
        registry = self.channel.registry
        assert registry is not None
        said = dict(zip(self._peers,
                        np.frombuffer(b"".join(notes), np.int64).reshape(-1, 2).tolist(),
                        strict=True))
        said[self.rank] = list(spot)
        if any(index < 0 for index, _ in said.values()):
            return None
        nbytes = buffers[_READS[kernel]].nbytes
        return tuple(registry.view(said[q][0], q, said[q][1], nbytes)
                     for q in range(self.world_size))

    def _launched(self, collective: str, algorithm: str, buffers: Mapping[str, Buffer],
                  ctx: OpContext, data: tuple[int, ...] | None) -> None:
        """The op's device work queued (on every rank's registered memory where it lies,
        ``data``, else through the regions), watched to its end, and handed back to the
        caller's streams."""
        channel = self.channel
        with held(self.lane) as (device, lifted):
            pointers = stage_in(self.lane, buffers, self.name, device, lifted)
            stream = self.lane.stream
            if data is not None:
                self._launch_where_they_lie(collective, data, buffers, pointers, ctx)
                written = "data" if collective == "allreduce" else "output"
            elif collective == "allreduce":
                assert ctx.reduce is not None
                channel.allreduce(algorithm, pointers["data"], buffers["data"].count,
                                  ctx.dtype, ctx.reduce, stream)
                written = "data"
            elif collective == "reduce_scatter":
                assert ctx.reduce is not None
                channel.reduce_scatter(pointers["input"], pointers["output"],
                                       buffers["output"].count, ctx.dtype, ctx.reduce, stream)
                written = "output"
            else:
                channel.all_gather(pointers["input"], pointers["output"],
                                   buffers["input"].nbytes, stream)
                written = "output"
            if self._peers:  # a kernel that waits on peers: watched to its end or deadline
                done = self.runtime.new_event()
                self.runtime.record(done, self.lane.stream)
                watch(self.runtime, self.transport, [(self._peers, done)], self._peers, ctx,
                      engine=self.name, abort=channel.abort, waiting_on=channel.waiting_on)
            stage_out(self.lane, device, lifted, {written})

    def describe(self) -> str:
        return f"{self.channel.describe()} on {self.runtime.name} ({self.runtime.memory})"
