"""The one hook through which a wrapper reaches every link, the board and every engine.

A ``Wrapper`` is asked once for each of a group's links (``link``), for its board channel
(``board``) and for each of its engines (``engine``), and returns what stands in their place:
the object itself, or one of the stand-ins of ``ringcomm.transport.wrappers`` and
``ringcomm.engines.base.EngineWrapper`` in front of it. So a tracer, a fault injector and a
checksum are each one small class that sees every message of every collective, the board's
posts and point-to-point included, and every op of every engine.

A communicator installs the wrappers it is given when it is made (``ringcomm.init`` adds the
timeline ``RINGCOMM_TRACE`` asks for), and a context (``comm.wrapped``, ``comm.tracing``)
may install one for a while and take it out again, on the worker between two ops;
``Wiring`` holds the objects as they were, so taking wrappers out restores them exactly. A
wrapper that changes what goes on the wire (faults, checksums) must be the same on every
rank: the setting that asks for it belongs to the must-match or agreed class of the table
of settings (``ringcomm.core.config``), so the ranks settle it at init. One that only
watches (a timeline) may differ from rank to rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..transport.base import Transport
from ..transport.board_channel import BoardChannel
from ..transport.link import Link
from .base import Engine
from .board import BoardEngine
from .device import DeviceEngine, DeviceLane
from .kernel import KernelChannel, KernelEngine
from .links import LinkEngine
from .nccl import NcclChannel, NcclEngine


class Wrapper:
    """Puts something in front of a group's links, board and engines; by default nothing."""

    name = "wrapper"

    def link(self, link: Link) -> Link:
        return link

    def board(self, channel: BoardChannel) -> BoardChannel:
        return channel

    def engine(self, engine: Engine) -> Engine:
        return engine


@dataclass
class Wiring:
    """A group's links, board channel and engines as made (``bare_*``), and as the installed
    wrappers stand in front of them. Engines are made over the wrapped links and board, so
    whatever an engine sends goes through every wrapper. The device lanes (a device channel
    with its stream and scratch: ``DeviceLane``) are made once at set-up, since they own
    device memory; the device engines over them are made here like the others, and their
    channels reach the peers through the wrapped links."""

    transport: Transport
    bare_links: list[Link | None]
    bare_board: BoardChannel | None
    wrappers: list[Wrapper] = field(default_factory=list)
    board: BoardChannel | None = None
    engines: dict[str, Engine] = field(default_factory=dict)
    lanes: dict[str, DeviceLane] = field(default_factory=dict)

    @classmethod
    def of(cls, transport: Transport, board: BoardChannel | None,
           wrappers: Sequence[Wrapper] = (),
           lanes: dict[str, DeviceLane] | None = None) -> Wiring:
        wiring = cls(transport, list(transport.links), board, list(wrappers),
                     lanes=dict(lanes or {}))
        wiring._wire()
        return wiring

    def install(self, wrapper: Wrapper) -> None:
        """Put ``wrapper`` in front of everything, outermost (only between ops)."""
        self.wrappers.append(wrapper)
        self._wire()

    def remove(self, wrapper: Wrapper) -> None:
        """Take ``wrapper`` out again (only between ops)."""
        self.wrappers.remove(wrapper)
        self._wire()

    def _wire(self) -> None:
        links = list(self.bare_links)
        board = self.bare_board
        for wrapper in self.wrappers:
            links = [None if link is None else wrapper.link(link) for link in links]
            board = None if board is None else wrapper.board(board)
        self.transport.links = links
        self.board = board
        engines: dict[str, Engine] = {"links": LinkEngine(self.transport)}
        if board is not None:
            engines["board"] = BoardEngine(board)
        for name, lane in self.lanes.items():
            if isinstance(lane.channel, NcclChannel):
                engines[name] = NcclEngine(lane, self.transport)
            elif isinstance(lane.channel, KernelChannel):
                engines[name] = KernelEngine(lane, self.transport)
            else:
                engines[name] = DeviceEngine(lane, self.transport.rank,
                                             self.transport.world_size)
        for wrapper in self.wrappers:
            engines = {name: wrapper.engine(engine) for name, engine in engines.items()}
        self.engines = engines
