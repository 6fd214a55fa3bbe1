"""Registered memory on the kernel path, checked against numpy: run by the in-process tests
(``test_registration``) and, as jobs, by rank processes (``mp_helpers.Cluster``), on the fake
runtime or on a GPU (CuPy arrays)."""

from __future__ import annotations

import gc
import hashlib
import time
from typing import Any

import numpy as np
from kernel_cases import GPU_PAIRS, expected, inputs, pairs

from ringcomm.core.algorithms import CUDA_KERNEL


def block(segment: Any, first: int, count: int) -> Any:
    """Elements ``first`` to ``first + count`` of a device array, as an array of their own
    inside its allocation (a caching allocator's block: no allocation's base)."""
    if hasattr(segment, "block"):  # a FakeDeviceArray
        return segment.block(first * segment.dtype.itemsize, count, segment.dtype)
    return segment[first:first + count]


def fill(runtime: Any, array: Any, values: np.ndarray) -> None:
    """``values`` into device array ``array``, on the caller's current stream."""
    if runtime.name == "cupy":
        array.set(values)
    else:
        runtime.from_host(array.ptr, np.ascontiguousarray(values), runtime.current_stream())


def region_untouched(comm: Any) -> bool:
    """Whether this rank's kernel-path region still holds only zeros: no op copied through
    it (an op on registered memory runs where the memory lies)."""
    channel = comm.wiring.lanes[CUDA_KERNEL].channel
    runtime = channel.runtime
    seen = np.ones(channel.capacity, np.uint8)
    stream = runtime.new_stream()
    runtime.to_host(seen, channel.data[comm.rank], stream)
    runtime.synchronize(stream)
    return not seen.any()


def registered_everything(count: int, only: tuple[tuple[str, str], ...] | None = None
                          ) -> Any:
    """A job for every rank of a group: for every (dtype, op) the host path has (or those in
    ``only``), one segment holding three registered blocks (the allreduce's data, the
    reduce-scatter's and the all-gather's inputs, at odd offsets), each op run on them and
    compared with numpy, then deregistered. What differed, the ops the kernel path ran
    where the memory lies, the exports and opens the registry made, whether the region was
    never used, and a digest of every result (the same on every rank for the allreduce and
    all-gather)."""

    def fn(comm: Any) -> Any:
        from device_cases import to_device, to_host

        world, rank, runtime = comm.world_size, comm.rank, comm.device
        channel = comm.wiring.lanes[CUDA_KERNEL].channel
        wrong, digest, ops = [], hashlib.sha256(), 0
        gathered: set[str] = set()
        for seed, (name, dtype, op) in enumerate(pairs()):
            if only is not None and (name, op) not in only:
                continue
            values = inputs(dtype, op, world, count * world, seed)
            segment = to_device(runtime, np.zeros(3 + count + 5 + 2 * count * world, dtype))
            data = block(segment, 3, count)
            scattered = block(segment, 3 + count + 5, count * world)
            gathering = block(segment, 3 + count + 5 + count * world, count)
            with comm.register(data), comm.register(scattered), comm.register(gathering):
                fill(runtime, data, values[rank][:count])
                comm.allreduce(data, op, algorithm="kernel-twoshot")
                got = to_host(data)
                digest.update(got.tobytes())
                if not _same(got, expected([v[:count] for v in values], name, op), op):
                    wrong.append(("allreduce", name, op))
                fill(runtime, scattered, values[rank])
                out = to_device(runtime, np.zeros(count, dtype))
                comm.reduce_scatter(out, scattered, op)
                want = expected([v[rank * count:(rank + 1) * count] for v in values], name, op)
                if not _same(to_host(out), want, op):
                    wrong.append(("reduce_scatter", name, op))
                ops += 2
                if name not in gathered:
                    gathered.add(name)
                    fill(runtime, gathering, values[rank][:count])
                    out = to_device(runtime, np.zeros(count * world, dtype))
                    comm.allgather(out, gathering)
                    got = to_host(out)
                    digest.update(got.tobytes())
                    if got.tobytes() != b"".join(v[:count].tobytes() for v in values):
                        wrong.append(("allgather", name, ""))
                    ops += 1
        registry = channel.registry
        return {"wrong": wrong, "in_place": channel.in_place, "ops": ops,
                "exported": registry.exported, "opens": registry.opens,
                "live": registry.live, "untouched": region_untouched(comm),
                "digest": digest.hexdigest()}
    return fn


def _same(got: np.ndarray, want: np.ndarray, op: str) -> bool:
    if op == "prod" and got.dtype.kind == "c":  # numpy's complex product fuses FMAs
        return bool(np.allclose(got, want, rtol=1e-5))
    return got.tobytes() == want.tobytes() or (
        got.dtype.kind in "fc" and bool(np.array_equal(got, want, equal_nan=True)))


def _setup(rank: int, world: int, device_name: str) -> tuple[Any, Any]:
    """The runtime for a rank process: fake device 0 shared under MPS, or on a GPU each rank
    on its own where there are enough, else GPU 0 (MPS, which the test found, serves them),
    the kernel path asked for. What to restore afterwards."""
    import os

    import ringcomm.testing  # noqa: F401 - registers the fake runtime
    from ringcomm.core import device

    fake = device_name == "fake"
    runtime = device.runtime("fake" if fake else "cupy")
    saved = (runtime._devices, runtime.mps_on, runtime.current_device()) if fake else None
    if fake:
        runtime._devices = max(world, runtime._devices)
        runtime.mps_on = True
        runtime.set_device(0)
    else:
        os.environ["RINGCOMM_DEVICE_ENGINE"] = CUDA_KERNEL
        runtime.set_device(rank if runtime.device_count() >= world else 0)
    return runtime, saved


def _close_last_on_rank_0(comm: Any, runtime: Any) -> int:
    """Close ``comm``, rank 0 last (its peers then wait for it to unmap their memory before
    they free it), collect what the job dropped, and return the device allocations live."""
    if comm.rank == 0:
        time.sleep(0.5)
    comm.close()
    gc.collect()
    return int(runtime.live_allocations())


def _restore(runtime: Any, saved: Any) -> None:
    if saved is not None:
        runtime._devices, runtime.mps_on, before = saved
        runtime.set_device(before)


def job_registered(rank: int, world: int, store: str, transport: str, count: int = 37,
                   device_name: str = "fake", **_: Any) -> dict[str, Any]:
    """A rank of real processes: ``registered_everything`` of ``GPU_PAIRS`` (the dtypes and
    ops training uses, one integer and one bitwise: what across processes adds is the
    mapping, which every pair exercises alike; the in-process test runs every pair), then
    the device memory left after ``close()``, which rank 0 calls last."""
    import ringcomm

    runtime, saved = _setup(rank, world, device_name)
    before = runtime.live_allocations()
    try:
        comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                             transport=transport, device=device_name)
        try:
            result = registered_everything(count, GPU_PAIRS)(comm)
        finally:
            live = _close_last_on_rank_0(comm, runtime)
        result["left"] = live - before
        return result
    finally:
        _restore(runtime, saved)


def job_held_until_deregistered(rank: int, world: int, store: str, transport: str,
                                deregister: bool = True, **_: Any) -> dict[str, Any]:
    """Ranks in processes on fake device 0 under MPS. Each registers an array of its own and
    drops every reference to it: the registration holds it (its peers map it), so it is not
    freed. Then
    ``deregister`` (or, with ``deregister=False``, the communicator's close) closes the
    peers' mappings before the array is let go and freed: the fake refuses a free while a
    peer maps the memory. Device allocations at each point, the values, the error if any."""
    import ringcomm
    from ringcomm.testing.fake_device import FakeDeviceArray

    runtime, saved = _setup(rank, world, "fake")
    before = runtime.live_allocations()
    out: dict[str, Any] = {"error": ""}
    try:
        comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                             transport=transport, device="fake")
        try:
            other = FakeDeviceArray.from_host(np.full(10, rank + 1.0, np.float32))
            comm.allreduce(other)  # not registered: through the region
            out["value"] = float(other.to_host()[0])
            del other
            made = runtime.live_allocations()
            mine = FakeDeviceArray.from_host(np.full(100, rank + 1.0, np.float32))
            registration = comm.register(mine)
            del mine
            gc.collect()
            out["held"] = runtime.live_allocations() - made
            if deregister:
                if rank == 0:  # the last to close its mappings: its peers wait for it
                    time.sleep(0.5)
                registration.deregister()
                gc.collect()
                out["after"] = runtime.live_allocations() - made  # a safe point: frees
        except Exception as err:  # noqa: BLE001 - what the test looks at
            out["error"] = f"{type(err).__name__}: {err}"
        finally:
            live = _close_last_on_rank_0(comm, runtime)
        out["left"] = live - before
        return out
    finally:
        _restore(runtime, saved)


def ddp_rank(rank: int, world: int, store: str, out: Any) -> None:
    """A rank of our DDP on CUDA over ringcomm's kernel path (``RINGCOMM_DEVICE_ENGINE=
    cuda-kernel``; MPS or a GPU per rank): three steps of a small model whose buckets DDP
    registered. Its gradients after each step against the average of every rank's, computed
    here from every rank's inputs; how many ops ran in place; the registrations."""
    import os
    import traceback

    try:
        import torch
        import torch.distributed as dist

        import ringcomm  # noqa: F401 - registers the backend
        from ddp import DistributedDataParallel

        os.environ["RINGCOMM_DEVICE_ENGINE"] = CUDA_KERNEL
        torch.cuda.set_device(rank if torch.cuda.device_count() >= world else 0)
        dist.init_process_group("ringcomm", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                        torch.nn.Linear(256, 8)).cuda()
            ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
            worst = 0.0
            for step in range(3):
                batches = [torch.Generator().manual_seed(100 * step + r) for r in range(world)]
                inputs = [torch.randn(16, 64, generator=g).cuda() for g in batches]
                ddp.zero_grad()
                ddp(inputs[rank]).square().mean().backward()
                local = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                            torch.nn.Linear(256, 8)).cuda()
                for p, q in zip(local.parameters(), model.parameters(), strict=True):
                    p.data.copy_(q.data)
                for x in inputs:
                    (local(x).square().mean() / world).backward()
                for p, q in zip(local.parameters(), model.parameters(), strict=True):
                    worst = max(worst, float((p.grad - q.grad).abs().max()))
            comm = dist.group.WORLD.comm
            channel = comm.wiring.lanes[CUDA_KERNEL].channel
            registrations = ddp.reducer._registrations
            result = {"worst": worst, "in_place": channel.in_place,
                      "registered": [r.in_place for r in registrations]}
        finally:
            dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - sent back to the test
        out.put((rank, "err", traceback.format_exc()))


class _FailingReads:
    """An exchange whose first read raises, as a lost store or a peer that never publishes
    would make it (``job_an_open_fails``), then reads as ``exchange`` does."""

    def __init__(self, exchange: Any, error: BaseException) -> None:
        self.exchange, self.error = exchange, error

    def publish(self, key: str, value: bytes) -> None:
        self.exchange.publish(key, value)

    def read(self, key: str, rank: int, deadline: float) -> bytes:
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        return self.exchange.read(key, rank, deadline)


def job_an_open_fails(rank: int, world: int, store: str, transport: str, how: str = "open",
                      **_: Any) -> dict[str, Any]:
    """Ranks in processes on fake device 0 under MPS; rank 1 cannot open its peers'
    allocations once (``how="open"``), or its first read of its peers' records fails after
    its own went out (``how="read"``: the peers that read it may have opened its memory).
    Every rank's registration raises (none is left holding mappings its peers do not know
    of) well within the group's timeout, leaving no device memory behind; the next
    registration works and its allreduce runs in place."""
    import ringcomm
    from ringcomm.testing.fake_device import FakeDeviceArray

    runtime, saved = _setup(rank, world, "fake")
    out: dict[str, Any] = {"error": ""}
    try:
        comm = ringcomm.init(rank=rank, world_size=world, store=store, timeout=30.0,
                             transport=transport, device="fake")
        try:
            made = runtime.live_allocations()
            x = FakeDeviceArray.from_host(np.full(64, rank + 1.0, np.float32))
            real_open = runtime.open_memory

            def refuse(handle: bytes) -> int:
                runtime.open_memory = real_open  # once only
                raise RuntimeError("cudaErrorMapBufferObjectFailed (as a test makes it)")

            registry = comm.wiring.lanes[CUDA_KERNEL].channel.registry
            real_exchange = registry.exchange
            if rank == 1 and how == "open":
                runtime.open_memory = refuse
            elif rank == 1:
                registry.exchange = _FailingReads(real_exchange, TimeoutError("lost"))
            started = time.monotonic()
            try:
                comm.register(x)
            except Exception as err:  # noqa: BLE001 - what the test looks at
                out["error"] = f"{type(err).__name__}: {err}"
            out["seconds"] = time.monotonic() - started
            runtime.open_memory = real_open
            registry.exchange = real_exchange
            out["left_after_failure"] = runtime.live_allocations() - made - 1  # x itself
            with comm.register(x) as registration:
                comm.allreduce(x, algorithm="kernel-twoshot")
                out["in_place"] = comm.wiring.lanes[CUDA_KERNEL].channel.in_place
                out["value"] = float(x.to_host()[0])
                out["registered"] = registration.in_place
            del x
        finally:  # the failed registration's traceback held x: freed here, not in the next
            _close_last_on_rank_0(comm, runtime)  # job of this process (which counts them)
        return out
    finally:
        _restore(runtime, saved)
