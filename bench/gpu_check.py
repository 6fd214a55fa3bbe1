"""``bench/gpu_check.sh``: everything a GPU machine can tell about ringcomm's device path, in
one command and under eight minutes, written to ``gpu.json`` and a log.

A GPU machine is lent for minutes at a time, with nothing outside it reachable, so the run
must not need anything it does not bring (wheels in ``.whl/``, installed by the shell script
into a private folder on ``PYTHONPATH``), must not stop at the first failure and must leave
its findings in files however it ends. Each step is a command in a process session of its
own, its output copied into the log as it comes, bounded by a time limit: at the limit it is
interrupted, a few seconds later killed with everything it started; a failing step is
recorded and the next one runs. The limits come from a plan that keeps time for every step
still to come, within the run's budget. The steps:

    wheels         the brought wheels, installed into the private folder (none: skipped)
    modules        which modules ringcomm, its tests and the benchmark need are missing
                   (with the wheel to bring for each)
    versions       device, driver, CUDA, CuPy, NCCL, torch (``gpu_probe versions``)
    ipc            device memory and an event shared by two processes (``gpu_probe ipc``)
    host-register  a /dev/shm mapping page-locked (``gpu_probe host-register``)
    mps            whether MPS runs (``gpu_probe mps``)
    pytest-gpu     the tests marked ``gpu`` and not ``slow``, in pytest-xdist workers where
                   it is importable, a time limit per test, every test's outcome streamed
                   as it ends and kept in ``gpu.json`` even when the step is stopped at its
                   limit (``gpu_pytest``; ``make test-slow`` on a GPU machine adds the slow
                   ones)
    tune           ``ringcomm tune --device --quick``: the device engines' cost constants
                   fitted on this device (``gpu_profile.json``, a profile ringcomm reads
                   through ``RINGCOMM_PROFILE``)
    bench          ``ringcomm bench --device``: the short device sweep (rows with #wrong 0
                   pass), without MPS (unless a daemon not of this run's runs already)
    bench-mps      under an MPS daemon this run starts and stops (as root, with
                   ``nvidia-cuda-mps-control`` on PATH and no daemon running; skipped with the
                   reason otherwise): first the kernel path's gpu tests
                   (``tests/test_kernel_path.py``, ``tests/test_registration.py``: ranks
                   sharing one GPU run its kernels at
                   once only under MPS, so pytest-gpu skips them there), then the sweep
                   again, shorter, with the kernel path as a backend

``--quick`` fits in four minutes instead of eight: the same tests, no tune step, the
benchmarks at 8 B, 8 KiB and 8 MiB only and without plots.

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
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from . import gpu_pytest

STEPS = ("wheels", "modules", "versions", "ipc", "host-register", "mps", "pytest-gpu", "tune",
         "bench", "bench-mps")
QUICK_DROPS = ("tune",)  # the steps --quick leaves out

# the whole run, with the shell script's set-up: under eight minutes, --quick under four
BUDGET_S = 470.0
QUICK_BUDGET_S = 225.0
# each step's time in seconds: (kept for it while the steps before it run, the most it may
# take). The first figures add up to the budget, so however the steps before it went, each
# step finds its share left; a step takes more when the ones before it took less than
# theirs. On an H100 (2026-11) the probes took seconds each and the gpu tests 98 s in six
# workers (236 s serially were not enough).
PLAN = {"wheels": (20, 120), "modules": (5, 60), "versions": (15, 90), "ipc": (15, 90),
        "host-register": (10, 60), "mps": (5, 20), "pytest-gpu": (150, 260),
        "tune": (40, 60), "bench": (140, 200), "bench-mps": (70, 140)}
KERNEL_TESTS_S = 80.0  # of bench-mps: the kernel path's gpu tests under its daemon
QUICK_PLAN = {**PLAN, "ipc": (10, 90), "host-register": (5, 60), "pytest-gpu": (110, 170),
              "tune": (0, 0), "bench": (35, 60), "bench-mps": (20, 40)}
PER_TEST_S = 120.0  # --timeout for each gpu test (the suite's own default), --quick: 90
QUICK_PER_TEST_S = 90.0
GRACE_S = 5.0  # from the interrupt at a step's limit to the kill of its whole session

# (module, the wheel that brings it, what needs it); cupy only on a GPU
NEEDED = (
    ("numpy", "numpy", "ringcomm"), ("torch", "torch", "ringcomm"), ("zmq", "pyzmq", "ringcomm"),
    ("ml_dtypes", "ml-dtypes", "ringcomm"), ("xxhash", "xxhash", "ringcomm"),
    ("pytest", "pytest", "tests"), ("pytest_timeout", "pytest-timeout", "tests"),
    ("hypothesis", "hypothesis", "tests"), ("rich", "rich", "bench"),
    ("matplotlib", "matplotlib", "bench"),
)
NEEDED_ON_GPU = (("cupy", "cupy-cuda13x (or cupy-cuda12x)", "the device runtime"),)
OPTIONAL = (("expecttest", "expecttest", "torch's own test suite (tests/torch_suite)"),
            ("xdist", "pytest-xdist and execnet", "the gpu tests in parallel workers"))


# what ``versions`` reports beside the device's own description (``gpu.json``'s "device")
LIBRARIES = ("ok", "available", "runtime", "torch", "torch_cuda", "torch_cuda_available",
             "numpy", "python", "cupy", "nccl")

# bench-mps: what MPS may change (the device engines, the copy's ceiling, torch's CUDA
# tensors through ringcomm), not the slow socket-bound NCCL and Gloo rows
MPS_BACKENDS = ("ringcomm+cuda-ipc", "ringcomm+cuda-kernel", "ringcomm+staged", "copy",
                "ringcomm/torch+cuda")
MPS_CONTROL = "nvidia-cuda-mps-control"


def bench_args(device: str, quick: bool, mps: bool) -> list[str]:
    """The device sweep's sizes (and for ``bench-mps`` its backends)."""
    if device == "fake":  # the plumbing: small sizes, few repetitions (numpy on the CPU)
        return ["-n", "2", "-b", "8", "-e", "64K", "-f", "32", "--reps", "3", "--iters", "2",
                "--warmup", "1"]
    # --quick: 8 B, 8 KiB and 8 MiB, few repetitions
    short = ["-b", "8", "-e", "8M", "-f", "1024", "--reps", "3", "--iters", "3",
             "--warmup", "1"]
    if mps:  # 8 B to 16 MiB
        sizes = short if quick else ["-b", "8", "-e", "16M", "-f", "128", "--reps", "3"]
        return ["-n", "2", "4", *sizes, "--backends", *MPS_BACKENDS]
    # 8 B to 256 MiB at 2 and 4 ranks sharing the GPU
    return ["-n", "2", "4", *(short if quick else
                              ["-b", "8", "-e", "256M", "-f", "32", "--reps", "5"])]


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


def bounded(argv: list[str], *, cwd: Path, env: dict[str, str], limit: float, log: IO[str],
            grace: float = GRACE_S) -> tuple[int | None, str, float]:
    """Run ``argv`` in a process session of its own, its output (stdout and stderr) copied
    into ``log`` line by line as it comes; at ``limit`` seconds interrupt it (SIGINT: pytest
    and the benchmark say what they were doing), ``grace`` seconds later kill its whole
    session (pytest's workers, the ranks a test or the benchmark started). What is left in
    the session after a normal end is killed too, so that nothing holds the GPU for the
    steps after. Its exit status (None: stopped at the limit), output and seconds."""
    grace = min(grace, limit / 4)
    kept: list[str] = []
    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            errors="replace", bufsize=1, start_new_session=True)
    copier = threading.Thread(target=_copy_lines, args=(proc.stdout, log, kept), daemon=True)
    copier.start()
    stopped = False
    try:
        proc.wait(timeout=max(limit - grace, 0.1))
    except subprocess.TimeoutExpired:
        stopped = True
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    finally:  # also where gpu_check itself is stopped: nothing it started outlives it
        _kill_session(proc.pid)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    # the pipe ends when every process that held it has: one that left the session must
    # not hold up the run
    copier.join(timeout=2.0)
    output = "".join(kept)
    if stopped:
        note = f"(stopped at its limit of {limit:.0f} s)\n"
        log.write(note)
        output += note
    log.flush()
    return None if stopped else proc.returncode, output, time.monotonic() - started


def _copy_lines(source: IO[str], log: IO[str], kept: list[str]) -> None:
    with contextlib.suppress(ValueError, OSError):  # the log closed under a stray writer
        for line in source:
            kept.append(line)
            log.write(line)
            log.flush()


def _kill_session(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _last_json(output: str) -> dict[str, Any] | None:
    """The last line of ``output`` that is a JSON object (a probe's answer: warnings on
    stderr may come after it)."""
    for line in reversed(output.strip().splitlines()):
        with contextlib.suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict):
                return found
    return None


def mps_daemons() -> list[str]:
    """The MPS processes running here (named ``nvidia-cuda-mps-*``)."""
    running = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if name.startswith("nvidia-cuda-mps"):
                running.append(name)
    return sorted(set(running))


def mps_unavailable(fake: bool) -> str | None:
    """Why this run cannot start an MPS daemon of its own, or None where it can."""
    if fake:
        return "the fake runtime: MPS shares a GPU, there is none"
    if os.geteuid() != 0:
        return "not root: this run starts an MPS daemon only as root"
    if shutil.which(MPS_CONTROL) is None:
        return f"{MPS_CONTROL} is not on PATH"
    if running := mps_daemons():
        return (f"an MPS daemon runs already ({', '.join(running)}), not this run's: the "
                "bench step ran under it")
    return None


class MpsDaemon:
    """An MPS control daemon of this run's own, its pipe and log folders in ``folder``; its
    clients need :attr:`env` (the same ``CUDA_MPS_PIPE_DIRECTORY``)."""

    def __init__(self, folder: Path) -> None:
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "mps"),
                    "CUDA_MPS_LOG_DIRECTORY": str(folder / "mpslog")}

    def _control(self, args: list[str], text: str | None = None) -> tuple[int | None, str]:
        try:
            done = subprocess.run([MPS_CONTROL, *args], input=text, capture_output=True,
                                  text=True, timeout=30, env={**os.environ, **self.env})
        except (OSError, subprocess.TimeoutExpired) as err:
            return None, str(err)
        return done.returncode, (done.stdout + done.stderr).strip()

    def start(self) -> str | None:
        """Start the daemon; None, or why it did not start."""
        for folder in self.env.values():
            Path(folder).mkdir(parents=True, exist_ok=True)
        code, output = self._control(["-d"])
        return None if code == 0 else f"{MPS_CONTROL} -d: exit {code} {output}".strip()

    def stop(self, wait: float = 10.0) -> bool:
        """Tell it to quit and wait for its processes to end; whether they did."""
        self._control([], "quit\n")
        deadline = time.monotonic() + wait
        while mps_daemons() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not mps_daemons()


class Run:
    """The steps of one check run: their time limits from the plan and the run's budget,
    their output into the log, their outcomes into ``checks``."""

    def __init__(self, root: Path, out: Path, fake: bool, budget: float, python: str,
                 quick: bool = False, steps: tuple[str, ...] = STEPS,
                 tests: tuple[str, ...] = ("tests",)) -> None:
        self.root, self.out, self.fake, self.python = root, out, fake, python
        self.quick, self.tests = quick, tests
        self.device = "fake" if fake else "cuda"
        self.deadline = time.monotonic() + budget
        self.checks: list[Check] = []
        # the steps that will run, in order; where their shares add up to more than the
        # budget (a --budget below the default), each is cut in proportion
        self.asked = [s for s in STEPS if s in steps and not (quick and s in QUICK_DROPS)]
        plan = QUICK_PLAN if quick else PLAN
        total = sum(plan[s][0] for s in self.asked)
        scale = min(1.0, budget / total) if total else 1.0
        self.plan = {s: (kept * scale, most) for s, (kept, most) in plan.items()}
        suffix = "_fake" if fake else ""
        self.json_path = out / f"gpu{suffix}.json"
        self.log_path = out / f"gpu_check{suffix}.log"
        self.tests_path = out / f"gpu_tests{suffix}.jsonl"
        self.bench_path = out / f"gpu_bench{suffix}.json"
        self.bench_mps_path = out / f"gpu_bench_mps{suffix}.json"
        self.profile_path = out / f"gpu_profile{suffix}.json"
        out.mkdir(parents=True, exist_ok=True)
        self.log = self.log_path.open("w")

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def limit(self, step: str) -> float:
        """The seconds ``step`` may take now: its most, less the time the steps after it
        keep, out of what is left of the budget."""
        later = self.asked[self.asked.index(step) + 1:] if step in self.asked else []
        left = self.deadline - time.monotonic() - sum(self.plan[s][0] for s in later)
        return min(self.plan[step][1], left)

    def command(self, name: str, argv: list[str], env: dict[str, str] | None = None,
                about: str | None = None) -> tuple[int | None, str, float]:
        """Run ``argv`` from the repository's root, bounded by the step's limit
        (:func:`bounded`); its exit status (None: stopped at the limit), output and
        seconds."""
        limit = self.limit(name)
        self.say(f"\n=== {name}{f' ({about})' if about else ''}: {shlex.join(argv)} "
                 f"(limit {limit:.0f} s)")
        if limit < 1:
            self.log.write("no time left in the run's budget\n")
            return None, "no time left in the run's budget", 0.0
        return bounded(argv, cwd=self.root, env={**os.environ, **(env or {})}, limit=limit,
                       log=self.log)

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
                       "--no-compile", "--target", site, *map(str, brought)])
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
        code, output, seconds = self.command("modules", [self.python, "-c", probe, *names])
        found = _last_json(output)
        if found is None:
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

    def probe(self, name: str) -> Check:
        argv = [self.python, "-m", "ringcomm_bench.gpu_probe", name, "--device", self.device]
        code, output, seconds = self.command(name, argv)
        result = _last_json(output) or {}
        ok = code == 0 and bool(result.get("ok"))
        if code is None:
            result["why"] = "timed out"
        elif not result:
            result["why"] = output.strip().splitlines()[-1:] or ["no output"]
        return self.record(Check(name, "pass" if ok else "fail", passed=int(ok),
                                 failed=int(not ok), seconds=seconds, detail=result))

    def pytest_gpu(self) -> Check:
        """The gpu tests, streamed (:mod:`ringcomm_bench.gpu_pytest`): every test's outcome
        comes from the stream file, so the record holds however pytest ended."""
        limit = self.limit("pytest-gpu")
        with contextlib.suppress(FileNotFoundError):
            self.tests_path.unlink()  # an old file must not pass for this run's
        have = gpu_pytest.importable(self.python, ("xdist", "pytest_timeout"))
        plan = gpu_pytest.plan(self.python, self.tests_path, cores=os.cpu_count(), have=have,
                               per_test_timeout=QUICK_PER_TEST_S if self.quick else PER_TEST_S,
                               paths=self.tests)
        runtime = "fake" if self.fake else "cupy"
        started, interrupted = time.monotonic(), None
        try:
            code, _, seconds = self.command("pytest-gpu", plan.argv,
                                            {"RINGCOMM_TEST_RUNTIME": runtime},
                                            about="; ".join(plan.notes))
        except (KeyboardInterrupt, SystemExit) as err:  # gpu_check itself stopped
            code, seconds, interrupted = None, time.monotonic() - started, err
        streamed = gpu_pytest.read_stream(self.tests_path)
        ok, found = gpu_pytest.record(streamed, code, code is None, limit)
        if interrupted is not None:
            found["why"] = f"gpu_check itself was stopped ({type(interrupted).__name__})"
        elif limit < 1:
            found["why"] = "no time left in the run's budget"
        passed, failed, skipped = streamed.counts()
        check = self.record(Check(
            "pytest-gpu", "pass" if ok else "fail", passed=passed,
            failed=failed + (0 if ok or failed else 1), skipped=skipped, seconds=seconds,
            detail={"runtime": runtime, "marker": gpu_pytest.MARKER, "workers": plan.workers,
                    "per_test_timeout_s": plan.per_test_timeout, "notes": plan.notes,
                    "stream": self.tests_path.name, **found}))
        for line in streamed.outcomes:
            if gpu_pytest.COUNTS.get(line["outcome"]) == "failed":
                self.say(f"  {line['outcome']}: {line['nodeid']}: {line.get('message', '')}")
        for line in streamed.collect_errors:
            self.say(f"  not collected: {line['nodeid']}: {line['message']}")
        if "why" in found:
            self.say(f"  {found['why']}")
        if isinstance(not_finished := found.get("not_finished"), list):
            self.say(f"  not finished ({len(not_finished)}): {', '.join(not_finished)}")
        if interrupted is not None:
            raise interrupted
        return check

    def tune(self) -> Check:
        """The device engines' constants, fitted here: the figures the cost model would
        price cuda-ipc and staged with on this machine."""
        with contextlib.suppress(FileNotFoundError):
            self.profile_path.unlink()  # an old file must not pass for this run's
        argv = [self.python, "-m", "ringcomm.cli", "tune", "--device", self.device, "-n", "2",
                "--quick", "-o", str(self.profile_path)]
        code, output, seconds = self.command("tune", argv)
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

    def bench(self, name: str = "bench", env: dict[str, str] | None = None,
              about: str | None = None) -> tuple[Check, dict[str, Any]]:
        """The device sweep (``bench``), or its shorter run under MPS (``bench-mps``, with
        the daemon's ``env``)."""
        mps = name == "bench-mps"
        path = self.bench_mps_path if mps else self.bench_path
        argv = [self.python, "-m", "ringcomm_bench", "--device", self.device,
                "--collectives", "allreduce", *bench_args(self.device, self.quick, mps),
                "--timeout", "120", "--json", str(path)]
        if not (self.fake or self.quick or mps):
            argv += ["--plot-dir", str(self.out / "plots")]
        under = None
        if not mps:
            running = [] if self.fake else mps_daemons()
            under = (f"under an MPS daemon running already, not this run's "
                     f"({', '.join(running)})" if running else "without MPS")
            about = about or ("the fake runtime" if self.fake else under)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # an old file must not pass for this run's
        code, output, seconds = self.command(name, argv, env, about=about)
        try:
            ran = json.loads(path.read_text())
        except (OSError, ValueError):
            return self.record(Check(name, "fail", failed=1, seconds=seconds, detail={
                "why": "no results written", "exit_code": code, "mps": about})), {}
        rows = ran.get("rows", [])
        wrong = [r for r in rows if r["wrong"]]
        ok = code == 0 and rows and not wrong
        figures = {
            "command": ran.get("command"), "runtime": ran.get("runtime"),
            "mps": about, "results": str(path.relative_to(self.out)),
            "device_targets": ran.get("device_targets", []), "notes": ran.get("notes", []),
            "rows": [{k: r.get(k) for k in (
                "world_size", "backend", "bytes", "dtype", "chosen", "time_us", "algbw_GBps",
                "busbw_GBps", "wrong", "predicted_us", "copy_rw_GBps", "one_gpu_bound_GBps")
                if r.get(k) is not None} for r in rows]}
        check = Check(name, "pass" if ok else "fail", passed=len(rows) - len(wrong),
                      failed=len(wrong) + (0 if rows else 1), seconds=seconds,
                      detail={"exit_code": code, "rows": len(rows), "mps": about})
        return self.record(check), figures

    def kernel_tests(self, env: dict[str, str]) -> dict[str, Any]:
        """The kernel path's gpu tests (its ops, registered memory) under this run's MPS
        daemon (``env``), within ``KERNEL_TESTS_S`` of bench-mps's time: its exit status,
        seconds and pytest's summary line."""
        have = gpu_pytest.importable(self.python, ("pytest_timeout",))
        argv = [self.python, "-m", "pytest", "-q", "-m", gpu_pytest.MARKER, "-p",
                "no:cacheprovider", *(["--timeout=120", "--timeout-method=signal"]
                                      if have.get("pytest_timeout") else []),
                "tests/test_kernel_path.py", "tests/test_registration.py"]
        limit = min(KERNEL_TESTS_S, self.limit("bench-mps"))
        self.say(f"\n=== bench-mps (the kernel path's gpu tests under MPS): "
                 f"{shlex.join(argv)} (limit {limit:.0f} s)")
        code, output, seconds = bounded(
            argv, cwd=self.root, env={**os.environ, **env,
                                      "RINGCOMM_TEST_RUNTIME": "fake" if self.fake else "cupy"},
            limit=limit, log=self.log)
        lines = [line for line in output.splitlines() if line.strip()]
        return {"exit_code": code, "seconds": round(seconds, 1),
                "summary": lines[-1] if lines else ""}

    def bench_mps(self) -> tuple[Check, dict[str, Any]]:
        """The sweep again, shorter, under an MPS daemon this run starts and always stops:
        ranks sharing the GPU without time-slicing."""
        if (why := mps_unavailable(self.fake)) is not None:
            self.say(f"\n=== bench-mps: skipped: {why}")
            return self.record(Check("bench-mps", "skip", skipped=1, detail={"why": why})), {}
        with tempfile.TemporaryDirectory(prefix="ringcomm-mps-") as tmp:
            daemon = MpsDaemon(Path(tmp))
            try:
                if (error := daemon.start()) is not None:
                    self.say(f"\n=== bench-mps: the MPS daemon did not start: {error}")
                    return self.record(Check("bench-mps", "fail", failed=1, detail={
                        "why": f"the MPS daemon did not start: {error}"})), {}
                kernel = self.kernel_tests(daemon.env)
                check, figures = self.bench("bench-mps", daemon.env, about=(
                    f"under an MPS daemon this run started, CUDA_MPS_PIPE_DIRECTORY="
                    f"{daemon.env['CUDA_MPS_PIPE_DIRECTORY']}"))
                check.detail["kernel_tests"] = kernel
                if kernel["exit_code"] != 0:
                    check.status, check.failed = "fail", check.failed + 1
                    self.say(f"--- bench-mps: fail (the kernel path's gpu tests under MPS: "
                             f"exit {kernel['exit_code']}, {kernel['summary']})")
            finally:
                stopped = daemon.stop()
                self.say(f"MPS daemon {'stopped' if stopped else 'still running 10 s after quit'}")
        check.detail["mps_stopped"] = stopped
        if not stopped:
            check.status, check.failed = "fail", check.failed + 1
        return check, figures


def check(root: Path, out: Path, fake: bool, budget: float | None = None,
          python: str | None = None, steps: tuple[str, ...] = STEPS, quick: bool = False,
          tests: tuple[str, ...] = ("tests",)) -> dict[str, Any]:
    """Run the steps asked for (every one by default; the others are recorded as skipped),
    write the JSON and the log, return what was written. ``tests``: what pytest-gpu runs."""
    started = time.monotonic()
    budget = budget if budget is not None else QUICK_BUDGET_S if quick else BUDGET_S
    # every step runs on the Python gpu_check.sh was given (PYTHON), this one by default
    run = Run(root, out, fake, budget, python or os.environ.get("PYTHON") or sys.executable,
              quick, steps, tests)
    date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    flags = " --fake" * fake + " --quick" * quick
    run.say(f"ringcomm gpu_check{flags}: {date}, budget {budget:.0f} s, results in {out}")
    figures: dict[str, Any] = {}
    figures_mps: dict[str, Any] = {}
    step = STEPS[0]
    try:
        for step in STEPS:
            if step not in steps:
                run.record(Check(step, "skip", skipped=1, detail={"why": "not asked for"}))
            elif quick and step in QUICK_DROPS:
                run.record(Check(step, "skip", skipped=1, detail={"why": "left out by --quick"}))
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
            elif step == "bench-mps":
                _, figures_mps = run.bench_mps()
            else:
                run.probe(step)
    except BaseException as err:  # stopped (SIGTERM, ^C) or broken: the record still says so
        if step not in {c.name for c in run.checks}:
            run.record(Check(step, "fail", failed=1, detail={
                "why": f"gpu_check itself was stopped in this step ({type(err).__name__})"}))
        for later in STEPS[STEPS.index(step) + 1:]:
            run.record(Check(later, "skip", skipped=1, detail={
                "why": "not reached: gpu_check was stopped"}))
        raise
    finally:
        found = next((c.detail for c in run.checks if c.name == "versions"), {})
        result = {
            "check": "ringcomm gpu_check", "fake": fake, "quick": quick,
            "runtime": "fake" if fake else "cupy",
            "note": ("the fake runtime on a CPU machine: the steps and the plumbing are "
                     "checked; no figure here says anything about a GPU" if fake else
                     "measured on the device named here"),
            "date": date, "command": "bench/gpu_check.sh" + flags,
            "budget_s": budget, "duration_s": round(time.monotonic() - started, 1),
            "machine": {"hostname": platform.node(), "cpus": os.cpu_count(),
                        "platform": platform.platform()},
            "device": {k: v for k, v in found.items() if k not in LIBRARIES},
            "versions": {k: v for k, v in found.items() if k not in ("ok",)},
            "checks": [vars(c) for c in run.checks],
            "passed": (len(run.checks) == len(STEPS) and
                       all(c.status != "fail" for c in run.checks)),
            "figures": figures,
            "figures_mps": figures_mps,
        }
        run.json_path.write_text(json.dumps(result, indent=1) + "\n")
        run.say(f"\nwrote {run.json_path} and {run.log_path}: "
                f"{'every step passed' if result['passed'] else 'some steps failed'}")
        run.log.close()
    return result


def _stop(signum: int, _frame: Any) -> None:
    """SIGTERM (a machine's limit): end like an interrupt, so that the steps' sessions are
    killed, the MPS daemon stopped and ``gpu.json`` written with what was found."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--fake", action="store_true",
                   help="on a CPU machine: the same steps against the strict fake runtime "
                   "(writes gpu_fake.json)")
    p.add_argument("--quick", action="store_true",
                   help=f"under four minutes (budget {QUICK_BUDGET_S:.0f} s): the same gpu "
                   f"tests (a {QUICK_PER_TEST_S:.0f} s limit each), no tune step, the "
                   "benchmarks at 8 B, 8 KiB and 8 MiB with few repetitions and no plots")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for the JSON, the log and the benchmark's results "
                   "(default bench/results)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"seconds for every step together (default {BUDGET_S:.0f}, --quick "
                   f"{QUICK_BUDGET_S:.0f}); each step's share shrinks in proportion")
    p.add_argument("--steps", default=",".join(STEPS),
                   help=f"the steps to run, commas between (default all: {','.join(STEPS)}); "
                   "the others are recorded as skipped")
    args = p.parse_args(argv)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    if unknown := [s for s in steps if s not in STEPS]:
        p.error(f"unknown step(s) {', '.join(unknown)}; choose from {', '.join(STEPS)}")
    root = Path(__file__).resolve().parent.parent
    signal.signal(signal.SIGTERM, _stop)
    result = check(root, args.out or root / "bench" / "results", args.fake, args.budget,
                   steps=steps, quick=args.quick)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
