"""What the torch backend checks of tensors and how it turns them into buffers.

Every buffer goes through the buffer kinds of ``ringcomm.core.tensors``: a contiguous CPU
tensor is used in place (as a view of its memory by address, for a call that runs on the
caller's thread from start to end; as a view of the tensor otherwise), a contiguous CUDA
tensor as a device buffer (taken as it is by a device engine, staged through the host by
the others), anything else copied once; a list of tensors is one
buffer laid end to end (``Concatenated``), copied back into each after the op. Ops that only
move data take any dtype, as its bytes; reductions take the dtypes the core reduces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ReduceOp

from ..core.arrays import Buffer, Concatenated, DeviceBuffer, keep_until_done
from ..core.tensors import HostViews, core_dtypes, device_runtime_usable, tensor_buffer
from ..errors import ArgumentError

CORE_DTYPES = core_dtypes()  # the dtypes the core reduces and moves as they are
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


def reduce_op(opts: Any) -> str:
    """The communicator's name of the reduce op in torch's ``opts``."""
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


def check(t: Any, what: str, *, reduce: bool = False) -> None:
    """Refuse what ringcomm cannot take, saying what to do instead."""
    if not isinstance(t, torch.Tensor):
        raise ArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ArgumentError(f"{what} is a {t.layout} tensor; ringcomm takes dense tensors "
                            "here (call .to_dense())")
    if reduce and t.dtype not in CORE_DTYPES:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in CORE_DTYPES))
        raise ArgumentError(f"{what} has dtype {t.dtype}, which ringcomm cannot reduce; "
                            f"use one of: {supported}")


def movable(dtype: torch.dtype) -> int:
    """Elements of the buffer per element of ``dtype``: 1, or its size when the core does
    not know the dtype and moves its bytes."""
    return 1 if dtype in CORE_DTYPES else dtype.itemsize


def same(tensors: Sequence[torch.Tensor], what: str, numel: int, dtype: torch.dtype) -> None:
    for i, t in enumerate(tensors):
        if t.numel() != numel:
            raise ArgumentError(f"{what}[{i}] has {t.numel()} elements but must have {numel} "
                                "(as many as the input)")
        if t.dtype != dtype:
            raise ArgumentError(f"{what}[{i}] is {t.dtype} but the input is {dtype}; they "
                                "must match")


def one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise ArgumentError(f"{what} must hold exactly one entry per call on this backend, "
                            f"got {len(tensors)}")
    return tensors[0]


class CallBuffers:
    """The buffers of one call. ``views``: the process group's host views by address, for a
    call whose ops run on the caller's thread from start to end before it returns (the
    caller holds its tensors meanwhile; a view by address keeps none alive, so an op that
    may outlive the call takes views of the tensors instead). ``device``: the buffers of
    CUDA tensors made so far, whose ``done`` events the call's ``Work`` orders the caller's
    stream after."""

    __slots__ = ("views", "device")

    def __init__(self, views: HostViews | None = None) -> None:
        self.views = views
        self.device: list[DeviceBuffer] = []

    def of(self, t: Any, what: str, *, reduce: bool = False, write: bool = False,
           read: bool = True) -> Buffer:
        """``t`` as a buffer of its kind (checked; results written back if ``write``)."""
        check(t, what, reduce=reduce)
        buf = tensor_buffer(t, what, CORE_DTYPES, reads=read, writes=write, views=self.views)
        if isinstance(buf, DeviceBuffer):
            self.device.append(buf)
        return buf

    def joined(self, tensors: Sequence[torch.Tensor], what: str, *, reduce: bool = False,
               read: bool = True, write: bool = False) -> Buffer:
        """``tensors`` laid end to end as one buffer (copied back into each if ``write``):
        CUDA tensors of one device and dtype into one CUDA tensor, so that a device engine
        takes them (``_joined_on_device``); anything else into host memory."""
        if not tensors:
            raise ArgumentError(f"{what} is empty")
        for i, t in enumerate(tensors):
            check(t, f"{what}[{i}]", reduce=reduce)
        if _one_cuda_device(tensors):
            return self._joined_on_device(tensors, what, reduce=reduce, read=read, write=write)
        parts = [self.of(t, f"{what}[{i}]", reduce=reduce, write=write, read=read)
                 for i, t in enumerate(tensors)]
        return Concatenated(parts, what, reads=read, writes=write)

    def _joined_on_device(self, tensors: Sequence[torch.Tensor], what: str, *, reduce: bool,
                          read: bool, write: bool) -> Buffer:
        """One CUDA tensor holding ``tensors`` end to end, made on the caller's stream (a
        ``cat`` where the op reads them), and, where the op writes it, its parts copied back
        on the caller's stream once the op is done there (``DeviceBuffer.then``). Where no
        device buffer comes of it, the tensors go through host memory one by one."""
        first = tensors[0]
        if read:
            flat = torch.cat([t.reshape(-1) for t in tensors])
        else:
            flat = torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype,
                               device=first.device)
        buf = self.of(flat, what, reduce=reduce, write=write, read=read)
        if not isinstance(buf, DeviceBuffer):
            parts = [self.of(t, f"{what}[{i}]", reduce=reduce, write=write, read=read)
                     for i, t in enumerate(tensors)]
            return Concatenated(parts, what, reads=read, writes=write)
        if write:
            buf.then = _copy_back(flat, list(tensors), torch.cuda.current_stream(first.device))
        return buf


def _one_cuda_device(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are CUDA tensors of one device and one dtype the core knows, and
    the device runtime can take them (what a device engine can take once they are
    joined)."""
    first = tensors[0]
    return (first.is_cuda and first.dtype in CORE_DTYPES
            and all(t.is_cuda and t.device == first.device and t.dtype == first.dtype
                    and not (t.is_conj() or t.is_neg()) for t in tensors)
            and device_runtime_usable())


def _copy_back(flat: torch.Tensor, parts: list[torch.Tensor], caller: Any) -> Any:
    """``DeviceBuffer.then`` for a joined list: copy each part of ``flat`` back into its
    tensor on ``caller`` (the torch stream the call was made on, which waits for the op by
    then; held as torch's object, since torch's default stream has no handle of its own to
    find it by), on the worker's thread; the event after it."""
    nbytes = flat.numel() * flat.element_size()

    def then(buf: DeviceBuffer) -> Any:
        runtime = buf.runtime
        with torch.cuda.device(flat.device), torch.cuda.stream(caller), torch.no_grad():
            offset = 0
            for part in parts:
                part.copy_(flat[offset:offset + part.numel()].view(part.shape))
                offset += part.numel()
            after = runtime.new_event()
            runtime.record(after, buf.caller_stream)
        # the joined tensor is ringcomm's own: counted, so that no more than a bounded
        # number of bytes of them wait to be let go
        keep_until_done(runtime, after, nbytes, flat, parts)
        return after
    return then
