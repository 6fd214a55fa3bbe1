"""ddp: data parallelism built on the public torch.distributed and autograd APIs.

It runs over any process group (ringcomm, gloo, nccl), so the backends, and this DDP and
torch's, can be compared under the same training code.

- ``Reducer``: buckets, per-parameter hooks and the launch order; usable on its own.
- ``DistributedDataParallel``: the module wrapper (``no_sync``, ``join``, comm hooks,
  ``average="samples"`` for ranks with different batch sizes).
"""

from .buckets import GradBucket
from .module import DistributedDataParallel
from .reducer import Reducer, StepRecord

__all__ = ["DistributedDataParallel", "GradBucket", "Reducer", "StepRecord"]
