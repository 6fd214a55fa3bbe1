"""The two ways a device channel's set-up swaps small records among its group's ranks
(``device_channel.Exchange``): through the group's store, for ranks that are processes,
and through a table in memory, for ranks that are threads of one process (``run_group``).

Why not the links: the records (IPC handles, pids) are needed while the channels are being
made, before any op, and the store is what the group's set-up already reads and writes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import CommTimeout, StoreError, StoreTimeout

__all__ = ["MemberExchange", "StoreExchange", "TableExchange", "Table"]


class StoreExchange:
    """Records under ``prefix`` in a store that has ``set``, ``wait`` and ``get`` (the
    group's, as ``ringcomm.init`` scoped it)."""

    def __init__(self, store: Any, prefix: str, rank: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank

    def _key(self, key: str, rank: int) -> str:
        return f"{self.prefix}/{key}/{rank}"

    def publish(self, key: str, value: bytes) -> None:
        self.store.set(self._key(key, self.rank), value)

    def read(self, key: str, rank: int, deadline: float) -> bytes:
        name = self._key(key, rank)
        try:
            self.store.wait([name], max(0.001, deadline - time.monotonic()))
            return bytes(self.store.get(name))
        except StoreTimeout:
            raise CommTimeout(f"rank {rank} never published its {key!r} for the device "
                              "channels' set-up: did it start with the same device settings?",
                              rank=self.rank, op="device set-up", peer=rank) from None
        except StoreError as err:
            raise CommTimeout(f"the store failed while reading rank {rank}'s {key!r} for the "
                              f"device channels' set-up: {err}", rank=self.rank,
                              op="device set-up", peer=rank) from None


class Table:
    """The records of one group of threads: shared by every rank's ``TableExchange``."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, int], bytes] = {}
        self.changed = threading.Condition()


class TableExchange:
    """Records in ``table``, shared by the ranks (threads) of one in-process group."""

    def __init__(self, table: Table, rank: int) -> None:
        self.table = table
        self.rank = rank

    def publish(self, key: str, value: bytes) -> None:
        table = self.table
        with table.changed:
            table.values[(key, self.rank)] = bytes(value)
            table.changed.notify_all()

    def read(self, key: str, rank: int, deadline: float) -> bytes:
        table = self.table
        with table.changed:
            while (key, rank) not in table.values:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeout(f"rank {rank} never published its {key!r} for the "
                                      "device channels' set-up", rank=self.rank,
                                      op="device set-up", peer=rank)
                table.changed.wait(left)
            return table.values[(key, rank)]


class MemberExchange:
    """The records of a subgroup (``Communicator.split``) through its parent group's
    exchange: keys under the subgroup's ``tag``, a member's rank in the subgroup mapped to
    its rank in the parent (``members``), so the subgroup's device channels are set up as
    the parent's were, and never read another subgroup's records."""

    def __init__(self, parent: Any, tag: str, members: tuple[int, ...]) -> None:
        self.parent = parent
        self.tag = tag
        self.members = members

    def publish(self, key: str, value: bytes) -> None:
        self.parent.publish(f"{self.tag}/{key}", value)

    def read(self, key: str, rank: int, deadline: float) -> bytes:
        return bytes(self.parent.read(f"{self.tag}/{key}", self.members[rank], deadline))
