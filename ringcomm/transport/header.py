"""The header that travels in front of every payload, and the check that catches desyncs.

A header carries the *op descriptor*: everything about the op that sender and receiver
must both see the same way (collective, sequence number, algorithm, dtype, reduce op, root
or tag, segment size, and the element count this pair of ranks expects), plus what
identifies the one message (sender, index within the op between this pair, bytes). A
receiver knows exactly what it expects next from each peer and compares every field, so
ranks that disagree about anything that shapes the op raise a ``DesyncError`` at the first
message they exchange, naming what differs ("rank 1 reduces 1048584 elements, rank 0
1048576"), instead of reducing bytes into the wrong place.

56 bytes, little-endian:

    seq u64 | nbytes u64 | count u64 | segment bytes u32 | sender u32 | index u32 | arg i32 |
    kind u8 | dtype u8 | algorithm u8 | reduce u8 | checksum u64 | version u8 | 3 bytes padding

``checksum`` is no part of the op descriptor: it is 0 unless checksums are on
(``RINGCOMM_CHECKSUM=1``, ``ringcomm.faults.checksum``), and then the receiving side of the
checksum takes it out before the header is compared with what the op expects (which carries
0), so the desync check never sees it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from ..core.algorithms import WIRE_CODES, WIRE_NAMES
from ..core.dtypes import REDUCE_OPS, ReduceOp, dtype_name
from ..errors import DesyncError

WIRE_VERSION = 7  # bumped whenever the header, the framing or the board changes; agreed at init
_FORMAT = struct.Struct("<QQQIIIiBBBBQB3x")  # Header's fields, then the version
SIZE = _FORMAT.size
CHECKSUM_AT = slice(44, 52)  # where a packed header holds its checksum


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
    CREDIT = 11  # a device channel's receiver frees slots: a stream of its own (``count``)
    PROBE = 254  # a stalled receive asks which op the peer is in (control plane only)
    ABORT = 255  # a rank failed; the payload is its error message


# The wire codes of the schedules' algorithm names (``Schedule.algorithm``), from the registry
# of algorithms; 0 is none.
ALGORITHMS = WIRE_NAMES
ALGORITHM_CODES = WIRE_CODES
_REDUCE_NAMES = {op.code + 1: name for name, op in REDUCE_OPS.items()}  # 0: no reduction


def algorithm_code(name: str) -> int:
    try:
        return ALGORITHM_CODES[name]
    except KeyError:
        raise ValueError(f"algorithm {name!r} has no wire code: add its row to "
                         "ringcomm.core.algorithms") from None


def reduce_name(code: int) -> str | None:
    """The name of the reduction a header's ``reduce`` field holds (None for none)."""
    return _REDUCE_NAMES.get(code)


def reduce_code(op: ReduceOp | None) -> int:
    """The wire code of a reduction (0 for ops that do not reduce)."""
    return 0 if op is None else op.code + 1


class Header(NamedTuple):
    """One message's header, fields in wire order. A tuple, because a header is built and
    compared for every message: a tuple is made and compared in C, and packs as it is."""

    seq: int
    nbytes: int
    count: int  # type: ignore[assignment]  # the wire field's name; hides tuple.count
    segment: int
    sender: int
    index: int  # type: ignore[assignment]  # the wire field's name; hides tuple.index
    arg: int
    kind: int
    dtype: int
    algorithm: int = 0
    reduce: int = 0
    checksum: int = 0  # not part of the op: see the module docstring

    def pack(self) -> bytes:
        return _FORMAT.pack(*self, WIRE_VERSION)

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        if len(raw) != SIZE:
            raise DesyncError(f"malformed header of {len(raw)} bytes (expected {SIZE}); "
                              "is every rank running the same ringcomm version?")
        return cls.unpack_from(raw, 0)

    @classmethod
    def unpack_from(cls, buffer: bytes | bytearray | memoryview, offset: int) -> Header:
        """The header at ``offset`` of ``buffer`` (which holds all of it)."""
        *fields, version = _FORMAT.unpack_from(buffer, offset)
        if version != WIRE_VERSION:
            raise DesyncError(f"a message in wire format {version} reached a rank that speaks "
                              f"{WIRE_VERSION}; every rank must run the same ringcomm version")
        return cls._make(fields)

    @classmethod
    def control(cls, kind: int, seq: int, sender: int, nbytes: int = 0) -> Header:
        """The header of an abort or a probe (no op descriptor)."""
        return cls(seq, nbytes, 0, 0, sender, 0, -1, kind, 0)

    @classmethod
    def credit(cls, sender: int, count: int) -> Header:
        """A credit: ``sender`` has used ``count`` messages in all of its peer's device
        slots (cumulative, so a later credit says all an earlier one did)."""
        return cls(0, 0, count, 0, sender, 0, -1, OpKind.CREDIT, 0)

    @property
    def is_p2p(self) -> bool:
        return self.kind == OpKind.P2P

    @property
    def op_name(self) -> str:
        kind = OpKind(self.kind).name.lower() if self.kind in OpKind._value2member_map_ else "?"
        return f"{kind} #{self.seq}"

    def describe(self) -> str:
        arg = f" root/tag {self.arg}" if self.arg >= 0 else ""
        return (f"{self.op_name}{arg}, message {self.index}, {self.nbytes} B "
                f"{dtype_name(self.dtype)} from rank {self.sender}")


@dataclass(slots=True)  # made once per op: no frozen-attribute overhead
class OpDescriptor:
    """One op as both ends of each of its messages must see it.

    ``count`` is the element count every pair agrees on (the whole vector for allreduce and
    broadcast, one rank's block for all-gather, reduce-scatter, gather and scatter); an
    all-to-all's pairs each agree on their own block instead: ``send_counts[p]`` elements
    to rank ``p``, ``recv_counts[p]`` from it.
    """

    kind: int
    seq: int
    dtype: int
    algorithm: int
    reduce: int = 0
    arg: int = -1
    segment: int = 0
    count: int = 0
    send_counts: tuple[int, ...] | None = None
    recv_counts: tuple[int, ...] | None = None

    def outgoing(self, peer: int, sender: int, index: int, nbytes: int) -> Header:
        """The header of message ``index`` from ``sender`` (this rank) to ``peer``."""
        count = self.count if self.send_counts is None else self.send_counts[peer]
        return Header(self.seq, nbytes, count, self.segment, sender, index, self.arg,
                      self.kind, self.dtype, self.algorithm, self.reduce)

    def incoming(self, peer: int, index: int, nbytes: int) -> Header:
        """The header this rank expects on message ``index`` from ``peer``."""
        count = self.count if self.recv_counts is None else self.recv_counts[peer]
        return Header(self.seq, nbytes, count, self.segment, peer, index, self.arg,
                      self.kind, self.dtype, self.algorithm, self.reduce)


_VERBS: dict[int, str] = {
    OpKind.ALLREDUCE: "reduces", OpKind.REDUCE: "reduces", OpKind.BROADCAST: "broadcasts",
    OpKind.ALLGATHER: "contributes", OpKind.GATHER: "contributes",
    OpKind.REDUCE_SCATTER: "keeps blocks of", OpKind.SCATTER: "receives blocks of",
    OpKind.P2P: "passes"}


def differences(mine: Header, theirs: Header, *, rank: int) -> list[str]:
    """What ``theirs`` (from rank ``theirs.sender``) says about the op that ``mine`` (this
    rank's view) does not, in words naming both ranks; empty if they agree on the op."""
    me, other = rank, theirs.sender
    if theirs.kind != mine.kind or theirs.seq != mine.seq:
        return [f"rank {other} is in {theirs.op_name}, rank {me} in {mine.op_name}"]
    found = []
    if theirs.arg != mine.arg:
        what = "tag" if mine.is_p2p else "root"
        found.append(f"rank {other} uses {what} {theirs.arg}, rank {me} {what} {mine.arg}")
    if theirs.algorithm != mine.algorithm:
        found.append(f"rank {other} runs {_name(ALGORITHMS, theirs.algorithm)}, rank {me} "
                     f"{_name(ALGORITHMS, mine.algorithm)}")
    if theirs.dtype != mine.dtype:
        found.append(f"rank {other} sends {dtype_name(theirs.dtype)}, rank {me} expects "
                     f"{dtype_name(mine.dtype)}")
    if theirs.reduce != mine.reduce:
        found.append(f"rank {other} reduces with {_REDUCE_NAMES.get(theirs.reduce, '?')}, "
                     f"rank {me} with {_REDUCE_NAMES.get(mine.reduce, '?')}")
    if theirs.count != mine.count:
        if mine.kind == OpKind.ALLTOALL:
            found.append(f"rank {other} sends {theirs.count} elements to rank {me}, which "
                         f"expects {mine.count}")
        else:
            verb = _VERBS.get(mine.kind, "has")
            found.append(f"rank {other} {verb} {theirs.count} elements, rank {me} "
                         f"{mine.count}")
    if theirs.segment != mine.segment:
        found.append(f"rank {other} cuts messages into segments of {theirs.segment} B, "
                     f"rank {me} of {mine.segment} B (their settings were not agreed?)")
    return found


def _name(names: tuple[str, ...], code: int) -> str:
    return names[code] if 0 <= code < len(names) else f"?{code}"


def check(expected: Header, got: Header, *, rank: int, op: str) -> None:
    """Raise ``DesyncError`` naming every way in which ``got`` differs from ``expected``."""
    if got == expected:
        return
    diffs = differences(expected, got, rank=rank)
    if not diffs:  # the op agrees, the message does not: a bug, or a lost message
        diffs = [f"expected {expected.describe()}, got {got.describe()}"]
    raise DesyncError(
        f"ranks disagree about the op: {'; '.join(diffs)}. Every rank must call the same "
        "collectives in the same order with the same dtype, element count, reduce op and "
        "root (and the same settings).",
        rank=rank, op=op, peer=got.sender,
    )
