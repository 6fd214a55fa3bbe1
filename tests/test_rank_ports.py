"""What a stranger can do at a rank's ports: bounded memory, bounded log lines, and errors
that say what arrived and from where.

Two ranks of this process (``GroupTransport`` over tcp, as between hosts) and a stranger
that speaks ZeroMQ's wire protocol (ZMTP 3.0) over a plain socket, so the test sees exactly
what a rank's port admits: how many bytes it takes before it stops reading, and whether it
drops a connection that claims too much.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest
import zmq
from mp_helpers import transport_pair

from ringcomm import CommError, CommTimeout, RemoteError
from ringcomm.core.rate_limit import RateLimitedLog
from ringcomm.transport import auth, socket_link, zmq_control
from ringcomm.transport.header import SIZE, WIRE_VERSION, Header, OpKind

TOKEN = "a token the strangers do not hold, 5e1b7c"
MiB = 1 << 20


# --------------------------------------------------------------------------- a stranger


def _greeting() -> bytes:
    """A ZMTP 3.0 greeting, NULL mechanism."""
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + \
        b"\0" * 32


def _ready(socket_type: bytes) -> bytes:
    """The READY command of a socket of ``socket_type``."""
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + \
        socket_type
    return b"\x04" + bytes([len(body)]) + body


def _read(sock: socket.socket, nbytes: int) -> bytes:
    got = b""
    while len(got) < nbytes:
        more = sock.recv(nbytes - len(got))
        if not more:
            raise ConnectionResetError("closed during the handshake")
        got += more
    return got


def connect_as(endpoint: str, socket_type: bytes, timeout: float) -> socket.socket:
    """A tcp connection to ``endpoint`` that has finished ZeroMQ's handshake (NULL
    mechanism) as a socket of ``socket_type``, the way libzmq does it: greetings first,
    then the READY commands."""
    sock = socket.create_connection(_endpoint_address(endpoint), timeout=timeout)
    sock.sendall(_greeting())
    _read(sock, 64)
    sock.sendall(_ready(socket_type))
    flags, size = _read(sock, 2)
    _read(sock, size if flags == 0x04 else struct.unpack(">Q", bytes([size]) +
                                                          _read(sock, 7))[0])
    return sock


def _frame(body: bytes, more: bool) -> bytes:
    flags = 0x01 if more else 0x00
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def _endpoint_address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


def push_until_stopped(endpoint: str, message: bytes, most: int,
                       stall_s: float = 1.0) -> tuple[int, bool]:
    """Connect to ``endpoint`` as a ZeroMQ PUSH socket and send ``message`` (framed) again
    and again, up to ``most`` bytes: how many bytes the port took before it stopped reading
    for ``stall_s`` (or dropped the connection), and whether it dropped it."""
    sock = connect_as(endpoint, b"PUSH", stall_s)
    sent = 0
    try:
        batch = memoryview(message * max(1, MiB // len(message)))
        pending = batch
        while sent < most:
            try:
                n = sock.send(pending)
            except TimeoutError:
                return sent, False
            except OSError:  # reset or broken: the port dropped the connection
                return sent, True
            sent += n
            pending = pending[n:] or batch  # whole messages, however the kernel cuts them
        return sent, False
    finally:
        sock.close()


def claim(endpoint: str, nbytes: int, most: int) -> tuple[int, bool]:
    """Connect as a PUSH, start a frame that claims ``nbytes`` and stream its body: how many
    bytes of it the port took, and whether it dropped the connection before ``most``."""
    sock = connect_as(endpoint, b"PUSH", 2.0)
    sent = 0
    try:
        sock.sendall(bytes([0x02]) + struct.pack(">Q", nbytes))
        chunk = b"\xab" * MiB
        while sent < most:
            try:
                sent += sock.send(chunk)
            except TimeoutError:
                return sent, False
            except OSError:
                return sent, True
        return sent, False
    finally:
        sock.close()


@pytest.fixture
def tcp_pair(monkeypatch):
    """Ranks 0 and 1 of this process over tcp, without a token."""
    monkeypatch.delenv("RINGCOMM_AUTH_TOKEN", raising=False)
    a, b = transport_pair("tcp", shm=False, hosts=("a", "b"))
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def curve_pair(monkeypatch):
    """Ranks 0 and 1 of this process over tcp, with a token."""
    monkeypatch.setenv("RINGCOMM_AUTH_TOKEN", TOKEN)
    a, b = transport_pair("tcp", shm=False, hosts=("a", "b"))
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def expected(seq: int, nbytes: int, sender: int = 1) -> Header:
    return Header(seq, nbytes, nbytes // 8, 1 << 20, sender, 0, -1, int(OpKind.ALLREDUCE), 2)


def a_message_goes_through(a, b, seq: int = 3) -> None:
    """Rank 1 sends rank 0 one message of an op, which arrives whole."""
    x = np.arange(64, dtype=np.float64)
    b.send(0, expected(seq, x.nbytes), x, f"allreduce #{seq}")
    out = np.empty_like(x)
    a.recv_into(1, expected(seq, x.nbytes), out, time.monotonic() + 10, f"allreduce #{seq}")
    assert np.array_equal(out, x)


def wait_on_link(transport, peer: int, seconds: float) -> None:
    """A receive from ``peer`` that nothing answers: its wait reads the link's monitor."""
    with pytest.raises(CommTimeout):
        transport.recv(peer, expected(99, 8, peer), time.monotonic() + seconds, "allreduce #99")


# --------------------------------------------------------------------------- what a port admits


@pytest.mark.timeout(60)
def test_a_data_port_drops_a_message_larger_than_a_segment_and_the_link_goes_on(tcp_pair):
    a, b = tcp_pair
    endpoint = a.links[1].describe_pull()
    took, dropped = claim(endpoint, 1 << 30, most=256 * MiB)  # an unfinished 1 GiB message
    assert dropped and took < 64 * MiB, (took, dropped)
    a_message_goes_through(a, b)


@pytest.mark.timeout(60)
def test_a_data_port_stops_reading_a_flood_of_messages(tcp_pair):
    a, b = tcp_pair
    endpoint = a.links[1].describe_pull()
    message = _frame(expected(3, 4 * MiB).pack(), more=True) + _frame(bytes(4 * MiB), False)
    took, dropped = push_until_stopped(endpoint, message, most=1024 * MiB, stall_s=0.5)
    # unread messages of about QUEUE_BYTES, and what the kernels' buffers hold
    assert not dropped and took < socket_link.QUEUE_BYTES + 64 * MiB, took


@pytest.mark.timeout(60)
def test_the_control_port_stops_reading_a_flood_of_notices_and_an_abort_still_gets_through(
        tcp_pair, caplog):
    caplog.set_level(logging.WARNING, logger="ringcomm")
    a, b = tcp_pair
    control = a.listening()[0]  # its control socket comes first
    junk = Header.control(OpKind.ABORT, 1, 99).pack()  # an abort from no rank of the group
    notice = _frame(junk, more=True) + _frame(b"s" * zmq_control.MAX_ABORT_BYTES, more=False)
    took, dropped = push_until_stopped(control, notice, most=256 * MiB, stall_s=0.5)
    assert not dropped and took < 48 * MiB, took  # it stopped reading: bounded, not dropped
    b.abort(5, "rank 1 gives up")  # a peer's abort is not stuck behind the stranger's flood
    with pytest.raises(RemoteError, match="rank 1 gives up"):
        a.recv(1, expected(5, 8), time.monotonic() + 10, "allreduce #5")
    dropped_lines = [r for r in caplog.records if "dropped a message" in r.getMessage()]
    assert len(dropped_lines) <= 12, len(dropped_lines)  # at a bounded rate


@pytest.mark.timeout(30)
def test_the_bounds_are_what_a_peer_may_send():
    largest_notice = max(zmq_control.MAX_ABORT_BYTES, SIZE + zmq_control.MAX_OP_NAME_BYTES)
    assert largest_notice == zmq_control.MAX_NOTICE_BYTES
    # a segment (or the largest message sent whole, whichever is larger) and no more
    assert socket_link.payload_bound(64 << 20) == 64 << 20
    assert socket_link.payload_bound(2 << 20) == 2 << 20  # the default segment
    assert socket_link.payload_bound(1) == socket_link.SMALLEST_BOUND == 64 << 10
    assert socket_link.payload_bound(0) == socket_link.UNAGREED_BOUND  # none agreed
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0
    try:
        socket_link.bound_receiving(pull, 32 << 20)
        assert pull.getsockopt(zmq.MAXMSGSIZE) == (32 << 20) + auth.FRAME_OVERHEAD
        assert 0 < pull.getsockopt(zmq.RCVHWM) * (32 << 20) <= socket_link.QUEUE_BYTES
    finally:
        pull.close()
        ctx.term()


# --------------------------------------------------------------------------- what it says


@pytest.mark.timeout(60)
def test_a_strangers_junk_header_names_the_rank_the_op_and_where_it_came_from(tcp_pair):
    a, b = tcp_pair
    endpoint = a.links[1].describe_pull()
    raw = bytearray(expected(3, 8).pack())
    raw[SIZE - 4] = 18  # the version byte: no ringcomm this group runs
    ctx = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.linger = 1000
        push.connect(endpoint)
        push.send_multipart([bytes(raw), b"12345678"])
        with pytest.raises(CommError) as caught:
            a.recv(1, expected(3, 8), time.monotonic() + 10, "allreduce #3")
        push.close()
    finally:
        ctx.term()
    text = str(caught.value)
    assert text.startswith("[rank 0, allreduce #3] "), text
    assert "wire format 18" in text and str(WIRE_VERSION) in text and endpoint in text, text
    assert "every rank must run the same ringcomm version" not in text, text
    assert "not from rank 1" in text, text


@pytest.mark.timeout(60)
def test_a_strangers_refused_handshake_is_an_unknown_peer_at_its_address(curve_pair, caplog):
    caplog.set_level(logging.WARNING, logger="ringcomm")
    a, _ = curve_pair
    endpoint = a.links[1].describe_pull()
    stranger = socket.create_connection(_endpoint_address(endpoint), timeout=5)
    try:
        wait_on_link(a, 1, 0.3)  # it sees the connection come while it is there
        stranger.sendall(_greeting())  # a plain greeting: refused (no token)
        with contextlib.suppress(OSError):
            stranger.recv(4096)
        where = "{}:{}".format(*stranger.getsockname())
    finally:
        stranger.close()
    wait_on_link(a, 1, 0.3)
    lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"from an unknown peer at {where}" in lines[0], lines
    assert "from rank 1" not in lines[0] and endpoint in lines[0], lines


@pytest.mark.timeout(60)
def test_refused_greetings_are_logged_at_a_bounded_rate_with_a_count(curve_pair, caplog):
    caplog.set_level(logging.WARNING, logger="ringcomm")
    a, b = curve_pair
    endpoint = a.links[1].describe_pull()
    now = [0.0]  # the limit's clock, moved on by hand below
    a.control.refusals = RateLimitedLog(logging.getLogger("ringcomm"), per_second=1.0,
                                        burst=10, clock=lambda: now[0])

    def knock() -> None:
        for _ in range(100):
            with contextlib.suppress(OSError), \
                    socket.create_connection(_endpoint_address(endpoint), timeout=2) as s:
                s.sendall(_greeting())
                with contextlib.suppress(OSError):
                    s.recv(4096)

    stranger = threading.Thread(target=knock)
    stranger.start()
    stranger.join(30)
    wait_on_link(a, 1, 0.3)
    a_message_goes_through(a, b)
    now[0] += 1.0  # a second later the limit lets one more line through:
    a.close()  # the transport's close says how many were held back
    lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()
             or "suppressed" in r.getMessage()]
    assert 1 <= len(lines) <= 12, len(lines)
    held = sum(int(n) for line in lines for n in re.findall(r"(\d+) similar lines? suppressed",
                                                              line))
    assert held + sum("refused a connection" in line for line in lines) == 100, lines



@pytest.mark.timeout(60)
def test_a_segment_larger_than_the_links_admit_is_refused_with_what_to_do(monkeypatch):
    """A link admits frames of the segment agreed at init (2 MiB by default): a larger
    segment later would have its messages dropped, so it is refused up front."""
    from mp_helpers import free_port

    import ringcomm
    from ringcomm import ArgumentError

    monkeypatch.delenv("RINGCOMM_AUTH_TOKEN", raising=False)
    with ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}",
                       timeout=20) as comm:
        comm.segment_bytes = 1 << 20  # within the agreed segment
        with pytest.raises(ArgumentError, match=r"ringcomm.init\(segment_bytes=67108864\)"):
            comm.segment_bytes = 64 << 20
        assert comm.segment_bytes == 1 << 20
    with ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}", timeout=20,
                       segment_bytes=64 << 20) as comm:
        comm.segment_bytes = 64 << 20


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_what_a_peer_sends_fits_what_its_link_admits(monkeypatch, token):
    """Over tcp, with links that admit the agreed segment (2 MiB): a binomial broadcast
    asked for by name on 4 MiB goes segment by segment (sent whole, the link dropped it as
    a stranger's and the receiver blamed a healthy root), and two ranks that each send
    128 MiB before they receive find their messages queued (a connection holds about
    256 MiB of unread segments). With a token, CURVE's frames are a little larger than
    their payload, and a whole segment still fits."""
    from mp_helpers import free_port

    import ringcomm

    if token is None:
        monkeypatch.delenv("RINGCOMM_AUTH_TOKEN", raising=False)
    else:
        monkeypatch.setenv("RINGCOMM_AUTH_TOKEN", token)
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "tcp")
    store = f"127.0.0.1:{free_port()}"
    results: list[object] = [None, None]

    def rank(r: int) -> None:
        try:
            with ringcomm.init(rank=r, world_size=2, store=store, timeout=20) as comm:
                x = np.full(1 << 20, float(r + 1), np.float32)  # 4 MiB
                comm.broadcast(x, root=0, algorithm="binomial")
                out = np.empty(32 << 20, np.float32)  # 128 MiB each way
                comm.send(np.full(32 << 20, float(r + 1), np.float32), 1 - r)
                comm.recv(out, 1 - r)
                results[r] = (float(x.min()), float(x.max()), float(out[0]), float(out[-1]))
        except BaseException as err:  # noqa: BLE001 - handed to the test
            results[r] = err

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert results == [(1.0, 1.0, 2.0, 2.0), (1.0, 1.0, 1.0, 1.0)], results


@pytest.mark.timeout(60)
def test_a_peers_abort_behind_stale_probes_is_seen_and_the_probes_go(tcp_pair):
    """Probes about ops this rank is past are dropped when it completes an op, not sent
    round again on every op; an abort behind a queue of them is still seen."""
    a, b = tcp_pair
    for seq in range(1, 41):  # a peer that asked, again and again, about ops long done
        b.control.probe(0, expected(seq, 8, sender=0), f"allreduce #{seq}")
    time.sleep(0.3)  # they arrive
    a.check_aborted(50, "allreduce #50")  # nothing to raise; the stale probes go
    assert not a.control.socket.poll(200, zmq.POLLIN), "stale probes still queued"
    for seq in range(51, 71):
        b.control.probe(0, expected(seq - 20, 8, sender=0), f"allreduce #{seq - 20}")
    b.abort(60, "rank 1 gives up")
    time.sleep(0.3)
    with pytest.raises(RemoteError, match="rank 1 gives up"):
        a.check_aborted(60, "allreduce #60")
