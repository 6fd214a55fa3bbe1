"""The communicator: the public object. It checks a call's arguments on the caller's thread,
asks the selector how to run it, and hands it to its runner.

A communicator is three things joined: the wiring of its group (links, board, engines, and
whatever wrappers stand in front of them: ``ringcomm.engines.wrapping``), one place that
decides how each call runs (``ringcomm.plan.select``) and the runner that runs its ops in
issue order (``ops``). What is here is the API, the checks of every argument, and the
lifecycle: arguments are checked before anything is queued, so a mistake raises at the
call, naming this rank and the op.

Point-to-point ops never hold the worker (``p2p``): two ranks that each post a receive
before their send (``batch_isend_irecv`` does) cannot deadlock, and ``recv(x, src=None)``
takes the first message from any rank. Messages between two ranks match in the order they
were sent; tags must agree (a mismatch is a ``DesyncError``, not a silent reorder).

Failure contract: an op that fails raises a typed ``CommError`` naming this rank and the op;
before raising, the rank tells every peer (``abort``), so that they raise too instead of
waiting out their timeout. A communicator that has failed stays failed (``CommAborted``):
ranks cannot tell how far their peers got, so the only safe next step is a new one.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from ..core import config
from ..core import tensors as _tensors  # also registers the kind of CUDA tensors
from ..core.algorithms import DEVICE_ENGINES
from ..core.arrays import (
    HOST,
    HOST_ONLY,
    IN_FLIGHT,
    Buffer,
    Concatenated,
    HostBuffer,
    as_buffer,
)
from ..core.config import DEFAULT_INLINE_BYTES
from ..core.device.nccl import nccl_takes
from ..core.dtypes import dtype_name, reduce_op
from ..engines.base import Engine
from ..engines.device_channel import Exchange
from ..engines.exchange import MemberExchange
from ..engines.wrapping import Wiring, Wrapper
from ..errors import ArgumentError, CommAborted, DesyncError
from ..faults import FaultWrapper, wrappers_for
from ..observe.clock import over_links
from ..observe.timeline import Clock, Timeline
from ..plan.collectives import COLLECTIVES
from ..plan.select import Choice, Group, Selector
from ..plan.settings import Settings
from ..plan.topology import Topology
from ..transport.base import Transport
from ..transport.group import GroupTransport
from ..transport.header import OpKind
from ..transport.kinds import KINDS
from . import devices, registration
from .hang_report import ReportStore
from .ops import CollectiveCall, OpRunner
from .p2p import P2POp
from .registration import Registration

log = logging.getLogger("ringcomm")
_ALLREDUCE = COLLECTIVES["allreduce"]
CLOSED_DURING_OP = ("the communicator was closed (close() on another thread) while this op "
                    "ran: closing in the middle of an op aborts it")


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _names_bad_input(
        method: Callable[Concatenate[Communicator, _P], _R]
) -> Callable[Concatenate[Communicator, _P], _R]:
    """Argument errors raised while checking a call name this rank and the op, like every
    other error of a running collective. Typed with a ParamSpec, so the wrapped method keeps
    its signature for IDEs and type checkers."""

    @functools.wraps(method)
    def checked(self: Communicator, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except ArgumentError as err:
            raise _named(err, self.rank, method.__name__) from None

    return checked


def _named(err: ArgumentError, rank: int, op: str) -> ArgumentError:
    """``err`` naming ``rank`` and ``op``, unless it names an op already."""
    return err if err.op is not None else ArgumentError(err.detail, rank=rank, op=op,
                                                        peer=err.peer)


class Communicator:
    """A group of ``world_size`` ranks, seen from ``rank``, over a ``Transport``.

    Build one with ``ringcomm.init``, which does the rendezvous and hands it the
    ``settings`` and the ``topology`` that every rank agreed on there. Groups inside one
    process (tests, ``ringcomm.runtime.local``) build them directly over in-memory transports,
    where every rank reads the same environment; ``segment_bytes`` overrides the agreed
    segment size (every rank must pass the same). ``store`` (the group's, as ``init`` passes
    it) is where rank 0 gathers the hang report of an op that times out
    (``ringcomm.runtime.hang_report``); without one each rank logs its own state only.
    ``store_done`` is called once in close, as soon as this rank has made its last use of
    the group's store (the device lanes are closed), before the links close; ``on_close``
    after everything else (``init`` says in the first that the rank leaves the store, and
    closes it in the second).

    Arrays may be numpy arrays or torch CPU tensors, used in place, or of any kind
    registered in ``ringcomm.core.arrays``. Where the settings name a device runtime
    (``device``), the group gets device engines over channels made here once (``devices``;
    ``exchange`` swaps their handles among the ranks: without one, only host staging), and
    that runtime's arrays are reduced on the device; other device arrays are staged through
    host memory.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        timeout: float = 300.0,
        settings: Settings | None = None,
        topology: Topology | None = None,
        segment_bytes: int | None = None,
        on_close: Sequence[Callable[[], None]] = (),
        store_done: Callable[[], None] | None = None,
        connect: Callable[[tuple[int, ...], str], Transport] | None = None,
        wrappers: Sequence[Wrapper] = (),
        store: ReportStore | None = None,
        faults_live: bool = True,
        exchange: Exchange | None = None,
    ) -> None:
        settings = settings or Settings.local(segment_bytes=segment_bytes)
        if segment_bytes is None:
            segment_bytes = settings.segment_bytes
        self.transport = transport
        self._check_segment(segment_bytes)
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.settings = settings
        self.topology = topology or Topology.single_host(self.world_size)
        self.timeout = float(timeout)
        self._segment_bytes = int(segment_bytes)
        self._on_close = list(on_close)
        self._store_done = store_done
        self._connect = connect  # (member ranks, tag) -> this rank's transport among them
        self._exchange = exchange  # how subgroups' device channels swap their records too
        self._split_numbers = itertools.count()
        self._p2p_sent = [0] * self.world_size
        self._closed = False
        self._close_lock = threading.Lock()
        self._write_timeline: weakref.finalize[..., Any] | None = None
        # the device runtime the ranks agreed on, and its channels (made once: they own
        # device memory); ``exchange`` swaps their handles (without one: staging only)
        self.device = devices.device_runtime(settings)
        lanes = {} if self.device is None else devices.open_lanes(
            self.device, transport, exchange, self.topology, settings, self._segment_bytes,
            self.timeout)
        # the agreed faults and checksum first (innermost), then the caller's wrappers
        self.wiring = Wiring.of(transport, transport.board, [
            *wrappers_for(settings.faults, settings.checksum, transport, live=faults_live),
            *wrappers], lanes)
        self.selector = self._selector()
        self._ops = OpRunner(transport, self.wiring, self.selector, self.topology,
                             self.timeout, inline_bytes(self.topology.spare_core(self.rank)),
                             store)
        self._views = _tensors.HostViews()  # of CPU tensors, for blocking allreduces

    def start_faults(self) -> None:
        """Count ops for the injected faults from here on (a communicator made with
        ``faults_live=False``: ``ringcomm.init`` and ``split`` call this once their own
        set-up ops are done, so a fault's ``call=1`` is the program's first call)."""
        for wrapper in self.wiring.wrappers:
            if isinstance(wrapper, FaultWrapper):
                wrapper.start()

    def _selector(self) -> Selector:
        lanes = self.wiring.lanes
        return Selector(Group(self.world_size, self.transport.board is not None,
                              self.settings, self.topology, self._segment_bytes,
                              tuple(n for n in DEVICE_ENGINES if n in lanes),
                              None if self.device is None else self.device.memory,
                              devices.kernel_verdict(self.device, self.topology,
                                                     self.settings, lanes)))

    def adopt(self, settings: Settings) -> None:
        """Run with ``settings`` from now on: every rank must adopt the same at the same
        point (as ``ringcomm.bootstrap.link_probe`` does at init), since choices follow from
        them."""
        self.settings = settings
        self._choose_afresh()

    @property
    def segment_bytes(self) -> int:
        """Bytes per message segment, as the ranks agreed (every rank must run the same)."""
        return self._segment_bytes

    @segment_bytes.setter
    def segment_bytes(self, value: int) -> None:
        self._check_segment(value)
        self._segment_bytes = int(value)
        self._choose_afresh()

    def _check_segment(self, value: int) -> None:
        if value <= 0:
            raise ArgumentError(f"segment_bytes must be positive, got {value}")
        limit = self.transport.max_segment_bytes
        if limit is not None and value > limit:
            raise ArgumentError(
                f"segment_bytes={value} is larger than this communicator's links admit "
                f"({limit} B, set at init from the agreed segment): make the communicator "
                f"with ringcomm.init(segment_bytes={value}) instead",
                rank=self.transport.rank)

    def _choose_afresh(self) -> None:
        self.selector = self._ops.selector = self._selector()
        self._ops.segment_bytes = self._segment_bytes
        self._ops.forget_plans()

    @property
    def engines(self) -> dict[str, Engine]:
        """The engines this group runs ops on, by name (``links``; ``board`` where its ranks
        share one), as the installed wrappers stand in front of them."""
        return self.wiring.engines

    @property
    def inline_bytes(self) -> int:
        """Async collectives up to this many bytes per buffer run on the caller's thread
        when nothing is queued (``RINGCOMM_INLINE_BYTES``)."""
        return self._ops.inline_bytes

    @inline_bytes.setter
    def inline_bytes(self, value: int) -> None:
        self._ops.inline_bytes = value

    @property
    def idle(self) -> bool:
        """Whether nothing is queued or in flight here (see ``OpRunner.idle``)."""
        return self._ops.idle

    def choose(self, collective: str, size: Any, itemsize: int = 4, *,
               algorithm: str | None = None, memory: str = HOST,
               op: str | None = None) -> Choice:
        """How this communicator runs ``collective`` on ``size``: a number of bytes (of
        ``itemsize``-byte elements, in ``memory``: host, or a device runtime's,
        ``comm.device.memory``), or the array or tensor itself (a CUDA tensor, a CuPy
        array, a numpy array: its bytes, element size and memory are read from it). The
        engine, algorithm, segment size, and why; the selector's choice, the same on every
        rank. Given the array, ``op`` names the reduction (as the collective would take it):
        on the nccl engine, NCCL's own call does not take every dtype and reduction.

        Example::

            comm.choose("allreduce", torch.ones(1024, device="cuda")).engine  # "cuda-ipc"
        """
        native = True
        if not isinstance(size, (int, np.integer)):
            data = as_buffer(size, name="x", reads=False)
            size, itemsize, memory = data.nbytes, data.dtype.itemsize, data.memory
            native = memory is HOST or nccl_takes(
                data.dtype, None if op is None else reduce_op(op, data.dtype).name)
        return self.selector.choose(collective, int(size), itemsize, memory=memory,
                                    forced=algorithm, native=native)

    def describe(self) -> str:
        """How this rank reaches its peers (the kind of each link, and why), the engines
        the group runs ops on, and the wrappers in front of them: for people."""
        lines = [f"rank {self.rank} of {self.world_size}"]
        if isinstance(self.transport, GroupTransport):  # linked through the registry
            lines[0] += ": link kinds, in the order asked: " + ", ".join(k.name for k in KINDS)
        lines += [self.transport.describe(),
                 "engines: " + "; ".join(f"{name}: {engine.describe()}"
                                         for name, engine in self.engines.items())]
        if self.device is not None:
            about = ", ".join(f"{k} {v}" for k, v in self.device.describe().items())
            lines.append(f"device: {self.settings.device} ({self.device.name} runtime: "
                         f"{about})")
            sharing = self.topology.gpu_sharing()
            if sharing:
                lines.append(f"gpus: {sharing}")
            kernel = self.selector.group.kernel
            if kernel is not None:
                lines.append(f"kernel path (cuda-kernel, device allreduce): "
                             f"{'yes' if kernel.ok else 'no'}: {kernel.why}")
        if self.wiring.wrappers:
            lines.append("wrappers: " + ", ".join(w.name for w in self.wiring.wrappers))
        return "\n".join(lines)

    @contextmanager
    def tracing(self, folder: str | os.PathLike[str]) -> Iterator[Timeline]:
        """Record this rank's timeline for the body of a ``with`` and write it to
        ``folder/rank<r>.json`` at its end, also when the body raises (``ringcomm trace merge
        folder`` puts the ranks together). Every rank enters it together, like a
        collective: it measures this rank's clock against rank 0's over the links first.

        Example::

            with comm.tracing("traces"):
                comm.allreduce(x)
        """
        clock = over_links(self)
        timeline = Timeline(self.rank, self.world_size, folder, config.value("trace_events"),
                            clock)
        try:
            with self.wrapped(timeline):
                yield timeline
        finally:
            timeline.write()

    def keep_timeline(self, folder: str | os.PathLike[str], clock: Clock) -> Timeline:
        """Record this rank's timeline from now on (``RINGCOMM_TRACE``,
        ``ringcomm.init(trace=)``): written to ``folder/rank<r>.json`` when the communicator
        closes, or when the program exits without closing it."""
        timeline = Timeline(self.rank, self.world_size, folder, config.value("trace_events"),
                            clock)
        self._rewire(self.wiring.install, timeline)
        self._write_timeline = weakref.finalize(self, timeline.write)
        return timeline

    @contextmanager
    def wrapped(self, wrapper: Wrapper) -> Iterator[Wrapper]:
        """Put ``wrapper`` in front of every link, the board and every engine for the body
        of a ``with`` (this rank only: one that changes the wire must be put in on every
        rank between the same two ops). It goes in once every op issued before has finished,
        and out once every op issued in the body has."""
        self._rewire(self.wiring.install, wrapper)
        try:
            yield wrapper
        finally:
            self._rewire(self.wiring.remove, wrapper)

    def _rewire(self, change: Callable[[Wrapper], None], wrapper: Wrapper) -> None:
        """Put a wrapper in or take it out between two ops, on the worker, where no message
        is half read; the plans of the fast entry name the engines, so they go too."""
        def rewire() -> None:
            change(wrapper)
            self._ops.forget_plans()

        self._ops.between_ops(rewire)

    @property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each host, hosts in the order of their lowest rank: gathered from
        every rank at init, the same on every rank."""
        return self.topology.hosts

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks that share this rank's host (this one included)."""
        return next(h for h in self.topology.hosts if self.rank in h)

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A communicator of the ranks that pass the same ``color`` (every rank calls this,
        as with ``MPI_Comm_split``), ranked by ``key`` (default: this rank), then by rank;
        ``color=None`` takes no part and gets None. The new one has its own links, so
        its ops never mix with this one's; close it before this one.

        Example::

            local = comm.split(comm.hosts.index(comm.local_ranks))  # one per host
        """
        if self._connect is None:
            raise ArgumentError("this communicator was built without a way to connect "
                                "subgroups (build it with ringcomm.init or run_group)",
                                rank=self.rank, op="split")
        for value, what in ((color, "color"), (key, "key")):
            if value is not None and (not isinstance(value, (int, np.integer)) or
                                      isinstance(value, bool) or value < 0):
                raise ArgumentError(f"{what} must be a non-negative int or None, got "
                                    f"{value!r}", rank=self.rank, op="split")
        mine = np.array([-1 if color is None else color,
                         self.rank if key is None else key], np.int64)
        everyone = np.empty(2 * self.world_size, np.int64)
        self.allgather(everyone, mine)
        number = next(self._split_numbers)
        if color is None:
            return None
        pairs = everyone.reshape(-1, 2)
        members = tuple(sorted((r for r in range(self.world_size) if pairs[r][0] == color),
                               key=lambda r: (pairs[r][1], r)))
        tag = f"split{number}/{color}"
        transport = self._connect(members, tag)
        exchange = None if self._exchange is None else MemberExchange(self._exchange, tag,
                                                                      members)
        sub = Communicator(transport, timeout=self.timeout, settings=self.settings,
                           topology=Topology(tuple(self.topology.ranks[r] for r in members)),
                           segment_bytes=self.segment_bytes, connect=None, faults_live=False,
                           exchange=exchange)
        sub.barrier()  # every member is connected
        sub.start_faults()
        return sub

    def register(self, x: Any) -> Registration:
        """Register device array ``x`` with the group, so the kernel path's allreduces (its
        two-shot), reduce-scatters and all-gathers run on it where it lies, without a copy,
        whenever every rank's buffer of an op lies in a registration. Collective: every rank
        registers its array at the same point, in the same order. The registration holds
        ``x`` (its memory is neither freed nor handed out again) until its ``deregister``,
        which every rank also calls at the same point, or ``close``. Costs one CUDA IPC
        export of the allocation holding ``x`` (once per allocation), two rounds through the
        store and one open of each peer's allocation (once per allocation); refused, with the
        reason, for host memory, another device's, or memory without an IPC handle (torch's
        expandable segments). Where the group has no kernel path it holds nothing and says
        why (``Registration.why``). ``ringcomm.engines.registered`` tells how it works.

        Example::

            with comm.register(bucket):      # every rank, once
                for step in range(steps):
                    comm.allreduce(bucket)   # in place, no copy
        """
        try:
            return registration.register(
                x, lanes=self.wiring.lanes, kernel=self.selector.group.kernel,
                device=self.device, between_ops=self._ops.between_ops, timeout=self.timeout)
        except ArgumentError as err:
            raise _named(err, self.rank, "register") from None

    # ------------------------------------------------------------------ collectives
    def allreduce(self, x: Any, op: str = "sum", *, algorithm: str | None = None,
                  async_op: bool = False) -> Any:
        """Reduce ``x`` across ranks, in place; every rank gets the result. Returns ``x``.

        ``algorithm`` (one of the registry's allreduce algorithms over links,
        ``ringcomm.core.algorithms``, or on the shared board ``board`` and ``twoshot``)
        forces one for this call, as ``RINGCOMM_ALGO`` (which must be the same on every
        rank) does for all. By default the selector chooses (``ringcomm.plan.select``): a
        group whose ranks share one host runs every allreduce on the shared board, any other
        group the cost model's cheapest algorithm over links. The choice is a function of
        the size, the dtype, the board that all ranks set up together, the settings agreed
        at init and the table of every rank's host and cores, so it is the same on every
        rank; a forced one that differs between ranks is caught at the first message or
        post.
        """
        try:  # argument errors named as ``_names_bad_input`` names them, without its call
            if algorithm is None and not async_op and type(x) is not np.ndarray:
                # a CPU tensor, for a call that runs here or not at all: viewed once
                view = self._views.tensor(x)
                if view is not None and self._ops.allreduce_now(view, op):
                    return x
            data = as_buffer(x, name="x")
            if algorithm is None and not async_op and self._ops.allreduce_now(data, op):
                return x
            rop = reduce_op(op, data.dtype)
            choice = self.selector.choose("allreduce", data.nbytes, data.dtype.itemsize,
                                          memory=data.memory, forced=algorithm,
                                          native=data.memory is HOST
                                          or nccl_takes(data.dtype, rop.name))
            return self._ops.submit(CollectiveCall(
                _ALLREDUCE, data.dtype, {"data": data}, x, choice, data.memory, rop,
                count=data.count), async_op)
        except ArgumentError as err:
            raise _named(err, self.rank, "allreduce") from None

    def allreduce_now(self, x: Any, op: str = "sum") -> bool:
        """``allreduce(x, op)`` if it can run on this thread from start to end at once (the
        engine's fast entry: a group on one host's board, nothing queued); else False,
        having done nothing. For a caller lending memory only for the call: a view that
        keeps nothing alive must not reach an op that might outlive it."""
        try:
            return self._ops.allreduce_now(as_buffer(x, name="x"), op)
        except ArgumentError as err:
            raise _named(err, self.rank, "allreduce_now") from None

    def allreduce_now_on(self, buffer: HostBuffer, op: str = "sum") -> bool:
        """``allreduce_now`` on a buffer the caller made and checked (a layer above: the
        torch backend's view of a tensor), without asking which kind ``x`` is."""
        try:
            return self._ops.allreduce_now(buffer, op)
        except ArgumentError as err:
            raise _named(err, self.rank, "allreduce_now") from None

    def allreduce_algorithm(self, nbytes: int, itemsize: int = 4,
                            forced: str | None = None) -> str:
        """The allreduce algorithm this communicator runs for ``nbytes`` of ``itemsize``-byte
        elements (``choose`` says which engine runs it, and why)."""
        return self.selector.choose("allreduce", nbytes, itemsize, forced=forced).algorithm

    @_names_bad_input
    def broadcast(self, x: Any, root: int = 0, *, algorithm: str | None = None,
                  async_op: bool = False) -> Any:
        """Copy root's ``x`` into ``x`` on every rank. Returns ``x``. ``algorithm``
        (``chain``, ``binomial``, or on the shared board ``board``) forces one for this call,
        and must be the same on every rank."""
        self._check_rank(root, "root")
        data = as_buffer(x, name="x", reads=self.rank == root)
        return self._collective("broadcast", {"data": data}, x, data.nbytes, async_op,
                                arg=root, count=data.count, forced=algorithm)

    @_names_bad_input
    def reduce(self, x: Any, root: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce ``x`` across ranks into root's ``x``; other ranks' ``x`` is left unchanged."""
        data = as_buffer(x, name="x")
        self._check_rank(root, "root")
        rop = reduce_op(op, data.dtype)
        return self._collective("reduce", {"data": data}, x, data.nbytes, async_op, rop,
                                arg=root, count=data.count)

    @_names_bad_input
    def allgather(self, out: Any, x: Any, *, async_op: bool = False) -> Any:
        """Concatenate every rank's ``x`` (rank order) into ``out`` on every rank."""
        data = as_buffer(x, name="x", writable=False)
        result = as_buffer(out, name="out", reads=False)
        self._check_same_dtype(result, data, "out", "x")
        self._check_size(result, data.count * self.world_size, "out", "world_size * x.size")
        return self._collective("allgather", {"input": data, "output": result}, out,
                                data.nbytes, async_op, count=data.count)

    @_names_bad_input
    def reduce_scatter(self, out: Any, x: Any, op: str = "sum", *,
                       async_op: bool = False) -> Any:
        """Reduce ``x`` (``world_size`` equal blocks) across ranks; rank ``r`` gets block ``r``."""
        data = as_buffer(x, name="x", writable=False)
        result = as_buffer(out, name="out", reads=False)
        self._check_same_dtype(result, data, "out", "x")
        self._check_size(data, result.count * self.world_size, "x", "world_size * out.size")
        rop = reduce_op(op, data.dtype)
        return self._collective("reduce_scatter", {"input": data, "output": result}, out,
                                data.nbytes, async_op, rop, count=result.count)

    @_names_bad_input
    def gather(self, out: Any | None, x: Any, root: int = 0, *, async_op: bool = False) -> Any:
        """Concatenate every rank's ``x`` into root's ``out``; ``out`` is ignored elsewhere."""
        self._check_rank(root, "root")
        data = as_buffer(x, name="x", writable=False)
        buffers: dict[str, Buffer] = {"input": data}
        if self.rank == root:
            if out is None:
                raise ArgumentError("the root must pass `out` for the result")
            result = as_buffer(out, name="out", reads=False)
            self._check_same_dtype(result, data, "out", "x")
            self._check_size(result, data.count * self.world_size, "out", "world_size * x.size")
            buffers["output"] = result
        return self._collective("gather", buffers, out, data.nbytes, async_op, arg=root,
                                count=data.count)

    @_names_bad_input
    def scatter(self, x: Any, inputs: Any | None = None, root: int = 0, *,
                async_op: bool = False) -> Any:
        """Root's ``inputs`` (one array of ``world_size`` blocks, or a list of them) is cut
        into blocks; rank ``r`` receives block ``r`` into ``x``."""
        self._check_rank(root, "root")
        result = as_buffer(x, name="x", reads=False)
        buffers: dict[str, Buffer] = {"output": result}
        if self.rank == root:
            if inputs is None:
                raise ArgumentError("the root must pass `inputs`")
            if isinstance(inputs, (list, tuple)):
                if len(inputs) != self.world_size:
                    raise ArgumentError(
                        f"{len(inputs)} inputs for a world of {self.world_size}: pass one per rank")
                parts = [as_buffer(t, name=f"inputs[{i}]", writable=False)
                         for i, t in enumerate(inputs)]
                for i, part in enumerate(parts):
                    self._check_same_dtype(part, result, f"inputs[{i}]", "x")
                    self._check_size(part, result.count, f"inputs[{i}]", "x.size")
                source: Buffer = Concatenated(parts, "inputs")
            else:
                source = as_buffer(inputs, name="inputs", writable=False)
                self._check_same_dtype(source, result, "inputs", "x")
                self._check_size(source, result.count * self.world_size, "inputs",
                                 "world_size * x.size")
            buffers["input"] = source
        return self._collective("scatter", buffers, x, result.nbytes, async_op, arg=root,
                                count=result.count)

    @_names_bad_input
    def alltoall(
        self,
        out: Any,
        x: Any,
        *,
        out_splits: Sequence[int] | None = None,
        in_splits: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Any:
        """Block ``i`` of ``x`` goes to rank ``i``; block ``j`` of ``out`` comes from rank ``j``.

        Blocks are equal unless ``in_splits``/``out_splits`` give their sizes (elements)."""
        data = as_buffer(x, name="x", writable=False)
        result = as_buffer(out, name="out", reads=False)
        self._check_same_dtype(result, data, "out", "x")
        send_counts = self._splits(in_splits, data, "in_splits", "x")
        recv_counts = self._splits(out_splits, result, "out_splits", "out")
        if send_counts[self.rank] != recv_counts[self.rank]:  # the one block a rank can check
            raise ArgumentError(
                f"this rank's block to itself has {send_counts[self.rank]} elements in x but "
                f"{recv_counts[self.rank]} in out: block {self.rank} of x and of out must be the "
                "same size (give in_splits and out_splits, or x and out of the same size)",
                rank=self.rank)
        return self._collective("alltoall", {"input": data, "output": result}, out,
                                data.nbytes, async_op, send_counts=send_counts,
                                recv_counts=recv_counts)

    @_names_bad_input
    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank has entered the barrier."""
        empty = HostBuffer(np.zeros(0, np.uint8), "barrier")
        return self._collective("barrier", {"data": empty}, None, 0, async_op)

    @_names_bad_input
    def send(self, x: Any, dst: int, tag: int = 0, *, async_op: bool = False) -> Any:
        """Send ``x`` to rank ``dst``; matched, in order, by ``recv(src=this rank)`` there.

        Completes once the data has left this process (the receiver need not have posted
        its receive yet, except for large payloads: past what its link queues, about
        256 MiB over sockets, a blocking send waits for the receiver, so two ranks that
        both send first exchange with ``async_op=True``)."""
        data = as_buffer(x, name="x", writable=False).staged_for(HOST_ONLY)
        self._check_rank(dst, "dst", allow_self=False)
        self._check_tag(tag)
        if self._closed:
            raise CommAborted("this communicator is closed", rank=self.rank)
        seq = self._p2p_sent[dst]
        self._p2p_sent[dst] += 1
        op = P2POp(True, dst, int(tag), data, seq, f"send #{seq} to rank {dst}", x)
        return self._ops.enqueue(op, op.name, async_op)

    @_names_bad_input
    def recv(self, x: Any, src: int | None = None, tag: int = 0, *,
             async_op: bool = False) -> Any:
        """Receive into ``x`` the next message that rank ``src`` sent to this rank.

        ``src=None`` takes the next message from any rank; the returned ``Work`` (with
        ``async_op=True``) then tells which in ``work.source``. Returns ``x``."""
        data = as_buffer(x, name="x", reads=False).staged_for(HOST_ONLY)
        if src is None:
            if self.world_size == 1:
                raise ArgumentError("recv from any source in a world of one rank: there is "
                                    "no other rank to receive from", rank=self.rank)
            name = "recv from any rank"
        else:
            self._check_rank(src, "src", allow_self=False)
            name = f"recv from rank {src}"
        self._check_tag(tag)
        op = P2POp(False, src, int(tag), data, -1, name, x)
        return self._ops.enqueue(op, name, async_op)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Finish queued ops, stop the worker, close the links (and the store, if ours).

        Sends still in flight get until their deadline to leave; receives still waiting for
        their message fail with ``CommAborted``. A blocking op that runs on another thread
        (on its caller's) is aborted as ``abort`` would: it raises ``CommAborted``, and the
        peers hear that this rank failed it. If a peer's message of a collective is
        waiting that no op here took, the ranks disagreed about an op in a way this rank
        could not see while it only sent (two ranks that both think they are a broadcast's
        root): everything is closed all the same, then ``DesyncError`` says so."""
        self._close(check=True)

    def abort(self, reason: str = "the program aborted this communicator") -> None:
        """Give up on this communicator, from any thread, and release everything it holds:
        the op in flight ends with ``CommAborted`` (``reason``) at once, queued ones fail,
        every peer hears that this rank failed (so they raise instead of waiting out their
        timeout), then the worker thread stops and links, sockets, shared memory and files
        are released as ``close`` releases them. Releasing waits a little, never the
        timeout: about 2 s at most for device work that may wait on a lost peer (what does
        not settle is left to the process's exit), and, on rank 0 serving the store, up to
        10 s for ranks still using it. Never raises; does nothing once closed.
        What ``torch.distributed``'s abort of a ringcomm group calls; after a failure, a new
        communicator (``ringcomm.init``) starts clean in the same process."""
        if self._closed:
            return
        self._ops.abort(reason)
        self._close(check=False)

    def _close(self, *, check: bool) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._ops.closing():  # an op runs on another thread: closing under it is an abort
            self._ops.abort(CLOSED_DURING_OP)
            check = False
        self._ops.stop()
        self._views = _tensors.HostViews()  # a program that keeps the communicator keeps no view
        lanes_failed = None
        try:  # before the links they use; IPC's close is collective
            devices.close_lanes(self.wiring.lanes, strict=True,
                                failed=self._ops.failure is not None)
        except Exception as failed:  # noqa: BLE001 - raised once everything is closed
            lanes_failed = failed
        try:  # neither may keep the links, the store and the rest below from closing
            if self._store_done is not None:  # the lanes were the store's last users here
                self._store_done()
            if self.device is not None:  # the arrays its finished ops held go with it
                IN_FLIGHT.let_go_done(self.device)
        except Exception as passed_over:  # noqa: BLE001 - a lost store, a device in error
            log.warning("rank %d: closing went on past an error: %s", self.rank, passed_over)
        stray = None
        if self._ops.failure is None:
            stray = self.transport.leftover()
            if stray is None and self.transport.board is not None:
                stray = self.transport.board.leftover()
        self.transport.close()
        for fn in self._on_close:
            fn()
        if self._write_timeline is not None:
            try:
                self._write_timeline()  # once: the finalizer is spent
            except OSError as lost:  # the timeline is lost; nothing else may be
                log.warning("rank %d: could not write its timeline: %s", self.rank, lost)
        if stray is not None:
            what = (f"rank {stray.sender}'s part of an op it then failed in (withdrawn from "
                    "the shared board)" if stray.kind == OpKind.ABORT else
                    f"a message of rank {stray.sender}'s {stray.describe()}")
            err = DesyncError(
                f"{what} was still waiting "
                "here, and no op of this rank took it: the ranks disagreed about an op (a "
                "rank whose part of it only sends, like a broadcast's root, returns before it "
                "can tell). Every rank must call the same collectives in the same order with "
                "the same root.", rank=self.rank, op="close", peer=stray.sender)
            if check:
                raise err
            log.warning("%s", err)
        if lanes_failed is not None and check:
            raise lanes_failed

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close(check=exc_type is None)  # never hide the error already on its way

    def __repr__(self) -> str:
        return f"<ringcomm.Communicator rank {self.rank} of {self.world_size}>"

    # ------------------------------------------------------------------ internals
    def _collective(self, name: str, buffers: dict[str, Buffer], result: Any, nbytes: int,
                    async_op: bool, reduce: Any = None, *, arg: int = -1, count: int = 0,
                    send_counts: tuple[int, ...] | None = None,
                    recv_counts: tuple[int, ...] | None = None,
                    forced: str | None = None) -> Any:
        """Submit collective ``name`` on ``buffers`` as the selector chooses for ``nbytes``
        (the size its rules look at) and where the buffers' memory lives, or with the
        ``forced`` algorithm."""
        first, *others = buffers.values()
        memory = first.memory  # a device's, where any buffer is on one: the selector and
        if memory is HOST:     # the engine see it
            for buf in others:
                if buf.memory is not HOST:
                    memory = buf.memory
        choice = self.selector.choose(
            name, nbytes, first.dtype.itemsize, memory=memory, forced=forced,
            native=memory is HOST or nccl_takes(first.dtype, None if reduce is None
                                                else reduce.name))
        return self._ops.submit(CollectiveCall(
            COLLECTIVES[name], first.dtype, buffers, result, choice, memory, reduce, arg, count,
            send_counts, recv_counts), async_op)

    def _check_rank(self, r: int, what: str, *, allow_self: bool = True) -> None:
        if not isinstance(r, (int, np.integer)) or isinstance(r, bool):
            raise ArgumentError(f"{what} must be an int rank, got {r!r}", rank=self.rank)
        if not 0 <= r < self.world_size:
            raise ArgumentError(
                f"{what}={r} is out of range: ranks are 0..{self.world_size - 1}",
                rank=self.rank)
        if not allow_self and r == self.rank:
            raise ArgumentError(f"{what}={r} is this rank itself", rank=self.rank)

    def _check_tag(self, tag: int) -> None:
        if not isinstance(tag, (int, np.integer)) or isinstance(tag, bool) or \
                not 0 <= tag < 2**31:
            raise ArgumentError(f"tag must be an int in 0..2**31-1, got {tag!r}", rank=self.rank)

    def _check_same_dtype(self, a: Buffer, b: Buffer, an: str, bn: str) -> None:
        if a.dtype != b.dtype:
            raise ArgumentError(
                f"{an} is {dtype_name(a.dtype)} but {bn} is {dtype_name(b.dtype)}; "
                "they must match", rank=self.rank)

    def _check_size(self, a: Buffer, want: int, an: str, wantn: str) -> None:
        if a.count != want:
            raise ArgumentError(
                f"{an} has {a.count} elements but must have {wantn} = {want}", rank=self.rank)

    def _splits(self, splits: Sequence[int] | None, arr: Buffer, what: str,
                arrn: str) -> tuple[int, ...]:
        n = self.world_size
        if splits is None:
            if arr.count % n:
                raise ArgumentError(
                    f"{arrn} has {arr.count} elements, not divisible by world_size {n}; "
                    f"pass {what}", rank=self.rank)
            return (arr.count // n,) * n
        counts = tuple(int(s) for s in splits)
        if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != arr.count:
            raise ArgumentError(
                f"{what}={list(counts)} must be {n} non-negative sizes adding up to "
                f"{arrn}.size = {arr.count}", rank=self.rank)
        return counts


EVERY_SIZE = sys.maxsize


def inline_bytes(spare_core: bool = True) -> int:
    """Async collectives up to this many bytes per buffer run on the caller's thread when
    nothing is queued (``RINGCOMM_INLINE_BYTES``; 0 sends every async op to the worker).
    Below it an op takes less than the thread hand-offs it would cost; above it, overlap
    with the caller's work (DDP's buckets during backward) pays, where there is a
    ``spare_core`` for the worker to run on. Where there is none (a rank per core), the
    worker would take turns with its own rank on one core, so every size runs inline: DDP's
    step at world size 2 on two cores, 11.1 ms with its buckets handed to the worker, takes
    9.1 ms so (7.1 MiB of gradients)."""
    value: int | None = config.value("inline_bytes")
    if value is None:
        return DEFAULT_INLINE_BYTES if spare_core else EVERY_SIZE
    return value
