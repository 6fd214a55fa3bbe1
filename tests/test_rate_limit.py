"""``ringcomm.core.rate_limit``: log lines at a bounded rate, the held-back ones counted; and
``ringcomm.core.waits``: timeouts as the OS's and ZeroMQ's calls take them."""

from __future__ import annotations

import logging
import math
import threading

import pytest
import zmq

from ringcomm.core import waits
from ringcomm.core.rate_limit import MAX_KINDS, RateLimitedLog

log = logging.getLogger("ringcomm.test_rate_limit")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.DEBUG, logger=log.name)

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == log.name]

    return said


def test_a_burst_then_the_rate_and_the_next_line_counts_what_was_held_back(lines):
    clock = Clock()
    limited = RateLimitedLog(log, per_second=2, burst=3, clock=clock)
    written = [limited.warning("bad", "refused %d", i) for i in range(1000)]
    assert written == [True] * 3 + [False] * 997
    assert lines() == ["refused 0", "refused 1", "refused 2"]
    clock.now += 0.5  # one line's worth of time
    assert limited.warning("bad", "refused %s", "again")
    assert not limited.warning("bad", "refused %s", "too soon")
    assert lines()[-1] == "refused again (997 similar lines suppressed in the last 0.5 s)"
    assert (limited.emitted, limited.suppressed) == (4, 998)


def test_over_any_span_a_kind_writes_at_most_its_burst_plus_its_rate(lines):
    clock = Clock()
    limited = RateLimitedLog(log, per_second=5, burst=10, clock=clock)
    for _ in range(20_000):  # 20,000 refusals over 20 s
        clock.now += 0.001
        limited.warning("flood", "one more")
    assert len(lines()) <= 10 + 5 * 20 + 1
    assert limited.emitted + limited.suppressed == 20_000


def test_kinds_have_their_own_budgets_and_the_table_of_kinds_is_bounded(lines):
    clock = Clock()
    limited = RateLimitedLog(log, per_second=1, burst=1, clock=clock)
    assert limited.warning("a", "a") and limited.warning("b", "b")
    assert not limited.warning("a", "a again")
    for k in range(10 * MAX_KINDS):  # kinds beyond the table share one bucket
        limited.warning(("kind", k), "k")
    assert len(limited._buckets) <= MAX_KINDS + 1
    assert len(lines()) <= 2 + MAX_KINDS + 1


def test_flush_says_how_many_were_held_back_once_the_flood_has_ended(lines):
    clock = Clock()
    limited = RateLimitedLog(log, per_second=1, burst=2, clock=clock)
    for _ in range(50):
        limited.warning("junk", "junk")
    assert limited.flush() == 0  # no budget yet: nothing more now
    clock.now += 3
    assert limited.flush() == 1
    assert lines()[-1] == "48 similar lines suppressed in the last 3.0 s (junk)"
    assert limited.flush() == 0  # said once


def test_a_level_nobody_reads_is_neither_written_nor_counted(caplog):
    caplog.set_level(logging.WARNING, logger=log.name)
    limited = RateLimitedLog(log, per_second=1, burst=1)
    assert not limited.debug("k", "quiet")
    assert limited.suppressed == 0 and limited.warning("k", "heard")


def test_threads_share_one_without_losing_count():
    limited = RateLimitedLog(log, per_second=1, burst=5)

    def knock() -> None:
        for _ in range(2000):
            limited.warning("k", "knock")

    threads = [threading.Thread(target=knock) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert limited.emitted + limited.suppressed == 8000 and limited.emitted <= 5 + 30


def test_bad_limits_are_refused():
    for per_second, burst in ((0, 1), (1, 0), (-1, 5)):
        with pytest.raises(ValueError):
            RateLimitedLog(log, per_second=per_second, burst=burst)


# --------------------------------------------------------------------------- waits


def test_timeouts_of_any_size_become_waits_the_calls_take():
    assert waits.clamp(5.0) == 5.0
    for huge in (waits.MAX_TIMEOUT + 1, 1e30, math.inf, math.nan):
        assert waits.clamp(huge) == waits.MAX_TIMEOUT
    assert waits.poll_ms(None) is None and waits.wait_s(None) is None
    assert waits.poll_ms(-1) == 0 and waits.poll_ms(math.nan) == 0
    assert waits.poll_ms(0.0125) == 12
    for huge in (2.2e6, 1e30, math.inf):
        assert waits.poll_ms(huge) == waits.MAX_POLL_MS
        assert waits.wait_s(huge) <= threading.TIMEOUT_MAX
    # a wait three times MAX_TIMEOUT (a deadline's slack on top) still fits the calls
    assert waits.poll_ms(3 * waits.MAX_TIMEOUT) < waits.MAX_POLL_MS
    # and the calls take the limits themselves
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    try:
        with pytest.raises(OverflowError):
            zmq.zmq_poll([(sock, zmq.POLLIN)], waits.MAX_POLL_MS + 1)
        sock.bind("inproc://waits")
        other = ctx.socket(zmq.PUSH)
        other.connect("inproc://waits")
        other.send(b"x")  # so that the longest wait returns at once
        assert zmq.zmq_poll([(sock, zmq.POLLIN)], waits.MAX_POLL_MS)
        other.close(linger=0)
    finally:
        sock.close(linger=0)
        ctx.term()
    cond = threading.Condition()
    with cond, pytest.raises(OverflowError):  # what wait_s keeps callers from
        cond.wait(math.inf)
