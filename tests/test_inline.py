"""Which async ops run on the caller's thread, and what a caller sees either way.

A small async collective with nothing queued ahead of it runs at once on the caller's
thread (``inline_bytes``, ``RINGCOMM_INLINE_BYTES``): it takes less than the two thread
hand-offs the worker would cost. A large one goes to the worker, so the caller's own work
overlaps it. Either way the result, the order of ops and the errors are the same: an
inline op's error is raised by ``wait``, as the worker's would be.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringcomm import ArgumentError, CommTimeout
from ringcomm.runtime.communicator import DEFAULT_INLINE_BYTES, inline_bytes
from ringcomm.runtime.local import run_group

LATE_S = 0.5


def _late_peer(count: int, *, inline: int | None = None):
    """Rank 0 starts an async allreduce of ``count`` floats at once, rank 1 only after
    ``LATE_S``; rank 0 reports how long its call took and the result after ``wait``."""

    def fn(comm):
        if inline is not None:
            comm.inline_bytes = inline
        x = np.full(count, comm.rank + 1.0, np.float32)
        if comm.rank == 1:
            time.sleep(LATE_S)
        started = time.monotonic()
        work = comm.allreduce(x, async_op=True)
        returned = time.monotonic() - started
        done_at_return = work.is_completed()
        work.wait()
        return returned, done_at_return, x

    return run_group(2, fn)[0]


@pytest.mark.timeout(30)
def test_a_small_async_op_runs_inline_and_returns_completed():
    returned, done, x = _late_peer(16)
    assert done, "a small async op should be complete when the call returns"
    assert returned >= LATE_S * 0.8  # it waited for the late peer on the caller's thread
    assert np.all(x == 3.0)


@pytest.mark.timeout(30)
def test_a_large_async_op_overlaps_the_callers_work():
    returned, done, x = _late_peer(DEFAULT_INLINE_BYTES // 4 + 1)
    assert not done and returned < LATE_S / 2, returned
    assert np.all(x == 3.0)


@pytest.mark.timeout(30)
def test_inline_bytes_zero_sends_every_async_op_to_the_worker():
    returned, done, x = _late_peer(16, inline=0)
    assert not done and returned < LATE_S / 2, returned
    assert np.all(x == 3.0)


@pytest.mark.timeout(30)
def test_an_inline_async_ops_error_is_raised_by_wait_not_by_the_call():
    def fn(comm):
        if comm.rank == 1:
            return None  # never joins
        work = comm.allreduce(np.ones(4, np.float32), async_op=True)
        assert work.is_completed()
        with pytest.raises(CommTimeout, match="no message from rank 1"):
            work.wait()
        return "raised by wait"

    assert run_group(2, fn, timeout=0.3, return_errors=True)[0] == "raised by wait"


def test_inline_bytes_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("RINGCOMM_INLINE_BYTES", "4096")
    assert inline_bytes() == 4096
    monkeypatch.setenv("RINGCOMM_INLINE_BYTES", "-1")
    with pytest.raises(ArgumentError, match="RINGCOMM_INLINE_BYTES=-1 is negative"):
        inline_bytes()
    monkeypatch.delenv("RINGCOMM_INLINE_BYTES")
    assert inline_bytes() == DEFAULT_INLINE_BYTES
