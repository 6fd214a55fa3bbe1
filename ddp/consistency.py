"""Checks that every rank holds the same model and the same buckets, before anything is summed.

A collective sums bytes; it cannot know that rank 1's third gradient belongs to another
layer than rank 0's. Both checks below gather what each rank has and compare it with rank
0's on every rank, so every rank raises the same error, naming the first difference and the
ranks that differ, instead of some ranks hanging in the next collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def describe(name: str, tensor: Any) -> tuple:
    """What must match across ranks about one parameter or buffer (never its values)."""
    if not isinstance(tensor, torch.Tensor):
        return (name, f"not a tensor: {type(tensor).__name__}")
    return (name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."),
            bool(tensor.requires_grad))


def _show(entry: tuple) -> str:
    if len(entry) == 2:
        return f"{entry[0]!r} ({entry[1]})"
    name, shape, dtype, requires_grad = entry
    return (f"{name!r} of shape {shape} and dtype {dtype}"
            f"{'' if requires_grad else ' (no gradient)'}")


def verify_same_across_ranks(entries: Sequence[tuple], group: Any, what: str) -> None:
    """Raise ``ValueError`` on every rank unless every rank passed the same ``entries``.

    ``entries`` come from ``describe``; ``what`` names them in the message ("parameter").
    One ``all_gather_object``: names travel too, so the message can say which tensor.
    """
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, list(entries), group=group)
    reference = gathered[0]
    differing = [r for r in range(world) if gathered[r] != reference]
    if not differing:
        return
    first = differing[0]
    mine = gathered[first]
    others = ", ".join(map(str, differing))
    for i, (a, b) in enumerate(zip(reference, mine, strict=False)):
        if a != b:
            detail = (f"{what} {i} is {_show(a)} on rank 0 but {_show(b)} on rank {first}")
            break
    else:
        longer, extra = (0, reference) if len(reference) > len(mine) else (first, mine)
        first_extra = _show(extra[min(len(reference), len(mine))])
        detail = (f"rank 0 has {len(reference)} {what}s and rank {first} {len(mine)}; the "
                  f"first one only rank {longer} has is {first_extra}")
    raise ValueError(f"ddp: the model differs across ranks: {detail} (ranks differing from "
                     f"rank 0: {others}). Every rank must build the same model, in the same "
                     "order, before wrapping it.")


def verify_layout_across_ranks(fingerprint: int, group: Any, device: torch.device,
                               when: str) -> None:
    """Raise ``RuntimeError`` on every rank unless every rank's bucket layout has the same
    fingerprint (``buckets.layout_fingerprint``). One ``all_gather`` of one int64."""
    world = dist.get_world_size(group)
    mine = torch.tensor([fingerprint], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    values = [int(t.item()) for t in everyone]
    differing = [r for r, v in enumerate(values) if v != values[0]]
    if differing:
        raise RuntimeError(
            f"ddp: the bucket layout differs across ranks {when}: ranks "
            f"{', '.join(map(str, differing))} would reduce other parameters together than "
            f"rank 0 (fingerprints {', '.join(f'{v:#x}' for v in values)}). Pass the same "
            "bucket_cap_mb and first_bucket_mb everywhere; the parameters themselves matched "
            "at construction.")
