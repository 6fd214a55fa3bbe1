"""The local fast path: the shared-memory ring and the pipes, on their own and between two
ranks that use them (threads of one process, real ZeroMQ sockets, real FIFOs and a real
/dev/shm ring), including a ring too small for the traffic, which must fall back without
losing or reordering anything, and pipes too full to take a send, which must not block."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from mp_helpers import free_port

import ringcomm
from ringcomm import ArgumentError
from ringcomm.transport import shm_ring
from ringcomm.transport.pipe import Flusher, PipeReader, PipeWriter

pytestmark = pytest.mark.skipif(not shm_ring.available(), reason="needs /dev/shm")


def _pair(capacity: int):
    name = shm_ring.ring_name(shm_ring.new_token(), 0, 1)  # only ringcomm's names open
    writer = shm_ring.RingWriter(name, capacity)
    return writer, shm_ring.RingReader(name, capacity)


def test_payloads_round_trip_and_names_vanish_once_both_ends_are_mapped():
    writer, reader = _pair(4096)
    assert not os.path.exists(writer.path)  # the reader unlinked it
    start, view = writer.reserve(100)
    view[:] = np.arange(100, dtype=np.uint8)
    np.testing.assert_array_equal(reader.view(start, 100), np.arange(100, dtype=np.uint8))
    writer.close()
    reader.close()


def test_a_full_ring_refuses_until_the_reader_releases_and_never_wraps_a_payload():
    writer, reader = _pair(1024)
    slots = [writer.reserve(300) for _ in range(3)]  # 3 x 320 aligned bytes = 960
    assert all(s is not None for s in slots)
    assert writer.reserve(300) is None  # 64 bytes left at the end, 0 at the front
    reader.release(slots[0][0], 300)
    start, view = writer.reserve(300)  # does not fit at the end: skips to the front
    assert start % 1024 == 0 and view.size == 300
    assert writer.reserve(1) is None  # the skipped tail is still owed by the reader
    reader.release(slots[1][0], 300)
    assert writer.reserve(300) is not None
    writer.close()
    reader.close()


def test_a_drained_ring_starts_over_at_the_front_so_it_reuses_warm_pages():
    writer, reader = _pair(4096)
    for value in range(20):  # 20 x 1 KiB through a 4 KiB ring, each read before the next
        start, view = writer.reserve(1000)
        assert start % 4096 == 0, start  # always the same, already mapped, memory
        view[:] = value
        assert (reader.view(start, 1000) == value).all()
        reader.release(start, 1000)
    first, _ = writer.reserve(1000)  # not drained: the next payload goes after it
    second, _ = writer.reserve(1000)
    assert second % 4096 == 1024 and second - first == 1024
    assert writer.reserve(4000) is None  # and the one in flight is not overwritten
    writer.close()
    reader.close()


def test_a_pipe_takes_more_than_it_holds_without_blocking_and_ends_with_eof(tmp_path):
    reader = PipeReader(str(tmp_path / "fifo"))
    flusher = Flusher()
    writer = PipeWriter(reader.path, flusher)
    frames = [bytes([i % 251]) * 50_000 for i in range(100)]  # 5 MB, the pipe holds ~1 MB
    for frame in frames:
        writer.write(frame)  # returns at once: what does not fit waits for the flusher
    assert writer.pending
    got = []
    while len(got) < len(frames):
        chunk = reader.take(50_000)
        if chunk is None:
            threading.Event().wait(0.001)
            continue
        got.append(chunk)
    assert got == frames  # whole and in order
    writer.close()
    flusher.stop()
    with pytest.raises(EOFError):
        reader.take(1)
    reader.close()
    assert not os.path.exists(reader.path)


def test_a_pipe_says_whether_data_is_waiting_without_taking_it(tmp_path):
    reader = PipeReader(str(tmp_path / "fifo"))
    flusher = Flusher()
    writer = PipeWriter(reader.path, flusher)
    assert not reader.has(1)
    writer.write(b"abc")
    assert reader.has(3) and not reader.has(4)
    assert reader.take(3) == b"abc"  # nothing was consumed by looking
    assert not reader.has(1)
    writer.close()
    flusher.stop()
    assert reader.has(1)  # the writer is gone: a take would say so at once
    with pytest.raises(EOFError):
        reader.take(1)
    reader.close()


def _run_pair(fn, **init_kw):
    """Run ``fn(comm)`` on ranks 0 and 1 (threads) and return their results."""
    port = free_port()
    results, errors = [None, None], []

    def rank_main(rank: int) -> None:
        try:
            with ringcomm.init(rank=rank, world_size=2, store=f"127.0.0.1:{port}", timeout=20,
                               **init_kw) as comm:
                results[rank] = fn(comm)
        except BaseException as err:  # noqa: BLE001 - reported to the test below
            errors.append(err)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def _allreduce_many(comm):
    rng = np.random.default_rng(comm.rank)
    checks = []
    for count in (3, 70_000, 1_000_003):  # below, near and far above the shm threshold
        x = rng.standard_normal(count)
        mine = x.copy()
        comm.allreduce(x)
        checks.append((mine, x))
    return checks, comm.transport.counters, comm.transport.describe()


def _check_sums(results):
    (a, counters0, text0), (b, _, _) = results
    for (mine0, got0), (mine1, got1) in zip(a, b, strict=True):
        np.testing.assert_allclose(got0, mine0 + mine1)
        np.testing.assert_array_equal(got0, got1)
    return counters0, text0


@pytest.mark.timeout(60)
def test_local_ranks_send_large_payloads_through_shared_memory(monkeypatch):
    monkeypatch.delenv("RINGCOMM_SHM", raising=False)
    monkeypatch.setenv("RINGCOMM_BOARD", "0")  # large allreduces over the links
    counters, text = _check_sums(_run_pair(_allreduce_many, segment_bytes=256 * 1024))
    assert counters["shm"] > 0 and counters["shm_full"] == 0, counters
    assert "shared memory" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mailbox", ["", "1"])
def test_local_ranks_send_headers_and_small_payloads_through_the_pipe_or_the_mailbox(
        monkeypatch, mailbox):
    monkeypatch.delenv("RINGCOMM_SHM", raising=False)
    monkeypatch.setenv("RINGCOMM_MAILBOX", mailbox)
    monkeypatch.setenv("RINGCOMM_BOARD", "0")  # small allreduces over the links
    counters, text = _check_sums(_run_pair(_allreduce_many))
    assert counters["socket"] == 0, counters
    assert "pipe + shared memory" in text
    if mailbox:
        assert counters["mailbox"] > 0 and "mailbox" in text, counters
    else:
        assert counters["pipe"] > 0 and counters["mailbox"] == 0 and "mailbox" not in text


def _exchange_before_receiving(comm):
    """Both ranks send 200 x 32 KiB (6 MiB, several times what a pipe holds) before either
    receives: only sends that never block let this finish."""
    peer = 1 - comm.rank
    sent = [np.full(8192, comm.rank * 1000.0 + i, np.float32) for i in range(200)]
    works = [comm.send(x, peer, async_op=True) for x in sent]
    got = [np.empty(8192, np.float32) for _ in sent]
    for x in got:
        comm.recv(x, peer)
    for w in works:
        w.wait()
    return [float(x[0]) for x in got if (x == x[0]).all()]


@pytest.mark.timeout(60)
def test_sends_to_a_full_pipe_do_not_block(monkeypatch):
    monkeypatch.delenv("RINGCOMM_SHM", raising=False)
    a, b = _run_pair(_exchange_before_receiving)
    assert a == [1000.0 + i for i in range(200)]
    assert b == [float(i) for i in range(200)]


@pytest.mark.timeout(60)
def test_a_ring_too_small_for_the_traffic_falls_back_to_the_pipe(monkeypatch):
    monkeypatch.setenv("RINGCOMM_SHM_BYTES", str(300 * 1024))  # one 256 KiB segment fits
    monkeypatch.setenv("RINGCOMM_BOARD", "0")  # large allreduces over the links
    counters, _ = _check_sums(_run_pair(_allreduce_many, segment_bytes=256 * 1024))
    assert counters["shm"] > 0 and counters["shm_full"] > 0, counters


@pytest.mark.timeout(60)
def test_shared_memory_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("RINGCOMM_SHM", "0")
    counters, text = _check_sums(_run_pair(_allreduce_many))
    assert counters["shm"] == 0 and counters["socket"] > 0, counters
    assert "pipe + shared memory" not in text  # the link kind says why it is not local:
    assert "not local: this rank does not offer shared memory (RINGCOMM_SHM=0)" in text, text


@pytest.mark.timeout(60)
def test_tcp_between_local_ranks_uses_no_shared_memory():
    counters, _ = _check_sums(_run_pair(_allreduce_many, transport="tcp"))
    assert counters["shm"] == 0 and counters["pipe"] == 0, counters


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spin_us", ["0", "2000"])
@pytest.mark.parametrize("mailbox", ["", "1"])
def test_receives_are_right_without_a_spin_and_with_a_long_one(monkeypatch, spin_us, mailbox):
    monkeypatch.setenv("RINGCOMM_SPIN_US", spin_us)
    monkeypatch.setenv("RINGCOMM_MAILBOX", mailbox)
    monkeypatch.setenv("RINGCOMM_BOARD", "0")  # small allreduces over the links
    counters, _ = _check_sums(_run_pair(_allreduce_many))
    assert counters["mailbox" if mailbox else "pipe"] > 0, counters


@pytest.mark.parametrize("bad", ["fast", "-5", "1e9"])
def test_a_bad_spin_setting_is_refused_with_what_to_do(monkeypatch, bad):
    monkeypatch.setenv("RINGCOMM_SPIN_US", bad)
    with pytest.raises(ArgumentError, match="RINGCOMM_SPIN_US.*microseconds.*unset it"):
        ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}", timeout=10)
