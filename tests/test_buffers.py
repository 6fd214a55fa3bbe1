"""The buffer protocol over every kind of array, in the manner of mpi4py's ``arrayimpl``: each
kind (numpy, torch CPU, the numpy-backed fake device) is described once below, and the
tests run over all of them.

Every collective and point-to-point op gives, for every kind, world sizes 1-4 and several
dtypes, the numpy reference (small integers keep sums exact, so the comparisons are exact
and the kinds agree bit for bit). Host kinds are used in place; the fake device is reached
only through explicit copies, after ``before_op`` and before ``after_op``, which its log
shows and its strict reads enforce. One test runs fake-device arrays over real processes.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from ringcomm import ArgumentError, DesyncError, RemoteError
from ringcomm.core.arrays import (
    HOST_ONLY,
    HostBuffer,
    NumpyKind,
    StagedBuffer,
    TorchCPUKind,
    as_buffer,
    kinds,
)
from ringcomm.core.dtypes import REDUCE_OPS
from ringcomm.core.fake_device import FakeDeviceArray, FakeDeviceKind, FakeStream
from ringcomm.core.tensors import TorchCUDAKind
from ringcomm.runtime.local import run_group

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
    kind = FakeDeviceKind

    def make(self, values: np.ndarray) -> FakeDeviceArray:
        return FakeDeviceArray(values)

    def read(self, x: FakeDeviceArray) -> np.ndarray:
        return x.to_host().reshape(-1)


class TorchCUDA(Torch):
    """CUDA tensors: device memory, staged through the host by their kind (run where there
    is a GPU)."""

    kind = TorchCUDAKind

    def make(self, values: np.ndarray) -> torch.Tensor:
        return super().make(values).cuda()

    def read(self, x: torch.Tensor) -> np.ndarray:
        return super().read(x.cpu())


KINDS = [Numpy(), Torch(), Fake()]
IDS = ["numpy", "torch", "fake"]
NEEDS_A_GPU = [pytest.param(TorchCUDA(), id="cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA tensors need a GPU"))]


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
    assert results[0] == results[1] == results[2]
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
    with pytest.raises(ArgumentError, match="dtype <U1 is not supported"):
        as_buffer(FakeDeviceArray(np.array(["a"])))
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    with pytest.raises(ArgumentError, match="out is read-only but the op writes"):
        as_buffer(read_only, name="out")
    as_buffer(read_only, writable=False)  # an input only: fine


# --------------------------------------------------------------------------- the fake device


def test_the_fake_device_refuses_implicit_host_access():
    x = FakeDeviceArray(np.arange(3.0))
    with pytest.raises(TypeError, match="in device memory"):
        np.asarray(x)
    with pytest.raises(TypeError):
        memoryview(x)
    with pytest.raises(RuntimeError, match="unfinished: wait for the stream"):
        x.to_host()  # the work that filled it was never waited for
    x.wait_stream()
    np.testing.assert_array_equal(x.to_host(), [0, 1, 2])
    x.from_host(np.array([5.0, 6, 7]))
    with pytest.raises(RuntimeError, match="must record them first"):
        x.to_host()
    x.record()
    np.testing.assert_array_equal(x.to_host(), [5, 6, 7])
    assert x.log == ["wait", "to_host", "from_host", "record", "to_host"]
    assert (x.copies_to_host, x.copies_from_host) == (2, 1)


def test_a_staged_buffer_waits_only_for_work_issued_before_the_op():
    """The producer is taken when the op is issued: work queued on the array's stream
    afterwards is a race the fake device reports, as a real device would corrupt data."""
    stream = FakeStream("user")
    x = FakeDeviceArray(np.ones(4), stream=stream)
    buf = as_buffer(x).staged_for(HOST_ONLY)
    assert type(buf) is StagedBuffer
    x.fill_async(2.0)  # launched after the op was issued
    with pytest.raises(RuntimeError, match="unfinished"):
        buf.before_op()
    y = FakeDeviceArray(np.ones(4), stream=stream)  # issued after all of the stream's work
    buf = as_buffer(y).staged_for(HOST_ONLY)
    buf.before_op()
    np.testing.assert_array_equal(buf.region(0, 4), 1.0)
    assert buf.region(0, 4).ctypes.data == buf.address  # host memory, a mirror
    assert y.log == ["wait", "to_host"]


def test_the_executor_calls_the_hooks_around_its_copies():
    """Inputs are copied in after ``before_op`` waited for their producer; outputs copied back,
    then recorded; outputs an op only fills are not copied in; every result is written back."""
    def fn(comm):
        r, n = comm.rank, comm.world_size
        arrays = {
            "allreduce": FakeDeviceArray(np.full(5, r + 1.0)),
            "allgather x": FakeDeviceArray(np.full(2, float(r))),
            "allgather out": FakeDeviceArray.empty(2 * n, np.float64),
            "broadcast": FakeDeviceArray(np.full(3, float(r))),
            "send": FakeDeviceArray(np.full(4, 10.0 + r)),
            "recv": FakeDeviceArray.empty(4, np.float64),
        }
        comm.allreduce(arrays["allreduce"])
        comm.allgather(arrays["allgather out"], arrays["allgather x"])
        comm.broadcast(arrays["broadcast"], root=0)
        posted = comm.recv(arrays["recv"], 1 - r, async_op=True)
        comm.send(arrays["send"], 1 - r)
        posted.wait(timeout=20)
        logs = {name: list(a.log) for name, a in arrays.items()}
        values = {name: a.to_host().tolist() for name, a in arrays.items()}
        return logs, values

    both = run_group(2, fn, segment_bytes=SEG, timeout=20)
    read_write = ["wait", "to_host", "from_host", "record"]
    for r, (logs, got) in enumerate(both):
        assert logs == {
            "allreduce": read_write,
            "allgather x": ["wait", "to_host", "record"],
            "allgather out": ["wait", "from_host", "record"],
            "broadcast": read_write if r == 0 else ["wait", "from_host", "record"],
            "send": ["wait", "to_host", "record"],
            "recv": ["wait", "from_host", "record"],
        }, r
        assert got["allreduce"] == [3.0] * 5
        assert got["allgather out"] == [0.0, 0.0, 1.0, 1.0]
        assert got["broadcast"] == [0.0] * 3
        assert got["recv"] == [10.0 + 1 - r] * 4


def test_an_op_that_fails_leaves_device_memory_as_it_was():
    def fn(comm):
        x = FakeDeviceArray(np.full(10 + comm.rank, 1.0))
        with pytest.raises((DesyncError, RemoteError)):
            comm.allreduce(x, algorithm="ring")
        return list(x.log), x.to_host()

    for log, got in run_group(2, fn, timeout=10):
        assert log == ["wait", "to_host"]
        np.testing.assert_array_equal(got, 1.0)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("traced", [False, True], ids=["short-way", "traced"])
def test_device_arrays_on_the_board_are_staged_without_a_forced_algorithm(world, traced):
    """A group with a shared board and no forced algorithm runs a small allreduce one-shot
    and a large one two-shot (three posts of a piece each), broadcasts, all-gathers and
    barriers on the board: device arrays go through host memory there too, copied in after
    ``before_op`` and back before ``after_op``. Untraced, a blocking allreduce takes the
    communicator's short way; traced, the general one, whose trace shows the board ran
    every op."""
    from ringcomm.transport.board import SLOT_BYTES

    f32 = np.dtype(np.float32)
    large = 2 * SLOT_BYTES // f32.itemsize + 5

    def fn(comm):
        r, n = comm.rank, comm.world_size
        arrays = {
            "small allreduce": FakeDeviceArray(values(r, 7, 0, f32)),
            "large allreduce": FakeDeviceArray(values(r, large, 1, f32)),
            "async allreduce": FakeDeviceArray(values(r, 7, 2, f32)),
            "broadcast": FakeDeviceArray(values(r, 9, 3, f32)),
            "allgather x": FakeDeviceArray(values(r, 5, 4, f32)),
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
        return (chosen, {name: list(a.log) for name, a in arrays.items()},
                {name: a.to_host() for name, a in arrays.items()})

    trace = [] if traced else None
    results = run_group(world, fn, board=True, trace=trace, timeout=20)
    ranks = range(world)
    read_write = ["wait", "to_host", "from_host", "record"]
    for r, (chosen, logs, got) in enumerate(results):
        assert chosen == ["board", "twoshot"], chosen
        assert logs == {
            "small allreduce": read_write,
            "large allreduce": read_write,
            "async allreduce": read_write,
            "broadcast": read_write if r == world - 1 else ["wait", "from_host", "record"],
            "allgather x": ["wait", "to_host", "record"],
            "allgather out": ["wait", "from_host", "record"],
        }, r
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
    logs = cluster.run(3, "job_fake_device_allreduce", transport="ipc", timeout=45)
    assert logs == [[["wait", "to_host", "from_host", "record"]] * 2] * 3


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
