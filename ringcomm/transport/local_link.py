"""A link between two ranks of one host: a named pipe each way and a shared-memory ring,
and, where the receiving rank asks for one (``RINGCOMM_MAILBOX=1``), mailbox slots.

Every message is a *frame*: a header, then its payload inline or the position of the
payload in the shared-memory ring. Payloads above ``SHM_MIN_BYTES`` travel through the ring
(``shm_ring``): one copy instead of three through a socket, and a fused
receive-reduce-send writes its sum straight into the ring (``reserve``). The frames go down
the pipe (``pipe``): a pipe wakes the receiver straight from the sender's write, where
ZeroMQ needs two I/O threads in between; or, to a receiver with a mailbox (``mailbox``),
into its next free slot, with no system call on either side, and down the pipe only when
every slot is taken. Nothing blocks: a full ring or mailbox falls back to the pipe.

To a receiver with a mailbox, frames are numbered per direction, and it takes them in that
order from whichever path holds the next one, so the two paths never reorder messages; the
pipe then also carries the mailbox's doorbell (a byte that wakes a receiver asleep in
``poll``). The pipe reports its writer's end (end-of-file after the last data), so a dead
peer is a ``PeerLostError`` at once, after the frames it sent before it died.

Pipe frames open with a tag (and, to a peer with a mailbox, the frame's number): the payload
follows inline, or it waits in shared memory at the position that follows the header.
"""

from __future__ import annotations

import contextlib
import logging
import select
import struct
import time
from typing import Any

import numpy as np
import zmq

from ..errors import CommError, PeerLostError
from . import mailbox, shm_ring
from .header import SIZE as HEADER_SIZE
from .header import Header
from .link import Wait
from .pipe import Flusher, PipeReader, PipeWriter
from .zmq_control import PolledLink, ZmqControl

log = logging.getLogger("ringcomm")

SHM_MIN_BYTES = mailbox.PAYLOAD_BYTES + 1  # payloads this big go through the ring
_SHM_NOTICE = struct.Struct("<q")  # follows the header: the payload's position in the ring
_NUMBER = struct.Struct("<Q")  # follows a pipe frame's tag: the frame's number
_INLINE, _IN_SHM, _DOORBELL = b"I", b"S", b"D"
_PLAIN_HEAD = 1 + HEADER_SIZE  # a pipe frame's tag and header, to a peer without a mailbox
_NUMBERED_HEAD = 1 + _NUMBER.size + HEADER_SIZE  # tag, frame number, header: to one with
_CHECK_EVERY_S = 0.001  # check_delivered asks whether the receiver lives at most this often
_PAYLOAD_GRACE_S = 30.0  # the rest of a frame whose header arrived is on its way


class LocalLink(PolledLink):
    """Pipes to and from ``peer`` (``pipe_out`` is written by ``flusher`` when it would
    block), the shared-memory rings ``ring_out`` (ours, ``capacity`` bytes) and ``ring_in``
    (the peer's, ``capacity_in`` bytes), mapped on first use, and the mailboxes
    ``mailbox_in`` (ours to create now) and ``mailbox_out`` (the peer's, mapped once both
    ends are open); None where there is none."""

    kind = "pipe"

    def __init__(self, rank: int, peer: int, control: ZmqControl, spin_s: float, *,
                 pipe_in: PipeReader, pipe_out_path: str, flusher: Flusher,
                 ring_out: str, ring_in: str, capacity: int, capacity_in: int,
                 mailbox_in: str | None = None, mailbox_out: str | None = None) -> None:
        super().__init__(rank, peer, control, spin_s)
        self.pipe_in = pipe_in
        self.pipe_out = PipeWriter(pipe_out_path, flusher)
        self._writer_error = select.poll()  # reports POLLERR once the pipe's reader is gone
        self._writer_error.register(self.pipe_out.fd, 0)
        self._next_check = 0.0  # when check_delivered may next ask the pipe
        self.ring_out_name: str | None = ring_out  # None: no shared memory after all
        self.ring_in_name = ring_in
        self.capacity, self.capacity_in = capacity, capacity_in
        self.ring_out: shm_ring.RingWriter | None = None
        self.ring_in: shm_ring.RingReader | None = None
        self.mailbox_in: mailbox.MailboxReader | None = None
        self.mailbox_out: mailbox.MailboxWriter | None = None
        self.mailbox_out_name = mailbox_out
        if mailbox_in is not None:
            try:
                self.mailbox_in = mailbox.MailboxReader(mailbox_in)
                self.max_sleep_ms = int(mailbox.DOZE_S * 1000)
                self.cheap_spin = True
            except OSError as err:  # /dev/shm full or unusable: the pipe still works
                log.warning("rank %d: no shared-memory mailbox for rank %d (%s); using the "
                            "pipe", rank, peer, err)
        self.frames_out = 0  # frames sent, by either path, where the peer has a mailbox
        self.numbered_out = False  # the peer has a mailbox: pipe frames carry their number
        self.frames_in = 0  # frames received
        self.piped = False  # the last frame came down the pipe
        self.incoming: tuple[int, int] | None = None  # (ring position, bytes) of the header read
        self.held: tuple[int, int] | None = None  # a ring payload handed out, not yet released
        self.reserved: int | None = None  # ring position of a slot handed out to fill
        self.inline: int | None = None  # bytes of the pipe payload after the header read
        self.boxed: np.ndarray | None = None  # the mailbox payload after the header read
        self.box_held = False  # a mailbox slot taken, not yet released
        # payloads by path; doorbells: messages that had to wake a receiver asleep in poll
        self.counters = {"shm": 0, "pipe": 0, "shm_full": 0, "mailbox": 0, "doorbell": 0}

    def opened(self) -> None:
        """Both ends are open (the transport waited for the peer): the pipe's name is no
        longer needed, the peer's mailbox exists, and the link can be polled."""
        self.pipe_in.unlink()
        if self.mailbox_out_name is not None:
            try:
                self.mailbox_out = mailbox.MailboxWriter(self.mailbox_out_name)
                self.checks_delivery = self.numbered_out = True
            except FileNotFoundError:  # the peer takes its messages through the pipe alone
                pass
            except OSError as err:  # it has one we cannot map: the pipe, numbered for it
                self.numbered_out = True
                log.warning("rank %d: cannot map the mailbox of rank %d (%s); using the pipe",
                            self.rank, self.peer, err)
        self.poller.register(self.pipe_in.fd, zmq.POLLIN)

    def describe(self) -> str:
        how = "pipe"
        if self.ring_out_name is not None:
            how += f" + shared memory ({self.capacity >> 20} MiB ring"
            how += " and mailbox)" if self.mailbox_out is not None else ")"
        return how

    # ---------------------------------------------------------------- sending
    def send(self, header: Header, payload: np.ndarray | None, op: str) -> None:
        raw = header.pack()
        if payload is None or header.nbytes == 0:
            self._frame(_INLINE, raw, None, op)
            return None
        data = payload.view(np.uint8).reshape(-1)
        if header.nbytes < SHM_MIN_BYTES:
            if self.mailbox_out is not None and self._boxed(_INLINE, raw, data):
                self.counters["mailbox"] += 1
                return None
        else:
            dst = self.reserve(header.nbytes)
            if dst is not None:
                np.copyto(dst, data)
                return self.send_reserved(header, op)
        self.counters["pipe"] += 1
        self._piped(_INLINE, raw, data, op)
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
        self._frame(_IN_SHM, header.pack(), _SHM_NOTICE.pack(start), op)

    def host_memory(self) -> tuple[tuple[int, int], ...]:
        """The shared-memory rings' payload areas, each once it is mapped (the outgoing one
        at the first ``reserve``, the incoming one at the first payload read from it)."""
        return tuple(ring.region for ring in (self.ring_out, self.ring_in) if ring is not None)

    def send_notice(self, header: Header, text: bytes) -> None:
        # down the pipe it arrives before this rank's end of the pipe closes, so a peer that
        # sees the close has read the notice first and reports the real cause
        with contextlib.suppress(OSError, CommError):
            self._piped(_INLINE, header.pack(), text, "abort")

    def _frame(self, tag: bytes, raw: bytes, rest: bytes | None, op: str) -> None:
        """A frame whose payload (``rest``) fits a mailbox slot: there, else the pipe."""
        if self.mailbox_out is None or not self._boxed(tag, raw, rest):
            self._piped(tag, raw, b"" if rest is None else rest, op)

    def _boxed(self, tag: bytes, raw: bytes, rest: Any) -> bool:
        box = self.mailbox_out
        if box is None or not box.put(self.frames_out, tag, raw, rest):
            return False
        self.frames_out += 1
        if box.sleeping:
            self.counters["doorbell"] += 1
            with contextlib.suppress(OSError):  # a peer gone: its receive reports that
                self.pipe_out.write(_DOORBELL)
        return True

    def _piped(self, tag: bytes, raw: bytes, rest: Any, op: str) -> None:
        if self.numbered_out:  # the peer merges the pipe with its mailbox by number
            frame = b"".join((tag, _NUMBER.pack(self.frames_out), raw, rest))
            self.frames_out += 1
        else:
            frame = b"".join((tag, raw, rest))
        try:
            self.pipe_out.write(frame)
        except BrokenPipeError:
            self.peer_lost(op, f"rank {self.peer} closed its pipe while this rank still had "
                           "data to send to it")

    def check_delivered(self, op: str) -> None:
        # A pipe's write fails once its reader is gone; a mailbox's cannot. So a frame still
        # in the mailbox with the pipe's reader gone (an error on its write end) will never
        # be read: its receiver died (one that closes takes its frames first). Asked at most
        # once a millisecond (a system call): an op that sends right after another one that
        # asked may return, and the next op raises.
        box = self.mailbox_out
        if box is None or box.delivered:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _CHECK_EVERY_S
        if self._writer_error.poll(0) and not box.delivered:
            self.peer_lost(op, f"rank {self.peer} closed its pipe while this rank still had "
                           "data to send to it")

    # ---------------------------------------------------------------- receiving
    def recv_header(self, wait: Wait) -> Header:
        if self.held is not None or self.box_held:
            self._release()
        while True:
            header = self._next_frame(wait)
            if header is not None:
                return header
            self.wait_readable(wait)

    def release_payload(self) -> None:
        self._release()

    def _release(self) -> None:
        """The previous payload has been used by now: free its slot."""
        if self.held is not None:
            assert self.ring_in is not None  # a payload was held: the ring is mapped
            self.ring_in.release(*self.held)
            self.held = None
        if self.box_held:
            assert self.mailbox_in is not None
            self.mailbox_in.release()
            self.box_held = False
            self.boxed = None

    def _next_frame(self, wait: Wait) -> Header | None:
        """The header of the next frame, from the mailbox or the pipe, or None if it has not
        arrived. Raises once the peer is gone and everything it sent has been read."""
        box = self.mailbox_in
        if box is None:  # everything comes down the pipe, unnumbered
            try:
                head = self.pipe_in.peek(_PLAIN_HEAD)
            except EOFError:
                self.peer_lost(wait.op)
            if head is None:
                return None
            self.pipe_in.skip(_PLAIN_HEAD)
            return self._pipe_frame(head, 1, wait)
        if box.ready(self.frames_in):
            tag, raw, at = box.take()
            header = Header.unpack(raw)
            self.box_held = True
            self.frames_in += 1
            self.piped = False
            if tag == _IN_SHM:
                self.incoming = (int(box.payload(at, _SHM_NOTICE.size).view(np.int64)[0]),
                                 header.nbytes)
            else:
                self.boxed = box.payload(at, header.nbytes)
            return header
        pipe = self.pipe_in
        try:
            head = pipe.peek(_NUMBERED_HEAD)
            while head is None or head[:1] == _DOORBELL:
                if pipe.buffered(1) != _DOORBELL:
                    return None  # nothing yet, or a frame not all here yet
                pipe.take(1)
                head = pipe.peek(_NUMBERED_HEAD)
        except EOFError:
            if box.ready(self.frames_in):
                return self._next_frame(wait)  # its last frames went to the mailbox
            self.peer_lost(wait.op)
        assert head is not None  # the loop above ends on a frame's head
        number = _NUMBER.unpack_from(head, 1)[0]
        if number != self.frames_in:
            # The sender filled the mailbox since we looked and went on in the pipe: the
            # frame we wait for is in the mailbox now (it was put there first).
            if box.ready(self.frames_in):
                return self._next_frame(wait)
            raise CommError(f"message {number} from rank {self.peer} came before message "
                            f"{self.frames_in}: the link lost a message", rank=self.rank,
                            op=wait.op, peer=self.peer)
        pipe.skip(_NUMBERED_HEAD)
        self.frames_in += 1
        self.piped = True
        return self._pipe_frame(head, 1 + _NUMBER.size, wait)

    def _pipe_frame(self, head: bytes, at: int, wait: Wait) -> Header:
        """A pipe frame whose ``head`` (tag, [number,] header at ``at``) has been read."""
        header = Header.unpack_from(head, at)
        tag = head[:1]
        if tag == _INLINE:
            self.inline = header.nbytes
        elif tag == _IN_SHM:
            notice = self._take(_SHM_NOTICE.size, wait, rest=True)
            self.incoming = (_SHM_NOTICE.unpack(notice)[0], header.nbytes)
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
        if self.boxed is not None:
            boxed, self.boxed = self.boxed, None
            return boxed  # its slot is released at the next header
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
            self._release()  # the notice's mailbox slot: taken now
            return out.nbytes
        data = self.recv_payload(op)
        if len(data) != out.nbytes:
            raise CommError(f"payload of {len(data)} B from rank {self.peer}, expected "
                            f"{out.nbytes} B", rank=self.rank, op=op, peer=self.peer)
        out[:] = np.frombuffer(data, dtype=np.uint8)
        if self.box_held:
            self._release()
        return out.nbytes

    def peek(self) -> bool:
        box = self.mailbox_in
        if box is not None and box.ready(self.frames_in):
            return True
        pipe = self.pipe_in
        if box is None:
            return pipe.has(_PLAIN_HEAD)
        try:
            while pipe.peek(1) == _DOORBELL:
                pipe.take(1)
            return pipe.peek(_NUMBERED_HEAD) is not None
        except EOFError:
            return True

    def _ready_or_lost(self, wait: Wait) -> bool:
        # Without a mailbox the pipe shows in the poll of every turn. With one: a memory
        # read, and the pipe polled every few turns, or on every turn while frames come that
        # way (a sender running ahead filled the mailbox).
        box = self.mailbox_in
        return box is not None and (box.ready(self.frames_in)
                                    or self.piped and self.pipe_in.has(1))

    def _doze(self, sleeping: bool) -> bool:
        box = self.mailbox_in
        if box is None:
            return False
        box.doze(sleeping)
        return sleeping and box.ready(self.frames_in)

    def _readable(self, events: dict) -> bool:
        return self.pipe_in.fd in events

    # ---------------------------------------------------------------- teardown
    def finish_sending(self) -> None:
        self.pipe_out.close()

    def close(self) -> None:
        if self.mailbox_in is not None:  # the frames taken, before the pipe says we left
            self.mailbox_in.release()
        self.pipe_in.close()
        for shared in (self.ring_out, self.ring_in, self.mailbox_in, self.mailbox_out):
            if shared is not None:
                shared.close()
