"""The device runtimes keep CUDA's rules (``ringcomm/core/device/runtime.py``).

The tests of behaviour a GPU shares run over every runtime this machine has (the fake
everywhere, CuPy where a GPU is); the strictness demonstrations (a forgotten wait reads
stale bytes, a misused handle raises) are the fake's own, because only the fake makes them
deterministic.
"""

from __future__ import annotations

import gc
import os
import struct
import tempfile
import threading

import device_peer
import ml_dtypes
import numpy as np
import pytest
from device_peer import Peer

from ringcomm.core.device import available_runtimes, runtime
from ringcomm.core.device.runtime import Allocation, DeviceRuntime
from ringcomm.core.dtypes import REDUCE_OPS, finish_reduction, reduce_into
from ringcomm.errors import ArgumentError
from ringcomm.testing import FakeDeviceArray, FakeDeviceFault, FakeRuntime, fake_device

RUNTIMES = available_runtimes()


@pytest.fixture(params=RUNTIMES)
def rt(request: pytest.FixtureRequest) -> DeviceRuntime:
    return runtime(request.param)


@pytest.fixture
def fake() -> FakeRuntime:
    rt = runtime("fake")
    assert isinstance(rt, FakeRuntime)
    return rt


def put(rt: DeviceRuntime, values: np.ndarray, stream=None) -> Allocation:
    """A fresh allocation holding ``values`` (queued on ``stream``)."""
    stream = stream or rt.current_stream()
    alloc = rt.malloc(values.nbytes)
    rt.from_host(alloc.ptr, np.ascontiguousarray(values), stream)
    return alloc


def get(rt: DeviceRuntime, ptr: int, like: np.ndarray, stream) -> np.ndarray:
    out = np.zeros_like(like)
    rt.to_host(out, ptr, stream)
    rt.synchronize(stream)
    return out


# ----------------------------------------------------------------------------- every runtime

def test_runtime_registry():
    assert "fake" in RUNTIMES
    assert runtime("fake") is runtime("fake")
    with pytest.raises(ArgumentError, match="unknown device runtime 'nope'"):
        runtime("nope")
    if "cupy" not in RUNTIMES:
        with pytest.raises(ArgumentError, match="cupy device runtime cannot be used: CuPy"):
            runtime("cupy")


def test_a_destroyed_events_handle_comes_back_for_the_next_event(rt):
    """Measured on an H100 (CUDA 13, 2026-11-27), 4 of 4: a handle names a slot the process
    reuses, never a lasting identity. Destroyed explicitly or by dropping the event."""
    first = rt.new_event(interprocess=True)
    handle = rt.export_event(first)
    rt.close_event(first)
    second = rt.new_event(interprocess=True)
    assert rt.export_event(second) == handle
    del second
    gc.collect()
    third = rt.new_event(interprocess=True)
    assert rt.export_event(third) == handle
    rt.close_event(third)


def test_copies_and_events_in_order(rt):
    before = rt.live_allocations()
    producer, consumer = rt.new_stream(), rt.new_stream()
    values = np.arange(1000, dtype=np.float32)
    a = rt.malloc(values.nbytes)
    b = rt.malloc(values.nbytes)
    rt.from_host(a.ptr, values, producer)
    ready = rt.new_event()
    rt.record(ready, producer)
    rt.wait_event(consumer, ready)
    rt.copy(b.ptr, a.ptr, values.nbytes, consumer)
    np.testing.assert_array_equal(get(rt, b.ptr, values, consumer), values)
    rt.event_synchronize(ready)
    assert rt.event_done(ready)
    assert rt.external_stream(consumer.handle) is consumer or \
        rt.external_stream(consumer.handle).handle == consumer.handle
    rt.free(a)
    rt.free(b)
    assert rt.live_allocations() == before


def test_never_recorded_event_is_no_wait(rt):
    stream = rt.new_stream()
    event = rt.new_event()
    assert rt.event_done(event)
    rt.event_synchronize(event)  # returns at once
    rt.wait_event(stream, event)
    values = np.arange(8, dtype=np.int64)
    a = rt.malloc(values.nbytes)
    rt.from_host(a.ptr, values, stream)
    np.testing.assert_array_equal(get(rt, a.ptr, values, stream), values)
    rt.free(a)


def _values(dtype: np.dtype, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, count).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(1, 50, count).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(count) + 1j * rng.standard_normal(count)).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


REDUCTIONS = [(op, name) for op in REDUCE_OPS.values() for name in sorted(op.dtypes)]


@pytest.mark.parametrize("op,dtype_name", REDUCTIONS,
                         ids=[f"{op.name}-{d}" for op, d in REDUCTIONS])
def test_reductions_equal_the_host_bits(rt, op, dtype_name):
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(dtype_name)
    count = 257
    x, y = _values(dtype, count, 1), _values(dtype, count, 2)
    expect = np.empty_like(x)
    reduce_into(expect, x, y, op)
    finish_reduction(expect, op, 3)
    stream = rt.new_stream()
    a, b = put(rt, x, stream), put(rt, y, stream)
    rt.reduce(a.ptr, a.ptr, b.ptr, count, dtype, op, stream)  # dst may be a
    rt.finish(a.ptr, count, dtype, op, 3, stream)
    got = get(rt, a.ptr, x, stream)
    if rt.name != "fake" and dtype_name in ("float16", "bfloat16"):
        # a GPU may round 16-bit floats differently from numpy's float32 detour
        np.testing.assert_allclose(got.astype(np.float32), expect.astype(np.float32),
                                   rtol=1e-2)
    else:
        assert got.tobytes() == expect.tobytes()
    rt.free(a)
    rt.free(b)


def test_avg_divides_once_at_the_end(rt):
    op = REDUCE_OPS["avg"]
    stream = rt.new_stream()
    parts = [np.full(16, v, np.float32) for v in (1.0, 2.0, 6.0)]
    acc = put(rt, parts[0], stream)
    others = [put(rt, p, stream) for p in parts[1:]]
    for other in others:
        rt.reduce(acc.ptr, acc.ptr, other.ptr, 16, np.dtype(np.float32), op, stream)
    rt.finish(acc.ptr, 16, np.dtype(np.float32), op, 3, stream)
    got = get(rt, acc.ptr, parts[0], stream)
    np.testing.assert_array_equal(got, np.full(16, 3.0, np.float32))
    for alloc in [acc, *others]:
        rt.free(alloc)


def test_pointer_arithmetic_inside_an_allocation(rt):
    stream = rt.new_stream()
    values = np.arange(64, dtype=np.int32)
    a = put(rt, values, stream)
    b = rt.malloc(values.nbytes)
    rt.copy(b.ptr, a.ptr + 128, 128, stream)  # elements 32..63 to the start of b
    rt.copy(b.ptr + 128, a.ptr, 128, stream)  # elements 0..31 to its end
    got = get(rt, b.ptr, values, stream)
    np.testing.assert_array_equal(got, np.concatenate([values[32:], values[:32]]))
    rt.free(a)
    rt.free(b)


def test_memory_made_elsewhere_is_exported_as_its_allocations_base(rt):
    """A pointer inside an allocation (a pool's block) is exported as the whole allocation:
    its handle, its base and its size (``cuMemGetAddressRange``), never by its own pointer;
    a host address is refused, saying so. On the fake, memory mapped as cuMemCreate maps
    it has no handle."""
    a = rt.malloc(4096)
    handle, base, nbytes = rt.export_user_memory(a.ptr + 1000)
    assert base == a.ptr and nbytes >= 4096 and handle
    host = np.zeros(8)
    with pytest.raises(ValueError):
        rt.export_user_memory(host.ctypes.data)
    if isinstance(rt, FakeRuntime):
        assert handle == rt.export_memory(a)
        mapped = rt.malloc_mapped(64)
        with pytest.raises(ValueError, match="cuMemCreate"):
            rt.export_user_memory(mapped.ptr + 8)
        with pytest.raises(FakeDeviceFault, match="cuMemCreate"):
            rt.export_memory(mapped)
        rt.free(mapped)
    rt.free(a)


def test_current_stream_is_per_thread(rt):
    mine = rt.current_stream()
    assert rt.current_stream() is mine or rt.current_stream().handle == mine.handle
    theirs: list = []
    t = threading.Thread(target=lambda: theirs.append(rt.current_stream().handle))
    t.start()
    t.join(10)
    if rt.name == "fake":  # CuPy's per-thread default is the legacy stream, shared
        assert theirs and theirs[0] != mine.handle


# ------------------------------------------------------------------ the fake's strictness

def test_a_forgotten_wait_reads_stale_memory(fake):
    producer, consumer = fake.new_stream(), fake.new_stream()
    values = np.arange(32, dtype=np.float32)
    a = put(fake, np.zeros(32, np.float32), producer)
    fake.synchronize(producer)
    b = fake.malloc(values.nbytes)
    fake.from_host(a.ptr, values, producer)
    ready = fake.new_event()
    fake.record(ready, producer)
    fake.copy(b.ptr, a.ptr, values.nbytes, consumer)  # no wait_event: the producer has not run
    np.testing.assert_array_equal(get(fake, b.ptr, values, consumer), np.zeros(32))
    fake.wait_event(consumer, ready)
    fake.copy(b.ptr, a.ptr, values.nbytes, consumer)
    np.testing.assert_array_equal(get(fake, b.ptr, values, consumer), values)
    fake.free(a)
    fake.free(b)


def test_a_record_made_after_the_wait_is_not_waited_for(fake):
    producer, consumer = fake.new_stream(), fake.new_stream()
    a = put(fake, np.zeros(4, np.int64), producer)
    ready = fake.new_event()
    fake.record(ready, producer)  # generation 1: the zeros
    fake.wait_event(consumer, ready)  # captures generation 1
    fake.from_host(a.ptr, np.full(4, 7, np.int64), producer)
    fake.record(ready, producer)  # generation 2, after the wait: does not count
    out = np.full(4, -1, np.int64)
    fake.to_host(out, a.ptr, consumer)
    fake.synchronize(consumer)
    np.testing.assert_array_equal(out, np.zeros(4))
    assert not fake.event_done(ready)  # the 7s are not written yet...
    assert fake.event_done(ready)  # ...until a poll has set them going
    fake.free(a)


def test_event_done_keeps_a_polling_loop_live(fake):
    stream = fake.new_stream()
    a = put(fake, np.ones(4), stream)
    event = fake.new_event()
    fake.record(event, stream)
    polls = 0
    while not fake.event_done(event):
        polls += 1
        assert polls < 5
    assert polls == 1
    fake.free(a)


def test_bad_pointers_fault_at_once(fake):
    stream = fake.new_stream()
    a = fake.malloc(64)
    host = np.zeros(8)
    with pytest.raises(FakeDeviceFault, match=r"run past the end .*\(by 8 bytes\)"):
        fake.copy(a.ptr + 8, a.ptr, 64, stream)
    with pytest.raises(FakeDeviceFault, match="not fake device memory"):
        fake.copy(a.ptr, host.ctypes.data, 8, stream)
    with pytest.raises(FakeDeviceFault, match="not fake device memory"):
        fake.to_host(host, a.ptr - 8, stream)
    fake.free(a)
    with pytest.raises(FakeDeviceFault, match=f"{a.ptr:#x} lies in the allocation freed"):
        fake.from_host(a.ptr, host, stream)
    with pytest.raises(FakeDeviceFault, match="double free"):
        fake.free(a)


def test_free_first_runs_the_queued_work_that_uses_the_memory(fake):
    stream = fake.new_stream()
    a = put(fake, np.arange(4, dtype=np.int16), stream)
    b = fake.malloc(8)
    fake.copy(b.ptr, a.ptr, 8, stream)
    fake.free(a)  # waits for the queued copy, as cudaFree waits for the device
    assert fake.live_allocations() >= 1
    np.testing.assert_array_equal(get(fake, b.ptr, np.zeros(4, np.int16), stream),
                                  np.arange(4))
    fake.free(b)


def test_handles_refuse_misuse_in_one_process(fake):
    a = fake.malloc(64)
    handle = fake.export_memory(a)
    with pytest.raises(FakeDeviceFault, match="own allocation"):
        fake.open_memory(handle)
    with pytest.raises(FakeDeviceFault, match="not a fake memory handle"):
        fake.open_memory(b"junk")
    with pytest.raises(FakeDeviceFault, match="no mapping opened with open_memory"):
        fake.close_memory(a.ptr)
    event = fake.new_event(interprocess=True)
    with pytest.raises(FakeDeviceFault, match="event of this process"):
        fake.open_event(fake.export_event(event))
    with pytest.raises(FakeDeviceFault, match="only an event made with new_event"):
        fake.export_event(fake.new_event())
    fake.free(a)
    with pytest.raises(FakeDeviceFault, match="only the base of a live allocation"):
        fake.export_memory(a)


def test_a_pending_record_keeps_an_events_slot_until_it_runs(fake):
    """cudaEventDestroy on an event whose record has not completed returns at once and
    releases the event once the device is done with it (CUDA runtime docs): until then its
    handle is not given to a new event."""
    stream = fake.new_stream()
    event = fake.new_event(interprocess=True)
    handle = fake.export_event(event)
    fake.record(event, stream)  # queued: nothing runs it yet
    fake.close_event(event)
    with pytest.raises(FakeDeviceFault, match="closed with close_event"):
        fake.record(event, stream)
    other = fake.new_event(interprocess=True)
    assert fake.export_event(other) != handle
    fake.synchronize(stream)  # the record runs: now the slot is free
    assert fake.export_event(fake.new_event(interprocess=True)) == handle


def test_host_registration_is_tracked(fake):
    before = fake.live_allocations()
    ring = np.zeros(4096, np.uint8)
    address = ring.ctypes.data
    fake.host_register(address, ring.nbytes)
    assert fake.live_allocations() == before + 1
    with pytest.raises(FakeDeviceFault, match="overlaps"):
        fake.host_register(address + 100, 10)
    fake.host_unregister(address)
    with pytest.raises(FakeDeviceFault, match="no range registered"):
        fake.host_unregister(address)
    assert fake.live_allocations() == before


def test_streams_and_devices_are_checked(fake):
    with pytest.raises(FakeDeviceFault, match="no fake stream has handle"):
        fake.external_stream(0x1)
    with pytest.raises(FakeDeviceFault, match="has 1 device"):
        fake.set_device(1)
    fake.set_device(0)
    assert fake.device_count() == 1 and fake.describe()["device"] == "fake (numpy)"


def test_an_array_dropped_while_another_stream_uses_it_is_a_fault(fake):
    """A pool allocator (CuPy's, torch's caching one) hands a dropped array's memory out again
    at once, for its own stream; work queued on another stream that still reads it would read
    whatever comes next. The fake says so at the next safe point; work on the array's own
    stream is fine (stream order protects it)."""
    mine, other = fake.current_stream(), fake.new_stream()
    x = FakeDeviceArray.from_host(np.arange(8.0))
    scratch = fake.malloc(x.nbytes)
    fake.copy(scratch.ptr, x.ptr, x.nbytes, mine)
    del x  # only its own stream has work on it
    fake.live_allocations()
    y = FakeDeviceArray.from_host(np.arange(8.0))
    fake.copy(scratch.ptr, y.ptr, y.nbytes, other)  # queued on another stream, not run
    del y
    with pytest.raises(FakeDeviceFault, match="released .* while queued device work still "
                                              "uses it: copy on stream"):
        fake.live_allocations()
    fake.synchronize(other)
    fake.synchronize(mine)
    fake.free(scratch)


def test_a_closed_event_is_not_waited_on_or_recorded(fake):
    stream = fake.new_stream()
    event = fake.new_event()
    fake.record(event, stream)
    fake.close_event(event)
    with pytest.raises(FakeDeviceFault, match="closed with close_event"):
        fake.wait_event(stream, event)
    with pytest.raises(FakeDeviceFault, match="closed with close_event"):
        fake.record(event, stream)
    fake.synchronize(stream)


def test_fake_device_array_refuses_host_access(fake):
    before = fake.live_allocations()
    x = FakeDeviceArray.from_host(np.arange(6.0).reshape(2, 3))
    assert (x.shape, x.size, x.nbytes, x.dtype) == ((2, 3), 6, 48, np.float64)
    with pytest.raises(TypeError, match=r"\.to_host\(\)"):
        np.asarray(x)
    with pytest.raises(TypeError):
        memoryview(x)  # type: ignore[arg-type]
    np.testing.assert_array_equal(x.to_host(), np.arange(6.0).reshape(2, 3))
    assert fake.live_allocations() == before + 1
    y = FakeDeviceArray.empty(3, np.int32)
    y.close()
    del x
    gc.collect()
    assert fake.live_allocations() == before


def test_from_host_reads_the_values_when_the_copy_runs(fake):
    values = np.arange(4.0)
    x = FakeDeviceArray.from_host(values)  # from_host keeps its own copy of values
    values[:] = -1
    np.testing.assert_array_equal(x.to_host(), np.arange(4.0))
    stream = fake.current_stream()
    host = np.arange(4.0)
    fake.from_host(x.ptr, host, stream)  # the runtime's copy reads host when it runs
    host[:] = 9
    np.testing.assert_array_equal(x.to_host(), np.full(4, 9.0))
    x.close()


# ----------------------------------------------------------------------------- two processes

SCRATCH_DIRS = ("/dev/shm", tempfile.gettempdir())


def _listing() -> set[str]:
    return {os.path.join(d, n) for d in SCRATCH_DIRS for n in os.listdir(d)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", RUNTIMES)
def test_ipc_between_two_processes(name):
    """Memory and an event exported by one process, opened by the other, both ways: the
    waiting consumer reads what the producer queued; on the fake, one that skips the wait
    reads what was there before, and the exporter cannot free before the importer closes."""
    rt = runtime(name)
    strict = name == "fake"
    before, files_before = rt.live_allocations(), _listing()
    peer = Peer(name)
    try:
        first = np.arange(4096, dtype=np.float32)
        second = first * 2
        # the peer exports, this process imports
        here: dict = {}
        memory, event = peer("export", nbytes=first.nbytes)
        device_peer.open_(rt, here, memory, event)
        # a handle opened again: the same mapping, counted (cuIpcOpenMemHandle); an event
        # opened again is an event of its own (measured); each is closed once
        assert rt.open_memory(memory) == here["peer"]
        again = rt.open_event(event)
        assert again is not here["peer_ready"]
        assert rt.live_allocations() == before + 4
        rt.close_memory(here["peer"])
        rt.close_event(again)
        assert rt.live_allocations() == before + 2
        if strict:
            with pytest.raises(FakeDeviceFault, match="closed already"):
                rt.close_event(again)
            with pytest.raises(FakeDeviceFault, match="can be waited on here, not recorded"):
                rt.record(here["peer_ready"], here["stream"])
        peer("produce", values=first)  # queued there, not run
        if strict:
            stale = device_peer.consume(rt, here, first, wait=False)
            np.testing.assert_array_equal(stale, np.zeros_like(first))
        np.testing.assert_array_equal(device_peer.consume(rt, here, first, wait=True), first)
        peer("produce", values=second)
        if strict:
            stale = device_peer.consume(rt, here, first, wait=False)
            np.testing.assert_array_equal(stale, first)
        np.testing.assert_array_equal(device_peer.consume(rt, here, first, wait=True), second)
        if strict:
            status, text = peer.ask("free")
            assert status == "error" and f"process(es) {os.getpid()} still map" in text
            status, text = peer.ask("destroy")
            assert status == "error" and f"process(es) {os.getpid()} still have" in text
        mapped_at = here["peer"]
        device_peer.close(rt, here)
        if strict:
            with pytest.raises(FakeDeviceFault, match="mapping of process .* closed earlier"):
                rt.copy(mapped_at, mapped_at, 4, rt.current_stream())
            with pytest.raises(FakeDeviceFault, match="no mapping opened"):
                rt.close_memory(mapped_at)
        peer("free")
        peer("destroy")
        if strict:
            with pytest.raises(FakeDeviceFault, match="has exited or given it back|is stale"):
                rt.open_memory(memory)
        assert peer("live") == 0
        # this process exports, the peer imports (this process's device thread serves it)
        mine: dict = {}
        memory, event = device_peer.export(rt, mine, first.nbytes)
        peer("open", memory=memory, event=event)
        device_peer.produce(rt, mine, second)
        np.testing.assert_array_equal(peer("consume", like=first, wait=True), second)
        if strict:
            with pytest.raises(FakeDeviceFault, match=f"process\\(es\\) {peer.pid} still map"):
                device_peer.free(rt, mine)
            with pytest.raises(FakeDeviceFault, match=f"process\\(es\\) {peer.pid} still have"):
                device_peer.destroy(rt, mine)
            mapped = peer("maps")
            assert any("memfd:ringcomm-fake-device" in m for m in mapped)
            assert not any(m.startswith(SCRATCH_DIRS) and "fake" in m for m in mapped)
        peer("close")
        device_peer.free(rt, mine)
        device_peer.destroy(rt, mine)
    finally:
        peer.close()
    assert rt.live_allocations() == before
    ours = ("fake", str(os.getpid()), str(peer.pid))  # others' tests may add files meanwhile
    assert not {f for f in _listing() - files_before if any(o in f for o in ours)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", RUNTIMES)
def test_a_chain_of_waits_through_another_process(name):
    """This process produces, the peer relays (waits on us, copies, records), this process
    waits on the peer: each side's work runs only when the other asks for it (fake)."""
    rt = runtime(name)
    peer = Peer(name)
    mine: dict = {}
    theirs: dict = {}
    values = np.arange(1000, dtype=np.int64)
    try:
        memory, event = device_peer.export(rt, mine, values.nbytes)
        device_peer.produce(rt, mine, values)
        relayed = peer("relay", memory=memory, event=event, nbytes=values.nbytes)
        device_peer.open_(rt, theirs, *relayed)
        np.testing.assert_array_equal(device_peer.consume(rt, theirs, values, wait=True), values)
        device_peer.close(rt, theirs)
        peer("close")
        peer("free")
        device_peer.free(rt, mine)
    finally:
        peer.close()


@pytest.mark.timeout(30)
def test_a_wait_on_a_dead_process_is_a_device_hang(fake):
    """The recording process dies before its device thread ran the record: the waiter gets
    FakeDeviceFault("device hang") once the fake's timeout is over, not a wait forever."""
    peer = Peer("fake")
    theirs: dict = {}
    values = np.arange(8, dtype=np.float64)
    saved = fake.hang_timeout
    try:
        memory, event = peer("export", nbytes=values.nbytes)
        device_peer.open_(fake, theirs, memory, event)
        peer("produce", values=values)
        peer.kill()
        peer.proc.join(10)
        fake.hang_timeout = 0.5
        with pytest.raises(FakeDeviceFault, match="device hang: the host waited 0.5 s"):
            fake.event_synchronize(theirs["peer_ready"])
        device_peer.close(fake, theirs)
    finally:
        fake.hang_timeout = saved
        peer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", RUNTIMES)
def test_a_reused_event_handle_opens_again_in_the_importer(name):
    """What a second communicator in a process meets: the peer destroys its event and makes
    the next, whose handle has the same bytes; this process, which opened and closed the
    old one, opens the new one and waits on it (once refused, as "open already")."""
    rt = runtime(name)
    peer = Peer(name)
    here: dict = {}
    values = np.arange(256, dtype=np.float32)
    try:
        memory, event = peer("export", nbytes=values.nbytes)
        device_peer.open_(rt, here, memory, event)
        rt.close_event(here.pop("peer_ready"))
        again = peer("renew")
        assert again == event
        here["peer_ready"] = rt.open_event(again)
        peer("produce", values=values)
        np.testing.assert_array_equal(device_peer.consume(rt, here, values, wait=True), values)
        device_peer.close(rt, here)
        peer("free")
        peer("destroy")
        assert peer("live") == 0
    finally:
        peer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", RUNTIMES)
def test_a_killed_importer_does_not_block_the_free(name):
    rt = runtime(name)
    peer = Peer(name)
    mine: dict = {}
    try:
        memory, event = device_peer.export(rt, mine, 1024)
        peer("open", memory=memory, event=event)
        if name == "fake":
            with pytest.raises(FakeDeviceFault, match="still map"):
                device_peer.free(rt, mine)
        peer.kill()
        peer.proc.join(10)  # reaped: no process of that pid any more
        device_peer.free(rt, mine)
    finally:
        peer.close()


# ----------------------------------------------------------------------------- the fake's refusals
# each refusal of the fake (``ringcomm/testing/fake_device.py`` lists them with their sources)
# has a test that fails once the refusal is taken out


def test_streams_and_events_of_no_runtime_here_are_refused(fake):
    """A stream of another runtime object (a second library's, a stale one) is no stream of
    this process's runtime; an object that is no fake event is no event."""
    with pytest.raises(FakeDeviceFault, match="is not a stream of this process's fake runtime"):
        fake.synchronize(FakeRuntime().new_stream())
    with pytest.raises(FakeDeviceFault, match="is not an event of the fake runtime"):
        fake.record(object(), fake.new_stream())


def test_a_stream_whose_work_failed_runs_nothing_more(fake):
    """As a CUDA error is sticky: once an item failed as it ran, the stream runs nothing
    queued after it, and every later wait for it says so."""
    stream = fake.new_stream()
    a = put(fake, np.ones(4), stream)
    # numpy has no bitwise and of floats: the item fails when it runs, not when it is queued
    fake.reduce(a.ptr, a.ptr, a.ptr, 4, np.dtype(np.float64), REDUCE_OPS["band"], stream)
    with pytest.raises(TypeError):
        fake.synchronize(stream)
    after = fake.new_event()
    fake.record(after, stream)
    with pytest.raises(FakeDeviceFault, match="faulted earlier and runs nothing more"):
        fake.event_synchronize(after)
    fake.free(a)


def test_arguments_a_gpu_would_refuse_are_refused_at_the_call(fake):
    """A negative size, a pointer that is not an allocation's base, a null host range, a
    host buffer a device copy cannot use, a handle that is no fake event handle."""
    stream = fake.new_stream()
    a = fake.malloc(64)
    with pytest.raises(FakeDeviceFault, match="give a number of bytes, 0 or more"):
        fake.malloc(-1)
    with pytest.raises(FakeDeviceFault, match="not the base of an allocation made here"):
        fake.free(Allocation(a.ptr + 8, 56, 0))
    with pytest.raises(FakeDeviceFault, match="give a mapped host address and a positive"):
        fake.host_register(np.zeros(8).ctypes.data, 0)
    read_only = np.zeros(8)
    read_only.flags.writeable = False
    with pytest.raises(FakeDeviceFault, match="dst must be a writable, contiguous"):
        fake.to_host(read_only, a.ptr, stream)
    with pytest.raises(FakeDeviceFault, match="src must be a contiguous numpy array"):
        fake.from_host(a.ptr, np.arange(16.0).reshape(4, 4)[:, :2], stream)
    with pytest.raises(FakeDeviceFault, match="not a fake event handle"):
        fake.open_event(b"junk")
    fake.synchronize(stream)
    fake.free(a)


@pytest.mark.timeout(60)
def test_a_handle_naming_another_allocation_or_event_is_refused(fake):
    """A handle whose memfd is live but holds another allocation or event (the exporter
    freed the one named and its fd number went to the next) is refused, not mapped as if it
    were the one named; the refusal leaves no importer behind."""
    before = fake.live_allocations()
    peer = Peer("fake")
    try:
        memory, event = peer("export", nbytes=64)
        magic, pid, fd, ident, nbytes = struct.unpack("<8sQQQQ", memory)
        with pytest.raises(FakeDeviceFault, match="is stale"):
            fake.open_memory(struct.pack("<8sQQQQ", magic, pid, fd, ident + 1000, nbytes))
        magic, pid, fd, ident = struct.unpack("<8sQQQ", event)
        with pytest.raises(FakeDeviceFault, match="names no event slot"):
            fake.open_event(struct.pack("<8sQQQ", magic, pid, fd, ident + 1000))
        assert fake.live_allocations() == before
        peer("free")  # nobody maps it: the refusals registered no importer
        peer("destroy")
    finally:
        peer.close()


@pytest.mark.timeout(60)
def test_a_handle_opened_on_two_threads_at_once_is_refused_on_the_second(fake, monkeypatch):
    peer = Peer("fake")
    inside, go_on = threading.Event(), threading.Event()
    real, calls = fake_device._open_peer_fd, []

    def slow(*args):  # the first open stops inside, before its mapping is registered
        calls.append(args)
        if len(calls) == 1:
            inside.set()
            go_on.wait(10)
        return real(*args)
    monkeypatch.setattr(fake_device, "_open_peer_fd", slow)
    try:
        memory, _ = peer("export", nbytes=64)
        first: list[int] = []
        t = threading.Thread(target=lambda: first.append(fake.open_memory(memory)))
        t.start()
        assert inside.wait(10)
        with pytest.raises(FakeDeviceFault, match="being opened on another thread right now"):
            fake.open_memory(memory)
        go_on.set()
        t.join(10)
        fake.close_memory(first[0])
        peer("free")
        peer("destroy")
    finally:
        go_on.set()
        peer.close()


@pytest.mark.timeout(60)
def test_the_importer_table_holds_128_opens(fake):
    """Each open of an event handle is an importer of its own (measured); the fake's table
    has 128 places, and the 129th open is refused rather than left untracked (an untracked
    importer would let the exporter destroy the event under it)."""
    peer = Peer("fake")
    try:
        _, event = peer("export", nbytes=64)
        opened = [fake.open_event(event) for _ in range(128)]
        with pytest.raises(FakeDeviceFault, match="is open in 128 places already"):
            fake.open_event(event)
        for ev in opened:
            fake.close_event(ev)
        fake.close_event(fake.open_event(event))  # a place is free again
        peer("free")
        peer("destroy")
    finally:
        peer.close()
