"""The kernel path's allreduces of every dtype and op, checked against numpy: run by the
in-process tests (``test_kernel_path``) and, as a job, by rank processes
(``mp_helpers.Cluster``)."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ringcomm.core.algorithms import CUDA_KERNEL


def pairs() -> Iterator[tuple[str, np.dtype, str]]:
    from ringcomm.core.dtypes import DTYPE_NAMES, REDUCE_OPS, reduce_op

    for dtype, name in DTYPE_NAMES.items():
        for op in REDUCE_OPS:
            try:
                reduce_op(op, dtype)
            except Exception:  # noqa: BLE001 - a pair the host path refuses
                continue
            yield name, dtype, op


def inputs(dtype: np.dtype, op: str, world: int, count: int, seed: int) -> list[np.ndarray]:
    """One input per rank: values that make a wrong or stale element show (no zeros where a
    product would hide them; integers that wrap)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(world):
        if dtype.kind == "b":
            x = rng.random(count) < 0.5
        elif dtype.kind in "iu":
            info = np.iinfo(dtype)
            x = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        elif dtype.kind == "c":
            x = rng.normal(size=count) + 1j * rng.normal(size=count)
        else:
            x = rng.normal(size=count) * (1.0 if op == "prod" else 10.0)
        out.append(np.asarray(x).astype(dtype))
    return out


def expected(values: list[np.ndarray], name: str, op: str) -> np.ndarray:
    """numpy's: the host path (reduce_into rank by rank, then finish_reduction), or for
    float16 and bfloat16 the kernels' float32 accumulation rounded once."""
    import functools

    from ringcomm.core.dtypes import REDUCE_OPS, finish_reduction, reduce_into

    rop = REDUCE_OPS[op]
    if name in ("float16", "bfloat16"):
        acc = functools.reduce(rop.ufunc, [x.astype(np.float32) for x in values])
        if rop.divides:
            acc = acc / np.float32(len(values))
        return acc.astype(values[0].dtype)
    acc = values[0].copy()
    for x in values[1:]:
        reduce_into(acc, acc, x, rop)
    finish_reduction(acc, rop, len(values))
    return acc


def scatter_gather_everything(count: int, only: tuple[tuple[str, str], ...] | None = None
                              ) -> Callable[[Any], Any]:
    """A job for every rank of a group: a reduce-scatter (blocks of ``count``) of every
    (dtype, op) the host path has (or those in ``only``), and an all-gather of each dtype,
    on arrays of the group's device runtime; what differed from numpy, the choices' engines
    and algorithms, and a digest of every result (the same on every rank: the all-gather's
    whole, the reduce-scatter's blocks in rank order are not, so each rank's own)."""

    def fn(comm: Any) -> Any:
        from device_cases import to_device, to_host

        from ringcomm.core.device import release

        world, rank = comm.world_size, comm.rank
        wrong, chosen = [], set()
        digest = hashlib.sha256()
        gathered = set()
        for seed, (name, dtype, op) in enumerate(pairs()):
            if only is not None and (name, op) not in only:
                continue
            values = inputs(dtype, op, world, count * world, seed)
            x = to_device(comm.device, values[rank])
            out = to_device(comm.device, np.zeros(count, dtype))
            comm.reduce_scatter(out, x, op)
            got = to_host(out)
            want = expected([v[rank * count:(rank + 1) * count] for v in values], name, op)
            same = got.tobytes() == want.tobytes() or (
                dtype.kind in "fc" and (np.array_equal(got, want, equal_nan=True) or (
                    op == "prod" and dtype.kind == "c" and np.allclose(got, want, rtol=1e-5))))
            if not same:
                wrong.append(("reduce_scatter", name, op))
            digest.update(got.tobytes())
            choice = comm.choose("reduce_scatter", x)
            chosen.add(f"reduce_scatter {choice.engine}:{choice.algorithm}")
            release(x, out)
            if name in gathered:
                continue
            gathered.add(name)
            mine = values[rank][:count]
            x = to_device(comm.device, mine)
            out = to_device(comm.device, np.zeros(count * world, dtype))
            comm.allgather(out, x)
            got = to_host(out)
            if got.tobytes() != b"".join(v[:count].tobytes() for v in values):
                wrong.append(("allgather", name, ""))
            digest.update(got.tobytes())
            choice = comm.choose("allgather", x)
            chosen.add(f"allgather {choice.engine}:{choice.algorithm}")
            release(x, out)
        return wrong, sorted(chosen), digest.hexdigest()
    return fn


#: what a GPU run compiles and checks (each instantiation is an NVRTC compile at first use):
#: the dtypes training reduces, with the ops it uses, plus one integer and one bitwise op
GPU_PAIRS = (("float32", "sum"), ("float32", "avg"), ("float32", "max"), ("float16", "sum"),
             ("bfloat16", "sum"), ("bfloat16", "avg"), ("int64", "sum"), ("uint8", "bxor"))


def allreduce_everything(count: int, algorithms: tuple[str | None, ...],
                         only: tuple[tuple[str, str], ...] | None = None
                         ) -> Callable[[Any], Any]:
    """A job for every rank of a group: every (dtype, op) the host path has (or those
    named in ``only``), by each of ``algorithms`` (None: the selector's choice), on arrays
    of the group's device runtime; what differed from numpy, the ops the kernel lane ran,
    the selector's choice at ``count`` float32s and a digest of every result (the same on
    every rank)."""

    def fn(comm: Any) -> Any:
        from device_cases import to_device, to_host

        from ringcomm.core.device import release

        wrong = []
        digest = hashlib.sha256()  # every rank's results: the same bits on every rank
        for seed, (name, dtype, op) in enumerate(pairs()):
            if only is not None and (name, op) not in only:
                continue
            values = inputs(dtype, op, comm.world_size, count, seed)
            for algorithm in algorithms:
                x = to_device(comm.device, values[comm.rank])
                comm.allreduce(x, op, algorithm=algorithm)
                got = to_host(x)
                want = expected(values, name, op)
                digest.update(got.tobytes())
                if op == "prod" and dtype.kind == "c":
                    # numpy's complex product fuses into FMAs where the CPU has them; the
                    # kernel's rounds every operation: the same to the last bit or two
                    same = np.allclose(got, want, rtol=1e-5)
                else:
                    same = got.tobytes() == want.tobytes() or (
                        dtype.kind in "fc" and np.array_equal(got, want, equal_nan=True))
                if not same:
                    wrong.append((name, op, algorithm))
                release(x)
        lane = comm.wiring.lanes[CUDA_KERNEL]
        return (wrong, lane.ops, comm.choose("allreduce", count * 4, memory=comm.device.memory),
                digest.hexdigest())
    return fn


def job_kernel_path(rank: int, world: int, store: str, transport: str, count: int = 45,
                    mps: bool = True, device_name: str = "fake",
                    **_: Any) -> dict[str, Any]:
    """A rank of real processes on the kernel path. On the fake runtime every rank on fake
    device 0 under MPS (``mps``), or each on a device of its own, every dtype and op; on a
    GPU (``device_name="cuda"``) each rank on its own GPU where there are enough, else all
    on GPU 0 (the MPS daemon the test found serves them), ``GPU_PAIRS``, with
    ``RINGCOMM_DEVICE_ENGINE=cuda-kernel`` (CuPy's launch is taken only on request). Each
    by both kernels and the selector's choice; what ``allreduce_everything`` says, the
    verdict, and the device memory left after ``close()``, which rank 0 calls last."""
    import os

    import ringcomm
    import ringcomm.testing  # noqa: F401 - registers the fake runtime
    from ringcomm.core import device

    fake = device_name == "fake"
    runtime = device.runtime("fake" if fake else "cupy")
    saved = (runtime._devices, runtime.mps_on) if fake else None
    before_device = runtime.current_device()
    if fake:
        runtime._devices = max(world, runtime._devices)
        runtime.mps_on = mps
        runtime.set_device(0 if mps else rank)
    else:
        os.environ["RINGCOMM_DEVICE_ENGINE"] = CUDA_KERNEL
        runtime.set_device(rank if runtime.device_count() >= world else 0)
    before = runtime.live_allocations()
    try:
        comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                             transport=transport, device=device_name)
        try:
            wrong, ops, choice, digest = allreduce_everything(
                count, ("kernel-oneshot", "kernel-twoshot", None),
                None if fake else GPU_PAIRS)(comm)
            scattered, chosen, _ = scatter_gather_everything(
                count, None if fake else GPU_PAIRS)(comm)
            verdict = str(comm.selector.group.kernel)
        finally:
            if rank == 0:  # the others free their regions only after rank 0 unmaps them
                time.sleep(0.5)
            comm.close()
        return {"wrong": wrong + scattered, "ops": ops, "engine": choice.engine,
                "digest": digest, "verdict": verdict, "chosen": chosen,
                "live": runtime.live_allocations() - before}
    finally:
        if saved is not None:
            runtime._devices, runtime.mps_on = saved
        runtime.set_device(before_device)


def job_killed_in_kernel(rank: int, world: int, store: str, transport: str,
                         **_: Any) -> dict[str, Any]:
    """Ranks sharing fake device 0 under MPS, on the kernel path. Rank 2 is killed at its
    second header of the second allreduce: rank 0 has its header and launches its kernel,
    which waits for flags rank 2 will never write; rank 1 waits for a header. Each
    survivor's error, how long it took, how long the abort after it took and the device
    memory its close left."""
    import os

    import ringcomm
    import ringcomm.testing  # noqa: F401 - registers the fake runtime
    from ringcomm.core import device
    from ringcomm.errors import CommError
    from ringcomm.testing.fake_device import FakeDeviceArray

    runtime = device.runtime("fake")
    saved = runtime.mps_on
    runtime.mps_on = True
    os.environ["RINGCOMM_FAULTS"] = "kill:rank=2,call=2,msg=1"
    before = runtime.live_allocations()
    outcome: dict[str, Any] = {"type": None, "msg": ""}
    try:
        comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=5.0,
                             transport=transport, device="fake")
        x = FakeDeviceArray.from_host(np.ones(4096, np.float32))
        comm.allreduce(x)
        outcome["first"] = x.to_host()[:4].tolist()
        outcome["engine"] = comm.choose("allreduce", x).engine
        started = time.monotonic()
        try:
            comm.allreduce(x)
            x.to_host()
        except CommError as err:
            outcome.update(type=type(err).__name__, msg=str(err))
        outcome["elapsed"] = time.monotonic() - started
        aborting = time.monotonic()
        comm.abort("test over")
        outcome["abort_s"] = time.monotonic() - aborting
        x.close()
        outcome["left"] = runtime.live_allocations() - before
        return outcome
    finally:
        runtime.mps_on = saved
        del os.environ["RINGCOMM_FAULTS"]
