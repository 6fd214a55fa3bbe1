"""Device collectives checked against the table of collectives' references: one function
that runs a list of calls on a communicator's device engines with its runtime's own arrays
(the fake runtime's ``FakeDeviceArray``, or CuPy arrays on a GPU) and returns what each rank
got, used by the in-process tests (``run_group(device="fake")``) and by the jobs of real
processes (``job_device_matrix``, on either runtime).
"""

from __future__ import annotations

import os
from typing import Any

import ml_dtypes
import numpy as np
from what_runs import CALLS, contribution

from ringcomm.core.device import release
from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.testing import FakeDeviceArray

# (collective, block, dtype, op, root, algorithm)
Case = tuple[str, int, str, str, int, str | None]
DTYPES = {"float32": np.float32, "int64": np.int64, "bfloat16": ml_dtypes.bfloat16,
          "float16": np.float16, "float64": np.float64, "int32": np.int32, "uint8": np.uint8}


def host_inputs(spec_name: str, rank: int, world: int, block: int, dtype: str,
                root: int) -> dict[str, np.ndarray]:
    """Every buffer ``rank`` holds for one call, in host memory: the source role holds the
    rank's contribution, the others 99s."""
    spec = COLLECTIVES[spec_name]
    made = {}
    for role, size in spec.sizes(block, world, rank=rank, root=root).items():
        values = contribution(rank, size, "int64") if role == spec.source \
            else np.full(size, 99, np.int64)
        made[role] = values.astype(DTYPES[dtype])
    return made


def to_device(runtime: Any, values: np.ndarray) -> Any:
    """``values`` as ``runtime``'s own array: a CuPy array, or a ``FakeDeviceArray``."""
    if runtime.name == "cupy":
        import cupy

        return cupy.asarray(values)
    return FakeDeviceArray.from_host(values, runtime=runtime)


def to_host(array: Any) -> np.ndarray:
    """A device array's values, waited for on the caller's current stream."""
    return array.to_host() if isinstance(array, FakeDeviceArray) else array.get()


def run_cases(comm: Any, cases: list[Case]) -> list[np.ndarray | None]:
    """Each case on ``comm`` with arrays of its device runtime; the result role's values
    (None where the rank has none)."""
    from ringcomm.core import device

    runtime = comm.device or device.runtime("fake")
    results: list[np.ndarray | None] = []
    for name, block, dtype, op, root, algorithm in cases:
        spec = COLLECTIVES[name]
        host = host_inputs(name, comm.rank, comm.world_size, block, dtype, root)
        arrays = {role: to_device(runtime, values) for role, values in host.items()}
        kw = {"algorithm": algorithm} if algorithm else {}
        CALLS[name](comm, arrays, op, root, **kw)
        out = arrays.get(spec.result)
        results.append(None if out is None else to_host(out))
        # what the caller queued on them is done before they go
        runtime.synchronize(runtime.current_stream())
        release(*arrays.values())
    return results


def check(cases: list[Case], world: int, results: list[list[np.ndarray | None]]) -> None:
    """Every rank's result of every case against the table's reference (exact, but for
    ``avg`` of floats, which divides in the dtype)."""
    for i, (name, block, dtype, op, root, algorithm) in enumerate(cases):
        spec = COLLECTIVES[name]
        inputs = [host_inputs(name, r, world, block, dtype, root).get(spec.source)
                  for r in range(world)]
        for rank, want in enumerate(spec.reference(inputs, op, root)):
            got = results[rank][i]
            where = (name, block, dtype, op, root, algorithm, rank)
            assert (got is None) == (want is None), where
            if want is None:
                continue
            assert got.dtype == want.dtype, where
            if op == "avg":
                tol = 2e-2 if dtype in ("bfloat16", "float16") else 1e-6
                np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                           rtol=tol, atol=tol, err_msg=str(where))
            else:
                assert got.tobytes() == want.tobytes(), (where, got, want)


def cases_for(world: int, dtypes: list[str], *, blocks: tuple[int, ...] = (0, 5, 37),
              algorithms: tuple[str, ...] = ("ring", "tree", "dbtree", "hd", "rd"),
              hier: bool = False) -> list[Case]:
    """Every collective (its sizes, ops and roots), and allreduce by each algorithm."""
    cases: list[Case] = []
    for dtype in dtypes:
        floats = np.dtype(DTYPES[dtype]).kind not in "iub"
        for name, spec in COLLECTIVES.items():
            if name == "barrier":
                cases.append((name, 0, dtype, "sum", 0, None))
                continue
            ops = ["sum", "max", *(["avg"] if floats and name == "allreduce" else [])] \
                if spec.reduces else ["sum"]
            roots = sorted({0, world - 1}) if spec.rooted else [0]
            for block in blocks:
                for op in ops:
                    for root in roots:
                        cases.append((name, block, dtype, op, root, None))
        for algorithm in (*algorithms, *(["hier"] if hier else [])):
            for op in ("sum", "max", *(["avg"] if floats else [])):
                cases.append(("allreduce", 37, dtype, op, 0, algorithm))
    return cases


RUNTIME_OF_DEVICE = {"fake": "fake", "cuda": "cupy"}


def share_gpu(engine: str, device_name: str, rank: int, world: int) -> None:
    """For the nccl engine on a GPU that the rank processes share: an NCCL_HOSTID each, so
    NCCL (which refuses two ranks on one GPU of one host before 2.30) takes them for hosts
    of their own and joins them over sockets."""
    if engine != "nccl" or device_name != "cuda":
        return
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < world:
        os.environ.setdefault("NCCL_HOSTID", f"ringcomm-test-rank-{rank}")


def job_device_matrix(rank: int, world: int, store: str, transport: str, engine: str,
                      dtypes: list[str], slot_bytes: int = 256, device_name: str = "fake",
                      blocks: tuple[int, ...] = (0, 5, 37), segment_bytes: int = 64,
                      **_: Any) -> dict[str, Any]:
    """A rank of real processes (``mp_helpers.Cluster``): init with ``device_name`` ("fake",
    or "cuda": CuPy arrays on the GPU every rank shares) and ``engine`` forced, run the
    matrix, return the results, the choices' engines and the device memory left after
    ``close()``."""
    import ringcomm
    from ringcomm.core import device

    os.environ["RINGCOMM_DEVICE_ENGINE"] = engine
    os.environ["RINGCOMM_IPC_SLOT_BYTES"] = str(slot_bytes)
    share_gpu(engine, device_name, rank, world)
    runtime = device.runtime(RUNTIME_OF_DEVICE[device_name])
    before = runtime.live_allocations()
    cases = cases_for(world, dtypes, blocks=blocks)
    comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                         transport=transport, device=device_name,
                         segment_bytes=segment_bytes)
    try:
        engines = sorted(name for name in comm.engines if name in ("cuda-ipc", "staged",
                                                                   "nccl"))
        chosen = comm.selector.choose("allreduce", 4096, 4, memory=runtime.memory).engine
        results = run_cases(comm, cases)
    finally:
        comm.close()
    return {"results": results, "engines": engines, "chosen": chosen,
            "live": runtime.live_allocations() - before, "cases": cases}


def job_nccl_bits(rank: int, world: int, store: str, transport: str, device_name: str = "fake",
                  **_: Any) -> dict[str, Any]:
    """A rank of real processes on the nccl engine: one allreduce of the same float32 and
    int64 values by NCCL's own call and by ringcomm's ring and tree as NCCL groups; each
    result's bytes."""
    import ringcomm

    os.environ["RINGCOMM_DEVICE_ENGINE"] = "nccl"
    share_gpu("nccl", device_name, rank, world)
    comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                         transport=transport, device=device_name)
    runtime = comm.device
    out: dict[str, Any] = {}
    try:
        rng = np.random.default_rng(rank)
        for dtype in ("float32", "int64"):
            values = (rng.standard_normal(70_000) * 1e3).astype(dtype)
            for algorithm in ("nccl", "ring", "tree"):
                x = to_device(runtime, values)
                comm.allreduce(x, algorithm=algorithm)
                out[f"{dtype}/{algorithm}"] = to_host(x).tobytes()
                release(x)
    finally:
        comm.close()
    return out
