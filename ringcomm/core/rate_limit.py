"""Log lines at a bounded rate: what a stranger can make a process write to its log.

Whatever a peer sends that is refused is worth a line in the log, but a peer that sends
refusals in a loop must not fill the disk. ``RateLimitedLog`` wraps a logger and lets each
*kind* of line through at most ``burst`` times at once and ``per_second`` times a second
after that (a token bucket per kind); the lines it holds back are counted, and the next
line of that kind it lets through says how many were held back since the last one, so the
log still shows that the flood happened and how large it was::

    from ringcomm.core.rate_limit import RateLimitedLog

    refusals = RateLimitedLog(log, per_second=1.0, burst=10)  # one per server or socket
    ...
    refusals.warning("bad request", "the store on port %d refused a request from %s: %s",
                     port, peer, err)
    # a loop that goes on while nothing is logged may call, now and then:
    refusals.flush()  # "... K similar lines suppressed" for kinds whose flood has ended

The first argument is the kind of line: a few fixed strings a caller chooses (one per
reason it refuses), never a peer's address or anything else a peer picks, since the table
of kinds is kept (at most ``MAX_KINDS``; lines of further kinds share one bucket). Over
any span of ``t`` seconds a kind writes at most ``burst + per_second * t`` lines, plus one
line from ``flush`` per kind, and every line held back is counted in a later one.
Thread-safe: a server's thread and its gatekeeper's may share one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_KINDS", "RateLimitedLog"]

MAX_KINDS = 64
_OTHER = ("ringcomm.rate_limit", "other kinds")  # the bucket of kinds beyond MAX_KINDS


@dataclass
class _Bucket:
    tokens: float
    refilled: float  # when ``tokens`` was last brought up to date
    held: int = 0  # lines held back since the last one let through
    held_since: float = 0.0  # when the first of them was held back


class RateLimitedLog:
    """A logger's lines, at most ``burst`` at once and ``per_second`` a second after that,
    per kind of line; the module docstring says how to use it. ``suppressed`` counts every
    line held back so far (all kinds); ``emitted`` every line written."""

    def __init__(self, log: logging.Logger, per_second: float = 1.0, burst: int = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not per_second > 0 or burst < 1:
            raise ValueError(f"a rate limit needs per_second > 0 and burst >= 1, got "
                             f"{per_second} and {burst}")
        self.log = log
        self.per_second = float(per_second)
        self.burst = int(burst)
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[Hashable, _Bucket] = {}
        self.suppressed = 0
        self.emitted = 0

    def debug(self, kind: Hashable, msg: str, *args: Any) -> bool:
        return self.write(logging.DEBUG, kind, msg, *args)

    def info(self, kind: Hashable, msg: str, *args: Any) -> bool:
        return self.write(logging.INFO, kind, msg, *args)

    def warning(self, kind: Hashable, msg: str, *args: Any) -> bool:
        return self.write(logging.WARNING, kind, msg, *args)

    def error(self, kind: Hashable, msg: str, *args: Any) -> bool:
        return self.write(logging.ERROR, kind, msg, *args)

    def write(self, level: int, kind: Hashable, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless ``kind`` is over its rate (then count it).
        Whether the line was written. A line written after some were held back ends with
        how many."""
        if not self.log.isEnabledFor(level):
            return False  # nobody would read it: neither written nor counted
        with self._lock:
            now = self._clock()
            bucket = self._bucket(kind, now)
            if bucket.tokens < 1.0:
                if not bucket.held:
                    bucket.held_since = now
                bucket.held += 1
                self.suppressed += 1
                return False
            bucket.tokens -= 1.0
            held, since = bucket.held, bucket.held_since
            bucket.held = 0
            self.emitted += 1
        if held:
            msg += " (%d similar line%s suppressed in the last %.1f s)"
            args = (*args, held, "" if held == 1 else "s", now - since)
        self.log.log(level, msg, *args)
        return True

    def flush(self, level: int = logging.WARNING) -> int:
        """One line for each kind that has held lines back and could write again (its
        flood has slowed or ended): "K similar lines suppressed". How many lines it wrote.
        Cheap when nothing is held: a caller's loop may call it every turn."""
        if not self.suppressed:
            return 0
        due = []
        with self._lock:
            now = self._clock()
            for kind, bucket in self._buckets.items():
                self._refill(bucket, now)
                if bucket.held and bucket.tokens >= 1.0:
                    bucket.tokens -= 1.0
                    due.append((kind, bucket.held, now - bucket.held_since))
                    bucket.held = 0
                    self.emitted += 1
        for kind, held, span in due:
            name = kind if isinstance(kind, str) else repr(kind)
            self.log.log(level, "%d similar line%s suppressed in the last %.1f s (%s)", held,
                         "" if held == 1 else "s", span, name)
        return len(due)

    def _bucket(self, kind: Hashable, now: float) -> _Bucket:
        bucket = self._buckets.get(kind)
        if bucket is None:
            if len(self._buckets) >= MAX_KINDS:
                kind = _OTHER
                bucket = self._buckets.get(kind)
            if bucket is None:
                bucket = self._buckets[kind] = _Bucket(float(self.burst), now)
        self._refill(bucket, now)
        return bucket

    def _refill(self, bucket: _Bucket, now: float) -> None:
        bucket.tokens = min(float(self.burst),
                            bucket.tokens + (now - bucket.refilled) * self.per_second)
        bucket.refilled = now
