"""The local link kind: a named pipe each way and shared-memory rings between two ranks of one
host (``ringcomm.transport.local_link``), with mailboxes where the receiver asks for them.

Offered by a rank with shared memory (``RINGCOMM_SHM``, and ``/dev/shm`` present) and peers
on its host, unless sockets are forced (``RINGCOMM_TRANSPORT=tcp``). The offer names the
rank's shared memory (a token that carries its pid, so a later rank can sweep what a killed
one left), the capacity of its outgoing rings and the folder its pipes are in; a pair uses
it only where both ends offer it. Its pipes must be open at both ends before a reader can
tell a closed writer from one not yet there, so once every pair has a link the kind meets
its local peers in the store once more (``connected``).
"""

from __future__ import annotations

from typing import Any

from ...core import config
from .. import mailbox, shm_ring
from ..link import Link
from ..local_link import LocalLink
from ..peer_names import Check
from ..pipe import PipeReader
from .base import LinkKind, SetUp, Verdict


def shm_ring_bytes(local_peers: int, forced: int | None = None) -> int:
    """Capacity of each shared-memory ring: room for many segments, less per ring when a
    rank has many local peers (``forced``: ``RINGCOMM_SHM_BYTES``)."""
    if forced:
        return forced
    return max(8 << 20, min(32 << 20, (256 << 20) // max(1, local_peers)))


class LocalKind(LinkKind):
    name = "local"

    def __init__(self, setup: SetUp) -> None:
        super().__init__(setup)
        self._pipes_in: dict[int, PipeReader] = {}  # made for local peers, no link yet
        self.links: list[LocalLink] = []
        self.why_not = ""  # why this rank offers nothing, for ``verdict``

    def offer(self) -> dict[str, Any] | None:
        setup = self.setup
        local = [r for r in setup.peers if setup.same_host(r)]
        if setup.mode == "tcp":
            self.why_not = "RINGCOMM_TRANSPORT=tcp forces sockets"
        elif not local:
            self.why_not = "no peer shares this host"
        elif not setup.shm:
            self.why_not = "this rank does not offer shared memory (RINGCOMM_SHM=0)"
        elif not shm_ring.available():
            self.why_not = f"this host has no {shm_ring.SHM_DIR}"
        if self.why_not:
            return None
        folder = setup.ipc_dir
        self._pipes_in = {r: PipeReader(f"{folder}/pipe-from-{r}") for r in local}
        ring_bytes = shm_ring_bytes(len(local), config.value("shm_bytes"))
        return {"token": setup.token, "ring_bytes": ring_bytes, "dir": folder}

    def check_offer(self, check: Check, offer: dict[str, Any]) -> None:
        """The token names the peer's shared memory, the folder holds its pipes: both of
        the forms a rank makes, and the folder named for the process of the token."""
        token = check.token("kinds.local.token", offer.get("token"))
        check.size("kinds.local.ring_bytes", offer.get("ring_bytes"))
        check.folder("kinds.local.dir", offer.get("dir"), owner=token.rsplit("-", 1)[0])

    def verdict(self, peer: int, mine: dict[str, Any] | None,
                theirs: dict[str, Any] | None) -> Verdict:
        if mine is None:
            return Verdict(False, self.why_not)
        if not self.setup.same_host(peer):
            return Verdict(False, f"rank {peer} is on another host")
        if theirs is None:
            return Verdict(False, f"rank {peer} does not offer shared memory "
                                  "(RINGCOMM_SHM=0 there, or no /dev/shm)")
        return Verdict(True, "same host, both offer pipes and shared memory")

    def connect(self, peer: int, mine: dict[str, Any], theirs: dict[str, Any]) -> Link:
        setup, me = self.setup, self.setup.rank
        # the peer's folder and its pipe to us, on disk: this user's, not links
        pipe_out = Check(me, peer).fifo_on_disk("kinds.local.dir", theirs["dir"],
                                                f"pipe-from-{me}")
        ring_out = shm_ring.ring_name(mine["token"], me, peer)
        ring_in = shm_ring.ring_name(theirs["token"], peer, me)
        # an end that wants them makes its incoming mailbox (RINGCOMM_MAILBOX); the sender
        # maps it, where there is one, and removes its name
        mailbox_in = mailbox.mailbox_name(shm_ring.ring_name(mine["token"], peer, me))
        mailbox_out = mailbox.mailbox_name(shm_ring.ring_name(theirs["token"], me, peer))
        # ours until the reader maps it; theirs is not needed once we stop reading
        setup.files.shm_paths += [shm_ring.shm_path(name)
                                  for name in (ring_out, ring_in, mailbox_in)]
        link = LocalLink(
            me, peer, setup.control, setup.spin_s, pipe_in=self._pipes_in.pop(peer),
            pipe_out_path=pipe_out, flusher=setup.flusher,
            ring_out=ring_out, ring_in=ring_in, capacity=mine["ring_bytes"],
            capacity_in=int(theirs["ring_bytes"]),
            mailbox_in=mailbox_in if mailbox.wanted() else None,
            mailbox_out=mailbox_out if mailbox.supported() else None)
        self.links.append(link)
        return link

    def connected(self, links: dict[int, Link]) -> None:
        """A pipe's reader sees end-of-file until its writer has opened it: say that ours
        are open, wait until every local peer has said so, then let the links poll."""
        if not self.links:
            return
        setup = self.setup
        setup.store.set(setup.key("pipes", setup.rank), b"open")
        setup.store.wait([setup.key("pipes", link.peer) for link in self.links], setup.timeout)
        for link in self.links:
            link.opened()

    def close(self) -> None:
        for pipe in self._pipes_in.values():  # peers that took sockets after all
            pipe.close()
        self._pipes_in.clear()
