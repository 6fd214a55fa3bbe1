"""``gpu_check``'s pytest-gpu step: the tests marked ``gpu`` in parallel workers, each test's
outcome streamed to a file as it ends, and a record that holds even when the step is
stopped at its limit.

- **Workers**: pytest-xdist where the run's Python can import it, ``-n`` sized from the
  cores (``min(8, cores - 2)``, at least 1); serially where it cannot.
- **Per test**: ``--timeout`` (pytest-timeout, where importable): a hung test fails alone
  and its worker goes on.
- **Streaming**: pytest's ``-v`` lines go into the log as they are printed, and the plugin
  ``ringcomm_bench.pytest_stream`` appends one JSON line per test as it ends. The record is
  read from that file, so it holds whatever happened to the process.
- **The limit**: like every step's command, pytest runs in a session of its own, is
  interrupted at its limit and killed with all its session a few seconds later
  (``gpu_check.bounded``). The record then names the tests that had not finished, and
  among them those that were running.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = "gpu and not slow"
PLUGIN = "ringcomm_bench.pytest_stream"
MAX_WORKERS = 8

# outcome -> the count it adds to (passed, failed, skipped)
COUNTS = {"passed": "passed", "xpassed": "passed", "failed": "failed", "error": "failed",
          "skipped": "skipped", "xfailed": "skipped"}


def workers_for(cores: int | None) -> int:
    """How many xdist workers on ``cores`` cores: two left to the ranks' helpers and the
    controller, at most :data:`MAX_WORKERS` (each test starts up to four rank processes
    sharing the one GPU), at least one."""
    return max(1, min(MAX_WORKERS, (cores or 1) - 2))


def importable(python: str, names: Iterable[str], timeout: float = 30.0) -> dict[str, bool]:
    """Which of the modules ``names`` the interpreter ``python`` finds (all False where it
    cannot even say)."""
    names = list(names)
    probe = ("import importlib.util, json, sys; print(json.dumps({m: importlib.util."
             "find_spec(m) is not None for m in sys.argv[1:]}))")
    try:
        done = subprocess.run([python, "-c", probe, *names], capture_output=True, text=True,
                              timeout=timeout)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        found = {}
    return {m: bool(found.get(m)) for m in names}


@dataclass
class Plan:
    """The command line of one pytest-gpu run and what it was sized from."""

    argv: list[str]
    workers: int  # 0: serially
    per_test_timeout: float | None
    notes: list[str] = field(default_factory=list)


def plan(python: str, stream: Path, *, per_test_timeout: float, cores: int | None,
         have: dict[str, bool], paths: Sequence[str] = ("tests",),
         marker: str = MARKER) -> Plan:
    """The pytest command: ``-m marker`` over ``paths``, streamed to ``stream``, in xdist
    workers where ``have["xdist"]``, with ``--timeout`` where ``have["pytest_timeout"]``."""
    argv = [python, "-m", "pytest", "-v", "-m", marker, "-p", "no:cacheprovider",
            "-p", PLUGIN, f"--stream-to={stream}", "--continue-on-collection-errors"]
    notes = []
    workers = 0
    if have.get("xdist"):
        workers = workers_for(cores)
        argv += ["-n", str(workers)]
        notes.append(f"pytest-xdist: {workers} workers on {cores} cores")
    else:
        notes.append("serially: pytest-xdist is not importable (bring the wheel "
                     "pytest-xdist and execnet for parallel workers)")
    timeout: float | None = per_test_timeout
    if have.get("pytest_timeout"):
        argv += [f"--timeout={per_test_timeout:g}", "--timeout-method=signal"]
    else:
        timeout = None
        notes.append("no time limit per test: pytest-timeout is not importable")
    return Plan([*argv, *paths], workers, timeout, notes)


@dataclass
class Streamed:
    """What a stream file says (:mod:`ringcomm_bench.pytest_stream`)."""

    collected: list[str] | None = None  # None: collection never ended
    started: list[str] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)  # in the order they ended
    collect_errors: list[dict[str, Any]] = field(default_factory=list)
    exitstatus: int | None = None  # None: pytest did not end by itself

    def counts(self) -> tuple[int, int, int]:
        """(passed, failed, skipped): xpassed counts as passed, an error (setup, teardown,
        a module that could not be collected) as failed, xfailed as skipped."""
        tally = {"passed": 0, "failed": len(self.collect_errors), "skipped": 0}
        for line in self.outcomes:
            tally[COUNTS.get(line["outcome"], "failed")] += 1
        return tally["passed"], tally["failed"], tally["skipped"]

    def not_finished(self) -> list[str] | None:
        """The tests collected that have no outcome (None where collection never ended)."""
        if self.collected is None:
            return None
        ended = {line["nodeid"] for line in self.outcomes}
        return [n for n in self.collected if n not in ended]

    def running(self) -> list[str]:
        """The tests that started and did not end."""
        ended = {line["nodeid"] for line in self.outcomes}
        return [n for n in self.started if n not in ended]


def read_stream(path: Path) -> Streamed:
    """The events in ``path``; a last line cut short by a kill is left out."""
    found = Streamed()
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return found
    for text in lines:
        try:
            event = json.loads(text)
        except ValueError:
            continue
        kind = event.get("event")
        if kind == "collected":
            found.collected = list(event["nodeids"])
        elif kind == "start":
            found.started.append(event["nodeid"])
        elif kind == "outcome":
            found.outcomes.append({k: event[k] for k in (
                "nodeid", "outcome", "duration", "message") if k in event})
        elif kind == "collect_error":
            found.collect_errors.append({"nodeid": event["nodeid"],
                                         "message": event.get("message")})
        elif kind == "finish":
            found.exitstatus = int(event["exitstatus"])
    return found


def record(streamed: Streamed, code: int | None, stopped: bool,
           limit: float) -> tuple[bool, dict[str, Any]]:
    """Whether the step passed, and what ``gpu.json`` keeps of it: every test's outcome,
    and where the run did not end by itself, why and which tests had not finished."""
    passed, failed, _ = streamed.counts()
    not_finished = streamed.not_finished()
    detail: dict[str, Any] = {"exit_code": code}
    if stopped:
        detail["why"] = f"stopped at the step's limit of {limit:.0f} s"
    elif streamed.exitstatus is None:
        detail["why"] = (f"pytest ended without finishing its session (exit status "
                         f"{code}): crashed or killed")
    elif not streamed.outcomes:
        detail["why"] = f"no test ran (pytest's exit status {code})"
    if not_finished is None:
        detail["not_finished"] = "unknown: collection had not ended"
    elif not_finished:
        detail["not_finished"] = not_finished
        if running := streamed.running():
            detail["running_when_stopped" if stopped else "running_at_the_end"] = running
    if streamed.collect_errors:
        detail["collect_errors"] = streamed.collect_errors
    detail["tests"] = streamed.outcomes
    ok = (code == 0 and not stopped and failed == 0 and passed > 0
          and not_finished == [])
    return ok, detail
