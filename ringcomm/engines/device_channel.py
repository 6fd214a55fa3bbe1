"""What a device engine needs of a channel: moving one message between two ranks' device
memory, ordered on the communicator's stream.

The device engine (``ringcomm.engines.device``) walks a schedule as the link engine does,
but its buffers are device memory and every copy and reduction is queued on the
communicator's stream; how a message's bytes reach the peer is the channel's:

- CUDA IPC (``ringcomm.engines.cuda_ipc``): ranks of one host map each other's persistent
  staging slots; only small notices (and credits, when a slot is free again) travel on
  the links; the receiver reduces straight from the peer's slot.
- host staging (``ringcomm.engines.staged``): device -> page-locked host memory -> the
  existing link (pipe, shared-memory ring, tcp) -> device, double-buffered so copies
  overlap the wire.

Every message still carries the op's header, so ranks that disagree get a ``DesyncError``
as on the links, and every wait runs against the op's deadline and watches the transport
for a lost peer or an abort.
"""

from __future__ import annotations

import abc
from typing import Protocol

from ..core.device.runtime import DeviceRuntime, Stream
from ..core.dtypes import ReduceOp
from ..transport.header import Header
from .context import OpContext


class Exchange(Protocol):
    """How a channel's set-up swaps small records (handles, pids) among the ranks of its
    group: through the store for processes, through a shared table for threads."""

    def publish(self, key: str, value: bytes) -> None:
        """Make ``value`` readable by every rank as this rank's ``key``."""

    def read(self, key: str, rank: int, deadline: float) -> bytes:
        """Rank ``rank``'s ``key`` once published (``CommTimeout`` past ``deadline``)."""


class DeviceChannel(abc.ABC):
    """Moves messages between this rank's device memory and its peers' (see the module
    docstring). Made once per group, at set-up; it reaches the peers through the group's
    transport, so wrappers in front of the links see its messages."""

    name = "device"  # the engine's name ("cuda-ipc", "staged")
    runtime: DeviceRuntime

    @abc.abstractmethod
    def send(self, peer: int, header: Header, src: int, nbytes: int, stream: Stream,
             ctx: OpContext) -> None:
        """Send message ``header`` (``nbytes`` at device pointer ``src``, as written by the
        work queued on ``stream`` so far) to ``peer``. May block the host for flow control
        (a ``CommTimeout`` naming the peer past ``ctx.deadline``). On return, work queued on
        ``stream`` afterwards may overwrite ``src``: the channel has ordered its reads of
        ``src`` before it."""

    @abc.abstractmethod
    def recv(self, peer: int, header: Header, dst: int, nbytes: int, stream: Stream,
             ctx: OpContext, *, reduce_with: int | None = None, op: ReduceOp | None = None,
             divide_by: int = 1) -> None:
        """Receive message ``header`` (``nbytes``) from ``peer`` into device pointer ``dst``,
        as work queued on ``stream``: a copy, or, with ``reduce_with``, ``dst = reduce_with
        (op) message`` followed by ``finish``'s division by ``divide_by`` where it is over 1.
        Returns once the work is queued; the channel keeps the message's memory until the
        stream has used it."""

    def finish(self, stream: Stream, ctx: OpContext) -> None:  # noqa: B027 - optional hook
        """This rank's last step of the op is queued: settle what the channel still owes
        (sends not yet out) before the op returns."""

    def close(self, *, failed: bool = False) -> None:  # noqa: B027 - optional hook
        """Give back device memory, mappings and host registrations, in the safe order.
        ``failed``: the group failed (its device work has settled all the same), so peers
        that may be stuck or gone are waited for briefly only."""

    def abandon(self) -> None:
        """After a failure, when device work on this channel's memory may never finish (it
        waits for a lost peer): let the peers go without freeing what that work uses. By
        default, ``close``."""
        self.close()

    def describe(self) -> str:
        return self.name
