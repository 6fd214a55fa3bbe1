"""The cost model and its tuning: replayed schedules, the fit, the choice, and the knobs that
force or reveal it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from ringcomm import ArgumentError, tune
from ringcomm.observe.steps import TraceEvent
from ringcomm.plan import cost
from ringcomm.runtime.local import run_group
from ringcomm.schedules import ALLREDUCE, Region
from ringcomm.schedules.schedule import StepList


@pytest.fixture(autouse=True)
def no_profile(tmp_path, monkeypatch):
    """Each test sees only the profile it writes, never the user's."""
    monkeypatch.setenv("RINGCOMM_PROFILE", str(tmp_path / "profile.json"))
    monkeypatch.delenv("RINGCOMM_ALGO", raising=False)
    cost._choose.cache_clear()
    return tmp_path / "profile.json"


def test_the_replay_detects_schedules_that_would_deadlock():
    def both_receive_first(rank):
        steps = StepList()
        steps.recv(1 - rank, Region("data", 0, 4))
        steps.send(1 - rank, Region("data", 0, 4))
        return steps.build("allreduce", "broken", rank, 2)

    with pytest.raises(RuntimeError, match="deadlock"):
        cost.simulate([both_receive_first(0), both_receive_first(1)], 4, cost.CostParams())


def test_the_replay_counts_what_a_ring_moves():
    n, count = 4, 4096
    schedules = [ALLREDUCE["ring"](r, n, count, count) for r in range(n)]
    result = cost.simulate(schedules, 4, cost.CostParams())
    # every rank sends 2(n-1) chunks of count/n and receives as many, n-1 of them reduced;
    # n-2 of the sends are partial sums fused with their reduction (no copy of their own)
    chunk = count // n * 4
    copied_sends = 2 * (n - 1) - (n - 2)
    assert result.work.moved == n * (copied_sends * chunk + (n - 1) * chunk)
    assert result.work.reduced == n * (n - 1) * chunk
    assert result.work.messages == n * 2 * (n - 1)  # half an alpha per send and per receive


@pytest.mark.parametrize("world", [3, 4, 8])
def test_predictions_grow_with_size_and_trees_win_small_messages_on_many_ranks(world):
    small = {a: cost.predict("allreduce", a, world, 8) for a in ALLREDUCE}
    big = {a: cost.predict("allreduce", a, world, 64 << 20) for a in ALLREDUCE}
    assert all(big[a] > small[a] for a in ALLREDUCE)
    if world >= 4:
        assert min(small["tree"], small["hd"]) < small["ring"]


def test_fit_recovers_the_constants_that_produced_the_timings():
    truth = cost.CostParams(alpha=250e-6, beta=0.5e-9, gamma=0.1e-9)
    samples = []
    for world in (2, 4):
        share = cost.cores_per_rank(world)
        for name in ALLREDUCE:
            for nbytes in (8, 65536, 1 << 20, 16 << 20):
                terms = cost.allreduce_cost(name, world, nbytes // 4, 4, (2 << 20) // 4)
                samples.append(tune.Sample(terms, share, terms.time(truth, share)))
    fitted = tune.fit(samples, gamma=truth.gamma)
    assert fitted.alpha == pytest.approx(truth.alpha, rel=0.02)
    assert fitted.beta == pytest.approx(truth.beta, rel=0.02)
    assert max(abs(e) for e in tune.relative_errors(samples, fitted)) < 0.02


def test_the_choice_follows_the_profile(no_profile):
    """The same call gets a different, exact algorithm under each profile."""
    def write(alpha, beta, gamma=1e-10):
        no_profile.write_text(json.dumps({"params": {"8": {"alpha": alpha, "beta": beta,
                                                           "gamma": gamma}}}))
        cost._choose.cache_clear()

    write(alpha=1e-3, beta=1e-12)  # messages are everything: fewest rounds wins
    assert cost.choose("allreduce", 4, 4096, share=1.0) == "rd"
    assert cost.choose("allreduce", 2, 64 << 20, share=1.0) == "ring"
    write(alpha=1e-9, beta=1e-9)  # bytes are everything: the ring's bandwidth wins
    assert cost.choose("allreduce", 4, 4096, share=1.0) == "ring"
    assert cost.choose("allreduce", 2, 64 << 20, share=1.0) == "rd"  # one exchange, not two
    write(alpha=1e-9, beta=1e-9, gamma=1e-9)  # two ranks: rd reduces twice what a ring does
    assert cost.choose("allreduce", 2, 64 << 20, share=1.0) == "ring"


def test_a_communicator_chooses_from_the_agreed_settings_and_topology_only(no_profile):
    """Not from this process's profile or affinity: the agreed constants and the gathered
    cores decide, so every rank that holds them decides the same."""
    from ringcomm.plan.settings import Settings
    from ringcomm.plan.topology import RankFacts, Topology
    from ringcomm.runtime.communicator import Communicator
    from ringcomm.transport.inmemory import InMemoryNetwork

    no_profile.write_text(json.dumps({"params": {"4": {"alpha": 1e-9, "beta": 1e-9,
                                                       "gamma": 1e-10}}}))  # says "ring"
    cost._choose.cache_clear()
    fewest_rounds = {4: cost.CostParams(alpha=1e-3, beta=1e-12, gamma=1e-10)}

    def chosen(params, cpus_per_host, nbytes):
        host = RankFacts("h", "h", tuple(range(cpus_per_host)), 1)
        comm = Communicator(InMemoryNetwork(4).transport(0),
                            settings=Settings(params=params),
                            topology=Topology((host,) * 4))
        try:
            return comm.allreduce_algorithm(nbytes)
        finally:
            comm.close()

    assert chosen(fewest_rounds, 4, 4096) == "rd"
    assert chosen({}, 4, 4096) == "rd"  # no profile agreed: the defaults, not the local file
    assert chosen({4: cost.CostParams(alpha=1e-9, beta=1e-9, gamma=1e-10)}, 4, 4096) == "ring"
    # the gathered cores decide: four ranks on one core each, or sharing two, where
    # reducing costs more than a message (the work shared cores do, not the rounds)
    costly_sums = {4: cost.CostParams(alpha=1e-5, beta=1e-10, gamma=1e-8)}
    assert chosen(costly_sums, 4, 8) == "rd"
    assert chosen(costly_sums, 2, 8) == "hd"
    # with the defaults, a few bytes go the fewest rounds either way (the work is a tie)
    assert chosen({}, 4, 8) == chosen({}, 2, 8) == "rd"


def test_an_unreadable_profile_falls_back_to_the_defaults(no_profile):
    no_profile.write_text("{not json")
    assert cost.load_profile().params == {}
    assert cost.choose("allreduce", 4, 1 << 20) in ALLREDUCE


def test_a_forced_algorithm_must_exist(monkeypatch):
    def fn(comm):
        with pytest.raises(ArgumentError, match="'rign'.*use one of ring, tree, dbtree, hd, rd"):
            comm.allreduce(np.ones(4), algorithm="rign")
        return True

    assert run_group(1, fn) == [True]
    monkeypatch.setenv("RINGCOMM_ALGO", "treee")  # read once, when the group is made
    with pytest.raises(ArgumentError, match="RINGCOMM_ALGO='treee' is not an allreduce "
                                            "algorithm; use one of ring, tree, dbtree, hd, rd"):
        run_group(1, lambda comm: None)


def test_every_call_shows_its_algorithm_in_the_trace_and_the_debug_log(monkeypatch, caplog):
    trace: list[TraceEvent] = []
    monkeypatch.setenv("RINGCOMM_ALGO", "dbtree")

    def fn(comm):
        x = np.full(100, float(comm.rank))
        comm.allreduce(x)
        comm.allreduce(x, algorithm="hd")
        return x

    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        results = run_group(4, fn, trace=trace)
    np.testing.assert_array_equal(results[0], 4 * 6.0)
    used = {(e.op, e.algorithm) for e in trace}
    assert used == {("allreduce #0", "dbtree"), ("allreduce #1", "hd")}
    assert any("allreduce/dbtree" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tune_measures_and_writes_a_profile_the_communicator_reads(tmp_path):
    out = tmp_path / "tuned.json"
    proc = subprocess.run([sys.executable, "-m", "ringcomm.cli", "tune", "-n", "2", "--quick",
                           "-o", str(out)], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr
    profile = cost.Profile.from_json(out.read_text(), str(out))
    params = profile.params[2]
    assert 1e-6 <= params.alpha < 0.1 and 1e-12 <= params.beta < 1e-6 and params.gamma > 0
    assert profile.segment_bytes in tune.SEGMENTS
    assert "median |error|" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tune_on_a_device_adds_the_device_engines_and_keeps_the_host_constants(tmp_path):
    """``ringcomm tune --device fake``: both device engines fitted into the profile file,
    whose host constants stay as they were; a group reading it prices device memory with
    them ("tuned")."""
    out = tmp_path / "tuned.json"
    host = cost.Profile(params={2: cost.CostParams(alpha=7e-6, beta=1e-10, gamma=1e-10)},
                        segment_bytes=1 << 20)
    out.write_text(host.to_json())
    proc = subprocess.run([sys.executable, "-m", "ringcomm.cli", "tune", "--device", "fake",
                           "-n", "2", "--quick", "-o", str(out)], capture_output=True, text=True,
                          timeout=110, env={**os.environ, "RINGCOMM_FAKE_DEVICES": "2"})
    assert proc.returncode == 0, proc.stderr
    profile = cost.Profile.from_json(out.read_text(), str(out))
    assert profile.params == host.params and profile.segment_bytes == 1 << 20
    # two fake devices: a rank on each, so the kernel path's algorithms are fitted too
    assert set(profile.devices) == {"cuda-ipc", "staged", "kernel-oneshot", "kernel-twoshot"}
    for params in profile.devices.values():
        assert 0 < params.alpha < 0.1 and 0 < params.beta < 1e-6 and params.gamma > 0
    assert proc.stdout.count("median |error|") == 4 and "device reduction" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tune_says_why_it_leaves_the_kernel_path_unmeasured(tmp_path):
    """Ranks sharing one device without MPS cannot take the kernel path: its defaults stay,
    and the log says why."""
    out = tmp_path / "tuned.json"
    proc = subprocess.run([sys.executable, "-m", "ringcomm.cli", "tune", "--device", "fake",
                           "-n", "2", "--quick", "-o", str(out)], capture_output=True, text=True,
                          timeout=110, env={**os.environ, "RINGCOMM_FAKE_DEVICES": "1"})
    assert proc.returncode == 0, proc.stderr
    assert set(cost.Profile.from_json(out.read_text(), str(out)).devices) == {"cuda-ipc",
                                                                              "staged"}
    assert "cuda-kernel: not measured on 2 ranks: ranks 0,1 share GPU fake:0 without MPS" \
        in proc.stdout


TWO_BY_TWO = ((0, 1), (2, 3))
GIGABIT = cost.CostParams(alpha=100e-6, beta=8e-9, gamma=0.09e-9)  # 1 Gbit/s between hosts


def test_the_model_counts_the_bytes_each_host_sends_to_the_others():
    """A flat ring of 2 x 2 ranks sends 1.5 N across each host's link (two of its four
    hops cross), hier N (the leaders' ring of two), recursive doubling 2 N (both ranks of
    a host exchange with the other host at once); on one host nothing crosses."""
    n = 1 << 20
    link = {a: cost.allreduce_cost(a, 4, n // 4, 4, (2 << 20) // 4, TWO_BY_TWO).link_bytes
            for a in ("ring", "hier", "rd")}
    assert link == {"ring": 1.5 * n, "hier": n, "rd": 2 * n}
    assert cost.allreduce_cost("ring", 4, n // 4, 4, (2 << 20) // 4).link_bytes == 0


def test_hier_is_chosen_where_the_link_between_hosts_is_what_costs():
    def chosen(nbytes, remote, hosts=TWO_BY_TWO):
        return cost.choose("allreduce", 4, nbytes, 4, segment_bytes=2 << 20,
                           params=cost.DEFAULT_PARAMS[4], share=1.0, hosts=hosts,
                           remote=remote)

    assert chosen(64 << 20, GIGABIT) == "hier"
    assert chosen(16 << 20, GIGABIT) == "hier"
    assert chosen(8, GIGABIT) == "rd"  # small: the fewest rounds still wins
    assert chosen(64 << 20, cost.DEFAULT_PARAMS[4], hosts=None) == "ring"  # one host: never
    ring = cost.predict("allreduce", "ring", 4, 64 << 20, hosts=TWO_BY_TWO, remote=GIGABIT,
                        share=1.0)
    hier = cost.predict("allreduce", "hier", 4, 64 << 20, hosts=TWO_BY_TWO, remote=GIGABIT,
                        share=1.0)
    assert 1.3 < ring / hier < 1.5  # at most the 1.5x fewer bytes it sends across


def test_the_link_between_hosts_is_measured_once_and_agreed():
    """Rank 0 and the first rank on another host time round trips; every rank then prices
    the link with rank 0's numbers and chooses accordingly. One host: nothing to measure."""
    from ringcomm.bootstrap.link_probe import measure_remote

    def fn(comm):
        before = comm.settings.remote
        remote = measure_remote(comm)
        return before, remote, comm.settings.remote, comm.allreduce_algorithm(64 << 20)

    results = run_group(4, fn, hosts=[[0, 2], [1, 3]])
    assert all(r[0] is None for r in results)  # nothing known before
    measured = {r[1] for r in results}
    assert len(measured) == 1 and results[0][1] == results[0][2]  # agreed and adopted
    remote = results[0][1]
    assert 0 < remote.alpha < 0.1 and 0 < remote.beta < 1e-6
    assert len({r[3] for r in results}) == 1
    assert run_group(2, lambda comm: measure_remote(comm)) == [None, None]
