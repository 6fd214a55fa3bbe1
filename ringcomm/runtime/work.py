"""What an op started with ``async_op=True`` returns: a handle on its future."""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from ..errors import CommTimeout

log = logging.getLogger("ringcomm")


class Work:
    """Handle of an op started with ``async_op=True``.

    ``source`` is, for a receive that has completed, the rank its message came from (what
    ``recv(x, src=None)`` needs to tell); ``None`` otherwise.
    """

    def __init__(self, future: concurrent.futures.Future[Any], name: str,
                 timeout: float) -> None:
        self._future = future
        self.name = name
        self._timeout = timeout
        self.source: int | None = None

    @staticmethod
    def finished(name: str, timeout: float, result: Any = None, *,
                 error: BaseException | None = None) -> Work:
        """The handle of an op that already ran (on the caller's thread)."""
        return _Finished(name, timeout, result, error)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the op is done and return its result; raise its error if it failed.

        ``timeout`` (seconds) bounds only this wait and is unlimited by default: the op
        enforces its own deadline once it starts, so a stuck peer still ends in an error.
        """
        if self._future.done():  # most small ops: they ran on the caller's thread
            return self._future.result()
        done, _ = concurrent.futures.wait([self._future], timeout=timeout)
        if not done:
            raise CommTimeout(
                f"{self.name} did not complete within {timeout} s of waiting; the op keeps "
                "running, call wait() again or close the communicator",
                op=self.name,
            )
        return self._future.result()

    def is_completed(self) -> bool:
        return self._future.done()

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<Work {self.name} {state}>"


class _Finished(Work):
    """The handle of an op that already ran: its result or its error, and no future (making
    one, with its lock and condition, costs more than a small op). It sets every field
    ``Work.__init__`` sets but the future."""

    def __init__(self, name: str, timeout: float, result: Any,
                 error: BaseException | None) -> None:
        self.name = name
        self._timeout = timeout
        self.source = None
        self._result = result
        self._error = error

    def wait(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return self._error

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        try:  # as a future does: a failing callback is logged, not raised to the caller
            fn(self)
        except Exception:  # noqa: BLE001
            log.exception("a done-callback of %s raised", self.name)

    def __repr__(self) -> str:
        return f"<Work {self.name} done>"
