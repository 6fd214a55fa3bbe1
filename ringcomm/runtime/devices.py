"""A group's device side, made once when the group is set up: the device runtime its
settings name, and the device lanes (channel, stream, scratch) its device engines run on.

Why here and not in the wiring: a device channel owns device memory and, for CUDA IPC,
exchanges handles with every peer, so it is made once per group, collectively, and closed
once (after the worker stops); the engines over it are made again whenever wrappers change
(``ringcomm.engines.wrapping.Wiring``). Every rank decides which channels to make from what
the ranks agreed (settings, every rank's host), so every rank makes the same ones.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from ..core import device as devices
from ..core.algorithms import CUDA_IPC, CUDA_KERNEL, NCCL, STAGED
from ..core.device.runtime import DeviceRuntime
from ..engines.cuda_ipc import IpcChannel
from ..engines.device import DeviceLane
from ..engines.device_channel import Exchange
from ..engines.kernel import KernelChannel
from ..engines.nccl import NcclChannel, open_channel
from ..engines.staged import StagedChannel
from ..errors import ArgumentError
from ..plan.kernel_path import Verdict, kernel_path
from ..plan.settings import Settings
from ..plan.topology import Topology
from ..transport.base import Transport

log = logging.getLogger("ringcomm")

_RUNTIME_OF_MODE = {"cuda": "cupy", "fake": "fake"}


def runtime_name(mode: str) -> str | None:
    """The device runtime a device mode runs on ("cuda" -> "cupy", "fake" -> "fake"; None
    for "off")."""
    return _RUNTIME_OF_MODE.get(mode)


def named_runtime(name: str) -> DeviceRuntime:
    """The process-wide runtime ``name`` ("cupy" or "fake"), loading the fake's package
    (``ringcomm.testing``, which registers it) when it is the one asked for."""
    if name == "fake":
        import ringcomm.testing  # noqa: F401 - registers the fake runtime
    return devices.runtime(name)


def gpu_facts(mode: str | None) -> dict[str, Any]:
    """This rank's GPU facts for the table every rank agrees on (``RankFacts``): which GPU
    its current device is (``gpu``) and whether an MPS daemon serves it (``mps``), where
    ``mode`` (the device it proposes: "cuda", "fake" or "off") names a runtime that can be
    had here; nothing otherwise (a rank that cannot have it says why at agreement)."""
    name = runtime_name(mode or "off")
    if name is None:
        return {}
    try:
        runtime = named_runtime(name)
        if not runtime.available():
            return {}
        return {"gpu": runtime.device_identity(runtime.current_device()),
                "mps": runtime.mps().on}
    except Exception as err:  # noqa: BLE001 - a fact we cannot read is a fact left out
        log.debug("no GPU facts here: %s", err)
        return {}


_SAID_NO_CUPY: list[bool] = []  # the warning below, once per process


def _say_once_without_cupy() -> None:
    """Where torch sees a GPU but CuPy cannot be had, CUDA tensors are copied through host
    memory by torch itself, not moved by a device engine: say so, once per process, and
    what to install."""
    torch = sys.modules.get("torch")
    if _SAID_NO_CUPY or torch is None:
        return
    try:
        has_gpu = bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a torch without CUDA, or a broken driver
        has_gpu = False
    if not has_gpu:
        return
    from ..core.device.cupy_runtime import cupy_problem

    problem = cupy_problem()
    _SAID_NO_CUPY.append(True)
    if problem:
        log.warning("torch sees a GPU but ringcomm's device engines cannot run: %s. CUDA "
                    "tensors are copied through host memory by torch (correct, slow); "
                    "install CuPy for them to stay on the GPU", problem)


def device_runtime(settings: Settings) -> DeviceRuntime | None:
    """The runtime the agreed ``settings.device`` names (None for ``off``); an
    ``ArgumentError`` where it cannot be had here (``cuda`` without CuPy or a GPU). With
    ``off`` where torch sees a GPU and CuPy cannot be had, it says once why CUDA tensors
    go through the host."""
    name = runtime_name(settings.device)
    if name is None:
        _say_once_without_cupy()
        return None
    runtime = named_runtime(name)
    if not runtime.available():
        raise ArgumentError(f"device={settings.device!r} (RINGCOMM_DEVICE or init(device=)) "
                            f"but the {runtime.name} runtime sees no device here; use "
                            "device='off' to stage device arrays through the host")
    return runtime


def ipc_serves(topology: Topology, settings: Settings) -> tuple[bool, str]:
    """Whether the cuda-ipc channel can serve this group, and why (or why not): every rank
    on one host, and the device engine setting allows it."""
    if settings.device_engine in (STAGED, NCCL):
        return False, f"RINGCOMM_DEVICE_ENGINE={settings.device_engine}"
    if len(topology.hosts) > 1:
        if settings.device_engine == CUDA_IPC:
            raise ArgumentError("RINGCOMM_DEVICE_ENGINE=cuda-ipc, but the ranks span "
                                f"{len(topology.hosts)} hosts and CUDA IPC maps memory of one "
                                "host only; use auto or staged")
        return False, f"the ranks span {len(topology.hosts)} hosts"
    return True, "every rank is on one host"


def launch_problem(runtime: DeviceRuntime, topology: Topology, settings: Settings) -> str:
    """Why this group's runtime cannot launch the kernels ("" where it can): the runtime's
    own reason, or, where its launch has not been checked against the kernels' mirror on a
    GPU (``DeviceRuntime.kernel_path_checked``), that it is taken only on request."""
    problem = runtime.kernel_launch([f.pid for f in topology.ranks])
    if problem or runtime.kernel_path_checked or settings.device_engine == CUDA_KERNEL:
        return problem
    return (f"{runtime.name}'s launch of the kernels is not yet checked on a GPU; "
            f"RINGCOMM_DEVICE_ENGINE={CUDA_KERNEL} takes it")


def _kernel_setting(settings: Settings) -> Verdict | None:
    """The refusal the device engine setting makes by itself (None: it allows the path)."""
    if settings.device_engine in ("auto", CUDA_KERNEL):
        return None
    return Verdict(False, f"RINGCOMM_DEVICE_ENGINE={settings.device_engine}")


def kernel_verdict(runtime: DeviceRuntime | None, topology: Topology, settings: Settings,
                   lanes: Mapping[str, Any]) -> Verdict | None:
    """Whether this group's allreduces of device memory may take the kernel path, and why
    (``ringcomm.plan.kernel_path``): from the agreed facts and settings, the runtime's
    ability to launch the kernels and whether the group made the engine (``lanes``), so the
    same on every rank. None without a device runtime."""
    if runtime is None:
        return None
    refused = _kernel_setting(settings)
    if refused is not None:
        return refused
    return kernel_path(topology, launch_problem(runtime, topology, settings),
                       CUDA_KERNEL in lanes)


def open_lanes(runtime: DeviceRuntime, transport: Transport, exchange: Exchange | None,
               topology: Topology, settings: Settings, segment_bytes: int,
               timeout: float) -> dict[str, DeviceLane]:
    """The group's device lanes, by engine name: ``nccl`` alone where the settings ask for
    it; else ``staged`` always, ``cuda-ipc`` where it serves (``ipc_serves``) and an
    ``exchange`` is at hand. Collective: every rank calls it
    at set-up, which waits at most ``timeout`` seconds for the peers' handles. What was made
    is closed again if a later part fails."""
    lanes: dict[str, DeviceLane] = {}
    try:
        if settings.device_engine == NCCL:
            lanes[NCCL] = DeviceLane(_nccl_channel(runtime, transport, exchange, timeout))
            return lanes
        serves, why = ipc_serves(topology, settings)
        if exchange is not None and _kernel_setting(settings) is None and kernel_path(
                topology, launch_problem(runtime, topology, settings)).ok:
            lanes[CUDA_KERNEL] = DeviceLane(KernelChannel(
                runtime, exchange, transport.rank, transport.world_size,
                time.monotonic() + timeout, close_wait_s=timeout))
        if serves and exchange is not None:
            channel = IpcChannel(runtime, transport, exchange, transport.rank,
                                 transport.world_size, slots=settings.ipc_slots,
                                 slot_bytes=settings.ipc_slot_bytes, timeout_s=timeout,
                                 close_wait_s=timeout)
            lanes[CUDA_IPC] = DeviceLane(channel)
        elif serves:
            log.debug("rank %d: no cuda-ipc engine: no way to exchange handles",
                      transport.rank)
        else:
            log.debug("rank %d: no cuda-ipc engine: %s", transport.rank, why)
        lanes[STAGED] = DeviceLane(StagedChannel(runtime, transport, segment_bytes))
    except BaseException:
        close_lanes(lanes)
        raise
    return lanes


def _nccl_channel(runtime: DeviceRuntime, transport: Transport, exchange: Exchange | None,
                  timeout: float) -> NcclChannel:
    """The group's NCCL communicator (``RINGCOMM_DEVICE_ENGINE=nccl``): its unique id goes
    through ``exchange`` (the store), made within ``timeout``."""
    library = devices.nccl_library(runtime)
    if not library.available():
        raise ArgumentError(f"RINGCOMM_DEVICE_ENGINE=nccl, but {runtime.name}'s NCCL cannot be "
                            "used here (is CuPy built with NCCL? pip install nvidia-nccl-cu12 "
                            "or cu13); use auto, cuda-ipc or staged")
    if exchange is None:
        raise ArgumentError("RINGCOMM_DEVICE_ENGINE=nccl needs a store to pass NCCL's unique "
                            "id through (ringcomm.init gives one)")
    return open_channel(runtime, library, exchange, transport.rank, transport.world_size,
                        timeout)


_SETTLE_AFTER_FAILURE_S = 2.0  # how long a failed group's close waits for device work


def close_lanes(lanes: dict[str, DeviceLane], *, strict: bool = False,
                failed: bool = False) -> None:
    """Close every lane (each synchronizes its stream, frees its scratch, then closes its
    channel in the safe order): after the worker has stopped, before the links close, since
    closing IPC mappings is collective and says so to the peers. Every lane is closed even
    if one fails; with ``strict`` the first failure is raised afterwards (a close that
    leaks is a bug to see), else it is logged (an abort must not raise). After a failure
    (``failed``) device work may wait for a lost peer for ever: the lanes wait for it a
    little only, and if any lane's work does not settle no lane frees anything (a free
    waits for the whole device, the stuck stream included; ``DeviceLane.close``)."""
    first: BaseException | None = None
    settled = not failed or all(lane.settles(_SETTLE_AFTER_FAILURE_S)
                                for lane in lanes.values())
    for name, lane in list(lanes.items()):
        started = time.monotonic()
        try:
            lane.close(settled, failed=failed)
        except Exception as err:  # noqa: BLE001 - every lane gets closed; see ``strict``
            log.warning("closing the %s device lane failed: %s", name, err)
            first = first or err
        log.debug("closed the %s lane in %.1f ms", name, (time.monotonic() - started) * 1e3)
    lanes.clear()
    if strict and first is not None:
        raise first
