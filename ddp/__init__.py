"""ddp: data parallelism built on the public torch.distributed and autograd APIs.

It runs over any process group (ringcomm, gloo, nccl), so the backends, and this DDP and
torch's, can be compared under the same training code.

- ``Reducer``: buckets, per-parameter hooks and the launch order; usable on its own.
- ``DistributedDataParallel``: the module wrapper (``no_sync``, ``join``, comm hooks,
  ``average="samples"`` for ranks with different batch sizes).
- ``SyncBatchNorm``: batch statistics over every rank's samples, on CPU too.
- ``hooks``: ``allreduce_hook`` and the fp16, bf16 and int8 compression hooks.
"""

from . import hooks
from .buckets import GradBucket
from .module import DistributedDataParallel
from .reducer import Reducer, StepRecord
from .sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedDataParallel", "GradBucket", "Reducer", "StepRecord", "SyncBatchNorm",
           "hooks"]
