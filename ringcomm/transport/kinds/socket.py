"""The socket link kind: ZeroMQ ``tcp://`` between hosts, ``ipc://`` on one host
(``ringcomm.transport.socket_link``).

It serves every pair, so it is the registry's last resort: ranks on different hosts, local
pairs where an end offers no shared memory, and every pair when ``RINGCOMM_TRANSPORT``
forces sockets. Its offer is one receiving socket per peer, bound before the offer is
published (its address is the offer), watched by a monitor that reports the connection
closing; a pair's sender connects a push socket to the address the receiver bound for it.
A tcp one binds a port the system picks, or one of ``RINGCOMM_PORT_RANGE`` where that is set
(``SetUp.bind_tcp``, as the control socket does).

With ``RINGCOMM_AUTH_TOKEN`` every tcp pair speaks CURVE (``ringcomm.transport.auth``): only
a sender holding the token gets through, and its frames are encrypted. An ipc pair stays
plain: its socket file is this user's alone (``files.bind_private``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import zmq

from .. import auth
from ..files import bind_private
from ..link import Link
from ..peer_names import Check
from ..socket_link import SocketLink, bound_receiving
from .base import LinkKind, SetUp, Verdict


class SocketKind(LinkKind):
    name = "socket"

    def __init__(self, setup: SetUp) -> None:
        super().__init__(setup)
        self._pulls: dict[int, zmq.Socket] = {}
        self.monitors: list[tuple[zmq.Socket, zmq.Socket]] = []  # (socket, its monitor)

    def offer(self) -> dict[str, Any] | None:
        setup = self.setup
        endpoints = {}
        for peer in setup.peers:
            by_ipc = setup.by_ipc(peer)
            pull = self._pulls[peer] = setup.sockets.pull(secure=not by_ipc)
            bound_receiving(pull, setup.segment_bytes)  # before it binds
            if by_ipc:
                endpoint = f"ipc://{setup.ipc_dir}/{peer}"
                bind_private(pull, endpoint)
            else:
                endpoint = setup.bind_tcp(pull)  # in RINGCOMM_PORT_RANGE where it is set
            self.monitors.append((pull, pull.get_monitor_socket(
                zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | auth.HANDSHAKE_EVENTS)))
            endpoints[str(peer)] = endpoint
        return {"endpoints": endpoints}

    def check_offer(self, check: Check, offer: dict[str, Any]) -> None:
        """An address of the form a rank binds for each of its peers, this rank's among
        them."""
        endpoints = check.mapping("kinds.socket.endpoints", offer.get("endpoints"))
        if str(check.rank) not in endpoints:
            raise check.refuse("kinds.socket.endpoints", endpoints,
                               f"has no address for rank {check.rank}")
        for peer, endpoint in endpoints.items():
            check.endpoint(f"kinds.socket.endpoints[{peer!r}]", endpoint)

    def verdict(self, peer: int, mine: dict[str, Any] | None,
                theirs: dict[str, Any] | None) -> Verdict:
        if theirs is None:
            return Verdict(False, f"rank {peer} offers no socket")
        scheme = "ipc" if self.setup.by_ipc(peer) else "tcp"
        why = ("RINGCOMM_TRANSPORT forces it" if self.setup.mode != "auto" else
               "same host" if self.setup.same_host(peer) else "another host")
        return Verdict(True, f"ZeroMQ {scheme} ({why})")

    def connect(self, peer: int, mine: dict[str, Any], theirs: dict[str, Any]) -> Link:
        setup = self.setup
        monitor = next(m for pull, m in self.monitors if pull is self._pulls[peer])
        endpoint = theirs["endpoints"][str(setup.rank)]
        Check(setup.rank, peer).endpoint_on_disk(
            f"kinds.socket.endpoints[{str(setup.rank)!r}]", endpoint)
        push = setup.sockets.push(endpoint,
                                  secure=not setup.by_ipc(peer), peer=peer)
        return SocketLink(setup.rank, peer, setup.control, setup.spin_s, push=push,
                          pull=self._pulls[peer], monitor=monitor)

    def close(self) -> None:
        """Stop the monitors (their sockets close with the context)."""
        for pull, monitor in self.monitors:
            with contextlib.suppress(zmq.ZMQError):
                pull.disable_monitor()
            monitor.close(linger=0)
        self.monitors.clear()
