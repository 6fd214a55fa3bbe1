"""Bounded, validated input: whatever arrives from a socket (a message header, a link's
frames, a control-plane notice, a store request) is decoded or refused with a reason, never
crashes its reader and never makes it allocate what the input claims.

Hypothesis fuzzes each decoder (bounded by ``max_examples`` and deadlines); then strangers
send garbage at a real store and at real ranks' tcp ports (raw TCP, a ZeroMQ handshake
followed by a frame that claims 2**60 bytes, ZeroMQ DEALER and PUSH sockets), and the ranks'
collectives must still give exact results.
"""

from __future__ import annotations

import contextlib
import random
import resource
import socket
import struct
import threading
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_auth import HOST, TOKEN, finish, free_port, read_line, start_ranks

from ringcomm import CommError, DesyncError
from ringcomm.bootstrap.store import (
    MAX_KEY_BYTES,
    StoreClient,
    StoreServer,
    parse_request,
)
from ringcomm.bootstrap.store_wire import MAX_MESSAGE_BYTES
from ringcomm.bootstrap.store_zmtp import ProtocolError, Reader, encode, greeting, ready
from ringcomm.transport import auth
from ringcomm.transport.header import SIZE, Header, OpKind
from ringcomm.transport.socket_link import Arrivals, decode_header
from ringcomm.transport.zmq_control import MAX_ABORT_BYTES, decode_notice

FUZZ = settings(max_examples=200, deadline=500, suppress_health_check=[HealthCheck.too_slow])
LIVE = settings(max_examples=60, deadline=2000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
small_ints = st.integers(min_value=0, max_value=255)
headers = st.tuples(*[small_ints] * len(Header._fields)).map(Header._make)


# --------------------------------------------------------------------------- the header


@FUZZ
@given(st.binary(max_size=3 * SIZE))
def test_the_header_decoder_takes_any_bytes_without_crashing(raw):
    try:
        header = Header.unpack(raw)
    except DesyncError:
        return
    assert len(raw) == SIZE and isinstance(header, Header)


@FUZZ
@given(headers, st.data())
def test_a_header_survives_its_round_trip_and_any_byte_changed_in_it(header, data):
    raw = header.pack()
    assert len(raw) == SIZE and Header.unpack(raw) == header
    spoilt = bytearray(raw)
    at = data.draw(st.integers(0, SIZE - 1))
    spoilt[at] = data.draw(st.integers(0, 255))
    with contextlib.suppress(DesyncError):  # a changed version byte: refused
        assert isinstance(Header.unpack(bytes(spoilt)), Header)


# --------------------------------------------------------------------------- a socket link's frames


@FUZZ
@given(st.binary(max_size=2 * SIZE), st.booleans())
def test_the_socket_links_frame_decoder_refuses_what_is_not_a_header(raw, more):
    try:
        header = decode_header(raw, more, rank=0, peer=1, op="allreduce #1")
    except CommError as err:
        assert err.peer == 1 and "rank 1" in str(err)
        return
    assert more and len(raw) == SIZE and header == Header.unpack(raw)


# --------------------------------------------------------------------------- a link's arrivals


ACCEPTED, CLOSED = zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED
# what a stranger's connection shows a receiving socket's monitor, by kind of stranger
STRANGERS = {
    "raw bytes": [zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL],
    "closed at once": [zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL],
    "wrong socket type": [],  # a DEALER: no handshake event at all
    "another token": [zmq.EVENT_HANDSHAKE_FAILED_AUTH],
}  # (a PUSH without a token finishes its handshake: without a token it is a sender like
# the peer, and one that comes and goes before the peer looks like the peer leaving)


@FUZZ
@given(st.lists(st.sampled_from(sorted(STRANGERS)), max_size=4), st.booleans(), st.data())
def test_a_strangers_connection_closing_is_never_the_peer_lost(strangers, peer_leaves, data):
    """Every interleaving of the peer's connection with strangers' ones: ``see`` says the peer
    is lost only once the peer's connection has closed."""
    lives = [[(ACCEPTED, 10), (auth.HANDSHAKE_SUCCEEDED, 0)] + [(CLOSED, 10)] * peer_leaves]
    for fd, kind in enumerate(strangers, start=20):
        lives.append([(ACCEPTED, fd)] + [(e, 0) for e in STRANGERS[kind]] + [(CLOSED, fd)])
    arrivals, peer_gone = Arrivals(), False
    while any(lives):
        life = data.draw(st.sampled_from([life for life in lives if life]))
        event, value = life.pop(0)
        lost = arrivals.see(event, value)
        peer_gone = peer_gone or (event == CLOSED and value == 10)
        assert not lost or peer_gone


def test_the_peer_lost_is_seen_at_once_when_no_stranger_overlaps_it():
    arrivals = Arrivals()
    for event, value in ((ACCEPTED, 20), (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, 0), (CLOSED, 20),
                         (ACCEPTED, 10), (auth.HANDSHAKE_SUCCEEDED, 0), (ACCEPTED, 21),
                         (CLOSED, 21), (ACCEPTED, 22), (auth.HANDSHAKE_SUCCEEDED, 0),
                         (CLOSED, 22)):  # a PUSH without a token came and went
        assert not arrivals.see(event, value)
    assert arrivals.see(CLOSED, 10)


# --------------------------------------------------------------------------- control-plane notices


frames = st.lists(st.binary(max_size=2 * SIZE + 8), max_size=4)


@FUZZ
@given(frames)
def test_the_control_planes_decoder_refuses_what_is_not_a_notice_from_a_peer(message):
    try:
        header, payload, probed = decode_notice(message, 0, {1, 2})
    except ValueError as err:
        assert str(err)  # a reason to log
        return
    assert len(message) == 2 and header.sender in (1, 2)
    assert header.kind in (OpKind.ABORT, OpKind.PROBE)
    assert (probed is None) == (header.kind == OpKind.ABORT)


@FUZZ
@given(st.integers(0, 1 << 20), st.integers(0, 5), st.binary(max_size=MAX_ABORT_BYTES + 64),
       headers, st.text(max_size=300))
def test_real_notices_decode_and_bounds_hold(seq, sender, text, expected, op):
    abort = [Header.control(OpKind.ABORT, seq, sender).pack(), text]
    probe = [Header.control(OpKind.PROBE, seq, sender).pack(), expected.pack() + op.encode()]
    for message, fits in ((abort, len(text) <= MAX_ABORT_BYTES),
                          (probe, len(op.encode()) <= 256)):
        # a peer's notice, or this rank's own abort (its wake)
        known = sender in (1, 2) or (sender == 0 and message is abort)
        try:
            header, _, probed = decode_notice(message, 0, {1, 2})
        except ValueError:
            assert not (known and fits)
            continue
        assert known and fits and header.sender == sender
        if message is probe:
            assert probed == expected


# --------------------------------------------------------------------------- store requests


requests = st.lists(st.one_of(
    st.sampled_from([b"set", b"get", b"wait", b"add", b"check", b"compare_set", b"delete",
                     b"num_keys", b"ping", b"leave", b"", b"-1", b"10"]),
    st.binary(max_size=40)), max_size=6)


@FUZZ
@given(requests)
def test_the_store_protocol_decoder_refuses_what_is_not_a_request(message):
    try:
        request_id, command, args = parse_request(message)
    except ValueError as err:
        assert str(err)
        return
    assert len(request_id) == 8 and command in (
        b"set", b"get", b"wait", b"add", b"check", b"compare_set", b"delete", b"num_keys",
        b"ping", b"leave")


def test_store_requests_of_the_protocol_are_taken_and_their_bounds_hold():
    rid = b"\0" * 8
    assert parse_request([rid, b"set", b"k", b"v"])[1] == b"set"
    assert parse_request([rid, b"wait", b"1000", b"a", b"b"])[2] == [b"1000", b"a", b"b"]
    assert parse_request([rid, b"add", b"k", b"-" + b"9" * 999])
    assert parse_request([rid, b"leave", b"ringcomm/0/1", b"3"])[2] == [b"ringcomm/0/1", b"3"]
    for bad, why in (([rid, b"set", b"k"], "takes 2"),
                     ([rid, b"get", b"soon", b"k"], "not a number"),
                     ([rid, b"get", b"9" * 21, b"k"], "not a number"),
                     ([rid, b"add", b"k", b"1e9"], "not an integer"),
                     ([rid, b"set", b"k" * (MAX_KEY_BYTES + 1), b"v"], "a key of"),
                     ([rid, b"delete", b""], "a key of 0 B"),
                     ([rid, b"leave", b"g", b"-1"], "rank .* is not a number"),
                     ([rid, b"leave", b"", b"0"], "a key of 0 B"),
                     ([b"short", b"ping"], "request id"),
                     ([rid, b"explode"], "unknown command")):
        with pytest.raises(ValueError, match=why):
            parse_request(bad)


@pytest.fixture(scope="module")
def store_server():
    with StoreServer(HOST, 0, auth_token="") as server:
        yield server


@LIVE
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=6))
def test_a_store_takes_garbage_from_a_dealer_and_serves_its_real_clients(store_server, junk):
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(f"tcp://{store_server.address}")
    try:
        if junk:
            dealer.send_multipart(junk)
        with StoreClient(store_server.address, timeout=10, auth_token="") as friend:
            friend.set("real/7d3f0c1e9b2a4c58", b"exact")
            assert friend.get("real/7d3f0c1e9b2a4c58") == b"exact"
    finally:
        dealer.close()
        ctx.term()


# --------------------------------------------------------------------------- whole store messages
# Without a token the store reads ZeroMQ's wire itself (``store_zmtp.Reader``), so that a whole
# message is bounded, not a frame. Small bounds here, so that the fuzzing reaches them.

SMALL_BYTES, SMALL_FRAMES = 300, 5
_PEER_READY = b"\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
PEER_HELLO = (b"\xff" + bytes(8) + b"\x7f\x03\x01" + b"NULL".ljust(20, b"\0") + bytes(32)
              + bytes([4, len(_PEER_READY)]) + _PEER_READY)


def _zmtp(message: list[bytes]) -> bytes:
    """A message as a DEALER writes it (ZMTP 3 frames), written here apart from the store."""
    out = b""
    for i, body in enumerate(message):
        more = 1 if i < len(message) - 1 else 0
        out += (bytes([more, len(body)]) if len(body) < 256
                else bytes([more | 2]) + struct.pack(">Q", len(body))) + body
    return out


def _fed_in_pieces(reader: Reader, data: bytes, cuts: list[int]) -> list[list[bytes]]:
    got: list[list[bytes]] = []
    at = 0
    for cut in sorted({min(c, len(data)) for c in cuts}) + [len(data)]:
        got += reader.feed(data[at:cut])
        assert 0 <= reader.held <= SMALL_BYTES
        at = cut
    return got


messages = st.lists(st.lists(st.binary(max_size=320), min_size=1, max_size=7), max_size=5)


@FUZZ
@given(messages, st.lists(st.integers(0, 3000), max_size=12))
def test_whole_messages_come_out_as_they_went_in_whatever_the_pieces(sent, cuts):
    """However the bytes are cut, the messages within the bounds come out whole and in
    order; the first that passes a bound is refused, before its body is read."""
    fits = [m for m in sent if len(m) <= SMALL_FRAMES and sum(map(len, m)) <= SMALL_BYTES]
    reader = Reader(SMALL_BYTES, SMALL_FRAMES)
    data = PEER_HELLO + b"".join(_zmtp(m) for m in sent)
    if fits == sent:
        assert _fed_in_pieces(reader, data, cuts) == sent
        assert reader.ready and reader.socket_type == b"DEALER" and reader.held == 0
        return
    with pytest.raises(ProtocolError, match="a message of more than"):
        _fed_in_pieces(reader, data, cuts)


@FUZZ
@given(st.binary(max_size=600), st.lists(st.integers(0, 700), max_size=8), st.booleans())
def test_the_store_wire_reader_takes_any_bytes_within_its_bounds(junk, cuts, greeted):
    """Any bytes, after a proper greeting or none: messages within the bounds, or a
    ProtocolError with a reason; never more held than the bound."""
    reader = Reader(SMALL_BYTES, SMALL_FRAMES)
    try:
        for message in _fed_in_pieces(reader, (PEER_HELLO if greeted else b"") + junk, cuts):
            assert 1 <= len(message) <= SMALL_FRAMES
            assert sum(map(len, message)) <= SMALL_BYTES
    except ProtocolError as err:
        assert str(err)


def test_the_store_wire_reader_refuses_what_a_store_does_not_speak():
    for hello, why in ((b"GET / HTTP/1.0\r\n", "not a ZeroMQ greeting"),
                       (b"\xff" + bytes(8) + b"\x00", "ZMTP 1.0"),
                       (b"\xff" + bytes(8) + b"\x7f\x02", "ZMTP 2"),
                       (PEER_HELLO.replace(b"NULL", b"CURVE"[:4]), "mechanism CURV"),
                       (PEER_HELLO.replace(b"DEALER", b"PUSHXX"), "type PUSHXX"),
                       (PEER_HELLO[:64] + b"\x00\x01x", "before the handshake"),
                       (PEER_HELLO + b"\x08", "reserved bits"),
                       (PEER_HELLO + b"\x05\x01x", "command frame with MORE"),
                       (PEER_HELLO + b"\x06" + struct.pack(">Q", 1 << 60), "a command of")):
        with pytest.raises(ProtocolError, match=why):
            Reader(SMALL_BYTES, SMALL_FRAMES).feed(hello)
    # what the store itself sends is what a DEALER expects: a greeting, then READY
    assert greeting()[:1] == b"\xff" and len(greeting()) == 64 and b"ROUTER" in ready()
    assert b"".join(encode([b"id", b"ok", bytes(1 << 17)])) == _zmtp([b"id", b"ok",
                                                                      bytes(1 << 17)])


def _raw_dealer(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(PEER_HELLO)
    return s


@LIVE
@given(st.lists(st.tuples(st.integers(0, 5000), st.booleans()), min_size=1, max_size=40))
def test_a_store_takes_whole_messages_of_any_shape_and_serves_its_real_clients(
        store_server, frames):
    """Frames of any size and count, MORE set or not, the last unfinished or not: the store
    answers, refuses or closes, holds no more than its bound, and serves its clients."""
    stranger = _raw_dealer(store_server.address)
    try:
        for size, more in frames:
            flags = (1 if more else 0) | (2 if size > 255 else 0)
            head = bytes([flags]) + (struct.pack(">Q", size) if size > 255 else bytes([size]))
            try:
                stranger.sendall(head + bytes(size))
            except OSError:
                break  # closed by the store
        with StoreClient(store_server.address, timeout=10, auth_token="") as friend:
            friend.set("whole/7d3f", b"exact")
            assert friend.get("whole/7d3f") == b"exact"
        assert store_server.held()["most_message_bytes"] <= MAX_MESSAGE_BYTES
    finally:
        stranger.close()


# --------------------------------------------------------------------------- strangers at the door


def _zmtp_claiming(nbytes: int) -> bytes:
    """A ZMTP 3.0 greeting (NULL mechanism), a READY command from a DEALER, then the header of
    a message frame that claims ``nbytes`` bytes (which never come)."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + \
        b"\0" + b"\0" * 31
    prop = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    ready = b"\x05READY" + prop
    return greeting + b"\x04" + bytes([len(ready)]) + ready + b"\x02" + struct.pack(">Q", nbytes)


def _raw(endpoint: str, payload: bytes) -> None:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(payload)
            time.sleep(0.02)
    except OSError:
        pass  # refused or reset: that is the point


def _zmq(endpoint: str, kind: int, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.linger = 100
    # a DEALER or PUSH waits to send until a handshake completes: one the endpoint refuses
    # (or a busy machine delays) must not hang the stranger
    sock.sndtimeo = 2000
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        time.sleep(0.02)
    except zmq.Again:
        pass  # never let in: that is the point too
    finally:
        sock.close()
        ctx.term()


def _garbage(endpoints: list[str], control: list[str], rng: random.Random) -> None:
    """One of every kind of stranger at every endpoint; PUSH sockets only at control
    sockets (without a token, a PUSH at a link's socket is a sender ZeroMQ admits)."""
    for endpoint in endpoints:
        _raw(endpoint, rng.randbytes(rng.randint(1, 300)))
        _raw(endpoint, _zmtp_claiming(1 << 60))
        _zmq(endpoint, zmq.DEALER, [rng.randbytes(rng.randint(0, 80)) for _ in range(3)])
    for endpoint in control:
        _zmq(endpoint, zmq.PUSH, [rng.randbytes(SIZE), rng.randbytes(50)])
        fake = Header.control(OpKind.ABORT, 1, 99).pack()  # an abort from no peer
        _zmq(endpoint, zmq.PUSH, [fake, b"stranger says stop"])
        _zmq(endpoint, zmq.PUSH, [Header.control(OpKind.ABORT, 1, 1).pack()])  # one frame


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.timeout(60)
def test_a_store_survives_raw_garbage_and_frames_that_claim_2_to_the_60_bytes(store_server):
    rng = random.Random(27)
    endpoint = f"tcp://{store_server.address}"
    before = _max_rss_mib()
    for _ in range(20):
        _raw(endpoint, rng.randbytes(rng.randint(1, 2000)))
        _raw(endpoint, _zmtp_claiming(rng.choice([1 << 60, (1 << 40) + 3, 1 << 31])))
    with StoreClient(store_server.address, timeout=10, auth_token="") as friend:
        friend.set("after", b"garbage")
        assert friend.get("after") == b"garbage"
    assert _max_rss_mib() - before < 64  # nothing allocated for the claims


@pytest.mark.timeout(120)
@pytest.mark.parametrize("token", [None, pytest.param(TOKEN, marks=pytest.mark.slow)],
                         ids=["no-token", "token"])
def test_garbage_at_the_store_and_the_ranks_ports_changes_nothing_for_the_ranks(token):
    port = free_port()
    procs = start_ranks(3, f"{HOST}:{port}", [token] * 3, pause=True, rounds=8)
    try:
        ready = [read_line(p, 60) for p in procs]
        assert all("listening" in r for r in ready), ready
        links = [e for r in ready for e in r["listening"]]
        control = [r["listening"][0] for r in ready]  # its control socket comes first
        rng = random.Random(2027)
        _garbage(links + [f"tcp://{HOST}:{port}"], control, rng)
        stop = threading.Event()

        def keep_at_it() -> None:  # strangers go on knocking while the ranks work
            while not stop.is_set():
                _garbage(links, control, rng)

        stranger = threading.Thread(target=keep_at_it, daemon=True)
        stranger.start()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [read_line(p, 90) for p in procs]
        stop.set()
        stranger.join(30)
        assert results == [{"ok": 8}] * 3, results
    finally:
        finish(procs)
