"""``ringcomm bench --device cuda|fake``: the sweep's device buffers and the device targets.

With ``--device`` the sweep's ringcomm backends run on device memory: CuPy arrays on a GPU
(``cuda``), or the strict fake runtime's ``FakeDeviceArray`` (``fake``: to check the
plumbing on a CPU machine; its times mean nothing for speed). Each device engine is a
backend of its own, forced through ``RINGCOMM_DEVICE_ENGINE`` while its communicator is
made. On a GPU the run adds a device-to-device copy of the same bytes (the ``copy`` row:
the ceiling, and the one-GPU bound derived from it), Gloo through torch on the same bytes as
CUDA tensors, and ringcomm's torch process group on CUDA tensors.

The one-GPU bound: ``p`` ranks sharing one GPU's memory move ``3p - 1`` bytes (read plus
written) per byte of an allreduce run as a reduce-scatter (each result byte reads ``p``
inputs and writes one) and an all-gather (``p - 1`` copies, each read and written), so no
allreduce among them runs faster than the copy bandwidth (counting read plus written) over
``3p - 1``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringcomm.core.device import pointer, zeros

from .buffers import Buffers, Reference
from .common import format_size

# --device: the name ringcomm.init(device=...) takes -> the device runtime it runs on
RUNTIMES = {"cuda": "cupy", "fake": "fake"}
DEVICE_ENGINES = ("cuda-ipc", "staged")
RUNTIME_ARRAYS = "runtime"  # a runner's ``device``: the run's device runtime's own arrays


def runtime_of(device: str) -> Any:
    """The ringcomm device runtime ``--device`` names (an ``ArgumentError`` saying why it
    cannot be had)."""
    from ringcomm.runtime.devices import named_runtime

    return named_runtime(RUNTIMES[device])


def numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype of a torch dtype (bfloat16 through ml_dtypes)."""
    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _count(array: Any) -> int:
    """Elements of a device array (``size``, as CuPy and the fake runtime name it)."""
    return int(array.size)


class RuntimeBuffers(Buffers):
    """The sweep's buffers as a device runtime's arrays, filled and checked through copies
    to and from the host on the calling thread's current stream (synchronized each time, so
    host memory handed to a copy outlives it)."""

    def __init__(self, collective: str, rank: int, world: int, count: int, dtype: Any,
                 ref: Reference, device: str) -> None:
        from .adapter import collective as collective_spec

        self.collective, self.rank, self.world, self.ref = collective, rank, world, ref
        self.device, self.dtype, self.rt = device, dtype, runtime_of(device)
        spec = collective_spec(collective)
        sizes = spec.sizes(spec.block(count, world), world, rank=rank)
        np_dtype = numpy_dtype(dtype)
        if "data" in sizes:
            self.inp = self.out = zeros(self.rt, sizes["data"], np_dtype)
        else:
            self.inp = zeros(self.rt, sizes["input"], np_dtype)
            self.out = zeros(self.rt, sizes["output"], np_dtype)

    def _upload(self, array: Any, host: Any) -> None:
        import torch

        stream = self.rt.current_stream()
        self.rt.from_host(pointer(array), host.contiguous().view(torch.uint8).numpy(), stream)
        self.rt.synchronize(stream)

    def _host(self, array: Any) -> Any:
        import torch

        raw = np.empty(array.nbytes, dtype=np.uint8)
        stream = self.rt.current_stream()
        self.rt.to_host(raw, pointer(array), stream)
        self.rt.synchronize(stream)
        return torch.from_numpy(raw).view(self.dtype)

    def reset(self) -> None:
        import torch

        host = torch.empty(_count(self.inp), dtype=self.dtype)
        if self.collective == "broadcast" and self.rank != 0:
            host.zero_()
        else:
            self.ref.fill(host, self.ref.inputs[self.rank])
        self._upload(self.inp, host)
        if self.out is not self.inp:
            self._upload(self.out, torch.zeros(_count(self.out), dtype=self.dtype))

    def steady(self, op: str | None) -> None:
        import torch

        if self.collective == "allreduce" and op in ("sum", "prod"):
            fill = torch.zeros if op == "sum" else torch.ones
            self._upload(self.inp, fill(_count(self.inp), dtype=self.dtype))


# --------------------------------------------------------------------------- the targets


def one_gpu_bound(copy_rw_GBps: float, world: int) -> float:
    """The fastest algbw an allreduce among ``world`` ranks sharing one GPU can reach, from
    the device-to-device copy bandwidth counting bytes read plus written (module docstring)."""
    return copy_rw_GBps / (3 * world - 1)


IPC = "ringcomm+cuda-ipc"
STAGED = "ringcomm+staged"
# the kernel path (one kernel per op, flags in device memory) on inputs registered with
# the group: allreduce, reduce-scatter and all-gather, only where every rank's kernels run
# at once (under MPS, or a GPU per rank)
KERNEL = "ringcomm+cuda-kernel"
# ringcomm's nccl engine: NCCL's own call where it has one (by the cost model for an
# allreduce; ``ringcomm+nccl:ring`` etc. force ringcomm's schedules as NCCL groups)
NCCL_ENGINE = "ringcomm+nccl"
COPY = "copy"
GLOO_CUDA = "gloo+cuda"
TORCH_CUDA = "ringcomm/torch+cuda"
TORCH_NCCL = "nccl"  # torch's own NCCL process group (ranks sharing a GPU: over sockets)


def device_summary(rows: list[dict]) -> list[dict]:
    """The issue's device targets, per world size and dtype, where the rows they compare were
    measured (each entry: the target, its bound, the worst value over its sizes and where,
    whether met):

    - IPC allreduce (and the kernel path's) at 64 MiB and above: algbw at least half the
      one-GPU bound, the bound from the copy row of the same size in the same run;
    - at 1 MiB and above: Gloo's time on the same CUDA tensors at least 20x IPC's, and
      torch's NCCL (on one GPU: its socket fallback) at least 10x and Gloo at least 20x
      the best device engine's;
    - an 8 B allreduce of a CUDA tensor through torch at world size 2: at most 50 us."""
    out: list[dict] = []
    keyed: dict[tuple[int, str, str], dict[int, dict[str, dict]]] = {}
    for r in rows:
        if r["collective"] == "allreduce":
            key = (r["world_size"], r["dtype"], r["op"])
            keyed.setdefault(key, {}).setdefault(r["bytes"], {})[r["backend"]] = r
    for (world, dtype, op), by_size in keyed.items():
        checks: list[tuple[str, float, bool, dict[int, float]]] = []
        bound_of: dict[int, float] = {}
        kernel_bound: dict[int, float] = {}
        ratio: dict[int, float] = {}
        nccl_ratio: dict[int, float] = {}
        gloo_best: dict[int, float] = {}
        for nbytes, same in by_size.items():
            ipc, copy = same.get(IPC), same.get(COPY)
            kernel = same.get(KERNEL)
            if copy and nbytes >= 64 << 20:
                bound = one_gpu_bound(copy["copy_rw_GBps"], world)
                if ipc:
                    bound_of[nbytes] = ipc["algbw_GBps"] / (bound / 2)
                if kernel:
                    kernel_bound[nbytes] = kernel["algbw_GBps"] / (bound / 2)
            gloo = same.get(GLOO_CUDA)
            if ipc and gloo and nbytes >= 1 << 20:
                ratio[nbytes] = gloo["time_us"] / ipc["time_us"]
            engines = [same[name] for name in (IPC, KERNEL, STAGED) if name in same]
            nccl = same.get(TORCH_NCCL)
            if engines and nccl and nbytes >= 1 << 20:
                best = min(r["time_us"] for r in engines)
                nccl_ratio[nbytes] = nccl["time_us"] / best
                if gloo:
                    gloo_best[nbytes] = gloo["time_us"] / best
        checks.append(("IPC algbw / (one-GPU bound / 2), 64 MiB and up", 1.0, True, bound_of))
        checks.append(("kernel path algbw / (one-GPU bound / 2), 64 MiB and up", 1.0, True,
                       kernel_bound))
        checks.append(("gloo time / IPC time, CUDA tensors, 1 MiB and up", 20.0, True, ratio))
        checks.append(("NCCL (torch, one GPU) time / best device engine time, 1 MiB and up",
                       10.0, True, nccl_ratio))
        checks.append(("gloo time / best device engine time, 1 MiB and up", 20.0, True,
                       gloo_best))
        tiny = by_size.get(8, {}).get(TORCH_CUDA)
        small = {8: tiny["time_us"]} if tiny is not None and world == 2 else {}
        checks.append(("8 B through torch on a CUDA tensor (us)", 50.0, False, small))
        for what, bound, higher, values in checks:
            if not values:
                continue
            pick = min if higher else max
            at = pick(values, key=lambda n: values[n])
            worst = values[at]
            met = worst >= bound if higher else worst <= bound
            out.append({"world_size": world, "dtype": dtype, "op": op, "target": what,
                        "bound": bound, "worst": round(worst, 3), "at_bytes": at, "met": met,
                        "sizes_met": sum(1 for v in values.values()
                                         if (v >= bound if higher else v <= bound)),
                        "sizes": len(values)})
    return out


def print_summary(summary: list[dict], runtime: str, console: Any) -> None:
    """The device targets as lines (with the fake runtime: said to mean nothing)."""
    if not summary:
        return
    fake = " (fake runtime: numpy on the CPU, these figures mean nothing for speed)"
    console.print(f"device targets{fake if runtime == 'fake' else ''}:", markup=False,
                  highlight=False)
    for t in summary:
        mark = "met" if t["met"] else "NOT met"
        console.print(f"  world {t['world_size']} {t['dtype']}: {t['target']}: worst "
                      f"{t['worst']} at {format_size(t['at_bytes'])} (bound {t['bound']}, "
                      f"{t['sizes_met']}/{t['sizes']} sizes): {mark}", markup=False,
                      highlight=False)
