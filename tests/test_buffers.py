"""The buffer protocol over every kind of array, in the manner of mpi4py's ``arrayimpl``: each
kind (numpy, torch CPU, the fake runtime's device arrays, an object exposing
``__cuda_array_interface__`` over fake device memory; CuPy, torch CUDA and DLPack where
there is a GPU) is described once below, and the tests run over all of them.

Every collective and point-to-point op gives, for every kind, world sizes 1-4 and several
dtypes, the numpy reference (small integers keep sums exact, so the comparisons are exact
and the kinds agree bit for bit). Host kinds are used in place; device arrays are staged
through host memory by the runtime, and the fake runtime is as strict as a GPU: queued work
runs only when something waits for it, so a staging that forgot to wait for the producer,
or a result the caller's stream was not made to wait for, reads stale values here. One
test runs fake device arrays over real processes.
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from ringcomm import ArgumentError, DesyncError, RemoteError
from ringcomm.core.arrays import (
    HOST_ONLY,
    Concatenated,
    DeviceBuffer,
    HostBuffer,
    NumpyKind,
    StagedBuffer,
    TorchCPUKind,
    as_buffer,
    kinds,
)
from ringcomm.core.device import runtime
from ringcomm.core.device.kinds import (
    CudaInterfaceKind,
    CupyKind,
    DLPackKind,
    TorchCUDAKind,
)
from ringcomm.core.dtypes import REDUCE_OPS
from ringcomm.core.tensors import HostViews, core_dtypes, viewable
from ringcomm.runtime.local import run_group
from ringcomm.testing import FakeDeviceArray, FakeRuntime
from ringcomm.testing.fake_arrays import FakeArrayKind

pytestmark = pytest.mark.timeout(60)

SEG = 24  # bytes: tiny segments, so every op pipelines several
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "int64": np.dtype(np.int64)}


class Numpy:
    kind = NumpyKind

    def make(self, values: np.ndarray) -> np.ndarray:
        return values.copy()

    def read(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(-1).copy()


class Torch:
    kind = TorchCPUKind

    def make(self, values: np.ndarray) -> torch.Tensor:
        if values.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(values.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(values.copy())

    def read(self, x: torch.Tensor) -> np.ndarray:
        if x.dtype == torch.bfloat16:
            return x.reshape(-1).view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return x.reshape(-1).numpy().copy()


class Fake:
    """The fake runtime's arrays: filled by a copy queued on the calling thread's current
    stream (not run until something waits for it), read back through that stream."""

    kind = FakeArrayKind

    def make(self, values: np.ndarray) -> FakeDeviceArray:
        return FakeDeviceArray.from_host(values)

    def read(self, x: FakeDeviceArray) -> np.ndarray:
        return x.to_host().reshape(-1)


class Interface:
    """A plain object of the test's own that exposes ``__cuda_array_interface__`` over fake
    device memory (the fake runtime's pointers): how numba, JAX and others hand arrays
    over. ``stream`` puts that key in it (the stream the producer work is on)."""

    kind = CudaInterfaceKind

    def __init__(self, array: FakeDeviceArray, *, stream: int | None = None,
                 strides: tuple[int, ...] | None = None, readonly: bool = False,
                 typestr: str | None = None, shape: tuple[int, ...] | None = None) -> None:
        self.array = array  # keeps the memory alive
        self.__cuda_array_interface__ = {
            "version": 3, "shape": shape if shape is not None else array.shape,
            "typestr": typestr or array.dtype.str, "data": (array.ptr, readonly),
            "strides": strides, "stream": stream}


class Cai:
    kind = CudaInterfaceKind

    def make(self, values: np.ndarray) -> Interface:
        return Interface(FakeDeviceArray.from_host(values))

    def read(self, x: Interface) -> np.ndarray:
        return x.array.to_host().reshape(-1)


class TorchCUDA(Torch):
    """CUDA tensors (run where there is a GPU)."""

    kind = TorchCUDAKind

    def make(self, values: np.ndarray) -> torch.Tensor:
        return super().make(values).cuda()

    def read(self, x: torch.Tensor) -> np.ndarray:
        return super().read(x.cpu())


class Cupy:
    """CuPy arrays (run where there is a GPU and CuPy)."""

    kind = CupyKind

    def make(self, values: np.ndarray) -> Any:
        import cupy

        return cupy.asarray(values)

    def read(self, x: Any) -> np.ndarray:
        import cupy

        return cupy.asnumpy(x).reshape(-1)


class DLPackOnly:
    """A CUDA tensor seen only through the DLPack protocol."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.tensor.__dlpack_device__()


class DLPack(TorchCUDA):
    kind = DLPackKind

    def make(self, values: np.ndarray) -> DLPackOnly:
        return DLPackOnly(super().make(values))

    def read(self, x: DLPackOnly) -> np.ndarray:  # type: ignore[override]
        return super().read(x.tensor)


def _cupy_with_a_gpu() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.cuda.is_available())


KINDS = [Numpy(), Torch(), Fake(), Cai()]
IDS = ["numpy", "torch", "fake", "cai"]
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA tensors need a GPU")
NEEDS_A_GPU = [
    pytest.param(TorchCUDA(), id="cuda", marks=[pytest.mark.gpu, _NO_CUDA]),
    pytest.param(DLPack(), id="dlpack", marks=[pytest.mark.gpu, _NO_CUDA]),
    pytest.param(Cupy(), id="cupy", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _cupy_with_a_gpu(), reason="CuPy arrays need CuPy and a GPU")]),
]


def values(rank: int, count: int, salt: int, dtype: np.dtype) -> np.ndarray:
    """Small integers: exact in every dtype here, also summed over four ranks."""
    return ((np.arange(count) * 7 + rank * 13 + salt * 5) % 23 - 11).astype(dtype)


def split(src: int, dst: int) -> int:
    """Elements that rank ``src`` sends rank ``dst`` in the uneven all-to-all."""
    return (src + 2 * dst) % 3


def test_every_registered_kind_is_tested():
    tested = {k.kind for k in KINDS} | {p.values[0].kind for p in NEEDS_A_GPU}
    assert {type(k) for k in kinds()} == tested


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("lib", [*(pytest.param(k, id=i) for k, i in zip(KINDS, IDS, strict=True)),
                                 *NEEDS_A_GPU])
def test_every_op_matches_numpy(lib, world, dtype):
    if isinstance(lib, Cai) and dtype == "bfloat16":
        pytest.skip("the CUDA array interface cannot name bfloat16 (refused, tested below)")
    dt, count = DTYPES[dtype], 7

    def val(rank: int, n: int, salt: int) -> np.ndarray:
        return values(rank, n, salt, dt)

    def empty(n: int) -> Any:
        return lib.make(np.full(n, -9, dt))

    def fn(comm):
        r, n = comm.rank, comm.world_size
        out = {}
        x = lib.make(val(r, count, 0))
        assert comm.allreduce(x) is x
        out["allreduce sum"] = x
        x = lib.make(val(r, count, 1))
        comm.allreduce(x, "max")
        out["allreduce max"] = x
        x = lib.make(val(r, count, 2))
        comm.broadcast(x, root=n - 1)
        out["broadcast"] = x
        x = lib.make(val(r, count, 3))
        comm.reduce(x, root=0)
        out["reduce"] = x
        out["allgather"] = empty(count * n)
        comm.allgather(out["allgather"], lib.make(val(r, count, 4)))
        out["reduce_scatter"] = empty(count)
        comm.reduce_scatter(out["reduce_scatter"], lib.make(val(r, count * n, 5)))
        out["gather"] = empty(count * n) if r == n - 1 else None
        comm.gather(out["gather"], lib.make(val(r, count, 6)), root=n - 1)
        out["scatter"] = empty(count)
        comm.scatter(out["scatter"], lib.make(val(0, count * n, 7)) if r == 0 else None)
        out["scatter list"] = empty(count)
        comm.scatter(out["scatter list"],
                     [lib.make(val(10 + i, count, 7)) for i in range(n)] if r == 0 else None)
        out["alltoall"] = empty(count * n)
        comm.alltoall(out["alltoall"], lib.make(val(r, count * n, 8)))
        sends = [split(r, d) for d in range(n)]
        recvs = [split(s, r) for s in range(n)]
        out["alltoall uneven"] = empty(sum(recvs))
        comm.alltoall(out["alltoall uneven"], lib.make(val(r, sum(sends), 9)),
                      in_splits=sends, out_splits=recvs)
        comm.barrier()
        if n > 1:
            out["recv"] = empty(count)
            posted = comm.recv(out["recv"], (r - 1) % n, async_op=True)
            comm.send(lib.make(val(r, count, 10)), (r + 1) % n)
            posted.wait(timeout=20)
        return {name: None if a is None else lib.read(a) for name, a in out.items()}

    results = run_group(world, fn, segment_bytes=SEG, timeout=20)
    n = world
    ranks = range(n)
    for r, got in enumerate(results):
        want = {
            "allreduce sum": sum(val(s, count, 0).astype(np.float64) for s in ranks),
            "allreduce max": np.max([val(s, count, 1) for s in ranks], axis=0),
            "broadcast": val(n - 1, count, 2),
            "reduce": (sum(val(s, count, 3).astype(np.float64) for s in ranks) if r == 0
                       else val(r, count, 3)),
            "allgather": np.concatenate([val(s, count, 4) for s in ranks]),
            "reduce_scatter": sum(val(s, count * n, 5).astype(np.float64)
                                  for s in ranks)[r * count:(r + 1) * count],
            "gather": (np.concatenate([val(s, count, 6) for s in ranks]) if r == n - 1
                       else None),
            "scatter": val(0, count * n, 7)[r * count:(r + 1) * count],
            "scatter list": val(10 + r, count, 7),
            "alltoall": np.concatenate([val(s, count * n, 8)[r * count:(r + 1) * count]
                                        for s in ranks]),
            "alltoall uneven": np.concatenate([
                val(s, sum(split(s, d) for d in ranks), 9)[
                    sum(split(s, d) for d in range(r)):][:split(s, r)] for s in ranks]),
        }
        if n > 1:
            want["recv"] = val((r - 1) % n, count, 10)
        assert got.keys() == want.keys()
        for name, expected in want.items():
            if expected is None:
                assert got[name] is None, name
                continue
            assert got[name].dtype == dt, name
            assert got[name].tobytes() == expected.astype(dt).tobytes(), (
                name, r, got[name], expected)


@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_rounded_results_are_bitwise_the_same_for_every_kind(op):
    """Random floats, whose sums round: the arithmetic is the same whatever the kind."""
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(301).astype(np.float32) for _ in range(3)]

    def run(lib):
        def fn(comm):
            x = lib.make(inputs[comm.rank])
            comm.allreduce(x, op, algorithm="ring")
            out = lib.make(np.zeros(101, np.float32))
            comm.reduce_scatter(out, lib.make(np.concatenate([inputs[comm.rank]] * 3)[:303]),
                                op)
            return lib.read(x).tobytes(), lib.read(out).tobytes()

        return run_group(3, fn, segment_bytes=SEG * 8)

    results = [run(lib) for lib in KINDS]
    assert all(r == results[0] for r in results)
    assert len({reduced for reduced, _ in results[0]}) == 1  # every rank, the same sum


def test_ranks_may_hold_different_kinds():
    """The kind is each rank's own business: the wire carries the same bytes."""
    def fn(comm):
        lib = KINDS[comm.rank]
        x = lib.make(values(comm.rank, 9, 0, DTYPES["bfloat16"]))
        comm.allreduce(x)
        return lib.read(x)

    want = sum(values(r, 9, 0, np.dtype(np.float64)) for r in range(3))
    for got in run_group(3, fn, segment_bytes=SEG):
        assert got.tobytes() == want.astype(ml_dtypes.bfloat16).tobytes()


# --------------------------------------------------------------------------- host kinds


@pytest.mark.parametrize("lib", KINDS[:2], ids=IDS[:2])
def test_host_buffers_are_the_callers_memory(lib):
    """No copy on the way in or out: every region the executor sends from or receives into
    is a view of the caller's array, and the hooks move nothing."""
    x = lib.make(np.arange(12, dtype=np.float32).reshape(3, 4))
    buf = as_buffer(x)
    assert type(buf) is HostBuffer and (buf.count, buf.nbytes) == (12, 48)
    address = x.ctypes.data if isinstance(x, np.ndarray) else x.data_ptr()
    assert buf.address == address
    buf.before_op()
    region = buf.region(4, 5)
    assert region.ctypes.data == address + 16
    buf.copy(region, np.full(5, -1, np.float32))
    buf.reduce_into(buf.region(0, 2), buf.region(0, 2), np.full(2, 10, np.float32),
                    REDUCE_OPS["sum"])
    buf.after_op()
    np.testing.assert_array_equal(lib.read(x), [10, 11, 2, 3, -1, -1, -1, -1, -1, 9, 10, 11])


def test_inputs_no_kind_takes_are_refused_with_what_to_pass():
    with pytest.raises(ArgumentError, match="x must be a numpy array or .*, got list") as err:
        as_buffer([1.0])
    assert all(kind.noun in str(err.value) for kind in kinds())
    with pytest.raises(ArgumentError, match=r"y is on meta; Communicator takes host memory "
                       r"and CUDA tensors: copy it with y.cpu\(\).*or use the torch backend"):
        as_buffer(torch.empty(3, device="meta"), name="y")
    with pytest.raises(ArgumentError, match="x: dtype uint16 is not supported"):
        as_buffer(FakeDeviceArray.empty(3, np.uint16))
    # no memory of their own to view, each said as such, by the direct API too
    not_dense = [torch.ones(3).to_sparse(), torch.ones(2, 2).to_sparse_csr()]
    if torch.backends.mkldnn.is_available():
        not_dense.append(torch.ones(2, 2).to_mkldnn())  # on the CPU, "contiguous"
    said = r"x is a (\S+) tensor; Communicator takes dense tensors: pass x.to_dense\(\)"
    for t in not_dense:
        with pytest.raises(ArgumentError, match=said.replace(r"(\S+)", str(t.layout))):
            as_buffer(t)
        assert HostViews().tensor(t) is None  # the short way leaves it to the long one

    def direct(comm):
        refused = []
        for t in not_dense:
            with pytest.raises(ArgumentError, match=said) as err:
                comm.allreduce(t)
            refused.append(re.search(said, str(err.value)).group(1))
        return refused

    assert run_group(1, direct, timeout=30)[0] == [str(t.layout) for t in not_dense]

    class NoStorage(torch.Tensor):  # a wrapper subclass: dense and contiguous, no memory
        @staticmethod
        def __new__(cls, shape: tuple[int, ...]) -> Any:
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            raise NotImplementedError(str(func))

    wrapper = NoStorage((3,))  # its address is 0: never viewed, by either way
    assert HostViews().tensor(wrapper) is None
    assert not viewable(wrapper, core_dtypes())
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    with pytest.raises(ArgumentError, match="out is read-only but the op writes"):
        as_buffer(read_only, name="out")
    as_buffer(read_only, writable=False)  # an input only: fine


# --------------------------------------------------------------------------- device arrays


def _fake() -> FakeRuntime:
    rt = runtime("fake")
    assert isinstance(rt, FakeRuntime)
    return rt


def _read_on_another_stream(x: FakeDeviceArray) -> np.ndarray:
    """``x``'s memory copied to the host on a fresh stream, without waiting for anything:
    what a reader that skipped the done event sees."""
    rt = _fake()
    side = rt.new_stream()
    out = np.empty(x.size, x.dtype)
    rt.to_host(out, x.ptr, side)
    rt.synchronize(side)
    return out


def test_device_arrays_refuse_implicit_host_access():
    x = FakeDeviceArray.from_host(np.arange(3.0))
    with pytest.raises(TypeError, match="device memory"):
        np.asarray(x)
    with pytest.raises(TypeError):
        memoryview(x)  # type: ignore[arg-type]
    buf = as_buffer(x)
    assert type(buf) is DeviceBuffer and buf.memory == "fake-cuda"
    with pytest.raises(TypeError, match="takes its staged_for"):
        buf.region(0, 3)
    np.testing.assert_array_equal(x.to_host(), [0, 1, 2])


def test_a_device_buffer_says_where_it_is_and_what_it_waits_for():
    """The contract device engines code against: pointer, runtime, the producer recorded on
    the caller's current stream at issue, that stream."""
    rt = _fake()
    x = FakeDeviceArray.from_host(np.arange(6, dtype=np.int64).reshape(2, 3))
    buf = as_buffer(x, name="x", reads=True, writable=False)
    assert isinstance(buf, DeviceBuffer)
    assert (buf.runtime, buf.pointer, buf.device) == (rt, x.ptr, 0)
    assert (buf.dtype, buf.count, buf.nbytes) == (np.dtype(np.int64), 6, 48)
    assert (buf.reads, buf.writes, buf.done) == (True, False, None)
    assert buf.caller_stream is rt.current_stream()
    assert not rt.event_done(buf.producer)  # the fill is queued behind it, not run
    rt.synchronize(rt.current_stream())
    assert rt.event_done(buf.producer)


def test_a_staged_buffer_waits_for_the_producer_and_nothing_issued_later():
    """The fill of ``x`` is queued and has not run when the op is issued: staging waits for
    it. Work queued on the caller's stream after the op was issued is not waited for."""
    x = FakeDeviceArray.from_host(np.ones(4))
    buf = as_buffer(x).staged_for(HOST_ONLY)
    assert type(buf) is StagedBuffer
    rt = _fake()
    rt.from_host(x.ptr, np.full(4, 2.0), rt.current_stream())  # issued after the op
    buf.before_op()
    np.testing.assert_array_equal(buf.region(0, 4), 1.0)
    assert buf.region(0, 4).ctypes.data == buf.address  # host memory, a mirror


def test_results_reach_the_callers_stream_through_the_done_event_only():
    """After a staged op the host does not block on the copy back: a reader on another
    stream that does not wait reads the old values; the caller's stream, made to wait for
    ``done``, reads the results."""
    x = FakeDeviceArray.from_host(np.arange(4.0))
    data = as_buffer(x)
    buf = data.staged_for(HOST_ONLY)
    buf.before_op()
    buf.copy(buf.region(0, 4), np.full(4, 9.0))
    buf.after_op()
    assert isinstance(data, DeviceBuffer) and data.done is not None
    np.testing.assert_array_equal(_read_on_another_stream(x), [0, 1, 2, 3])
    np.testing.assert_array_equal(x.to_host(), 9.0)
    assert _fake().event_done(data.done)


def test_an_input_the_op_only_fills_is_not_copied_in_and_an_input_it_only_reads_not_back():
    rt = _fake()
    out = FakeDeviceArray.from_host(np.zeros(3))
    buf = as_buffer(out, reads=False).staged_for(HOST_ONLY)
    buf.before_op()
    assert rt.live_allocations() >= 1
    assert not rt.event_done(as_buffer(out).producer)  # nothing waited for the fill
    buf.copy(buf.region(0, 3), np.arange(3.0))
    buf.after_op()
    np.testing.assert_array_equal(out.to_host(), [0, 1, 2])
    x = FakeDeviceArray.from_host(np.ones(3))
    data = as_buffer(x, writable=False)
    staged = data.staged_for(HOST_ONLY)
    staged.before_op()
    staged.region(0, 3)[:] = 5.0  # scribbled on by the op: never copied back
    staged.after_op()
    assert isinstance(data, DeviceBuffer) and data.done is None
    np.testing.assert_array_equal(x.to_host(), 1.0)


def test_every_op_leaves_results_behind_the_done_event_only():
    """Collectives and point-to-point ops over staged fake arrays: inputs filled by work
    still queued when the op is issued; right after each op, its results read on another
    stream without waiting are the old values (the copy back is queued, not waited for),
    and on the caller's stream, which waits for ``done``, the results."""
    def filled(values: np.ndarray) -> FakeDeviceArray:
        """An output whose old values are in place (its fill waited for)."""
        x = FakeDeviceArray.from_host(values)
        _fake().synchronize(_fake().current_stream())
        return x

    def fn(comm):
        r, n = comm.rank, comm.world_size
        stale = {}
        x = FakeDeviceArray.from_host(np.full(5, r + 1.0))  # queued, not run
        comm.allreduce(x)
        stale["allreduce"] = _read_on_another_stream(x)
        out = filled(np.full(2 * n, -1.0))
        comm.allgather(out, FakeDeviceArray.from_host(np.full(2, float(r))))
        stale["allgather"] = _read_on_another_stream(out)
        b = filled(np.full(3, r + 5.0))
        comm.broadcast(b, root=0)
        stale["broadcast"] = _read_on_another_stream(b)
        got = filled(np.full(4, -1.0))
        if r == 0:
            comm.send(FakeDeviceArray.from_host(np.full(4, 10.0)), 1)
            comm.recv(got, 1)
        else:
            comm.recv(got, 0)
            stale["recv"] = _read_on_another_stream(got)
            comm.send(FakeDeviceArray.from_host(np.full(4, 11.0)), 0)
        results = {"allreduce": x, "allgather": out, "broadcast": b, "recv": got}
        return ({name: a.tolist() for name, a in stale.items()},
                {name: a.to_host().tolist() for name, a in results.items()})

    for r, (stale, got) in enumerate(run_group(2, fn, segment_bytes=SEG, timeout=20)):
        assert stale == {"allreduce": [r + 1.0] * 5, "allgather": [-1.0] * 4,
                         "broadcast": [r + 5.0] * 3, **({"recv": [-1.0] * 4} if r else {})}, r
        assert got == {"allreduce": [3.0] * 5, "allgather": [0.0, 0.0, 1.0, 1.0],
                       "broadcast": [5.0] * 3, "recv": [10.0 + 1 - r] * 4}, r


def test_an_op_that_fails_leaves_device_memory_as_it_was():
    def fn(comm):
        x = FakeDeviceArray.from_host(np.full(10 + comm.rank, 1.0))
        with pytest.raises((DesyncError, RemoteError)):
            comm.allreduce(x, algorithm="ring")
        return x.to_host()

    for got in run_group(2, fn, timeout=10):
        np.testing.assert_array_equal(got, 1.0)


def test_the_interface_stream_is_the_one_the_producer_is_recorded_on():
    """v3's ``stream`` key: the producer event is recorded on that stream (not the current
    one), and the results are ordered on it."""
    rt = _fake()
    producer_stream = rt.new_stream()
    x = FakeDeviceArray.empty(4, np.float32)
    rt.from_host(x.ptr, np.arange(4, dtype=np.float32), producer_stream)  # queued there
    buf = as_buffer(Interface(x, stream=producer_stream.handle))
    assert isinstance(buf, DeviceBuffer) and buf.caller_stream is producer_stream
    staged = buf.staged_for(HOST_ONLY)
    staged.before_op()
    np.testing.assert_array_equal(staged.region(0, 4), [0, 1, 2, 3])
    staged.copy(staged.region(0, 4), np.full(4, 7, np.float32))
    staged.after_op()
    out = np.empty(4, np.float32)
    rt.to_host(out, x.ptr, producer_stream)
    rt.synchronize(producer_stream)
    np.testing.assert_array_equal(out, 7.0)


def test_device_arrays_that_cannot_be_read_as_they_are_are_refused_with_what_to_do(
        monkeypatch):
    x = FakeDeviceArray.from_host(np.arange(6.0).reshape(2, 3))
    with pytest.raises(ArgumentError, match=r"y is not C-contiguous \(strides \(8, 16\)\)"):
        as_buffer(Interface(x, strides=(8, 16)), name="y")
    as_buffer(Interface(x, strides=(24, 8)))  # C order spelled out: fine
    with pytest.raises(ArgumentError, match="out is read-only but the op writes"):
        as_buffer(Interface(x, readonly=True), name="out")
    as_buffer(Interface(x, readonly=True), writable=False)  # an input only: fine
    with pytest.raises(ArgumentError, match="y's __cuda_array_interface__ says '<V2', raw "
                       "bytes: .* bfloat16 .*through DLPack"):
        as_buffer(Interface(FakeDeviceArray.empty(2, ml_dtypes.bfloat16)), name="y")
    with pytest.raises(ArgumentError, match="y: dtype uint32 is not supported"):
        as_buffer(Interface(x, typestr="<u4", shape=(3,)), name="y")
    with pytest.raises(ArgumentError, match="stream 0 is ambiguous"):
        as_buffer(Interface(x, stream=0))
    monkeypatch.setenv("RINGCOMM_FAKE_DEVICES", "2")
    two = FakeRuntime()
    two.set_device(1)
    on_one = FakeDeviceArray.empty(3, np.float32, runtime=two)
    two.set_device(0)
    with pytest.raises(ArgumentError, match="z is on device 1 but the current device is 0: "
                       r"make 1 current on this thread first \(.*set_device"):
        as_buffer(on_one, name="z")
    two.set_device(1)
    assert as_buffer(on_one).device == 1


def test_lists_of_device_arrays_are_concatenated_and_written_back():
    """A scatter's list of device arrays is read through their stages; a list the op writes
    (the torch backend's all-gather into a list) gets its part of the result each."""
    def fn(comm):
        r, n = comm.rank, comm.world_size
        out = FakeDeviceArray.from_host(np.full(2, -1.0))
        parts = [FakeDeviceArray.from_host(np.full(2, 10.0 + s)) for s in range(n)]
        comm.scatter(out, parts if r == 0 else None)
        return out.to_host().tolist()

    assert run_group(3, fn, segment_bytes=SEG, timeout=20) == [[10.0 + s] * 2
                                                               for s in range(3)]
    outs = [FakeDeviceArray.from_host(np.full(2, -1.0)) for _ in range(3)]
    joined = Concatenated([as_buffer(o, reads=False) for o in outs], "outs", reads=False,
                          writes=True)
    joined.before_op()
    joined.copy(joined.region(0, 6), np.arange(6.0))
    joined.after_op()
    assert [o.to_host().tolist() for o in outs] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("traced", [False, True], ids=["short-way", "traced"])
def test_device_arrays_on_the_board_are_staged_without_a_forced_algorithm(world, traced):
    """A group with a shared board and no forced algorithm runs a small allreduce one-shot
    and a large one two-shot (three posts of a piece each), broadcasts, all-gathers and
    barriers on the board: device arrays go through host memory there too, and a reader on
    another stream that does not wait for the results sees the old values. Untraced, a
    blocking allreduce takes the communicator's short way; traced, the general one, whose
    trace shows the board ran every op."""
    from ringcomm.transport.board import SLOT_BYTES

    f32 = np.dtype(np.float32)
    large = 2 * SLOT_BYTES // f32.itemsize + 5

    def fn(comm):
        r, n = comm.rank, comm.world_size
        arrays = {
            "small allreduce": FakeDeviceArray.from_host(values(r, 7, 0, f32)),
            "large allreduce": FakeDeviceArray.from_host(values(r, large, 1, f32)),
            "async allreduce": FakeDeviceArray.from_host(values(r, 7, 2, f32)),
            "broadcast": FakeDeviceArray.from_host(values(r, 9, 3, f32)),
            "allgather x": FakeDeviceArray.from_host(values(r, 5, 4, f32)),
            "allgather out": FakeDeviceArray.empty(5 * n, f32),
        }
        chosen = [comm.allreduce_algorithm(arrays[name].nbytes)
                  for name in ("small allreduce", "large allreduce")]
        assert comm.allreduce(arrays["small allreduce"]) is arrays["small allreduce"]
        comm.barrier()
        comm.allreduce(arrays["large allreduce"])
        comm.allreduce(arrays["async allreduce"], "max", async_op=True).wait(timeout=20)
        comm.broadcast(arrays["broadcast"], root=n - 1)
        comm.allgather(arrays["allgather out"], arrays["allgather x"])
        comm.barrier()
        stale = _read_on_another_stream(arrays["allgather out"])  # the last op's output
        return (chosen, stale, {name: a.to_host() for name, a in arrays.items()})

    trace = [] if traced else None
    results = run_group(world, fn, board=True, trace=trace, timeout=20)
    ranks = range(world)
    for r, (chosen, stale, got) in enumerate(results):
        assert chosen == ["board", "twoshot"], chosen
        assert not stale.any()  # the fresh memory's zeros: the results are not there yet
        want = {
            "small allreduce": sum(values(s, 7, 0, np.dtype(np.float64)) for s in ranks),
            "large allreduce": sum(values(s, large, 1, np.dtype(np.float64)) for s in ranks),
            "async allreduce": np.max([values(s, 7, 2, f32) for s in ranks], axis=0),
            "broadcast": values(world - 1, 9, 3, f32),
            "allgather x": values(r, 5, 4, f32),
            "allgather out": np.concatenate([values(s, 5, 4, f32) for s in ranks]),
        }
        for name, expected in want.items():
            assert got[name].tobytes() == expected.astype(f32).tobytes(), (name, r)
    if trace is not None:
        ran = {(e.op.split(" #")[0], e.algorithm) for e in trace}
        assert ran == {("allreduce", "board"), ("allreduce", "twoshot"), ("barrier", "board"),
                       ("broadcast", "board"), ("allgather", "board")}, ran


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_fake_device_allreduce_over_real_processes(cluster):
    done = cluster.run(3, "job_fake_device_allreduce", transport="ipc", timeout=45)
    assert done == [[5, 1 << 18]] * 3


def test_a_registered_kind_that_claims_numpy_arrays_gets_them(monkeypatch):
    """Plain numpy arrays skip the kinds' questions only while no registered kind claims
    them: a later kind can take a type an earlier one takes."""
    from ringcomm.core import arrays

    class Claiming(arrays.NumpyKind):
        def buffer(self, x: Any, name: str, writable: bool, reads: bool) -> Any:
            return ("claimed", name)

    monkeypatch.setattr(arrays, "_KINDS", list(arrays._KINDS))
    monkeypatch.setattr(arrays, "_numpy_first", True)
    x = np.zeros(3, np.float32)
    assert isinstance(arrays.as_buffer(x), arrays.HostBuffer)
    arrays.register(Claiming())
    assert arrays.as_buffer(x, name="x") == ("claimed", "x")
