"""Stand-ins for a link and for the board channel, for whatever must see every message.

A tracer, a fault injector and a checksum each need to see every message a rank sends or
receives, on every kind of link and on the board. Each is a subclass of these classes that
overrides the few calls it cares about; everything else goes through to the wrapped object
(``inner``) unchanged. They are put in front of a transport's links and its board by one
hook (``ringcomm.engines.wrapping``), so neither the links, the board nor the engines know
they are there, and a group without such a wrapper pays nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .board_channel import BoardChannel
from .header import Header
from .link import Link, SendHandle, Wait


class LinkWrapper(Link):
    """A link in front of another (``inner``): every call goes through unchanged unless a
    subclass overrides it."""

    def __init__(self, inner: Link) -> None:
        super().__init__(inner.rank, inner.peer)
        self.inner = inner
        self.counters = inner.counters  # the same counts: the wrapper moves nothing itself

    @property
    def kind(self) -> str:  # type: ignore[override]  # the wrapped link's
        return self.inner.kind

    @property
    def checks_delivery(self) -> bool:  # type: ignore[override]
        return self.inner.checks_delivery

    def send(self, header: Header, payload: np.ndarray | None, op: str) -> SendHandle | None:
        return self.inner.send(header, payload, op)

    def reserve(self, nbytes: int) -> np.ndarray | None:
        return self.inner.reserve(nbytes)

    def send_reserved(self, header: Header, op: str) -> SendHandle | None:
        return self.inner.send_reserved(header, op)

    def host_memory(self) -> tuple[tuple[int, int], ...]:
        return self.inner.host_memory()

    def send_notice(self, header: Header, text: bytes) -> None:
        self.inner.send_notice(header, text)

    def wait_sent(self, handle: SendHandle, wait: Wait) -> None:
        self.inner.wait_sent(handle, wait)

    def check_delivered(self, op: str) -> None:
        self.inner.check_delivered(op)

    def recv_header(self, wait: Wait) -> Header:
        return self.inner.recv_header(wait)

    def recv_payload(self, op: str) -> Any:
        return self.inner.recv_payload(op)

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        return self.inner.recv_payload_into(out, op)

    def release_payload(self) -> None:
        self.inner.release_payload()

    def discard_payload(self, op: str) -> None:
        self.inner.discard_payload(op)

    def peek(self) -> bool:
        return self.inner.peek()

    def describe(self) -> str:
        return self.inner.describe()

    def finish_sending(self) -> None:
        self.inner.finish_sending()

    def close(self) -> None:
        self.inner.close()


class BoardChannelWrapper(BoardChannel):
    """A board channel in front of another (``inner``): every call goes through unchanged
    unless a subclass overrides it."""

    def __init__(self, inner: BoardChannel) -> None:
        super().__init__(inner.board, inner.transport)
        self.inner = inner
        self.kind = inner.kind

    def post(self, header: bytes, payload: np.ndarray | None, deadline: float,
             op: str, at: int = 0) -> None:
        self.inner.post(header, payload, deadline, op, at)

    def take(self, peer: int, header: bytes, dtype: np.dtype, count: int, deadline: float,
             op: str, at: int = 0) -> np.ndarray:
        return self.inner.take(peer, header, dtype, count, deadline, op, at)

    def wait_for(self, peer: int, header: bytes, deadline: float, op: str) -> None:
        self.inner.wait_for(peer, header, deadline, op)

    def posted_header(self, peer: int, op: str) -> Header:
        return self.inner.posted_header(peer, op)

    def withdraw(self, since: int) -> None:
        self.inner.withdraw(since)

    def leftover(self) -> Header | None:
        return self.inner.leftover()

    def describe(self) -> str:
        return self.inner.describe()

    def _wait(self, peer: int, number: int, op: str, deadline: float, header: bytes) -> None:
        raise AssertionError("a wrapper's posts and takes go through its inner channel")

    def close(self) -> None:
        self.inner.close()
