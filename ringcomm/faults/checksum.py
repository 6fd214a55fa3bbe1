"""Checksums on every message and board post (``RINGCOMM_CHECKSUM=1``): corruption on the
way is a ``ChecksumError`` naming the link, the op and the message, never a wrong result.

Why a wrapper: the links and the board stay as fast as they are for groups without
checksums (nothing is in their path), and every kind of link (pipe, shared-memory ring,
mailbox, socket, in-memory) and the board get the same check from one class each.

The sum is XXH3 (``xxhash``: one call over the payload's memory, in C, at tens of GB/s, many
times CRC-32's speed), 64 bits on a link and its low 32 bits on the board. It travels in the
header's ``checksum`` field (``ringcomm.transport.header``), which the receiving side here
takes out again before the transport compares the header with what the op expects.

A board post may fill its slot from any element on (``at``), and a take may read a part of a
post, so a post's sum covers its slot from the start to the post's end, and the field holds
that end too (bits 32 and up): a reader checks the whole post whatever part it takes (the
slot's bytes before ``at`` are the poster's from an earlier post and do not change).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import xxhash

from ..engines.wrapping import Wrapper
from ..errors import ChecksumError
from ..transport.board_channel import BoardChannel
from ..transport.header import CHECKSUM_AT, Header, OpKind
from ..transport.link import Link, SendHandle, Wait
from ..transport.wrappers import BoardChannelWrapper, LinkWrapper

_FIELD = struct.Struct("<Q")
_LOW = 0xFFFFFFFF  # the board's field holds the sum's low 32 bits (and the post's end)


def _bytes(data: Any) -> Any:
    if isinstance(data, np.ndarray) and not data.flags.c_contiguous:
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return data


def digest(*parts: Any) -> int:
    """XXH3 (64 bits) of ``parts`` (arrays or any buffers) one after the other."""
    if len(parts) == 1:
        return xxhash.xxh3_64_intdigest(_bytes(parts[0]))
    state = xxhash.xxh3_64()
    for part in parts:
        state.update(_bytes(part))
    return state.intdigest()


class ChecksumWrapper(Wrapper):
    """Adds a checksum to every outgoing message and board post and checks every incoming
    one. Must be on every rank or none (``checksum`` is a must-match setting)."""

    name = "checksum"

    def link(self, link: Link) -> Link:
        return _CheckedLink(link)

    def board(self, channel: BoardChannel) -> BoardChannel:
        return _CheckedBoard(channel)


def _with_sum(header: Header, checksum: int) -> Header:
    return Header._make((*header[:-1], checksum))


class _CheckedLink(LinkWrapper):
    def __init__(self, inner: Link) -> None:
        super().__init__(inner)
        self._slot: np.ndarray | None = None  # what the last ``reserve`` lent
        self._reading: Header | None = None  # the header whose payload comes next

    def send(self, header: Header, payload: np.ndarray | None, op: str) -> SendHandle | None:
        checksum = 0 if payload is None or not header.nbytes else digest(payload)
        return self.inner.send(_with_sum(header, checksum), payload, op)

    def reserve(self, nbytes: int) -> np.ndarray | None:
        self._slot = self.inner.reserve(nbytes)
        return self._slot

    def send_reserved(self, header: Header, op: str) -> SendHandle | None:
        slot, self._slot = self._slot, None
        checksum = 0 if slot is None else digest(slot)
        return self.inner.send_reserved(_with_sum(header, checksum), op)

    def recv_header(self, wait: Wait) -> Header:
        header = self.inner.recv_header(wait)
        if header.kind >= OpKind.PROBE:  # an abort's text carries no sum
            self._reading = None
            return header
        self._reading = header
        return _with_sum(header, 0) if header.checksum else header

    def recv_payload(self, op: str) -> Any:
        payload = self.inner.recv_payload(op)
        self._check(payload, op)
        return payload

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        nbytes = self.inner.recv_payload_into(out, op)
        self._check(out[:nbytes], op)
        return nbytes

    def discard_payload(self, op: str) -> None:
        self._reading = None
        self.inner.discard_payload(op)

    def _check(self, payload: Any, op: str) -> None:
        header, self._reading = self._reading, None
        if header is None:
            return
        got = digest(payload) if header.nbytes else 0
        if got != header.checksum:
            raise ChecksumError(
                f"message {header.index} of {header.op_name} from rank {self.peer} to rank "
                f"{self.rank} arrived corrupted: its payload's checksum is {got:#018x}, "
                f"the sender's was {header.checksum:#018x}. Check the memory and network "
                "between these ranks.", rank=self.rank, op=op, peer=self.peer)


class _CheckedBoard(BoardChannelWrapper):
    def post(self, header: bytes, payload: np.ndarray | None, deadline: float,
             op: str, at: int = 0) -> None:
        board = self.board
        if payload is None or not payload.size:
            field = 0
        else:
            start = at * payload.itemsize
            parts = (board.slot(self.rank, board.number + 1, start), payload) if start \
                else (payload,)
            field = (digest(*parts) & _LOW) | (start + payload.nbytes) << 32
        header = header[:CHECKSUM_AT.start] + _FIELD.pack(field) + header[CHECKSUM_AT.stop:]
        self.inner.post(header, payload, deadline, op, at)

    def take(self, peer: int, header: bytes, dtype: np.dtype, count: int, deadline: float,
             op: str, at: int = 0) -> np.ndarray:
        board = self.board
        self.inner.wait_for(peer, header, deadline, op)
        field = board.checksum(peer)  # the poster's: the one field the ranks' posts differ in
        header = header[:CHECKSUM_AT.start] + _FIELD.pack(field) + header[CHECKSUM_AT.stop:]
        part = self.inner.take(peer, header, dtype, count, deadline, op, at)  # compares
        end = field >> 32
        got = digest(board.slot(peer, board.number, end)) & _LOW if end else 0
        if got != field & _LOW:
            posted = board.header(peer)
            raise ChecksumError(
                f"post {posted.index} of {posted.op_name} from rank {peer} to rank "
                f"{self.rank} on the shared board arrived corrupted: its checksum is "
                f"{got:#010x}, the poster's was {field & _LOW:#010x}. Check this host's "
                "memory.", rank=self.rank, op=op, peer=peer)
        return part
