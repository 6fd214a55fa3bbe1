"""Link kinds as plug-ins: the registry that picks, for each pair of ranks, the kind of link
between them.

Each kind is one module (``local``: pipes and shared memory on one host; ``socket``: ZeroMQ
tcp or ipc) with one ``LinkKind`` class that says what a rank offers at rendezvous (a
structured record through the store), whether it can serve a pair given both ends' offers,
and how it connects (``base`` says how). ``KINDS`` orders them: for each pair the first
kind that serves it makes the link, and the reasons of every kind asked are kept for
``describe`` (``comm.describe()``, ``ringcomm env``). A new kind (a device link, a staged
one) is one module and one entry here.

Ranks that are threads of one process are connected by ``ringcomm.transport.inmemory``
without a store, so that kind is not in the registry.
"""

from __future__ import annotations

from .base import LinkKind, SetUp, Sockets, Verdict
from .local import LocalKind
from .socket import SocketKind

# Asked in this order for each pair: the first that serves it makes the link.
KINDS: tuple[type[LinkKind], ...] = (LocalKind, SocketKind)

__all__ = ["KINDS", "LinkKind", "LocalKind", "SetUp", "SocketKind", "Sockets",
           "Verdict"]
