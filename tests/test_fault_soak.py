"""A short soak in the default suite (``make soak`` runs 300 trials): seeded random faults in
random ops at world sizes 2-4 over real processes, with no hang, no crash of a survivor, no
wrong result returned without an error, and every trial's outcome as the issue promises."""

from __future__ import annotations

import os

import pytest
from fault_soak import WORLD_SIZES, draw, soak

SEED = int(os.environ.get("RINGCOMM_SOAK_SEED", "27"))
TRIALS = 4  # the fault matrix covers every op and action; these mix them at random


@pytest.mark.timeout(120)
def test_a_short_soak_has_no_hang_no_crash_no_wrong_result_and_nothing_unexpected():
    summary = soak(SEED, TRIALS)
    failures = "\n".join(f"trial {i}: {outcome.case.describe()}\n  " + "\n  ".join(problems)
                         for i, outcome, problems in summary.unexpected)
    assert (summary.hangs, summary.crashes, summary.wrong) == (0, 0, 0), summary.table()
    assert not summary.unexpected, (f"{failures}\n{summary.table()}\nagain: python "
                                    f"tests/fault_soak.py --seed {SEED} --only N -v")
    assert summary.total == TRIALS


def test_a_trial_is_the_same_for_its_seed_and_the_trials_cover_every_size_and_action():
    """Trial i of a seed is drawn the same every time and on its own; over many trials
    every world size, action and op kind turns up, and the fault's message is one the
    acting rank sends."""
    first = [draw(5, i) for i in range(300)]
    assert first == [draw(5, i) for i in range(300)]
    assert draw(5, 41) == first[41]
    assert first != [draw(6, i) for i in range(300)]
    assert {c.world for c in first} == set(WORLD_SIZES)
    assert {c.action for c in first} == {"kill", "delay_below", "delay_above", "drop",
                                         "corrupt"}
    assert len({c.op.label.split(" ")[0] for c in first}) >= 11
    for case in first:
        assert 0 <= case.msg < case.op.messages(case.actor, case.world)
