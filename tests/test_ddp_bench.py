"""``ringcomm bench ddp`` runs our DDP beside torch's on both backends, and checks them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quick_run_times_both_ddps_on_both_backends_and_their_weights_agree(tmp_path):
    out_json = tmp_path / "ddp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ringcomm.cli", "bench", "ddp", "--quick", "--models", "mlp",
         "--json", str(out_json)], cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "vs torch's" in proc.stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["backend"], r["ddp"]) for r in rows} == {
        ("local", None), ("ringcomm", "torch"), ("ringcomm", "ours"), ("gloo", "torch"),
        ("gloo", "ours")}
    for r in rows:
        assert 0 < r["min_step_ms"] <= r["step_ms"] < 10_000, r
        if r["ddp"] is not None:  # same start, same batches: the same weights everywhere
            assert r["max_weight_diff"] < 1e-5, r
