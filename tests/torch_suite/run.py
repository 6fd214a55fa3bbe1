"""Run torch's own distributed test suite against gloo and ringcomm and compare them.

    python -m tests.torch_suite.run --world-size 2              # both backends, all tests
    python -m tests.torch_suite.run -w 2 3 4 -b ringcomm -k allreduce -k broadcast
    python -m tests.torch_suite.run -w 2 --reuse                # keep saved gloo results
    python -m tests.torch_suite.run -w 3 4 --resume             # finish interrupted runs
    python -m tests.torch_suite.run -w 2 -b ringcomm -t test_barrier    # one test, exactly

Each (backend, world size) runs in its own process, one test after another, every test in
fresh spawned ranks (that is how upstream runs it; it takes a while on a small machine).
Results are saved as JSON per run in ``--results`` (default ``tests/torch_suite/results``),
written as they come, so an interrupted run still counts. The summary gives the counts per
run and lists every test that passes on gloo but not on ringcomm, with its error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_RESULTS = HERE / "results"
OUTCOMES = ("passed", "failed", "errors", "skipped")


# --------------------------------------------------------------------------- child process


class _Recorder(unittest.TextTestResult):
    """Records every test's outcome and writes the lot to ``path`` after each test."""

    def __init__(self, path: Path, meta: dict, saved: dict[str, dict], *args,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.path = path
        self.meta = meta
        self.records: dict[str, dict] = dict(saved)
        self._started = 0.0

    def startTest(self, test):  # noqa: N802 - unittest's name
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.records[name] = {"outcome": outcome, "seconds": round(time.monotonic() -
                                                                   self._started, 2),
                              "detail": detail[-3000:]}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.meta, "tests": self.records}, indent=1))
        tmp.replace(self.path)

    def addSuccess(self, test):  # noqa: N802
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):  # noqa: N802
        super().addFailure(test, err)
        self._record(test, "failed", self._exc_info_to_string(err, test))

    def addError(self, test, err):  # noqa: N802
        super().addError(test, err)
        self._record(test, "errors", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):  # noqa: N802
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):  # noqa: N802
        super().addExpectedFailure(test, err)
        self._record(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test):  # noqa: N802
        super().addUnexpectedSuccess(test)
        self._record(test, "failed", "unexpected success")


def _child(args: argparse.Namespace) -> int:
    from tests.torch_suite.suite import TARGET, TestDistBackendWithSpawn

    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.exact:
        unknown = sorted(set(args.exact) - set(names))
        if unknown:
            print(f"no such test in DistributedTest._DistTestBase: {', '.join(unknown)}",
                  file=sys.stderr)
            return 2
        names = [n for n in names if n in args.exact]
    out = Path(args.out)
    meta = {"backend": TARGET, "world_size": int(os.environ["WORLD_SIZE"]),
            "selected": len(names)}
    saved = _load(out).get("tests", {}) if args.resume else {}
    suite = unittest.TestSuite(TestDistBackendWithSpawn(n) for n in names if n not in saved)
    runner = unittest.TextTestRunner(
        verbosity=2, stream=sys.stdout,
        resultclass=lambda *a, **kw: _Recorder(out, meta, saved, *a, **kw))
    try:
        runner.run(suite)
    except Exception:  # noqa: BLE001 - keep what was recorded; say why it stopped
        traceback.print_exc()
        return 1
    return 0


# --------------------------------------------------------------------------- parent


def _results_path(results: Path, backend: str, world: int) -> Path:
    return results / f"{backend}-ws{world}.json"


def _run_one(backend: str, world: int, args: argparse.Namespace) -> Path:
    path = _results_path(Path(args.results), backend, world)
    path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, RINGCOMM_SUITE_BACKEND=backend, BACKEND=backend,
               WORLD_SIZE=str(world), PYTHONUNBUFFERED="1",
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.test_timeout))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "tests.torch_suite.run", "--child", "--out", str(path)]
    for k in args.k or ():
        cmd += ["-k", k]
    for name in args.exact or ():
        cmd += ["--test", name]
    if args.resume:
        cmd.append("--resume")
    log = path.with_suffix(".log")
    print(f"== {backend}, world size {world}: log in {log}", flush=True)
    started = time.monotonic()
    with open(log, "a" if args.resume else "w") as f:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    print(f"   done in {time.monotonic() - started:.0f} s: {_counts_line(_load(path))}",
          flush=True)
    return path


def _retry(backend: str, world: int, args: argparse.Namespace) -> None:
    """Rerun the saved failures of one run (by exact name) and merge the outcomes."""
    path = _results_path(Path(args.results), backend, world)
    saved = _load(path)
    failed = [n for n, rec in saved.get("tests", {}).items()
              if rec["outcome"] in ("failed", "errors")]
    if not failed:
        return
    retry = argparse.Namespace(**{**vars(args), "k": None, "exact": failed, "resume": False,
                                  "results": str(path.parent / "retry")})
    fresh = _load(_run_one(backend, world, retry))
    saved["tests"].update(fresh.get("tests", {}))
    path.write_text(json.dumps(saved, indent=1))


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"tests": {}}


def _counts(data: dict) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for rec in data.get("tests", {}).values():
        counts[rec["outcome"]] += 1
    return counts


def _counts_line(data: dict) -> str:
    c = _counts(data)
    return ", ".join(f"{c[o]} {o}" for o in OUTCOMES) + f" of {len(data.get('tests', {}))}"


def _reason(detail: str) -> str:
    """The line of a failure's text that says what went wrong: the innermost exception
    raised in a rank, else the last line."""
    lines = [ln.strip() for ln in detail.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Timeout)\b", ln)
              and not re.match(r"^RuntimeError: Process \d+ (exited|terminated)", ln)]
    return (errors or lines or [""])[-1][:300]


def summarize(results: Path, worlds: list[int], backends: list[str]) -> str:
    lines = ["| world size | backend | passed | failed | errors | skipped | total |",
             "|---|---|---|---|---|---|---|"]
    gaps = []
    for world in worlds:
        loaded = {b: _load(_results_path(results, b, world)) for b in backends}
        for b in backends:
            c = _counts(loaded[b])
            lines.append(f"| {world} | {b} | " + " | ".join(str(c[o]) for o in OUTCOMES)
                         + f" | {len(loaded[b].get('tests', {}))} |")
        if "gloo" in loaded and "ringcomm" in loaded:
            g, r = loaded["gloo"]["tests"], loaded["ringcomm"]["tests"]
            for name, rec in sorted(g.items()):
                if rec["outcome"] == "passed" and name in r and r[name]["outcome"] != "passed":
                    gaps.append(f"ws{world} {name}: {r[name]['outcome']}: "
                                f"{_reason(r[name]['detail'])}")
    out = "\n".join(lines)
    if gaps:
        out += "\n\nPassed on gloo, not on ringcomm:\n" + "\n".join(gaps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.torch_suite.run",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("-w", "--world-size", type=int, nargs="+", default=[2])
    parser.add_argument("-b", "--backend", nargs="+", default=["gloo", "ringcomm"])
    parser.add_argument("-k", action="append",
                        help="run only tests whose name contains this (repeatable)")
    parser.add_argument("-t", "--test", action="append", dest="exact",
                        help="run this test (exact name; repeatable)")
    parser.add_argument("--results", default=str(DEFAULT_RESULTS))
    parser.add_argument("--reuse", action="store_true",
                        help="do not rerun gloo where saved results exist")
    parser.add_argument("--retry", action="store_true",
                        help="rerun only the tests that failed in the saved results, and "
                             "merge the new outcomes into them")
    parser.add_argument("--resume", action="store_true",
                        help="keep the saved outcomes and run only the tests not yet recorded "
                             "(an interrupted run picks up where it stopped)")
    parser.add_argument("--test-timeout", type=int, default=180,
                        help="seconds before one test's ranks are declared hung")
    parser.add_argument("--summary", action="store_true", help="only print saved results")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args)
    results = Path(args.results)
    if not args.summary:
        for world in args.world_size:
            for backend in args.backend:
                path = _results_path(results, backend, world)
                if args.reuse and backend == "gloo" and path.exists():
                    continue
                if args.retry:
                    _retry(backend, world, args)
                else:
                    _run_one(backend, world, args)
    print(summarize(results, args.world_size, args.backend))
    empty = [f"{backend} at world size {world}" for world in args.world_size
             for backend in args.backend
             if not _load(_results_path(results, backend, world)).get("tests")]
    if empty:
        print(f"no test ran for {', '.join(empty)}: see the logs in {results} (is expecttest "
              "installed? `pip install -e '.[test]'`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
