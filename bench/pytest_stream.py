"""A pytest plugin that appends one JSON line per event to a file as it happens, so that a
run killed half-way still says what it did: ``gpu_check``'s pytest-gpu step reads it.

    python -m pytest -p ringcomm_bench.pytest_stream --stream-to FILE ...

The lines, each a JSON object with an ``event``:

    collected      {"nodeids": [...]}: the tests selected to run (after -m/-k), once
    collect_error  {"nodeid", "message"}: a module that could not be collected
    start          {"nodeid"}: a test began (its setup)
    outcome        {"nodeid", "outcome", "duration", "message"?}: a test ended; outcome is
                   passed, failed, error (its setup or teardown failed), skipped, xfailed or
                   xpassed; duration is its setup, call and teardown together, in seconds
    finish         {"exitstatus"}: pytest ended by itself

Under pytest-xdist only the controller writes (the workers' reports reach it), so every
test has one ``outcome`` line; a worker that crashed gives its test a ``failed`` outcome
(xdist's own report). The file is opened for appending and each line is flushed as written.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

WHEN = ("setup", "call", "teardown")


class Stream:
    """The events of one pytest session, into one file."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 (closed at session end)
        self.collected = False
        self.started: set[str] = set()
        self.seen: dict[str, dict[str, Any]] = {}  # nodeid -> the phases reported so far

    def write(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"event": event, "time": round(time.time(), 3),
                                    **fields}) + "\n")
        self.file.flush()

    def collection(self, nodeids: list[str]) -> None:
        if not self.collected:  # under xdist every worker collects the same list
            self.collected = True
            self.write("collected", nodeids=nodeids)

    def start(self, nodeid: str) -> None:
        if nodeid not in self.started:
            self.started.add(nodeid)
            self.write("start", nodeid=nodeid)

    def report(self, report: pytest.TestReport) -> None:
        phases = self.seen.setdefault(report.nodeid, {"duration": 0.0})
        phases["duration"] += float(getattr(report, "duration", 0.0) or 0.0)
        outcome = _outcome(report)
        if outcome is not None and "outcome" not in phases:
            phases["outcome"], phases["message"] = outcome, _message(report)
        elif outcome == "error" and phases["outcome"] in ("passed", "xpassed"):
            phases["outcome"], phases["message"] = outcome, _message(report)  # teardown
        # the teardown ends a test; a report of no phase of the three is xdist's for a test
        # whose worker crashed, and is the only one that test gets
        if report.when == "teardown" or report.when not in WHEN:
            self.seen.pop(report.nodeid)
            line = {"nodeid": report.nodeid, "outcome": phases.get("outcome", "passed"),
                    "duration": round(phases["duration"], 3)}
            if phases.get("message"):
                line["message"] = phases["message"]
            self.write("outcome", **line)

    def close(self, exitstatus: int) -> None:
        self.write("finish", exitstatus=int(exitstatus))
        self.file.close()


def _outcome(report: pytest.TestReport) -> str | None:
    """What ``report`` decides about its test, or None where it decides nothing (a setup
    or teardown that passed)."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call" or report.when not in WHEN:
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return str(report.outcome)
    if report.skipped:  # a skip mark or pytest.skip in a fixture: setup says skipped
        return "xfailed" if xfail else "skipped"
    if report.failed:
        return "error"
    return None


def _message(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """One line on why: the crash line of a failure, the reason of a skip."""
    if report.passed:
        return None
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        text = str(longrepr[2])
    elif crash is not None and getattr(crash, "message", None):
        text = str(crash.message)
    else:
        lines = str(longrepr or "").strip().splitlines()
        text = lines[-1] if lines else ""
    return " ".join(text.split())[:500] or None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("ringcomm").addoption(
        "--stream-to", default=None, metavar="FILE",
        help="append one JSON line per test event to FILE as it happens "
        "(ringcomm_bench.pytest_stream)")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--stream-to")
    if path and not hasattr(config, "workerinput"):  # xdist's workers: the controller writes
        config.pluginmanager.register(Hooks(Stream(path)), "ringcomm-stream")


class Hooks:
    """The hooks that feed a :class:`Stream` (registered only where ``--stream-to`` is)."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # serial runs: xdist's controller collects nothing and hears from its workers
        if not session.config.pluginmanager.hasplugin("dsession"):
            self.stream.collection([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: Any, ids: list[str]) -> None:
        self.stream.collection(list(ids))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.stream.write("collect_error", nodeid=report.nodeid, message=_message(report))

    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        self.stream.start(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.stream.report(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.stream.close(exitstatus)
