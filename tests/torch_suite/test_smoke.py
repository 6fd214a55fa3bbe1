"""A few tests of torch's own distributed suite on ringcomm, through the runner, so that
the runner and the suite's set-up keep working between full runs (``run.py``; hours)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SMOKE = ["test_all_reduce_sum", "test_all_gather_coalesced_simple", "test_send_recv_any_source",
         "test_DistributedDataParallelCPU"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_few_suite_tests_pass_on_ringcomm(tmp_path):
    cmd = [sys.executable, "-m", "tests.torch_suite.run", "-w", "2", "-b", "ringcomm",
           "--results", str(tmp_path)]
    for name in SMOKE:
        cmd += ["-t", name]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads((tmp_path / "ringcomm-ws2.json").read_text())["tests"]
    log = (tmp_path / "ringcomm-ws2.log").read_text()[-4000:]
    assert sorted(results) == sorted(SMOKE), log
    failed = {name: rec["detail"][-1500:] for name, rec in results.items()
              if rec["outcome"] != "passed"}
    assert not failed, failed
