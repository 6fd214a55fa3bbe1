"""``ringcomm bench``: its option parsing, its result checker, and one real quick run.

The checker matters most: a benchmark that cannot tell a wrong result from a right one
reports fast garbage, so it is tested here on results computed by hand, then corrupted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import report, sweep
from bench.common import format_size, parse_size
from ringcomm.algorithms import ALLREDUCE, HOST_AWARE

ROOT = Path(__file__).resolve().parent.parent


def test_sizes_parse_like_nccl_tests():
    assert [parse_size(s) for s in ("8", "64K", "1M", "256M", "1GiB", "2KB")] == [
        8, 64 << 10, 1 << 20, 256 << 20, 1 << 30, 2 << 10]
    with pytest.raises(ValueError, match="cannot read"):
        parse_size("12Q")
    assert sweep.size_range(8, 64, 2) == [8, 16, 32, 64]
    assert sweep.size_range(1 << 10, 1 << 20, 32) == [1 << 10, 32 << 10, 1 << 20]
    assert sweep.size_range(4096, 4096, 2) == [4096]
    with pytest.raises(ValueError, match="-f"):
        sweep.size_range(8, 64, 1)
    assert format_size(256 << 20) == "256 MiB" and format_size(100) == "100 B"


def test_fast_calls_get_more_calls_per_repetition():
    assert sweep.iters_for(100e-6, 5) == 201  # about 20 ms of calls
    assert sweep.iters_for(1e-9, 5) == sweep.MAX_ITERS
    assert sweep.iters_for(0.0, 5) == sweep.MAX_ITERS
    assert sweep.iters_for(0.5, 5) == 5  # never fewer than asked


def test_backends_of_one_library_share_their_calls_per_repetition():
    libraries = ["ringcomm", "ringcomm", "ringcomm", "gloo"]
    paces = [400e-6, 100e-6, 100e-6, 2e-3]  # the automatic choice warmed up slowly
    iters = sweep.iters_per_backend(libraries, paces, 5)
    assert iters[0] == iters[1] == iters[2] == sweep.iters_for(100e-6, 5)
    assert iters[3] == sweep.iters_for(2e-3, 5)


def _row(backend, algorithm, nbytes, time_us, chosen=None):
    library = backend.split(":")[0]
    return {"collective": "allreduce", "world_size": 2, "dtype": "float32", "op": "sum",
            "backend": backend, "library": library, "bytes": nbytes,
            "algorithm": algorithm if library == "ringcomm" else None, "time_us": time_us,
            "chosen": chosen}


def test_the_target_summary_finds_the_worst_size_of_each_target():
    rows = []
    for nbytes, gloo, auto, ring, rd in [(8, 100.0, 40.0, 60.0, 40.0),
                                         (64 << 10, 300.0, 200.0, 200.0, 260.0),
                                         (1 << 20, 2000.0, 1000.0, 1000.0, 1300.0),
                                         (16 << 20, 20000.0, 14000.0, 12000.0, 16000.0)]:
        rows += [_row("ringcomm", "auto", nbytes, auto, chosen="ring"),
                 _row("ringcomm:ring", "ring", nbytes, ring),
                 _row("ringcomm:rd", "rd", nbytes, rd), _row("gloo", None, nbytes, gloo)]
    got = {t["target"]: t for t in report.target_summary(rows)}
    busbw = got["busbw vs gloo, 1 MiB-256 MiB"]
    assert (busbw["at_bytes"], busbw["met"], busbw["sizes_met"]) == (16 << 20, False, 1)
    assert busbw["worst"] == pytest.approx(20000 / 14000, rel=1e-3)
    assert got["busbw vs gloo, 64 KiB"]["met"] is True  # 1.5x >= 1.2x
    assert got["latency vs gloo, 8 B-4 KiB (time ratio)"]["worst"] == pytest.approx(2.5)
    auto = got["auto vs best algorithm (time ratio)"]
    assert (auto["at_bytes"], auto["met"]) == (16 << 20, False)  # 14000 / 12000 > 1.1
    choice = got["chosen vs best algorithm, forced runs"]  # ring chosen; rd 1.5x faster at 8 B
    assert (choice["at_bytes"], choice["worst"], choice["sizes_met"]) == (8, 1.5, 3)
    same = got["noise: auto vs its own algorithm forced"]  # auto 40 against ring 60 at 8 B
    assert (same["at_bytes"], same["worst"], same["sizes_met"]) == (8, 1.5, 2)  # 16 MiB: 1.17x


def test_backends_parse_and_unknown_ones_are_named():
    names = [b.name for b in sweep.parse_backends(["ringcomm:all,gloo", "nccl"])]
    assert names == ["ringcomm", "ringcomm:ring", "ringcomm:tree", "ringcomm:dbtree",
                     "ringcomm:hd", "ringcomm:rd", "gloo", "nccl"]  # hier only when named
    assert [b.name for b in sweep.parse_backends(["ringcomm:hier"])] == ["ringcomm:hier"]
    assert [b.algorithm for b in sweep.parse_backends(["ringcomm:tree"])] == ["tree"]
    with pytest.raises(ValueError, match="ringcomm:bogus"):
        sweep.parse_backends(["ringcomm:bogus"])


def _simulate(collective, bufs, op):
    """Do each collective by hand on every rank's Buffers."""
    n = len(bufs)
    wide = torch.float64 if bufs[0].inp.is_floating_point() else torch.int64
    ins = [b.inp.to(wide) for b in bufs]
    if collective in ("allreduce", "reduce_scatter"):
        acc = ins[0].clone()
        for x in ins[1:]:
            acc = {"sum": acc + x, "avg": acc + x, "prod": acc * x,
                   "min": torch.minimum(acc, x), "max": torch.maximum(acc, x)}[op]
        if op == "avg":
            acc /= n
    for r, b in enumerate(bufs):
        if collective == "allreduce":
            b.out.copy_(acc)
        elif collective == "reduce_scatter":
            b.out.copy_(acc[r * b.block:(r + 1) * b.block])
        elif collective == "allgather":
            b.out.copy_(torch.cat([x.inp for x in bufs]))
        elif collective == "broadcast":
            b.out.copy_(bufs[0].inp)
        else:  # alltoall
            b.out.copy_(torch.cat([x.inp[r * b.block:(r + 1) * b.block] for x in bufs]))


@pytest.mark.parametrize("collective", sweep.COLLECTIVES)
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("int8", "prod"),
                                      ("bfloat16", "avg"), ("int64", "max")])
def test_checker_accepts_right_results_and_counts_wrong_ones(collective, dtype, op):
    n, count = 3, 3 * (sweep.CHUNK + 7)  # more than one chunk, not a multiple of the period
    dt = getattr(torch, dtype)
    ref = sweep.Reference(n, dt, op if collective in sweep.REDUCING else None)
    bufs = [sweep.Buffers(collective, r, n, count, dt, ref) for r in range(n)]
    for b in bufs:
        b.reset()
    assert sum(b.wrong() for b in bufs) > 0  # outputs not yet computed
    _simulate(collective, bufs, op)
    assert [b.wrong() for b in bufs] == [0] * n
    last = bufs[-1].out
    last[-1] += 1
    last[3] = last[3] * 2 + 1
    assert bufs[-1].wrong() == 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_quick_run_end_to_end(tmp_path):
    """``ringcomm bench --quick``: real ranks, every collective and backend, checked."""
    out_json, plots = tmp_path / "bench.json", tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "ringcomm.cli", "bench", "--quick", "--json", str(out_json),
         "--plot-dir", str(plots)], cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "busbw (GB/s)" in proc.stdout and "#wrong" in proc.stdout
    result = json.loads(out_json.read_text())
    assert result["command"].startswith("ringcomm bench --quick")
    assert result["machine"]["cpus"] >= 1 and result["machine"]["torch"]
    rows = result["rows"]
    sizes = result["settings"]["sizes"]
    allreduce = {"ringcomm", "gloo"} | {f"ringcomm:{a}" for a in ALLREDUCE
                                        if a not in HOST_AWARE}
    for collective in sweep.COLLECTIVES:
        mine = [r for r in rows if r["collective"] == collective]
        want = allreduce if collective == "allreduce" else {"ringcomm", "gloo"}
        assert {r["backend"] for r in mine} >= want, collective
        assert {r["bytes"] for r in mine} == set(sizes), collective
        for r in mine:
            assert r["wrong"] == 0, r
            assert r["world_size"] == 2
            assert 0 < r["min_time_us"] <= r["time_us"] < 5e6, r
            factor = sweep.BUSBW_FACTOR[collective](2)
            assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * factor, rel_tol=1e-9)
            assert math.isclose(r["algbw_GBps"], r["bytes"] / r["time_us"] / 1e3, rel_tol=1e-9)
            assert 0 < r["busbw_GBps"] < 1000
            assert len(r["rep_times_us"]) == r["reps"]
            if r["library"] == "ringcomm":
                assert r["predicted_us"] > 0, r
            if collective == "allreduce" and r["library"] == "ringcomm":
                assert r["chosen"] in ALLREDUCE
    if not torch.cuda.is_available():
        assert any("nccl skipped" in note for note in result["notes"])
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert "busbw_allreduce_n2_float32_sum.png" in pngs
    assert "predicted_allreduce_n2_float32_sum.png" in pngs
    assert len(pngs) == 2 * len(sweep.COLLECTIVES)
    assert all((plots / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
