"""Elastic restarts: ``examples/elastic_training.py`` under ``torchrun --max-restarts 1``,
whose rank 1 SIGKILLs itself mid-training on the first attempt, restarts from its last
checkpoint and ends with exactly the weights of a run without the fault; and neither run
leaves anything in /dev/shm or the ipc folders' base.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mp_helpers import files_of

from ringcomm.transport import shm_ring

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "elastic_training.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")

pytestmark = [
    pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not next to this python"),
    pytest.mark.skipif(not shm_ring.available(), reason="needs /dev/shm"),
]


def train(folder: Path, *fault: str) -> subprocess.CompletedProcess:
    """One ``torchrun`` of the example into ``folder``; killed whole (its workers too) if it
    outlives its time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    env["RINGCOMM_DEBUG"] = "INFO"  # the sweep says what it removes: nothing of these runs
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "3", "--max-restarts", "1",
           "--monitor-interval", "0.1", str(EXAMPLE), "--dir", str(folder), *fault]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{out}\n{err[-4000:]}"
    return result


def worker_pids(folder: Path) -> dict[str, int]:
    """``attempt-rank`` -> the pid of that worker, as the example wrote it."""
    return {p.name[len("pid-"):]: int(p.read_text()) for p in folder.glob("pid-*")}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_mid_training_restarts_from_its_checkpoint_to_the_same_weights(
        tmp_path):
    faulted = train(tmp_path / "faulted", "--kill-rank", "1", "--kill-step", "10")
    clean = train(tmp_path / "clean")

    # rank 1 died in epoch 1 (6 steps an epoch); the restart resumed after epoch 0
    assert re.search(r"exitcode: -9\) local_rank: 1", faulted.stderr), faulted.stderr[-3000:]
    assert "attempt 1: resumed from the checkpoint at epoch 1" in faulted.stdout, faulted.stdout
    assert "done after attempt 1" in faulted.stdout, faulted.stdout
    assert "resumed" not in clean.stdout and "done after attempt 0" in clean.stdout

    weights = [torch.load(tmp_path / run / "final.pt") for run in ("faulted", "clean")]
    assert list(weights[0]) == list(weights[1])
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name

    pids = worker_pids(tmp_path / "faulted")
    assert sorted(pids) == [f"{a}-{r}" for a in (0, 1) for r in range(3)], pids
    every = [*pids.values(), *worker_pids(tmp_path / "clean").values()]
    assert files_of(every) == []
    # the workers of the first attempt (rank 1 SIGKILLed, the others SIGTERMed by torchrun)
    # left nothing for the second attempt's sweep to remove
    first = [pid for key, pid in pids.items() if key.startswith("0-")]
    swept = [line for line in faulted.stderr.splitlines() if "left behind" in line]
    assert not [line for line in swept for pid in first
                if f"/{pid}-" in line or f"ringcomm-{pid}-" in line], swept
