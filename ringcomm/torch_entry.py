"""The ``torch.backends`` entry point: ``import torch`` calls ``_autoload`` here.

Why a module of its own, this small: torch runs the entry point while ``import torch`` is
still executing, and turns any exception from it into a failed ``import torch`` for every
program in the environment. So this module imports only the standard library when it loads
(not numpy, zmq, torch or the rest of ringcomm), registers a creator that imports the real
backend (``ringcomm.torch_backend``) only when a group is created, and logs instead of
raising. Importing the backend from the entry point formed an import cycle with
``import ringcomm.torch_backend``, and broke ``import torch`` where a dependency is missing.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("ringcomm")

BACKEND_NAME = "ringcomm"


def _create(opts: Any, backend_options: Any = None) -> Any:
    """torch's factory for a "ringcomm" group: load the backend now that it is needed.

    On a platform ringcomm does not support, or with a dependency missing, this raises an
    error that says so (``UnsupportedPlatformError``, ``MissingDependencyError``).
    """
    from ._support import check_platform, import_core

    check_platform()
    backend = import_core("ringcomm.torch_backend")
    return backend._create(opts, backend_options)


def register() -> None:
    """Make ``"ringcomm"`` a ``torch.distributed`` backend (idempotent).

    Imports ``torch.distributed``; does nothing where torch is built without it.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return
    try:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    except AssertionError:
        # torch before 2.5 refuses a second registration; ours being there already is fine
        plugin = getattr(dist.Backend, "_plugins", {}).get(BACKEND_NAME.upper())
        if getattr(plugin, "creator_fn", None) is not _create:
            raise


def _autoload() -> None:
    """The entry point in the ``torch.backends`` group, called by ``import torch``.

    It must never raise: torch turns an exception here into a failed ``import torch``.
    """
    try:
        register()
    except Exception:  # noqa: BLE001 - see the docstring
        log.warning("could not register the ringcomm torch.distributed backend",
                    exc_info=True)
