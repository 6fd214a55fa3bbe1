"""Communication hooks: how a bucket is reduced, as ``(state, bucket) -> Future[Tensor]``.

The signature is torch's (``ddp_comm_hooks/default_hooks.py``), so these hooks run on
torch's DDP and on ours, and torch's run on ours. ``state`` is the process group (``None``
for the default group). Each hook averages over the group's ranks and completes its future
with the bucket's new contents. They use only ``torch.distributed`` calls that every backend
has, on any device.

The compressed hooks trade precision for bytes on the wire: fp16 and bf16 send half of
float32, int8 a quarter. Every rank must register the same hook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .buckets import GradBucket

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "int8_compress_hook"]


def _group(state: Any) -> Any:
    return state if state is not None else dist.group.WORLD


def allreduce_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future:
    """The plain average: divide by the world size, then sum across ranks.

    Example::

        >>> model.register_comm_hook(None, allreduce_hook)
    """
    group = _group(process_group)
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _compress_hook(dtype: torch.dtype, process_group: Any,
                   bucket: GradBucket) -> torch.futures.Future:
    group = _group(process_group)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(group))
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(f.value()[0])
    return fut.then(decompress)


def fp16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future:
    """Divide by the world size, cast to float16, sum, cast back.

    About 3 significant decimal digits; values beyond float16's range (65504) become inf.

    Example::

        >>> model.register_comm_hook(None, fp16_compress_hook)
    """
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future:
    """Divide by the world size, cast to bfloat16, sum, cast back.

    float32's range with about 2 significant decimal digits.

    Example::

        >>> model.register_comm_hook(None, bf16_compress_hook)
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


INT8_MAX = 127


def int8_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future:
    """Quantise to int8 with one scale per bucket, agreed across ranks, with headroom.

    The ranks first agree on the bucket's largest magnitude ``m`` (a blocking max-allreduce
    of one float: ranks must issue collectives in the same order, which a second collective
    launched from a future's callback would not guarantee). With ``W`` ranks each rank
    sends ``round(g / m * L)`` with ``L = 127 // W`` levels: every rank's value lies in
    ``[-L, L]``, so the int8 sum lies in ``[-127, 127]`` and cannot overflow, whatever the
    order of additions. The cost of the headroom is precision: the error of each averaged
    element is at most ``m / (2 L)``, about ``m * W / 254``. Above 127 ranks no level is
    left: the hook raises ``ValueError`` saying so (use the bf16 hook there). A bucket
    holding inf or nan raises ``FloatingPointError`` on every rank, since its scale would
    be meaningless.

    Example::

        >>> model.register_comm_hook(None, int8_compress_hook)
    """
    group = _group(process_group)
    world = dist.get_world_size(group)
    levels = INT8_MAX // world
    if levels < 1:
        raise ValueError(f"int8_compress_hook: {world} ranks leave no int8 level per rank "
                         f"without overflowing the sum (at most {INT8_MAX} ranks); use "
                         "bf16_compress_hook")
    buffer = bucket.buffer()
    largest = buffer.detach().abs().max().to(torch.float32).reshape(1)
    # nan would vanish in a max over ranks; send it as inf, which stays
    largest = torch.where(torch.isnan(largest), torch.full_like(largest, float("inf")), largest)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    agreed = float(largest.item())
    if agreed != agreed or agreed == float("inf"):
        raise FloatingPointError(f"int8_compress_hook: bucket {bucket.index()} holds inf or "
                                 "nan on some rank; cannot quantise it")
    scale = agreed / levels if agreed > 0 else 1.0
    quantised = torch.round(buffer / scale).clamp_(-levels, levels).to(torch.int8)
    fut = dist.all_reduce(quantised, group=group, async_op=True).get_future()

    def dequantise(f: torch.futures.Future) -> torch.Tensor:
        return buffer.copy_(f.value()[0].to(buffer.dtype).mul_(scale / world))
    return fut.then(dequantise)
