"""``bench/gpu_check.sh``: everything a GPU machine can tell about ringcomm's device path, in
one command and under eight minutes, written to ``gpu.json`` and a log.

A GPU machine is lent for half an hour at a time, with nothing outside it reachable, so the
run must not need anything it does not bring (wheels in ``.whl/``, installed by the shell
script into a private folder on ``PYTHONPATH``), must not stop at the first failure (each
step is a subprocess with its own time limit; a failing step is recorded and the next one
runs) and must leave its findings in files. The steps:

    wheels         the brought wheels, installed into the private folder (none: skipped)
    modules        which modules ringcomm, its tests and the benchmark need are missing
                   (with the wheel to bring for each)
    versions       device, driver, CUDA, CuPy, NCCL, torch (``gpu_probe versions``)
    ipc            device memory and an event shared by two processes (``gpu_probe ipc``)
    host-register  a /dev/shm mapping page-locked (``gpu_probe host-register``)
    mps            whether MPS runs (``gpu_probe mps``)
    pytest-gpu     the tests marked ``gpu`` and not ``slow`` (counts from their JUnit report;
                   ``make test-slow`` on a GPU machine adds the slow ones)
    tune           ``ringcomm tune --device --quick``: the device engines' cost constants
                   fitted on this device (``gpu_profile.json``, a profile ringcomm reads
                   through ``RINGCOMM_PROFILE``)
    bench          ``ringcomm bench --device``: the short device sweep (rows with #wrong 0
                   pass)

``--fake`` runs the same steps on a CPU machine against the strict fake runtime (the tests
marked ``gpu`` with ``RINGCOMM_TEST_RUNTIME=fake``, the benchmark with ``--device fake``)
and writes ``gpu_fake.json`` instead, which says so: it checks the plumbing, and none of its
figures says anything about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BUDGET_S = 470.0  # the whole run, under eight minutes with the shell script's set-up

# (module, the wheel that brings it, what needs it); cupy only on a GPU
NEEDED = (
    ("numpy", "numpy", "ringcomm"), ("torch", "torch", "ringcomm"), ("zmq", "pyzmq", "ringcomm"),
    ("ml_dtypes", "ml-dtypes", "ringcomm"), ("xxhash", "xxhash", "ringcomm"),
    ("pytest", "pytest", "tests"), ("pytest_timeout", "pytest-timeout", "tests"),
    ("hypothesis", "hypothesis", "tests"), ("rich", "rich", "bench"),
    ("matplotlib", "matplotlib", "bench"),
)
NEEDED_ON_GPU = (("cupy", "cupy-cuda13x (or cupy-cuda12x)", "the device runtime"),)
OPTIONAL = (("expecttest", "expecttest", "torch's own test suite (tests/torch_suite)"),)


# what ``versions`` reports beside the device's own description (``gpu.json``'s "device")
LIBRARIES = ("ok", "available", "runtime", "torch", "torch_cuda", "torch_cuda_available",
             "numpy", "python", "cupy", "nccl")


@dataclass
class Check:
    """One step's outcome as ``gpu.json`` records it."""

    name: str
    status: str = "pass"  # "pass" | "fail" | "skip"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


class Run:
    """The steps of one check run: their time limits against the whole run's budget, their
    output into the log, their outcomes into ``checks``."""

    def __init__(self, root: Path, out: Path, fake: bool, budget: float, python: str) -> None:
        self.root, self.out, self.fake, self.python = root, out, fake, python
        self.device = "fake" if fake else "cuda"
        self.deadline = time.monotonic() + budget
        self.checks: list[Check] = []
        suffix = "_fake" if fake else ""
        self.json_path = out / f"gpu{suffix}.json"
        self.log_path = out / f"gpu_check{suffix}.log"
        self.bench_path = out / f"gpu_bench{suffix}.json"
        self.profile_path = out / f"gpu_profile{suffix}.json"
        out.mkdir(parents=True, exist_ok=True)
        self.log = self.log_path.open("w")

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def command(self, name: str, argv: list[str], limit: float,
                env: dict[str, str] | None = None) -> tuple[int | None, str, float]:
        """Run ``argv`` from the repository's root, bounded by ``limit`` and what is left
        of the budget; its exit status (None: it ran out of time), output and seconds."""
        left = self.deadline - time.monotonic()
        limit = min(limit, left)
        self.say(f"\n=== {name}: {shlex.join(argv)} (limit {limit:.0f} s)")
        if limit < 1:
            return None, "no time left in the run's budget", 0.0
        started = time.monotonic()
        try:
            done = subprocess.run(argv, cwd=self.root, capture_output=True, text=True,
                                  timeout=limit, env={**os.environ, **(env or {})})
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as err:
            code = None
            output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                             for x in (err.stdout, err.stderr))
            output += f"\n(timed out after {limit:.0f} s)"
        seconds = time.monotonic() - started
        self.log.write(output if output.endswith("\n") else output + "\n")
        return code, output, seconds

    def record(self, check: Check) -> Check:
        check.seconds = round(check.seconds, 2)
        self.checks.append(check)
        self.say(f"--- {check.name}: {check.status} (passed {check.passed}, failed "
                 f"{check.failed}, skipped {check.skipped}, {check.seconds:.1f} s)")
        return check

    # ------------------------------------------------------------------ the steps

    def wheels(self) -> Check:
        brought = sorted((self.root / ".whl").glob("*.whl"))
        site = os.environ.get("RINGCOMM_GPU_SITE")
        if not brought or not site:
            why = "no wheels in .whl/" if not brought else "no private folder (run gpu_check.sh)"
            return self.record(Check("wheels", "skip", skipped=1, detail={"why": why}))
        code, output, seconds = self.command(
            "wheels", [self.python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                       "--no-compile", "--target", site, *map(str, brought)], 120)
        names = [w.name for w in brought]
        return self.record(Check("wheels", "pass" if code == 0 else "fail",
                                 passed=len(names) if code == 0 else 0,
                                 failed=0 if code == 0 else len(names), seconds=seconds,
                                 detail={"installed" if code == 0 else "not installed": names,
                                         "folder": "private (PYTHONPATH), removed at exit"}))

    def modules(self) -> Check:
        needed = [*NEEDED, *(() if self.fake else NEEDED_ON_GPU)]
        probe = ("import importlib.util, json, sys; print(json.dumps({m: importlib.util."
                 "find_spec(m) is not None for m in sys.argv[1:]}))")
        names = [m for m, _, _ in (*needed, *OPTIONAL)]
        code, output, seconds = self.command("modules", [self.python, "-c", probe, *names], 60)
        try:
            found = json.loads(output.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return self.record(Check("modules", "fail", failed=1, seconds=seconds,
                                     detail={"why": "the probe printed no answer"}))
        missing = [f"{m}: bring the wheel {wheel} (for {what})" for m, wheel, what in needed
                   if not found.get(m)]
        optional = [f"{m}: bring the wheel {wheel} (for {what})" for m, wheel, what in OPTIONAL
                    if not found.get(m)]
        for line in missing:
            self.say(f"missing {line}")
        for line in optional:
            self.say(f"missing (optional) {line}")
        return self.record(Check("modules", "fail" if missing else "pass",
                                 passed=len(needed) - len(missing), failed=len(missing),
                                 seconds=seconds,
                                 detail={"missing": missing, "optional_missing": optional}))

    def probe(self, name: str, limit: float) -> Check:
        argv = [self.python, "-m", "ringcomm_bench.gpu_probe", name, "--device", self.device]
        code, output, seconds = self.command(name, argv, limit)
        result: dict[str, Any] = {}
        with contextlib.suppress(ValueError, IndexError):
            result = json.loads(output.strip().splitlines()[-1])
        ok = code == 0 and bool(result.get("ok"))
        if code is None:
            result["why"] = "timed out"
        elif not result:
            result["why"] = output.strip().splitlines()[-1:] or ["no output"]
        return self.record(Check(name, "pass" if ok else "fail", passed=int(ok),
                                 failed=int(not ok), seconds=seconds, detail=result))

    def pytest_gpu(self) -> Check:
        with tempfile.TemporaryDirectory(prefix="ringcomm-gpu-check-") as tmp:
            report = Path(tmp) / "junit.xml"
            argv = [self.python, "-m", "pytest", "-q", "-m", "gpu and not slow", "-p",
                    "no:cacheprovider",
                    f"--junitxml={report}", "tests"]
            env = {"RINGCOMM_TEST_RUNTIME": "fake" if self.fake else "cupy"}
            code, output, seconds = self.command("pytest-gpu", argv, 270, env)
            counts = _junit_counts(report)
        if counts is None:
            return self.record(Check("pytest-gpu", "fail", failed=1, seconds=seconds,
                                     detail={"why": "no test report (timed out or crashed)",
                                             "exit_code": code}))
        passed, failed, skipped = counts
        ok = code == 0 and failed == 0 and passed > 0
        return self.record(Check("pytest-gpu", "pass" if ok else "fail", passed=passed,
                                 failed=failed, skipped=skipped, seconds=seconds,
                                 detail={"exit_code": code, "runtime": env[
                                     "RINGCOMM_TEST_RUNTIME"]}))

    def tune(self) -> Check:
        """The device engines' constants, fitted here: the figures the cost model would
        price cuda-ipc and staged with on this machine."""
        with contextlib.suppress(FileNotFoundError):
            self.profile_path.unlink()  # an old file must not pass for this run's
        argv = [self.python, "-m", "ringcomm.cli", "tune", "--device", self.device, "-n", "2",
                "--quick", "-o", str(self.profile_path)]
        code, output, seconds = self.command("tune", argv, 60)
        try:
            devices = json.loads(self.profile_path.read_text())["devices"]
        except (OSError, ValueError, KeyError):
            return self.record(Check("tune", "fail", failed=1, seconds=seconds, detail={
                "why": "no profile with device constants written", "exit_code": code}))
        fitted = {engine: {"alpha_us": round(p["alpha"] * 1e6, 2),
                           "beta_GBps": round(1 / p["beta"] / 1e9, 2),
                           "gamma_GBps": round(1 / p["gamma"] / 1e9, 2)}
                  for engine, p in devices.items()}
        ok = code == 0 and set(fitted) == {"cuda-ipc", "staged"}
        return self.record(Check("tune", "pass" if ok else "fail", passed=len(fitted),
                                 failed=0 if ok else 1, seconds=seconds, detail={
                                     "exit_code": code, "constants": fitted,
                                     "profile": str(self.profile_path.relative_to(self.out))}))

    def bench(self) -> tuple[Check, dict[str, Any]]:
        if self.fake:  # the plumbing: small sizes, few repetitions (numpy on the CPU)
            sizes = ["-n", "2", "-b", "8", "-e", "64K", "-f", "32", "--reps", "3",
                     "--iters", "2", "--warmup", "1"]
        else:  # 8 B to 256 MiB at 2 and 4 ranks sharing the GPU
            sizes = ["-n", "2", "4", "-b", "8", "-e", "256M", "-f", "32", "--reps", "5"]
        argv = [self.python, "-m", "ringcomm_bench", "--device", self.device,
                "--collectives", "allreduce", *sizes, "--timeout", "120",
                "--json", str(self.bench_path)]
        if not self.fake:
            argv += ["--plot-dir", str(self.out / "plots")]
        with contextlib.suppress(FileNotFoundError):
            self.bench_path.unlink()  # an old file must not pass for this run's
        code, output, seconds = self.command("bench", argv, 200)
        try:
            ran = json.loads(self.bench_path.read_text())
        except (OSError, ValueError):
            return self.record(Check("bench", "fail", failed=1, seconds=seconds, detail={
                "why": "no results written", "exit_code": code})), {}
        rows = ran.get("rows", [])
        wrong = [r for r in rows if r["wrong"]]
        ok = code == 0 and rows and not wrong
        figures = {
            "command": ran.get("command"), "runtime": ran.get("runtime"),
            "results": str(self.bench_path.relative_to(self.out)),
            "device_targets": ran.get("device_targets", []), "notes": ran.get("notes", []),
            "rows": [{k: r.get(k) for k in (
                "world_size", "backend", "bytes", "dtype", "chosen", "time_us", "algbw_GBps",
                "busbw_GBps", "wrong", "predicted_us", "copy_rw_GBps", "one_gpu_bound_GBps")
                if r.get(k) is not None} for r in rows]}
        check = Check("bench", "pass" if ok else "fail", passed=len(rows) - len(wrong),
                      failed=len(wrong) + (0 if rows else 1), seconds=seconds,
                      detail={"exit_code": code, "rows": len(rows)})
        return self.record(check), figures


def _junit_counts(path: Path) -> tuple[int, int, int] | None:
    """(passed, failed, skipped) from pytest's JUnit XML report; None where there is none."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return total - failed - skipped, failed, skipped


STEPS = ("wheels", "modules", "versions", "ipc", "host-register", "mps", "pytest-gpu", "tune",
         "bench")


def check(root: Path, out: Path, fake: bool, budget: float = BUDGET_S,
          python: str | None = None, steps: tuple[str, ...] = STEPS) -> dict[str, Any]:
    """Run the steps asked for (every one by default; the others are recorded as skipped),
    write the JSON and the log, return what was written."""
    started = time.monotonic()
    # every step runs on the Python gpu_check.sh was given (PYTHON), this one by default
    run = Run(root, out, fake, budget, python or os.environ.get("PYTHON") or sys.executable)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    run.say(f"ringcomm gpu_check{' --fake' if fake else ''}: {date}, results in {out}")
    figures: dict[str, Any] = {}
    limits = {"versions": 90, "ipc": 90, "host-register": 60, "mps": 20}
    try:
        for step in STEPS:
            if step not in steps:
                run.record(Check(step, "skip", skipped=1, detail={"why": "not asked for"}))
            elif step == "wheels":
                run.wheels()
            elif step == "modules":
                run.modules()
            elif step == "pytest-gpu":
                run.pytest_gpu()
            elif step == "tune":
                run.tune()
            elif step == "bench":
                _, figures = run.bench()
            else:
                run.probe(step, limits[step])
    finally:
        found = next((c.detail for c in run.checks if c.name == "versions"), {})
        result = {
            "check": "ringcomm gpu_check", "fake": fake,
            "runtime": "fake" if fake else "cupy",
            "note": ("the fake runtime on a CPU machine: the steps and the plumbing are "
                     "checked; no figure here says anything about a GPU" if fake else
                     "measured on the device named here"),
            "date": date, "command": "bench/gpu_check.sh" + (" --fake" if fake else ""),
            "duration_s": round(time.monotonic() - started, 1),
            "machine": {"hostname": platform.node(), "cpus": os.cpu_count(),
                        "platform": platform.platform()},
            "device": {k: v for k, v in found.items() if k not in LIBRARIES},
            "versions": {k: v for k, v in found.items() if k not in ("ok",)},
            "checks": [vars(c) for c in run.checks],
            "passed": bool(run.checks) and all(c.status != "fail" for c in run.checks),
            "figures": figures,
        }
        run.json_path.write_text(json.dumps(result, indent=1) + "\n")
        run.say(f"\nwrote {run.json_path} and {run.log_path}: "
                f"{'every step passed' if result['passed'] else 'some steps failed'}")
        run.log.close()
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true",
                   help="on a CPU machine: the same steps against the strict fake runtime "
                   "(writes gpu_fake.json)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the JSON, the log and the benchmark's results "
                   "(default bench/results)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help=f"seconds for every step together (default {BUDGET_S:.0f})")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"the steps to run, commas between (default all: {','.join(STEPS)}); "
                   "the others are recorded as skipped")
    args = p.parse_args(argv)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    if unknown := [s for s in steps if s not in STEPS]:
        p.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    root = Path(__file__).resolve().parent.parent
    result = check(root, args.out or root / "bench" / "results", args.fake, args.budget,
                   steps=steps)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
