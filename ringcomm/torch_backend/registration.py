"""How torch makes a ringcomm process group: the factory registered as backend "ringcomm".

torch calls ``_create`` with the group's rank, size, timeout and c10d store; every rank joins
a communicator through that store (``ringcomm.init``), so every init method torch has works.
Registration itself goes through ``ringcomm.torch_entry``, the light registrar torch's entry
point loads, which imports this only when a group is created.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch.distributed as dist

from ..bootstrap.rendezvous import _reachable_host, init
from ..bootstrap.store import TorchStore
from .process_group import RingcommProcessGroup

log = logging.getLogger("ringcomm")


def _store_address(store: Any) -> str | None:
    """``host:port`` of the TCPStore under torch's prefix stores, if it is one."""
    while store is not None:
        if isinstance(store, dist.TCPStore):
            return f"{store.host}:{store.port}"
        store = getattr(store, "underlying_store", None)
    return None


def _create(opts: Any, backend_options: Any = None) -> RingcommProcessGroup:
    """torch's factory hook: join the group through torch's store, return the group."""
    timeout = opts.timeout.total_seconds() if opts.timeout else 300.0
    address = _store_address(opts.store)
    comm = init(opts.group_rank, opts.group_size,
                store=TorchStore(opts.store, timeout=timeout), timeout=timeout,
                host=_reachable_host(address))
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        log.info(DETAIL_NOTE)
    return RingcommProcessGroup(comm)


# torch wraps gloo and nccl groups in a checking wrapper under DETAIL; it does not wrap a
# group implemented in Python, and ringcomm does not need it: its checks are always on
DETAIL_NOTE = (
    "TORCH_DISTRIBUTED_DEBUG=DETAIL: ringcomm checks what DETAIL checks for other backends on "
    "every op, always and at no extra cost: every message carries the op's descriptor "
    "(collective, sequence number, dtype, element count, reduce op, root, algorithm), and a "
    "rank that receives one that differs from its own raises DesyncError naming both ranks "
    "and the difference; a stalled op asks its peers which op they are in. No wrapper is "
    "added.")


def register() -> None:
    """Make ``"ringcomm"`` a ``torch.distributed`` backend (idempotent).

    Through ``ringcomm.torch_entry``, so every registration (import, entry point, this) installs
    the same light creator, which loads this module only when a group is created.
    """
    from ..torch_entry import register

    register()


def _autoload() -> None:
    """The old ``torch.backends`` entry point, kept for installs whose metadata still names it
    (reinstall to switch to ``ringcomm.torch_entry:_autoload``). Never raises."""
    from ..torch_entry import _autoload

    _autoload()
