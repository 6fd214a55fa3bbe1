"""Channels: ordered, checked point-to-point messages. They know nothing of algorithms."""

from .base import SendHandle, Transport
from .header import Header, OpKind
from .inmemory import InMemoryNetwork, InMemoryTransport

__all__ = ["Header", "InMemoryNetwork", "InMemoryTransport", "OpKind", "SendHandle", "Transport"]
