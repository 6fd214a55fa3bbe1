"""ringcomm: collective communication you can read.

    import ringcomm
    comm = ringcomm.init()                 # under torchrun, or init(rank=, world_size=, store=)
    comm.allreduce(x, op="sum")            # numpy array or CPU tensor, in place

A collective is a *schedule* (``ringcomm.schedules``), executed over *links*
(``ringcomm.transport``) by the executor; ``print(schedule)`` shows it step by step.

``import ringcomm`` is cheap on purpose: it loads only the errors. ``Communicator``, ``Work``
and ``init`` (which need numpy, pyzmq and ml_dtypes) load on first use, so importing
ringcomm never imports torch or zmq, no import order forms a cycle, and a missing dependency
is reported by name when it is needed (``MissingDependencyError``), not by a failed import.
"""

import importlib.abc
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from .errors import (
    ArgumentError,
    AuthError,
    ChecksumError,
    CommAborted,
    CommError,
    CommTimeout,
    DesyncError,
    PeerLostError,
    RecordError,
    RemoteError,
    StoreError,
    StoreTimeout,
)

if TYPE_CHECKING:
    from .bootstrap.rendezvous import init
    from .runtime.communicator import Communicator
    from .runtime.work import Work

from ._support import configure_logging  # noqa: E402 - stdlib only
from ._version import __version__ as __version__  # noqa: E402 - written in one place
from .core import config as _config  # noqa: E402 - stdlib only

# names loaded on first use (PEP 562) -> the module that defines them
_LAZY = {"Communicator": "runtime.communicator", "Work": "runtime.work",
         "init": "bootstrap.rendezvous"}


def __getattr__(name: str) -> Any:
    """Load ``Communicator``, ``Work`` and ``init`` (and submodules) on first access.

    Why lazily: they import numpy and zmq, which ``import ringcomm`` (and so the torch entry
    point) must not. A missing dependency raises ``MissingDependencyError`` naming it.
    """
    from ._support import import_core

    if name in _LAZY:
        value = getattr(import_core(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    # `import ringcomm; ringcomm.schedules` worked when the package imported everything
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return import_core(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """List the lazy names too, as if they were loaded."""
    return sorted(set(globals()) | set(_LAZY))


def _register_torch_backend() -> None:
    """Make ``init_process_group("ringcomm")`` work once ringcomm is imported.

    Registering needs torch.distributed, and importing torch costs seconds that users of
    the core alone should not pay. So: register now if torch is already loaded, else right
    after it loads (the ``torch.backends`` entry point does that too, where ringcomm is
    installed and autoloading is on; registering twice is harmless). Both go through
    ``ringcomm.torch_entry``, which loads the backend itself only when a group is created.
    """
    if sys.modules.get("torch") is not None:
        from .torch_entry import _autoload

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

        # this one loader's exec_module, wrapped: the hook runs once torch has loaded
        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _debug_level() -> str | None:
    """``RINGCOMM_DEBUG`` from the settings table; a value it refuses is warned about and
    ignored, since an import must not fail over a log level."""
    reading = _config.read("debug")
    if reading.problem is not None:
        import warnings

        warnings.warn(f"RINGCOMM_DEBUG={reading.raw!r} {reading.problem}; ignored",
                      stacklevel=3)
    level: str | None = reading.value
    return level


_register_torch_backend()
configure_logging(_debug_level())

__all__ = [
    "ArgumentError",
    "AuthError",
    "ChecksumError",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "Communicator",
    "DesyncError",
    "PeerLostError",
    "RecordError",
    "RemoteError",
    "StoreError",
    "StoreTimeout",
    "Work",
    "init",
]
