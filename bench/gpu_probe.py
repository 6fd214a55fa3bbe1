"""The probes ``gpu_check`` runs, each printing one JSON object (and exiting non-zero when it
fails), all through ringcomm's device runtime seam so that the same probe runs on a GPU
(``--device cuda``: CuPy) and on a CPU (``--device fake``: the strict fake runtime):

    versions       device, driver, CUDA, CuPy, NCCL, torch and numpy versions
    ipc            device memory and an interprocess event exported by one process and
                   opened, waited on, read and closed by another (then freed by the first)
    host-register  a /dev/shm mapping page-locked, written by a device copy, read back
    mps            whether an MPS control daemon runs here (on a GPU, kernels of different
                   processes time-slice without one)

    python -m ringcomm_bench.gpu_probe ipc --device fake
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import time
from typing import Any

import numpy as np

from .device import RUNTIMES

PROBE_BYTES = 1 << 20


def _runtime(device: str) -> Any:
    from ringcomm.runtime.devices import named_runtime

    return named_runtime(RUNTIMES[device])


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Bytes no stale or zeroed memory holds by chance."""
    return ((np.arange(nbytes, dtype=np.int64) * 7 + seed) % 251).astype(np.uint8)


def versions(device: str) -> dict[str, Any]:
    """What the machine runs: the runtime's own description, and the libraries around it."""
    import torch

    rt = _runtime(device)
    out: dict[str, Any] = {"runtime": rt.name, "available": rt.available(),
                           **rt.describe(), "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda or "-",
                           "torch_cuda_available": torch.cuda.is_available(),
                           "numpy": np.__version__, "python": sys.version.split()[0]}
    if rt.name == "cupy":
        import cupy

        out["cupy"] = cupy.__version__
        try:
            from cupy.cuda import nccl

            out["nccl"] = str(nccl.get_version()) if nccl.available else "-"
        except (ImportError, AttributeError, RuntimeError) as err:
            out["nccl"] = f"- ({err})"
    return out


def _export_side(device: str, conn: Any, parent: Any) -> None:
    """The exporter: memory and an event, handles sent, freed once the importer has closed."""
    rt = _runtime(device)
    stream = rt.new_stream()
    memory = rt.malloc(PROBE_BYTES)
    rt.from_host(memory.ptr, pattern(PROBE_BYTES, 1), stream)
    ready = rt.new_event(interprocess=True)
    rt.record(ready, stream)  # the handle goes out only once the record is made
    conn.send((rt.export_memory(memory), rt.export_event(ready)))
    if conn.recv() != "closed":
        raise RuntimeError("the importer did not close its mapping")
    rt.synchronize(stream)
    rt.free(memory)
    parent.send(rt.live_allocations())


def _import_side(device: str, conn: Any) -> None:
    """The importer: opens the peer's memory and event, waits, reads, closes."""
    rt = _runtime(device)
    memory, event = conn.recv()
    stream = rt.new_stream()
    ptr = rt.open_memory(memory)
    rt.wait_event(stream, rt.open_event(event))
    got = np.empty(PROBE_BYTES, dtype=np.uint8)
    rt.to_host(got, ptr, stream)
    rt.synchronize(stream)
    rt.close_memory(ptr)
    conn.send("closed")
    if not np.array_equal(got, pattern(PROBE_BYTES, 1)):
        raise RuntimeError("the importer read other bytes than the exporter wrote")


def ipc(device: str, timeout: float = 60.0) -> dict[str, Any]:
    """Two spawned processes (CUDA does not survive fork) share memory and an event."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    exporter_end, importer_end = ctx.Pipe()
    heard, told = ctx.Pipe(duplex=False)
    exporter = ctx.Process(target=_export_side, args=(device, exporter_end, told))
    importer = ctx.Process(target=_import_side, args=(device, importer_end))
    started = time.monotonic()
    exporter.start()
    importer.start()
    try:
        for p in (importer, exporter):
            p.join(max(0.1, started + timeout - time.monotonic()))
        left = heard.recv() if heard.poll(1.0) else None
    finally:
        for p in (importer, exporter):
            if p.is_alive():
                p.kill()
                p.join(5)
    codes = {"exporter": exporter.exitcode, "importer": importer.exitcode}
    ok = codes == {"exporter": 0, "importer": 0} and left == 0
    return {"ok": ok, "bytes": PROBE_BYTES, "exit_codes": codes,
            "exporter_live_allocations": left,
            "seconds": round(time.monotonic() - started, 3)}


def host_register(device: str) -> dict[str, Any]:
    """Page-lock a mapping of a /dev/shm file (as the shared-memory ring's), copy device ->
    it -> device, unregister before unmapping."""
    rt = _runtime(device)
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if folder is None:
        return {"ok": False, "why": "no /dev/shm here"}
    path = os.path.join(folder, f"ringcomm-gpu-probe-{os.getpid()}")
    started = time.monotonic()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, PROBE_BYTES)
        mapping = mmap.mmap(fd, PROBE_BYTES)
        try:
            host = np.frombuffer(mapping, dtype=np.uint8)
            address = host.ctypes.data
            rt.host_register(address, PROBE_BYTES)
            stream = rt.new_stream()
            source, back = rt.malloc(PROBE_BYTES), rt.malloc(PROBE_BYTES)
            try:
                rt.from_host(source.ptr, pattern(PROBE_BYTES, 2), stream)
                rt.to_host(host, source.ptr, stream)
                rt.from_host(back.ptr, host, stream)
                got = np.empty(PROBE_BYTES, dtype=np.uint8)
                rt.to_host(got, back.ptr, stream)
                rt.synchronize(stream)
            finally:
                rt.free(source)
                rt.free(back)
                rt.host_unregister(address)
            same = bool(np.array_equal(host, pattern(PROBE_BYTES, 2))
                        and np.array_equal(got, host))
            del host
        finally:
            mapping.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return {"ok": same, "bytes": PROBE_BYTES, "live_allocations": rt.live_allocations(),
            "seconds": round(time.monotonic() - started, 3)}


def mps() -> dict[str, Any]:
    """Whether an MPS daemon runs (a process named ``nvidia-cuda-mps-*``), and whether its
    control command is installed. The probe passes either way: it only says."""
    running = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith("nvidia-cuda-mps"):
            running.append(name)
    from shutil import which

    return {"ok": True, "mps_running": bool(running), "processes": sorted(set(running)),
            "control": which("nvidia-cuda-mps-control")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringcomm_bench.gpu_probe",
                                description=__doc__.splitlines()[0])
    p.add_argument("probe", choices=("versions", "ipc", "host-register", "mps"))
    p.add_argument("--device", choices=sorted(RUNTIMES), default="cuda")
    args = p.parse_args(argv)
    if args.probe == "versions":
        found = versions(args.device)
        result = {"ok": bool(found["available"]), **found}
    elif args.probe == "ipc":
        result = ipc(args.device)
    elif args.probe == "host-register":
        result = host_register(args.device)
    else:
        result = mps()
    print(json.dumps(result))
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
