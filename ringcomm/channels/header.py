"""The header that travels in front of every payload, and the check that catches desyncs.

32 bytes, little-endian: op sequence number, payload bytes, sender, message index (within
this op, between this pair), an op argument (root or tag, -1 if none), op kind, dtype code.
A receiver knows exactly what it expects next from each peer; any difference means the
ranks disagree about the program, and becomes a ``DesyncError`` that says how, instead of
bytes reduced into the wrong place.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from ..buffers import dtype_name
from ..errors import DesyncError

_FORMAT = struct.Struct("<QQIIiBB2x")
SIZE = _FORMAT.size


class OpKind(IntEnum):
    ALLREDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALLGATHER = 4
    REDUCE_SCATTER = 5
    GATHER = 6
    SCATTER = 7
    ALLTOALL = 8
    BARRIER = 9
    P2P = 10  # send/recv: their own stream, numbered per pair of ranks
    PROBE = 254  # a stalled receive asks which op the peer is in (control channel only)
    ABORT = 255  # a rank failed; the payload is its error message


@dataclass(frozen=True, slots=True)
class Header:
    seq: int
    nbytes: int
    sender: int
    index: int
    arg: int
    kind: int
    dtype: int

    def pack(self) -> bytes:
        return _FORMAT.pack(self.seq, self.nbytes, self.sender, self.index, self.arg,
                            self.kind, self.dtype)

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        if len(raw) != SIZE:
            raise DesyncError(f"malformed header of {len(raw)} bytes (expected {SIZE}); "
                              "is every rank running the same ringcomm version?")
        return cls(*_FORMAT.unpack(raw))

    @property
    def is_p2p(self) -> bool:
        return self.kind == OpKind.P2P

    def describe(self) -> str:
        kind = OpKind(self.kind).name.lower() if self.kind in OpKind._value2member_map_ else "?"
        arg = f" root/tag {self.arg}" if self.arg >= 0 else ""
        return (f"{kind} #{self.seq}{arg}, message {self.index}, {self.nbytes} B "
                f"{dtype_name(self.dtype)} from rank {self.sender}")


def check(expected: Header, got: Header, *, rank: int, op: str) -> None:
    """Raise ``DesyncError`` naming every field in which ``got`` differs from ``expected``."""
    if got == expected:
        return
    diffs = []
    if got.kind != expected.kind or got.seq != expected.seq:
        diffs.append("a different op")
    if got.arg != expected.arg:
        diffs.append("a different root or tag")
    if got.dtype != expected.dtype:
        diffs.append(f"dtype {dtype_name(got.dtype)} instead of {dtype_name(expected.dtype)}")
    if got.nbytes != expected.nbytes:
        diffs.append(f"{got.nbytes} B instead of {expected.nbytes} B (shapes differ?)")
    if got.index != expected.index or got.sender != expected.sender:
        diffs.append("an unexpected message")
    raise DesyncError(
        f"expected {expected.describe()}, got {got.describe()}: {'; '.join(diffs)}. "
        "Every rank must call the same collectives in the same order with the same dtype, "
        "element count and root.",
        rank=rank, op=op, peer=got.sender,
    )
