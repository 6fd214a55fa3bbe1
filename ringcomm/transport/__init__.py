"""Links: ordered, checked point-to-point messages. They know nothing of algorithms.

``Transport`` (``base``) holds one ``Link`` per peer (``link``) and a control plane for aborts
and probes; it checks every header against what the op expects, whatever the link. Links:
``local_link`` (a named pipe + a shared-memory ring, ranks of one host), ``socket_link``
(ZeroMQ, tcp between hosts), ``inmemory`` (ranks that are threads of one process). The
transport of a real group is set up in ``zmq_transport``; ``header`` is the wire format;
``files`` keeps the file system clean.
"""

from .base import Transport
from .header import Header, OpKind
from .inmemory import InMemoryNetwork, InMemoryTransport
from .link import ControlPlane, Link, SendHandle, Wait

__all__ = ["ControlPlane", "Header", "InMemoryNetwork", "InMemoryTransport", "Link", "OpKind",
           "SendHandle", "Transport", "Wait"]
