"""A link between two ranks of one host: a named pipe each way and a shared-memory ring.

Payloads of ``SHM_MIN_BYTES`` or more travel through the shared-memory ring (``shm_ring``):
one copy instead of three through a socket, and a fused receive-reduce-send writes its sum
straight into the ring (``reserve``). The headers, the small payloads and the ring's
notices go through the pipe (``pipe``): a pipe wakes the receiver straight from the
sender's write, where ZeroMQ needs two I/O threads in between. A full ring falls back to
the pipe; nothing blocks. The pipe also reports its writer's end (end-of-file after the
last data), so a dead peer is a ``PeerLostError`` at once.

Pipe frames open with a tag: the payload follows inline, or it waits in shared memory at
the position that follows the header.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from typing import Any

import numpy as np
import zmq

from ..errors import CommError, PeerLostError
from . import shm_ring
from .header import SIZE as HEADER_SIZE
from .header import Header
from .link import Wait
from .pipe import Flusher, PipeReader, PipeWriter
from .zmq_control import PolledLink, ZmqControl

log = logging.getLogger("ringcomm")

SHM_MIN_BYTES = 64 * 1024  # payloads this big go through shared memory
_SHM_NOTICE = struct.Struct("<q")  # follows the header: the payload's position in the ring
_INLINE, _IN_SHM = b"I", b"S"
_PAYLOAD_GRACE_S = 30.0  # the rest of a frame whose header arrived is on its way


class LocalLink(PolledLink):
    """Pipes to and from ``peer`` (``pipe_out`` is written by ``flusher`` when it would
    block) and the shared-memory rings ``ring_out`` (ours, ``capacity`` bytes) and
    ``ring_in`` (the peer's, ``capacity_in`` bytes), mapped on first use."""

    kind = "pipe"

    def __init__(self, rank: int, peer: int, control: ZmqControl, spin_s: float, *,
                 pipe_in: PipeReader, pipe_out_path: str, flusher: Flusher,
                 ring_out: str, ring_in: str, capacity: int, capacity_in: int) -> None:
        super().__init__(rank, peer, control, spin_s)
        self.pipe_in = pipe_in
        self.pipe_out = PipeWriter(pipe_out_path, flusher)
        self.ring_out_name: str | None = ring_out  # None: no shared memory after all
        self.ring_in_name = ring_in
        self.capacity, self.capacity_in = capacity, capacity_in
        self.ring_out: shm_ring.RingWriter | None = None
        self.ring_in: shm_ring.RingReader | None = None
        self.incoming: tuple[int, int] | None = None  # (ring position, bytes) of the header read
        self.held: tuple[int, int] | None = None  # a ring payload handed out, not yet released
        self.reserved: int | None = None  # ring position of a slot handed out to fill
        self.inline: int | None = None  # bytes of the pipe payload after the header read
        self.counters = {"shm": 0, "pipe": 0, "shm_full": 0}

    def opened(self) -> None:
        """Both ends are open (the transport waited for the peer): the pipe's name is no
        longer needed, and the link can be polled."""
        self.pipe_in.unlink()
        self.poller.register(self.pipe_in.fd, zmq.POLLIN)

    def describe(self) -> str:
        how = "pipe"
        if self.ring_out_name is not None:
            how += f" + shared memory ({self.capacity >> 20} MiB ring)"
        return how

    # ---------------------------------------------------------------- sending
    def send(self, header: Header, payload: np.ndarray | None, op: str) -> None:
        raw = header.pack()
        if payload is None or header.nbytes == 0:
            self._write(_INLINE + raw, op)
            return None
        data = payload.view(np.uint8)
        dst = self.reserve(header.nbytes)
        if dst is not None:
            np.copyto(dst, data.reshape(-1))
            return self.send_reserved(header, op)
        self.counters["pipe"] += 1
        # an ndarray is a buffer; numpy's stubs say so only for Python 3.12 and later
        self._write(b"".join((_INLINE, raw, data.reshape(-1))), op)  # type: ignore[arg-type]
        return None

    def reserve(self, nbytes: int) -> np.ndarray | None:
        """A slot of the shared-memory ring (payloads of ``SHM_MIN_BYTES`` and more)."""
        if nbytes < SHM_MIN_BYTES or self.ring_out_name is None:
            return None
        if self.ring_out is None:
            try:
                self.ring_out = shm_ring.RingWriter(self.ring_out_name, self.capacity)
            except OSError as err:  # /dev/shm full or unusable: the pipe still works
                log.warning("rank %d: no shared memory for rank %d (%s); using the pipe",
                            self.rank, self.peer, err)
                self.ring_out_name = None
                return None
        slot = self.ring_out.reserve(nbytes)
        if slot is None:
            self.counters["shm_full"] += 1
            return None
        self.reserved = slot[0]
        return slot[1]

    def send_reserved(self, header: Header, op: str) -> None:
        start, self.reserved = self.reserved, None
        if start is None:
            raise CommError(f"send_reserved to rank {self.peer} without a reserved slot",
                            rank=self.rank, op=op, peer=self.peer)
        self.counters["shm"] += 1
        self._write(_IN_SHM + header.pack() + _SHM_NOTICE.pack(start), op)

    def send_notice(self, header: Header, text: bytes) -> None:
        # down the pipe it arrives before this rank's end of the pipe closes, so a peer that
        # sees the close has read the notice first and reports the real cause
        with contextlib.suppress(OSError, CommError):
            self._write(_INLINE + header.pack() + text, "abort")

    def _write(self, frame: bytes, op: str) -> None:
        try:
            self.pipe_out.write(frame)
        except BrokenPipeError:
            self.peer_lost(op, f"rank {self.peer} closed its pipe while this rank still had "
                           "data to send to it")

    # ---------------------------------------------------------------- receiving
    def recv_header(self, wait: Wait) -> Header:
        if self.held is not None:  # the previous payload has been used by now
            assert self.ring_in is not None  # a payload was held: the ring is mapped
            self.ring_in.release(*self.held)
            self.held = None
        frame = self._take(1 + HEADER_SIZE, wait)
        header = Header.unpack(frame[1:])
        if frame[:1] == _IN_SHM:
            notice = self._take(_SHM_NOTICE.size, wait, rest=True)
            self.incoming = (_SHM_NOTICE.unpack(notice)[0], header.nbytes)
        elif frame[:1] == _INLINE:
            self.inline = header.nbytes
        else:
            raise CommError(f"malformed message from rank {self.peer}", rank=self.rank,
                            op=wait.op, peer=self.peer)
        return header

    def _take(self, nbytes: int, wait: Wait, *, rest: bool = False) -> bytes:
        """``nbytes`` from the pipe; ``rest`` for the remainder of a frame whose header was
        read, which is given more time than the caller's deadline (a short one, when
        point-to-point polls) since its writer is writing it."""
        if rest:
            wait = Wait(wait.op, max(wait.deadline, time.monotonic() + _PAYLOAD_GRACE_S),
                        wait.expected)
        while True:
            try:
                data = self.pipe_in.take(nbytes)
            except EOFError:
                self.peer_lost(wait.op)
            if data is not None:
                return data
            self.wait_readable(wait)

    def _ring_payload(self, incoming: tuple[int, int],
                      op: str) -> tuple[np.ndarray, tuple[int, int]]:
        """The payload at ``incoming`` (ring position, bytes), mapping the ring on first use."""
        start, nbytes = incoming
        self.incoming = None
        if self.ring_in is None:
            try:
                self.ring_in = shm_ring.RingReader(self.ring_in_name, self.capacity_in)
            except FileNotFoundError:
                # The sender removes its ring when it closes: it failed (its abort may be on
                # the way, and explains more) or left the group.
                self.control.explain_loss(op)
                raise PeerLostError(
                    f"rank {self.peer} closed its shared memory before this rank read its "
                    f"data: rank {self.peer} failed or left the group early",
                    rank=self.rank, op=op, peer=self.peer,
                ) from None
            except OSError as err:
                raise CommError(
                    f"cannot map the shared memory of rank {self.peer} ({err}); if /dev/shm "
                    "is cleaned while jobs run, set RINGCOMM_SHM=0", rank=self.rank, op=op,
                    peer=self.peer,
                ) from None
        return self.ring_in.view(start, nbytes), (start, nbytes)

    def recv_payload(self, op: str) -> Any:
        if self.incoming is not None:
            view, self.held = self._ring_payload(self.incoming, op)
            return view
        nbytes, self.inline = self.inline, None
        assert nbytes is not None, "recv_payload before recv_header"
        return self._take(nbytes, Wait(op, 0.0), rest=True)

    def discard_payload(self, op: str) -> None:
        # A ring payload is left alone: the sender may have failed and unmapped it already.
        if self.incoming is not None:
            self.incoming = None
        else:
            self.recv_payload(op)

    def recv_payload_into(self, out: np.ndarray, op: str) -> int:
        if self.incoming is not None:
            view, slot = self._ring_payload(self.incoming, op)
            np.copyto(out, view)
            assert self.ring_in is not None  # mapped by _ring_payload
            self.ring_in.release(*slot)
            return out.nbytes
        data = self.recv_payload(op)
        if len(data) != out.nbytes:
            raise CommError(f"payload of {len(data)} B from rank {self.peer}, expected "
                            f"{out.nbytes} B", rank=self.rank, op=op, peer=self.peer)
        out[:] = np.frombuffer(data, dtype=np.uint8)
        return out.nbytes

    def peek(self) -> bool:
        return self.pipe_in.has(1 + HEADER_SIZE)

    def _readable(self, events: dict) -> bool:
        return self.pipe_in.fd in events

    # ---------------------------------------------------------------- teardown
    def finish_sending(self) -> None:
        self.pipe_out.close()

    def close(self) -> None:
        self.pipe_in.close()
        if self.ring_out is not None:
            self.ring_out.close()
        if self.ring_in is not None:
            self.ring_in.close()

