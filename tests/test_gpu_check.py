"""``bench/gpu_check.sh`` and ``ringcomm bench --device``, on the fake runtime.

The GPU machine is lent for minutes at a time, so the one command run there must work the
first time: its ``--fake`` mode runs every step against the strict fake runtime here, and
the JSON it writes is what the GPU run writes too. The device sweep runs over two real
ranks on fake device arrays, through each device engine, and every result is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringcomm_bench import device, gpu_check, sweep

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
CHECK_KEYS = {"name", "status", "passed", "failed", "skipped", "seconds", "detail"}


def _gpu_check(out: Path, *args: str, timeout: float) -> tuple[dict, str]:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run([str(SCRIPT), "--fake", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode in (0, 1), done.stderr
    return json.loads((out / "gpu_fake.json").read_text()), (out / "gpu_check_fake.log").read_text()


@pytest.mark.slow
def test_a_reduced_fake_run_writes_every_field_and_says_it_is_fake(tmp_path):
    result, log = _gpu_check(tmp_path, "--steps", "modules,versions,ipc,mps", timeout=120)
    assert result["fake"] is True and result["runtime"] == "fake"
    assert "no figure here says anything about a GPU" in result["note"]
    assert {"date", "duration_s", "machine", "device", "versions", "checks", "passed",
            "figures", "command"} <= set(result)
    assert result["device"]["device"] == "fake (numpy)" and "torch" in result["versions"]
    checks = {c["name"]: c for c in result["checks"]}
    assert list(checks) == list(gpu_check.STEPS)
    assert all(set(c) == CHECK_KEYS for c in checks.values())
    for name in ("modules", "versions", "ipc", "mps"):
        assert checks[name]["status"] == "pass" and checks[name]["passed"] >= 1, checks[name]
        assert checks[name]["failed"] == 0 and f"=== {name}:" in log
    assert checks["ipc"]["detail"]["exporter_live_allocations"] == 0
    for name in ("wheels", "host-register", "pytest-gpu", "tune", "bench"):
        assert checks[name]["status"] == "skip" and checks[name]["detail"]["why"] == "not asked for"
    assert result["passed"] is True
    assert not list(tmp_path.glob("*.xml"))  # the tests' report went to a folder of its own


def test_a_failing_step_is_recorded_and_the_rest_still_run(tmp_path):
    """A probe that cannot run (no such module on the path) fails its step only."""
    env_python = tmp_path / "python"
    env_python.write_text(f"#!/bin/sh\nif [ \"$2\" = ringcomm_bench.gpu_probe ] && "
                          f"[ \"$3\" = ipc ]; then exit 3; fi\nexec {sys.executable} \"$@\"\n")
    env_python.chmod(0o755)
    done = subprocess.run([str(SCRIPT), "--fake", "--out", str(tmp_path / "out"), "--steps",
                           "ipc,mps"], env={**os.environ, "PYTHON": str(env_python)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads((tmp_path / "out" / "gpu_fake.json").read_text())
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["ipc"]["status"] == "fail" and checks["ipc"]["failed"] == 1
    assert checks["mps"]["status"] == "pass" and result["passed"] is False


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_fake_run_passes_every_step_end_to_end(tmp_path):
    result, log = _gpu_check(tmp_path, timeout=560)
    checks = {c["name"]: c for c in result["checks"]}
    assert list(checks) == list(gpu_check.STEPS)
    # nothing brought here (.whl/ is for the GPU machine): the only step allowed to skip
    assert checks["wheels"]["status"] in ("pass", "skip")
    for name in gpu_check.STEPS[1:]:
        assert checks[name]["status"] == "pass", (name, checks[name], log[-3000:])
    assert checks["pytest-gpu"]["passed"] > 0 and checks["pytest-gpu"]["failed"] == 0
    rows = result["figures"]["rows"]
    assert rows and all(r["wrong"] == 0 for r in rows)
    assert {r["backend"] for r in rows} == {device.IPC, device.STAGED,
                                            f"{device.NCCL_ENGINE}:ring",
                                            f"{device.NCCL_ENGINE}:nccl"}
    assert result["figures"]["runtime"] == "fake" and result["passed"] is True
    constants = checks["tune"]["detail"]["constants"]
    assert set(constants) == {"cuda-ipc", "staged"}
    assert all(c["alpha_us"] > 0 and c["beta_GBps"] > 0 for c in constants.values())
    assert result["duration_s"] < 8 * 60


def _device_rows(world: int, nbytes: int, copy_us: float, ipc_us: float, gloo_us: float,
                 torch_us: float) -> list[dict]:
    def row(backend: str, time_us: float) -> dict:
        r = {"collective": "allreduce", "world_size": world, "dtype": "float32", "op": "sum",
             "backend": backend, "bytes": nbytes, "time_us": time_us,
             "algbw_GBps": nbytes / time_us / 1e3}
        if backend == device.COPY:
            r["copy_rw_GBps"] = 2 * nbytes / time_us / 1e3
        return r

    return [row(device.COPY, copy_us), row(device.IPC, ipc_us), row(device.GLOO_CUDA, gloo_us),
            row(device.TORCH_CUDA, torch_us)]


def test_the_device_targets_use_the_copy_of_the_same_run():
    # 64 MiB: the copy moves 2 x 64 MiB in 50 us; at world 2 the bound is that over 5
    big = 64 << 20
    rows = _device_rows(2, big, 50.0, 240.0, 30 * 240.0, 900.0)
    rows += _device_rows(2, 8, 2.0, 30.0, 700.0, 40.0)
    got = {t["target"]: t for t in device.device_summary(rows)}
    assert device.one_gpu_bound(100.0, 2) == pytest.approx(20.0)
    bound = got["IPC algbw / (one-GPU bound / 2), 64 MiB and up"]
    # bound / 2 = (2 big / 50 us) / 5 / 2 = big / 250 us; ipc's algbw is big / 240 us
    assert bound["worst"] == pytest.approx(250 / 240, abs=1e-3) and bound["met"]
    gloo = got["gloo time / IPC time, CUDA tensors, 1 MiB and up"]
    assert gloo["worst"] == pytest.approx(30.0) and gloo["met"] and gloo["sizes"] == 1
    tiny = got["8 B through torch on a CUDA tensor (us)"]
    assert (tiny["worst"], tiny["met"]) == (40.0, True)
    slower = _device_rows(2, big, 50.0, 260.0, 10 * 260.0, 900.0)
    got = {t["target"]: t for t in device.device_summary(slower)}
    assert not got["IPC algbw / (one-GPU bound / 2), 64 MiB and up"]["met"]
    assert not got["gloo time / IPC time, CUDA tensors, 1 MiB and up"]["met"]
    assert device.device_summary(_device_rows(4, 8, 2.0, 30.0, 700.0, 40.0)) == []


def test_the_nccl_targets_compare_with_the_best_device_engine():
    """Torch's NCCL on one GPU (its socket fallback) at least 10x and Gloo at least 20x the
    best device engine's time, from 1 MiB up; the best engine is the faster of IPC and
    staged at each size."""
    big = 4 << 20
    rows = _device_rows(2, big, 50.0, 300.0, 30 * 300.0, 900.0)
    staged = dict(rows[1], backend=device.STAGED, time_us=200.0)
    nccl = dict(rows[1], backend=device.TORCH_NCCL, time_us=2500.0)
    got = {t["target"]: t for t in device.device_summary([*rows, staged, nccl])}
    over_nccl = got["NCCL (torch, one GPU) time / best device engine time, 1 MiB and up"]
    assert over_nccl["worst"] == pytest.approx(12.5) and over_nccl["met"]
    over_gloo = got["gloo time / best device engine time, 1 MiB and up"]
    assert over_gloo["worst"] == pytest.approx(45.0) and over_gloo["met"]
    slow_engines = [*rows, dict(nccl, time_us=2000.0)]  # IPC alone: 300 us
    got = {t["target"]: t for t in device.device_summary(slow_engines)}
    assert not got["NCCL (torch, one GPU) time / best device engine time, 1 MiB and up"]["met"]


def test_the_nccl_engine_backends() -> None:
    names = sweep.parse_backends([f"{device.NCCL_ENGINE}:ring", f"{device.NCCL_ENGINE}:nccl"])
    assert [(b.name, b.library, b.algorithm) for b in names] == [
        (f"{device.NCCL_ENGINE}:ring", device.NCCL_ENGINE, "ring"),
        (f"{device.NCCL_ENGINE}:nccl", device.NCCL_ENGINE, "nccl")]
    with pytest.raises(ValueError, match="unknown backend"):
        sweep.parse_backends([f"{device.NCCL_ENGINE}:bogus"])
    parser = sweep.build_parser()
    with pytest.raises(ValueError, match="--device cuda or --device fake"):
        sweep.settings_from(parser.parse_args(["--backends", device.NCCL_ENGINE]))


def test_device_backends_need_device_and_device_runs_default_to_the_engines():
    parser = sweep.build_parser()
    s, _ = sweep.settings_from(parser.parse_args(["--device", "fake"]))
    assert [b.name for b in s.backends] == [device.IPC, device.STAGED, f"{device.NCCL_ENGINE}:ring",
                                            f"{device.NCCL_ENGINE}:nccl"]
    assert s.device == "fake"
    s, _ = sweep.settings_from(parser.parse_args(["--device", "cuda"]))
    assert [b.name for b in s.backends] == sweep.DEVICE_BACKENDS["cuda"]
    with pytest.raises(ValueError, match="give --device cuda or --device fake"):
        sweep.settings_from(parser.parse_args(["--backends", device.IPC]))
    with pytest.raises(ValueError, match="give --device cuda"):
        sweep.settings_from(parser.parse_args(["--device", "fake", "--backends", "gloo+cuda"]))
    s, _ = sweep.settings_from(parser.parse_args([]))
    assert "ringcomm" in [b.name for b in s.backends] and s.device is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_device_sweep_over_two_ranks_checks_every_result(tmp_path):
    out = tmp_path / "fake.json"
    done = subprocess.run(
        [sys.executable, "-m", "ringcomm_bench", "--device", "fake", "-n", "2",
         "--collectives", "allreduce", "allgather", "-b", "8", "-e", "4K", "-f", "512",
         "--reps", "2", "--iters", "1", "--warmup", "0", "--dtype", "float32", "bfloat16",
         "--backends", device.IPC, device.STAGED, device.COPY,
         "--json", str(out), "--timeout", "120"],
        capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for backend in (device.IPC, device.STAGED):
        assert backend in done.stdout
    result = json.loads(out.read_text())
    assert result["runtime"] == "fake" and result["device"]["device"] == "fake (numpy)"
    rows = result["rows"]
    assert {(r["collective"], r["dtype"], r["backend"]) for r in rows} == {
        (c, d, b) for c in ("allreduce", "allgather") for d in ("float32", "bfloat16")
        for b in (device.IPC, device.STAGED, device.COPY)}
    assert all(r["wrong"] == 0 and r["runtime"] == "fake" for r in rows)
    engines = [r for r in rows if r["backend"] != device.COPY]
    engine = {device.IPC: "cuda-ipc:", device.STAGED: "staged:"}
    assert all(r["chosen"].startswith(engine[r["backend"]]) for r in engines), rows
    # the copy is the ceiling (bytes read plus written), and the IPC rows carry the bound
    copies = [r for r in rows if r["backend"] == device.COPY]
    assert all(r["copy_rw_GBps"] > 0 and r["chosen"] is None for r in copies)
    for r in rows:
        if r["backend"] in (device.IPC, device.STAGED) and r["collective"] == "allreduce":
            copy = next(c for c in copies if (c["bytes"], c["dtype"], c["collective"]) ==
                        (r["bytes"], r["dtype"], "allreduce"))
            assert r["one_gpu_bound_GBps"] == pytest.approx(copy["copy_rw_GBps"] / 5)
