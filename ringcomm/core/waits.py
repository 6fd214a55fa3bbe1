"""How long a wait may be: timeouts as the OS's and ZeroMQ's calls take them.

A timeout read from a caller or a peer can be any size, ``inf`` included, but the calls
that wait take less: ``zmq_poll`` and ``poll(2)`` take a C ``int`` of milliseconds (at most
2**31 - 1 ms, about 24.8 days: more is an ``OverflowError`` in pyzmq), and
``threading.Condition.wait`` at most ``threading.TIMEOUT_MAX`` seconds. So:

- ``MAX_TIMEOUT`` (7 days) is the longest timeout ringcomm keeps: ``ringcomm.init`` takes
  any longer one, ``inf`` included, as this (``clamp``); a week of waiting is the same as
  forever for a job, and it leaves room under the calls' limits for the slack that
  deadlines add to it.
- ``poll_ms(seconds)`` is a wait as ``zmq.Poller.poll`` and ``zmq_poll`` take it: whole
  milliseconds from 0 to ``MAX_POLL_MS``; ``wait_s(seconds)`` is one as
  ``Condition.wait`` and ``Event.wait`` take it. A caller that waits in a loop until its
  deadline (as every wait in ringcomm does) just waits again where the clamp cut it short.
"""

from __future__ import annotations

import math
import threading

__all__ = ["MAX_POLL_MS", "MAX_TIMEOUT", "clamp", "poll_ms", "wait_s"]

MAX_POLL_MS = (1 << 31) - 1  # a C int: zmq_poll's and poll(2)'s longest wait
MAX_TIMEOUT = 7 * 24 * 3600.0  # s: the longest timeout kept (init's, a store request's)
_MAX_WAIT_S = min(threading.TIMEOUT_MAX, MAX_POLL_MS / 1e3)


def clamp(seconds: float) -> float:
    """``seconds`` (positive, ``inf`` allowed) as at most ``MAX_TIMEOUT``."""
    return MAX_TIMEOUT if math.isnan(seconds) or seconds > MAX_TIMEOUT else float(seconds)


def poll_ms(seconds: float | None) -> int | None:
    """A wait of ``seconds`` as whole milliseconds ``zmq_poll`` takes: 0 for none or less,
    ``MAX_POLL_MS`` at most (``inf`` included); None (no limit) stays None."""
    if seconds is None:
        return None
    if not seconds > 0:  # negative, or NaN
        return 0
    return int(min(seconds * 1e3, MAX_POLL_MS))


def wait_s(seconds: float | None) -> float | None:
    """A wait of ``seconds`` as ``Condition.wait`` takes it: 0 for none or less, at most
    about 24.8 days (``inf`` included); None (no limit) stays None."""
    if seconds is None:
        return None
    if not seconds > 0:
        return 0.0
    return min(float(seconds), _MAX_WAIT_S)
