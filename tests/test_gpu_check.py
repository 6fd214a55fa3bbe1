"""``bench/gpu_check.sh`` and ``ringcomm bench --device``, on the fake runtime.

The GPU machine is lent for minutes at a time, so the one command run there must work the
first time: its ``--fake`` mode runs every step against the strict fake runtime here, and
the JSON it writes is what the GPU run writes too. The pytest step's streaming and its
limit run here on small synthetic test folders (a run stopped at its limit keeps what
finished and names what did not); the MPS run starts and stops a stand-in control command.
The device sweep runs over two real ranks on fake device arrays, through each device
engine, and every result is checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ringcomm_bench import device, gpu_check, gpu_pytest, sweep

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
    for name in ("wheels", "host-register", "pytest-gpu", "tune", "bench", "bench-mps"):
        assert checks[name]["status"] == "skip" and checks[name]["detail"]["why"] == "not asked for"
    assert result["passed"] is True and result["quick"] is False
    assert not (tmp_path / "gpu_tests_fake.jsonl").exists()  # no tests asked for


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
    # nothing brought here (.whl/ is for the GPU machine), no MPS on the fake: the only
    # steps allowed to skip
    assert checks["wheels"]["status"] in ("pass", "skip")
    assert checks["bench-mps"]["status"] == "skip"
    assert checks["bench-mps"]["detail"]["why"] == gpu_check.mps_unavailable(fake=True)
    for name in gpu_check.STEPS[1:-1]:
        assert checks[name]["status"] == "pass", (name, checks[name], log[-3000:])
    tests = checks["pytest-gpu"]
    assert tests["passed"] > 0 and tests["failed"] == 0
    assert len(tests["detail"]["tests"]) == tests["passed"] + tests["skipped"]
    assert "not_finished" not in tests["detail"] and "why" not in tests["detail"]
    rows = result["figures"]["rows"]
    assert rows and all(r["wrong"] == 0 for r in rows)
    assert {r["backend"] for r in rows} == {device.IPC, device.KERNEL, device.STAGED,
                                            f"{device.NCCL_ENGINE}:ring",
                                            f"{device.NCCL_ENGINE}:nccl"}
    assert result["figures"]["runtime"] == "fake" and result["passed"] is True
    constants = checks["tune"]["detail"]["constants"]
    assert set(constants) == {"cuda-ipc", "staged"}
    assert all(c["alpha_us"] > 0 and c["beta_GBps"] > 0 for c in constants.values())
    assert result["duration_s"] < 8 * 60


SYNTHETIC_INI = """[pytest]
markers =
    gpu: as in ringcomm's tests
    slow: as in ringcomm's tests
"""


def _synthetic(folder: Path, tests: str, **more: str) -> Path:
    """A test folder of its own (its pytest.ini makes it the root): quick to collect."""
    folder.mkdir()
    (folder / "pytest.ini").write_text(SYNTHETIC_INI)
    (folder / "test_synthetic.py").write_text(tests)
    for name, text in more.items():
        (folder / f"{name}.py").write_text(text)
    return folder


STOPPED = """
import os, signal, subprocess, sys, time
import pytest

pytestmark = pytest.mark.gpu


def test_a_passes():
    pass


def test_b_fails():
    assert 1 == 2, "wrong on purpose"


def test_c_hangs_and_ignores_the_interrupt():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(os.environ["SYNTHETIC_CHILD"], "w") as f:
        f.write(str(child.pid))
    time.sleep(300)


def test_d_never_starts():
    pass


@pytest.mark.slow
def test_e_slow_is_left_out():
    pass
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stopped_run(tmp_path: Path) -> tuple[dict, float]:
    """The pytest step of the ``STOPPED`` tests with a budget of 10 s: gpu_check's result
    and the seconds it took."""
    tests = _synthetic(tmp_path / "synthetic", STOPPED)
    started = time.monotonic()
    result = gpu_check.check(ROOT, tmp_path / "out", fake=True, budget=10,
                             python=sys.executable, steps=("pytest-gpu",), tests=(str(tests),))
    return result, time.monotonic() - started


def test_a_pytest_step_stopped_at_its_limit_keeps_what_finished_and_names_what_did_not(
        waiting_runs, request):
    """The hung test ignores the interrupt, so pytest is killed and never ends its session:
    the record comes from the stream alone, and the process the test started dies with it."""
    tmp_path, (result, took) = waiting_runs[request.node.name].result()
    assert took < 14
    step = {c["name"]: c for c in result["checks"]}["pytest-gpu"]
    detail = step["detail"]
    assert (step["status"], step["passed"], step["failed"]) == ("fail", 1, 1), step
    assert detail["why"].startswith("stopped at the step's limit") and detail["exit_code"] is None
    name = "test_synthetic.py::test_"
    assert detail["not_finished"] == [f"{name}c_hangs_and_ignores_the_interrupt",
                                      f"{name}d_never_starts"]
    assert detail["running_when_stopped"] == [f"{name}c_hangs_and_ignores_the_interrupt"]
    outcomes = {t["nodeid"]: t for t in detail["tests"]}
    assert {n: t["outcome"] for n, t in outcomes.items()} == {
        f"{name}a_passes": "passed", f"{name}b_fails": "failed"}
    assert outcomes[f"{name}b_fails"]["message"] == "AssertionError: wrong on purpose assert 1 == 2"
    assert all(t["duration"] >= 0 for t in detail["tests"])
    assert result["passed"] is False
    assert json.loads((tmp_path / "out" / "gpu_fake.json").read_text())["checks"] == \
        result["checks"]
    # the tests' lines reached the log as they ended, before the stop
    log = (tmp_path / "out" / "gpu_check_fake.log").read_text()
    passed = re.search(r"test_a_passes PASSED|PASSED \S*test_a_passes", log)  # serial, xdist
    assert passed and passed.start() < log.index("(stopped at its limit of 10 s)"), log
    assert f"not finished (2): {name}c_hangs" in log
    streamed = gpu_pytest.read_stream(tmp_path / "out" / "gpu_tests_fake.jsonl")
    assert streamed.exitstatus is None  # killed: pytest never said it ended
    # nothing the test started outlives the step
    child = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


OUTCOMES = """
import os, time
import pytest

pytestmark = pytest.mark.gpu


def test_passes():
    pass


def test_fails():
    assert 1 == 2, "wrong on purpose"


@pytest.mark.skip(reason="not here")
def test_skipped():
    pass


@pytest.mark.xfail(reason="known")
def test_xfails():
    assert False


@pytest.fixture
def broken_setup():
    raise RuntimeError("setup broke")


def test_setup_error(broken_setup):
    pass


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown broke")


def test_teardown_error(broken_teardown):
    pass


def test_over_its_time_limit():
    time.sleep(30)


@pytest.mark.skipif("PYTEST_XDIST_WORKER" not in os.environ, reason="would end a serial run")
def test_its_worker_dies():
    os._exit(3)


def test_after_the_others():
    pass
"""


def _stream_run(tmp_path: Path, xdist: bool) -> tuple[gpu_pytest.Plan, int | None, str,
                                                   gpu_pytest.Streamed]:
    """The ``OUTCOMES`` tests (and a module that cannot be imported), serially or in xdist
    workers, with a time limit of 2 s a test: the plan, pytest's exit status, its output
    and what it streamed."""
    tests = _synthetic(tmp_path / "synthetic", OUTCOMES,
                       test_broken_import="import no_such_module_here\n")
    stream = tmp_path / "stream.jsonl"
    plan = gpu_pytest.plan(sys.executable, stream, per_test_timeout=2, cores=4,
                           have={"xdist": xdist, "pytest_timeout": True}, paths=[str(tests)])
    with (tmp_path / "log").open("w") as log:
        code, output, _ = gpu_check.bounded(plan.argv, cwd=ROOT, env=dict(os.environ),
                                            limit=60, log=log)
    return plan, code, output, gpu_pytest.read_stream(stream)


@pytest.mark.parametrize("workers", ["serial", "xdist"])
def test_the_stream_has_one_outcome_per_test_as_the_record_counts_it(waiting_runs, request,
                                                                      workers):
    """Each kind of ending, a module that cannot be imported and a test over its own time
    limit (the run goes on), serially and in xdist workers (where xdist is here: it is on
    the GPU machine)."""
    xdist = workers == "xdist"
    if xdist and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed here")
    _, (plan, code, output, streamed) = waiting_runs[request.node.name].result()
    assert plan.workers == (2 if xdist else 0) and ("-n" in plan.argv) == xdist
    outcomes = {t["nodeid"].split("::")[-1]: t["outcome"] for t in streamed.outcomes}
    assert outcomes == {
        "test_passes": "passed", "test_fails": "failed", "test_skipped": "skipped",
        "test_xfails": "xfailed", "test_setup_error": "error", "test_teardown_error": "error",
        "test_over_its_time_limit": "failed",
        "test_its_worker_dies": "failed" if xdist else "skipped",
        "test_after_the_others": "passed"}, output[-3000:]
    assert len(streamed.outcomes) == len(outcomes)  # one line per test, not per phase
    messages = {t["nodeid"].split("::")[-1]: t.get("message") for t in streamed.outcomes}
    assert "Timeout" in messages["test_over_its_time_limit"]
    assert messages["test_setup_error"] == "RuntimeError: setup broke"
    assert messages["test_teardown_error"] == "RuntimeError: teardown broke"
    assert messages["test_skipped"] == "Skipped: not here" and messages["test_passes"] is None
    assert [e["nodeid"] for e in streamed.collect_errors] == ["test_broken_import.py"]
    assert sorted(n.split("::")[-1] for n in streamed.collected or []) == sorted(outcomes)
    assert streamed.counts() == (2, 5 + xdist, 2 + (not xdist))
    assert code == streamed.exitstatus == 1
    ok, detail = gpu_pytest.record(streamed, code, False, 60)
    assert not ok and "not_finished" not in detail and "why" not in detail
    assert detail["collect_errors"][0]["message"].endswith("No module named 'no_such_module_here'")


# The step stopped at its limit waits most of its 10 s for that limit, and each stream run a
# test's 2 s limit: the runs of those tests that this session runs start together when the
# first of them does (the tests follow one another), each test then checks its own.
WAITING = {
    "test_a_pytest_step_stopped_at_its_limit_keeps_what_finished_and_names_what_did_not":
        _stopped_run,
    "test_the_stream_has_one_outcome_per_test_as_the_record_counts_it[serial]":
        lambda tmp_path: _stream_run(tmp_path, xdist=False),
    "test_the_stream_has_one_outcome_per_test_as_the_record_counts_it[xdist]":
        lambda tmp_path: _stream_run(tmp_path, xdist=True),
}


@pytest.fixture(scope="module")
def waiting_runs(request, tmp_path_factory):
    """Each ``WAITING`` run whose test this session runs, started at once in a thread of its
    own: its ``Future`` of (its folder, what it returned) under its test's name. The stopped
    step's synthetic test writes its child's pid where ``SYNTHETIC_CHILD`` says."""
    names = [item.name for item in request.session.items
             if item.module is request.module and item.name in WAITING
             and ("xdist]" not in item.name or importlib.util.find_spec("xdist") is not None)]

    def run(name: str, tmp_path: Path) -> tuple[Path, object]:
        return tmp_path, WAITING[name](tmp_path)

    folders = {name: tmp_path_factory.mktemp("waiting") for name in names}
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(max_workers=3) as pool:
        stopped = next((n for n in names if n.startswith("test_a_pytest_step_stopped")), None)
        if stopped is not None:
            mp.setenv("SYNTHETIC_CHILD", str(folders[stopped] / "child.pid"))
        yield {name: pool.submit(run, name, folders[name]) for name in names}


def test_reading_a_stream_cut_short():
    """A kill can cut the last line; a run stopped before its collection ended cannot say
    which tests it would have run."""
    lines = [{"event": "start", "nodeid": "t.py::a"}]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"event": "outcome", "nodeid": "t.p'
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"ringcomm-stream-{os.getpid()}.jsonl"
    try:
        path.write_text(text)
        streamed = gpu_pytest.read_stream(path)
    finally:
        path.unlink()
    assert streamed.started == ["t.py::a"] and streamed.outcomes == []
    assert streamed.collected is None and streamed.not_finished() is None
    ok, detail = gpu_pytest.record(streamed, None, True, 30)
    assert not ok and detail["not_finished"] == "unknown: collection had not ended"
    assert gpu_pytest.read_stream(path).collected is None  # no file: nothing known
    done = gpu_pytest.Streamed(collected=["t.py::a"], started=["t.py::a"], exitstatus=0,
                               outcomes=[{"nodeid": "t.py::a", "outcome": "passed",
                                          "duration": 0.1}])
    assert gpu_pytest.record(done, 0, False, 30) == (True, {"exit_code": 0,
                                                            "tests": done.outcomes})
    ok, detail = gpu_pytest.record(gpu_pytest.Streamed(collected=[], exitstatus=5), 5, False, 30)
    assert not ok and detail["why"] == "no test ran (pytest's exit status 5)"
    # a pytest that ended with 0 but never finished its session (killed from outside)
    ok, detail = gpu_pytest.record(gpu_pytest.Streamed(collected=[]), 0, False, 30)
    assert not ok and "ended without finishing" in detail["why"]


def test_a_run_stopped_from_outside_still_writes_what_it_found(tmp_path):
    """SIGTERM to the shell script (a machine's own limit): the step then running is
    recorded as failed, the ones after as not reached, and gpu.json is written."""
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.Popen([str(SCRIPT), "--fake", "--out", str(tmp_path), "--steps",
                             "modules,versions"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:  # the versions probe takes seconds: stop the run in it
        if line.startswith("=== versions"):
            proc.terminate()
            break
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    result = json.loads((tmp_path / "gpu_fake.json").read_text())
    checks = {c["name"]: c for c in result["checks"]}
    assert list(checks) == list(gpu_check.STEPS) and result["passed"] is False
    assert checks["modules"]["status"] == "pass"
    assert checks["versions"]["status"] == "fail"
    assert checks["versions"]["detail"]["why"] == \
        "gpu_check itself was stopped in this step (SystemExit)"
    assert all(checks[s]["detail"]["why"] == "not reached: gpu_check was stopped"
               for s in gpu_check.STEPS[gpu_check.STEPS.index("versions") + 1:])


def test_the_workers_come_from_the_cores_and_serially_without_xdist(tmp_path):
    assert [gpu_pytest.workers_for(n) for n in (None, 1, 2, 3, 4, 10, 16, 64)] == \
        [1, 1, 1, 1, 2, 8, 8, 8]
    stream = tmp_path / "s.jsonl"
    both = gpu_pytest.plan("py", stream, per_test_timeout=90, cores=16,
                           have={"xdist": True, "pytest_timeout": True})
    assert both.argv[:2] == ["py", "-m"] and both.argv[-1] == "tests"
    assert both.argv[both.argv.index("-n"):both.argv.index("-n") + 2] == ["-n", "8"]
    assert "--timeout=90" in both.argv and f"--stream-to={stream}" in both.argv
    assert both.argv[both.argv.index("-m", 3) + 1] == "gpu and not slow"
    neither = gpu_pytest.plan("py", stream, per_test_timeout=90, cores=16, have={})
    assert neither.workers == 0 and neither.per_test_timeout is None
    assert "-n" not in neither.argv and not any(a.startswith("--timeout") for a in neither.argv)
    assert any("pytest-xdist is not importable" in n for n in neither.notes)
    assert gpu_pytest.importable(sys.executable, ["json", "no_such_module_here"]) == {
        "json": True, "no_such_module_here": False}


def test_the_plans_fit_their_budgets_and_keep_time_for_the_steps_after(tmp_path):
    full = sum(gpu_check.PLAN[s][0] for s in gpu_check.STEPS)
    quick = sum(gpu_check.QUICK_PLAN[s][0] for s in gpu_check.STEPS
                if s not in gpu_check.QUICK_DROPS)
    assert full <= gpu_check.BUDGET_S < 8 * 60 - 5
    assert quick <= gpu_check.QUICK_BUDGET_S < 4 * 60 - 5
    run = gpu_check.Run(ROOT, tmp_path, True, gpu_check.QUICK_BUDGET_S, sys.executable,
                        quick=True)
    assert "tune" not in run.asked
    # at the start the tests may take their most: the benchmarks' shares are kept
    assert run.limit("pytest-gpu") == pytest.approx(gpu_check.QUICK_PLAN["pytest-gpu"][1],
                                                    abs=1)
    assert run.limit("bench") == gpu_check.QUICK_PLAN["bench"][1]
    run.deadline -= 200  # the steps before took most of the budget: bench-mps keeps its 20
    assert run.limit("bench") == pytest.approx(5, abs=1)
    run.log.close()
    small = gpu_check.Run(ROOT, tmp_path, True, 100, sys.executable)  # a budget cut short
    assert small.limit("wheels") < 100 and sum(k for k, _ in small.plan.values()) < 130
    small.log.close()
    result = gpu_check.check(ROOT, tmp_path, True, python=sys.executable, quick=True,
                             steps=("tune", "bench-mps"))
    checks = {c["name"]: c for c in result["checks"]}
    assert checks["tune"]["detail"]["why"] == "left out by --quick"
    assert checks["bench-mps"]["detail"]["why"].startswith("the fake runtime")
    assert result["quick"] is True and result["budget_s"] == gpu_check.QUICK_BUDGET_S
    assert result["command"] == "bench/gpu_check.sh --fake --quick"
    assert result["figures_mps"] == {} and result["passed"] is True


@pytest.mark.parametrize(("quick", "mps"), [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_the_bench_steps_ask_the_sweep_for_what_it_can_run(quick, mps):
    args = gpu_check.bench_args("cuda", quick, mps)
    parser = sweep.build_parser()
    s, worlds = sweep.settings_from(parser.parse_args(["--device", "cuda", *args]))
    assert worlds == [2, 4] and s.sizes[0] == 8
    assert s.sizes[-1] == (8 << 20 if quick else 16 << 20 if mps else 256 << 20)
    assert [b.name for b in s.backends] == (list(gpu_check.MPS_BACKENDS) if mps else
                                            sweep.DEVICE_BACKENDS["cuda"])
    fake, _ = sweep.settings_from(parser.parse_args(
        ["--device", "fake", *gpu_check.bench_args("fake", quick, mps)]))
    assert fake.sizes == [8, 256, 8 << 10]


def _mps_control(folder: Path, start_exit: int = 0) -> Path:
    """A stand-in for nvidia-cuda-mps-control on PATH that writes down how it was called."""
    folder.mkdir()
    calls = folder / "calls"
    script = folder / gpu_check.MPS_CONTROL
    script.write_text(f"#!/bin/sh\nif [ \"$1\" = -d ]; then echo \"start "
                      f"$CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY\" >> {calls}; "
                      f"exit {start_exit}; fi\nread line\necho \"$line "
                      f"$CUDA_MPS_PIPE_DIRECTORY\" >> {calls}\n")
    script.chmod(0o755)
    return calls


def test_the_mps_bench_starts_its_daemon_and_always_stops_it(tmp_path, monkeypatch):
    calls = _mps_control(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpu_check, "mps_unavailable", lambda fake: None)
    seen = []

    def bench(self, name="bench", env=None, about=None):
        seen.append((name, dict(env or {}), about))
        if len(seen) == 2:
            raise RuntimeError("the bench broke")
        return self.record(gpu_check.Check(name)), {"rows": []}

    monkeypatch.setattr(gpu_check.Run, "bench", bench)
    run = gpu_check.Run(ROOT, tmp_path / "out", False, 60, sys.executable)
    check, figures = run.bench_mps()
    assert check.status == "pass" and check.detail["mps_stopped"] is True
    name, env, about = seen[0]
    pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert name == "bench-mps" and f"CUDA_MPS_PIPE_DIRECTORY={pipe}" in about
    assert calls.read_text().splitlines() == [
        f"start {pipe} {env['CUDA_MPS_LOG_DIRECTORY']}", f"quit {pipe}"]
    with pytest.raises(RuntimeError, match="the bench broke"):
        run.bench_mps()
    assert calls.read_text().splitlines()[-1] == f"quit {seen[1][1]['CUDA_MPS_PIPE_DIRECTORY']}"
    run.log.close()
    assert "MPS daemon stopped" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_bench_mps_runs_the_kernel_paths_gpu_tests_under_its_daemon_first(tmp_path,
                                                                        monkeypatch):
    """Ranks sharing one GPU run the kernel path only under MPS: bench-mps runs its gpu
    tests under the daemon it started, before the sweep, and a failing test fails the
    step."""
    _mps_control(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpu_check, "mps_unavailable", lambda fake: None)
    ran = []

    def bounded(argv, *, cwd, env, limit, log):
        ran.append((argv, env, limit))
        return exit_codes.pop(0), "x\n2 passed in 9.0s\n", 9.0

    exit_codes = [0, 1]
    monkeypatch.setattr(gpu_check, "bounded", bounded)
    monkeypatch.setattr(gpu_check.Run, "bench", lambda self, name="bench", env=None,
                        about=None: (self.record(gpu_check.Check(name)), {"rows": []}))
    run = gpu_check.Run(ROOT, tmp_path / "out", False, 60, sys.executable)
    check, _ = run.bench_mps()
    assert check.status == "pass"
    assert check.detail["kernel_tests"] == {"exit_code": 0, "seconds": 9.0,
                                            "summary": "2 passed in 9.0s"}
    argv, env, limit = ran[0]
    assert argv[-2:] == ["tests/test_kernel_path.py", "tests/test_registration.py"]
    assert gpu_check.gpu_pytest.MARKER in argv
    assert env["RINGCOMM_TEST_RUNTIME"] == "cupy" and "CUDA_MPS_PIPE_DIRECTORY" in env
    assert limit <= gpu_check.KERNEL_TESTS_S
    check, _ = run.bench_mps()  # a test failed: the step fails
    run.log.close()
    assert check.status == "fail" and check.detail["kernel_tests"]["exit_code"] == 1


def test_an_mps_daemon_that_does_not_start_fails_the_step_and_is_still_told_to_quit(
        tmp_path, monkeypatch):
    calls = _mps_control(tmp_path / "bin", start_exit=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gpu_check, "mps_unavailable", lambda fake: None)
    run = gpu_check.Run(ROOT, tmp_path / "out", False, 60, sys.executable)
    check, figures = run.bench_mps()
    run.log.close()
    assert check.status == "fail" and "did not start" in check.detail["why"]
    assert figures == {} and calls.read_text().splitlines()[-1].startswith("quit ")


def test_mps_is_started_only_as_root_with_its_control_command_and_none_running(monkeypatch):
    assert gpu_check.mps_unavailable(fake=True).startswith("the fake runtime")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert gpu_check.mps_unavailable(fake=False).startswith("not root")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpu_check.mps_unavailable(fake=False) == f"{gpu_check.MPS_CONTROL} is not on PATH"


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
    assert [b.name for b in s.backends] == [device.IPC, device.KERNEL, device.STAGED,
                                            f"{device.NCCL_ENGINE}:ring",
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
