"""``ringcomm bench``: nccl-tests-style sweeps of the collectives, several backends interleaved.

    ringcomm bench                                     # every collective, world 2, 8 B..128 MiB
    ringcomm bench --collectives allreduce -n 2 4 -b 8 -e 256M -f 2 --json out.json
    ringcomm bench --backends ringcomm ringcomm/torch gloo --peers mpi   # MPI as a peer
    ringcomm bench --quick                             # under a minute
    ringcomm bench ddp                                 # DDP training step (bench/ddp_step.py)

Why one run and interleaved: on a small, shared machine the speed of everything drifts by
tens of percent from one minute to the next, so backends are only compared when measured
in the same processes, on the same buffers, taking turns. For every world size the command
spawns that many ranks on 127.0.0.1; each joins a Gloo process group (which is also the
benchmark's own control channel: barriers, gathering times and error counts), a ringcomm
communicator, a second process group of backend ``ringcomm`` and an NCCL group when there is
one GPU per rank. ringcomm is timed both ways: ``ringcomm`` calls the ``Communicator``
directly, ``ringcomm/torch`` calls ``torch.distributed`` on the ringcomm process group, which
is what users run (``dist.all_reduce``, DDP). ``--peers mpi`` adds MPI's collectives, run by
ranks of their own under ``mpiexec`` that take their turn in every repetition like one more
backend (``bench/mpi_peer.py`` says how). For every size, repetition
``k`` runs ``--iters`` back-to-back calls of each backend in turn (in a new shuffled order
every repetition); a repetition's time is the slowest rank's, and ``time`` is the median over
repetitions (``min`` the best), per call. Each repetition starts with one untimed call of
the backend itself: ranks leave the Gloo barrier before it up to milliseconds apart, and the
first rank out would otherwise time the others' lateness. A repetition runs at least
``--iters`` calls, and more for a fast backend, enough to last about 20 ms (``iters_for``,
from the pace of a second warm-up round): a small call takes a fraction of a millisecond,
and one late wake-up on a busy core would otherwise decide the figure. ringcomm's automatic
choice and its forced algorithms run the same number of calls (``iters_per_backend``), so
they are compared like for like.

Sizes, counts and bandwidth follow nccl-tests: ``size`` is the larger buffer one rank holds
(allgather: its output, reduce_scatter and alltoall: their input), ``count`` its elements
(rounded down to a multiple of the world size where the buffer is cut in blocks),
``algbw = size / time`` and ``busbw = algbw * factor``, the factor making busbw comparable
with the hardware's bandwidth whatever the collective (``ringcomm.plan.collectives`` holds
the sizes and factors of every collective):

    allreduce 2(n-1)/n    allgather, reduce_scatter, alltoall (n-1)/n    broadcast 1

Every backend's results are checked, on every rank and at every size, once before timing
and once after it, against the expected values of the table of collectives' numpy
reference (``buffers.Reference`` says how a small problem stands for a large one); ``#wrong``
counts the elements that differ (summed over ranks and both checks). ``pred`` is ringcomm's cost
model's time for the same call (``ringcomm tune`` fits it to this machine).

``--hosts HxR`` places the ranks on ``H`` simulated hosts of ``R`` ranks each instead
(network namespaces with hostnames of their own, ``bench/netns.py``; root only), optionally
with every host's link shaped to ``--rate``: ringcomm then sees several hosts, tcp between
them, and ``pred`` is the model's time for that layout with the link constants the ranks
agreed at init (``bench/multihost.py`` says how the ranks are started and heard from).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from ringcomm.plan.collectives import COLLECTIVES as TABLE
from ringcomm.schedules import HOST_AWARE

from . import adapter, mpi_peer, multihost
from .buffers import Buffers, Reference
from .common import (
    RankFailed,
    format_size,
    free_port,
    launch,
    machine_info,
    parse_size,
    timed,
    turn_order,
)

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")
REDUCING = tuple(c for c in COLLECTIVES if TABLE[c].reduces)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
OPS = ("sum", "prod", "min", "max", "avg")


@dataclass(frozen=True)
class Backend:
    """One column of the comparison: ``ringcomm`` (its own choice or one forced
    algorithm), ``ringcomm/torch``, ``gloo`` or ``nccl``."""

    name: str
    library: str
    algorithm: str | None = None


TORCH = "ringcomm/torch"  # ringcomm through torch.distributed: what users run


def parse_backends(spec: list[str]) -> list[Backend]:
    """``ringcomm``, ``ringcomm:ring`` (any allreduce algorithm, the shared board's too),
    ``ringcomm:all`` (the automatic choice and every flat algorithm over links; the
    two-level ``hier`` only where named: on one host it is a reduce and a broadcast),
    ``ringcomm/torch``, ``gloo``, ``nccl``; commas or spaces between them. (MPI runs in
    processes of its own: ``--peers mpi``.)"""
    algorithms = adapter.allreduce_algorithms(board=True)
    out: list[Backend] = []
    for word in (w.strip().lower() for item in spec for w in item.split(",")):
        if not word:
            continue
        if word == "mpi":
            raise ValueError("mpi is not one of --backends: it runs in processes of its own, "
                             "started by mpiexec; ask for it with --peers mpi")
        if word in ("ringcomm", "ringcomm:auto"):
            found = [Backend("ringcomm", "ringcomm")]
        elif word == TORCH:
            found = [Backend(TORCH, TORCH)]
        elif word == "ringcomm:all":
            found = [Backend("ringcomm", "ringcomm")] + [
                Backend(f"ringcomm:{a}", "ringcomm", a) for a in adapter.allreduce_algorithms()
                if a not in HOST_AWARE]
        elif word.startswith("ringcomm:") and word.split(":", 1)[1] in algorithms:
            a = word.split(":", 1)[1]
            found = [Backend(f"ringcomm:{a}", "ringcomm", a)]
        elif word in ("gloo", "nccl"):
            found = [Backend(word, word)]
        else:
            raise ValueError(
                f"unknown backend {word!r}: use ringcomm (its own choice), ringcomm:ALGO with "
                f"ALGO one of {', '.join(algorithms)}, ringcomm:all, {TORCH}, gloo or nccl")
        out += [b for b in found if b not in out]
    if not out:
        raise ValueError("--backends names no backend")
    return out


def size_range(begin: int, end: int, factor: int) -> list[int]:
    """nccl-tests' ``-b -e -f``: begin, begin*f, ... up to end."""
    if begin < 0 or end < begin:
        raise ValueError(f"sizes must satisfy 0 <= begin <= end, got -b {begin} -e {end}")
    if factor < 2 and begin != end:
        raise ValueError(f"-f must be at least 2, got {factor}")
    sizes, size = [], begin
    while size <= end:
        sizes.append(size)
        if size == 0 or begin == end:
            size = size + 1 if size == 0 and begin != end else end + 1
        else:
            size *= factor
    return sizes


@dataclass
class Settings:
    """Everything a rank needs, sent to it when it is spawned."""

    sizes: list[int]
    collectives: list[str]
    backends: list[Backend]
    dtypes: list[str]
    ops: list[str]
    iters: int
    warmup: int
    reps: int
    timeout: float
    ports: tuple[int, int] = (0, 0)
    nccl: bool = False
    notes: list[str] = field(default_factory=list)
    address: str = "127.0.0.1"  # where rank 0 serves the Gloo and ringcomm rendezvous
    hosts: str | None = None  # "HxR": ranks on simulated hosts (``--hosts``); None: this one
    rate: str | None = None  # each simulated host's link shaped to this (tc's words)
    shared_cpus: bool = False  # simulated hosts share every core instead of splitting them
    peers: list[str] = field(default_factory=list)  # "mpi": MPI's ranks take turns too

    def layout(self) -> multihost.Layout | None:
        if self.hosts is None:
            return None
        return multihost.Layout(*multihost.parse_layout(self.hosts), rate=self.rate,
                                shared_cpus=self.shared_cpus)


# --------------------------------------------------------------------------- rank side


def _runner(backend: Backend, collective: str, bufs: Buffers, op: str | None, comm: Any,
            group: Any) -> Any:
    """A no-argument function that runs one call of ``collective`` on ``backend``: through
    ``comm`` for ringcomm, through ``torch.distributed`` on ``group`` for the others (None:
    the default group, Gloo)."""
    import torch.distributed as dist

    x, out = bufs.inp, bufs.out
    if backend.library == "ringcomm":
        return {
            "allreduce": lambda: adapter.allreduce(comm, x, op, backend.algorithm),
            "allgather": lambda: comm.allgather(out, x),
            "reduce_scatter": lambda: comm.reduce_scatter(out, x, op),
            "broadcast": lambda: comm.broadcast(x, root=0),
            "alltoall": lambda: comm.alltoall(out, x),
        }[collective]
    rop = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}.get(op or "sum")
    # torch 2.13 renamed the flat-tensor variants; older versions have only the old names
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    run = {
        "allreduce": lambda: dist.all_reduce(x, op=rop, group=group),
        "allgather": lambda: gather(out, x, group=group),
        "reduce_scatter": lambda: scatter(out, x, op=rop, group=group),
        "broadcast": lambda: dist.broadcast(x, src=0, group=group),
        "alltoall": lambda: dist.all_to_all_single(out, x, group=group),
    }[collective]
    return run


REP_SECONDS = 0.02
MAX_ITERS = 400


def iters_for(seconds_per_call: float, iters: int) -> int:
    """Calls per repetition: enough to last ``REP_SECONDS``, at least ``iters``."""
    if seconds_per_call <= 0:
        return max(iters, MAX_ITERS)
    return max(iters, min(MAX_ITERS, int(REP_SECONDS / seconds_per_call) + 1))


def iters_per_backend(libraries: list[str], paces: list[float], iters: int) -> list[int]:
    """Calls per repetition for each backend, from its warmed-up time per call (``paces``).
    Backends of one library (ringcomm's automatic choice and its forced algorithms) share
    one count, from their median pace: what a repetition costs beyond its calls (the last
    rank to arrive, the final sync) is then spread over the same number of calls, and an
    algorithm is not charged more of it for having been measured slower while warming up."""
    shared = {}
    for lib in set(libraries):
        mine = sorted(p for p, other in zip(paces, libraries, strict=True) if other == lib)
        shared[lib] = iters_for(mine[len(mine) // 2], iters)
    return [shared[lib] for lib in libraries]


class _Local:
    """A backend in these processes: one call, the buffers it works on, and what waits for
    the device (nothing on the CPU)."""

    def __init__(self, run: Any, sync: Any, bufs: Buffers) -> None:
        self.run, self.sync, self.bufs = run, sync, bufs

    def check(self) -> int:
        """One checked call: this rank's wrong elements."""
        self.bufs.reset()
        self.run()
        self.sync()
        return self.bufs.wrong()

    def pace(self, calls: int) -> float:
        """Seconds per call of ``calls`` back-to-back calls (warm-up)."""
        return timed(self.run, calls, self.sync)

    def time(self, iters: int) -> float:
        """One repetition: this rank's seconds per call."""
        import torch.distributed as dist

        dist.barrier()
        self.run()  # lines the ranks up: they leave Gloo's barrier up to milliseconds apart
        self.sync()
        return timed(self.run, iters, self.sync)


class _MpiTurns:
    """MPI's ranks as one more backend (``mpi_peer`` says how they are reached): each step
    is a turn that rank 0 gives them while every rank of the sweep waits in a Gloo barrier.
    Rank 0 returns the slowest MPI rank's time and all their wrong elements, the other ranks
    zero, so the sweep's MAX and SUM over its own ranks come out right."""

    def __init__(self, peer: mpi_peer.MpiPeer | None, collective: str, dtype: str,
                 op: str | None, count: int) -> None:
        self.peer = peer
        self._prepare: list | None = ["prepare", collective, dtype, op, count]

    def _turn(self, combine: Any, *instruction: Any) -> Any:
        import torch.distributed as dist

        value = combine(self.peer.turn(*instruction)) if self.peer is not None else 0
        dist.barrier()
        return value

    def check(self) -> int:
        if self._prepare is not None:  # the first check builds the MPI ranks' buffers
            instruction, self._prepare = self._prepare, None
            return self._turn(sum, *instruction)
        return self._turn(sum, "check")

    def pace(self, calls: int) -> float:
        return self._turn(max, "calls", calls)

    def time(self, iters: int) -> float:
        return self._turn(max, "time", iters)


def _measure(collective: str, nbytes: int, dtype_name: str, op: str | None, rank: int,
             world: int, s: Settings, comm: Any, groups: dict[str, Any],
             mpi: mpi_peer.MpiPeer | None) -> list[dict] | None:
    """Check, warm up, time interleaved and check again every backend at one size.
    ``groups``: the torch process group of each library that runs on one (``nccl``,
    ``ringcomm/torch``); ``mpi``: rank 0's handle on the MPI ranks where they take part."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, dtype_name)
    itemsize = dtype.itemsize
    spec = TABLE[collective]
    # nccl-tests' count: the larger buffer's elements, whole blocks
    count = max(spec.sizes(spec.block(nbytes // itemsize, world), world).values())
    if count == 0:
        return None
    reduce_op = op if spec.reduces else None
    backends = _backends_for(collective, op, s)
    ref = Reference(collective, world, count, dtype, reduce_op)
    cpu = Buffers(collective, rank, world, count, dtype, ref)
    gpu = Buffers(collective, rank, world, count, dtype, ref, "cuda") if any(
        b.library == "nccl" for b in backends) else None
    nothing = lambda: None  # noqa: E731
    parts: list[_Local | _MpiTurns] = []
    group_backend = {}  # what torch itself says each torch-run backend ran on
    for b in backends:
        bufs = gpu if b.library == "nccl" else cpu
        group = groups.get(b.library)
        parts.append(_Local(_runner(b, collective, bufs, op, comm, group),
                            torch.cuda.synchronize if b.library == "nccl" else nothing, bufs))
        if b.library != "ringcomm":
            group_backend[b.name] = str(dist.get_backend(group))
    if "mpi" in s.peers and mpi_peer.unsupported(collective, dtype_name, reduce_op) is None:
        backends = [*backends, Backend("mpi", "mpi")]
        parts.append(_MpiTurns(mpi, collective, dtype_name, reduce_op, count))

    wrong = [p.check() for p in parts]
    for bufs in {id(p.bufs): p.bufs for p in parts if isinstance(p, _Local)}.values():
        bufs.steady(op)
    pace = torch.zeros(len(parts), dtype=torch.float64)
    if s.warmup:
        for p in parts:  # the first calls after the checks run cold
            p.pace(s.warmup)
        for i, p in enumerate(parts):
            pace[i] = p.pace(s.warmup)
    dist.all_reduce(pace, op=dist.ReduceOp.MAX)  # every rank must run the same number of calls
    iters = (iters_per_backend([b.library for b in backends], pace.tolist(), s.iters)
             if s.warmup else [s.iters] * len(parts))
    times = [[0.0] * s.reps for _ in parts]
    for rep in range(s.reps):
        for i in turn_order(len(parts), rep, salt=nbytes):
            times[i][rep] = parts[i].time(iters[i])
    wrong = [w + p.check() for w, p in zip(wrong, parts, strict=True)]

    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    total_wrong = torch.tensor(wrong, dtype=torch.int64)
    dist.all_reduce(total_wrong)
    if rank != 0:
        return []
    size = count * itemsize
    factor = spec.busbw_factor(world)
    rows = []
    for i, b in enumerate(backends):
        reps = slowest[i].tolist()
        median, best = statistics.median(reps), min(reps)
        chosen = None
        predicted = None
        ours = b.library in ("ringcomm", TORCH)  # the torch path makes the same choice
        if ours and len(comm.hosts) > 1:  # the model for this layout
            chosen, predicted = multihost.modelled_on_hosts(collective, b.algorithm, comm,
                                                            size, itemsize)
        elif ours:
            if collective == "allreduce":
                chosen = b.algorithm or adapter.chosen_algorithm(comm, size, itemsize)
            predicted = adapter.predicted_seconds(collective, chosen, world, size, itemsize,
                                                  comm.segment_bytes)
        rows.append({
            "collective": collective, "world_size": world, "backend": b.name,
            "library": b.library, "algorithm": b.algorithm or ("auto" if chosen else None),
            "chosen": chosen, "bytes": size, "count": count, "dtype": dtype_name,
            "op": op if collective in REDUCING else "none",
            "time_us": median * 1e6, "min_time_us": best * 1e6,
            "algbw_GBps": size / median / 1e9, "busbw_GBps": size / median / 1e9 * factor,
            "best_busbw_GBps": size / best / 1e9 * factor,
            "wrong": int(total_wrong[i]),
            "predicted_us": None if predicted is None else predicted * 1e6,
            "rep_times_us": [t * 1e6 for t in reps],
            "iters": iters[i], "reps": s.reps, "warmup": s.warmup,
            "process_group": group_backend.get(b.name),
        })
    return rows


def _backends_for(collective: str, op: str | None, s: Settings) -> list[Backend]:
    """Forced algorithms exist only for allreduce; elsewhere ringcomm is one backend.
    Gloo has no average; NCCL runs only with a GPU per rank."""
    out: list[Backend] = []
    for b in s.backends:
        if b.library == "ringcomm" and collective != "allreduce":
            b = Backend("ringcomm", "ringcomm")
        if b.library == "gloo" and op == "avg" and collective in REDUCING:
            continue
        if b.library == "nccl" and not s.nccl:
            continue
        if b not in out:
            out.append(b)
    return out


def rank_main(rank: int, world: int, report: Any, s: Settings) -> None:
    """One rank of a sweep: join every backend, then measure every collective and size.
    With ``--peers mpi`` rank 0 starts the MPI ranks first, so they start up while the
    sweep's ranks do."""
    import torch
    import torch.distributed as dist

    import ringcomm

    torch.set_num_threads(1)
    mpi = mpi_peer.MpiPeer(world, s.timeout) if rank == 0 and "mpi" in s.peers else None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://{s.address}:{s.ports[0]}",
                                rank=rank, world_size=world,
                                timeout=timedelta(seconds=s.timeout))
        comm = ringcomm.init(rank=rank, world_size=world, store=f"{s.address}:{s.ports[1]}",
                             timeout=s.timeout)
        if rank == 0 and len(comm.hosts) > 1:
            report("layout", multihost.layout_facts(comm))
        groups: dict[str, Any] = {}
        if any(b.library == TORCH for b in s.backends):  # beside Gloo, the control group
            groups[TORCH] = dist.new_group(backend="ringcomm",
                                           timeout=timedelta(seconds=s.timeout))
        if s.nccl:
            torch.cuda.set_device(rank % torch.cuda.device_count())
            groups["nccl"] = dist.new_group(backend="nccl")
        if mpi is not None:
            mpi.connect()
            report("peer", {"mpi": {"library": mpi.library, "command": mpi.command}})
        try:
            for collective in s.collectives:
                for dtype in s.dtypes:
                    for op in (s.ops if collective in REDUCING else [None]):
                        for nbytes in s.sizes:
                            rows = _measure(collective, nbytes, dtype, op, rank, world, s,
                                            comm, groups, mpi)
                            if rank == 0:
                                report("rows", rows or [])
                                report("progress", (collective, dtype, op, nbytes))
        finally:
            comm.close()
            dist.destroy_process_group()
    finally:
        if mpi is not None:
            mpi.close()


# --------------------------------------------------------------------------- parent side


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringcomm bench", description=__doc__.splitlines()[0].replace("``", ""),
        epilog="Sizes take K, M, G suffixes (powers of 1024). `ringcomm bench ddp --help` for "
        "the DDP training benchmark.", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-b", "--minbytes", type=_size_arg, default=None,
                   help="first size (default 8; --quick: 1K)")
    p.add_argument("-e", "--maxbytes", type=_size_arg, default=None,
                   help="last size (default 128M; --quick: 1M)")
    p.add_argument("-f", "--stepfactor", type=int, default=None,
                   help="multiply the size by this each step (default 8; --quick: 32)")
    p.add_argument("-n", "--world-sizes", type=int, nargs="+", default=None,
                   help="ranks to spawn, one sweep per value (default 2)")
    p.add_argument("--iters", type=int, default=None,
                   help="back-to-back calls per repetition at least (default 5; --quick: 3); "
                   "fast backends run more, to fill about 20 ms")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls per backend and size (default 2; --quick: 1)")
    p.add_argument("--reps", type=int, default=None,
                   help="interleaved repetitions; time is their median (default 5; --quick: 3)")
    p.add_argument("--dtype", nargs="+", default=["float32"],
                   help=f"element types, spaces or commas between ({', '.join(DTYPES)})")
    p.add_argument("--op", nargs="+", default=["sum"],
                   help=f"reductions for allreduce and reduce_scatter ({', '.join(OPS)})")
    p.add_argument("--collectives", nargs="+", default=list(COLLECTIVES),
                   help=f"which collectives ({', '.join(COLLECTIVES)}; default all)")
    p.add_argument("--backends", nargs="+", default=["ringcomm:all", TORCH, "gloo", "nccl"],
                   help="ringcomm (the Communicator, automatic choice), ringcomm:ALGO (forced; "
                   f"ALGO one of {', '.join(adapter.allreduce_algorithms(board=True))}; "
                   "board and twoshot on one host only), ringcomm:all, "
                   f"{TORCH} (torch.distributed on a process group of backend ringcomm), gloo, "
                   f"nccl (default: ringcomm:all {TORCH} gloo nccl; nccl only with one GPU per "
                   "rank)")
    p.add_argument("--peers", nargs="+", default=[], choices=["mpi"], metavar="PEER",
                   help="mpi: also run MPI's collectives (mpi4py, MPICH: pip install "
                   "'ringcomm[mpi]') in processes of their own started by mpiexec, taking "
                   "turns with the backends in every repetition; reported as backend mpi")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in under a minute: 1K, 32K, 1M at world 2, few repetitions")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds without progress before the run is declared hung")
    p.add_argument("--hosts", default=None, metavar="HxR",
                   help="run on H simulated hosts of R ranks each (network namespaces, root "
                   "only; bench/netns.py), e.g. 2x2; replaces -n")
    p.add_argument("--rate", default=None,
                   help="with --hosts: shape every host's link to this tc rate (tbf, both "
                   "ends), e.g. 1gbit, 200mbit; default unshaped")
    p.add_argument("--shared-cpus", action="store_true",
                   help="with --hosts: let every host's ranks run on every core (default: "
                   "the cores are split between the hosts, as separate machines would have)")
    return p


def _words(values: list[str]) -> list[str]:
    return [w.strip().lower() for v in values for w in v.split(",") if w.strip()]


def settings_from(args: argparse.Namespace) -> tuple[Settings, list[int]]:
    """Check the options and fill the defaults (``--quick`` has its own)."""
    quick = args.quick
    pick = lambda value, full, short: value if value is not None else (short if quick else full)  # noqa: E731
    begin = pick(args.minbytes, 8, 1 << 10)
    end = pick(args.maxbytes, 128 << 20, 1 << 20)
    factor = pick(args.stepfactor, 8, 32)
    worlds = pick(args.world_sizes, [2], [2])
    sizes = size_range(begin, end, factor)
    if any(w < 1 for w in worlds):
        raise ValueError(f"world sizes must be at least 1, got {worlds}")
    collectives = _words(args.collectives)
    for c in collectives:
        if c not in COLLECTIVES:
            raise ValueError(f"unknown collective {c!r}; choose from {', '.join(COLLECTIVES)}")
    dtypes = _words(args.dtype)
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"unsupported dtype {d!r}; choose from {', '.join(DTYPES)}")
    ops = _words(args.op)
    for o in ops:
        if o not in OPS:
            raise ValueError(f"unknown op {o!r}; choose from {', '.join(OPS)}")
        if o == "avg" and any(not d.startswith(("float", "bfloat")) for d in dtypes):
            raise ValueError("--op avg needs floating-point dtypes only")
    s = Settings(
        sizes=sizes, collectives=collectives, backends=parse_backends(args.backends),
        dtypes=dtypes, ops=ops, iters=pick(args.iters, 5, 3), warmup=pick(args.warmup, 2, 1),
        reps=pick(args.reps, 5, 3), timeout=args.timeout,
        peers=list(dict.fromkeys(getattr(args, "peers", None) or [])))
    if s.iters < 1 or s.reps < 1 or s.warmup < 0:
        raise ValueError("--iters and --reps must be at least 1 and --warmup not negative")
    hosts, rate = getattr(args, "hosts", None), getattr(args, "rate", None)
    shared = bool(getattr(args, "shared_cpus", False))
    if hosts is None:
        if rate is not None or shared:
            raise ValueError("--rate and --shared-cpus shape simulated hosts: give --hosts too")
        return s, worlds
    if args.world_sizes is not None:
        raise ValueError("--hosts HxR sets the world size (H x R ranks): leave out -n")
    if s.peers:
        raise ValueError("--peers runs on this host only: leave out --hosts")
    layout = multihost.Layout(*multihost.parse_layout(hosts))
    s.hosts, s.shared_cpus = str(layout), shared
    s.rate = None if rate is None else multihost.parse_rate(rate)
    return s, [layout.world]


def _nccl_usable(world: int) -> str | None:
    """None if NCCL can run ``world`` ranks here, else why not."""
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


def run(s: Settings, worlds: list[int], console: Any = None,
        facts: dict | None = None) -> tuple[list[dict], list[str]]:
    """Every world size in turn, with a progress bar; the rows and any notes. With
    ``s.hosts``, the one world on simulated hosts; ``facts`` (if given) then receives the
    layout and link constants the communicator agreed."""
    import contextlib
    from dataclasses import replace

    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    console = console or Console(stderr=True)
    rows: list[dict] = []
    notes: list[str] = []
    per_world = sum(len(s.dtypes) * (len(s.ops) if c in REDUCING else 1) * len(s.sizes)
                    for c in s.collectives)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("starting ranks", total=per_world * len(worlds))
        for world in worlds:
            nccl = any(b.library == "nccl" for b in s.backends)
            if nccl and s.hosts is not None:
                notes.append("nccl skipped: not run on simulated hosts (--hosts)")
                progress.console.print(f"[yellow]{notes[-1]}[/]")
                nccl = False
            if nccl and (why := _nccl_usable(world)):
                notes.append(f"nccl skipped at world size {world}: {why}")
                progress.console.print(f"[yellow]{notes[-1]}[/]")
                nccl = False
            layout = s.layout()
            if layout is None:
                ws = replace(s, ports=(free_port(), free_port()), nccl=nccl)
                reports = contextlib.closing(launch(world, rank_main, (ws,), s.timeout))
                progress.update(task, description=f"world {world}: starting ranks")
            else:
                ws = replace(s, ports=multihost.STORE_PORTS, nccl=nccl)
                reports = contextlib.closing(multihost.launch(
                    layout, rank_main, lambda addr, ws=ws: (replace(ws, address=addr),), s.timeout))
                progress.update(task, description=f"{layout} hosts: starting ranks")
            with reports as events:
                _follow_reports(events, rows, facts, progress, task, world, s)
    for collective in s.collectives if "mpi" in s.peers else []:
        spec = TABLE[collective]
        for dtype in s.dtypes:
            for op in s.ops if spec.reduces else [None]:
                if why := mpi_peer.unsupported(collective, dtype, op):
                    notes.append(f"mpi skipped for {collective} {dtype} {op}: {why}")
    skipped = sorted({(r, c) for r in worlds for c in s.collectives} -
                     {(r["world_size"], r["collective"]) for r in rows})
    for world, c in skipped:
        notes.append(f"{c} at world size {world}: every size was too small to split")
    return rows, notes


def _follow_reports(events: Any, rows: list[dict], facts: dict | None, progress: Any,
                    task: Any, world: int, s: Settings) -> None:
    """Take the ranks' reports: rows, progress, and (on several hosts) the layout."""
    where = f"world {world}" if s.hosts is None else f"{s.hosts} hosts"
    for kind, _rank, payload in events:
        if kind == "rows":
            if s.hosts is not None:
                payload = [{**r, "hosts": s.hosts, "rate": s.rate} for r in payload]
            rows += payload
        elif kind == "layout":
            if facts is not None:
                facts.update(payload)
        elif kind == "peer":
            if facts is not None:
                facts.setdefault("peers", {}).update(payload)
        elif kind == "progress":
            collective, dtype, op, nbytes = payload
            progress.update(task, advance=1, description=(
                f"{where}: {collective} {dtype} {op or ''} "
                f"{format_size(nbytes)}".replace("  ", " ")))


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ringcomm bench``; returns the exit status."""
    from rich.console import Console

    from . import report

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        s, worlds = settings_from(args)
    except ValueError as err:
        parser.error(str(err))
    out = Console(width=None if sys.stdout.isatty() else 180)
    err_console = Console(stderr=True)
    if os.environ.get("RINGCOMM_ALGO"):
        err_console.print(f"[yellow]RINGCOMM_ALGO={os.environ['RINGCOMM_ALGO']} is set: the "
                          "'ringcomm' rows use it instead of the automatic choice[/]")
    facts: dict = {}
    if "mpi" in s.peers and (why := mpi_peer.unavailable()) is not None:
        print(f"ringcomm bench: {why}", file=sys.stderr)  # unwrapped: the command stays whole
        return 2
    if s.hosts is not None:
        from . import netns

        if (why := netns.available()) is not None:
            err_console.print(f"ringcomm bench: --hosts needs simulated hosts, which cannot be "
                              f"made here: {why}", style="red", markup=False, highlight=False)
            return 2
    started, load_before = time.time(), _loadavg()
    try:
        rows, notes = run(s, worlds, err_console, facts)
    except RankFailed as err:
        err_console.print(f"ringcomm bench: {err}", style="red", markup=False,
                          highlight=False)
        return 1
    peers_meta = facts.pop("peers", None)
    hosts_meta = None
    if s.hosts is not None:
        hosts_meta = {"layout": s.hosts, "rate": s.rate,
                      "rate_bits": multihost.rate_bits(s.rate) if s.rate else None,
                      "shared_cpus": s.shared_cpus, **facts}
        remote = facts.get("remote") or {}
        out.print(f"ranks on {s.hosts.replace('x', ' simulated hosts x ')} ranks, "
                  f"links {s.rate or 'unshaped'}; remote link agreed at init: "
                  f"alpha {remote.get('alpha', 0) * 1e6:.0f} us, "
                  f"{1 / max(remote.get('beta', 0), 1e-30) / 1e9:.3f} GB/s; hosts "
                  f"{facts.get('hosts')}, cores per rank {facts.get('cores_per_rank')}",
                  markup=False, highlight=False)
    report.print_tables(rows, out)
    targets = report.target_summary(rows)
    report.print_targets(targets, out)
    hosts_summary = multihost.summary(rows) if s.hosts is not None else None
    if hosts_summary:
        multihost.print_summary(hosts_summary, out)
    for note in notes:
        out.print(f"note: {note}")
    wrong = sum(r["wrong"] for r in rows)
    if args.json:
        report.write_json(args.json, rows, {
            "benchmark": "ringcomm bench",
            "command": shlex.join(["ringcomm", "bench", *argv]),
            "argv": argv,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - started, 1),
            "machine": {**machine_info(), "loadavg_before": load_before},
            "settings": {**asdict(s), "world_sizes": worlds,
                         "backends": [b.name for b in s.backends]},
            "env": {k: v for k, v in os.environ.items() if k.startswith("RINGCOMM_")},
            "notes": notes,
            "targets": targets,
            **({"peers": peers_meta} if peers_meta else {}),
            **({"hosts": hosts_meta, "hosts_summary": hosts_summary} if hosts_meta else {}),
        })
        out.print(f"wrote {args.json}")
    if args.plot_dir:
        for path in report.plot(rows, args.plot_dir):
            out.print(f"wrote {path}")
    if wrong:
        err_console.print(f"[red]{wrong} wrong elements: see the #wrong column[/]")
        return 1
    return 0
