"""What the torch backend hands torch for an op: a ``torch.distributed.Work``.

Two kinds: ``FinishedWork`` for ops that ran to their end on the caller's thread (a blocking
call, the commonest), which holds no event, lock or future until someone asks for one; and
``RingcommWork`` for ops still running on the communicator's worker, which completes when
the last of its parts does. Python must never ``set_exception`` on a future that C++ (DDP's
Reducer) reads, so both complete their futures with a ``(value, error)`` record and hand
out ``then(_unwrap)`` of it.

CUDA tensors follow torch's stream semantics (as its NCCL process group does): the op's
last work on each tensor is an event (``DeviceBuffer.done``); ``wait()`` makes the caller's
*current* stream wait for it without blocking the host, ``synchronize()`` blocks the host
until it is done, and a future's value is ordered the same way before it is set, so the
value is safe to use on the caller's stream (torch's CUDA-aware future then carries the
order to whoever reads it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.arrays import DeviceBuffer
from ..errors import CommTimeout
from ..runtime.work import Work as CommWork


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


def torch_style(err: BaseException, timeout: float) -> BaseException:
    """An op's timeout worded as torch's backends word theirs ("Timed out after ..."), which
    is what people and torch's tests look for; same type, rank, op and peer, and the same
    hang report (``err.report``)."""
    if isinstance(err, CommTimeout) and not err.detail.startswith("Timed out"):
        styled = CommTimeout(f"Timed out after {timeout:g} s: {err.detail}", rank=err.rank,
                             op=err.op, peer=err.peer)
        styled.progress, styled.report = err.progress, err.report  # the hang report
        styled.__cause__ = err
        return styled
    return err


def order_current_streams(device: Sequence[DeviceBuffer]) -> None:
    """Make the calling thread's current torch stream of each buffer's device wait for the
    op's last work on that buffer (its ``done`` event; the host does not block)."""
    for buf in device:
        done = buf.done
        if done is not None:
            runtime = buf.runtime
            current = torch.cuda.current_stream(buf.device).cuda_stream
            runtime.wait_event(runtime.external_stream(current), done)


class _Handle(dist.Work):
    """What both kinds of handle answer alike, from ``_result``, ``_error``, ``_source`` and
    ``_device`` (the buffers of the op's CUDA tensors)."""

    _result: Any
    _error: BaseException | None
    _source: int
    _device: Sequence[DeviceBuffer] = ()

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
        """Block the host until the op is done, on the device too."""
        self.wait()
        for buf in self._device:
            if buf.done is not None:
                buf.runtime.event_synchronize(buf.done)


class RingcommWork(_Handle):
    """The torch handle of one or more communicator ops.

    ``wait(timeout)`` raises ringcomm's typed errors (``CommTimeout`` when the wait runs
    out; the op itself keeps its own deadline). ``get_future()`` completes with the output
    tensors or fails with the op's error. Python must never ``set_exception`` on a future
    that C++ (DDP's Reducer) reads, so the source future is completed with a
    ``(value, error)`` record and the future handed out is ``src.then(_unwrap)``.
    """

    def __init__(self, name: str, parts: Sequence[CommWork], result: Any,
                 timeout: float = 0.0, device: Sequence[DeviceBuffer] = ()) -> None:
        super().__init__()
        self._name = name
        self._device = device
        self._timeout = timeout
        self._result = result
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
            self._error = torch_style(error, self._timeout)
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
        # done first: a callback on the future must find the Work completed
        self._done.set()
        if self._device and self._error is None:
            # the future records its events on this thread's current streams: order those
            order_current_streams(self._device)
        self._src.set_result((self._result if self._error is None else None, self._error))

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
        if self._device:
            order_current_streams(self._device)
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
                 source: int = -1, device: Sequence[DeviceBuffer] = ()) -> None:
        dist.Work.__init__(self)
        self._name = name
        self._result = result
        if error is not None:
            self._error = error
        if source != -1:
            self._source = source
        if device:
            self._device = device

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if self._error is not None:
            raise self._error
        if self._device:
            order_current_streams(self._device)
        return True

    def get_future(self) -> torch.futures.Future:
        with _FUTURE_LOCK:
            if self._future is None:
                devices: list[int | str | torch.device] = sorted(
                    {t.device for t in _tensors(self._result) if not t.is_cpu}, key=str)
                future: torch.futures.Future = torch.futures.Future(devices=devices or None)
                if self._error is None:
                    order_current_streams(self._device)  # what set_result records after
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


