"""A locked door for ZeroMQ sockets: CURVE keys derived from a shared token, a ZAP handler
that admits only the token's client key, and the handshake events that tell a client at once
that it was refused.

Why CURVE: ZeroMQ already has an authenticated, encrypted handshake (CurveZMQ); a hand-made
one would be new code where mistakes are easy to make and hard to see. Every process that
holds the token (``RINGCOMM_AUTH_TOKEN``) derives the same two key pairs from it: a server
pair for sockets that listen (the store, a rank's receiving sockets and control socket) and a
client pair for sockets that connect. A client must know the server's public key to start a
handshake, and the server's ZAP handler (``Gatekeeper``) then admits only the client public
key of the token; so a peer without the token can neither talk to a server nor pose as one,
and every frame after the handshake is encrypted. The keys come from the token through
scrypt, so that guessing a short token from a recorded handshake costs a guesser dearly;
still, use a long random token (``secrets.token_hex(32)``).

A refused client sees a handshake failure in its socket monitor within a round trip
(``handshake_failure``); a server logs refusals with their reason (``log_refusal``, the
gatekeeper's own) and goes on serving the peers that hold the token. Strangers can knock
in a loop, so refusals are logged at a bounded rate (``RateLimitedLog``: ten at once, then
one a second per kind of refusal), each line saying how many were held back before it.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from ..core.rate_limit import RateLimitedLog

log = logging.getLogger("ringcomm")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
ZAP_VERSION = b"1.0"
DOMAIN = "ringcomm"
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1, "salt": b"ringcomm CURVE keys v1"}
REFUSALS_PER_SECOND = 1.0  # refusals logged, per kind, after the first REFUSALS_AT_ONCE
REFUSALS_AT_ONCE = 10
_REFUSALS = RateLimitedLog(log, per_second=REFUSALS_PER_SECOND, burst=REFUSALS_AT_ONCE)

# What a socket monitor reports about a handshake (libzmq 4.3 and later).
# What CURVE adds to a frame on the wire, which is what ZMQ_MAXMSGSIZE bounds: a MESSAGE
# command's name, nonce, flags and MAC (about 33 B, per RFC 26), with room to spare
FRAME_OVERHEAD = 256
HANDSHAKE_SUCCEEDED = zmq.EVENT_HANDSHAKE_SUCCEEDED
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_EVENTS = HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED


@dataclass(frozen=True)
class Keys:
    """The two CURVE key pairs of one token (z85 text, as ZeroMQ's options take them)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it binds) a CURVE server that asks the ZAP handler."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public)
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit

    def dial(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before it connects) a CURVE client holding the token's keys."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)


@functools.lru_cache(maxsize=4)
def _derive(token: str) -> Keys:
    seed = hashlib.scrypt(token.encode(), dklen=64, **_SCRYPT)  # type: ignore[arg-type]
    server_secret, client_secret = z85.encode(seed[:32]), z85.encode(seed[32:])
    return Keys(zmq.curve_public(server_secret), server_secret,
                zmq.curve_public(client_secret), client_secret)


def keys_for(token: str | None) -> Keys | None:
    """The key pairs of ``token``; None without one (sockets stay plain)."""
    if not token:
        return None
    if not zmq.has("curve"):
        from ..errors import ArgumentError
        raise ArgumentError("RINGCOMM_AUTH_TOKEN is set, but this libzmq has no CURVE "
                            "support; install pyzmq's own wheel (which bundles libsodium)")
    return _derive(token)


class Gatekeeper:
    """The ZAP handler of one ZeroMQ context: admits CURVE clients holding the token's
    client key and refuses everyone else, logging why. A thread with a REP socket on the
    context's ZAP endpoint, started before any server socket of the context binds (without a
    handler libzmq would admit any client that knows the server key). ``close`` stops it
    (before the context ends)."""

    def __init__(self, ctx: zmq.Context, keys: Keys, what: str) -> None:
        self._ctx = ctx
        self._client_key = z85.decode(keys.client_public)
        self._what = what
        self._stop_addr = f"inproc://ringcomm-zap-stop-{id(self)}"
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.refused = 0
        self._log = RateLimitedLog(log, per_second=REFUSALS_PER_SECOND, burst=REFUSALS_AT_ONCE)
        self._thread = threading.Thread(target=self._serve, name="ringcomm-zap", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise self._failure

    def _serve(self) -> None:
        try:
            rep = self._ctx.socket(zmq.REP)
            stop = self._ctx.socket(zmq.PAIR)
            rep.setsockopt(zmq.LINGER, 0)
            stop.setsockopt(zmq.LINGER, 0)
            rep.bind(ZAP_ENDPOINT)
            stop.bind(self._stop_addr)
        except zmq.ZMQError as err:
            self._failure = err
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while True:  # (while refusals are held back, a look each second to count them)
                events = dict(poller.poll(1000 if self._log.suppressed else None))
                self._log.flush()
                if stop in events:
                    return
                if rep in events:
                    try:
                        rep.send_multipart(self.answer(rep.recv_multipart()))
                    except zmq.ZMQError as err:  # one request failed; the next is answered
                        log.warning("%s could not answer a ZAP request: %s", self._what, err)
        finally:
            rep.close()
            stop.close()

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request: 200 for the token's client key, 400 otherwise."""
        if len(request) < 6:
            self._refuse("?", "a malformed ZAP request")
            request_id = request[1] if len(request) > 1 else b""
            return [ZAP_VERSION, request_id, b"400", b"malformed request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = request[:6]
        credentials = request[6:]
        peer = address.decode(errors="replace") or "a local process"
        if version != ZAP_VERSION:
            reason = "an unknown ZAP version"
        elif mechanism != b"CURVE" or len(credentials) != 1:
            reason = f"mechanism {mechanism.decode(errors='replace')} instead of CURVE"
        elif not hmac.compare_digest(credentials[0], self._client_key):
            reason = "a client key that is not the token's"
        else:
            return [ZAP_VERSION, request_id, b"200", b"OK", b"ringcomm", b""]
        self._refuse(peer, reason)
        return [ZAP_VERSION, request_id, b"400", b"not the token's key", b"", b""]

    def _refuse(self, peer: str, reason: str) -> None:
        self.refused += 1
        # a stranger knocking in a loop must not fill the log: a bounded rate, and a count
        self._log.warning("refused", "%s refused a connection from %s: %s (it does not hold "
                          "this RINGCOMM_AUTH_TOKEN; %d refused so far)", self._what, peer,
                          reason, self.refused)

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        poke = self._ctx.socket(zmq.PAIR)
        try:
            poke.connect(self._stop_addr)
            poke.send(b"stop")
            self._thread.join(timeout=10)
        finally:
            poke.close(linger=0)


def handshake_failure(event: int, value: int) -> str | None:
    """What a client's monitor event says went wrong in a handshake; None if nothing did."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the server refused this process's key (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "one end uses a token and the other none"
        return f"the handshake broke a rule of the protocol (code {value:#x})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return ("the server closed the connection during the handshake (it holds another "
                "token, or one of the two holds none)")
    return None


def log_refusal(what: str, event: int, value: int, endpoint: str,
                limiter: RateLimitedLog | None = None) -> None:
    """Log a server socket's failed handshake (a peer with another token, or a stranger), at
    a bounded rate: through ``limiter`` (a server's own, which its loop flushes), else this
    module's (whose held-back lines are counted in its next line of the kind)."""
    if not event & HANDSHAKE_FAILED:
        return
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
            value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        why = "its CURVE handshake does not decrypt with this token's keys (another token)"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
            value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        why = "one end uses a token and the other none"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return  # the gatekeeper has said why
    else:
        why = f"not ZeroMQ, or not ringcomm's protocol (code {value:#x})"
    (limiter or _REFUSALS).warning(("handshake", what), "%s refused a connection on %s: %s",
                                   what, endpoint, why)
