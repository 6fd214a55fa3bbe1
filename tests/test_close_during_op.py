"""``close()`` from another thread while an op runs is an abort: the op raises
``CommAborted`` on the closing rank, and its peers, entering that op afterwards, raise typed
errors; no rank reports success for the op, on the shared board or over links.

The ranks are real processes (``tests/close_rank.py``): rank 0 closes while its allreduce
waits for the others, and only once that allreduce has ended do the others enter it, so
rank 0's post (on the board) or its message (over links, where one exchange is the whole op
at world size 2) is already there for them to take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
from mp_helpers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
TYPED = {"RemoteError", "PeerLostError", "CommAborted", "CommTimeout", "DesyncError"}


def read_json(proc: subprocess.Popen, timeout: float) -> dict:
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got or not got[0].startswith("{"):
        proc.kill()
        raise AssertionError(f"no line from a rank within {timeout} s ({got}); stderr: "
                             f"{proc.stderr.read()[-3000:]}")
    return json.loads(got[0])


def close_during_op(world: int, env: dict[str, str], *extra: str) -> list[dict]:
    """Run ``close_rank.py`` on ``world`` ranks; every rank's last line."""
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RINGCOMM_")}
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "close_rank.py"), str(r),
                               str(world), str(port), *extra], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**base, **env})
             for r in range(world)]
    try:
        ready = [read_json(p, 30) for p in procs]
        assert all(r["ready"] for r in ready), ready
        assert read_json(procs[0], 30) == {"op_ended": True}
        for p in procs[1:]:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [read_json(p, 30) for p in procs]
        for p in procs:
            p.wait(20)
        return [dict(r, ready=ready[i]) for i, r in enumerate(results)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            for stream in (p.stdin, p.stdout, p.stderr):
                stream.close()


def check(results: list[dict], engine: str) -> None:
    closing, *peers = results
    assert all(r["ready"]["engine"] == engine for r in results), results
    assert closing["op_done"], closing
    assert closing["op"] is not None and closing["op"]["type"] == "CommAborted", closing
    assert "closed" in closing["op"]["msg"], closing
    assert closing["close"] is None, closing  # close itself went through
    for r, peer in enumerate(peers, 1):
        assert peer["op"] is not None, (r, peer)  # never a success of an op rank 0 aborted
        assert peer["op"]["type"] in TYPED, (r, peer)
        assert peer["op"]["s"] < 5.0, (r, peer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_close_during_an_op_on_the_board_is_an_abort(world):
    check(close_during_op(world, {}), "board")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, transport", [
    (2, "auto"), pytest.param(3, "tcp", marks=pytest.mark.slow),
    pytest.param(2, "tcp", marks=pytest.mark.slow)])
def test_close_during_an_op_over_links_is_an_abort(world, transport):
    check(close_during_op(world, {"RINGCOMM_BOARD": "0", "RINGCOMM_TRANSPORT": transport}),
          "links")


@pytest.mark.timeout(60)
def test_close_aborts_the_op_even_with_another_threads_op_queued():
    """Another thread's async receive, queued on the worker while the allreduce waits, does
    not hide the allreduce from close: it is aborted, and the receive fails too."""
    results = close_during_op(2, {"RINGCOMM_BOARD": "0"}, "post-recv")
    check(results, "links")
    assert results[0]["recv"]["type"] == "CommAborted", results[0]


@pytest.mark.timeout(30)
def test_the_control_plane_is_read_by_one_thread_at_a_time_and_never_blocks_a_waiter():
    """Two threads that wait (an op on the caller's thread, another on the worker) watch the
    same control socket: both may see a notice ready, and only one takes it. The other
    returns instead of blocking on a socket that holds nothing more (it hung there, and
    a thread could take part of another's notice); no notice is taken in part."""
    import logging

    import zmq

    from ringcomm.transport.header import Header, OpKind
    from ringcomm.transport.link import Wait
    from ringcomm.transport.zmq_control import WAKE_ENDPOINT, ZmqControl

    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pushes: list[zmq.Socket] = []

    def connect(endpoint: str, peer: int | None = None) -> zmq.Socket:
        push = context.socket(zmq.PUSH)
        push.connect(endpoint)
        pushes.append(push)
        return push

    control = ZmqControl(0, pull, {1: "inproc://rank-1"}, connect)
    peer = connect(WAKE_ENDPOINT)
    wait = Wait("allreduce #9", 1e18, Header.control(OpKind.ALLREDUCE, 9, 1))
    dropped: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: dropped.append(record.getMessage())  # type: ignore
    logging.getLogger("ringcomm").addHandler(handler)
    try:
        def probe(seq: int) -> None:  # rank 1 asks about one of its ops
            asked = Header.control(OpKind.ALLREDUCE, seq, 0)
            peer.send_multipart((Header.control(OpKind.PROBE, seq, 1).pack(),
                                 asked.pack() + b"allreduce"))

        probe(3)
        assert pull.poll(2000)
        control.handle(wait)  # the thread that took it
        done = threading.Event()
        other = threading.Thread(target=lambda: (control.handle(wait), done.set()),
                                 daemon=True)
        other.start()  # the thread whose poll saw the same notice
        assert done.wait(5), "a waiter blocked on a control socket that held nothing"

        def read(n: int) -> None:  # a wait that saw the socket ready (without polling it
            for _ in range(n):     # here: a ZeroMQ socket polled by two threads is unsafe)
                control.handle(wait)

        readers = [threading.Thread(target=read, args=(400,)) for _ in range(4)]
        for r in readers:
            r.start()
        for seq in range(10, 810):
            probe(seq)
        for r in readers:
            r.join(20)
        while pull.poll(100):
            control.handle(wait)
        assert not [m for m in dropped if "dropped" in m], dropped[:3]
    finally:
        logging.getLogger("ringcomm").removeHandler(handler)
        control.close()
        for s in (*pushes, pull):
            s.close(linger=0)
        context.term()
