"""Setting up a group's shared board, beside its links.

Where every rank of a group shares one host and offers shared memory (the local link kind to
every peer), the group may also share a board (``board``): rank 0 makes it and names it in
its record, the others map it, and it is used only if every rank offers it
(``RINGCOMM_BOARD``, x86's store order) and every rank mapped it, which the ranks tell each
other through the store once more; then its name goes (``/dev/shm`` keeps nothing). Each
rank also has a doorbell (a FIFO in its folder) that a poster rings if the rank sleeps.
Reserved up front (2 MiB a rank), so a full ``/dev/shm`` shows here, as a warning and a
group that uses its links, not as a fault in the middle of an op.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from . import board, shm_ring
from .board_channel import Screening, ShmBoardChannel
from .kinds.base import SetUp
from .local_link import LocalLink
from .peer_names import Check
from .pipe import Doorbell, open_doorbell

log = logging.getLogger("ringcomm")


class BoardSetUp:
    """One rank's part in setting up the board of a group (see the module docstring)."""

    def __init__(self, setup: SetUp) -> None:
        self.setup = setup
        self._bell: Doorbell | None = None
        self._memory: Any = None
        self._name: str | None = None  # rank 0's, while the others may still map it

    def offer(self, local: dict[str, Any] | None) -> dict[str, Any] | None:
        """This rank's offer, given its offer of the local kind (``local``)."""
        setup = self.setup
        if local is None or not all(setup.same_host(p) for p in setup.peers) \
                or not board.wanted():
            return None
        self._bell = Doorbell(f"{setup.ipc_dir}/board-bell")
        if setup.rank != 0:
            return {}
        name = f"ringcomm-{setup.token}-board"
        path = shm_ring.shm_path(name)
        try:
            self._memory = shm_ring.map_shared(path, board.size(setup.world_size), create=True)
        except OSError as err:
            log.warning("rank 0: no shared board (%s); collectives use the links", err)
            return None
        setup.files.shm_paths.append(path)
        self._name = name
        return {"name": name}

    def check_offer(self, check: Check, offer: dict[str, Any],
                    local: dict[str, Any] | None) -> None:
        """Check a peer's board offer (``local``: its offer of the local kind, checked): a
        board comes with the local kind, and rank 0's names its shared memory as rank 0
        names it, after the token of its local offer."""
        if local is None:
            raise check.refuse("board", offer, "comes without an offer of the local kind")
        if check.peer == 0:
            name = offer.get("name")
            if name != f"ringcomm-{local.get('token')}-board":
                raise check.refuse("board.name", name, "is not the name rank 0 gives its "
                                   "board (ringcomm-<the token of its local offer>-board)")

    def connect(self, records: list[dict[str, Any]], transport: Screening,
                links: list[LocalLink]) -> ShmBoardChannel | None:
        """The board channel, if every rank offered the board and mapped it; None (and
        nothing held) otherwise. ``records``: every rank's published record."""
        setup, me = self.setup, self.setup.rank
        offers = [record.get("board") for record in records]
        if self._bell is None or any(offer is None for offer in offers):
            self._release()
            return None
        if me != 0:
            try:
                self._memory = shm_ring.map_shared(
                    shm_ring.shm_path(offers[0]["name"]),  # type: ignore[index]
                    board.size(setup.world_size), create=False)
            except (OSError, ValueError) as err:
                log.warning("rank %d: cannot map the shared board (%s); collectives use "
                            "the links", me, err)
        setup.store.set(setup.key("board", me), b"1" if self._memory is not None else b"0")
        keys = [setup.key("board", r) for r in range(setup.world_size)]
        setup.store.wait(keys, setup.timeout)
        mapped = all(setup.store.get(key) == b"1" for key in keys)
        if self._name is not None:  # every rank has mapped it, or will not: the name goes
            shm_ring.remove_made(shm_ring.shm_path(self._name))
        if not mapped or len(links) != setup.world_size - 1:
            self._release()
            return None
        # every peer's doorbell, on disk: a FIFO of this user's in its own folder, not a link
        paths = {peer: Check(me, peer).fifo_on_disk("kinds.local.dir",
                                                    records[peer]["kinds"]["local"]["dir"],
                                                    "board-bell") for peer in setup.peers}
        bells: dict[int, int] = {}
        try:
            for peer, path in paths.items():
                bells[peer] = open_doorbell(path)
        except BaseException:
            for fd in bells.values():
                os.close(fd)
            raise
        bell, self._bell = self._bell, None
        return ShmBoardChannel(board.Board(self._memory, me, setup.world_size), transport,
                               control=setup.control, links=links, bell=bell, bells=bells,
                               spin_s=setup.spin_s)

    def _release(self) -> None:
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        if self._memory is not None:
            with contextlib.suppress(Exception):
                self._memory.close()
            self._memory = None

    def close(self) -> None:
        """After a failed set-up: let go of what was made."""
        self._release()
