"""Faults on purpose and checksums: the wrappers that inject faults where messages move
(``injector``) and that check every message and board post (``checksum``), and how a
test asks for them (``inject``).

Both change what goes on the wire, so both are must-match settings, agreed at init
(``RINGCOMM_FAULTS``, ``RINGCOMM_CHECKSUM``, or ``inject`` on every rank); a communicator
puts them in front of its links, board and engines from its agreed settings
(``wrappers_for``): the injector innermost, so a corruption comes after the checksum is
computed. A group with neither has nothing in its path. The spec's grammar is
``ringcomm.core.fault_spec``; docs/faults.md has the reference.
"""

from __future__ import annotations

from types import TracebackType

from ..core import fault_spec
from ..core.fault_spec import FaultRule, FaultSpec
from ..engines.wrapping import Wrapper
from ..errors import ArgumentError
from ..transport.base import Transport
from .checksum import ChecksumWrapper
from .injector import FaultWrapper

__all__ = ["ChecksumWrapper", "FaultRule", "FaultSpec", "FaultWrapper", "inject",
           "wrappers_for"]


class inject:  # noqa: N801 - used as a function and a context manager, like open()
    """Inject the faults of ``spec`` (``"kill:rank=1,op=allreduce,call=2"``, the grammar of
    ``RINGCOMM_FAULTS``; None: none) into every communicator made while this holds, instead
    of what ``RINGCOMM_FAULTS`` says; ``checksum`` (if not None) likewise overrides
    ``RINGCOMM_CHECKSUM``. A spec that cannot be read is an ``ArgumentError`` here.

    Every rank of a group must inject the same (it is agreed at init like the variables):
    in a group of threads (``ringcomm.runtime.local.run_group``) one ``inject`` serves
    them all; in a job of processes each rank calls it before ``ringcomm.init`` (or
    ``torch.distributed.init_process_group``), or the launcher sets ``RINGCOMM_FAULTS``
    for all of them.

    Example::

        with ringcomm.faults.inject("drop:rank=1,op=allreduce,call=2", checksum=True):
            comm = ringcomm.init(timeout=5)

        @pytest.fixture
        def corrupted():
            with ringcomm.faults.inject("corrupt:rank=0,op=broadcast", checksum=True) as spec:
                yield spec
    """

    def __init__(self, spec: str | FaultSpec | None, *, checksum: bool | None = None) -> None:
        if isinstance(spec, str):
            try:
                spec = fault_spec.parse(spec)
            except ValueError as err:
                raise ArgumentError(f"fault spec {spec!r} {err}") from None
        elif spec is not None and not isinstance(spec, FaultSpec):
            raise ArgumentError(f"inject takes a fault spec (a string), got "
                                f"{type(spec).__name__}")
        if checksum is not None and not isinstance(checksum, bool):
            raise ArgumentError(f"checksum must be True, False or None, got {checksum!r}")
        self.spec = spec
        self.checksum = checksum
        self._held = False

    def __enter__(self) -> FaultSpec | None:
        fault_spec.push(self.spec, self.checksum)
        self._held = True
        return self.spec

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._held:
            self._held = False
            fault_spec.pop()


def wrappers_for(faults: FaultSpec | None, checksum: bool, transport: Transport, *,
                 live: bool = True) -> list[Wrapper]:
    """The wrappers a communicator over ``transport`` puts in first (innermost first) for
    its agreed ``faults`` and ``checksum``: none where both are off. The injector counts ops
    once ``live`` (else from its ``start``)."""
    wrappers: list[Wrapper] = []
    if faults:
        wrappers.append(FaultWrapper(faults, transport.rank, transport.world_size,
                                     transport.die, live=live))
    if checksum:
        wrappers.append(ChecksumWrapper())
    return wrappers
