"""What every engine that maps its peers' device memory with CUDA IPC shares: this
process's table of its own exports (a peer in the same process may not open a handle of
its own process, so it takes the pointer from here), what a close had to leave to the
process's exit, whether a peer's process still runs, and the wait, at close, until every
peer that maps this rank's memory says it has closed its mapping.

Why the order matters: freeing memory a living peer still maps is undefined on a GPU
(``cudaIpcOpenMemHandle``'s documentation), so an exporter frees only after every importer
has said "closed" through the group's exchange, or is gone. Used by ``cuda_ipc``'s slots
and the kernel path's regions (``kernel``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any

from ..errors import CommError
from .device_channel import Exchange

log = logging.getLogger("ringcomm")

SAY_WAITING_AFTER_S = 5.0  # a close that waits longer for a peer's "closed" says so
AFTER_FAILURE_S = 2.0  # how long a failed group's close waits for its peers' "closed"


class Exports:
    """This process's exported memory and events by handle, for peers in this same process
    (which may not open them): set before the handles are published, cleared at free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._table: dict[bytes, Any] = {}

    def add(self, handle: bytes, thing: Any) -> None:
        with self._lock:
            self._table[handle] = thing

    def get(self, handle: bytes) -> Any:
        with self._lock:
            return self._table[handle]

    def drop(self, handles: list[bytes]) -> None:
        with self._lock:
            for handle in handles:
                self._table.pop(handle, None)


EXPORTS = Exports()
# what a close could not give back safely (a living peer still maps it): kept referenced so
# that nothing destroys it before the process exits, when the driver takes all of it back
LEFT_FOR_EXIT: list[Any] = []


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def await_closed(exchange: Exchange, key: str, rank: int, pids: dict[int, int],
                 deadline: float, what: str) -> list[int]:
    """Wait until every peer in ``pids`` (rank -> pid: the peers that read this rank's
    handles) has published ``key`` ("closed"), or is gone, or ``deadline`` has passed; the
    peers of other processes still running that have not said it (a peer of this process
    maps nothing: it is freed from under it, as the process's exit would). ``what`` names
    the memory in the warning a long wait logs."""
    mapping = []
    said = time.monotonic() + SAY_WAITING_AFTER_S
    for peer, pid in pids.items():
        while True:
            try:
                exchange.read(key, peer, min(deadline, time.monotonic() + 0.05))
                break
            except (TimeoutError, CommError):  # a timeout, or the store is gone
                if not alive(pid):
                    break
                now = time.monotonic()
                if now >= deadline:
                    if pid != os.getpid():
                        mapping.append(peer)
                    break
                if now >= said:
                    said = math.inf
                    log.warning("rank %d waits for rank %d to close its mappings of rank "
                                "%d's %s (up to %.0f s more; freeing them first would be "
                                "undefined on a GPU)", rank, peer, rank, what,
                                deadline - now)
    return mapping


def close_in_order(exchange: Exchange, key: str, rank: int, pids: dict[int, int],
                   wait_s: float, what: str) -> bool:
    """This rank's half of a close in the safe order, after it closed what it opened of its
    peers': say so (``key``), then wait up to ``wait_s`` for every peer in ``pids`` that
    maps this rank's ``what`` to say the same, or be gone. Whether this rank may free it
    now; where not (a living peer still maps it), the warning is logged and the caller
    keeps it to the process's exit."""
    try:
        exchange.publish(key, b"1")
    except Exception as err:  # noqa: BLE001 - the store may be gone with the group
        log.warning("rank %d could not say its mappings of its peers' %s are closed: %s",
                    rank, what, err)
    mapping = await_closed(exchange, key, rank, pids, time.monotonic() + wait_s, what)
    if mapping:  # freeing what a living peer maps is undefined on a GPU: never do it
        log.warning("rank %d leaves its %s for the process's exit to give back: rank(s) %s, "
                    "still running, did not say within %g s that they closed their mappings "
                    "of them", rank, what, ", ".join(map(str, mapping)), wait_s)
    return not mapping
