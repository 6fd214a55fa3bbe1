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
        path = os.path.join(shm_ring.SHM_DIR, name)
        try:
            self._memory = shm_ring.map_shared(path, board.size(setup.world_size), create=True)
        except OSError as err:
            log.warning("rank 0: no shared board (%s); collectives use the links", err)
            return None
        setup.files.shm_paths.append(path)
        self._name = name
        return {"name": name}

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
                    os.path.join(shm_ring.SHM_DIR, offers[0]["name"]),  # type: ignore[index]
                    board.size(setup.world_size), create=False)
            except (OSError, ValueError) as err:
                log.warning("rank %d: cannot map the shared board (%s); collectives use "
                            "the links", me, err)
        setup.store.set(setup.key("board", me), b"1" if self._memory is not None else b"0")
        keys = [setup.key("board", r) for r in range(setup.world_size)]
        setup.store.wait(keys, setup.timeout)
        mapped = all(setup.store.get(key) == b"1" for key in keys)
        if self._name is not None:  # every rank has mapped it, or will not: the name goes
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(shm_ring.SHM_DIR, self._name))
        if not mapped or len(links) != setup.world_size - 1:
            self._release()
            return None
        dirs = {peer: records[peer]["kinds"]["local"]["dir"] for peer in setup.peers}
        bells = {peer: open_doorbell(f"{folder}/board-bell") for peer, folder in dirs.items()}
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
