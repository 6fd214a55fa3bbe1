"""ringcomm: collective communication you can read.

    import ringcomm
    comm = ringcomm.init()                 # under torchrun, or init(rank=, world_size=, store=)
    comm.allreduce(x, op="sum")            # numpy array or CPU tensor, in place

A collective is a *schedule* (``ringcomm.algorithms``), executed over *channels*
(``ringcomm.channels``) by the executor; ``print(schedule)`` shows it step by step.
"""

import importlib.abc
import importlib.util
import sys
from typing import Any

from .communicator import Communicator, Work
from .errors import (
    ArgumentError,
    CommAborted,
    CommError,
    CommTimeout,
    DesyncError,
    PeerLostError,
    RemoteError,
    StoreError,
    StoreTimeout,
)
from .rendezvous import init

__version__ = "0.1.0"


def _register_torch_backend() -> None:
    """Make ``init_process_group("ringcomm")`` work once ringcomm is imported.

    Registering needs torch.distributed, and importing torch costs seconds that users of
    the core alone should not pay. So: register now if torch is already loaded, else right
    after it loads (the ``torch.backends`` entry point does that too, where ringcomm is
    installed and autoloading is on; registering twice is harmless).
    """
    if "torch.distributed" in sys.modules:
        from .torch_backend import _autoload

        _autoload()
    elif not any(isinstance(f, _AfterTorch) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTorch())


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Runs ``_register_torch_backend`` once ``import torch`` has finished."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register_torch_backend()

        spec.loader.exec_module = exec_module
        return spec


_register_torch_backend()

__all__ = [
    "ArgumentError",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "Communicator",
    "DesyncError",
    "PeerLostError",
    "RemoteError",
    "StoreError",
    "StoreTimeout",
    "Work",
    "init",
]
