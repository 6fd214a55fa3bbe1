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
        ("local", None), ("none", "torch"), ("ringcomm", "torch"), ("ringcomm", "ours"),
        ("gloo", "torch"), ("gloo", "ours")}
    assert "where a step goes" in proc.stdout
    for r in rows:
        assert 0 < r["min_step_ms"] <= r["step_ms"] < 10_000, r
        # the phases of a step: each a part of it (medians of parts need not add up to the
        # median step, but none is negative or longer than the slowest repetition's step)
        assert list(r["phase_ms"]) == ["forward", "backward", "tail", "optimizer"], r
        assert all(0 <= ms <= max(r["rep_step_ms"]) for ms in r["phase_ms"].values()), r
        if r["backend"] == "local":  # nothing runs after the last gradient but autograd's end
            assert r["phase_ms"]["tail"] < r["phase_ms"]["backward"], r
        if r["ddp"] is not None and r["backend"] != "none":
            assert r["max_weight_diff"] < 1e-5, r  # same start and batches: same weights
        else:  # no DDP, or DDP that communicates nothing: each rank's own weights
            assert r["max_weight_diff"] is None, r


def test_the_added_time_ratio_and_the_ddp_table_come_from_the_saved_rows(tmp_path):
    """``python -m ringcomm_bench.report ddp.json --markdown`` prints docs/benchmarks.md's
    table, with (ringcomm - local) / (gloo - local) per model and world size, and the same
    beyond DDP's own cost, (ringcomm - none) / (gloo - none); '-' where a row is missing."""
    from ringcomm_bench import ddp_step

    def row(model: str, world: int, backend: str, ddp: str | None, ms: float) -> dict:
        return {"model": model, "world_size": world, "backend": backend, "ddp": ddp,
                "step_ms": ms}

    rows = [row("mlp", 2, "local", None, 6.0), row("mlp", 2, "ringcomm", "torch", 8.0),
            row("mlp", 2, "gloo", "torch", 14.0), row("mlp", 2, "ringcomm", "ours", 9.0),
            row("mlp", 2, "gloo", "ours", 12.0), row("mlp", 2, "none", "torch", 7.0),
            row("mlp", 4, "local", None, 10.0), row("mlp", 4, "ringcomm", "torch", 12.0)]
    assert ddp_step.added_ratio(rows, "mlp", 2) == 2.0 / 8.0
    assert ddp_step.added_ratio(rows, "mlp", 2, "ours") == 3.0 / 6.0
    assert ddp_step.added_ratio(rows, "mlp", 2, over="none") == 1.0 / 7.0
    assert ddp_step.added_ratio(rows, "mlp", 4) is None  # no Gloo row
    assert ddp_step.added_ratio(rows, "mlp", 4, over="none") is None  # nor a DDP-alone one
    saved = tmp_path / "ddp.json"
    saved.write_text(json.dumps({"benchmark": "ringcomm bench ddp", "rows": rows}))
    proc = subprocess.run([sys.executable, "-m", "ringcomm_bench.report", str(saved),
                           "--markdown"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "| mlp | 2 | 6.00 | 7.00 | 8.00 | 14.00 | 0.25x | 0.14x | 9.00 | 12.00 |" in lines
    assert "| mlp | 4 | 10.00 | - | 12.00 | - | - | - | - | - |" in lines
