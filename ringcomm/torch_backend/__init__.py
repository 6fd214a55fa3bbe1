"""ringcomm as a ``torch.distributed`` backend: the process group (``process_group``), the
torch handles of its ops (``work``), how tensors become buffers (``tensors``), and how torch
makes one (``registration``)."""

from .process_group import RingcommProcessGroup
from .registration import _autoload, _create, register
from .work import RingcommWork

__all__ = ["RingcommProcessGroup", "RingcommWork", "register"]
__all__ += ["_autoload", "_create"]  # torch's hooks, not API
