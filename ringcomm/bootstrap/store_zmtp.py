"""ZMTP 3 with the NULL mechanism, read and written here: how the store without a token
bounds a whole message, not a frame.

libzmq delivers a multipart message only once its last frame has come, and until then holds
every frame of it, however many; its one limit (``ZMQ_MAXMSGSIZE``) is per frame. So a
stranger could make a ZeroMQ server hold any amount (48 frames of 32 MiB each took the store
to 1.58 GB). The store without a token therefore listens on a ZeroMQ ``STREAM`` socket,
which hands over the bytes of each connection as they come (in pieces of at most 8 KiB), and
reads ZeroMQ's wire protocol itself with ``Reader``: the greeting, the NULL handshake's
``READY`` command, then frames, counted as they come. A message of more than
``max_frames`` frames or ``max_message_bytes`` bytes is refused at the header of the frame
that would pass the bound, before its body is read: nothing is allocated from what a frame
claims, and a connection holds at most one message in progress, so it holds at most
``max_message_bytes`` (the caller then closes it). Clients are ordinary ZeroMQ ``DEALER``
sockets (``StoreClient``): they cannot tell this from a ``ROUTER``.

With a token the store is a ZeroMQ ``ROUTER`` with CURVE instead (a CurveZMQ handshake
needs libzmq's cryptography): a stranger without the token gets no frame through at all.

The wire, from https://rfc.zeromq.org/spec/23/ (ZMTP 3.0)::

    greeting: 0xFF, 8 bytes of padding, 0x7F, version 3.0, "NULL" in 20 bytes, as-server
              (0), 31 bytes of filler: 64 bytes, each way
    frame:    flags (1 byte: MORE 1, LONG 2, COMMAND 4), size (1 byte, or 8 bytes big-endian
              if LONG), body
    READY:    a command whose body is 5 "READY" then properties: name length (1 byte), name,
              value length (4 bytes big-endian), value ("Socket-Type", "Identity")
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = ["GREETING_SIZE", "MAX_COMMAND_BYTES", "ProtocolError", "Reader", "encode",
           "greeting", "ready"]

GREETING_SIZE = 64
SIGNATURE_SIZE = 10
MAX_COMMAND_BYTES = 4096  # a READY: a socket type, a routing id of at most 255 B, a few more
MAX_IDENTITY_BYTES = 255
MORE, LONG, COMMAND = 1, 2, 4
PEERS = (b"DEALER", b"REQ", b"ROUTER")  # the socket types that may talk to a ROUTER
_SIZE = struct.Struct(">Q")
_PROPERTY_SIZE = struct.Struct(">I")
_INLINE = 1 << 16  # bodies up to this are copied into the piece before them (``encode``)


class ProtocolError(ValueError):
    """What a connection sent is not ZMTP 3 as the store speaks it, or passes a bound: the
    reason, to log; the connection is to be closed."""


def greeting() -> bytes:
    """This end's greeting: ZMTP 3.0, the NULL mechanism, not a server (NULL has none)."""
    return (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0"
            + bytes(31))


def _command(name: bytes, data: bytes) -> bytes:
    body = bytes([len(name)]) + name + data
    if len(body) < 256:
        return bytes([COMMAND, len(body)]) + body
    return bytes([COMMAND | LONG]) + _SIZE.pack(len(body)) + body


def ready(socket_type: bytes = b"ROUTER") -> bytes:
    """The NULL handshake's READY command this end sends: its socket type."""
    name = b"Socket-Type"
    return _command(b"READY", bytes([len(name)]) + name
                    + _PROPERTY_SIZE.pack(len(socket_type)) + socket_type)


def _header(size: int, more: bool) -> bytes:
    flags = MORE if more else 0
    if size < 256:
        return bytes([flags, size])
    return bytes([flags | LONG]) + _SIZE.pack(size)


def encode(frames: Sequence[bytes]) -> list[bytes]:
    """A message as the pieces to write in turn: frame headers and small bodies joined into
    one piece, each body over 64 KiB a piece of its own (sent as it is, not copied)."""
    pieces: list[bytes] = []
    run: list[bytes] = []
    for i, body in enumerate(frames):
        run.append(_header(len(body), i < len(frames) - 1))
        if len(body) <= _INLINE:
            run.append(bytes(body))
        else:
            pieces.append(b"".join(run))
            run = []
            pieces.append(body)
    if run:
        pieces.append(b"".join(run))
    return pieces


class Reader:
    """One connection's bytes in, whole messages out (``feed``), within the bounds. Reads
    the peer's greeting and READY first (``identity``, ``socket_type``), then frames; any
    departure from the protocol, and any message of more than ``max_frames`` frames or
    ``max_message_bytes`` bytes of bodies, is a ``ProtocolError``. ``held`` is how many
    bytes of the message in progress it holds (at most ``max_message_bytes``)."""

    def __init__(self, max_message_bytes: int, max_frames: int) -> None:
        self.max_message_bytes = max_message_bytes
        self.max_frames = max_frames
        self.identity: bytes | None = None
        self.socket_type: bytes | None = None
        self.ready = False  # the peer's READY has come: frames may follow
        self._greeting = bytearray()
        self._header = bytearray()  # the frame header being read
        self._flags = 0
        self._left = -1  # body bytes still to come for the frame being read; -1: a header
        self._body: list[bytes] = []
        self._frames: list[bytes] = []  # the message in progress
        self.held = 0  # bytes of bodies of the message in progress

    def feed(self, data: bytes) -> list[list[bytes]]:
        """The messages ``data`` completes (often none, a piece of one or several)."""
        view = memoryview(data)
        pos, end = 0, len(view)
        done: list[list[bytes]] = []
        if len(self._greeting) < GREETING_SIZE:
            pos = self._read_greeting(view)
        while pos < end:
            if self._left < 0:  # a frame header
                pos = self._read_header(view, pos)
                continue
            take = min(self._left, end - pos)
            self._body.append(bytes(view[pos:pos + take]))
            pos += take
            self._left -= take
            if not self._flags & COMMAND:
                self.held += take
            if self._left == 0:
                message = self._end_frame()
                if message is not None:
                    done.append(message)
        if self._left == 0:  # an empty body, right after its header at the end of the data
            message = self._end_frame()
            if message is not None:
                done.append(message)
        return done

    def _read_greeting(self, view: memoryview) -> int:
        take = min(GREETING_SIZE - len(self._greeting), len(view))
        self._greeting += view[:take]
        g = self._greeting
        if g and g[:1] != b"\xff":
            raise ProtocolError("not a ZeroMQ greeting (not ZMTP 3, or not ZeroMQ at all)")
        if len(g) >= SIGNATURE_SIZE and not g[9] & 1:
            raise ProtocolError("a ZMTP 1.0 peer (ZeroMQ 2; ringcomm speaks ZMTP 3)")
        if len(g) > SIGNATURE_SIZE and g[10] < 3:
            raise ProtocolError(f"a ZMTP {g[10]}.x peer (ringcomm speaks ZMTP 3)")
        if len(g) >= 32:
            mechanism = bytes(g[12:32]).rstrip(b"\0")
            if mechanism != b"NULL":
                raise ProtocolError(
                    f"mechanism {mechanism.decode('ascii', 'replace')[:20]} instead of NULL "
                    "(it holds a token; this store holds none)")
        return take

    def _read_header(self, view: memoryview, pos: int) -> int:
        h = self._header
        if not h:
            h.append(view[pos])
            pos += 1
            flags = h[0]
            if flags & ~(MORE | LONG | COMMAND):
                raise ProtocolError(f"frame flags {flags:#04x} (reserved bits set)")
            if flags & COMMAND and flags & MORE:
                raise ProtocolError("a command frame with MORE set")
        need = (1 + _SIZE.size if h[0] & LONG else 2) - len(h)
        take = min(need, len(view) - pos)
        h += view[pos:pos + take]
        pos += take
        if take < need:
            return pos
        flags = h[0]
        size = _SIZE.unpack(h[1:])[0] if flags & LONG else h[1]
        h.clear()
        self._start_frame(flags, size)
        return pos

    def _start_frame(self, flags: int, size: int) -> None:
        if flags & COMMAND:
            if self._frames:
                raise ProtocolError("a command inside a message")
            if size > MAX_COMMAND_BYTES:
                raise ProtocolError(f"a command of {size} B (at most {MAX_COMMAND_BYTES} B)")
        else:
            if not self.ready:
                raise ProtocolError("a message before the handshake's READY")
            if len(self._frames) >= self.max_frames:
                raise ProtocolError(f"a message of more than {self.max_frames} frames")
            if size > self.max_message_bytes - self.held:
                raise ProtocolError(
                    f"a message of more than {self.max_message_bytes} B (a frame of {size} B "
                    f"after {self.held} B in {len(self._frames)} frame(s))")
        self._flags = flags
        self._left = size

    def _end_frame(self) -> list[bytes] | None:
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        self._left = -1
        if self._flags & COMMAND:
            self._command(body)
            return None
        self._frames.append(body)
        if self._flags & MORE:
            return None
        message, self._frames, self.held = self._frames, [], 0
        return message

    def _command(self, body: bytes) -> None:
        if not body or len(body) < 1 + body[0]:
            raise ProtocolError("a command without a name")
        name, data = body[1:1 + body[0]], body[1 + body[0]:]
        if self.ready:
            return  # after the handshake (a ZMTP 3.1 PING, say): nothing for the store
        if name == b"ERROR":
            reason = data[1:1 + data[0]] if data else b""
            raise ProtocolError(f"the peer gave up its handshake: "
                                f"{reason.decode('ascii', 'replace')[:100]!r}")
        if name != b"READY":
            raise ProtocolError(f"a {name.decode('ascii', 'replace')[:20]!r} command "
                                "instead of READY")
        properties: dict[bytes, bytes] = {}
        pos = 0
        while pos < len(data):
            length = data[pos]
            key = data[pos + 1:pos + 1 + length]
            at = pos + 1 + length
            if length == 0 or len(key) < length or at + 4 > len(data):
                raise ProtocolError("a READY whose properties are cut short")
            size = _PROPERTY_SIZE.unpack(data[at:at + 4])[0]
            if at + 4 + size > len(data):
                raise ProtocolError("a READY whose properties are cut short")
            properties[key.lower()] = data[at + 4:at + 4 + size]
            pos = at + 4 + size
        socket_type = properties.get(b"socket-type")
        if socket_type not in PEERS:
            raise ProtocolError(f"a socket of type "
                                f"{(socket_type or b'?').decode('ascii', 'replace')[:20]} "
                                "(a store talks with DEALER, REQ and ROUTER sockets)")
        identity = properties.get(b"identity", b"")
        if len(identity) > MAX_IDENTITY_BYTES:
            raise ProtocolError(f"a routing id of {len(identity)} B (at most "
                                f"{MAX_IDENTITY_BYTES} B)")
        self.socket_type, self.identity, self.ready = socket_type, identity or None, True
