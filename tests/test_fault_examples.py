"""The worked example of the user's guide (``examples/fault_injection``) runs as its reader
would run it, with pytest, and passes: a fault-injection test of a small DDP training script
over real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent / "examples" / "fault_injection" / "test_train_faults.py"


def _pytest(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(EXAMPLE), *args], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_examples_test_of_a_rank_killed_mid_training_passes():
    assert "1 passed" in _pytest("-k", "killed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_test_of_the_example_passes():
    assert "2 passed" in _pytest()
