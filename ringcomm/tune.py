"""``ringcomm tune``: measure this machine and fit the cost model's constants.

It launches ``world_size`` ranks on localhost, times every allreduce algorithm at a few
sizes (medians of interleaved repetitions, slowest rank), times the ring at a few segment
sizes, times a local reduction for ``gamma`` (in an allreduce bytes moved and bytes reduced
grow together, so the two cannot be told apart from allreduce timings alone), and fits
``alpha`` and ``beta`` so that the model's predictions match the measurements in relative
terms. The result goes to the profile file that the communicator
reads (``ringcomm.plan.cost.profile_path()``), one set of constants per world size.

Fitting: a prediction is ``max(critical . p, work . p / share)`` where ``p = (alpha, beta,
gamma)`` and the terms come from replaying the schedules, so it is linear in ``p`` once it
is known which bound is active. The fit alternates: pick the active bound of every sample
under the current ``p``, solve a weighted least-squares problem for ``p`` (weights
``1 / measured``: relative errors), repeat.

With ``--device cuda`` (or ``fake``) it tunes the device engines instead: for each
(cuda-ipc, staged) it launches ranks with that engine forced, times every allreduce
algorithm on device arrays (the host waits for the device after each batch), times a
device reduction for ``gamma``, and fits one set of constants per engine over every world
size measured (device ranks have the device to themselves, so no cores are shared). They
go under ``"devices"`` in the profile, beside whatever host constants it already holds.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .core.algorithms import ALLREDUCE_KERNELS, CUDA_KERNEL
from .errors import ArgumentError
from .plan import cost
from .schedules import ALLREDUCE

if TYPE_CHECKING:
    from .core.device.runtime import DeviceRuntime

TUNE_SIZES = (8, 4096, 65536, 1 << 20, 8 << 20, 32 << 20)
QUICK_SIZES = (8, 65536, 1 << 20, 4 << 20)
SEGMENTS = (512 << 10, 1 << 20, 2 << 20, 4 << 20)
DEVICE_SIZES = (8, 65536, 1 << 20, 16 << 20, 64 << 20)
QUICK_DEVICE_SIZES = (8, 65536, 1 << 20)
DEVICE_ENGINES = ("cuda-ipc", "staged")
_FLOOR = cost.CostParams(alpha=1e-6, beta=1e-12, gamma=1e-12)
_DEVICE_FLOOR = cost.CostParams(alpha=1e-7, beta=1e-15, gamma=1e-15)


@dataclass(frozen=True)
class Sample:
    """One measurement: the schedule's cost terms, the cores share, the time taken."""

    terms: cost.ScheduleCost
    share: float
    seconds: float


def fit(samples: list[Sample], gamma: float, start: cost.CostParams | None = None,
        rounds: int = 8, floor: cost.CostParams = _FLOOR) -> cost.CostParams:
    """``alpha`` and ``beta`` that minimise the relative error of the predictions, with
    ``gamma`` measured apart (see module doc)."""
    p = start or cost.CostParams(gamma=gamma)
    for _ in range(rounds):
        rows, target = [], []
        for s in samples:
            crit, work = s.terms.critical, s.terms.work
            scale = 1.0 / (s.terms.world_size * min(1.0, s.share))
            if crit.time(p) >= work.time(p) * scale:
                row = (crit.messages, crit.moved, crit.reduced)
            else:
                row = (work.messages * scale, work.moved * scale, work.reduced * scale)
            rows.append([row[0] / s.seconds, row[1] / s.seconds])
            target.append(1.0 - gamma * row[2] / s.seconds)
        solution, *_ = np.linalg.lstsq(np.array(rows), np.array(target), rcond=None)
        p = cost.CostParams(alpha=max(float(solution[0]), floor.alpha),
                            beta=max(float(solution[1]), floor.beta), gamma=gamma)
    return p


def measure_gamma(nbytes: int = 64 << 20, segment_bytes: int = cost.DEFAULT_SEGMENT_BYTES,
                  reps: int = 5) -> float:
    """Seconds per byte of an in-place float32 sum, as the executor does it: segment by
    segment over buffers too big for the cache, as in the large allreduces where gamma
    matters (cache-resident data reduces several times faster and would hide its cost)."""
    a = np.ones(nbytes // 4, np.float32)
    b = np.ones(nbytes // 4, np.float32)
    step = max(1, segment_bytes // 4)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for lo in range(0, a.size, step):
            np.add(a[lo:lo + step], b[lo:lo + step], out=a[lo:lo + step])
        times.append(time.perf_counter() - start)
    return statistics.median(times) / nbytes


def measure_device_gamma(rt: DeviceRuntime, nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Seconds per byte of an in-place float32 sum on the device, on a stream of its own,
    the host waiting for each (the device reduction a device engine runs)."""
    from .core.device import pointer, release, zeros
    from .core.dtypes import reduce_op

    count = max(1, nbytes // 4)
    a, b = zeros(rt, count, np.float32), zeros(rt, count, np.float32)
    pa, pb = pointer(a), pointer(b)
    op = reduce_op("sum", np.dtype(np.float32))
    stream = rt.new_stream()
    rt.synchronize(rt.current_stream())  # the zeros are there
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        rt.reduce(pa, pa, pb, count, np.dtype(np.float32), op, stream)
        rt.synchronize(stream)
        times.append(time.perf_counter() - start)
    release(a, b)
    return statistics.median(times[1:]) / (count * 4)


def relative_errors(samples: list[Sample], p: cost.CostParams) -> list[float]:
    return [s.terms.time(p, s.share) / s.seconds - 1.0 for s in samples]


# --------------------------------------------------------------------------- measuring


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, sizes: tuple[int, ...], reps: int,
               segments: tuple[int, ...], results) -> None:
    import ringcomm

    # links admit the largest segment timed below; the algorithms are timed at the default
    comm = ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{port}", timeout=120,
                         segment_bytes=max(cost.DEFAULT_SEGMENT_BYTES, *segments))
    comm.segment_bytes = cost.DEFAULT_SEGMENT_BYTES
    try:
        timings: dict[tuple[object, ...], list[float]] = {}

        def timed(key: tuple, run, iters: int) -> None:
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                run()
            mine = np.array([(time.perf_counter() - start) / iters])
            comm.allreduce(mine, "max")
            timings.setdefault(key, []).append(float(mine[0]))

        for nbytes in sizes:
            x = np.zeros(max(1, nbytes // 4), np.float32)
            iters = 20 if nbytes <= 65536 else 3
            for name in ALLREDUCE:
                comm.allreduce(x, algorithm=name)  # warm-up
            for _ in range(reps):
                for name in ALLREDUCE:
                    run = lambda n=name, t=x: comm.allreduce(t, algorithm=n)  # noqa: E731
                    timed(("algo", name, nbytes), run, iters)
        big = np.zeros(max(sizes) // 4, np.float32)
        for _ in range(reps):
            for seg in segments:
                comm.segment_bytes = seg
                comm.allreduce(big, algorithm="ring")
                timed(("segment", seg), lambda: comm.allreduce(big, algorithm="ring"), 2)
        if rank == 0:
            results.put({key: statistics.median(v) for key, v in timings.items()})
    finally:
        comm.close()


def _run_ranks(world: int, target: Callable[..., None], *args: Any,
               timeout: float = 600.0) -> Any:
    """Start ``world`` spawned ranks of ``target(rank, world, port, *args, results)`` (CUDA
    does not survive fork) and return what rank 0 puts in ``results``; a rank that exits
    with an error ends the wait at once, naming it."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, *args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    give_up = time.monotonic() + timeout
    try:
        while True:
            try:
                return results.get(timeout=0.5)
            except queue.Empty:
                failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
                if failed:
                    raise RuntimeError("tuning ranks failed: " + ", ".join(
                        f"rank {r} exited with {code}" for r, code in failed)) from None
                if time.monotonic() > give_up:
                    raise TimeoutError(
                        f"tuning ranks gave no result within {timeout:g} s") from None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def measure(world: int, sizes: tuple[int, ...], reps: int,
            segments: tuple[int, ...]) -> dict[tuple, float]:
    """Median seconds per (algorithm, size) and per ring segment size, on ``world`` ranks."""
    result: dict[tuple, float] = _run_ranks(world, _rank_main, sizes, reps, segments)
    return result


def _device_rank_main(rank: int, world: int, port: int, device: str, engine: str,
                      sizes: tuple[int, ...], reps: int, results) -> None:
    import os

    import ringcomm

    from .core import config
    from .core.device import release, zeros
    from .runtime.devices import named_runtime, runtime_name

    variable = config.BY_NAME["device_engine"].env  # must match: every rank forces it
    assert variable is not None
    os.environ[variable] = engine
    kernel = engine == CUDA_KERNEL
    if kernel:  # a GPU each where there are enough (their kernels run at once), else all
        runtime = named_runtime(runtime_name(device) or device)  # on the first (under MPS)
        runtime.set_device(rank if runtime.device_count() >= world else 0)
    comm = ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{port}", timeout=120,
                         segment_bytes=cost.DEFAULT_SEGMENT_BYTES, device=device)
    try:
        rt = comm.device
        verdict = comm.selector.group.kernel
        if kernel and (verdict is None or not verdict.ok):  # the ranks agree: all say so
            if rank == 0:
                results.put({"unavailable": str(verdict)})
            return
        if rt is None or engine not in comm.engines:
            raise RuntimeError(f"no {engine} engine in this group (device {device!r}): "
                               f"{sorted(comm.engines)}")
        names = ALLREDUCE_KERNELS if kernel else ALLREDUCE
        timings: dict[tuple[str, int], list[float]] = {}
        for nbytes in sizes:
            x = zeros(rt, max(1, nbytes // 4), np.float32)
            iters = 20 if nbytes <= 65536 else 3
            for name in names:
                comm.allreduce(x, algorithm=name)  # warm-up
            rt.synchronize(rt.current_stream())
            for _ in range(reps):
                for name in names:
                    comm.barrier()
                    start = time.perf_counter()
                    for _ in range(iters):
                        comm.allreduce(x, algorithm=name)
                    rt.synchronize(rt.current_stream())  # the device has done them all
                    mine = np.array([(time.perf_counter() - start) / iters])
                    comm.allreduce(mine, "max")
                    timings.setdefault((name, nbytes), []).append(float(mine[0]))
            release(x)
        if rank == 0:
            results.put({key: statistics.median(v) for key, v in timings.items()})
    finally:
        comm.close()


def measure_device(device: str, engine: str, world: int, sizes: tuple[int, ...],
                   reps: int) -> dict[Any, Any]:
    """Median seconds per (algorithm, size) of allreduces of device arrays over ``engine``
    (``cuda-kernel``: by each of its algorithms), on ``world`` ranks; for the kernel path
    where the group cannot take it, ``{"unavailable": why}``."""
    result: dict[Any, Any] = _run_ranks(world, _device_rank_main, device, engine, sizes, reps)
    return result


def tune_device(device: str, worlds: list[int], *, quick: bool = False,
                log: Callable[[str], None] = print,
                profile: cost.Profile | None = None) -> cost.Profile:
    """Measure and fit the device engines' constants into ``profile`` (or a new one). The
    samples are priced as the links price them (the default segment size): cuda-ipc moves
    a message in slot-sized pieces, whose per-piece cost the fit folds into alpha and
    beta."""
    from .runtime.devices import named_runtime, runtime_name

    profile = profile or cost.Profile()
    profile.source = "ringcomm tune"
    sizes = QUICK_DEVICE_SIZES if quick else DEVICE_SIZES
    reps = 3 if quick else 5
    gamma = measure_device_gamma(named_runtime(runtime_name(device) or device))
    log(f"device reduction: {1 / gamma / 1e9:.2f} GB/s")
    for engine in DEVICE_ENGINES:
        samples = []
        for world in worlds:
            log(f"measuring {engine} on {world} ranks ...")
            for (name, nbytes), seconds in measure_device(device, engine, world, sizes,
                                                          reps).items():
                terms = cost.allreduce_cost(name, world, nbytes // 4, 4,
                                            cost.DEFAULT_SEGMENT_BYTES // 4)
                samples.append(Sample(terms, 1.0, seconds))
        _fitted(profile, engine, samples, gamma, log)
    _tune_kernel_path(device, worlds, sizes, reps, gamma, profile, log)
    return profile


def _fitted(profile: cost.Profile, name: str, samples: list[Sample], gamma: float,
            log: Callable[[str], None]) -> None:
    params = fit(samples, gamma, floor=_DEVICE_FLOOR)
    profile.devices[name] = params
    errors = relative_errors(samples, params)
    log(f"  {name}: alpha {params.alpha * 1e6:.1f} us  beta "
        f"{1 / params.beta / 1e9:.2f} GB/s  median |error| "
        f"{statistics.median(abs(e) for e in errors):.0%}")


def _tune_kernel_path(device: str, worlds: list[int], sizes: tuple[int, ...], reps: int,
                      gamma: float, profile: cost.Profile,
                      log: Callable[[str], None]) -> None:
    """The kernel path's constants, one set per algorithm (the selector prices each with
    its own: ``cost.kernel_allreduce``), where the ranks can take it (their kernels run at
    once: under MPS, or a GPU each); else the defaults stay, and the log says why."""
    samples: dict[str, list[Sample]] = {name: [] for name in ALLREDUCE_KERNELS}
    for world in worlds:
        log(f"measuring {CUDA_KERNEL} on {world} ranks ...")
        measured = measure_device(device, CUDA_KERNEL, world, sizes, reps)
        if "unavailable" in measured:
            log(f"  {CUDA_KERNEL}: not measured on {world} ranks: {measured['unavailable']}")
            continue
        for (name, nbytes), seconds in measured.items():
            terms = cost.kernel_allreduce_terms(name, world, nbytes // 4 * 4)
            samples[name].append(Sample(terms, 1.0, seconds))
    for name, taken in samples.items():
        if taken:
            _fitted(profile, name, taken, gamma, log)


def tune(worlds: list[int], *, quick: bool = False, log=print) -> cost.Profile:
    """Measure, fit, and return the profile (not yet written)."""
    sizes = QUICK_SIZES if quick else TUNE_SIZES
    segments = SEGMENTS[1:3] if quick else SEGMENTS
    reps = 3 if quick else 5
    profile = cost.Profile(source="ringcomm tune")
    segment_votes: dict[int, float] = {}
    gamma = measure_gamma()
    log(f"local reduction: {1 / gamma / 1e9:.2f} GB/s")
    for world in worlds:
        log(f"measuring {world} ranks ...")
        timings = measure(world, sizes, reps, segments)
        share = cost.cores_per_rank(world)
        samples = []
        for (kind, *key), seconds in timings.items():
            if kind != "algo":
                continue
            name, nbytes = key
            terms = cost.allreduce_cost(name, world, nbytes // 4, 4,
                                        cost.DEFAULT_SEGMENT_BYTES // 4)
            samples.append(Sample(terms, share, seconds))
        params = fit(samples, gamma)
        profile.params[world] = params
        errors = relative_errors(samples, params)
        log(f"  alpha {params.alpha * 1e6:.1f} us  beta {1 / params.beta / 1e9:.2f} GB/s  "
            f"median |error| "
            f"{statistics.median(abs(e) for e in errors):.0%}")
        for (kind, *key), seconds in timings.items():
            if kind == "segment":
                segment_votes[key[0]] = segment_votes.get(key[0], 0.0) + seconds
    profile.segment_bytes = (min(segment_votes, key=segment_votes.__getitem__)
                             if segment_votes else None)
    log(f"best segment: {profile.segment_bytes} B")
    return profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ringcomm tune", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("-o", "--output", help=f"profile file (default {cost.profile_path()})")
    parser.add_argument("--device", choices=["cuda", "fake"], default=None,
                        help="tune the device engines (cuda-ipc, staged) on this device "
                        "instead, keeping the host constants the profile file holds")
    args = parser.parse_args(argv)
    if bad := [n for n in args.world_sizes if n < 2]:
        raise ArgumentError(
            f"-n {' '.join(map(str, bad))}: tuning times ranks exchanging data, so every "
            "world size must be 2 or more (e.g. -n 2 4)")
    path = args.output or cost.profile_path()
    from pathlib import Path

    if args.device:
        held = (cost.Profile.from_json(Path(path).read_text(), str(path))
                if Path(path).exists() else None)
        profile = tune_device(args.device, args.world_sizes, quick=args.quick, profile=held)
    else:
        profile = tune(args.world_sizes, quick=args.quick)

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(profile.to_json())
    if Path(path).resolve() == cost.profile_path().resolve():
        found = "ringcomm reads it from there at every init (rank 0's is agreed by all ranks)"
    else:
        found = (f"ringcomm reads {cost.profile_path()} by default: set RINGCOMM_PROFILE={path} "
                 "on rank 0 (whose profile every rank agrees on) to use this one")
    print(f"wrote the profile to {path}; {found}")
    return 0
