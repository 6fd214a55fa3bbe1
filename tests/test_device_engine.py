"""The device engines (``ringcomm.engines.device`` over the cuda-ipc and host-staged
channels) on the strict fake runtime: every collective and every allreduce algorithm
against the table's references, in one process and across real processes; ranks that
disagree; a killed rank; device memory given back at close; stream order against the
caller.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from device_cases import Case, cases_for, check, run_cases

from ringcomm import DesyncError
from ringcomm.core import device
from ringcomm.core.device.fake import FakeDeviceArray
from ringcomm.errors import CommError
from ringcomm.observe.steps import TraceEvent
from ringcomm.runtime.local import run_group

pytestmark = pytest.mark.timeout(120)
slow = pytest.mark.slow
RUNTIME = device.runtime("fake")
ENGINES = ["cuda-ipc", "staged"]


@pytest.fixture
def engine_env(monkeypatch):
    """Force the device engine (and small IPC slots, so messages go in pieces)."""
    def force(engine: str) -> None:
        monkeypatch.setenv("RINGCOMM_DEVICE_ENGINE", engine)
        monkeypatch.setenv("RINGCOMM_IPC_SLOT_BYTES", "256")
        monkeypatch.setenv("RINGCOMM_IPC_SLOTS", "4")
    return force


def _run_matrix(world: int, engine: str, cases: list[Case],
                hosts: list[list[int]] | None = None) -> set[str]:
    """Run ``cases`` on device memory, check them, and return the engines that ran them
    (the barrier's empty host buffer aside)."""
    before = RUNTIME.live_allocations()
    trace: list[TraceEvent] = []
    results = run_group(world, lambda comm: run_cases(comm, cases), device="fake",
                        segment_bytes=64, trace=trace, hosts=hosts, timeout=30)
    check(cases, world, results)
    assert RUNTIME.live_allocations() == before, "device memory left after close"
    return {e.engine for e in trace if not e.op.startswith("barrier")}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_on_device_memory(engine_env, engine, world):
    """float32 at every world size, bfloat16 and int64 at three ranks: each collective (its
    ops, roots, sizes) and allreduce by each algorithm, run by the device engine named."""
    engine_env(engine)
    dtypes = ["float32", "bfloat16", "int64"] if world == 3 else ["float32"]
    ran = _run_matrix(world, engine, cases_for(world, dtypes, blocks=(0, 37)))
    if world > 1:  # cuda-ipc hands the calls its slots cannot carry to staging
        assert engine in ran and ran <= {engine, "staged"}, ran


@slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_and_dtype_on_device_memory_in_full(engine_env, engine, world):
    engine_env(engine)
    ran = _run_matrix(world, engine, cases_for(world, ["float32", "bfloat16", "int64"]))
    assert engine in ran and ran <= {engine, "staged"}, ran


@pytest.mark.parametrize("hosts", [[[0, 1], [2, 3]], [[0, 2], [1]]])
def test_hier_over_simulated_hosts_goes_staged(engine_env, hosts):
    """Ranks on several hosts: CUDA IPC cannot serve them, so auto takes the staged channel
    (the hierarchical allreduce included)."""
    engine_env("auto")
    world = sum(len(h) for h in hosts)
    cases = cases_for(world, ["float32", "int64"], blocks=(37,), algorithms=("ring",),
                      hier=True)
    assert _run_matrix(world, "staged", cases, hosts=hosts) == {"staged"}


def test_auto_takes_cuda_ipc_on_one_host_and_says_why(monkeypatch):
    monkeypatch.setenv("RINGCOMM_DEVICE_ENGINE", "auto")

    def fn(comm):
        choice = comm.choose("allreduce", 1 << 20)  # host memory: unchanged
        on_device = comm.selector.choose("allreduce", 1 << 20, 4, memory=RUNTIME.memory)
        return choice, on_device, sorted(comm.engines), comm.describe()

    host, dev, engines, described = run_group(2, fn, device="fake")[0]
    assert host.engine == "links"
    assert dev.engine == "cuda-ipc" and "default constants" in dev.why, dev
    assert engines == ["cuda-ipc", "links", "staged"]
    assert "device: fake (fake runtime" in described


def test_without_a_device_runtime_device_arrays_are_staged_through_the_host(engine_env):
    """device="off": no device engines; a fake device array still works, staged through the
    host by its kind for the link engine."""
    def fn(comm):
        x = FakeDeviceArray.from_host(np.arange(6, dtype=np.float32) * (comm.rank + 1))
        comm.allreduce(x)
        out = x.to_host()
        x.close()
        return out, sorted(comm.engines)

    (a, engines), (b, _) = run_group(2, fn, device="off")
    assert engines == ["links"]
    assert a.tolist() == b.tolist() == (np.arange(6) * 3).tolist()


def test_what_cuda_ipc_slots_cannot_carry_goes_staged(engine_env):
    """Recursive doubling sends its whole vector before it receives: more pieces than the
    4 slots hold would leave both ranks waiting for the other's credit, so the selector
    takes staging for it (and says why), and the call gives the right sum."""
    engine_env("cuda-ipc")

    def fn(comm):
        small = comm.selector.choose("allreduce", 4 * 16, 4, memory=RUNTIME.memory,
                                     forced="rd")
        large = comm.selector.choose("allreduce", 4 * 4096, 4, memory=RUNTIME.memory,
                                     forced="rd")
        x = FakeDeviceArray.from_host(np.full(4096, comm.rank + 1.0, np.float32))
        comm.allreduce(x, algorithm="rd")
        out = x.to_host()
        x.close()
        return small, large, out

    (small, large, out), _ = run_group(2, fn, device="fake", segment_bytes=64)
    assert small.engine == "cuda-ipc"
    assert large.engine == "staged" and "waiting on each other's credits" in large.why
    assert out.tolist() == [3.0] * 4096


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("what", ["dtype", "count"])
def test_ranks_that_disagree_get_a_desync_error(engine_env, engine, what):
    engine_env(engine)

    def fn(comm):
        dtype = np.float64 if what == "dtype" and comm.rank == 1 else np.float32
        count = 9 if what == "count" and comm.rank == 1 else 8
        x = FakeDeviceArray.from_host(np.ones(count, dtype))
        try:
            comm.allreduce(x, algorithm="ring")
        finally:
            x.close()

    results = run_group(2, fn, device="fake", return_errors=True, timeout=10)
    assert any(isinstance(r, DesyncError) for r in results), results
    assert all(isinstance(r, CommError) for r in results), results


@pytest.mark.parametrize("engine", ENGINES)
def test_a_result_read_without_the_done_wait_is_stale(engine_env, engine):
    """The engine's work is ordered on its own stream: a stream that never waited for its
    done event (here a fresh one) reads the old values, while the caller's stream, which the
    engine made wait, reads the result."""
    engine_env(engine)

    def fn(comm):
        x = FakeDeviceArray.from_host(np.full(16, comm.rank + 1.0, np.float32))
        RUNTIME.synchronize(RUNTIME.current_stream())  # the input is in device memory
        comm.reduce(x, root=0)
        other = RUNTIME.new_stream()
        stale = np.empty(16, np.float32)
        RUNTIME.to_host(stale, x.ptr, other)
        RUNTIME.synchronize(other)
        right = x.to_host()  # on the caller's stream
        x.close()
        return stale, right

    (stale, right), _ = run_group(2, fn, device="fake")
    assert right.tolist() == [3.0] * 16
    assert stale.tolist() == [1.0] * 16


def test_the_engine_waits_for_what_the_caller_queued(engine_env):
    """The caller writes its input on its own stream right before the op and does not wait:
    the engine's stream waits on the producer event, so the op reads the new values."""
    engine_env("cuda-ipc")

    def fn(comm):
        x = FakeDeviceArray.from_host(np.zeros(8, np.float32))
        RUNTIME.synchronize(RUNTIME.current_stream())
        RUNTIME.from_host(x.ptr, np.full(8, comm.rank + 1.0, np.float32),
                          RUNTIME.current_stream())  # queued, not done
        comm.allreduce(x)
        out = x.to_host()
        x.close()
        return out

    assert [r.tolist() for r in run_group(2, fn, device="fake")] == [[3.0] * 8] * 2


# --------------------------------------------------------------------------- processes


@pytest.mark.parametrize("engine", ENGINES)
def test_device_collectives_across_processes(cluster, engine):
    """Real processes, a 127.0.0.1 store, the fake runtime's memory shared through named
    memory between them: every collective on each device engine."""
    world = 3
    res = cluster.run(world, "device_cases.job_device_matrix", engine=engine,
                      dtypes=["float32"], timeout=90)
    assert all(r["engines"] == sorted({"staged", engine}) for r in res), res[0]["engines"]
    assert all(r["chosen"] == engine for r in res)
    assert all(r["live"] == 0 for r in res), [r["live"] for r in res]
    check(res[0]["cases"], world, [r["results"] for r in res])


@slow
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [2, 4])
def test_device_collectives_across_processes_in_full(cluster, engine, world):
    res = cluster.run(world, "device_cases.job_device_matrix", engine=engine,
                      dtypes=["float32", "bfloat16", "int64"], timeout=240)
    assert all(r["live"] == 0 for r in res)
    check(res[0]["cases"], world, [r["results"] for r in res])


def job_killed_mid_op(rank: int, world: int, store: str, transport: str, engine: str,
                      **_: object) -> dict[str, object]:
    """Rank 2 is killed at its third message of the second allreduce; the others report
    the type of their error and how long it took."""
    import ringcomm

    os.environ["RINGCOMM_DEVICE_ENGINE"] = engine
    os.environ["RINGCOMM_FAULTS"] = "kill:rank=2,call=2,msg=3"
    comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=5.0,
                         transport=transport, device="fake", segment_bytes=1024)
    x = FakeDeviceArray.from_host(np.ones(4096, np.float32))
    comm.allreduce(x)
    started = time.monotonic()
    try:
        comm.allreduce(x)
        x.to_host()
    except CommError as err:
        return {"type": type(err).__name__, "elapsed": time.monotonic() - started,
                "msg": str(err)}
    finally:
        comm.abort("test over")
    return {"type": None, "elapsed": time.monotonic() - started, "msg": ""}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_killed_rank_gives_typed_errors_on_the_others_in_time(cluster, engine):
    res = cluster.run(3, "test_device_engine.job_killed_mid_op", engine=engine, dies=(2,),
                      timeout=60)
    for r in res[:2]:
        assert r["type"] in ("PeerLostError", "RemoteError", "CommTimeout"), r
        assert r["elapsed"] < 5.0 + 2.0, r
