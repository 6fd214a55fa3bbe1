"""``ringcomm env``: what a bug report needs to say about where ringcomm runs.

Versions, the platform, cores and this process's affinity, the cost profile in use, every
``RINGCOMM_*`` setting with its class (must match across ranks, agreed from rank 0, or
local) and what this host's links can use. Read-only: nothing is started or written.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from importlib import metadata


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cores() -> str:
    mine = sorted(os.sched_getaffinity(0))
    spans, start = [], mine[0] if mine else None
    for a, b in zip(mine, mine[1:] + [None], strict=True):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return f"{os.cpu_count()} on this machine, this process may use {len(mine)} ({','.join(spans)})"


def report() -> str:
    """The report, as lines of ``name: value`` under a few headings."""
    from .plan import cost
    from .transport import shm_ring
    from .transport.files import ipc_base

    lines = ["versions"]
    lines += [f"  {name}: {_version(dist)}" for name, dist in (
        ("ringcomm", "ringcomm"), ("torch", "torch"), ("numpy", "numpy"), ("pyzmq", "pyzmq"),
        ("ml_dtypes", "ml_dtypes"), ("mpi4py", "mpi4py"), ("cupy (cuda12x)", "cupy-cuda12x"),
        ("cupy (cuda13x)", "cupy-cuda13x"))]
    lines += [f"  python: {platform.python_version()} ({sys.executable})",
              "platform", f"  system: {platform.platform()}", f"  cores: {_cores()}"]
    path = cost.profile_path()
    found = "found" if path.exists() else "absent: the built-in defaults are used"
    lines += ["cost profile", f"  path: {path} ({found})",
              "  set RINGCOMM_PROFILE to use another; `ringcomm tune` writes one"]
    lines.append("settings (class: what happens when ranks differ; ! marks a problem)")
    lines += _settings_lines()
    from .transport.kinds import KINDS

    lines.append("link kinds, asked in this order for each pair (the first that serves it "
                 "links it; comm.describe() says which each pair got, and why)")
    for kind in KINDS:
        about = (sys.modules[kind.__module__].__doc__ or "").strip().split("\n\n")[0]
        lines.append(f"  {kind.name}: {' '.join(about.split())}")
    shm = shm_ring.available()
    free = shutil.disk_usage(shm_ring.SHM_DIR).free >> 20 if shm else 0
    lines += ["links on this host",
              f"  shared memory ({shm_ring.SHM_DIR}): "
              + (f"available, {free} MiB free" if shm else "unavailable: local pairs use sockets"),
              f"  named pipes and ipc sockets under: {ipc_base()}",
              "  between hosts: ZeroMQ tcp (address: init(host=), RINGCOMM_IFADDR, "
              "RINGCOMM_SOCKET_IFNAME, else the route to the store)",
              f"  the shared board's one-shot round: {_board_round()}"]
    lines += device_report()
    return "\n".join(lines)


def _board_round() -> str:
    """Whether the board's smallest allreduces run their compiled round here, and why not."""
    from .core import config
    from .transport import board

    built = board.compiled_round()
    if built is None:
        return ("in Python: not compiled (the install found no C compiler; with one, "
                "`pip install -e .` in ringcomm's checkout builds it)")
    reading = config.read("board_compiled")
    if reading.problem is not None:
        return "compiled, but RINGCOMM_BOARD_COMPILED's value is refused (! above)"
    if not reading.value:
        return "in Python (RINGCOMM_BOARD_COMPILED=0)"
    return f"compiled ({built})"


def _settings_lines() -> list[str]:
    """Every setting's variable with its value, then the other ``RINGCOMM_*`` variables
    set here; a value its setting refuses and a variable ringcomm does not know are
    flagged with what to do, since either would otherwise pass unnoticed in a long report."""
    from .core import config, variables

    lines = []
    for s in config.SETTINGS:
        if s.env is None:
            continue
        value = os.environ.get(s.env)
        shown = "unset" if value is None else "set (not shown)" if s.secret else repr(value)
        lines.append(f"  {s.env} = {shown}  [{s.scope.value}] {s.meaning} (default: "
                     f"{s.shown_default})")
        problem = config.read(s.name).problem
        if problem is not None:
            raw = "the value" if s.secret else repr(value)
            fate = "ignored" if s.name == "debug" else "ringcomm.init refuses it"
            lines.append(f"    ! invalid: {raw} {problem}; {fate}: unset it for the default "
                         f"({s.shown_default})")
    unknown = variables.unknown()
    for k in sorted(k for k in os.environ if k.startswith(variables.PREFIX)
                    and k not in variables.settings_variables()):
        reader = variables.OUTSIDE_THE_TABLE.get(k)
        lines.append(f"  {k} = {os.environ[k]!r}" + (f"  (read by {reader})" if reader else ""))
        if k in unknown:
            lines.append(f"    ! unknown: {variables.unknown_message(k, unknown[k])}")
    return lines


def problems() -> int:
    """How many ``RINGCOMM_*`` variables set here are refused or unknown (the report marks
    each with !)."""
    from .core import config, variables

    refused = sum(config.read(s.name).problem is not None for s in config.SETTINGS
                  if s.env is not None)
    return refused + len(variables.unknown())


def device_report() -> list[str]:
    """The device section: the device this process would propose, its runtime's versions,
    and the device engines a group would get."""
    from .core import config
    from .errors import ArgumentError
    from .plan.settings import device_mode

    lines = ["device"]
    try:
        mode = device_mode()
    except ArgumentError as err:
        return [*lines, f"  device: unusable setting: {err}"]
    asked = config.read("device").value
    lines.append(f"  device: {mode}" + (f" (from {asked})" if asked != mode else ""))
    if mode == "off":
        lines.append("  device arrays (CuPy, CUDA tensors) are staged through host memory "
                     "for the host engines")
        return lines
    from .core import device
    from .runtime.devices import named_runtime

    name = "cupy" if mode == "cuda" else "fake"
    try:
        runtime = named_runtime(name)
        about = runtime.describe()
    except ArgumentError as err:
        return [*lines, f"  runtime {name}: unavailable: {err}"]
    lines.append(f"  runtime: {runtime.name} (memory {runtime.memory!r})")
    lines += [f"    {key}: {value}" for key, value in about.items()]
    if not about.get("mps", "").startswith("on"):
        lines.append("  ranks that share one GPU without MPS take turns on it (every switch "
                     "between processes costs time); an MPS daemon lets their kernels run at "
                     "once (docs/gpu.md: MPS)")
    engine = config.read("device_engine").value
    lines.append("  device engines (RINGCOMM_DEVICE_ENGINE=" + engine + "): " + {
        "auto": "cuda-ipc where every rank is on one host, else staged; staged always",
        "cuda-ipc": "cuda-ipc (every rank must be on one host); staged always",
        "staged": "staged only",
        "nccl": "nccl only: every pair of ranks over NCCL's communicator",
        "cuda-kernel": "as auto, and the kernel path for allreduces, reduce-scatters and "
                       "all-gathers wherever every rank's kernels run at once, on any "
                       "runtime that can launch them"}[engine])
    nccl = device.nccl_library(runtime)
    lines.append(f"  nccl: {nccl.version() if nccl.available() else 'unavailable'} "
                 f"({nccl.name}; used where RINGCOMM_DEVICE_ENGINE=nccl)")
    return lines
