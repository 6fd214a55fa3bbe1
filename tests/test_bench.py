"""``ringcomm bench``: its option parsing, its result checker, and one real quick run.

The checker matters most: a benchmark that cannot tell a wrong result from a right one
reports fast garbage, so it is tested here on results computed by hand, then corrupted.
"""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from rich.console import Console

from ringcomm.plan.collectives import COLLECTIVES
from ringcomm.schedules import ALLREDUCE, HOST_AWARE, ON_BOARD
from ringcomm_bench import buffers, report, sweep, versions
from ringcomm_bench.common import format_size, parse_size

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


def _timed_row(backend, nbytes, reps, chosen=None):
    """A row whose time is the median of its repetitions, as the sweep makes them."""
    algorithm = backend.split(":")[1] if ":" in backend else "auto"
    row = _row(backend, algorithm, nbytes, sorted(reps)[len(reps) // 2], chosen=chosen)
    row["library"] = "mpi" if backend == "mpi" else row["library"]
    return {**row, "rep_times_us": list(reps)}


def test_targets_use_the_torch_row_and_mpi_with_the_noise_of_each():
    """With a ringcomm/torch row at a size, the targets against Gloo and MPI take it as
    ringcomm's time (what users run); the torch path is also held to the direct one (+10
    us) and 8 B to 10 us at world size 2. Beside each target: the band its value moved in
    over the repetitions, and whether the bound lies inside it."""
    rows = []
    for nbytes, direct, torch_reps, gloo, mpi in [
            (8, [20.0] * 5, [40.0, 42.0, 44.0, 46.0, 48.0], [400.0] * 5, [4.0] * 5),
            (64 << 10, [50.0] * 5, [60.0] * 5, [600.0] * 5, [33.0, 38.0, 45.0, 50.0, 55.0]),
            (1 << 20, [300.0] * 5, [310.0] * 5, [3000.0] * 5, [290.0, 300.0, 320.0, 330.0,
                                                              340.0])]:
        rows += [_timed_row("ringcomm", nbytes, direct, chosen="rd"),
                 _timed_row("ringcomm/torch", nbytes, torch_reps, chosen="rd"),
                 _timed_row("gloo", nbytes, gloo), _timed_row("mpi", nbytes, mpi)]
    got = {t["target"]: t for t in report.target_summary(rows)}
    assert {t["row"] for t in got.values()} == {"ringcomm/torch", "ringcomm"}
    latency = got["latency vs gloo, 8 B-4 KiB (time ratio)"]
    assert latency["worst"] == pytest.approx(400 / 44, abs=1e-3) and latency["met"]
    # from 64 KiB at most MPI's time: the worst is 64 KiB (MPI 45 us against our 60 us)
    near = got["vs mpi, 64 KiB-256 MiB: at most its time"]
    assert near["worst"] == pytest.approx(45 / 60, abs=1e-3) and not near["met"]
    assert near["noise"] == pytest.approx([38 / 60, 50 / 60], abs=1e-3)
    assert not near["within_noise"] and near["sizes_met"] == 1  # 1 MiB: MPI 320 against 310
    direct_vs_mpi = got["direct, 8 B-4 KiB: at most 2x mpi's time"]  # 4 us against 20 us
    assert direct_vs_mpi["row"] == "ringcomm" and direct_vs_mpi["worst"] == pytest.approx(0.2)
    assert not direct_vs_mpi["met"]
    assert "torch, 8 B-4 KiB: over torch's floor + mpi (us)" not in got  # no floor measured
    over = got["torch path over direct, every size (us)"]
    assert (over["at_bytes"], over["worst"], over["met"], over["sizes_met"]) == (8, 24.0,
                                                                                 False, 2)
    assert over["noise"] == [22.0, 26.0] and not over["within_noise"]
    eight = got["time at 8 B (us)"]
    assert (eight["worst"], eight["bound"], eight["met"]) == (44.0, 10.0, False)
    # without the torch rows: the direct one stands for ringcomm
    direct = {t["target"]: t for t in report.target_summary(
        [r for r in rows if r["library"] != "ringcomm/torch"])}
    assert direct["latency vs gloo, 8 B-4 KiB (time ratio)"]["row"] == "ringcomm"
    assert direct["time at 8 B (us)"]["worst"] == 20.0
    assert "torch path over direct, every size (us)" not in direct


def test_the_floors_split_a_small_calls_time_and_its_gap_to_mpi():
    """Beside MPI's time, torch's floor (its dispatch on a backend that does nothing) and
    ringcomm's API on one rank split a small allreduce: through torch, torch's floor plus
    ringcomm's part; directly, the fixed cost plus the exchange; the torch row's gap to MPI
    is torch's floor plus what ringcomm adds beyond MPI's time, which the target holds to 0
    at world size 2 (sizes above 64 KiB are not split)."""
    rows = []
    for nbytes, torch_floor, api_floor, direct, torch_path, mpi in [
            (8, [4.0] * 5, [3.0] * 5, [9.0] * 5, [15.0, 16.0, 17.0, 18.0, 19.0], [5.0] * 5),
            (4 << 10, [4.0] * 5, [3.0] * 5, [8.0] * 5, [8.0] * 5, [5.0] * 5),
            (1 << 20, [4.0] * 5, [3.0] * 5, [90.0] * 5, [95.0] * 5, [200.0] * 5)]:
        rows += [_timed_row("ringcomm", nbytes, direct, chosen="board"),
                 _timed_row("ringcomm/torch", nbytes, torch_path, chosen="board"),
                 _timed_row("mpi", nbytes, mpi),
                 {**_timed_row("floor/torch", nbytes, torch_floor), "library": "floor/torch",
                  "algorithm": None},
                 {**_timed_row("floor/ringcomm", nbytes, api_floor),
                  "library": "floor/ringcomm", "algorithm": None}]
    split = {e["bytes"]: e for e in report.floor_split(rows)}
    assert sorted(split) == [8, 4 << 10]
    eight = split[8]
    assert (eight["torch_us"], eight["torch_floor_us"], eight["ringcomm_in_torch_us"]) == (
        17.0, 4.0, 13.0)
    assert (eight["direct_us"], eight["api_floor_us"], eight["exchange_us"]) == (9.0, 3.0, 6.0)
    assert (eight["gap_to_mpi_us"], eight["gap_torch_us"], eight["gap_ringcomm_us"]) == (
        12.0, 4.0, 8.0)
    got = {t["target"]: t for t in report.target_summary(rows)}
    over = got["torch, 8 B-4 KiB: over torch's floor + mpi (us)"]
    assert (over["at_bytes"], over["worst"], over["met"], over["sizes_met"]) == (8, 8.0, False,
                                                                                 1)
    assert over["noise"] == [7.0, 9.0]  # 17 - 4 - 5 = 8 us, moving 6-10 over repetitions
    direct = got["direct, 8 B-4 KiB: at most 2x mpi's time"]  # 9 us against MPI's 5 us
    assert direct["worst"] == pytest.approx(5 / 9, abs=1e-3) and direct["met"]
    with_floors = io.StringIO()
    report.print_floor_split(report.floor_split(rows), Console(file=with_floors, width=200))
    assert "where the time goes" in with_floors.getvalue() and "13.0" in with_floors.getvalue()


def test_backends_parse_and_unknown_ones_are_named():
    names = [b.name for b in sweep.parse_backends(["ringcomm:all,gloo", "nccl"])]
    assert names == ["ringcomm", "ringcomm:ring", "ringcomm:tree", "ringcomm:dbtree",
                     "ringcomm:hd", "ringcomm:rd", "gloo", "nccl"]  # hier only when named
    assert [b.name for b in sweep.parse_backends(["ringcomm:hier"])] == ["ringcomm:hier"]
    assert [b.algorithm for b in sweep.parse_backends(["ringcomm:tree"])] == ["tree"]
    assert [b.name for b in sweep.parse_backends(["ringcomm:board,ringcomm:twoshot"])] == [
        "ringcomm:board", "ringcomm:twoshot"]  # the shared board's, only when named
    with pytest.raises(ValueError, match="ringcomm:bogus"):
        sweep.parse_backends(["ringcomm:bogus"])
    torch_path = sweep.parse_backends(["ringcomm", "ringcomm/torch"])
    assert [(b.name, b.library) for b in torch_path] == [("ringcomm", "ringcomm"),
                                                         ("ringcomm/torch", "ringcomm/torch")]
    s, _ = _settings()  # the default set times both paths
    assert {"ringcomm", "ringcomm/torch", "gloo"} <= {b.name for b in s.backends}
    with pytest.raises(ValueError, match="--peers mpi"):
        sweep.parse_backends(["mpi"])
    s, _ = _settings("--peers", "mpi")
    assert s.peers == ["mpi"]
    with pytest.raises(ValueError, match="leave out --hosts"):
        _settings("--peers", "mpi", "--hosts", "2x2")


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
            block = b.out.numel()
            b.out.copy_(acc[r * block:(r + 1) * block])
        elif collective == "allgather":
            b.out.copy_(torch.cat([x.inp for x in bufs]))
        elif collective == "broadcast":
            b.out.copy_(bufs[0].inp)
        else:  # alltoall
            block = b.inp.numel() // n
            b.out.copy_(torch.cat([x.inp[r * block:(r + 1) * block] for x in bufs]))


LONG = 3 * (buffers.CHUNK + 7)  # elements: blocks longer than a chunk


@pytest.mark.parametrize("collective", sweep.COLLECTIVES)
@pytest.mark.parametrize("dtype,op,count", [
    # blocks longer than a chunk in one dtype (the chunks are the same in every dtype; the
    # slow suite has the others), blocks of a few periods and blocks shorter than one in each
    pytest.param(dtype, op, count, id=f"{count}-{dtype}-{op}",
                 marks=pytest.mark.slow if count == LONG and dtype != "float32" else ())
    for dtype, op in [("float32", "sum"), ("int8", "prod"), ("bfloat16", "avg"),
                      ("int64", "max")]
    for count in [LONG, 3 * 12, 3 * 4]])
def test_checker_accepts_right_results_and_counts_wrong_ones(collective, dtype, op, count):
    """Blocks longer than a chunk and not a multiple of the period, blocks of a few periods
    and blocks shorter than one."""
    n = 3
    dt = getattr(torch, dtype)
    ref = buffers.Reference(collective, n, count, dt, op if collective in sweep.REDUCING else None)
    bufs = [buffers.Buffers(collective, r, n, count, dt, ref) for r in range(n)]
    for b in bufs:
        b.reset()
    assert any(b.wrong() > 0 for b in bufs)  # outputs not yet computed
    _simulate(collective, bufs, op)
    assert [b.wrong() for b in bufs] == [0] * n
    last = bufs[-1].out
    last[-1] += 1
    last[0] = last[0] * 2 + 1
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
    both = {"ringcomm", "ringcomm/torch", "gloo"}
    allreduce = both | {f"ringcomm:{a}" for a in ALLREDUCE if a not in HOST_AWARE}
    for collective in sweep.COLLECTIVES:
        mine = [r for r in rows if r["collective"] == collective]
        want = allreduce if collective == "allreduce" else both
        assert {r["backend"] for r in mine} >= want, collective
        assert {r["bytes"] for r in mine} == set(sizes), collective
        for r in mine:
            assert r["wrong"] == 0, r
            assert r["world_size"] == 2
            assert 0 < r["min_time_us"] <= r["time_us"] < 5e6, r
            factor = COLLECTIVES[collective].busbw_factor(2)
            assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * factor, rel_tol=1e-9)
            assert math.isclose(r["algbw_GBps"], r["bytes"] / r["time_us"] / 1e3, rel_tol=1e-9)
            assert 0 < r["busbw_GBps"] < 1000
            assert len(r["rep_times_us"]) == r["reps"]
            if r["library"] in ("ringcomm", "ringcomm/torch"):
                # the model prices the links' algorithms; the board's are taken by size
                assert (r["predicted_us"] is None) == (r["chosen"] in ("board", "twoshot")), r
                assert r["predicted_us"] is None or r["predicted_us"] > 0, r
            if collective == "allreduce" and r["library"] in ("ringcomm", "ringcomm/torch"):
                assert r["chosen"] in (*ALLREDUCE, "board", "twoshot")
    # the floors stand under allreduce and split its small sizes' time (up to 64 KiB)
    floors = {r["backend"]: r for r in rows if r["backend"].startswith("floor/")}
    assert set(floors) == {"floor/torch", "floor/ringcomm"}
    assert all(r["collective"] == "allreduce" for r in rows if r["backend"].startswith("floor/"))
    assert [e["bytes"] for e in result["floor_split"]] == [s for s in sizes if s <= 64 << 10]
    if not torch.cuda.is_available():
        assert any("nccl skipped" in note for note in result["notes"])
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert "busbw_allreduce_n2_float32_sum.png" in pngs
    assert "predicted_allreduce_n2_float32_sum.png" in pngs
    assert "time_allreduce_n2_float32_sum.png" in pngs
    assert len(pngs) == 3 * len(sweep.COLLECTIVES)
    assert all((plots / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def _bench(tmp_path, *argv, timeout):
    """``ringcomm bench ARGV --json``: the finished process and the JSON it wrote."""
    out_json = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "ringcomm.cli", "bench", *argv, "--json",
                           str(out_json)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out_json.read_text())


def _table_rows(stdout, collective):
    """The backend column of one collective's printed table."""
    lines = stdout.split(f"{collective}, world size")[1].split("\n\n")[0].splitlines()
    return [cells[4].strip() for line in lines if len(cells := line.split("│")) > 5]


# The arguments of the two end-to-end runs below, under their tests' names. Both start when
# the first of the two tests does (``runs``): each run's parent process spends seconds
# importing torch on one core, and its ranks then take turns with the other run's.
RUNS = {
    "test_both_ringcomm_paths_run_every_collective_end_to_end": (
        "-b", "4K", "-e", "4K", "--backends", "ringcomm", "ringcomm/torch", "--reps", "2",
        "--iters", "2", "--warmup", "1"),
    "test_the_shared_boards_algorithms_run_forced_end_to_end": (
        "--collectives", "allreduce", "-b", "8", "-e", "64K", "-f", "8192", "--backends",
        *(f"ringcomm:{a}" for a in ON_BOARD), "--reps", "2", "--iters", "2", "--warmup", "1"),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The end-to-end runs of the tests in ``RUNS`` that this session runs, started together;
    each one's ``Future`` (``_bench``'s process and JSON) under its test's name."""
    names = [item.name for item in request.session.items
             if item.module is request.module and item.name in RUNS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {name: pool.submit(_bench, tmp_path_factory.mktemp("bench"), *RUNS[name],
                                 timeout=55) for name in names}


@pytest.mark.timeout(60)
def test_both_ringcomm_paths_run_every_collective_end_to_end(runs, request):
    """ringcomm through its Communicator and through ``torch.distributed`` on a process
    group of backend ringcomm (beside Gloo's): real ranks, every collective, both checked and
    both in the printed tables; the targets take the torch row."""
    proc, result = runs[request.node.name].result()
    rows = result["rows"]
    for collective in sweep.COLLECTIVES:
        mine = {r["backend"]: r for r in rows if r["collective"] == collective}
        assert set(mine) == {"ringcomm", "ringcomm/torch"}, collective
        assert mine["ringcomm/torch"]["process_group"] == "ringcomm"  # as torch names it
        assert mine["ringcomm"]["process_group"] is None  # the Communicator, no torch
        for r in mine.values():
            assert r["wrong"] == 0 and r["bytes"] == 4096, r
            assert len(r["rep_times_us"]) == 2 and 0 < r["min_time_us"] <= r["time_us"], r
        assert _table_rows(proc.stdout, collective) == ["ringcomm", "ringcomm/torch"]
    over = [t for t in result["targets"] if t["kind"] == "extra_us"]
    assert len(over) == 1 and over[0]["row"] == "ringcomm/torch" and over[0]["noise"]
    assert "noise: the band" in proc.stdout


@pytest.mark.timeout(60)
def test_the_shared_boards_algorithms_run_forced_end_to_end(runs, request):
    """``ringcomm:board`` and ``ringcomm:twoshot``, which ``ringcomm:all`` leaves out (they
    need every rank on one host): a row for each at every size, checked, timed, in the
    printed table, and with no prediction, since the cost model does not price the board."""
    sizes = [8, 64 << 10]
    forced = [f"ringcomm:{a}" for a in ON_BOARD]
    proc, result = runs[request.node.name].result()
    rows = result["rows"]
    assert sorted((r["backend"], r["bytes"]) for r in rows) == sorted(
        (name, n) for name in forced for n in sizes)
    factor = COLLECTIVES["allreduce"].busbw_factor(2)
    for r in rows:
        algorithm = r["backend"].split(":")[1]
        assert (r["library"], r["algorithm"], r["chosen"]) == ("ringcomm", algorithm,
                                                               algorithm), r
        assert r["wrong"] == 0 and r["world_size"] == 2 and r["process_group"] is None, r
        assert len(r["rep_times_us"]) == 2 and 0 < r["min_time_us"] <= r["time_us"], r
        assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * factor, rel_tol=1e-9)
        assert r["predicted_us"] is None, r
    assert _table_rows(proc.stdout, "allreduce") == forced * len(sizes)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_mpi_takes_turns_as_a_peer_end_to_end(tmp_path):
    """``--peers mpi``: MPI's ranks, started by mpiexec, run every collective at the same
    sizes, checked like the others; the table has a ``vs mpi`` column and the targets
    against MPI use the torch row."""
    from ringcomm_bench import mpi_peer

    if (why := mpi_peer.unavailable()) is not None:
        pytest.skip(why)
    proc, result = _bench(tmp_path, "-b", "8", "-e", "64K", "-f", "8192", "--backends",
                          "ringcomm/torch", "--peers", "mpi", "--reps", "2", "--iters", "2",
                          "--warmup", "1", timeout=85)
    rows = result["rows"]
    mpi = [r for r in rows if r["backend"] == "mpi"]
    want = {(c, n, "sum" if c in sweep.REDUCING else "none") for c in sweep.COLLECTIVES
            for n in (8, 64 << 10)}
    assert {(r["collective"], r["bytes"], r["op"]) for r in mpi} == want
    for r in mpi:
        assert r["wrong"] == 0 and r["library"] == "mpi" and r["world_size"] == 2, r
        assert len(r["rep_times_us"]) == 2 and 0 < r["min_time_us"] <= r["time_us"], r
        assert r["iters"] >= 2 and r["predicted_us"] is None
    assert all(r["wrong"] == 0 for r in rows)
    assert _table_rows(proc.stdout, "alltoall")[:2] == ["ringcomm/torch", "mpi"]
    assert "vs mpi" in proc.stdout
    assert result["peers"]["mpi"]["library"].startswith("MPICH")
    near = [t for t in result["targets"] if t["target"].startswith("vs mpi, 64 KiB")]
    assert len(near) == 1 and near[0]["row"] == "ringcomm/torch"


@pytest.mark.timeout(60)
def test_mpi_ranks_move_bfloat16_and_a_failing_one_is_named_with_its_traceback():
    """The MPI ranks' turns, given by hand: bfloat16, which MPI has no type for, moves as
    16-bit integers and checks right (and is never reduced); an instruction that fails on
    the MPI ranks comes back as ``MpiPeerFailed`` with the rank and its traceback."""
    from ringcomm_bench import mpi_peer

    if (why := mpi_peer.unavailable()) is not None:
        pytest.skip(why)
    assert mpi_peer.unsupported("allreduce", "bfloat16", "sum") is not None
    assert mpi_peer.unsupported("allgather", "bfloat16", None) is None
    peer = mpi_peer.MpiPeer(2, timeout=30)
    try:
        peer.connect()
        for collective in ("allgather", "broadcast", "alltoall"):
            assert peer.turn("prepare", collective, "bfloat16", None, 2 * 1000) == [0, 0]
            assert len(peer.turn("calls", 3)) == 2
            assert peer.turn("check") == [0, 0], collective
        assert peer.turn("prepare", "allreduce", "float32", "sum", 8) == [0, 0]
        with pytest.raises(mpi_peer.MpiPeerFailed,
                           match=r"rank 0 failed in 'bogus':\nTraceback[\s\S]*unknown instr"):
            peer.turn("bogus")
    finally:
        peer.close()
    assert peer.proc.returncode not in (None, 0)


@pytest.mark.timeout(60)
def test_peers_mpi_without_mpi4py_names_the_extra():
    """Without mpi4py, ``--peers mpi`` says which extra to install, before any rank starts."""
    from test_imports import BLOCK

    code = BLOCK.format(top="mpi4py") + (
        "from ringcomm_bench.cli import main\nsys.exit(main(['--peers', 'mpi', '--quick']))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=55)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs mpi4py and MPICH" in proc.stderr, proc.stderr
    assert "pip install -e '.[mpi]' in ringcomm's checkout" in proc.stderr
    assert "Traceback" not in proc.stderr and "starting ranks" not in proc.stderr


# --------------------------------------------------------------------------- --hosts


def _settings(*argv):
    return sweep.settings_from(sweep.build_parser().parse_args(list(argv)))


def test_hosts_option_parses_and_is_checked():
    """``--hosts HxR`` sets the world (H x R ranks), ``--rate`` takes tc's rates; wrong
    values and combinations are refused with the option named. Needs no root."""
    from ringcomm_bench import multihost

    s, worlds = _settings("--hosts", "2x2")
    assert (s.hosts, s.rate, s.shared_cpus, worlds) == ("2x2", None, False, [4])
    layout = s.layout()
    assert (layout.hosts, layout.ranks, layout.world) == (2, 2, 4)
    assert [layout.host_of(r) for r in range(4)] == [0, 0, 1, 1]  # as torchrun numbers them
    s, worlds = _settings("--hosts", " 3X1 ", "--rate", "1GBit", "--shared-cpus")
    assert (s.hosts, s.rate, s.shared_cpus, worlds) == ("3x1", "1gbit", True, [3])
    assert multihost.rate_bits("1gbit") == 1e9 and multihost.rate_bits("100mbps") == 8e8
    s, worlds = _settings("-n", "2", "3")  # without --hosts: as before, nothing on hosts
    assert (s.hosts, s.rate, s.address, s.layout(), worlds) == (None, None, "127.0.0.1",
                                                                None, [2, 3])
    for argv, match in [(["--hosts", "2"], "HOSTSxRANKS"), (["--hosts", "0x2"], "at least"),
                        (["--hosts", "2x0"], "at least"), (["--hosts", "axb"], "HOSTSxRANKS"),
                        (["--hosts", "2x2", "-n", "4"], "leave out -n"),
                        (["--rate", "1gbit"], "give --hosts"),
                        (["--shared-cpus"], "give --hosts"),
                        (["--hosts", "2x2", "--rate", "fast"], "tc rate"),
                        (["--hosts", "2x2", "--rate", "0gbit"], "tc rate")]:
        with pytest.raises(ValueError, match=match):
            _settings(*argv)


def test_hosts_without_namespaces_fail_with_the_reason(monkeypatch, capsys):
    from ringcomm_bench import netns

    monkeypatch.setattr(netns, "available", lambda: "network namespaces need root: not root")
    assert sweep.main(["--hosts", "2x2", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "--hosts needs simulated hosts" in err and "need root: not root" in err


def test_cores_are_split_between_simulated_hosts(monkeypatch):
    from ringcomm_bench import multihost

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    assert multihost.cpu_groups(2, False) == [[0, 1, 2], [3, 4]]
    assert multihost.cpu_groups(2, True) == [None, None]
    assert multihost.cpu_groups(6, False) == [None] * 6  # fewer cores than hosts: all share


_FAKE_RANK = """
import json, sys, time
path, rank, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def say(kind, payload=None):
    with open(path, "a") as f:
        f.write(json.dumps([kind, rank, payload]) + "\\n")
if how == "hang":
    time.sleep(60)
say("rows", [{"rank": rank}])
if how == "error":
    say("error", "Traceback: boom in rank %d" % rank)
    sys.exit(1)
if how == "die":
    sys.exit(3)
with open(path, "a") as f:  # a line written in two pieces is read once it is whole
    f.write(json.dumps(["progress", rank, ["half"]])[:5]); f.flush(); time.sleep(0.3)
    f.write(json.dumps(["progress", rank, ["half"]])[5:] + "\\n")
say("done")
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["ok", "error", "die", "hang"])
def test_ranks_on_hosts_are_heard_through_files(tmp_path, how):
    """The driver's side of ``--hosts``: reports follow from each rank's file; a traceback,
    an exit without ``done`` and silence for the timeout each end in ``RankFailed`` naming
    the rank, within seconds, never a hang. (Plain processes here: needs no root.)"""
    from ringcomm_bench import multihost
    from ringcomm_bench.common import RankFailed

    procs = [subprocess.Popen(
        [sys.executable, "-c", _FAKE_RANK, str(tmp_path / f"rank{r}.jsonl"), str(r),
         how if r == 1 else "ok"], stdout=subprocess.DEVNULL) for r in range(2)]
    try:
        events = multihost._follow(procs, tmp_path, timeout=2.0)
        if how == "ok":
            got = sorted(map(tuple, ((k, r, json.dumps(p)) for k, r, p in events)))
            assert got == [("progress", 0, '["half"]'), ("progress", 1, '["half"]'),
                           ("rows", 0, '[{"rank": 0}]'), ("rows", 1, '[{"rank": 1}]')]
            return
        want = {"error": r"rank 1 of 2 failed:\nTraceback: boom in rank 1",
                "die": r"rank 1 of 2 exited with code 3 before finishing",
                "hang": r"no word from any of the 2 ranks for 2 s"}[how]
        with pytest.raises(RankFailed, match=want):
            list(events)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_predictions_on_hosts_use_the_layout_and_the_agreed_link():
    """``pred`` on several hosts is the model's time for the communicator's own hosts,
    with the link constants its ranks agreed, not the one-host figure; the automatic
    row's algorithm is the communicator's own choice."""
    from dataclasses import replace

    from ringcomm.plan import cost
    from ringcomm.runtime.local import run_group
    from ringcomm_bench import multihost

    slow = cost.CostParams(alpha=100e-6, beta=8e-9, gamma=0.09e-9)  # about 1 Gbit/s

    def fn(comm):
        comm.adopt(replace(comm.settings, remote=slow))
        return ({(n, a): multihost.modelled_on_hosts("allreduce", a, comm, n, 4)
                 for n in (1 << 20, 64 << 20) for a in (None, "ring", "hier")},
                multihost.modelled_on_hosts("allgather", None, comm, 16 << 20, 4),
                comm.settings.cost_params(4), comm.topology.cores_per_rank, comm.segment_bytes)

    got, gather, params, share, seg = run_group(4, fn, hosts=[[0, 1], [2, 3]])[0]
    for (nbytes, algorithm), (chosen, predicted) in got.items():
        assert chosen == (algorithm or cost.choose(
            "allreduce", 4, nbytes, 4, segment_bytes=seg, params=params, share=share,
            hosts=((0, 1), (2, 3)), remote=slow))
        assert predicted == pytest.approx(cost.predict(
            "allreduce", chosen, 4, nbytes, 4, segment_bytes=seg, params=params,
            hosts=((0, 1), (2, 3)), remote=slow, share=share), rel=1e-12)
    ring, hier = got[64 << 20, "ring"][1], got[64 << 20, "hier"][1]
    assert got[64 << 20, None][0] == "hier" and 1.3 < ring / hier <= 1.5  # the link's bytes
    one_host = cost.predict("allreduce", "ring", 4, 64 << 20, 4, segment_bytes=seg,
                            params=params, share=share)
    assert ring > 3 * one_host  # priced on the slow link, not on shared memory
    # allgather: three of the four 4 MiB blocks cross the slow link, one after another
    assert gather[0] is None and gather[1] >= (12 << 20) * 8e-9


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_hosts_run_end_to_end(tmp_path):
    """``ringcomm bench --hosts 2x2``: four real ranks in two network namespaces; rows for
    the automatic choice, ring and hier with #wrong 0 and the model's time for the layout
    the ranks found, priced with the link they measured; no namespace left behind."""
    from ringcomm.plan import cost
    from ringcomm_bench import netns

    why = netns.available()
    if why is not None:
        pytest.skip(f"simulated hosts unavailable: {why}")
    out_json = tmp_path / "hosts.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringcomm.cli", "bench", "--hosts", "2x2", "--collectives",
         "allreduce", "allgather", "-b", "1K", "-e", "64K", "-f", "64", "--backends",
         "ringcomm", "ringcomm:ring", "ringcomm:hier", "--reps", "2", "--iters", "2",
         "--warmup", "1", "--timeout", "60", "--rate", "1gbit", "--json", str(out_json)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=110)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "2 simulated hosts x 2 ranks, links 1gbit" in stdout
    assert "hier against ring" in stdout
    assert not [ns for ns in netns._listed() if ns.startswith(f"rcns-{proc.pid}-")]
    result = json.loads(out_json.read_text())
    meta = result["hosts"]
    assert (meta["layout"], meta["rate"], meta["hosts"]) == ("2x2", "1gbit", [[0, 1], [2, 3]])
    assert meta["hostnames"] == ["host0", "host0", "host1", "host1"]
    assert meta["remote"]["beta"] > 0 and meta["cores_per_rank"] > 0
    rows = result["rows"]
    assert {r["bytes"] for r in rows} == {1 << 10, 64 << 10}
    reduce = [r for r in rows if r["collective"] == "allreduce"]
    for nbytes in (1 << 10, 64 << 10):
        assert {r["backend"] for r in reduce if r["bytes"] == nbytes} == {
            "ringcomm", "ringcomm:ring", "ringcomm:hier"}
    local, remote = cost.CostParams(**meta["local"]), cost.CostParams(**meta["remote"])
    for r in rows:
        assert r["wrong"] == 0 and r["world_size"] == 4 and r["hosts"] == "2x2", r
        assert 0 < r["min_time_us"] <= r["time_us"], r
        if r["collective"] == "allgather":
            assert r["predicted_us"] > 0, r
            continue
        assert r["chosen"] in ALLREDUCE
        assert r["predicted_us"] == pytest.approx(1e6 * cost.predict(
            "allreduce", r["chosen"], 4, r["bytes"], 4, segment_bytes=meta["segment_bytes"],
            params=local, hosts=((0, 1), (2, 3)), remote=remote,
            share=meta["cores_per_rank"]), rel=1e-9), r
    assert {e["bytes"] for e in result["hosts_summary"]} == {1 << 10, 64 << 10}


def test_versions_calls_a_size_slower_only_beyond_the_noise_of_its_own_rounds():
    """The A/B comparison: each version's median over its rounds; the noise is the larger
    spread between rounds of one version; slower means new/old above that spread."""
    a, b, c, d = ("allreduce", "ringcomm", 2, 8), ("allreduce", "ringcomm", 2, 1024), \
        ("allreduce", "ringcomm", 4, 8), ("broadcast", "ringcomm", 2, 8)
    t = ("allreduce", "ringcomm/torch", 2, 8)
    old = [{a: 10.0, b: 100.0, d: 5.0, t: 20.0}, {a: 12.0, b: 100.0, d: 5.0, t: 20.0},
           {a: 11.0, b: 101.0, d: 5.0, t: 20.0}]
    new = [{a: 12.5, b: 130.0, d: 9.0, t: 30.0}, {a: 11.5, b: 131.0, d: 9.0, t: 30.0},
           {a: 13.0, b: 129.0, c: 1.0, d: 9.0, t: 30.0}]  # a size only one run has: skipped
    rows = {(r["collective"], r["path"], r["world_size"], r["bytes"]): r
            for r in versions.compare(old, new)}
    assert set(rows) == {a, b, d, t}  # collectives and paths are kept apart, not mixed
    small, large = rows[a], rows[b]
    assert small["old_us"] == 11.0 and small["new_us"] == 12.5
    assert math.isclose(small["noise"], 12.0 / 10.0) and math.isclose(small["new_over_old"],
                                                                      12.5 / 11.0)
    assert rows[d]["slower"] and rows[d]["old_us"] == 5.0
    assert rows[t]["slower"] and rows[t]["new_over_old"] == 1.5  # the torch path's own
    assert not small["slower"]  # 1.14x, within the 1.2x the old rounds differ by
    assert math.isclose(large["noise"], 131.0 / 129.0) and large["slower"]  # 1.30x > 1.02x


def test_versions_times_each_way_ringcomm_was_timed_apart():
    """Rows of the direct API and of the torch path at one size stay two entries; forced
    algorithms and other libraries are left out."""
    rows = [{"collective": "allreduce", "library": lib, "algorithm": algo, "world_size": 2,
             "bytes": 8, "time_us": us}
            for lib, algo, us in (("ringcomm", "auto", 7.0), ("ringcomm/torch", "auto", 9.0),
                                  ("ringcomm", "ring", 30.0), ("gloo", None, 100.0))]
    assert versions.times(rows) == {("allreduce", "ringcomm", 2, 8): 7.0,
                                    ("allreduce", "ringcomm/torch", 2, 8): 9.0}


@pytest.mark.timeout(60)
def test_versions_builds_a_versions_compiled_round_as_its_install_would(tmp_path):
    """A worktree holds sources only: without its round built, a version would be timed on
    its Python round, slower than it runs installed."""
    root = Path(__file__).resolve().parent.parent
    for name in ("pyproject.toml", "README.md", "LICENSE", "ringcomm/transport/_board_round.c"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, tmp_path / name)
    versions.build_compiled(tmp_path)
    assert list((tmp_path / "ringcomm" / "transport").glob("_board_round.*.so"))


def test_the_help_names_the_device_backends_that_run_by_default() -> None:
    """``--help`` is built from the table the sweep runs, so it cannot fall behind it."""
    text = " ".join(sweep.build_parser().format_help().split())
    for runtime, backends in sweep.DEVICE_BACKENDS.items():
        assert f"{runtime}: {' '.join(backends)}" in text
    assert f"default: {' '.join(sweep.HOST_BACKENDS)}" in text


def test_the_algo_column_of_cuda_tensors_through_torch_names_the_device_engine() -> None:
    """ringcomm/torch+cuda's column is asked of the torch group that ran the row, about
    device memory: once it was asked of the host group, and said the board ran CUDA
    tensors. Here a one-rank group on the fake device stands for it."""
    from ringcomm.runtime.local import run_group
    from ringcomm.torch_backend.process_group import RingcommProcessGroup
    from ringcomm_bench import device

    (host,) = run_group(1, lambda comm: sweep.row_choice(
        sweep.Backend(sweep.TORCH, sweep.TORCH), None, comm, "allreduce", 1, 8, 4))
    b = sweep.Backend(device.TORCH_CUDA, device.TORCH_CUDA)
    (chosen, _), = run_group(1, lambda comm: sweep.row_choice(
        b, RingcommProcessGroup(comm), comm, "allreduce", 1, 8, 4), device="fake")
    assert chosen is not None and chosen.split(":")[0] in ("cuda-ipc", "cuda-kernel", "staged",
                                                          "nccl")
    assert host[0] != chosen  # the host path's choice is not the device's


def test_the_kernel_backend_is_left_out_for_shared_gpus_without_mps_only_on_a_gpu_run(
        monkeypatch) -> None:
    """On a machine with CuPy and a GPU but no MPS, ``--device cuda`` leaves the kernel
    path out at world sizes over one (its kernels would take turns), while ``--device fake``
    runs it (the fake's ranks run at once, whatever the machine has)."""
    import importlib.util

    from ringcomm.core.device import mps
    from ringcomm_bench import backends, device

    class _Gpu:
        def available(self) -> bool:
            return True

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "cupy" else real_find_spec(name, *a))
    monkeypatch.setattr(device, "runtime_of", lambda name: _Gpu())
    monkeypatch.setattr(mps, "mps_state", lambda: mps.MpsState(False, "no daemon"))
    kernel = backends.RUNNERS[device.KERNEL]
    assert kernel.unavailable(2, "fake") is None
    assert kernel.unavailable(1, "cuda") is None
    assert "without MPS" in kernel.unavailable(2, "cuda")
