"""Links: ordered, checked point-to-point messages. They know nothing of algorithms.

``Transport`` (``base``) holds one ``Link`` per peer (``link``) and a control plane for aborts
and probes; it checks every header against what the op expects, whatever the link. Links:
``local_link`` (a named pipe + a shared-memory ring, ranks of one host), ``socket_link``
(ZeroMQ, tcp between hosts), ``inmemory`` (ranks that are threads of one process). Which
kind links a pair is the registry's choice (``kinds``); the transport of a real group is set
up through the store in ``group``. The shared board of one host's ranks is a channel beside
the links (``board``, ``board_channel``, ``board_setup``). ``wrappers`` puts an observer in
front of every link and the board; ``header`` is the wire format; ``files`` keeps the file
system clean.
"""

from .base import Transport
from .header import Header, OpKind
from .inmemory import InMemoryNetwork, InMemoryTransport
from .link import ControlPlane, Link, SendHandle, Wait

__all__ = ["ControlPlane", "Header", "InMemoryNetwork", "InMemoryTransport", "Link", "OpKind",
           "SendHandle", "Transport", "Wait"]
