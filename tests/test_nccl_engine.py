"""The NCCL engine on the strict fake runtime and fake NCCL (ranks are threads of one
process): every collective correct, NCCL's own calls and ringcomm's schedules as NCCL
groups; the unique id through the store within its deadline; agreement checked before any
NCCL work; and the deadline NCCL lacks: a rank that never joins an op makes every other
rank abort its communicator and raise a typed error naming rank, op and peer, promptly, and
the aborted communicator is never used again."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from device_cases import Case, cases_for, check, run_cases, to_device, to_host

from ringcomm.core import device
from ringcomm.engines.exchange import Table, TableExchange
from ringcomm.engines.nccl import open_channel
from ringcomm.errors import CommAborted, CommError, CommTimeout, DesyncError, RemoteError
from ringcomm.observe.steps import TraceEvent
from ringcomm.runtime.local import run_group

pytestmark = pytest.mark.timeout(120)
RUNTIME = device.runtime("fake")
NCCL = device.nccl_library(RUNTIME)  # ringcomm's CuPy adapter over the fake CuPy module


@pytest.fixture
def nccl_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGCOMM_DEVICE_ENGINE", "nccl")


def run_matrix(world: int, cases: list[Case]) -> list[str]:
    trace: list[TraceEvent] = []
    def rank(comm):
        engines = [comm.choose(name, block * 4, 4, memory=comm.device.memory,
                               algorithm=algorithm).engine
                   for name, block, _, _, _, algorithm in cases if name != "barrier"]
        return run_cases(comm, cases), engines
    results = run_group(world, rank, device="fake", segment_bytes=64, trace=trace,
                        timeout=30)
    check(cases, world, [r[0] for r in results])
    return [e for r in results for e in r[1]]


@pytest.mark.parametrize("world", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_collective_over_nccl(nccl_engine: None, world: int) -> None:
    """Each collective (NCCL's own call where it has one, ringcomm's schedules as NCCL groups
    for the others) and allreduce by every algorithm as NCCL groups and by NCCL's own; at
    four ranks in the slow suite (two and three, a power of two and not, in the default)."""
    cases = cases_for(world, ["float32"], blocks=(0, 5, 37),
                      algorithms=("ring", "tree", "dbtree", "hd", "rd", "nccl"))
    engines = run_matrix(world, cases)
    assert set(engines) <= {"nccl"}


def test_other_dtypes_over_nccl(nccl_engine: None) -> None:
    run_matrix(3, cases_for(3, ["int64", "bfloat16"], blocks=(5,),
                            algorithms=("ring", "nccl")))


def test_the_choice_on_the_nccl_engine(nccl_engine: None) -> None:
    """Device memory goes to the nccl engine: NCCL's own call where it has one (an allreduce
    by the cost model, against the schedules as NCCL groups), the schedules for the rest;
    host memory stays on the links."""
    def rank(comm):
        memory = comm.device.memory
        made = {c: comm.choose(c, 1 << 20, 4, memory=memory) for c in
                ("allreduce", "broadcast", "alltoall", "gather")}
        made["small"] = comm.choose("allreduce", 8, 4, memory=memory)
        made["forced"] = comm.choose("allreduce", 8, 4, memory=memory, algorithm="ring")
        made["host"] = comm.choose("allreduce", 8, 4)
        return made
    choices = run_group(4, rank, device="fake")[0]
    assert {c: (ch.engine, ch.algorithm) for c, ch in choices.items()
            if c not in ("allreduce", "host")} == {
        "broadcast": ("nccl", "nccl"), "alltoall": ("nccl", "pairwise"),
        "gather": ("nccl", "direct"), "small": ("nccl", "nccl"), "forced": ("nccl", "ring")}
    assert choices["allreduce"].engine == "nccl"
    assert "cost model" in choices["allreduce"].why and "cost model" in choices["small"].why
    assert "as NCCL groups" in choices["alltoall"].why
    assert choices["host"].engine != "nccl"


# --------------------------------------------------------------------------- set-up


def test_the_unique_id_goes_through_the_exchange() -> None:
    table = Table()
    made: list[object] = [None, None]

    def rank(r: int) -> None:
        made[r] = open_channel(RUNTIME, NCCL, TableExchange(table, r), r, 2, 5.0)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    uid = table.values[("nccl-id", 0)]
    assert len(uid) == 128 and ("nccl-id", 1) not in table.values  # rank 0 draws it alone
    for channel in reversed(made):  # rank 0 serves the fake's broker: it ends last
        channel.close()  # type: ignore[union-attr]


def test_a_missing_unique_id_is_a_timeout_naming_rank_0() -> None:
    started = time.monotonic()
    with pytest.raises(CommTimeout) as caught:
        open_channel(RUNTIME, NCCL, TableExchange(Table(), 1), 1, 2, 0.5)
    assert time.monotonic() - started < 3
    assert caught.value.peer == 0 and caught.value.op == "device set-up"
    assert "never published its 'nccl-id'" in str(caught.value)


def test_a_rank_that_never_connects_is_a_timeout() -> None:
    table = Table()
    TableExchange(table, 0).publish("nccl-id", NCCL.unique_id())
    started = time.monotonic()
    with pytest.raises(CommTimeout, match="NCCL waits for every rank"):
        open_channel(RUNTIME, NCCL, TableExchange(table, 1), 1, 3, 0.5)
    assert time.monotonic() - started < 3


# --------------------------------------------------------------------------- failures


def test_ranks_that_disagree_get_desync_errors_not_a_hang(nccl_engine: None) -> None:
    def rank(comm):
        x = to_device(comm.device, np.ones(8 if comm.rank else 16, np.float32))
        comm.allreduce(x)
        return to_host(x)
    results = run_group(2, rank, device="fake", timeout=5, return_errors=True)
    assert all(isinstance(r, (DesyncError, RemoteError)) for r in results), results
    assert any(isinstance(r, DesyncError) for r in results)


def test_a_rank_that_stays_away_makes_every_other_abort_and_raise(nccl_engine: None) -> None:
    """Rank 2 never joins the allreduce: ranks 0 and 1 are stuck in NCCL work that waits for
    it. Each raises within its timeout and a little: a CommTimeout naming the op and a peer,
    or a RemoteError naming the rank that failed first; their communicators are aborted,
    and the next op says so instead of touching them."""
    timeout = 1.5
    release = threading.Barrier(3)

    def rank(comm):
        x = to_device(comm.device, np.ones(64, np.float32))
        if comm.rank == 2:
            release.wait(timeout + 5)  # until the others are done with it
            return "stayed away"
        started = time.monotonic()
        try:
            comm.allreduce(x, algorithm="ring")
        except CommError as err:
            took = time.monotonic() - started
            try:
                comm.allreduce(x)
            except CommAborted as again:
                return err, took, again
            finally:
                release.wait(timeout + 5)
            return err, took, None
        release.wait(timeout + 5)
        return "finished?", time.monotonic() - started, None
    results = run_group(3, rank, device="fake", timeout=timeout, return_errors=True)
    for r in (0, 1):
        err, took, again = results[r]
        assert isinstance(err, (CommTimeout, RemoteError)), results
        assert took < timeout + 2, (r, took)
        assert err.rank == r and err.op.startswith("allreduce")
        assert err.peer is not None
        assert again is not None
    assert any(isinstance(results[r][0], CommTimeout) for r in (0, 1))


def test_a_stuck_nccl_op_times_out_and_the_abort_reaches_every_rank(
        nccl_engine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2's NCCL work never runs (its group calls vanish, as on a GPU that hangs), after
    every header was exchanged: ranks 0 and 1 wait in NCCL. Rank 0 reaches its deadline
    first, aborts its communicator and raises CommTimeout naming the op and a peer of the
    group that waits; rank 1, which started later, hears it over the control plane before
    its own deadline and raises RemoteError naming rank 0. Both communicators are aborted."""
    from ringcomm.testing import fake_nccl

    original = fake_nccl.FakeNcclCommunicator._launch

    def lost_on_rank_2(self: fake_nccl.FakeNcclCommunicator, calls: list) -> None:
        if self.rank != 2:
            original(self, calls)
    monkeypatch.setattr(fake_nccl.FakeNcclCommunicator, "_launch", lost_on_rank_2)
    timeout = 1.5

    def rank(comm):
        x = to_device(comm.device, np.ones(64, np.float32))
        if comm.rank == 1:
            time.sleep(0.7)
        started = time.monotonic()
        try:
            comm.allreduce(x, algorithm="ring")
        except CommError as err:
            return err, time.monotonic() - started, comm.wiring.lanes["nccl"].channel.ended
        return None, time.monotonic() - started, ""
    results = run_group(3, rank, device="fake", timeout=timeout, return_errors=True)
    (first, took0, ended0), (second, took1, ended1) = results[0], results[1]
    assert isinstance(first, CommTimeout), results
    assert first.rank == 0 and first.op.startswith("allreduce") and first.peer in (1, 2)
    assert "NCCL" in str(first) and took0 < timeout + 1
    assert isinstance(second, RemoteError), results
    assert second.peer == 0 and second.rank == 1 and took1 < timeout
    assert ended0.startswith("aborted") and ended1.startswith("aborted")


def test_describe_and_env_say_where_nccl_runs(nccl_engine: None,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    described = run_group(3, lambda comm: comm.describe(), device="fake")
    assert "nccl: nccl 2.28.9 (fake; every pair: 1<->0, 1<->2)" in described[1]
    from ringcomm.environment import device_report

    monkeypatch.setenv("RINGCOMM_DEVICE", "fake")
    report = "\n".join(device_report())
    assert "RINGCOMM_DEVICE_ENGINE=nccl): nccl only" in report
    assert "nccl: 2.28.9 (fake; used where RINGCOMM_DEVICE_ENGINE=nccl)" in report


def test_nccl_own_allreduce_against_the_schedules_bit_for_bit(nccl_engine: None) -> None:
    """NCCL's own call and ringcomm's schedules as NCCL groups give the same bits where they
    add in the same order: integers always, and floats at two ranks (each element is one
    addition of two values, and IEEE addition commutes). From three ranks on, floats are
    added in another order (the ring's, against NCCL's), so they agree to rounding only."""
    def rank(comm):
        rng = np.random.default_rng(comm.rank)
        out = {}
        for dtype in ("float32", "int64"):
            values = (rng.standard_normal(1000) * 1e3).astype(dtype)
            for algorithm in ("nccl", "ring", "tree"):
                x = to_device(comm.device, values)
                comm.allreduce(x, algorithm=algorithm)
                out[(dtype, algorithm)] = to_host(x)
        return out
    for world in (2, 3):
        got = run_group(world, rank, device="fake")[0]
        for algorithm in ("ring", "tree"):
            assert got[("int64", algorithm)].tobytes() == got[("int64", "nccl")].tobytes()
            own, ours = got[("float32", "nccl")], got[("float32", algorithm)]
            if world == 2:
                assert own.tobytes() == ours.tobytes(), algorithm
            else:
                np.testing.assert_allclose(ours, own, rtol=1e-5, atol=1e-2)


def test_dtypes_and_reductions_nccls_own_calls_lack_run_as_nccl_groups(
        nccl_engine: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's own calls take no bool, int16 or complex and no bitwise reduction: those go
    through ringcomm's schedules as NCCL groups (bytes), right, on the nccl engine; forcing
    NCCL's own call on them is an ArgumentError saying so."""
    import device_cases

    for name, dtype in (("bool", np.bool_), ("int16", np.int16), ("complex64", np.complex64)):
        monkeypatch.setitem(device_cases.DTYPES, name, dtype)
    cases: list[Case] = [
        ("broadcast", 5, "bool", "sum", 0, None), ("allgather", 5, "bool", "sum", 0, None),
        ("allreduce", 37, "int16", "sum", 0, None), ("reduce", 5, "int16", "max", 2, None),
        ("reduce_scatter", 5, "int16", "sum", 0, None),
        ("allreduce", 37, "complex64", "sum", 0, None),
        ("allreduce", 37, "int32", "band", 0, None), ("allreduce", 37, "int64", "bxor", 0, None),
        ("broadcast", 5, "complex64", "sum", 1, None)]
    assert set(run_matrix(3, cases)) == {"nccl"}

    def forced(comm):
        x = to_device(comm.device, np.ones(8, np.int16))
        choice = comm.choose("allreduce", x)
        with pytest.raises(CommError, match="does not take this dtype"):
            comm.allreduce(x, algorithm="nccl")
        return choice
    choice = run_group(2, forced, device="fake")[0]
    assert (choice.engine, choice.algorithm) != ("nccl", "nccl"), choice
    assert "does not take this dtype" in choice.why, choice
