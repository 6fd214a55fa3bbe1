"""The backends ``ringcomm bench`` runs, in one table (``RUNNERS``): for each, how a rank
joins it and leaves it, how it runs each collective on the benchmark's buffers, whether it
can run here and which calls it sits out, and whose library it belongs to.

    ringcomm        ringcomm's ``Communicator``, called directly
    ringcomm/torch  ``torch.distributed`` on a process group of backend ``ringcomm``: what
                    users run (``dist.all_reduce``, DDP)
    ringcomm+checksum  ringcomm's ``Communicator`` with a checksum on every message and
                    board post (``RINGCOMM_CHECKSUM=1``): what integrity costs
    gloo            ``torch.distributed`` on the default group, Gloo; also the benchmark's
                    control channel (barriers, gathering times and error counts)
    nccl            ``torch.distributed`` on an NCCL group, one GPU per rank
    mpi             MPI's collectives, in ranks of their own started by ``mpiexec``, which
                    take their turn when rank 0 gives it to them (``mpi_peer``)

Why one table: the sweep (``sweep``) and the DDP benchmark (``ddp_step``) both set backends
up, and the sweep checks, times and tears them down in several places; each of those now
looks the backend up here instead of branching on its name, so a backend is added or
changed in one record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

from . import adapter, mpi_peer
from .buffers import Buffers
from .common import timed

TORCH = "ringcomm/torch"  # ringcomm through torch.distributed: what users run
CHECKSUMMED = "ringcomm+checksum"  # the Communicator with checksums on

Call = Callable[[], object]  # one call of a collective, on buffers fixed beforehand
# (handle, collective, buffers, reduction or None, forced algorithm or None) -> one call
Calls = Callable[[Any, str, Buffers, str | None, str | None], Call]


@dataclass(frozen=True)
class RankContext:
    """What joining a backend takes: this rank's place, where rank 0 serves the rendezvous
    and the channel to the parent (``report(kind, payload)``)."""

    rank: int
    world: int
    address: str
    ports: tuple[int, int]  # Gloo's store, the Communicator's store
    timeout: float
    report: Callable[[str, Any], None]


@dataclass(frozen=True)
class Case:
    """One measurement: the collective, its dtype's name, its reduction (None where nothing
    is reduced) and the nccl-tests count of its larger buffer."""

    collective: str
    dtype: str
    op: str | None
    count: int


class Turns(Protocol):
    """One backend's part in one measurement; every rank of the sweep calls each method at
    the same point."""

    def check(self) -> int:
        """One checked call: this rank's wrong elements."""
        ...

    def pace(self, calls: int) -> float:
        """Seconds per call of ``calls`` back-to-back calls (warm-up)."""
        ...

    def time(self, iters: int) -> float:
        """One repetition: this rank's seconds per call."""
        ...


class LocalTurns:
    """A backend in the sweep's own processes: one call, the buffers it works on, and what
    waits for the device (nothing on the CPU)."""

    def __init__(self, run: Call, sync: Call, bufs: Buffers) -> None:
        self.run, self.sync, self.bufs = run, sync, bufs

    def check(self) -> int:
        self.bufs.reset()
        self.run()
        self.sync()
        return self.bufs.wrong()

    def pace(self, calls: int) -> float:
        return timed(self.run, calls, self.sync)

    def time(self, iters: int) -> float:
        import torch.distributed as dist

        dist.barrier()
        self.run()  # lines the ranks up: they leave Gloo's barrier up to milliseconds apart
        self.sync()
        return timed(self.run, iters, self.sync)


class PeerTurns:
    """A peer's ranks as one more backend (``mpi_peer`` says how they are reached): each step
    is a turn that rank 0 gives them while every rank of the sweep waits in a Gloo barrier.
    Rank 0 returns the slowest peer rank's time and all their wrong elements, the other ranks
    zero, so the sweep's MAX and SUM over its own ranks come out right."""

    def __init__(self, peer: mpi_peer.MpiPeer | None, case: Case) -> None:
        self.peer = peer
        self._prepare: list[Any] | None = ["prepare", case.collective, case.dtype, case.op,
                                           case.count]

    def _turn(self, combine: Callable[[list[Any]], Any], *instruction: Any) -> Any:
        import torch.distributed as dist

        value = combine(self.peer.turn(*instruction)) if self.peer is not None else 0
        dist.barrier()
        return value

    def check(self) -> int:
        if self._prepare is not None:  # the first check builds the peer ranks' buffers
            instruction, self._prepare = self._prepare, None
            return int(self._turn(sum, *instruction))
        return int(self._turn(sum, "check"))

    def pace(self, calls: int) -> float:
        return float(self._turn(max, "calls", calls))

    def time(self, iters: int) -> float:
        return float(self._turn(max, "time", iters))


def _nothing() -> None:
    return None


def _leave_nothing(handle: Any) -> None:
    """Leaving a group that the default group's end takes with it."""


def _ready(handle: Any, where: RankContext) -> None:
    """Joined is ready: nothing more to wait for."""


def _runs_anywhere(world: int) -> str | None:
    return None


def _runs_everything(collective: str, dtype: str, op: str | None) -> str | None:
    return None


@dataclass(frozen=True)
class Runner:
    """One backend: its record in ``RUNNERS``.

    ``name`` is the word ``--backends`` (or ``--peers``) takes and the rows' ``library``;
    ``owner`` the library whose collectives run (ringcomm's on both of its paths, so the
    cost model prices both). ``join`` returns the handle every other function takes (a
    communicator, a process group, the peer's handle on rank 0); ``ready`` runs once every
    backend has joined, ``leave`` when the rank is done. ``calls`` gives one call of a
    collective; a peer's (``launcher``: what starts its processes) run in those processes,
    which ``mpi_peer`` serves, and the sweep gives the peer turns instead. ``unavailable``
    says why it cannot run ``world`` ranks here, ``unsupported`` why it sits out a
    collective, dtype and reduction (None: it runs)."""

    name: str
    owner: str
    join: Callable[[RankContext], Any]
    calls: Calls
    leave: Callable[[Any], None] = _leave_nothing
    ready: Callable[[Any, RankContext], None] = _ready
    device: str = "cpu"  # where its buffers live
    sync: Call = _nothing  # waits for what its calls left running
    always: bool = False  # joined by every rank whatever is asked for
    process_group: bool = False  # a torch process group: rows say what torch calls it
    launcher: str | None = None
    on_simulated_hosts: bool = True
    unavailable: Callable[[int], str | None] = _runs_anywhere
    unsupported: Callable[[str, str, str | None], str | None] = _runs_everything

    @property
    def peer(self) -> bool:
        """Whether it runs in processes of its own (``--peers``)."""
        return self.launcher is not None

    def turns(self, handle: Any, case: Case, bufs: Buffers, algorithm: str | None) -> Turns:
        """Its part in measuring ``case`` on this rank, on ``bufs`` (a peer has its own)."""
        if self.peer:
            return PeerTurns(handle, case)
        return LocalTurns(self.calls(handle, case.collective, bufs, case.op, algorithm),
                          self.sync, bufs)


# --------------------------------------------------------------------------- ringcomm


def _join_communicator(where: RankContext) -> Any:
    import ringcomm

    return ringcomm.init(rank=where.rank, world_size=where.world,
                         store=f"{where.address}:{where.ports[1]}", timeout=where.timeout)


def _join_checksummed(where: RankContext) -> Any:
    import ringcomm.faults

    with ringcomm.faults.inject(None, checksum=True):
        return _join_communicator(where)


def _close_communicator(comm: Any) -> None:
    comm.close()


def _communicator_calls(comm: Any, collective: str, bufs: Buffers, op: str | None,
                        algorithm: str | None) -> Call:
    x, out = bufs.inp, bufs.out
    return {
        "allreduce": lambda: adapter.allreduce(comm, x, op or "sum", algorithm),
        "allgather": lambda: comm.allgather(out, x),
        "reduce_scatter": lambda: comm.reduce_scatter(out, x, op),
        "broadcast": lambda: comm.broadcast(x, root=0),
        "alltoall": lambda: comm.alltoall(out, x),
    }[collective]


# --------------------------------------------------------------------------- torch.distributed


def _join_default_group(where: RankContext) -> Any:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{where.address}:{where.ports[0]}",
                            rank=where.rank, world_size=where.world,
                            timeout=timedelta(seconds=where.timeout))
    return dist.group.WORLD


def _leave_default_group(group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def _join_ringcomm_group(where: RankContext) -> Any:
    import torch.distributed as dist

    import ringcomm  # noqa: F401 - registers the "ringcomm" backend with torch.distributed

    return dist.new_group(backend="ringcomm", timeout=timedelta(seconds=where.timeout))


def _join_nccl_group(where: RankContext) -> Any:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(where.rank % torch.cuda.device_count())
    return dist.new_group(backend="nccl")


def _cuda_sync() -> None:
    import torch

    torch.cuda.synchronize()


def _nccl_unavailable(world: int) -> str | None:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    gpus = torch.cuda.device_count()
    if gpus < world:
        return f"{gpus} GPU(s) for {world} ranks (NCCL needs one GPU per rank)"
    return None


def _gloo_unsupported(collective: str, dtype: str, op: str | None) -> str | None:
    return "Gloo has no average" if op == "avg" else None


def _torch_calls(group: Any, collective: str, bufs: Buffers, op: str | None,
                 algorithm: str | None) -> Call:
    """Through ``torch.distributed`` on ``group``; the backend picks its own algorithm."""
    import torch.distributed as dist

    x, out = bufs.inp, bufs.out
    rop = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}.get(op or "sum")
    # torch 2.13 renamed the flat-tensor variants; older versions have only the old names
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "allreduce": lambda: dist.all_reduce(x, op=rop, group=group),
        "allgather": lambda: gather(out, x, group=group),
        "reduce_scatter": lambda: scatter(out, x, op=rop, group=group),
        "broadcast": lambda: dist.broadcast(x, src=0, group=group),
        "alltoall": lambda: dist.all_to_all_single(out, x, group=group),
    }[collective]


# --------------------------------------------------------------------------- MPI


def _start_mpi(where: RankContext) -> mpi_peer.MpiPeer | None:
    """Rank 0 starts the MPI ranks (``mpiexec`` returns at once); the other ranks hold none."""
    return mpi_peer.MpiPeer(where.world, where.timeout) if where.rank == 0 else None


def _connect_mpi(peer: mpi_peer.MpiPeer | None, where: RankContext) -> None:
    if peer is not None:
        peer.connect()
        where.report("peer", {"mpi": {"library": peer.library, "command": peer.command}})


def _stop_mpi(peer: mpi_peer.MpiPeer | None) -> None:
    if peer is not None:
        peer.close()


def _mpi_unavailable(world: int) -> str | None:
    return mpi_peer.unavailable()


# --------------------------------------------------------------------------- the table

# in the order a rank joins them (``joining``): Gloo first, as the default group every other
# process group is made from
RUNNERS: dict[str, Runner] = {r.name: r for r in (
    Runner("gloo", owner="gloo", join=_join_default_group, leave=_leave_default_group,
           calls=_torch_calls, always=True, process_group=True, unsupported=_gloo_unsupported),
    Runner("ringcomm", owner="ringcomm", join=_join_communicator, leave=_close_communicator,
           calls=_communicator_calls, always=True),  # the cost model's questions go to it
    Runner(TORCH, owner="ringcomm", join=_join_ringcomm_group, calls=_torch_calls,
           process_group=True),
    Runner(CHECKSUMMED, owner="ringcomm", join=_join_checksummed, leave=_close_communicator,
           calls=_communicator_calls),
    Runner("nccl", owner="nccl", join=_join_nccl_group, calls=_torch_calls, device="cuda",
           sync=_cuda_sync, process_group=True, on_simulated_hosts=False,
           unavailable=_nccl_unavailable),
    Runner("mpi", owner="mpi", join=_start_mpi, ready=_connect_mpi, leave=_stop_mpi,
           calls=mpi_peer.calls, launcher="mpiexec", unavailable=_mpi_unavailable,
           unsupported=mpi_peer.unsupported),
)}


def joining(names: Iterable[str]) -> list[Runner]:
    """The runners a rank joins to run ``names`` (and those every rank joins), in the order
    it joins them: peers first, so their processes start up while the rank joins the rest,
    then the table's order."""
    wanted = set(names)
    runners = [r for r in RUNNERS.values() if r.always or r.name in wanted]
    return [r for r in runners if r.peer] + [r for r in runners if not r.peer]
