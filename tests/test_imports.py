"""Importing torch never breaks because of ringcomm, in any import order.

Every order runs in a fresh interpreter: torch calls the ``torch.backends`` entry point from
inside ``import torch``, once per process, so only a new process shows what a user sees. The
entry point (``ringcomm.torch_entry``) must load nothing heavy and must never raise; the
backend itself (``ringcomm.torch_backend``) loads when a group is created, and a missing
dependency or an unsupported platform is reported there, by name.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from importlib.metadata import entry_points

import pytest

import ringcomm
from ringcomm import _support, torch_entry

# a `-c` prelude that makes one top-level package unimportable, as if it were not installed
BLOCK = """
import importlib.abc, sys
class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == {top!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Missing())
"""

# registered, through the light creator, and the heavy backend module not loaded yet
CHECK_REGISTERED = """
import sys, torch.distributed as dist
plugin = dist.Backend._plugins["RINGCOMM"]
assert "ringcomm" in dist.Backend.backend_list, dist.Backend.backend_list
assert plugin.creator_fn.__module__ == "ringcomm.torch_entry", plugin.creator_fn
assert "ringcomm.torch_backend" not in sys.modules or {backend_loaded!r}
print("registered")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, cwd, autoload: str = "1") -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (outside the checkout, so the installed ringcomm
    and its entry point are what is imported); fail with its output if it fails."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "could not register" not in proc.stderr, proc.stderr
    return proc


# --------------------------------------------------------------------------- the interpreters
# Each test below checks what one fresh interpreter printed: its code is in INTERPRETERS under
# the test's name. They are started, two at a time, as the module begins (``interpreters``):
# one interpreter importing torch leaves a second core idle, and the tests then mostly read
# what has already finished.


def _missing_dependency(top: str) -> str:
    """``import torch`` with ``top`` unimportable; what ``ringcomm.init`` and
    ``init_process_group("ringcomm")`` raise."""
    port, port2 = _free_port(), _free_port()
    return BLOCK.format(top=top) + f"""
import json, sys
import torch
import torch.distributed as dist
import ringcomm
assert "RINGCOMM" in dist.Backend._plugins
errors = []
try:
    ringcomm.init(rank=0, world_size=1, store="127.0.0.1:{port}")
except ImportError as e:
    errors.append([type(e).__name__, str(e)])
try:
    dist.init_process_group("ringcomm", rank=0, world_size=1,
                            init_method="tcp://127.0.0.1:{port2}")
except ImportError as e:
    errors.append([type(e).__name__, str(e)])
print(json.dumps(errors))
"""


IMPORT_IS_CHEAP = """
import sys, ringcomm
print(sorted(m for m in ("zmq", "torch", "numpy", "ml_dtypes") if m in sys.modules))
assert {"Communicator", "Work", "init"} <= set(dir(ringcomm)), dir(ringcomm)
assert ringcomm.Communicator.__module__ == "ringcomm.runtime.communicator"
assert ringcomm.Work.__module__ == "ringcomm.runtime.work"
assert ringcomm.init.__module__ == "ringcomm.bootstrap.rendezvous"
assert ringcomm.schedules.__name__ == "ringcomm.schedules"  # submodules as before
from ringcomm import *  # noqa
assert init is ringcomm.init
try:
    ringcomm.no_such_name
except AttributeError:
    print("ok")
"""

# test name -> (its code, TORCH_DEVICE_BACKEND_AUTOLOAD); a function for a code that takes
# free ports, chosen when the interpreter starts
INTERPRETERS = {
    "test_importing_the_backend_module_first": (
        lambda: "import ringcomm.torch_backend\n"
        + CHECK_REGISTERED.format(backend_loaded=True), "1"),
    **{f"test_torch_then_ringcomm[{autoload}]": (
        lambda: "import torch\nimport ringcomm\n"
        + CHECK_REGISTERED.format(backend_loaded=False), autoload) for autoload in "10"},
    **{f"test_ringcomm_then_torch[{autoload}]": (
        lambda: "import sys, ringcomm\nassert 'torch' not in sys.modules\nimport torch\n"
        + CHECK_REGISTERED.format(backend_loaded=False), autoload) for autoload in "10"},
    "test_the_entry_point_registers_without_importing_ringcomm": (
        lambda: CHECK_REGISTERED.format(backend_loaded=False)
        + "print(sorted(m for m in ('zmq', 'ml_dtypes') if m in sys.modules))", "1"),
    "test_import_ringcomm_is_cheap": (lambda: IMPORT_IS_CHEAP, "1"),
    **{f"test_a_missing_dependency_leaves_import_torch_clean[{top}-{package}]": (
        lambda top=top: _missing_dependency(top), "1")
        for top, package in [("zmq", "pyzmq"), ("numpy", "numpy"), ("ml_dtypes", "ml_dtypes")]},
}


@pytest.fixture(scope="module")
def interpreters(request, tmp_path_factory):
    """The interpreters of the module's tests that this session runs, started two at a
    time; each test's ``Future`` under its name (its result, or its failure, as ``_run``
    gives them)."""
    names = [item.name for item in request.session.items
             if item.module is request.module and item.name in INTERPRETERS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        started: dict[str, Future] = {}
        for name in names:
            make, autoload = INTERPRETERS[name]
            started[name] = pool.submit(_run, make(), tmp_path_factory.mktemp("imports"),
                                        autoload)
        yield started
        for future in started.values():
            future.cancel()


def _output(interpreters, request) -> subprocess.CompletedProcess:
    return interpreters[request.node.name].result()


# --------------------------------------------------------------------------- import orders


@pytest.mark.timeout(70)
def test_importing_the_backend_module_first(interpreters, request):
    """Was an import cycle: the entry point ran on a half-initialised torch_backend and
    ``import torch`` raised "Failed to load the backend extension: ringcomm"."""
    assert _output(interpreters, request).stdout.split() == ["registered"]


@pytest.mark.timeout(70)
@pytest.mark.parametrize("autoload", ["1", "0"])
def test_torch_then_ringcomm(interpreters, request, autoload):
    """Registered by the entry point, or (autoload off) by ``import ringcomm`` itself."""
    assert _output(interpreters, request).stdout.split() == ["registered"]


@pytest.mark.timeout(70)
@pytest.mark.parametrize("autoload", ["1", "0"])
def test_ringcomm_then_torch(interpreters, request, autoload):
    """``import ringcomm`` loads no torch; the hook registers right after ``import torch``."""
    assert _output(interpreters, request).stdout.split() == ["registered"]


@pytest.mark.timeout(70)
def test_the_entry_point_registers_without_importing_ringcomm(interpreters, request):
    installed = [e.value for e in entry_points(group="torch.backends") if e.name == "ringcomm"]
    assert installed == ["ringcomm.torch_entry:_autoload"], (
        "the installed torch.backends entry point is stale: reinstall ringcomm "
        "(pip install -e .), pyproject.toml declares it")
    assert _output(interpreters, request).stdout.split() == ["registered", "[]"]


@pytest.mark.timeout(70)
def test_import_ringcomm_is_cheap(interpreters, request):
    """No zmq, torch or numpy on ``import ringcomm``; the lazy names still resolve."""
    assert _output(interpreters, request).stdout.split() == ["[]", "ok"]


# --------------------------------------------------------------------------- a missing dependency


@pytest.mark.timeout(70)
@pytest.mark.parametrize("top,package", [("zmq", "pyzmq"), ("numpy", "numpy"),
                                         ("ml_dtypes", "ml_dtypes")])
def test_a_missing_dependency_leaves_import_torch_clean(interpreters, request, top, package):
    """``import torch`` works and registers the backend; ``ringcomm.init`` and
    ``init_process_group("ringcomm")`` say which package to install."""
    proc = _output(interpreters, request)
    assert "Failed to load the backend extension" not in proc.stderr, proc.stderr
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(errors) == 2, proc.stdout
    for kind, message in errors:
        assert kind == "MissingDependencyError"
        assert f"ringcomm needs {package}" in message and f"pip install {package}" in message
        assert "pip install -e . in ringcomm's checkout" in message


# --------------------------------------------------------------------------- in process


@pytest.mark.timeout(20)
@pytest.mark.parametrize("platform", ["darwin", "win32"])
def test_an_unsupported_platform_is_named_before_anything_else(monkeypatch, platform):
    monkeypatch.setattr(sys, "platform", platform)
    port = _free_port()
    with pytest.raises(_support.UnsupportedPlatformError, match="Linux only") as info:
        ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{port}")
    assert isinstance(info.value, ringcomm.CommError) and platform in str(info.value)
    with socket.socket() as s:  # nothing was started: the store's port is still free
        s.bind(("127.0.0.1", port))
    with pytest.raises(_support.UnsupportedPlatformError):  # torch's creator: the same
        torch_entry._create(object())


@pytest.mark.timeout(20)
def test_the_entry_point_never_raises(monkeypatch, caplog):
    import torch.distributed as dist

    def broken(*args, **kwargs):
        raise RuntimeError("registry is broken")

    monkeypatch.setattr(dist.Backend, "register_backend", broken)
    torch_entry._autoload()  # an exception here would break every `import torch`
    assert "could not register" in caplog.text
    caplog.clear()
    monkeypatch.setattr(dist, "is_available", lambda: False)
    torch_entry._autoload()  # torch without distributed: nothing to register, nothing said
    assert caplog.text == ""
