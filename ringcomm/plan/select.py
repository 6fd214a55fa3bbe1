"""One place decides: for a call, which engine runs it, with which algorithm and segment.

Every choice a communicator makes about how to run a collective is made here, from the
call (collective, size, dtype, where its memory lives, a forced algorithm) and the group
(world size, whether its ranks share a board, the settings they agreed, every rank's host
and cores). Every input is the same on every rank, so every rank makes the same choice
without asking the others. The cost model prices (``cost``); this module chooses, and says
why, so the choices print as a table (``choices``; ``ringcomm schedule --choices``) that is
exactly what runs.

The rules, per collective:

- any collective: a forced algorithm (``algorithm=``), one of its own;
- allreduce: a forced algorithm (``algorithm=``, then ``RINGCOMM_ALGO``); else, on one
  host's board, the one-shot post up to ``one_shot_bytes`` and the two-shot above; else
  the cost model's cheapest algorithm over links for this size (``hier`` among them where
  ranks span hosts);
- broadcast: the board up to 64 KiB; else a binomial tree up to 64 KiB and a pipelined chain
  above;
- all-gather: the board up to 64 KiB per rank; else the ring;
- barrier: the board where there is one; else dissemination;
- the others: their one algorithm over links.

Device memory a group's device engines move (``device_memory``) goes to one of them. An
allreduce goes to the kernel path (engine ``cuda-kernel``: one kernel per op over regions
every rank maps, the ranks meeting through flags in device memory) wherever the group's
verdict (``Group.kernel``, ``ringcomm.plan.kernel_path``) says it can run: its kernels run at
once, its runtime can launch them, it made the engine. Between its one-shot (small) and
two-shot (large) the cost model's kernel prices choose (``cost.kernel_allreduce``). Why an
engine of its own and not algorithms of ``cuda-ipc``: an engine here is how bytes move
between ranks, and the kernel path moves them differently (no messages and no schedule
steps: one launch, like NCCL's own call on the ``nccl`` engine), owns other memory (a
region with a signal pad per rank) and may run only where the verdict holds, while
``cuda-ipc`` runs everywhere on one host; so the selector can take it or leave it whole.
Where the verdict fails (ranks sharing a GPU without MPS: the kernels would spin for ever)
the reason goes into the choice of the path taken instead. Otherwise:
``nccl`` where the group asked for it (NCCL's own call for the collectives that have one,
an allreduce priced against the schedules as NCCL groups), else ``cuda-ipc`` where the
group has it (every rank on one host), else ``staged``, with the
algorithm the links would run (never a board schedule); an allreduce's is the cost
model's cheapest under that engine's constants (a tuned profile's, else the defaults),
and the choice's reason says which. Any other device
memory is staged through host memory for the host engines: its kind does that, and the
choice says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..core.algorithms import (
    ALGORITHMS,
    ALLREDUCE_KERNELS,
    BOARD,
    CUDA_KERNEL,
    KERNEL_COLLECTIVES,
    KERNEL_DIRECT,
    LINKS,
    NCCL,
    NCCL_OWN,
    engines_of,
)
from ..core.arrays import HOST
from ..errors import ArgumentError
from ..schedules import ALLREDUCE, ON_BOARD
from ..schedules import board as board_schedules
from ..transport.board import SLOT_BYTES
from . import cost
from .collectives import COLLECTIVES
from .kernel_path import Verdict
from .settings import Settings
from .topology import Topology

SMALL_BROADCAST_BYTES = 64 * 1024  # up to this a binomial tree beats the pipelined chain
# collectives whose choice depends on the group only, never on the call's size
_SIZE_FREE = frozenset({"reduce", "reduce_scatter", "gather", "scatter", "alltoall", "barrier"})


@dataclass(frozen=True)
class Group:
    """What a choice depends on that is the same for every call of one communicator: its
    size, whether its ranks share a board, what they agreed, and where they are."""

    world_size: int
    board: bool
    settings: Settings
    topology: Topology
    segment_bytes: int
    device_engines: tuple[str, ...] = ()  # in order of preference: cuda-ipc, staged
    device_memory: str | None = None  # the memory they move
    # whether an allreduce of device memory may take the kernel path (cuda-kernel), and
    # why (``kernel_path.kernel_path``); None where the group has no device runtime
    kernel: Verdict | None = None


@dataclass(frozen=True)
class Choice:
    """How one call runs: the engine, the algorithm (as the wire names it), the segment
    size in bytes, and why, in words."""

    engine: str
    algorithm: str
    segment_bytes: int
    why: str


class Selector:
    """The choices of one group. Pure: ``choose`` depends on its arguments and ``group``
    only; the cost model's answers are kept per size, since pricing takes tens of
    microseconds and the same sizes come back."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._priced: dict[tuple[int, int], str] = {}
        self._priced_device: dict[tuple[int, int, str], str] = {}
        self._made: dict[tuple[str, int, int, str, str | None, bool], Choice] = {}
        self._fixed: dict[str, Choice] = {}  # the collectives whose choice has no size
        self._one_shot = board_schedules.one_shot_bytes(group.world_size)

    def choose(self, collective: str, nbytes: int, itemsize: int = 4, *,
               memory: str = HOST, forced: str | None = None, native: bool = True) -> Choice:
        """The choice for ``collective`` on a buffer of ``nbytes`` (allgather: one rank's
        input) of ``itemsize``-byte elements in ``memory``, ``forced`` naming one of the
        collective's algorithms (an ``ArgumentError`` where it is unknown or cannot run
        here); ``native``: whether NCCL's own call takes the dtype and the reduction
        (``nccl_takes``; the same on every rank, as they are). Made once
        per call shape (once per collective where its size does not matter): a program
        makes the same few calls over and over."""
        if collective in _SIZE_FREE and memory is HOST and forced is None:
            choice = self._fixed.get(collective)
            if choice is None:
                choice = self._fixed[collective] = self._make(collective, 0, itemsize,
                                                              memory, forced)
            return choice
        key = (collective, nbytes, itemsize, memory, forced, native)
        choice = self._made.get(key)
        if choice is None:
            choice = self._make(collective, nbytes, itemsize, memory, forced, native)
            if len(self._made) >= 1024:  # many shapes: keep the latest
                del self._made[next(iter(self._made))]
            self._made[key] = choice
        return choice

    def _make(self, collective: str, nbytes: int, itemsize: int, memory: str,
              forced: str | None, native: bool = True) -> Choice:
        group = self.group
        if memory == group.device_memory and group.device_engines:
            engine, algorithm, why = self._on_device(collective, nbytes, itemsize, forced,
                                                     native)
            return Choice(engine, algorithm, group.segment_bytes, why)
        engine, algorithm, why = self._rule(collective, nbytes, itemsize, forced)
        if memory != HOST:
            why += f"; {memory} memory staged through the host"
        return Choice(engine, algorithm, group.segment_bytes, why)

    def _on_device(self, collective: str, nbytes: int, itemsize: int,
                   forced: str | None, native: bool = True) -> tuple[str, str, str]:
        """Device memory on the group's preferred device engine (cuda-ipc where the group
        has it, else staged), with what the links would run: the same schedules, never
        the board's."""
        kernel = self.group.kernel
        if collective == "allreduce":
            chosen = self._kernel_allreduce(nbytes, forced)
            if chosen is not None:
                return chosen
        elif collective in KERNEL_COLLECTIVES:
            chosen = self._kernel_direct(collective, forced)
            if chosen is not None:
                return chosen
        engine = self.group.device_engines[0]
        algorithm, why = self._device_algorithm(engine, collective, nbytes, itemsize, forced,
                                                native)
        why = f"{engine} for device memory; {why}"
        if (collective == "allreduce" or collective in KERNEL_COLLECTIVES) and \
                kernel is not None and not kernel.ok:
            why += f"; not the kernel path ({CUDA_KERNEL}): {kernel.why}"
        return engine, algorithm, why

    def _kernel_or_refuse(self, collective: str, forced: str | None) -> Verdict:
        """The group's kernel path verdict for an algorithm of it that the caller forced: an
        ``ArgumentError`` saying why where the group cannot take the path."""
        kernel = self.group.kernel
        if kernel is None or not kernel.ok:
            why = kernel.why if kernel is not None else "the group has no device runtime"
            raise ArgumentError(f"{collective} algorithm {forced!r} runs on the kernel path "
                                f"({CUDA_KERNEL}), which this group cannot take: {why}; "
                                "leave the algorithm unset for the automatic choice")
        return kernel

    def _kernel_direct(self, collective: str,
                       forced: str | None) -> tuple[str, str, str] | None:
        """The kernel path's one kernel for a reduce-scatter or all-gather of device memory
        (nothing to price), where the verdict holds and nothing forces another algorithm;
        forced where it does not hold, an ``ArgumentError`` saying why."""
        kernel = self.group.kernel
        name = forced.lower() if isinstance(forced, str) else forced
        if name == KERNEL_DIRECT:
            kernel = self._kernel_or_refuse(collective, forced)
        if name not in (None, KERNEL_DIRECT) or kernel is None or not kernel.ok:
            return None
        how = "forced by algorithm=" if name else "one kernel"
        return CUDA_KERNEL, KERNEL_DIRECT, f"{CUDA_KERNEL} for device memory ({kernel.why}); {how}"

    def _kernel_allreduce(self, nbytes: int, forced: str | None) -> tuple[str, str, str] | None:
        """The kernel path for an allreduce of device memory, where the group's verdict
        holds and nothing forces another algorithm: its one-shot or two-shot, whichever the
        cost model's kernel prices say is cheaper (``cost.kernel_allreduce``). A forced
        kernel algorithm where the verdict fails is an ``ArgumentError`` saying why."""
        group = self.group
        kernel = group.kernel
        name = forced.lower() if isinstance(forced, str) else forced
        if name in ALLREDUCE_KERNELS:
            kernel = self._kernel_or_refuse("allreduce", forced)
            return CUDA_KERNEL, name, f"{CUDA_KERNEL} for device memory ({kernel.why}); " \
                                      "forced by algorithm="
        if forced is not None or group.settings.algorithm is not None:
            return None
        if kernel is None or not kernel.ok:
            return None
        key = (nbytes, 0, CUDA_KERNEL)
        chosen = self._priced_device.get(key)
        if chosen is None:
            chosen = self._priced_device[key] = min(
                ALLREDUCE_KERNELS, key=lambda a: cost.kernel_allreduce(
                    a, group.world_size, nbytes, group.settings.device_cost(a)))
        tuned = any(a in group.settings.device_params for a in ALLREDUCE_KERNELS)
        return CUDA_KERNEL, chosen, (
            f"{CUDA_KERNEL} for device memory ({kernel.why}); the "
            f"{'one' if chosen == 'kernel-oneshot' else 'two'}-shot kernel: the cost "
            f"model's cheaper with its {'tuned' if tuned else 'default'} kernel constants")

    def _device_algorithm(self, engine: str, collective: str, nbytes: int, itemsize: int,
                          forced: str | None, native: bool = True) -> tuple[str, str]:
        group = self.group
        if engine == NCCL:
            return self._nccl_algorithm(collective, nbytes, itemsize, forced, native)
        if collective != "allreduce":
            _, algorithm, why = self._rule(collective, nbytes, itemsize, forced, board=False)
            return algorithm, why
        if forced is not None:
            name = forced.lower() if isinstance(forced, str) else forced
            if name in ALGORITHMS and engine not in engines_of(name):
                raise ArgumentError(f"algorithm {forced!r} runs on the shared board of host "
                                    f"memory; device memory goes over {engine}: choose one of "
                                    f"{', '.join(ALLREDUCE)}")
            _, algorithm, why = self._allreduce(nbytes, itemsize, forced)
            return algorithm, why
        if group.settings.algorithm is not None:
            return group.settings.algorithm, "forced by RINGCOMM_ALGO"
        key = (nbytes, itemsize, engine)
        chosen = self._priced_device.get(key)
        if chosen is None:
            chosen = self._priced_device[key] = cost.choose(
                "allreduce", group.world_size, nbytes, itemsize,
                segment_bytes=group.segment_bytes, params=group.settings.device_cost(engine),
                share=1.0, hosts=group.topology.hosts, remote=group.settings.remote)
        source = "tuned" if engine in group.settings.device_params else "default"
        return chosen, f"the cost model's cheapest with its {source} constants"

    def _nccl_algorithm(self, collective: str, nbytes: int, itemsize: int,
                        forced: str | None, native: bool = True) -> tuple[str, str]:
        """On the nccl engine: NCCL's own call (``nccl``) for the collectives that have one,
        against ringcomm's schedules as NCCL groups, by the cost model for an allreduce;
        the schedules the links would run for the others, and for dtypes and reductions
        NCCL's own calls do not take (``native`` False)."""
        group = self.group
        if forced is not None and forced.lower() == NCCL:
            if collective not in NCCL_OWN:
                raise ArgumentError(f"NCCL has no call of its own for {collective}; leave "
                                    "the algorithm unset (its schedules run as NCCL groups)")
            if not native:
                raise ArgumentError(f"NCCL's own {collective} does not take this dtype or "
                                    "reduction (it takes int8, uint8, int32, uint32, int64, "
                                    "uint64, float16, float32, float64, bfloat16 and sum, "
                                    "prod, max, min, avg); leave the algorithm unset (its "
                                    "schedules run as NCCL groups)")
            return NCCL, "forced by algorithm="
        if collective == "allreduce":
            schedules = forced is not None or group.settings.algorithm is not None
        else:
            schedules = forced is not None or collective not in NCCL_OWN
        if schedules or not native:  # what the links would run, as NCCL groups
            _, algorithm, why = self._rule(collective, nbytes, itemsize, forced, board=False)
            if not native and not schedules and collective in NCCL_OWN:
                why += "; NCCL's own call does not take this dtype or reduction"
            return algorithm, f"{why}, as NCCL groups"
        if collective != "allreduce":
            return NCCL, "NCCL's own call"
        params = group.settings.device_cost(NCCL)
        key = (nbytes, itemsize, NCCL)
        chosen = self._priced_device.get(key)
        if chosen is None:
            best = cost.choose("allreduce", group.world_size, nbytes, itemsize,
                               segment_bytes=group.segment_bytes, params=params, share=1.0,
                               hosts=group.topology.hosts, remote=group.settings.remote)
            ours = cost.predict("allreduce", best, group.world_size, nbytes, itemsize,
                                segment_bytes=group.segment_bytes, params=params, share=1.0,
                                hosts=group.topology.hosts, remote=group.settings.remote)
            own = cost.nccl_own_allreduce(group.world_size, nbytes, itemsize, params)
            chosen = self._priced_device[key] = NCCL if own <= ours else best
        source = "tuned" if NCCL in group.settings.device_params else "default"
        what = "NCCL's own allreduce" if chosen == NCCL else f"{chosen} as NCCL groups"
        return chosen, f"{what}: the cost model's cheapest with its {source} constants"

    def _rule(self, collective: str, nbytes: int, itemsize: int,
              forced: str | None, *, board: bool | None = None) -> tuple[str, str, str]:
        if board is None:
            board = self.group.board
        if collective == "allreduce":
            return self._allreduce(nbytes, itemsize, forced)
        if forced is not None:
            return self._forced(collective, forced, board)
        small = board_schedules.SMALL_BYTES
        if collective == "broadcast":
            if board and nbytes <= small:
                return BOARD, "board", f"one host's board, up to {_size(small)}"
            if nbytes <= SMALL_BROADCAST_BYTES:
                return LINKS, "binomial", f"a binomial tree up to {_size(SMALL_BROADCAST_BYTES)}"
            return LINKS, "chain", f"a pipelined chain above {_size(SMALL_BROADCAST_BYTES)}"
        if collective == "allgather":
            if board and nbytes <= small:
                return BOARD, "board", f"one host's board, up to {_size(small)} a rank"
            return LINKS, "ring", "the ring" + (
                f" above {_size(small)} a rank" if board else ": no shared board")
        if collective == "barrier":
            if board:
                return BOARD, "board", "one host's board"
            return LINKS, "dissemination", "no shared board"
        algorithm = next(iter(COLLECTIVES[collective].algorithms))
        return LINKS, algorithm, "its one algorithm"

    def _forced(self, collective: str, forced: str, board: bool) -> tuple[str, str, str]:
        """A forced algorithm of a collective other than allreduce: one of its own, and one
        of the board's only where the group has a board."""
        algorithms = COLLECTIVES[collective].algorithms
        name = forced.lower() if isinstance(forced, str) else forced
        if name not in algorithms:
            raise ArgumentError(f"{collective} has no algorithm {forced!r}; use one of "
                                f"{', '.join(algorithms)}, or leave it unset for the "
                                "automatic choice")
        engine = ALGORITHMS[name].engine
        if engine == BOARD and not board:
            raise ArgumentError(f"{collective} algorithm {name!r} needs the shared board, "
                                "which this group does not have; choose another algorithm")
        return engine, name, "forced by algorithm="

    def _allreduce(self, nbytes: int, itemsize: int,
                   forced: str | None) -> tuple[str, str, str]:
        group = self.group
        if forced is not None:
            name = forced.lower() if isinstance(forced, str) else forced
            if name in ALLREDUCE_KERNELS:
                raise ArgumentError(f"allreduce algorithm {forced!r} runs on the kernel path, "
                                    "on device memory only (a device array of the group's "
                                    "runtime); leave the algorithm unset for host memory")
            if name in ON_BOARD:
                self._check_board(name, nbytes)
            elif name not in ALLREDUCE:
                raise ArgumentError(
                    f"allreduce algorithm {forced!r} is unknown; use one of "
                    f"{', '.join((*ALLREDUCE, *ON_BOARD))}, or leave it unset for the "
                    "automatic choice")
            return ALGORITHMS[name].engine, name, "forced by algorithm="
        if group.settings.algorithm is not None:
            return LINKS, group.settings.algorithm, "forced by RINGCOMM_ALGO"
        if group.board:
            if nbytes <= self._one_shot:
                return BOARD, "board", f"one host's board, one-shot up to {_size(self._one_shot)}"
            return BOARD, "twoshot", f"one host's board, two-shot above {_size(self._one_shot)}"
        key = (nbytes, itemsize)
        chosen = self._priced.get(key)
        if chosen is None:
            chosen = self._priced[key] = cost.choose(
                "allreduce", group.world_size, nbytes, itemsize,
                segment_bytes=group.segment_bytes,
                params=group.settings.cost_params(group.world_size),
                share=group.topology.cores_per_rank, hosts=group.topology.hosts,
                remote=group.settings.remote)
        return LINKS, chosen, "the cost model's cheapest over links"

    def _check_board(self, algorithm: str, nbytes: int) -> None:
        if not self.group.board:
            raise ArgumentError(
                f"algorithm {algorithm!r} needs the shared board, which this group does not "
                "have (its ranks span hosts, shared memory is off, or RINGCOMM_BOARD=0 on "
                "some rank); choose another algorithm")
        if algorithm == "board" and nbytes > SLOT_BYTES:
            raise ArgumentError(f"algorithm 'board' takes at most {SLOT_BYTES} B per "
                                f"rank, got {nbytes} B; choose 'twoshot' or another algorithm")


@dataclass(frozen=True)
class Band:
    """Consecutive sizes of one collective that get the same choice: ``low`` (exclusive;
    0 for the first band) to ``high`` (inclusive) bytes, sampled at powers of two."""

    collective: str
    low: int
    high: int
    choice: Choice

    @property
    def sizes(self) -> str:
        if not self.low:
            return f"up to {_size(self.high)}"
        return f"{_size(self.low)} < size <= {_size(self.high)}"


def choices(selector: Selector, collectives: Iterable[str] | None = None,
            sizes: Sequence[int] | None = None, itemsize: int = 4) -> list[Band]:
    """What ``selector`` runs for each collective at each of ``sizes`` (bytes; default every
    power of two from 4 B to 1 GiB), merged into bands of one choice."""
    sizes = sizes or [1 << k for k in range(2, 31)]
    bands: list[Band] = []
    for collective in collectives or COLLECTIVES:
        low = 0
        current: Choice | None = None
        for i, size in enumerate(sizes):
            choice = selector.choose(collective, size, itemsize)
            if current is not None and (choice.engine, choice.algorithm) != \
                    (current.engine, current.algorithm):
                bands.append(Band(collective, low, sizes[i - 1], current))
                low = sizes[i - 1]
            current = choice
        assert current is not None
        bands.append(Band(collective, low, sizes[-1], current))
    return bands


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


__all__ = ["SMALL_BROADCAST_BYTES", "Band", "Choice", "Group", "Selector",
           "choices"]
