"""ringcomm as a ``torch.distributed`` backend (see ``process_group``)."""

from .process_group import RingcommProcessGroup, RingcommWork, _autoload, _create, register

__all__ = ["RingcommProcessGroup", "RingcommWork", "register"]
__all__ += ["_autoload", "_create"]  # torch's hooks, not API
