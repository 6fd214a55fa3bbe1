"""The names this module held before it was split: dtypes and reductions now live in
``ringcomm.core.dtypes``, partitions in ``ringcomm.core.partition``, and the flat views of
arrays became the buffer protocol (``ringcomm.core.arrays``). Import from those."""

from .dtypes import (  # noqa: F401 - re-exported under the old path
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
from .partition import Partition, segments  # noqa: F401 - re-exported under the old path
