"""The device engines (``ringcomm.engines.device`` over the cuda-ipc and host-staged
channels) on the strict fake runtime: every collective and every allreduce algorithm
against the table's references, in one process and across real processes; ranks that
disagree; a killed rank; device memory given back at close; stream order against the
caller.
"""

from __future__ import annotations

import gc
import json
import os
import time

import numpy as np
import pytest
from device_cases import Case, cases_for, check, run_cases, share_gpu, to_device, to_host

from ringcomm import ArgumentError, DesyncError
from ringcomm.core import device
from ringcomm.core.arrays import IN_FLIGHT, keep_until_done
from ringcomm.errors import CommError
from ringcomm.observe.steps import TraceEvent
from ringcomm.plan.cost import DEFAULT_DEVICE_PARAMS
from ringcomm.plan.settings import _check_match as check_match
from ringcomm.plan.settings import propose
from ringcomm.runtime.local import run_group
from ringcomm.testing import FakeDeviceArray

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


def _settled_live() -> int:
    """The fake runtime's live allocations once what earlier tests left behind is gone:
    arrays dropped (a collection) and arrays still held for device work in flight
    (``keep_until_done`` holds a bounded number: as many empty holds push them all out)."""
    gc.collect()
    event = RUNTIME.new_event()
    RUNTIME.record(event, RUNTIME.current_stream())
    for _ in range(IN_FLIGHT.LIMIT + 1):
        keep_until_done(RUNTIME, event, 0)
    gc.collect()
    return RUNTIME.live_allocations()


def _run_matrix(world: int, engine: str, cases: list[Case],
                hosts: list[list[int]] | None = None) -> set[str]:
    """Run ``cases`` on device memory, check them, and return the engines that ran them
    (the barrier's empty host buffer aside)."""
    before = _settled_live()
    trace: list[TraceEvent] = []
    results = run_group(world, lambda comm: run_cases(comm, cases), device="fake",
                        segment_bytes=64, trace=trace, hosts=hosts, timeout=30)
    check(cases, world, results)
    assert _settled_live() == before, "device memory left after close"
    return {e.engine for e in trace if not e.op.startswith("barrier")}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=slow)])
def test_every_collective_on_device_memory(engine_env, engine, world):
    """float32 at every world size, bfloat16 and int64 at three ranks: each collective (its
    ops, roots, sizes) and allreduce by each algorithm, run by the device engine named. The
    default suite stops at three ranks (a power of two and not); four are in the slow suite,
    here and in full."""
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


def test_more_pieces_than_slots_before_a_receive(engine_env):
    """Recursive doubling and halving-doubling send many pieces to a peer before they
    receive from it: far more than cuda-ipc's slots, so its sends must not wait for the
    peer's credits (both ranks would wait for ever)."""
    engine_env("cuda-ipc")

    def fn(comm):
        x = FakeDeviceArray.from_host(np.full(4096, comm.rank + 1.0, np.float32))
        comm.allreduce(x, algorithm="rd")
        comm.allreduce(x, algorithm="hd")
        out = x.to_host()
        x.close()
        return comm.selector.choose("allreduce", 4 * 4096, 4, memory=RUNTIME.memory,
                                    forced="rd"), out

    (choice, out), _ = run_group(2, fn, device="fake", segment_bytes=64, timeout=20)
    assert choice.engine == "cuda-ipc", choice
    assert out.tolist() == [6.0] * 4096


@pytest.mark.parametrize("engine", [pytest.param("cuda-ipc", marks=slow), "staged"])
def test_buffers_that_grow_give_the_smaller_ones_back(engine_env, engine):
    """A larger segment size mid-run: the staged channel's bounce buffers (page-locked) and
    device staging grow; the ones they replace are unregistered and freed (a leak shows in
    the live count), and the sums stay right."""
    engine_env(engine)

    def fn(comm):
        got = []
        for segment in (64, 1 << 16):
            comm.segment_bytes = segment
            x = FakeDeviceArray.from_host(np.full(50_000, comm.rank + 1.0, np.float32))
            comm.allreduce(x, algorithm="ring")
            got.append(x.to_host()[::997].tolist())
            x.close()
        return got

    before = _settled_live()
    results = run_group(2, fn, device="fake", segment_bytes=64, timeout=30)
    assert results == [[[3.0] * 51] * 2] * 2
    assert _settled_live() == before, "device or page-locked memory left after close"


@pytest.mark.parametrize("world", [1, 2])
def test_many_arrays_dropped_right_after_their_ops_live_until_the_device_is_done(
        engine_env, world):
    """The caller drops its arrays as soon as each op is issued, far more often than the
    engine keeps ops' arrays in flight (``IN_FLIGHT.LIMIT``): the oldest are let go only
    once their work is done (nothing else waits for a group of one's copies). The fake
    gives a dropped array's memory back as a pool would, so one let go early is a fault."""
    engine_env("cuda-ipc")

    def fn(comm):
        for i in range(IN_FLIGHT.LIMIT + 16):
            x = FakeDeviceArray.from_host(np.full(64, float(i + comm.rank), np.float32))
            out = FakeDeviceArray.empty(64 * comm.world_size, np.float32)
            comm.allgather(out, x)
            del x, out
        keep = FakeDeviceArray.from_host(np.ones(4, np.float32))
        comm.allreduce(keep)
        got = keep.to_host()
        keep.close()
        return got.tolist()

    assert run_group(world, fn, device="fake", timeout=60) == [[float(world)] * 4] * world


@pytest.mark.timeout(30)
def test_a_stream_stuck_behind_a_lost_peer_does_not_settle():
    """What a lane's close after a failure asks before it frees (``_settles``): a stream
    waiting for a dead process's event never settles, and the answer comes within the
    time given; a stream with nothing stuck settles."""
    import device_peer
    from device_peer import Peer

    from ringcomm.engines.device import _settles

    peer = Peer("fake")
    theirs: dict = {}
    try:
        memory, event = peer("export", nbytes=64)
        device_peer.open_(RUNTIME, theirs, memory, event)
        peer("produce", values=np.arange(8, dtype=np.float64))
        peer.kill()  # before its device thread ran the record
        peer.proc.join(10)
        stuck, free = RUNTIME.new_stream(), RUNTIME.new_stream()
        RUNTIME.wait_event(stuck, theirs["peer_ready"])
        started = time.monotonic()
        assert not _settles(RUNTIME, stuck, 0.3)
        assert time.monotonic() - started < 5
        assert _settles(RUNTIME, free, 0.3)
        device_peer.close(RUNTIME, theirs)
    finally:
        peer.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_host_arrays_beside_device_arrays_in_one_call(engine_env, engine):
    """A numpy array handed to a device op with a device array: the engine copies it to the
    device for the op, and back where the op writes it."""
    engine_env(engine)

    def fn(comm):
        mine = np.arange(4, dtype=np.float32) + 10 * comm.rank
        out = FakeDeviceArray.empty(8, np.float32)
        comm.allgather(out, mine)  # host input, device output
        gathered = out.to_host()
        x = FakeDeviceArray.from_host(np.arange(8, dtype=np.float32))
        block = np.zeros(4, np.float32)
        comm.reduce_scatter(block, x)  # device input, host output
        scattered = block.copy()  # read at once: the op is over for the host
        x.close()
        out.close()
        return gathered, scattered

    (g0, b0), (g1, b1) = run_group(2, fn, device="fake")
    assert g0.tolist() == g1.tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    assert b0.tolist() == [0, 2, 4, 6] and b1.tolist() == [8, 10, 12, 14]


def test_a_tuned_profile_gives_the_device_engines_their_constants(monkeypatch, tmp_path):
    """``ringcomm tune`` on a GPU writes the device engines' constants under "devices";
    rank 0's profile is agreed, and the choice says it used them."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"params": {}, "devices": {
        "cuda-ipc": {"alpha": 1e-6, "beta": 1e-12, "gamma": 1e-12}}}))
    monkeypatch.setenv("RINGCOMM_PROFILE", str(profile))

    def fn(comm):
        return [comm.selector.choose("allreduce", 1 << 20, 4, memory=RUNTIME.memory,
                                     forced=None).why,
                comm.settings.device_cost("cuda-ipc").alpha,
                comm.settings.device_cost("staged").alpha]

    why, ipc_alpha, staged_alpha = run_group(2, fn, device="fake")[0]
    assert "tuned constants" in why
    assert ipc_alpha == 1e-6 and staged_alpha == DEFAULT_DEVICE_PARAMS["staged"].alpha


def test_a_board_algorithm_is_refused_for_device_memory():
    def fn(comm):
        x = FakeDeviceArray.from_host(np.ones(4, np.float32))
        try:
            with pytest.raises(ArgumentError, match="'twoshot' runs on the shared board"):
                comm.allreduce(x, algorithm="twoshot")
        finally:
            x.close()

    run_group(2, fn, device="fake", board=True)


def test_ranks_that_differ_on_the_device_are_refused_at_init():
    """The device setting must match: one rank on the fake runtime and one without a
    device would run different engines on the same call."""
    proposals = [propose(device="fake")["match"], propose(device="off")["match"]]
    with pytest.raises(ArgumentError, match="ranks disagree on device"):
        check_match(proposals, 0)
    with pytest.raises(ArgumentError, match="device 'gpu' is unknown"):
        propose(device="gpu")


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("what", ["dtype", "count"])
def test_ranks_that_disagree_get_a_desync_error(engine_env, engine, what):
    engine_env(engine)

    def fn(comm):
        dtype = np.float64 if what == "dtype" and comm.rank == 1 else np.float32
        count = 9 if what == "count" and comm.rank == 1 else 8
        # dropped, not closed, after the failure: work the failed op queued may still use
        # it, so the engine keeps it until the group closes
        comm.allreduce(FakeDeviceArray.from_host(np.ones(count, dtype)), algorithm="ring")

    before = _settled_live()
    results = run_group(2, fn, device="fake", return_errors=True, timeout=10)
    assert any(isinstance(r, DesyncError) for r in results), results
    assert all(isinstance(r, CommError) for r in results), results
    assert _settled_live() == before, "a failed op's arrays were not given back at close"


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


@pytest.mark.parametrize("engine", [*ENGINES, "nccl", "host"])
def test_work_a_buffer_asks_for_runs_on_the_callers_stream_after_the_op(engine_env, engine):
    """``DeviceBuffer.then`` (how the torch backend copies a joined list of CUDA tensors back
    into each): queued on the caller's stream once that stream waits for the op, so it sees
    the result, and its event becomes the buffer's ``done``; on every device engine, and
    where a group without a device runtime stages the array through the host."""
    from ringcomm.core.arrays import as_buffer

    if engine != "host":
        engine_env(engine)

    def fn(comm):
        x = FakeDeviceArray.from_host(np.full(8, comm.rank + 1.0, np.float32))
        copy = FakeDeviceArray.from_host(np.zeros(8, np.float32))
        buf = as_buffer(x, name="x")
        seen = []

        def then(mine):
            RUNTIME.copy(copy.ptr, x.ptr, x.nbytes, mine.caller_stream)
            after = RUNTIME.new_event()
            RUNTIME.record(after, mine.caller_stream)
            seen.append(after)
            return after
        buf.then = then
        comm.allreduce(buf)
        out = copy.to_host()
        assert buf.done is seen[0]
        x.close()
        copy.close()
        return out

    device = "off" if engine == "host" else "fake"
    assert [r.tolist() for r in run_group(2, fn, device=device)] == [[3.0] * 8] * 2


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


def job_tight_rings(rank: int, world: int, store: str, transport: str, count: int,
                    segment: int, **_: object) -> list[list[float]]:
    """Staged messages over shared-memory rings far smaller than an op moves: the rings
    wrap many times within one op, so a payload released to the link before its copy to
    the device is done, or a bounce buffer rewritten while a send still reads it (within an
    op, or by the next op), shows up as wrong values. The broadcast moves one way only, so
    the receiver's own sends never make it wait for its copies in between."""
    import ringcomm

    os.environ["RINGCOMM_DEVICE_ENGINE"] = "staged"
    os.environ["RINGCOMM_SHM_BYTES"] = str(64 << 10)
    comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                         transport=transport, device="fake", segment_bytes=segment)
    try:
        x = FakeDeviceArray.from_host(np.arange(count, dtype=np.float32) + rank)
        z = FakeDeviceArray.from_host(np.full(count, -1.0, np.float32))
        out = FakeDeviceArray.empty(count * world, np.float32)
        comm.allgather(out, x)
        comm.allreduce(x, algorithm="ring")
        comm.gather(out if rank == 0 else None, x, root=0)
        comm.allreduce(z, algorithm="ring")  # right after the gather's last sends
        y = FakeDeviceArray.from_host(np.arange(count, dtype=np.float32) * (rank + 1) * -1)
        comm.broadcast(y, root=0)
        every = count // 64
        got = [x.to_host()[::every].tolist(), out.to_host()[::every].tolist(),
               z.to_host()[::every].tolist(), y.to_host()[::every].tolist()]
        for array in (x, z, out, y):
            array.close()
        return got
    finally:
        comm.close()


def job_pinned_rings(rank: int, world: int, store: str, transport: str,
                     **_: object) -> dict[str, object]:
    """Staged messages between ranks of one host: large ones go straight from the device
    into the shared-memory ring's slots (no bounce buffer is made: it would be page-locked
    too), and both rings are page-locked while in use."""
    import ringcomm

    os.environ["RINGCOMM_DEVICE_ENGINE"] = "staged"
    before = RUNTIME.live_allocations()
    comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                         transport=transport, device="fake", segment_bytes=64 << 10)
    try:
        x = FakeDeviceArray.from_host(np.full(1 << 16, rank + 1.0, np.float32))
        comm.allreduce(x, algorithm="ring")
        values = x.to_host()[::4099].tolist()
        x.close()
        peer = 1 - rank
        rings = comm.transport.host_memory(peer)
        registered = RUNTIME.registered()
        pinned = [registered.get(address) == nbytes for address, nbytes in rings]
        others = len(registered) - sum(pinned)
        counters = dict(comm.transport.links[peer].counters)
    finally:
        comm.close()
    return {"values": values, "rings": len(rings), "pinned": pinned, "others": others,
            "counters": counters, "live": RUNTIME.live_allocations() - before}


def test_staged_messages_go_through_the_page_locked_rings(cluster):
    res = cluster.run(2, "test_device_engine.job_pinned_rings", timeout=60)
    for r in res:
        assert r["values"] == [3.0] * len(r["values"])
        assert r["rings"] == 2 and r["pinned"] == [True, True], r  # ours and the peer's
        assert r["others"] == 0, r  # no bounce buffer
        assert r["counters"]["shm"] > 0, r["counters"]
        assert r["live"] == 0, r  # unregistered (and everything freed) at close


@pytest.mark.parametrize("transport,count,segment", [
    ("ipc", 64 << 10, 16 << 10),  # 16 KiB messages through a 64 KiB ring
    ("tcp", 1 << 20, 128 << 10),  # sends that read the bounce buffer until they are out
])
def test_staging_through_links_that_hold_its_memory(cluster, transport, count, segment):
    """Over tight shared-memory rings, and over tcp, whose large sends read the bounce
    buffer until the socket has taken them."""
    world = 2
    res = cluster.run(world, "test_device_engine.job_tight_rings", transport=transport,
                      count=count, segment=segment, timeout=60)
    every = count // 64
    base = np.arange(count, dtype=np.float32)
    total = sum(base + r for r in range(world))
    for rank, (x, out, z, y) in enumerate(res):
        assert x == total[::every].tolist()
        assert z == [-1.0 * world] * len(z)
        assert y == (-base)[::every].tolist()
        if rank == 0:  # the gather of the sums
            assert out == np.concatenate([total] * world)[::every].tolist()
        else:  # the allgather of the inputs
            assert out == np.concatenate([base + r for r in range(world)])[::every].tolist()


def job_killed_mid_op(rank: int, world: int, store: str, transport: str, engine: str,
                      device_name: str = "fake", **_: object) -> dict[str, object]:
    """Rank 2 is killed at its third message of the second allreduce; the others report
    the type of their error and how long it took."""
    import ringcomm

    os.environ["RINGCOMM_DEVICE_ENGINE"] = engine
    # the nccl engine sends each peer one header an op over the links, then NCCL's work:
    # rank 2 dies at its second (msg counts from 0), once rank 0 has its header and may be
    # in NCCL's work
    os.environ["RINGCOMM_FAULTS"] = f"kill:rank=2,call=2,msg={1 if engine == 'nccl' else 3}"
    share_gpu(engine, device_name, rank, world)
    comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=5.0,
                         transport=transport, device=device_name, segment_bytes=1024)
    x = to_device(comm.device, np.ones(4096, np.float32))
    comm.allreduce(x)
    # done on every rank before one dies: the fake runs work only when it is waited for,
    # and work that waits for a dead rank's would stay queued on this thread's stream
    assert to_host(x).tolist() == [3.0] * 4096
    started = time.monotonic()
    outcome: dict[str, object] = {"type": None, "msg": ""}
    try:
        comm.allreduce(x)
        to_host(x)
    except CommError as err:
        outcome = {"type": type(err).__name__, "msg": str(err)}
    finally:
        outcome["elapsed"] = time.monotonic() - started
        aborting = time.monotonic()
        comm.abort("test over")  # what torch's abort of a group calls: prompt, never raises
        outcome["abort_s"] = time.monotonic() - aborting
        del os.environ["RINGCOMM_FAULTS"]  # the rank process may run other jobs after
    return outcome


@pytest.mark.parametrize("engine", ["cuda-ipc", pytest.param("staged", marks=slow),
                                    pytest.param("nccl", marks=slow)])
def test_a_killed_rank_gives_typed_errors_on_the_others_in_time(cluster, engine):
    _killed_rank_case(cluster, engine, "fake")


def _killed_rank_case(cluster, engine: str, device_name: str) -> None:
    # a rank replaced after an earlier kill starts up first, not within the 5 s init
    cluster.run(3, "fault_jobs.job_ready", timeout=60)
    res = cluster.run(3, "test_device_engine.job_killed_mid_op", engine=engine, dies=(2,),
                      timeout=60, device_name=device_name)
    for r in res[:2]:
        assert r["type"] in ("PeerLostError", "RemoteError", "CommTimeout"), r
        assert r["elapsed"] < 5.0 + 2.0, r
        # the abort waits a little for device work that may wait for the dead rank, never
        # the group's timeout (5 s here)
        assert r["abort_s"] < 4.0, r


# --------------------------------------------------------------------------- on the test runtime
# The same matrix and the same kill on the runtime the ``gpu`` tests run on: CuPy arrays on
# a GPU that 1-4 rank processes share (bench/gpu_check.sh), or the fake runtime where
# RINGCOMM_TEST_RUNTIME=fake. On CuPy every dtype the device reduces is checked; on the fake
# runtime float32 only (the default suite has the rest), so gpu_check --fake stays short.
GPU_DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"]


ON_GPU = [*ENGINES, "nccl"]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", ON_GPU)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_collective_and_dtype_on_the_test_runtime(cluster, gpu_device, engine, world):
    """Every collective (its ops, roots, sizes) and allreduce by each algorithm, on device
    arrays of the test runtime shared by ``world`` real processes, each checked against the
    table's reference; nothing of the device memory ringcomm took is left after close. On
    the nccl engine, ranks sharing the GPU each get an NCCL_HOSTID (NCCL over sockets)."""
    dtypes = GPU_DTYPES if gpu_device == "cuda" else ["float32"]
    # on a GPU: sizes that make the slots wrap and the messages go in pieces
    extra = {"blocks": (0, 5, 37, 70_000), "segment_bytes": 64 << 10,
             "slot_bytes": 128 << 10} if gpu_device == "cuda" else {}
    res = cluster.run(world, "device_cases.job_device_matrix", engine=engine, dtypes=dtypes,
                      device_name=gpu_device, timeout=280, **extra)
    assert all(r["live"] == 0 for r in res), [r["live"] for r in res]
    if world > 1:
        assert all(r["chosen"] == engine for r in res), [r["chosen"] for r in res]
    check(res[0]["cases"], world, [r["results"] for r in res])


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ON_GPU)
def test_a_killed_rank_gives_typed_errors_on_the_test_runtime(cluster, gpu_device, engine):
    """On the nccl engine too: the survivors raise within timeout + 2 s, none hangs in
    NCCL (their communicators are aborted)."""
    _killed_rank_case(cluster, engine, gpu_device)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 3])
def test_nccl_own_allreduce_against_ringcomms_schedules_on_the_test_runtime(
        cluster, gpu_device, world):
    """On the GPU (or the fake across processes): NCCL's own allreduce and ringcomm's ring
    and tree as NCCL groups, bit for bit where the order of the additions is the same
    (integers always; floats at two ranks, one commutative addition each); to rounding
    where it is not (floats from three ranks: NCCL's order and the ring's differ)."""
    res = cluster.run(world, "device_cases.job_nccl_bits", device_name=gpu_device,
                      timeout=120)
    for r in res:
        for algorithm in ("ring", "tree"):
            assert r[f"int64/{algorithm}"] == r["int64/nccl"]
            ours = np.frombuffer(r[f"float32/{algorithm}"], np.float32)
            own = np.frombuffer(r["float32/nccl"], np.float32)
            if world == 2:
                assert ours.tobytes() == own.tobytes(), algorithm
            else:
                np.testing.assert_allclose(ours, own, rtol=1e-4, atol=1e-1)
