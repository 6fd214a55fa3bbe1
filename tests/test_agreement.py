"""Settings that ranks must agree on are agreed, not assumed (``ringcomm.plan.settings``).

Real processes, each with its own environment: a forced algorithm on one rank only is an
error at init on every rank; different tuned profiles and different CPU affinities end in
one agreed choice and right results; different versions are named. The settings table in
the code covers every ``RINGCOMM_*`` variable the library reads.

The default suite runs the agreement at world 2 (a setting on one rank only, one on every
rank, different versions, different tuned profiles); the larger worlds, CPU affinity and
wrong settings are marked slow.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from ringcomm.plan import cost
from ringcomm.plan.settings import SETTINGS, Scope

slow = pytest.mark.slow


def _quick(result):
    assert "init_error" not in result, result["init_error"]
    return result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,odd", [(2, 1), pytest.param(3, 1, marks=slow),
                                       pytest.param(3, 0, marks=slow)])
def test_a_forced_algorithm_on_some_ranks_only_is_an_error_at_init_on_every_rank(
        cluster, world, odd):
    env = {odd: {"RINGCOMM_ALGO": "tree"}}
    for r in range(world):
        env.setdefault(r, {"RINGCOMM_ALGO": None})
    res = cluster.run(world, "job_agreement", env=env)
    others = [r for r in range(world) if r != odd]
    who = f"rank {others[0]} has" if len(others) == 1 else \
        f"ranks {', '.join(map(str, others))} have" if others != [1, 2] else "ranks 1-2 have"
    first, second = (f"{who} it unset", f"rank {odd} has 'tree'")
    parts = f"{first}; {second}" if others[0] < odd else f"{second}; {first}"
    for r, x in enumerate(res):
        err = x["init_error"]
        assert err["type"] == "ArgumentError" and err["rank"] == r, err
        assert err["msg"] == (
            f"[rank {r}] ranks disagree on algorithm (RINGCOMM_ALGO): {parts}. It must be "
            "the same on every rank: set it on all of them or on none."), err["msg"]
        assert err["elapsed"] < 10.0  # far from the 30 s timeout


@pytest.mark.timeout(60)
def test_a_forced_algorithm_on_every_rank_is_agreed_and_run(cluster):
    env = {r: {"RINGCOMM_ALGO": "tree"} for r in range(2)}
    sizes = (8, 1 << 20)
    for x in cluster.run(2, "job_agreement", env=env, sizes=sizes):
        assert _quick(x)["chosen"] == {n: "tree" for n in sizes}
        assert x["right"] == [True] * len(sizes)


@pytest.mark.timeout(60)
def test_different_versions_are_named_at_init(cluster):
    res = cluster.run(2, "job_agreement", env={}, version={1: "9.9.9"})
    for r, x in enumerate(res):
        assert x["init_error"]["msg"].startswith(
            f"[rank {r}] ranks run different software: the ringcomm version differs (rank 0 "
            "has '0.1.0'; rank 1 has '9.9.9'). Install the same ringcomm on every host.")


def _profile(path: Path, segment: int, alpha: float, beta: float) -> str:
    path.write_text(json.dumps({"segment_bytes": segment, "params": {
        "2": {"alpha": alpha, "beta": beta, "gamma": 1e-10}}}))
    return str(path)


@pytest.mark.timeout(60)
def test_ranks_with_different_tuned_profiles_run_rank_0s(cluster, tmp_path):
    """One host tuned (small segments, messages dear), the other not or differently: every
    rank runs rank 0's segment size and constants, so 1-8 MiB allreduces are right instead
    of failing on segment sizes that differ."""
    a = _profile(tmp_path / "a.json", 512 << 10, alpha=1e-3, beta=1e-12)
    b = _profile(tmp_path / "b.json", 4 << 20, alpha=1e-9, beta=1e-9)
    sizes = (8, 4096, 1 << 20, 4 << 20, 8 << 20)
    for env in ({0: {"RINGCOMM_PROFILE": a}, 1: {"RINGCOMM_PROFILE": b}},
                {0: {"RINGCOMM_PROFILE": a}, 1: {"RINGCOMM_PROFILE": str(tmp_path / "none")}}):
        res = [_quick(x) for x in cluster.run(2, "job_agreement", env=env, sizes=sizes)]
        assert [x["segment"] for x in res] == [512 << 10] * 2
        assert [x["profile"] for x in res] == [a, a]
        assert res[0]["params"] == res[1]["params"] == cost.CostParams(1e-3, 1e-12, 1e-10)
        assert res[0]["chosen"] == res[1]["chosen"]
        assert all(all(x["right"]) for x in res), res


@slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to differ in")
def test_ranks_with_different_cpu_affinity_choose_the_same_algorithm(cluster, tmp_path):
    """Rank 1 runs on one core (as under `taskset -c 0`), rank 0 on all. Each used to read
    its own affinity and choose differently (tree on one, rd or ring on the other), giving
    wrong sums; the cores come from the gathered table now, the same on both."""
    cpus = sorted(os.sched_getaffinity(0))
    sizes = (8, 4096, 65536, 1 << 20, 4 << 20)
    # a tuned profile under which the cores decide (messages cheap: the total work counts)
    profile = _profile(tmp_path / "p.json", 2 << 20, alpha=1e-6, beta=1e-11)
    params = cost.CostParams(1e-6, 1e-11, 1e-10)
    local_views = {share: [cost.choose("allreduce", 2, n, 4, segment_bytes=2 << 20,
                                       params=params, share=share) for n in sizes]
                   for share in (0.5, 1.0)}
    assert local_views[0.5] != local_views[1.0]  # each rank on its own would differ
    # the links' algorithms at every size (with the board, small ones would take that)
    env = {r: {"RINGCOMM_PROFILE": profile, "RINGCOMM_ALGO": None, "RINGCOMM_BOARD": "0"}
           for r in range(2)}
    res = [_quick(x) for x in cluster.run(2, "job_agreement", env=env, sizes=sizes,
                                          cpus={1: cpus[:1]})]
    assert res[0]["chosen"] == res[1]["chosen"]
    assert [res[0]["chosen"][n] for n in sizes] == local_views[1.0]  # both cores, two ranks
    assert [x["cores_per_rank"] for x in res] == [1.0, 1.0]
    assert all(all(x["right"]) for x in res), res


def test_every_setting_is_read_through_its_row_of_the_table():
    """No module reads a RINGCOMM_* variable itself: each is parsed by its row of the table
    (``ringcomm.core.config``), which every variable of the table has, with a default that
    its help shows."""
    root = Path(__file__).resolve().parent.parent / "ringcomm"
    read = {path.relative_to(root).as_posix(): found for path in root.rglob("*.py")
            if (found := re.findall(r"environ(?:\.get)?[\(\[]\s*\"(RINGCOMM_\w+)\"",
                                    path.read_text()))}
    assert not read, f"read outside the settings table: {read}"
    assert all(s.parse is not None and s.shown_default for s in SETTINGS if s.env)
    assert {s.scope for s in SETTINGS} == set(Scope)


@slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("variable,value,says", [
    ("RINGCOMM_ALGO", "treee", "RINGCOMM_ALGO='treee' is not an allreduce algorithm"),
    ("RINGCOMM_SOCKET_IFNAME", "nosuch0", "RINGCOMM_SOCKET_IFNAME='nosuch0': interface "
                                          "'nosuch0' does not exist"),
    # read only deep in the set-up of links: checked at init with every other setting
    ("RINGCOMM_BOARD", "maybe", "RINGCOMM_BOARD='maybe' is not a switch"),
])
def test_a_rank_whose_own_setting_is_wrong_is_named_by_every_rank_at_once(
        cluster, variable, value, says):
    """The rank with the mistake raises it; the others do not wait out the timeout for a
    rank that will never come: they raise at once, naming it and its error."""
    env = {r: {variable: value if r == 1 else None} for r in range(3)}
    res = cluster.run(3, "job_agreement", env=env)
    for r, x in enumerate(res):
        err = x["init_error"]
        assert err["type"] == "ArgumentError" and err["elapsed"] < 10.0, err
        assert says in err["msg"], err
        if r != 1:
            assert err["msg"].startswith(f"[rank {r}] rank 1 could not join the group: "), err
