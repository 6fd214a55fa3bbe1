"""ringcomm as a ``torch.distributed`` backend: ``dist.init_process_group("ringcomm")``.

    import torch.distributed as dist
    dist.init_process_group("ringcomm")     # env://, tcp://, file:// or store=, as for gloo
    dist.all_reduce(t)                      # and every other collective, DDP, new_group...

The backend is registered when ringcomm is imported and, through the ``torch.backends``
entry point, whenever torch is imported in an environment where ringcomm is installed.

Why it is thin: every collective already exists in ``Communicator``; a method here turns
torch's arguments into flat CPU buffers, maps the ``ReduceOp``, starts the op with
``async_op=True`` and wraps what comes back in a ``torch.distributed.Work``. Ranks meet
through the c10d store torch hands the backend (one key prefix per group), so every init
method torch has works, and each ``new_group`` gets a communicator of its own.

Buffers: a contiguous CPU tensor of a dtype the core knows is used in place (a zero-copy
view; for a call whose ops run on the caller's thread from start to end, such as
``dist.all_reduce(t)``, a host view of its memory made once per address, size and dtype,
``_HostViews``). Anything else (non-contiguous, CUDA, a conjugate view) is copied into a
contiguous CPU tensor, and results are copied back when the op completes, on the
communicator's thread, before the op's ``Work`` reports completion. Ops that only move
data (broadcast, all-gather, all-to-all, gather, scatter, send/recv) take any dtype by
moving its bytes; reductions take the dtypes the core reduces.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..bootstrap.rendezvous import _reachable_host, init
from ..bootstrap.store import TorchStore
from ..core.arrays import HostBuffer, as_buffer
from ..errors import ArgumentError, CommError, CommTimeout
from ..runtime.communicator import Communicator
from ..runtime.work import Work as CommWork

log = logging.getLogger("ringcomm")

BACKEND_NAME = "ringcomm"
_MONITORED_TAG = 2**31 - 16  # monitored_barrier's messages, apart from the user's tags

# dtypes the core reduces and moves as they are (see ringcomm.core.dtypes)
_CORE_DTYPES = {
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128,
}
_OPS = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "avg",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.BAND: "band",
    ReduceOp.BOR: "bor",
    ReduceOp.BXOR: "bxor",
}
_OPS_BY_CODE = {kind.value: name for kind, name in _OPS.items()}  # hashing torch's enum is slow
_SUM = ReduceOp.SUM
_STRIDED = torch.strided
# where every buffer the group makes lives: said each time, since a program may have made
# another device torch's default (torch.set_default_device)
_HOST = torch.device("cpu")


# --------------------------------------------------------------------------- work


def _unwrap(fut: torch.futures.Future) -> Any:
    value, error = fut.value()
    if error is not None:
        raise error
    return value


_FUTURE_LOCK = threading.Lock()  # guards get_future of finished Works (they have no lock)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _torch_style(err: BaseException, timeout: float) -> BaseException:
    """An op's timeout worded as torch's backends word theirs ("Timed out after ..."), which
    is what people and torch's tests look for; same type, rank, op and peer."""
    if isinstance(err, CommTimeout) and not err.detail.startswith("Timed out"):
        styled = CommTimeout(f"Timed out after {timeout:g} s: {err.detail}", rank=err.rank,
                             op=err.op, peer=err.peer)
        styled.__cause__ = err
        return styled
    return err


class _Handle(dist.Work):
    """What both kinds of handle answer alike, from ``_result``, ``_error`` and ``_source``."""

    _result: Any
    _error: BaseException | None
    _source: int

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        self.wait()


class RingcommWork(_Handle):
    """The torch handle of one or more communicator ops.

    ``wait(timeout)`` raises ringcomm's typed errors (``CommTimeout`` when the wait runs
    out; the op itself keeps its own deadline). ``get_future()`` completes with the output
    tensors or fails with the op's error. Python must never ``set_exception`` on a future
    that C++ (DDP's Reducer) reads, so the source future is completed with a
    ``(value, error)`` record and the future handed out is ``src.then(_unwrap)``.
    """

    def __init__(self, name: str, parts: Sequence[CommWork], result: Any,
                 finish: Callable[[], None] | None = None, timeout: float = 0.0) -> None:
        super().__init__()
        self._name = name
        self._timeout = timeout
        self._result = result
        self._finish = finish
        self._error: BaseException | None = None
        self._source = -1
        # a future holding CUDA tensors must say so, or completing it fails
        devices: list[int | str | torch.device] = sorted(
            {t.device for t in _tensors(result) if not t.is_cpu}, key=str)
        self._src: torch.futures.Future = torch.futures.Future(devices=devices or None)
        self._future: torch.futures.Future | None = None  # made when asked for
        self._parts = list(parts)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._left = len(parts)
        for part in parts:
            part.add_done_callback(self._part_done)

    def _take(self, part: CommWork) -> None:
        """Note what a finished part says: its error (the first one wins), its source."""
        error = part.exception()
        if self._error is None and error is not None:
            self._error = _torch_style(error, self._timeout)
        if part.source is not None:
            self._source = part.source

    def _part_done(self, part: CommWork) -> None:
        with self._lock:
            self._left -= 1
            self._take(part)
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        if self._error is None and self._finish is not None:
            try:
                self._finish()
            except Exception as err:  # noqa: BLE001 - reported through wait() and the future
                self._error = err
        self._src.set_result((self._result if self._error is None else None, self._error))
        self._done.set()

    # -- the torch.distributed.Work interface
    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._done.wait(seconds if seconds > 0 else None):
            raise CommTimeout(
                f"Timed out after {seconds:g} s waiting for {self._name}; the op keeps "
                "running until its own deadline: wait again, or raise the timeout",
                op=self._name)
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """Made on first use (most callers only ``wait``): ``_src.then(_unwrap)``, so the
        future handed out fails with the op's error without Python ever setting an exception
        on a future C++ may hold."""
        with self._lock:
            if self._future is None:
                self._future = self._src.then(_unwrap)
            return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None


    def __repr__(self) -> str:
        return f"<RingcommWork {self._name} {'done' if self.is_completed() else 'pending'}>"


class FinishedWork(_Handle):
    """The torch handle of ops that ran to their end on the caller's thread: a blocking call
    (``dist.all_reduce(t)``) or a small one with nothing queued. Most callers only ``wait``,
    so it holds no event, lock or future; ``get_future()`` makes a completed one when asked
    (through ``then(_unwrap)`` for an error, as ``RingcommWork`` does). Made on every
    blocking call, so what most handles share is a class default, not set each time."""

    _error: BaseException | None = None
    _source = -1
    _future: torch.futures.Future | None = None

    def __init__(self, name: str, result: Any, error: BaseException | None = None,
                 source: int = -1) -> None:
        dist.Work.__init__(self)
        self._name = name
        self._result = result
        if error is not None:
            self._error = error
        if source != -1:
            self._source = source

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        with _FUTURE_LOCK:
            if self._future is None:
                devices: list[int | str | torch.device] = sorted(
                    {t.device for t in _tensors(self._result) if not t.is_cpu}, key=str)
                future: torch.futures.Future = torch.futures.Future(devices=devices or None)
                if self._error is None:
                    future.set_result(self._result)
                else:
                    future.set_result((None, self._error))
                    future = future.then(_unwrap)
                self._future = future
            return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return self._error is None


    def __repr__(self) -> str:
        return f"<FinishedWork {self._name}>"


# --------------------------------------------------------------------------- buffers


def _check(t: Any, what: str, *, reduce: bool = False) -> None:
    """Refuse what ringcomm cannot take, saying what to do instead."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ArgumentError(f"{what} is a {t.layout} tensor; ringcomm takes dense tensors "
                            "here (call .to_dense())")
    if reduce and t.dtype not in _CORE_DTYPES:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in _CORE_DTYPES))
        raise ArgumentError(f"{what} has dtype {t.dtype}, which ringcomm cannot reduce; "
                            f"use one of: {supported}")


def _buffer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a buffer holding ``dtype``'s data: itself, or bytes where the core does
    not know it."""
    return dtype if dtype in _CORE_DTYPES else torch.uint8


def _movable(dtype: torch.dtype) -> int:
    """Elements of the buffer per element of ``dtype``: 1, or its size when the core does
    not know the dtype and moves its bytes."""
    return 1 if dtype in _CORE_DTYPES else dtype.itemsize


def _in_place(t: Any) -> bool:
    """Whether the communicator can work on ``t``'s memory as it is: a contiguous CPU tensor
    of a dtype the core knows, not a conjugate or negated view."""
    return (isinstance(t, torch.Tensor) and t.layout is _STRIDED and t.is_cpu
            and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and t.dtype in _CORE_DTYPES)


class _Staging:
    """Buffers of one call, and the copies back into the caller's tensors once it is done.

    ``views``: the process group's host views, for a call whose ops run on the caller's
    thread from start to end before it returns (the caller holds its tensors meanwhile; a
    view by address keeps none alive, so an op that may outlive the call, queued for the
    worker or started async, takes tensors)."""

    def __init__(self, views: _HostViews | None = None) -> None:
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.views = views

    def host(self, t: torch.Tensor, what: str, *, reduce: bool = False, write: bool = False,
             read: bool = True) -> Any:
        """``buffer`` for a caller that only hands it to the communicator: a blocking call's
        tensor that can be used in place comes as the host view of its memory (a tensor
        would be checked and viewed again there)."""
        if self.views is not None and _in_place(t):
            return self.views.of(t)
        return self.buffer(t, what, reduce=reduce, write=write, read=read)

    def buffer(self, t: torch.Tensor, what: str, *, reduce: bool = False,
               write: bool = False, read: bool = True) -> torch.Tensor:
        """A flat, contiguous CPU tensor holding ``t``'s data: a view of ``t`` when possible,
        else a copy (``read``: of its values), written back into ``t`` if ``write``. A dtype
        the core does not know is moved as bytes."""
        _check(t, what, reduce=reduce)
        in_place = (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj()
                    and not t.is_neg())
        if in_place:
            buf = t.detach().reshape(-1)
        else:
            buf = self._copy_of(t, read).reshape(-1)
            if write:
                self.copies.append((t, buf))
        return buf if buf.dtype in _CORE_DTYPES else buf.view(torch.uint8)

    @staticmethod
    def _copy_of(t: torch.Tensor, read: bool) -> torch.Tensor:
        if not read:
            return torch.empty(t.shape, dtype=t.dtype, device=_HOST)
        t = t.detach().resolve_conj().resolve_neg()
        return t.to("cpu", memory_format=torch.contiguous_format, copy=True)

    @staticmethod
    def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A fresh flat buffer of ``numel`` elements of ``dtype`` (a buffer's dtype)."""
        return torch.empty(numel, dtype=dtype, device=_HOST)

    @staticmethod
    def fresh(buf: torch.Tensor) -> Any:
        """What the communicator takes for a buffer this group made (``scratch``, ``cat``): a
        host buffer over it (its numpy view keeps it alive), without the checks a caller's
        tensor needs."""
        return buf if buf.dtype == torch.bfloat16 else HostBuffer(buf.numpy(), "scratch")

    def cat(self, tensors: Sequence[torch.Tensor], what: str, *, reduce: bool = False
            ) -> torch.Tensor:
        """A fresh buffer holding ``tensors`` one after another."""
        if not tensors:
            raise ArgumentError(f"{what} is empty")
        parts = [self.buffer(t, f"{what}[{i}]", reduce=reduce) for i, t in enumerate(tensors)]
        return torch.cat(parts)

    def split_back(self, buf: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
        """Once the op is done, consecutive ranges of ``buf`` go into ``outputs``."""
        offset = 0
        for out in outputs:
            n = out.numel() * _movable(out.dtype)
            self.copies.append((out, buf[offset: offset + n]))
            offset += n

    def finish(self) -> None:
        with torch.no_grad():
            for dst, src in self.copies:
                if src.dtype != dst.dtype:  # bytes of a dtype the core does not know
                    src = src.view(dst.dtype)
                dst.copy_(src if dst.dim() == 1 else src.reshape(dst.shape))

    def finisher(self) -> Callable[[], None] | None:
        return self.finish if self.copies else None


class _HostViews:
    """Host buffers over CPU tensors' memory, for the short way of a blocking call: made
    once per address, size and dtype (viewing a tensor as numpy and checking it costs more
    than a small op's exchange). A view is made from the address, so it keeps no tensor
    alive, and is used only for a tensor of that address, size and dtype, the caller having
    checked that it is a contiguous CPU tensor: exactly the memory the view covers."""

    _LIMIT = 64  # views kept (the latest made); a program reduces a few tensors over and over

    def __init__(self) -> None:
        self._views: dict[tuple[int, int, torch.dtype], HostBuffer] = {}
        self._lock = threading.Lock()  # misses only: threads may share a process group

    def of(self, t: torch.Tensor) -> HostBuffer:
        key = (t.data_ptr(), t.numel(), t.dtype)
        view = self._views.get(key)
        if view is None:
            view = self._make(t, key)
        return view

    def _make(self, t: torch.Tensor, key: tuple[int, int, torch.dtype]) -> HostBuffer:
        address, count, dtype = key
        host = _numpy_dtype(dtype)
        if count:
            memory = (ctypes.c_byte * (count * host.itemsize)).from_address(address)
            view = HostBuffer(np.frombuffer(memoryview(memory), host), "tensor")
        else:
            view = HostBuffer(np.empty(0, host), "tensor")
        with self._lock:
            if len(self._views) >= self._LIMIT:
                self._views.pop(next(iter(self._views)), None)
            self._views[key] = view
        return view


_NUMPY_NAMES: dict[torch.dtype, np.dtype] = {}


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's name for a core dtype (``ml_dtypes``' for bfloat16), as the core views it."""
    host = _NUMPY_NAMES.get(dtype)
    if host is None:
        empty = torch.empty(0, dtype=dtype, device=_HOST)
        host = _NUMPY_NAMES[dtype] = as_buffer(empty, name="t").dtype
    return host


def _reduce_op(opts: Any) -> str:
    if opts is None:
        return "sum"
    red = opts.reduceOp
    if red == _SUM:  # the commonest, told at a third of the cost of the lookup below
        return "sum"
    name = _OPS_BY_CODE.get(getattr(red, "op", red).value)
    if name is not None:
        return name
    raise ArgumentError(f"reduce op {red} is not supported by ringcomm; use SUM, AVG, PRODUCT, "
                        "MIN, MAX, BAND, BOR or BXOR")


def _same(tensors: Sequence[torch.Tensor], what: str, numel: int, dtype: torch.dtype) -> None:
    for i, t in enumerate(tensors):
        if t.numel() != numel:
            raise ArgumentError(f"{what}[{i}] has {t.numel()} elements but must have {numel} "
                                "(as many as the input)")
        if t.dtype != dtype:
            raise ArgumentError(f"{what}[{i}] is {t.dtype} but the input is {dtype}; they "
                                "must match")


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ArgumentError(f"{what} must hold exactly one entry per call on this backend, "
                            f"got {len(tensors)}")
    return tensors[0]


# --------------------------------------------------------------------------- process group


class RingcommProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose ops run on a ringcomm ``Communicator``.

    Created by torch through the registered backend; ``comm`` is the communicator (its
    ``transport.describe()`` tells how the ranks are connected).
    """

    def __init__(self, comm: Communicator) -> None:
        # (rank, size): a constructor torch has and its stub does not list
        super().__init__(comm.rank, comm.world_size)  # type: ignore[call-arg]
        self.comm = comm
        self._views = _HostViews()
        self._group_name = ""
        self._group_desc = ""

    # -- identity
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return (f"<RingcommProcessGroup {self._group_name or '?'} rank {self.comm.rank} of "
                f"{self.comm.world_size}>")

    # -- lifecycle
    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: stop the worker, close sockets and files."""
        self.comm.close()

    def abort(self) -> None:
        self.comm.close()

    def _start(self, opts: Any, method: Callable[..., Any], *args: Any,
               **kwargs: Any) -> CommWork:
        """Start one communicator op for torch. torch says whether its caller waits at once
        (``opts.asyncOp`` is False in ``dist.all_reduce(t)``): then the op runs as a
        blocking call (on this thread when nothing is queued: no hand-off to the worker and
        back) and comes back as a finished Work; its failure is raised by ``wait``, as an
        async op's would be. Bad arguments raise here either way."""
        if getattr(opts, "asyncOp", True):
            return method(*args, async_op=True, **kwargs)
        name = getattr(method, "__name__", "op")
        try:
            result = method(*args, async_op=False, **kwargs)
        except ArgumentError:
            raise
        except CommError as err:
            return CommWork.finished(name, self.comm.timeout, error=err)
        return CommWork.finished(name, self.comm.timeout, result)

    def _staging(self, opts: Any) -> _Staging:
        """The staging of a call: with the host views where its ops will run on this thread
        from start to end (``opts.asyncOp`` False, every op of it started through ``_start``,
        and nothing queued before them: ``Communicator.idle``), which is what lets it use
        them."""
        blocking = not getattr(opts, "asyncOp", True)
        return _Staging(self._views if blocking and self.comm.idle else None)

    def _work(self, name: str, parts: Sequence[CommWork], result: Any,
              stage: _Staging | None = None) -> dist.Work:
        """The torch handle of ``parts``: a ``FinishedWork`` when all of them already ran (on
        this thread), its staged results copied back now; else a ``RingcommWork`` that
        completes when the last part does."""
        finish = stage.finisher() if stage else None
        if not all(part.is_completed() for part in parts):
            return RingcommWork(name, parts, result, finish, self.comm.timeout)
        error: BaseException | None = None
        source = -1
        for part in parts:
            failed = part.exception()
            if error is None and failed is not None:
                error = _torch_style(failed, self.comm.timeout)
            if part.source is not None:
                source = part.source
        if error is None and finish is not None:
            try:
                finish()
            except Exception as err:  # noqa: BLE001 - reported through wait() and the future
                error = err
        return FinishedWork(name, result if error is None else None, error, source)

    # torch's stub gives ProcessGroup's collectives the overloads of its Python API; c10d
    # calls a backend written in Python with (tensors..., opts) only. The overrides below
    # take that form, hence their `type: ignore[override]` (and `[assignment]` for aliases).

    # -- reductions
    def allreduce(  # type: ignore[override]  # c10d's form, see above
            self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = _reduce_op(opts)
        if len(tensors) == 1 and opts is not None and not opts.asyncOp:
            t = tensors[0]  # dist.all_reduce(t): the commonest call, taken the short way
            if _in_place(t):  # a view of its memory: the op runs here, start to end, or not
                try:
                    if self.comm.allreduce_now(self._views.of(t), op):
                        return FinishedWork("allreduce", tensors)
                except ArgumentError:
                    raise
                except CommError as err:  # raised by wait, as an async op's would be
                    return FinishedWork("allreduce", None,
                                        _torch_style(err, self.comm.timeout))
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        stage = self._staging(opts)
        bufs = [stage.host(t, f"tensors[{i}]", reduce=True, write=True)
                for i, t in enumerate(tensors)]
        parts = [self._start(opts, self.comm.allreduce, b, op) for b in bufs]
        return self._work("allreduce", parts, tensors, stage)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None
                            ) -> dist.Work:
        """One allreduce per dtype, over that dtype's tensors laid end to end."""
        op = _reduce_op(opts)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for i, t in enumerate(tensors):
            _check(t, f"tensors[{i}]", reduce=True)
            groups.setdefault(t.dtype, []).append(t)
        stage = _Staging()
        parts = []
        for same_dtype in groups.values():
            buf = stage.cat(same_dtype, "tensors", reduce=True)
            stage.split_back(buf, same_dtype)
            parts.append(self._start(opts, self.comm.allreduce, buf, op))
        return self._work("allreduce_coalesced", parts, tensors, stage)

    def reduce(  # type: ignore[override]  # c10d's form, see above
            self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        stage = self._staging(opts)
        buf = stage.host(_one(tensors, "tensors"), "tensor", reduce=True, write=True)
        part = self._start(opts, self.comm.reduce, buf, root=opts.rootRank, op=_reduce_op(opts))
        return self._work("reduce", [part], tensors, stage)

    def reduce_scatter(  # type: ignore[override]  # c10d's form, see above
            self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
            opts: Any = None) -> dist.Work:
        out, inputs = _one(output_tensors, "output_tensors"), _one(input_lists, "input_lists")
        self._check_world(inputs, "input_list")
        _same(inputs, "input_list", out.numel(), out.dtype)
        stage = self._staging(opts)
        src = stage.cat(inputs, "input_list", reduce=True)
        dst = stage.host(out, "output", reduce=True, write=True, read=False)
        part = self._start(opts, self.comm.reduce_scatter, dst, src, _reduce_op(opts))
        return self._work("reduce_scatter", [part], output_tensors, stage)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> dist.Work:
        stage = self._staging(opts)
        part = self._reduce_scatter_tensor(opts, stage, output, input, _reduce_op(opts))
        return self._work("reduce_scatter_tensor", [part], [output], stage)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # see above

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None
                                        ) -> dist.Work:
        stage, op = self._staging(opts), _reduce_op(opts)
        parts = [self._reduce_scatter_tensor(opts, stage, o, i, op)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._work("reduce_scatter_tensor_coalesced", parts, outputs, stage)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def _reduce_scatter_tensor(self, opts: Any, stage: _Staging, output: torch.Tensor,
                               input: torch.Tensor, op: str) -> CommWork:  # noqa: A002
        self._check_numel(input, output.numel() * self.comm.world_size, "input",
                          "world_size * output.numel()")
        src = stage.host(input, "input", reduce=True)
        dst = stage.host(output, "output", reduce=True, write=True, read=False)
        return self._start(opts, self.comm.reduce_scatter, dst, src, op)

    # -- data movement
    def broadcast(  # type: ignore[override]  # c10d's form, see above
            self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        stage = self._staging(opts)
        root = opts.rootRank
        is_root = self.comm.rank == root
        bufs = [stage.host(t, f"tensors[{i}]", write=not is_root, read=is_root)
                for i, t in enumerate(tensors)]
        parts = [self._start(opts, self.comm.broadcast, b, root=root) for b in bufs]
        return self._work("broadcast", parts, tensors, stage)

    def allgather(  # type: ignore[override]  # c10d's form, see above
            self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
            opts: Any = None) -> dist.Work:
        stage = self._staging(opts)
        parts = []
        for i, (outputs, inp) in enumerate(zip(output_lists, input_list, strict=True)):
            self._check_world(outputs, f"output_lists[{i}]")
            _same(outputs, f"output_lists[{i}]", inp.numel(), inp.dtype)
            src = stage.host(inp, f"input_list[{i}]")
            dst = stage.scratch(inp.numel() * _movable(inp.dtype) * self.comm.world_size,
                                _buffer_dtype(inp.dtype))
            stage.split_back(dst, outputs)
            parts.append(self._start(opts, self.comm.allgather, stage.fresh(dst), src))
        return self._work("allgather", parts, output_lists, stage)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> dist.Work:
        stage = self._staging(opts)
        part = self._all_gather_tensor(opts, stage, output, input)
        return self._work("all_gather_into_tensor", [part], [output], stage)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None
                                        ) -> dist.Work:
        stage = self._staging(opts)
        parts = [self._all_gather_tensor(opts, stage, o, i)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._work("all_gather_into_tensor_coalesced", parts, outputs, stage)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def _all_gather_tensor(self, opts: Any, stage: _Staging, output: torch.Tensor,
                           input: torch.Tensor) -> CommWork:  # noqa: A002
        self._check_numel(output, input.numel() * self.comm.world_size, "output",
                          "world_size * input.numel()")
        src = stage.host(input, "input")
        dst = stage.host(output, "output", write=True, read=False)
        return self._start(opts, self.comm.allgather, dst, src)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None
                            ) -> dist.Work:
        """``output_lists[r][i]`` receives rank ``r``'s ``input_list[i]``: one all-gather of
        the inputs laid end to end."""
        self._check_world(output_lists, "output_tensor_lists")
        for r, outputs in enumerate(output_lists):
            if len(outputs) != len(input_list):
                raise ArgumentError(f"output_tensor_lists[{r}] has {len(outputs)} tensors for "
                                    f"{len(input_list)} inputs; it needs one per input")
            for i, (o, t) in enumerate(zip(outputs, input_list, strict=True)):
                _same([o], f"output_tensor_lists[{r}][{i}]", t.numel(), t.dtype)
        stage = _Staging()
        src = stage.cat(input_list, "input_tensor_list")
        dst = stage.scratch(src.numel() * self.comm.world_size, src.dtype)
        stage.split_back(dst, [o for outputs in output_lists for o in outputs])
        part = self.comm.allgather(dst, src, async_op=True)
        return self._work("allgather_coalesced", [part], output_lists, stage)

    def gather(  # type: ignore[override]  # c10d's form, see above
            self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
            opts: Any) -> dist.Work:
        stage = _Staging()
        root = opts.rootRank
        inp = _one(input_list, "input_tensors")
        src = stage.buffer(inp, "input")
        dst = None
        if self.comm.rank == root:
            outputs = _one(output_lists, "output_tensors")
            self._check_world(outputs, "gather_list")
            _same(outputs, "gather_list", inp.numel(), inp.dtype)
            dst = stage.scratch(src.numel() * self.comm.world_size, src.dtype)
            stage.split_back(dst, outputs)
        part = self._start(opts, self.comm.gather, dst, src, root=root)
        return self._work("gather", [part], output_lists, stage)

    def scatter(  # type: ignore[override]  # c10d's form, see above
            self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
            opts: Any) -> dist.Work:
        stage = self._staging(opts)
        root = opts.rootRank
        out = _one(output_tensors, "output_tensors")
        src = None
        if self.comm.rank == root:
            inputs = _one(input_lists, "input_tensors")
            self._check_world(inputs, "scatter_list")
            _same(inputs, "scatter_list", out.numel(), out.dtype)
            src = stage.cat(inputs, "scatter_list")
        dst = stage.host(out, "output", write=True, read=False)
        part = self._start(opts, self.comm.scatter, dst, src, root=root)
        return self._work("scatter", [part], output_tensors, stage)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """Tensor ``j`` of ``input_tensors`` goes to rank ``j``; sizes may differ."""
        self._check_world(input_tensors, "input_tensor_list")
        self._check_world(output_tensors, "output_tensor_list")
        dtype = input_tensors[0].dtype
        for what, ts in (("input_tensor_list", input_tensors),
                         ("output_tensor_list", output_tensors)):
            for i, t in enumerate(ts):
                if t.dtype != dtype:
                    raise ArgumentError(f"{what}[{i}] is {t.dtype}, not {dtype}: all tensors "
                                        "of an all_to_all must have one dtype")
        stage = _Staging()
        scale = _movable(dtype)
        src = stage.cat(input_tensors, "input_tensor_list")
        dst = stage.scratch(sum(t.numel() for t in output_tensors) * scale, src.dtype)
        stage.split_back(dst, output_tensors)
        part = self._start(opts, self.comm.alltoall, stage.fresh(dst), stage.fresh(src),
                           in_splits=[t.numel() * scale for t in input_tensors],
                           out_splits=[t.numel() * scale for t in output_tensors])
        return self._work("all_to_all", [part], output_tensors, stage)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> dist.Work:
        """Splits count rows (sizes along dim 0); empty splits mean equal ones."""
        stage = self._staging(opts)
        src = stage.host(input, "input")
        dst = stage.host(output, "output", write=True, read=False)
        in_splits = self._rows(input, input_split_sizes, "input")
        out_splits = self._rows(output, output_split_sizes, "output")
        part = self._start(opts, self.comm.alltoall, dst, src, in_splits=in_splits,
                           out_splits=out_splits)
        return self._work("all_to_all_single", [part], [output], stage)

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # c10d's form, see above

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._work("barrier", [self._start(opts, self.comm.barrier)], [])

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """Gloo's debugging barrier, for callers that reach the group directly
        (``dist.monitored_barrier`` itself accepts only gloo groups): rank 0 hears from
        every other rank within ``timeout`` and names those it did not hear from (the first
        one, or all with ``wait_all_ranks``), then releases them."""
        comm, rank = self.comm, self.comm.rank
        limit = timeout.total_seconds() if timeout is not None else comm.timeout
        ms = int(limit * 1000)
        token = torch.zeros(1, dtype=torch.uint8, device=_HOST)
        if rank != 0:
            for work in (comm.send(token, 0, _MONITORED_TAG, async_op=True),
                         comm.recv(token, 0, _MONITORED_TAG, async_op=True)):
                try:
                    work.wait(max(limit, 0.0))
                except CommTimeout as err:
                    raise CommTimeout(f"Rank {rank} failed to pass monitoredBarrier in {ms} ms",
                                      rank=rank, op="monitored_barrier") from err
            return
        start = time.monotonic()
        passed: list[int] = []
        failed: list[int] = []
        for src in range(1, comm.world_size):
            left = limit if wait_all_ranks else limit - (time.monotonic() - start)
            if left <= 0 and not wait_all_ranks:
                done = ", ".join(map(str, passed)) or "none"
                raise CommTimeout(f"Rank 0 timed out in monitoredBarrier after {ms} ms. "
                                  f"Ranks that passed it: {done}", rank=0,
                                  op="monitored_barrier")
            try:
                comm.recv(torch.zeros(1, dtype=torch.uint8, device=_HOST), src, _MONITORED_TAG,
                          async_op=True).wait(max(left, 0.0))
                passed.append(src)
            except CommTimeout as err:
                if not wait_all_ranks:
                    raise CommTimeout(f"Rank {src} failed to pass monitoredBarrier in {ms} ms",
                                      rank=0, op="monitored_barrier", peer=src) from err
                failed.append(src)
        if failed:
            raise CommTimeout(f"Ranks {', '.join(map(str, failed))} failed to pass "
                              f"monitoredBarrier in {ms} ms", rank=0, op="monitored_barrier")
        for dst in range(1, comm.world_size):
            comm.send(token, dst, _MONITORED_TAG)

    # -- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        buf = _Staging().buffer(_one(tensors, "tensors"), "tensor")
        return self._work("send", [self.comm.send(buf, dst, tag, async_op=True)], tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        stage = _Staging()
        buf = stage.buffer(_one(tensors, "tensors"), "tensor", write=True, read=False)
        part = self.comm.recv(buf, src, tag, async_op=True)
        return self._work("recv", [part], tensors, stage)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        stage = _Staging()
        buf = stage.buffer(_one(tensors, "tensors"), "tensor", write=True, read=False)
        part = self.comm.recv(buf, None, tag, async_op=True)
        return self._work("recv from any source", [part], tensors, stage)

    # -- helpers
    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: str) -> dist.Work:
        """Sparse COO all-reduce (sum), as gloo does it: every rank's indices and values are
        gathered (padded to the longest), then summed and coalesced."""
        if op != "sum":
            raise ArgumentError(f"sparse all_reduce supports only SUM, got {op}")
        t = _one(tensors, "tensors")
        world = self.comm.world_size
        sparse = t.coalesce()
        indices, values = sparse.indices(), sparse.values()
        counts = torch.zeros(world, dtype=torch.int64, device=_HOST)
        self.comm.allgather(counts, torch.tensor([indices.shape[1]], device=_HOST))
        most = int(counts.max())
        mine_i = torch.zeros((indices.shape[0], most), dtype=torch.int64, device=_HOST)
        mine_i[:, : indices.shape[1]] = indices
        mine_v = torch.zeros((most, *values.shape[1:]), dtype=values.dtype, device=_HOST)
        mine_v[: values.shape[0]] = values
        all_i = torch.empty((world, *mine_i.shape), dtype=torch.int64, device=_HOST)
        all_v = torch.empty((world, *mine_v.shape), dtype=values.dtype, device=_HOST)
        self.comm.allgather(all_i, mine_i)
        self.comm.allgather(all_v, mine_v)
        idx = torch.cat([all_i[r, :, : int(counts[r])] for r in range(world)], dim=1)
        val = torch.cat([all_v[r, : int(counts[r])] for r in range(world)])
        total = torch.sparse_coo_tensor(idx, val, sparse.shape, device=_HOST).coalesce()
        with torch.no_grad():
            t.copy_(total)
        return self._work("sparse allreduce", [], [t])

    def _check_world(self, tensors: Sequence[Any], what: str) -> None:
        if len(tensors) != self.comm.world_size:
            raise ArgumentError(f"{what} has {len(tensors)} entries but the group has "
                                f"{self.comm.world_size} ranks; pass one per rank")

    def _check_numel(self, t: torch.Tensor, want: int, what: str, wantn: str) -> None:
        if t.numel() != want:
            raise ArgumentError(f"{what} has {t.numel()} elements but must have {wantn} = "
                                f"{want}")

    def _rows(self, t: torch.Tensor, splits: Sequence[int], what: str) -> list[int] | None:
        """Row splits of ``t`` (dim 0) as element counts of its flat buffer; None: equal."""
        rows = t.shape[0] if t.dim() > 0 else 1
        numel = t.numel() * _movable(t.dtype)
        if not splits:
            if rows % self.comm.world_size:
                raise ArgumentError(f"{what} has {rows} rows, not divisible by the "
                                    f"{self.comm.world_size} ranks: pass split sizes")
            return None
        if len(splits) != self.comm.world_size or sum(splits) != rows:
            raise ArgumentError(f"{what} split sizes {list(splits)} must be "
                                f"{self.comm.world_size} row counts adding up to {rows}")
        per_row = numel // rows if rows else 0
        return [int(s) * per_row for s in splits]


# --------------------------------------------------------------------------- registration


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
