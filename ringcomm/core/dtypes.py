"""Dtypes and reductions: what a wire byte means, and which ops make sense for which dtypes.

One byte names a dtype on the wire, so a receiver can tell float32 from int32; bfloat16
comes from ``ml_dtypes``. The reduction table says which ops are defined for which dtypes; a
bad pair is refused here, before a single byte is sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# numpy first: without it, ml_dtypes fails with an ImportError that names no module
import numpy as np  # isort: split

import ml_dtypes

from ..errors import ArgumentError

# One byte identifies a dtype on the wire, so a receiver can tell float32 from int32.
_DTYPES: list[tuple[str, np.dtype]] = [
    ("float32", np.dtype(np.float32)),
    ("float64", np.dtype(np.float64)),
    ("float16", np.dtype(np.float16)),
    ("bfloat16", np.dtype(ml_dtypes.bfloat16)),
    ("int8", np.dtype(np.int8)),
    ("int16", np.dtype(np.int16)),
    ("int32", np.dtype(np.int32)),
    ("int64", np.dtype(np.int64)),
    ("uint8", np.dtype(np.uint8)),
    ("bool", np.dtype(np.bool_)),
    ("complex64", np.dtype(np.complex64)),
    ("complex128", np.dtype(np.complex128)),
]
DTYPE_CODES: dict[np.dtype, int] = {dt: code for code, (_, dt) in enumerate(_DTYPES)}
DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in _DTYPES}


def dtype_code(dtype: np.dtype) -> int:
    """The one-byte wire code of a supported dtype."""
    code = DTYPE_CODES.get(dtype)  # a numpy dtype, as every op has: no conversion (slow)
    if code is not None:
        return code
    try:
        return DTYPE_CODES[np.dtype(dtype)]
    except KeyError:
        supported = ", ".join(name for name, _ in _DTYPES)
        raise ArgumentError(f"dtype {dtype} is not supported; use one of: {supported}") from None


def dtype_name(code_or_dtype: int | np.dtype) -> str:
    if isinstance(code_or_dtype, int):
        known = 0 <= code_or_dtype < len(_DTYPES)
        return _DTYPES[code_or_dtype][0] if known else f"?{code_or_dtype}"
    name = DTYPE_NAMES.get(np.dtype(code_or_dtype))  # no str() unless unknown: it is slow
    return name if name is not None else str(code_or_dtype)


# --------------------------------------------------------------------------- reductions

_FLOATS = {"float16", "bfloat16", "float32", "float64"}
_COMPLEX = {"complex64", "complex128"}
_INTS = {"int8", "int16", "int32", "int64", "uint8"}


@dataclass(frozen=True)
class ReduceOp:
    """A reduction: the ufunc that combines two buffers, and the dtypes it is defined for.

    ``avg`` reduces with ``sum`` and divides once, where the reduction of a chunk completes.
    """

    name: str
    code: int
    ufunc: np.ufunc
    dtypes: frozenset[str]
    divides: bool = False


_ALL_NUMERIC = frozenset(_FLOATS | _INTS | _COMPLEX)
REDUCE_OPS: dict[str, ReduceOp] = {
    op.name: op
    for op in (
        ReduceOp("sum", 0, np.add, _ALL_NUMERIC | {"bool"}),
        ReduceOp("prod", 1, np.multiply, _ALL_NUMERIC | {"bool"}),
        ReduceOp("min", 2, np.minimum, frozenset(_FLOATS | _INTS | {"bool"})),
        ReduceOp("max", 3, np.maximum, frozenset(_FLOATS | _INTS | {"bool"})),
        ReduceOp("avg", 4, np.add, frozenset(_FLOATS | _COMPLEX), divides=True),
        ReduceOp("band", 5, np.bitwise_and, frozenset(_INTS | {"bool"})),
        ReduceOp("bor", 6, np.bitwise_or, frozenset(_INTS | {"bool"})),
        ReduceOp("bxor", 7, np.bitwise_xor, frozenset(_INTS | {"bool"})),
    )
}
_OP_ALIASES = {"product": "prod", "mean": "avg", "minimum": "min", "maximum": "max"}


def reduce_op(name: str | ReduceOp, dtype: np.dtype) -> ReduceOp:
    """Look up ``name`` and check it is defined for ``dtype``; raise a clear error if not."""
    if isinstance(name, ReduceOp):
        op = name
    else:
        key = _OP_ALIASES.get(str(name).lower(), str(name).lower())
        if key not in REDUCE_OPS:
            raise ArgumentError(
                f"unknown reduce op {name!r}; use one of: {', '.join(REDUCE_OPS)}"
            )
        op = REDUCE_OPS[key]
    dname = dtype_name(dtype)
    if dname not in op.dtypes:
        fits = ", ".join(sorted(op.dtypes))
        raise ArgumentError(
            f"reduce op {op.name!r} is not defined for {dname}; it takes: {fits}"
        )
    return op


def reduce_into(dst: np.ndarray, a: np.ndarray, b: Any, op: ReduceOp) -> None:
    """``dst = a (op) b`` elementwise; ``b`` may be any buffer (a received frame) of dst's dtype."""
    if not isinstance(b, np.ndarray) or b.dtype != dst.dtype:
        b = np.frombuffer(b, dtype=dst.dtype)
    op.ufunc(a, b, out=dst)


def finish_reduction(dst: np.ndarray, op: ReduceOp, world_size: int) -> None:
    """Apply what remains once a region is fully reduced: ``avg`` divides by the world size."""
    if op.divides and world_size > 1:
        np.divide(dst, world_size, out=dst, casting="unsafe")
