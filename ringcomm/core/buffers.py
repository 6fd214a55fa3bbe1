"""Flat views, and the names this module held before dtypes and partitions moved out.

``flat_view`` gives one zero-copy 1-D numpy view over what the caller hands us. A torch CPU
tensor enters as a view of its storage, bfloat16 through ``ml_dtypes``, so a reduction written
into the view is written into the caller's tensor. torch is never imported here: a tensor is
recognised by duck typing, so the core stays usable (and quick to import) without it.
"""

from __future__ import annotations

import sys
from typing import Any

# numpy first: without it, ml_dtypes fails with an ImportError that names no module
import numpy as np  # isort: split

import ml_dtypes

from ..errors import ArgumentError
from .dtypes import (  # noqa: F401 - the old import path of these names
    DTYPE_CODES,
    DTYPE_NAMES,
    REDUCE_OPS,
    ReduceOp,
    dtype_code,
    dtype_name,
    finish_reduction,
    reduce_into,
    reduce_op,
)
from .partition import Partition, segments  # noqa: F401 - the old import path

# --------------------------------------------------------------------------- flat views


def _is_torch_tensor(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def flat_view(x: Any, *, name: str = "tensor", writable: bool = True) -> np.ndarray:
    """A 1-D numpy view sharing memory with ``x`` (numpy array or torch CPU tensor).

    Refuses what cannot be viewed without a copy (non-contiguous, GPU, unsupported dtype),
    because writing results into a copy would lose them silently.
    """
    if _is_torch_tensor(x):
        return _torch_flat_view(x, name)
    if not isinstance(x, np.ndarray):
        raise ArgumentError(
            f"{name} must be a numpy array or a torch CPU tensor, got {type(x).__name__}"
        )
    if not x.flags.c_contiguous:
        raise ArgumentError(
            f"{name} is not contiguous; pass np.ascontiguousarray({name}) and copy results back"
        )
    if writable and not x.flags.writeable:
        raise ArgumentError(f"{name} is read-only but the op writes its result into it")
    dtype_code(x.dtype)
    return x.reshape(-1)


def _torch_flat_view(t: Any, name: str) -> np.ndarray:
    import torch  # already imported by the caller, or t would not be a tensor

    if t.device.type != "cpu":
        raise ArgumentError(
            f"{name} is on {t.device}; this communicator moves CPU buffers: use .cpu() "
            "or the CUDA (NCCL) channel"
        )
    if not t.is_contiguous():
        raise ArgumentError(
            f"{name} is not contiguous; pass {name}.contiguous() and copy results back"
        )
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).reshape(-1).numpy().view(ml_dtypes.bfloat16)
    try:
        arr = t.reshape(-1).numpy()
    except TypeError:
        raise ArgumentError(f"{name} has dtype {t.dtype}, which is not supported") from None
    dtype_code(arr.dtype)
    return arr
