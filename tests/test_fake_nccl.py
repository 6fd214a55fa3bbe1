"""The fake of CuPy's ``cupy.cuda.nccl`` refuses what CuPy and NCCL refuse, and allows what
they allow (``ringcomm/testing/fake_nccl.py`` lists each rule and its source). Ranks are
threads of this process, each with a communicator of its own."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ringcomm.core.device import nccl_library, runtime
from ringcomm.core.device.nccl import NCCL_DTYPES, NCCL_OPS
from ringcomm.testing import (
    FakeCupyNccl,
    FakeDeviceArray,
    FakeDeviceFault,
    FakeNcclError,
    fake_nccl,
)

pytestmark = pytest.mark.timeout(60)
RT = runtime("fake")
NCCL = FakeCupyNccl.of(RT)
FLOAT32, UINT8, SUM = NCCL_DTYPES["float32"], NCCL_DTYPES["uint8"], NCCL_OPS["sum"]


def ranks(world: int, fn: Callable[[Any, int], Any]) -> list[Any]:
    """``fn(comm, rank)`` on ``world`` threads, each with its own communicator of one id;
    each rank's result, or the exception it raised."""
    uid = NCCL.get_unique_id()
    out: list[Any] = [None] * world

    def main(rank: int) -> None:
        comm = NCCL.NcclCommunicator(world, uid, rank)
        try:
            out[rank] = fn(comm, rank)
        except BaseException as err:  # noqa: BLE001 - the test looks at it (a failed
            out[rank] = err  # pytest.raises is a BaseException too: it must not vanish)
        finally:
            comm.destroy()
    threads = [threading.Thread(target=main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_the_unique_id_is_128_bytes_and_nothing_else_makes_a_communicator() -> None:
    uid = NCCL.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    # measured with CuPy 14.2 on an H100: what ringcomm once passed
    with pytest.raises(TypeError, match=r"^Argument 'commId' has incorrect type \(expected "
                                        r"bytes, got tuple\)$"):
        NCCL.NcclCommunicator(1, tuple(uid), 0)
    with pytest.raises(AssertionError):  # CuPy: assert len(commId) == NCCL_UNIQUE_ID_BYTES
        NCCL.NcclCommunicator(1, uid[:127], 0)


def test_ringcomms_adapter_passes_the_id_as_bytes() -> None:
    library = nccl_library(RT)
    assert library.name == "fake" and library.version() == "2.28.9"
    comm = library.connect(1, library.unique_id(), 0)
    comm.destroy()


def test_an_ended_communicator_refuses_calls_and_ends_again_quietly() -> None:
    x = FakeDeviceArray.from_host(np.ones(4, np.float32))
    stream = RT.current_stream().handle

    def run(comm: Any, rank: int) -> list[str]:
        comm.allReduce(x.ptr, x.ptr, 4, FLOAT32, SUM, stream)
        RT.synchronize(RT.current_stream())
        comm.abort()
        comm.abort()  # CuPy: nothing once its handle is NULL
        comm.destroy()
        seen = []
        for call in (lambda: comm.allReduce(x.ptr, x.ptr, 4, FLOAT32, SUM, stream),
                     lambda: comm.send(x.ptr, 16, UINT8, 0, stream),
                     comm.check_async_error):
            with pytest.raises(FakeNcclError, match="NCCL_ERROR_INVALID_ARGUMENT") as info:
                call()
            seen.append(str(info.value))
        return seen
    (seen,) = ranks(1, run)
    assert not isinstance(seen, Exception), seen
    assert all("already aborted" in text for text in seen)


def test_a_peer_out_of_range_and_a_group_end_without_start_are_refused() -> None:
    x = FakeDeviceArray.from_host(np.ones(4, np.float32))
    stream = RT.current_stream().handle

    def run(comm: Any, rank: int) -> None:
        with pytest.raises(FakeNcclError, match="INVALID_ARGUMENT.*peer 2"):
            comm.send(x.ptr, 16, UINT8, 2, stream)
        with pytest.raises(FakeNcclError, match="INVALID_USAGE"):
            NCCL.groupEnd()
    assert ranks(2, run) == [None, None]


def test_refusals_of_one_thread_are_refused_on_it() -> None:
    with pytest.raises(FakeNcclError, match="INVALID_USAGE"):
        NCCL.groupEnd()
    x = FakeDeviceArray.from_host(np.ones(4, np.float32))
    stream = RT.current_stream().handle
    RT.synchronize(RT.current_stream())
    comm = NCCL.NcclCommunicator(1, NCCL.get_unique_id(), 0)
    try:
        with pytest.raises(FakeNcclError, match="INVALID_ARGUMENT.*peer 1"):
            comm.send(x.ptr, 16, UINT8, 1, stream)
        with pytest.raises(FakeNcclError, match="INVALID_ARGUMENT: datatype 99"):
            comm.allReduce(x.ptr, x.ptr, 4, 99, SUM, stream)
        with pytest.raises(FakeNcclError, match="INVALID_ARGUMENT: reduction 99"):
            comm.allReduce(x.ptr, x.ptr, 4, FLOAT32, 99, stream)
    finally:
        comm.destroy()


@pytest.mark.timeout(20)
def test_ids_and_ranks_a_communicator_cannot_be_made_of() -> None:
    uid = NCCL.get_unique_id()
    with pytest.raises(FakeDeviceFault, match="not a fake NCCL unique id"):
        NCCL.NcclCommunicator(1, bytes(128), 0)
    saved, RT.hang_timeout = RT.hang_timeout, 1.0  # a fake without the check waits this long
    try:
        with pytest.raises(FakeNcclError, match="INVALID_ARGUMENT: rank 2 of a communicator "
                                                "of 2"):
            NCCL.NcclCommunicator(2, NCCL.get_unique_id(), 2)
    finally:
        RT.hang_timeout = saved
    comm = NCCL.NcclCommunicator(1, uid, 0)
    try:
        with pytest.raises(FakeDeviceFault, match="rank 0 connects twice with one NCCL id"):
            NCCL.NcclCommunicator(1, uid, 0)
        gc.collect()  # the refused rank's end leaves the id to its members
        with pytest.raises(FakeDeviceFault, match="connects with 2 ranks to an NCCL id others "
                                                  "used with 1"):
            NCCL.NcclCommunicator(2, uid, 1)
    finally:
        comm.destroy()
    with pytest.raises(FakeDeviceFault, match="the id's broker cannot be reached"):
        NCCL.NcclCommunicator(1, uid, 0)  # every rank of that id ended: its broker is gone


@pytest.mark.timeout(10)
def test_a_rank_that_never_joins_is_an_init_hang() -> None:
    saved, RT.hang_timeout = RT.hang_timeout, 0.3
    try:
        with pytest.raises(FakeDeviceFault, match="NCCL init hang: rank 0 waited 0.3 s for 1 "
                                                  "more ranks"):
            NCCL.NcclCommunicator(2, NCCL.get_unique_id(), 0)
    finally:
        RT.hang_timeout = saved


def test_work_queued_before_destroy_faults_when_it_runs() -> None:
    x = FakeDeviceArray.from_host(np.ones(4, np.float32))
    stream = RT.new_stream()
    RT.synchronize(RT.current_stream())
    comm = NCCL.NcclCommunicator(1, NCCL.get_unique_id(), 0)
    comm.allReduce(x.ptr, x.ptr, 4, FLOAT32, SUM, stream.handle)  # queued, not run
    comm.destroy()
    with pytest.raises(FakeDeviceFault, match="rank 0: NCCL used after it ended"):
        RT.synchronize(stream)


@pytest.mark.parametrize("call", ["send", "allReduce"])
def test_a_call_its_peer_never_matches_is_a_device_hang(call: str) -> None:
    """Rank 1 never launches the receive or the collective: rank 0's wait for it ends in a
    FakeDeviceFault after the hang timeout, not never (a rescue abort ends it if not)."""
    def run(comm: Any, rank: int) -> str | None:
        if rank == 1:
            return None
        x = FakeDeviceArray.from_host(np.ones(4, np.float32))
        stream = RT.current_stream()
        RT.synchronize(stream)
        if call == "send":
            comm.send(x.ptr, 16, UINT8, 1, stream.handle)
        else:
            comm.allReduce(x.ptr, x.ptr, 4, FLOAT32, SUM, stream.handle)
        saved, RT.hang_timeout = RT.hang_timeout, 0.5
        rescue = threading.Timer(10, comm.abort)
        rescue.start()
        try:
            RT.synchronize(stream)
        except FakeDeviceFault as err:
            return str(err)
        finally:
            rescue.cancel()
            RT.hang_timeout = saved
        return "no fault"
    results = ranks(2, run)
    expect = ("device hang: rank 0's NCCL group waits for rank 1's receive" if call == "send"
              else "device hang: rank 0's NCCL all_reduce #0 waits for other ranks")
    assert results[0] == expect, results


def test_a_host_wait_behind_a_stuck_stream_is_a_device_hang() -> None:
    """Another thread runs the stream and is stuck in it (a send nobody receives): a host
    wait for the same stream gives up after the hang timeout, not when the other thread
    does."""
    def run(comm: Any, rank: int) -> str | None:
        if rank == 1:
            return None  # never receives
        x = FakeDeviceArray.from_host(np.ones(4, np.uint8))
        RT.synchronize(RT.current_stream())
        stream = RT.new_stream()
        comm.send(x.ptr, 4, UINT8, 1, stream.handle)
        stuck = threading.Thread(target=RT.synchronize, args=(stream,))
        stuck.start()
        while stream.runner is None:  # the other thread is inside the send
            time.sleep(0.001)
        saved, RT.hang_timeout = RT.hang_timeout, 0.3
        rescue = threading.Timer(10, comm.abort)
        rescue.start()
        try:
            RT.synchronize(stream)
        except FakeDeviceFault as err:
            return str(err)
        finally:
            RT.hang_timeout = saved
            rescue.cancel()
            comm.abort()  # ends the stuck send
            stuck.join(10)
        return "no fault"
    results = ranks(2, run)
    assert results[0] is not None and results[0].startswith("device hang: stream ") and \
        "did not get past item 1 within 0.3 s" in results[0], results


def test_an_id_whose_address_does_not_fit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake_nccl, "UNIQUE_ID_BYTES", 48)
    with pytest.raises(FakeDeviceFault, match="bytes is too long"):
        NCCL.get_unique_id()


def test_ranks_that_launch_a_collective_with_different_ops_get_a_fault() -> None:
    """Same kind, count and type, a different op: the sizes agree, so only the check sees
    it."""
    def run(comm: Any, rank: int) -> None:
        x = FakeDeviceArray.from_host(np.ones(8, np.float32))
        stream = RT.current_stream()
        comm.allReduce(x.ptr, x.ptr, 8, FLOAT32, SUM if rank == 0 else NCCL_OPS["max"],
                       stream.handle)
        RT.synchronize(stream)
    results = ranks(2, run)
    assert all(isinstance(r, FakeDeviceFault) and "differs between ranks" in str(r)
               for r in results), results


def test_a_receive_of_another_size_than_its_send_is_a_fault() -> None:
    def run(comm: Any, rank: int) -> None:
        x = FakeDeviceArray.from_host(np.arange(8, dtype=np.uint8))
        stream = RT.current_stream()
        if rank == 0:
            comm.send(x.ptr, 8, UINT8, 1, stream.handle)
        else:
            comm.recv(x.ptr, 4, UINT8, 0, stream.handle)
        RT.synchronize(stream)
    results = ranks(2, run)
    assert isinstance(results[1], FakeDeviceFault) and "receives 4 B from rank 0, whose " \
        "send has 8 B" in str(results[1]), results


def test_ranks_that_launch_different_collectives_get_a_fault() -> None:
    def run(comm: Any, rank: int) -> None:
        x = FakeDeviceArray.from_host(np.ones(8, np.float32))
        stream = RT.current_stream()
        comm.allReduce(x.ptr, x.ptr, 8 if rank == 0 else 4, FLOAT32, SUM, stream.handle)
        RT.synchronize(stream)
    results = ranks(2, run)
    assert all(isinstance(r, FakeDeviceFault) and "differs between ranks" in str(r)
               for r in results), results


def test_what_nccl_allows_works() -> None:
    """Calls of one group on two streams (the group orders both), a collective inside a
    group, and a send to oneself."""
    def run(comm: Any, rank: int) -> list[float]:
        a, b = RT.new_stream(), RT.new_stream()
        mine = FakeDeviceArray.from_host(np.full(4, float(rank + 1), np.float32))
        got = FakeDeviceArray.from_host(np.zeros(4, np.float32))
        me_too = FakeDeviceArray.from_host(np.zeros(4, np.float32))
        total = FakeDeviceArray.from_host(np.full(4, float(rank + 1), np.float32))
        RT.synchronize(RT.current_stream())
        peer = 1 - rank
        NCCL.groupStart()
        comm.send(mine.ptr, 16, UINT8, peer, a.handle)
        comm.recv(got.ptr, 16, UINT8, peer, b.handle)
        comm.send(mine.ptr, 16, UINT8, rank, a.handle)
        comm.recv(me_too.ptr, 16, UINT8, rank, a.handle)
        comm.allReduce(total.ptr, total.ptr, 4, FLOAT32, SUM, a.handle)
        NCCL.groupEnd()
        RT.synchronize(b)  # the group ordered b after it: the receive is there
        out = [float(v) for v in (got.to_host()[0], me_too.to_host()[0])]
        RT.synchronize(a)
        return [*out, float(total.to_host()[0])]
    assert ranks(2, run) == [[2.0, 1.0, 3.0], [1.0, 2.0, 3.0]]
