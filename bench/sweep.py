"""``ringcomm bench``: nccl-tests-style sweeps of the collectives, several backends interleaved.

    ringcomm bench                                     # every collective, world 2, 8 B..128 MiB
    ringcomm bench --collectives allreduce -n 2 4 -b 8 -e 256M -f 2 --json out.json
    ringcomm bench --backends ringcomm ringcomm/torch gloo --peers mpi   # MPI as a peer
    ringcomm bench --quick                             # a short smoke run
    ringcomm bench ddp                                 # DDP training step (bench/ddp_step.py)
    ringcomm bench --device cuda --collectives allreduce   # device memory (bench/device.py)

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
import contextlib
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ringcomm.plan.collectives import COLLECTIVES as TABLE
from ringcomm.schedules import HOST_AWARE

from . import adapter, device, floors, multihost
from .backends import (
    CHECKSUMMED,
    RUNNERS,
    TORCH,
    Case,
    DeviceHandle,
    RankContext,
    Runner,
    Turns,
    joining,
)
from .buffers import Buffers, Reference
from .common import (
    RankFailed,
    format_size,
    free_port,
    launch,
    machine_info,
    parse_size,
    turn_order,
)

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall")
REDUCING = tuple(c for c in COLLECTIVES if TABLE[c].reduces)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
OPS = ("sum", "prod", "min", "max", "avg")


@dataclass(frozen=True)
class Backend:
    """One column of the comparison: ``ringcomm`` (its own choice or one forced
    algorithm), ``ringcomm/torch``, ``gloo``, ``nccl`` or a peer's ``mpi``; ``library`` is
    the name of the runner it runs on (``backends.RUNNERS``)."""

    name: str
    library: str
    algorithm: str | None = None


def parse_backends(spec: list[str]) -> list[Backend]:
    """``ringcomm``, ``ringcomm:ring`` (any allreduce algorithm, the shared board's too),
    ``ringcomm:all`` (the automatic choice and every flat algorithm over links; the
    two-level ``hier`` only where named: on one host it is a reduce and a broadcast),
    ``ringcomm/torch``, ``ringcomm+checksum`` (checksums on), ``gloo``, ``nccl``; commas or
    spaces between them. (MPI runs in
    processes of its own: ``--peers mpi``.)"""
    algorithms = adapter.allreduce_algorithms(board=True)
    out: list[Backend] = []
    for word in (w.strip().lower() for item in spec for w in item.split(",")):
        if not word:
            continue
        runner = RUNNERS.get(word)
        if runner is not None and runner.launcher is not None:
            raise ValueError(f"{word} is not one of --backends: it runs in processes of its "
                             f"own, started by {runner.launcher}; ask for it with --peers {word}")
        if word in ("ringcomm", "ringcomm:auto"):
            found = [Backend("ringcomm", "ringcomm")]
        elif word == "ringcomm:all":
            found = [Backend("ringcomm", "ringcomm")] + [
                Backend(f"ringcomm:{a}", "ringcomm", a) for a in adapter.allreduce_algorithms()
                if a not in HOST_AWARE]
        elif word.startswith("ringcomm:") and word.split(":", 1)[1] in algorithms:
            a = word.split(":", 1)[1]
            found = [Backend(f"ringcomm:{a}", "ringcomm", a)]
        elif runner is not None:
            found = [Backend(word, word)]
        elif word.startswith(f"{device.NCCL_ENGINE}:") and \
                word.split(":", 1)[1] in (*adapter.allreduce_algorithms(), "nccl"):
            # an allreduce algorithm on the nccl engine: ringcomm's schedule as NCCL groups,
            # or NCCL's own call (``nccl``); the other collectives get the engine's choice
            found = [Backend(word, device.NCCL_ENGINE, word.split(":", 1)[1])]
        else:
            raise ValueError(
                f"unknown backend {word!r}: use ringcomm (its own choice), ringcomm:ALGO with "
                f"ALGO one of {', '.join(algorithms)}, ringcomm:all, {TORCH}, "
                f"ringcomm/curve, {CHECKSUMMED}, gloo, nccl, or on device memory "
                f"{device.IPC}, {device.STAGED}, {device.NCCL_ENGINE}[:ALGO|:nccl]")
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
    nccl: bool = False  # NCCL takes part at this world size (set with ``backends`` per world)
    notes: list[str] = field(default_factory=list)
    address: str = "127.0.0.1"  # where rank 0 serves the Gloo and ringcomm rendezvous
    hosts: str | None = None  # "HxR": ranks on simulated hosts (``--hosts``); None: this one
    rate: str | None = None  # each simulated host's link shaped to this (tc's words)
    shared_cpus: bool = False  # simulated hosts share every core instead of splitting them
    peers: list[str] = field(default_factory=list)  # "mpi": MPI's ranks take turns too
    device: str | None = None  # "cuda" | "fake": the device backends' memory (``device``)

    def layout(self) -> multihost.Layout | None:
        if self.hosts is None:
            return None
        return multihost.Layout(*multihost.parse_layout(self.hosts), rate=self.rate,
                                shared_cpus=self.shared_cpus)


# --------------------------------------------------------------------------- rank side


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


def row_choice(b: Backend, handle: Any, comm: Any, collective: str, world: int, size: int,
               itemsize: int) -> tuple[str | None, float | None]:
    """What a row's ``algo`` column says ran, and the cost model's time for it: asked of the
    communicator that ran it, about the memory it ran on (a device engine's own group, a
    torch group on CUDA tensors about device memory; ``comm``, the host group every rank
    joins, for the host backends of ringcomm); nothing for the other libraries."""
    runner = RUNNERS[b.library]
    if isinstance(handle, DeviceHandle):  # the device engine's own choice and price
        if handle.comm is None:  # the copy has neither
            return None, None
        return adapter.device_choice(handle.comm, collective, world, size, itemsize,
                                     b.algorithm if collective == "allreduce" else None)
    if runner.owner != "ringcomm":
        return None, None
    if runner.device == "cuda":  # CUDA tensors through torch: the group's own device choice
        return adapter.device_choice(handle.comm, collective, world, size, itemsize)
    if len(comm.hosts) > 1:  # the model for this layout
        return multihost.modelled_on_hosts(collective, b.algorithm, comm, size, itemsize)
    chosen = None
    if collective == "allreduce":  # the torch path makes the Communicator's choice
        chosen = b.algorithm or adapter.chosen_algorithm(comm, size, itemsize)
    return chosen, adapter.predicted_seconds(collective, chosen, world, size, itemsize,
                                             comm.segment_bytes)


def _measure(collective: str, nbytes: int, dtype_name: str, op: str | None, rank: int,
             world: int, s: Settings, handles: dict[str, Any]) -> list[dict] | None:
    """Check, warm up, time interleaved and check again every backend at one size.
    ``handles``: what each joined runner (``backends.RUNNERS``) returned when it joined."""
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
    backends = _backends_for(collective, dtype_name, reduce_op, s)
    case = Case(collective, dtype_name, reduce_op, count)
    ref = Reference(collective, world, count, dtype, reduce_op)
    buffers: dict[str, Buffers] = {"cpu": Buffers(collective, rank, world, count, dtype, ref)}
    for where in dict.fromkeys(RUNNERS[b.library].device for b in backends):
        if where in buffers:
            continue
        if where == device.RUNTIME_ARRAYS:
            assert s.device is not None
            buffers[where] = device.RuntimeBuffers(collective, rank, world, count, dtype, ref,
                                                   s.device)
        else:
            buffers[where] = Buffers(collective, rank, world, count, dtype, ref, where)
    parts: list[Turns] = []
    group_backend = {}  # what torch itself says each torch-run backend ran on
    for b in backends:
        runner = RUNNERS[b.library]
        parts.append(runner.turns(handles[b.library], case, buffers[runner.device],
                                  b.algorithm))
        if runner.process_group:
            group_backend[b.name] = str(dist.get_backend(handles[b.library]))

    wrong = [p.check() for p in parts]
    for bufs in buffers.values():
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
    comm = handles["ringcomm"]  # every rank joins it: the model's questions go to it
    rows = []
    for i, b in enumerate(backends):
        reps = slowest[i].tolist()
        median, best = statistics.median(reps), min(reps)
        chosen, predicted = row_choice(b, handles[b.library], comm, collective, world, size,
                                       itemsize)
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
            "device": s.device or "cpu", "runtime": device.RUNTIMES.get(s.device or ""),
        })
        if b.library == device.COPY:  # the ceiling: bytes read plus bytes written
            rows[-1]["copy_rw_GBps"] = 2 * size / median / 1e9
    copy = next((r for r in rows if "copy_rw_GBps" in r), None)
    if copy is not None and collective == "allreduce":
        for r in rows:
            if r["library"] in (device.IPC, device.STAGED, device.NCCL_ENGINE):
                r["one_gpu_bound_GBps"] = device.one_gpu_bound(copy["copy_rw_GBps"], world)
    return rows


def _backends_for(collective: str, dtype: str, op: str | None, s: Settings) -> list[Backend]:
    """The columns of one measurement (``op``: None where nothing is reduced), peers last.
    Forced algorithms exist only for allreduce; elsewhere ringcomm is one backend. A backend
    sits out what its runner does not support (Gloo has no average, MPI no bfloat16
    reductions)."""
    out: list[Backend] = []
    for b in s.backends:
        if b.algorithm is not None and collective != "allreduce":
            b = Backend(b.library, b.library)
        if RUNNERS[b.library].unsupported(collective, dtype, op) is None and b not in out:
            out.append(b)
    return out + [Backend(name, name) for name in s.peers
                  if RUNNERS[name].unsupported(collective, dtype, op) is None]


def rank_main(rank: int, world: int, report: Any, s: Settings) -> None:
    """One rank of a sweep: join every backend it runs (``backends.joining``: with ``--peers
    mpi`` rank 0 starts the MPI ranks first, so they start up while the sweep's ranks join
    the rest), then measure every collective and size, then leave them in reverse order."""
    import torch

    torch.set_num_threads(1)
    where = RankContext(rank, world, s.address, s.ports, s.timeout, report,
                        s.device or "cpu")
    if s.device is not None and rank == 0:
        report("device", device.runtime_of(s.device).describe())
    with contextlib.ExitStack() as joined:
        handles: dict[str, Any] = {}
        runners = joining([*(b.library for b in s.backends), *s.peers])
        for runner in runners:
            handles[runner.name] = handle = runner.join(where)
            joined.callback(runner.leave, handle)
        comm = handles["ringcomm"]
        if rank == 0 and len(comm.hosts) > 1:
            report("layout", multihost.layout_facts(comm))
        for runner in runners:
            runner.ready(handles[runner.name], where)
        for collective in s.collectives:
            for dtype in s.dtypes:
                for op in (s.ops if collective in REDUCING else [None]):
                    for nbytes in s.sizes:
                        rows = _measure(collective, nbytes, dtype, op, rank, world, s, handles)
                        if rank == 0:
                            report("rows", rows or [])
                            report("progress", (collective, dtype, op, nbytes))


# --------------------------------------------------------------------------- parent side


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as err:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(err)) from None


class _Help(argparse.RawDescriptionHelpFormatter):
    """Help text wrapped at spaces only: a backend's name (``ringcomm+cuda-kernel``) is
    never split at its hyphen."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringcomm bench", description=__doc__.splitlines()[0].replace("``", ""),
        epilog="Sizes take K, M, G suffixes (powers of 1024). `ringcomm bench ddp --help` for "
        "the DDP training benchmark.", formatter_class=_Help)
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
    p.add_argument("--device", choices=sorted(device.RUNTIMES), default=None,
                   help="sweep device memory: cuda (CuPy arrays on a GPU) or fake (the strict "
                   "fake runtime's arrays on the CPU: checks the plumbing, its times mean "
                   "nothing); backends default to "
                   + "; ".join(f"{name}: {' '.join(backends)}"
                               for name, backends in DEVICE_BACKENDS.items()))
    p.add_argument("--backends", nargs="+", default=None,
                   help="ringcomm (the Communicator, automatic choice), ringcomm:ALGO (forced; "
                   f"ALGO one of {', '.join(adapter.allreduce_algorithms(board=True))}; "
                   "board and twoshot on one host only), ringcomm:all, "
                   f"{TORCH} (torch.distributed on a process group of backend ringcomm), "
                   "ringcomm/curve (the Communicator with an auth token: its tcp links "
                   "authenticate and encrypt; RINGCOMM_TRANSPORT=tcp to measure them), "
                   f"{CHECKSUMMED} (the Communicator with RINGCOMM_CHECKSUM=1), gloo, nccl, "
                   f"{floors.TORCH_FLOOR} (torch.distributed on a backend that does nothing: "
                   f"torch's dispatch), {floors.API_FLOOR} (ringcomm's API on one rank: its "
                   f"fixed cost) (default: {' '.join(HOST_BACKENDS)}; nccl only with one GPU per "
                   "rank); with --device: ringcomm+cuda-ipc, ringcomm+staged, "
                   "ringcomm+nccl[:ALGO|:nccl] (an engine forced), "
                   f"{device.COPY}, {device.GLOO_CUDA}, {device.TORCH_CUDA}, nccl")
    p.add_argument("--peers", nargs="+", default=[], metavar="PEER",
                   choices=[name for name, runner in RUNNERS.items() if runner.peer],
                   help="mpi: also run MPI's collectives (mpi4py, MPICH: pip install -e "
                   "'.[mpi]' in ringcomm's checkout) in processes of their own started by "
                   "mpiexec, taking turns with the backends in every repetition; reported as "
                   "backend mpi")
    p.add_argument("--json", type=Path, default=None, help="write every row here")
    p.add_argument("--plot-dir", type=Path, default=None, help="write PNG plots here")
    p.add_argument("--quick", action="store_true",
                   help="a short smoke run: 1K, 32K, 1M at world 2, few repetitions")
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
    where = getattr(args, "device", None)
    named = args.backends or (DEVICE_BACKENDS[where] if where else HOST_BACKENDS)
    s = Settings(
        sizes=sizes, collectives=collectives, backends=parse_backends(named), device=where,
        dtypes=dtypes, ops=ops, iters=pick(args.iters, 5, 3), warmup=pick(args.warmup, 2, 1),
        reps=pick(args.reps, 5, 3), timeout=args.timeout,
        peers=list(dict.fromkeys(getattr(args, "peers", None) or [])))
    if s.iters < 1 or s.reps < 1 or s.warmup < 0:
        raise ValueError("--iters and --reps must be at least 1 and --warmup not negative")
    hosts, rate = getattr(args, "hosts", None), getattr(args, "rate", None)
    shared = bool(getattr(args, "shared_cpus", False))
    for b in s.backends:
        needs = RUNNERS[b.library].needs_device
        if needs and where not in needs:
            raise ValueError(f"backend {b.name} runs on device memory: give --device "
                             f"{' or --device '.join(needs)}")
    if hosts is None:
        if rate is not None or shared:
            raise ValueError("--rate and --shared-cpus shape simulated hosts: give --hosts too")
        return s, worlds
    if args.world_sizes is not None:
        raise ValueError("--hosts HxR sets the world size (H x R ranks): leave out -n")
    if s.peers:
        raise ValueError("--peers runs on this host only: leave out --hosts")
    if where is not None:
        raise ValueError("--device runs on this host only: leave out --hosts")
    layout = multihost.Layout(*multihost.parse_layout(hosts))
    s.hosts, s.shared_cpus = str(layout), shared
    s.rate = None if rate is None else multihost.parse_rate(rate)
    return s, [layout.world]


HOST_BACKENDS = ["ringcomm:all", TORCH, "gloo", "nccl", *floors.FLOORS]
DEVICE_BACKENDS = {"fake": [device.IPC, device.KERNEL, device.STAGED,
                            f"{device.NCCL_ENGINE}:ring", f"{device.NCCL_ENGINE}:nccl"],
                   "cuda": [device.IPC, device.KERNEL, device.STAGED,
                            f"{device.NCCL_ENGINE}:ring",
                            f"{device.NCCL_ENGINE}:nccl", device.COPY, device.GLOO_CUDA,
                            device.TORCH_CUDA, "nccl"]}


def _left_out(runner: Runner, on_hosts: bool, world: int,
              device_name: str | None = None) -> str | None:
    """The note saying why ``runner`` cannot run ``world`` ranks here (``on_hosts``: on
    simulated hosts; ``device_name``: ``--device``'s runtime), or None where it can."""
    if on_hosts and not runner.on_simulated_hosts:
        return f"{runner.name} skipped: not run on simulated hosts (--hosts)"
    if why := runner.unavailable(world, device_name):
        return f"{runner.name} skipped at world size {world}: {why}"
    return None


def run(s: Settings, worlds: list[int], console: Any = None,
        facts: dict | None = None) -> tuple[list[dict], list[str]]:
    """Every world size in turn, with a progress bar; the rows and any notes. With
    ``s.hosts``, the one world on simulated hosts; ``facts`` (if given) then receives the
    layout and link constants the communicator agreed."""
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
            left_out: set[str] = set()
            for name in dict.fromkeys(b.library for b in s.backends):
                if (note := _left_out(RUNNERS[name], s.hosts is not None, world,
                                           s.device)) is not None:
                    left_out.add(name)
                    notes.append(note)
                    progress.console.print(f"[yellow]{note}[/]")
            backends = [b for b in s.backends if b.library not in left_out]
            nccl = any(b.library == "nccl" for b in backends)
            layout = s.layout()
            if layout is None:
                ws = replace(s, ports=(free_port(), free_port()), backends=backends, nccl=nccl)
                reports = contextlib.closing(launch(world, rank_main, (ws,), s.timeout))
                progress.update(task, description=f"world {world}: starting ranks")
            else:
                ws = replace(s, ports=multihost.STORE_PORTS, backends=backends, nccl=nccl)

                def args_for(address: str, ws: Settings = ws) -> tuple[Settings]:
                    return (replace(ws, address=address),)

                reports = contextlib.closing(multihost.launch(layout, rank_main, args_for,
                                                              s.timeout))
                progress.update(task, description=f"{layout} hosts: starting ranks")
            with reports as events:
                _follow_reports(events, rows, facts, progress, task, world, s)
    for name in s.peers:
        for collective in s.collectives:
            spec = TABLE[collective]
            for dtype in s.dtypes:
                for op in s.ops if spec.reduces else [None]:
                    if why := RUNNERS[name].unsupported(collective, dtype, op):
                        notes.append(f"{name} skipped for {collective} {dtype} {op}: {why}")
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
        elif kind == "device":
            if facts is not None:
                facts["device"] = payload
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


def _device_problem(where: str) -> str | None:
    """Why the device runtime ``--device`` names cannot be had here (None: it can), asked
    in this process before any rank starts: every rank would otherwise fail on it alone."""
    from ringcomm.errors import ArgumentError

    try:
        runtime = device.runtime_of(where)
    except ArgumentError as err:
        return str(err)
    return None if runtime.available() else f"the {runtime.name} runtime sees no device"


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
    if s.device is not None and (why := _device_problem(s.device)) is not None:
        print(f"ringcomm bench: --device {s.device}: {why}", file=sys.stderr)  # one line
        return 2
    out = Console(width=None if sys.stdout.isatty() else 180)
    err_console = Console(stderr=True)
    if os.environ.get("RINGCOMM_ALGO"):
        err_console.print(f"[yellow]RINGCOMM_ALGO={os.environ['RINGCOMM_ALGO']} is set: the "
                          "'ringcomm' rows use it instead of the automatic choice[/]")
    facts: dict = {}
    for name in s.peers:  # asked for by name: missing, it stops the run instead of a note
        why = next((w for w in (RUNNERS[name].unavailable(world, s.device)
                                for world in worlds) if w), None)
        if why is not None:
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
    device_meta = facts.pop("device", None)
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
    split = report.floor_split(rows)
    report.print_floor_split(split, out)
    targets = report.target_summary(rows)
    report.print_targets(targets, out)
    device_targets = device.device_summary(rows) if s.device else []
    device.print_summary(device_targets, device.RUNTIMES.get(s.device or "", ""), out)
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
            "floor_split": split,
            **({"peers": peers_meta} if peers_meta else {}),
            **({"runtime": device.RUNTIMES[s.device], "device": device_meta,
                "device_targets": device_targets} if s.device else {}),
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
