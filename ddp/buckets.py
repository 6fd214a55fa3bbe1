"""Buckets: which parameters share one flat gradient tensor, and in which order they go out.

One allreduce per parameter would pay a message's fixed cost hundreds of times per step; one
allreduce for the whole model could only start once backward is over. A bucket sits in
between: a flat tensor holding the gradients of a few parameters that tend to become ready
together, all-reduced as soon as the last of them is in, while backward computes the rest.

The assignment follows torch's ``compute_bucket_assignment_by_size``: walk the parameters in
the order their gradients are expected, keep one open bucket per (device, dtype), close a
bucket once it holds ``cap`` bytes (``first_cap`` for the first bucket of each kind, small
so the first allreduce starts early), and launch buckets in the order their first parameter
comes. Before any gradient has been seen the expected order is the reverse of registration
order (backward usually runs the model back to front); ``Reducer`` replaces it with the
order it observes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: dtypes whose bucket can carry the Reducer's small integer bookkeeping exactly
CONTROL_DTYPES = (torch.float32, torch.float64)


def assign_buckets(params: Sequence[torch.Tensor], order: Sequence[int], cap_bytes: int,
                   first_cap_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, buckets in launch order.

    ``order`` lists every parameter index once, the one expected to be ready first first.
    A bucket may exceed its cap by its last parameter (a parameter is never split).
    """
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"order must list each of the {len(params)} parameters once")
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    caps: dict[tuple, int] = {}
    closed: list[list[int]] = []
    for i in order:
        p = params[i]
        kind = (p.device, p.dtype)
        bucket = open_buckets.setdefault(kind, [])
        bucket.append(i)
        open_bytes[kind] = open_bytes.get(kind, 0) + p.numel() * p.element_size()
        if open_bytes[kind] >= caps.setdefault(kind, first_cap_bytes):
            closed.append(bucket)
            del open_buckets[kind]
            open_bytes[kind] = 0
            caps[kind] = cap_bytes
    closed.extend(b for b in open_buckets.values() if b)
    position = {i: n for n, i in enumerate(order)}
    closed.sort(key=lambda b: position[b[0]])
    return closed


def layout_fingerprint(layout: Sequence[Sequence[int]], params: Sequence[torch.Tensor]) -> int:
    """A 63-bit digest of the layout and of the shape and dtype of every parameter in it.

    Ranks compare digests after every (re)build: two ranks whose buckets hold different
    parameters would otherwise add unrelated gradients without any error where the sizes
    happen to match (gloo checks nothing else).
    """
    text = ";".join(",".join(f"{i}:{tuple(params[i].shape)}:{params[i].dtype}" for i in b)
                    for b in layout)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True)
class ControlSlots:
    """Where the Reducer's per-step bookkeeping sits in a small float vector summed across
    ranks: ranks taking part (joined ranks send 0), the local batch size (for
    ``average="samples"``), the number of ranks that saw the gradient order change, and one
    "used in this step" entry per parameter (with ``find_unused_parameters``)."""

    num_params: int
    with_used_mask: bool

    ACTIVE = 0
    BATCH = 1
    ORDER_CHANGED = 2
    USED = 3

    @property
    def size(self) -> int:
        return self.USED + (self.num_params if self.with_used_mask else 0)


class Bucket:
    """One flat tensor: the gradients of ``param_indices`` back to back (``views`` shaped like
    the parameters), then ``control_size`` slots of bookkeeping where the Reducer fuses it
    into this bucket's allreduce."""

    def __init__(self, index: int, param_indices: Sequence[int], params: Sequence[torch.Tensor],
                 control_size: int = 0) -> None:
        members = [params[i] for i in param_indices]
        self.index = index
        self.param_indices = list(param_indices)
        self.dtype = members[0].dtype
        self.device = members[0].device
        self.grad_numel = sum(p.numel() for p in members)
        self.flat = torch.zeros(self.grad_numel + control_size, dtype=self.dtype,
                                device=self.device)
        self.grads = self.flat[:self.grad_numel]
        self.control = self.flat[self.grad_numel:]
        self._shapes = [p.shape for p in members]
        self.views = self.views_of(self.flat)

    def views_of(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views into ``flat`` (shaped like this bucket's ``flat``), one per parameter."""
        views, offset = [], 0
        for shape in self._shapes:
            n = shape.numel()
            views.append(flat[offset:offset + n].view(shape))
            offset += n
        return views

    def __repr__(self) -> str:
        return (f"Bucket({self.index}, params={self.param_indices}, {self.dtype}, "
                f"{self.grad_numel * self.flat.element_size() / 2**20:.2f} MiB)")


class GradBucket:
    """What a communication hook sees of a bucket: the same methods as torch's
    ``dist.GradBucket``, so torch's own hooks (``default_hooks.fp16_compress_hook``) and ours
    run on either DDP."""

    __slots__ = ("_index", "_buffer", "_is_last", "_params", "_grads")

    def __init__(self, index: int, buffer: torch.Tensor, is_last: bool,
                 params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        self._index, self._buffer, self._is_last = index, buffer, is_last
        self._params, self._grads = params, grads

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The bucket's gradients, flat; a hook's result replaces them."""
        return self._buffer

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        """Views into ``buffer()`` shaped like ``parameters()``."""
        return self._grads

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)
