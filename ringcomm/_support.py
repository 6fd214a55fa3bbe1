"""What ringcomm needs from where it runs: Linux, and the packages it imports.

Why a module of its own: without these checks a missing pyzmq shows up as a bare
``No module named 'zmq'`` from deep inside an import chain, and a Mac as an AttributeError on
``os.sched_getaffinity`` halfway through a rendezvous. Both are cheap to say up front. It is
light on purpose (the standard library and ``ringcomm.errors`` only), so ``import ringcomm``
and the ``torch.backends`` entry point can use it without loading numpy, zmq or torch.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import CommError

# import name -> the name pip installs it under
DEPENDENCIES = {"zmq": "pyzmq", "numpy": "numpy", "ml_dtypes": "ml_dtypes", "torch": "torch"}


class MissingDependencyError(ModuleNotFoundError):
    """A package ringcomm needs cannot be imported; the message names it and how to install it.

    A ``ModuleNotFoundError``, so code that already catches that (or ``ImportError``) still does.
    """


class UnsupportedPlatformError(CommError):
    """ringcomm runs on Linux only (it relies on ``os.mkfifo``, /dev/shm and
    ``os.sched_getaffinity``)."""


def check_platform() -> None:
    """Raise ``UnsupportedPlatformError`` unless this is Linux, before anything else is done."""
    if not sys.platform.startswith("linux"):
        raise UnsupportedPlatformError(
            f"ringcomm runs on Linux only: it relies on os.mkfifo, /dev/shm and "
            f"os.sched_getaffinity, and this platform is {sys.platform!r}. Run it on Linux (a "
            f"Linux machine, a container, or WSL 2 on Windows); for torch.distributed here, "
            f"use the gloo backend instead")


def import_core(module: str) -> ModuleType:
    """Import a ringcomm module that needs the dependencies (``ringcomm.bootstrap.rendezvous``...).

    A dependency that cannot be imported becomes a ``MissingDependencyError`` that says which
    package to install; any other import error propagates unchanged.
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = (err.name or "").partition(".")[0]
        package = DEPENDENCIES.get(top)
        if package is None or isinstance(err, MissingDependencyError):
            raise
        raise MissingDependencyError(
            f"ringcomm needs {package} (import name {top!r}), which could not be imported: "
            f"{err}. Install it with `pip install {package}`, or reinstall ringcomm "
            f"(`{install_hint()}` pulls in all its dependencies)", name=top) from err


def install_hint(extra: str | None = None) -> str:
    """The command that installs ringcomm with ``extra`` (None: its dependencies alone):
    ringcomm is installed from its checkout, editable."""
    what = "." if extra is None else f"'.[{extra}]'"
    return f"pip install -e {what} in ringcomm's checkout"


def configure_logging(level: str | None) -> None:
    """``RINGCOMM_DEBUG=INFO|DEBUG`` (like ``NCCL_DEBUG``; read through the settings table):
    the ``ringcomm`` logger at ``level``, printing to stderr unless the program configured a
    handler of its own. INFO: one line per rank when a group starts (host, links, agreed
    settings, versions); DEBUG: one line per op as well (op, bytes, algorithm, time)."""
    import logging

    if not level:
        return
    logger = logging.getLogger("ringcomm")
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("ringcomm %(levelname)s: %(message)s"))
        logger.addHandler(handler)
