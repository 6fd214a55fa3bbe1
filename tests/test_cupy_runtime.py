"""The CuPy runtime against a real GPU: every method once (the behaviour shared with the
fake, copies, events, reductions and IPC between processes, runs over both runtimes in
``test_device_runtime``). Skipped, with the reason, where there is no GPU."""

from __future__ import annotations

import mmap
import os
import tempfile
import threading

import numpy as np
import pytest

from ringcomm.core.device import available_runtimes, runtime
from ringcomm.core.device.cupy_runtime import cupy_problem
from ringcomm.core.dtypes import REDUCE_OPS

PROBLEM = cupy_problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(PROBLEM), reason=PROBLEM or "-")]


@pytest.fixture
def rt():
    return runtime("cupy")


def test_devices_and_description(rt):
    import cupy

    assert "cupy" in available_runtimes() and rt.available() and rt.memory == "cuda"
    count = rt.device_count()
    assert count == cupy.cuda.runtime.getDeviceCount() >= 1
    here = rt.current_device()
    rt.set_device(here)
    assert rt.current_device() == here
    with pytest.raises(ValueError, match="GPU"):
        rt.set_device(count)
    described = rt.describe()
    assert described["device"] not in ("", "-") and described["cuda"] != "-"
    assert described["library"] == f"cupy {cupy.__version__}"


def test_streams_are_cupy_streams(rt):
    import cupy

    stream = rt.new_stream()
    assert stream.handle != 0 and rt.external_stream(stream.handle).handle == stream.handle
    with cupy.cuda.Stream(non_blocking=True) as theirs:
        assert rt.current_stream().handle == theirs.ptr
    assert rt.current_stream().handle == cupy.cuda.get_current_stream().ptr
    seen: list[int] = []
    worker = threading.Thread(target=lambda: seen.append(rt.current_stream().handle))
    worker.start()
    worker.join(30)
    assert len(seen) == 1


def test_events_order_streams_and_report_done(rt):
    a, b = rt.new_stream(), rt.new_stream()
    n = 1 << 24
    src, dst = rt.malloc(4 * n), rt.malloc(4 * n)
    values = np.arange(n, dtype=np.float32)
    rt.from_host(src.ptr, values, a)
    event = rt.new_event()
    assert rt.event_done(event)  # never recorded: done
    rt.record(event, a)
    rt.wait_event(b, event)
    rt.copy(dst.ptr, src.ptr, 4 * n, b)
    out = np.empty_like(values)
    rt.to_host(out, dst.ptr, b)
    rt.synchronize(b)
    np.testing.assert_array_equal(out, values)
    rt.event_synchronize(event)
    assert rt.event_done(event)
    rt.free(src)
    rt.free(dst)
    with pytest.raises(ValueError, match="freed already"):
        rt.free(src)


def test_array_at_reduce_and_finish(rt):
    stream = rt.new_stream()
    x = np.arange(1000, dtype=np.float32)
    a, b = rt.malloc(x.nbytes), rt.malloc(x.nbytes)
    rt.from_host(a.ptr, x, stream)
    rt.from_host(b.ptr, x, stream)
    rt.reduce(a.ptr, a.ptr, b.ptr, x.size, x.dtype, REDUCE_OPS["avg"], stream)
    rt.finish(a.ptr, x.size, x.dtype, REDUCE_OPS["avg"], 2, stream)
    rt.synchronize(stream)
    view = rt.array_at(a.ptr, x.size, x.dtype)
    np.testing.assert_array_equal(view.get(), x)
    rt.free(a)
    rt.free(b)


@pytest.mark.parametrize("backing", ["anonymous", "dev-shm"])
def test_host_registration(rt, backing):
    before = rt.live_allocations()
    size = 1 << 22
    if backing == "anonymous":
        mapping = mmap.mmap(-1, size)
    else:
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="ringcomm-test-")
        os.unlink(path)
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        os.close(fd)
    host = np.frombuffer(mapping, np.uint8)
    address = host.ctypes.data
    rt.host_register(address, size)
    assert rt.live_allocations() == before + 1
    stream = rt.new_stream()
    dev = rt.malloc(size)
    rt.from_host(dev.ptr, np.full(size, 7, np.uint8), stream)
    rt.to_host(host, dev.ptr, stream)
    rt.synchronize(stream)
    assert (host == 7).all()
    rt.host_unregister(address)
    with pytest.raises(ValueError, match="no range registered"):
        rt.host_unregister(address)
    rt.free(dev)
    del host
    mapping.close()
    assert rt.live_allocations() == before


def test_memory_returns_to_its_baseline(rt):
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    free_before, _ = cupy.cuda.runtime.memGetInfo()
    allocations = [rt.malloc(64 << 20) for _ in range(4)]
    assert cupy.cuda.runtime.memGetInfo()[0] <= free_before - 4 * (64 << 20)
    for allocation in allocations:
        rt.free(allocation)
    # within less than one allocation (the driver may keep a little for itself)
    assert abs(cupy.cuda.runtime.memGetInfo()[0] - free_before) < (32 << 20)
