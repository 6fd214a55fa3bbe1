"""The backends ``ringcomm bench`` runs, in one table (``RUNNERS``): for each, how a rank
joins it and leaves it, how it runs each collective on the benchmark's buffers, whether it
can run here and which calls it sits out, and whose library it belongs to.

    ringcomm        ringcomm's ``Communicator``, called directly
    ringcomm/torch  ``torch.distributed`` on a process group of backend ``ringcomm``: what
                    users run (``dist.all_reduce``, DDP)
    ringcomm/curve  ringcomm's ``Communicator`` with an auth token: tcp links speak CURVE
    ringcomm+checksum  ringcomm's ``Communicator`` with a checksum on every message and
                    board post (``RINGCOMM_CHECKSUM=1``): what integrity costs
    gloo            ``torch.distributed`` on the default group, Gloo; also the benchmark's
                    control channel (barriers, gathering times and error counts)
    nccl            ``torch.distributed`` on an NCCL group, one GPU per rank
    ringcomm+cuda-ipc, ringcomm+staged  (``--device cuda|fake``) ringcomm's ``Communicator``
                    on device arrays (CuPy's, or the fake runtime's), its device engine
                    forced (``RINGCOMM_DEVICE_ENGINE``)
    copy            (``--device``) a device-to-device copy of the same bytes on rank 0: the
                    ceiling, and the one-GPU bound (``device.one_gpu_bound``)
    gloo+cuda       (``--device cuda``) Gloo through torch on the same bytes as CUDA tensors
    ringcomm/torch+cuda  (``--device cuda``) ringcomm's process group on CUDA tensors
    mpi             MPI's collectives, in ranks of their own started by ``mpiexec``, which
                    take their turn when rank 0 gives it to them (``mpi_peer``)
    floor/torch     ``torch.distributed`` on a group whose backend does nothing: torch's own
                    dispatch of a call (``floors``)
    floor/ringcomm  ringcomm's API on a group of one rank per process: its fixed cost with
                    nothing to exchange (``floors``)

Why one table: the sweep (``sweep``) and the DDP benchmark (``ddp_step``) both set backends
up, and the sweep checks, times and tears them down in several places; each of those now
looks the backend up here instead of branching on its name, so a backend is added or
changed in one record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from ringcomm.core.algorithms import KERNEL_COLLECTIVES

from . import adapter, device, floors, mpi_peer
from .buffers import Buffers
from .common import timed

log = logging.getLogger("ringcomm.bench")

TORCH = "ringcomm/torch"  # ringcomm through torch.distributed: what users run
CURVE = "ringcomm/curve"  # ringcomm with an auth token: its tcp links authenticate and encrypt
CHECKSUMMED = "ringcomm+checksum"  # the Communicator with checksums on
FLOOR = "floor"  # the owner of the floors: what a call costs before any library's work

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
    device: str = "cpu"  # ``--device``: "cuda" or "fake" for the device backends


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

    def __init__(self, run: Call, sync: Call, bufs: Any) -> None:
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


class FloorTurns(LocalTurns):
    """A floor's part: timed as any backend's, but it computes nothing, so there is nothing
    to check (its rows count no wrong elements)."""

    def check(self) -> int:
        self.run()
        self.sync()
        return 0


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


def _nothing(handle: Any) -> None:
    """Nothing to wait for: the calls were done when they returned."""


def _leave_nothing(handle: Any) -> None:
    """Leaving a group that the default group's end takes with it."""


def _ready(handle: Any, where: RankContext) -> None:
    """Joined is ready: nothing more to wait for."""


def _runs_anywhere(world: int, device_name: str | None = None) -> str | None:
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
    says why it cannot run ``world`` ranks here (given ``--device``'s runtime name),
    ``unsupported`` why it sits out a collective, dtype and reduction (None: it runs)."""

    name: str
    owner: str
    join: Callable[[RankContext], Any]
    calls: Calls
    leave: Callable[[Any], None] = _leave_nothing
    ready: Callable[[Any, RankContext], None] = _ready
    device: str = "cpu"  # where its buffers live ("runtime": the --device runtime's arrays)
    sync: Callable[[Any], object] = _nothing  # given the handle: waits for what calls left
    needs_device: tuple[str, ...] = ()  # the --device values it runs under (empty: any)
    # its own part in a measurement, where a call is not the collective (the copy)
    own_turns: Callable[[Any, Case, Any], Turns] | None = None
    always: bool = False  # joined by every rank whatever is asked for
    process_group: bool = False  # a torch process group: rows say what torch calls it
    launcher: str | None = None
    on_simulated_hosts: bool = True
    unavailable: Callable[[int, str | None], str | None] = _runs_anywhere
    unsupported: Callable[[str, str, str | None], str | None] = _runs_everything

    @property
    def peer(self) -> bool:
        """Whether it runs in processes of its own (``--peers``)."""
        return self.launcher is not None

    def turns(self, handle: Any, case: Case, bufs: Buffers, algorithm: str | None) -> Turns:
        """Its part in measuring ``case`` on this rank, on ``bufs`` (a peer has its own)."""
        if self.peer:
            return PeerTurns(handle, case)
        if self.own_turns is not None:
            return self.own_turns(handle, case, bufs)
        if self.owner == FLOOR:
            return FloorTurns(self.calls(handle, case.collective, bufs, case.op, algorithm),
                              lambda: self.sync(handle), bufs)
        return LocalTurns(self.calls(handle, case.collective, bufs, case.op, algorithm),
                          lambda: self.sync(handle), bufs)


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


# the store each authenticated communicator was given (its own client: init leaves it open)
_CURVE_STORES: dict[int, Any] = {}
BENCH_TOKEN = "ringcomm bench"  # where RINGCOMM_AUTH_TOKEN is unset: what is measured is CURVE


def _join_curve_communicator(where: RankContext) -> Any:
    """ringcomm's Communicator whose links authenticate and encrypt (CURVE, from
    ``RINGCOMM_AUTH_TOKEN`` or a benchmark token), on the same plain store as ``ringcomm``'s:
    beside it, the cost of a locked door on every link (tcp ones, under
    ``RINGCOMM_TRANSPORT=tcp``; ipc links and shared memory do not encrypt)."""
    import os

    import ringcomm
    from ringcomm.bootstrap.store import StoreClient

    token = os.environ.get("RINGCOMM_AUTH_TOKEN") or BENCH_TOKEN
    store = StoreClient(f"{where.address}:{where.ports[1]}", timeout=where.timeout,
                        auth_token="")
    comm = ringcomm.init(rank=where.rank, world_size=where.world, store=store,
                         timeout=where.timeout, auth_token=token)
    _CURVE_STORES[id(comm)] = store
    return comm


def _close_curve_communicator(comm: Any) -> None:
    comm.close()
    _CURVE_STORES.pop(id(comm)).close()


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


def _floor_unsupported(collective: str, dtype: str, op: str | None) -> str | None:
    """The floors stand under allreduce, the small call DDP, metrics and barriers make (one
    rank's API floor could not run the others: their buffers are sized for the world)."""
    return None if collective == "allreduce" else "a floor is measured under allreduce only"


def _join_torch_floor(where: RankContext) -> Any:
    return floors.join_torch_floor(where.timeout)


def _join_api_floor(where: RankContext) -> Any:
    return floors.join_api_floor(where.timeout)


def _join_ringcomm_group(where: RankContext) -> Any:
    import torch.distributed as dist

    import ringcomm  # noqa: F401 - registers the "ringcomm" backend with torch.distributed

    return dist.new_group(backend="ringcomm", timeout=timedelta(seconds=where.timeout))


def share_gpu(rank: int, world: int) -> None:
    """Before NCCL starts in a rank process: where the ranks outnumber the GPUs, give each
    its own ``NCCL_HOSTID``, so NCCL (which refuses two ranks on one GPU of one host) takes
    them for separate hosts and joins them over sockets: correct, not fast."""
    import os

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and gpus < world:
        os.environ.setdefault("NCCL_HOSTID", f"ringcomm-bench-rank-{rank}")


def _join_nccl_group(where: RankContext) -> Any:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(where.rank % torch.cuda.device_count())
    share_gpu(where.rank, where.world)
    return dist.new_group(backend="nccl")


def _cuda_sync(handle: Any) -> None:
    import torch

    torch.cuda.synchronize()


def _nccl_unavailable(world: int, device_name: str | None = None) -> str | None:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "no CUDA device"
    if not dist.is_nccl_available():
        return "this torch has no NCCL"
    return None  # ranks that share a GPU get an NCCL_HOSTID each (share_gpu)


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


# --------------------------------------------------------------------------- device memory


@dataclass(frozen=True)
class DeviceHandle:
    """A device backend's handle: what its calls run on (a communicator made for device
    memory, or None for the copy), the runtime whose stream is waited for, and the rank."""

    comm: Any
    runtime: Any
    rank: int
    registered: list[Any] = field(default_factory=list)  # the kernel path's, this case's


def _join_device_engine(engine: str) -> Callable[[RankContext], DeviceHandle]:
    """Joining ringcomm for device memory with ``engine`` forced: ``RINGCOMM_DEVICE_ENGINE``
    is set while the communicator is made (the setting is read, and agreed, at init)."""

    def join(where: RankContext) -> DeviceHandle:
        import os

        import ringcomm

        if engine == "nccl" and where.device == "cuda":
            share_gpu(where.rank, where.world)
        saved = os.environ.get("RINGCOMM_DEVICE_ENGINE")
        os.environ["RINGCOMM_DEVICE_ENGINE"] = engine
        try:
            comm = ringcomm.init(rank=where.rank, world_size=where.world,
                                 store=f"{where.address}:{where.ports[1]}",
                                 timeout=where.timeout, device=where.device)
        finally:
            if saved is None:
                del os.environ["RINGCOMM_DEVICE_ENGINE"]
            else:
                os.environ["RINGCOMM_DEVICE_ENGINE"] = saved
        return DeviceHandle(comm, device.runtime_of(where.device), where.rank)

    return join


def _join_kernel_path(where: RankContext) -> DeviceHandle:
    """ringcomm with ``RINGCOMM_DEVICE_ENGINE=cuda-kernel``, refusing to measure anything
    else under the kernel path's name: the group's verdict must say its kernels run at
    once (on the fake runtime, whose MPS is a test's switch, the rank turns it on)."""
    if where.device == "fake":
        device.runtime_of("fake").mps_on = True
    handle = _join_device_engine("cuda-kernel")(where)
    verdict = handle.comm.selector.group.kernel
    if verdict is None or not verdict.ok:
        handle.comm.close()
        raise RuntimeError(f"{device.KERNEL}: this group cannot take the kernel path: "
                           f"{verdict}")
    return handle


def _kernel_unavailable(world: int, device_name: str | None = None) -> str | None:
    """Ranks of a GPU run share GPU 0: their kernels run at once only under MPS."""
    import importlib.util

    if device_name != "cuda" or importlib.util.find_spec("cupy") is None:
        return None  # a fake run: its ranks' kernels run at once (``_join_kernel_path``)
    from ringcomm.core.device.mps import mps_state

    runtime = device.runtime_of("cuda")
    if not runtime.available() or world == 1 or mps_state().on:
        return None
    return ("ranks sharing one GPU without MPS take turns, and a kernel waiting for a peer's "
            "would spin for ever (bench-mps runs it under MPS)")


def _kernel_unsupported(collective: str, dtype: str, op: str | None) -> str | None:
    return None if collective in _KERNEL_COLLECTIVES else \
        "the kernel path runs allreduce, reduce-scatter and all-gather only"


_KERNEL_COLLECTIVES = ("allreduce", *sorted(KERNEL_COLLECTIVES))


def _kernel_calls(handle: DeviceHandle, collective: str, bufs: Any, op: str | None,
                  algorithm: str | None) -> Call:
    """The kernel path's calls on an input registered with the group, as DDP's buckets are
    (its ops then run where the buffers lie, one kernel, no copy): the last case's
    registration ended first. Every rank makes a case's calls at the same point, as
    registering needs."""
    for registration in handle.registered:
        registration.deregister()
    handle.registered.clear()
    if collective in _KERNEL_COLLECTIVES and bufs.inp.nbytes:
        from ringcomm import ArgumentError

        try:
            handle.registered.append(handle.comm.register(bufs.inp))
        except ArgumentError as refused:  # every rank alike: timed as it is, copied
            log.warning("%s: the input stays unregistered: %s", device.KERNEL, refused)
    return _communicator_calls(handle.comm, collective, bufs, op, algorithm)


def _close_device_engine(handle: DeviceHandle) -> None:
    handle.comm.close()


def _device_calls(handle: DeviceHandle, collective: str, bufs: Any, op: str | None,
                  algorithm: str | None) -> Call:
    return _communicator_calls(handle.comm, collective, bufs, op, algorithm)


def _device_sync(handle: DeviceHandle) -> None:
    """Wait for the work the calls left on the caller's current stream (the engine makes it
    wait on every op's done event)."""
    rt = handle.runtime
    rt.synchronize(rt.current_stream())


def _no_calls(handle: Any, collective: str, bufs: Any, op: str | None,
              algorithm: str | None) -> Call:
    raise TypeError("the copy's calls are its turns' (CopyTurns)")


def _join_copy(where: RankContext) -> DeviceHandle:
    return DeviceHandle(None, device.runtime_of(where.device), where.rank)


class CopyTurns(LocalTurns):
    """A device-to-device copy of the larger buffer's bytes into memory of its own, queued on
    the current stream, on rank 0 only (one copy at a time: the GPU's own bandwidth); the
    other ranks' calls do nothing, and a repetition's time is the slowest rank's. Its check
    is the copy's own: the elements of the copy that differ from the source."""

    def __init__(self, handle: DeviceHandle, case: Case, bufs: Any) -> None:
        rt = self.rt = handle.runtime
        self.src = max((bufs.inp, bufs.out), key=lambda a: a.nbytes)
        self.dst = device.zeros(rt, self.src.size, self.src.dtype)
        src, dst, nbytes = device.pointer(self.src), device.pointer(self.dst), self.src.nbytes

        def copy() -> None:
            rt.copy(dst, src, nbytes, rt.current_stream())

        super().__init__(copy if handle.rank == 0 else _nothing_at_all,
                         lambda: _device_sync(handle), bufs)

    def check(self) -> int:
        import torch

        self.bufs.reset()
        self.run()
        self.sync()
        if self.run is _nothing_at_all:
            return 0
        itemsize = self.src.dtype.itemsize
        src, dst = (self.bufs._host(a).view(-1).view(torch.uint8) for a in
                    (self.src, self.dst))
        return int((src != dst).view(-1, itemsize).any(dim=1).sum())


def _nothing_at_all() -> None:
    """A call that does nothing (the copy on ranks other than 0)."""


def _torch_cuda_unavailable(world: int, device_name: str | None = None) -> str | None:
    import torch

    return None if torch.cuda.is_available() else "this torch has no CUDA device"


def _join_gloo_cuda(where: RankContext) -> Any:
    """The default Gloo group, given CUDA tensors (Gloo stages them through the host)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(where.rank % torch.cuda.device_count())
    return dist.group.WORLD


def _join_ringcomm_group_cuda(where: RankContext) -> Any:
    import torch

    torch.cuda.set_device(where.rank % torch.cuda.device_count())
    return _join_ringcomm_group(where)


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


def _mpi_unavailable(world: int, device_name: str | None = None) -> str | None:
    return mpi_peer.unavailable()


# --------------------------------------------------------------------------- the table

# in the order a rank joins them (``joining``): Gloo first, as the default group every other
# process group is made from
RUNNERS: dict[str, Runner] = {r.name: r for r in (
    Runner("gloo", owner="gloo", join=_join_default_group, leave=_leave_default_group,
           calls=_torch_calls, always=True, process_group=True, unsupported=_gloo_unsupported),
    Runner("ringcomm", owner="ringcomm", join=_join_communicator, leave=_close_communicator,
           calls=_communicator_calls, always=True),  # the cost model's questions go to it
    Runner(CURVE, owner="ringcomm", join=_join_curve_communicator,
           leave=_close_curve_communicator, calls=_communicator_calls),
    Runner(TORCH, owner="ringcomm", join=_join_ringcomm_group, calls=_torch_calls,
           process_group=True),
    Runner(CHECKSUMMED, owner="ringcomm", join=_join_checksummed, leave=_close_communicator,
           calls=_communicator_calls),
    Runner("nccl", owner="nccl", join=_join_nccl_group, calls=_torch_calls, device="cuda",
           sync=_cuda_sync, process_group=True, on_simulated_hosts=False,
           unavailable=_nccl_unavailable),
    Runner(device.IPC, owner="ringcomm", join=_join_device_engine("cuda-ipc"),
           leave=_close_device_engine, calls=_device_calls, device=device.RUNTIME_ARRAYS,
           sync=_device_sync, needs_device=("cuda", "fake"), on_simulated_hosts=False),
    Runner(device.KERNEL, owner="ringcomm", join=_join_kernel_path,
           leave=_close_device_engine, calls=_kernel_calls, device=device.RUNTIME_ARRAYS,
           sync=_device_sync, needs_device=("cuda", "fake"), on_simulated_hosts=False,
           unavailable=_kernel_unavailable, unsupported=_kernel_unsupported),
    Runner(device.STAGED, owner="ringcomm", join=_join_device_engine("staged"),
           leave=_close_device_engine, calls=_device_calls, device=device.RUNTIME_ARRAYS,
           sync=_device_sync, needs_device=("cuda", "fake")),
    Runner(device.NCCL_ENGINE, owner="ringcomm", join=_join_device_engine("nccl"),
           leave=_close_device_engine, calls=_device_calls, device=device.RUNTIME_ARRAYS,
           sync=_device_sync, needs_device=("cuda", "fake"), on_simulated_hosts=False),
    Runner(device.COPY, owner="device", join=_join_copy, calls=_no_calls, own_turns=CopyTurns,
           device=device.RUNTIME_ARRAYS, sync=_device_sync, needs_device=("cuda", "fake")),
    Runner(device.GLOO_CUDA, owner="gloo", join=_join_gloo_cuda, calls=_torch_calls,
           device="cuda", sync=_cuda_sync, process_group=True, needs_device=("cuda",),
           unavailable=_torch_cuda_unavailable, unsupported=_gloo_unsupported),
    Runner(device.TORCH_CUDA, owner="ringcomm", join=_join_ringcomm_group_cuda,
           calls=_torch_calls, device="cuda", sync=_cuda_sync, process_group=True,
           needs_device=("cuda",), unavailable=_torch_cuda_unavailable),
    Runner(floors.TORCH_FLOOR, owner=FLOOR, join=_join_torch_floor, calls=_torch_calls,
           process_group=True, unsupported=_floor_unsupported),
    Runner(floors.API_FLOOR, owner=FLOOR, join=_join_api_floor, leave=_close_communicator,
           calls=_communicator_calls, unsupported=_floor_unsupported),
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
