"""One rank of a group whose rank 0 is closed from another thread while an op runs, for
``tests/test_close_during_op.py``:

    python close_rank.py RANK WORLD PORT [post-recv]

Every rank joins (``RINGCOMM_BOARD`` and ``RINGCOMM_TRANSPORT`` from the environment say
whether small allreduces run on the shared board or over links), runs one allreduce to
warm up, and prints ``{"ready": true, "board": ...}``. Then rank 0 starts an allreduce on a
thread of its own and, while that waits for the others, calls ``comm.close()`` from its main
thread; its op thread prints ``{"op_ended": true}`` once the allreduce has returned or
raised (with ``post-recv``, another thread's async receive is queued on the worker first,
while the allreduce waits: close must still abort the allreduce). The others wait for a line
on stdin (the test sends it once rank 0's op has ended),
then run the same allreduce. Every rank ends with one JSON line: the allreduce's error (type
and message) or its sum, and close's.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np

import ringcomm


def failure(fn) -> dict | None:
    started = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"type": type(err).__name__, "msg": str(err)[:400],
                "s": round(time.monotonic() - started, 3)}
    return None


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main() -> None:
    rank, world, port = map(int, sys.argv[1:4])
    post_recv = sys.argv[4:] == ["post-recv"]
    comm = ringcomm.init(rank=rank, world_size=world, store=f"127.0.0.1:{port}", timeout=20)
    x = np.full(8, float(rank + 1), np.float32)
    comm.allreduce(x)  # every link (and the board) in use
    say(ready=True, board=comm.transport.board is not None,
        engine=comm.choose("allreduce", x).engine)
    x[:] = rank + 1
    out: dict = {}
    if rank == 0:
        def run() -> None:
            out["op"] = failure(lambda: comm.allreduce(x))
            say(op_ended=True)

        op = threading.Thread(target=run)
        op.start()
        time.sleep(0.3)  # the allreduce waits for the others now
        if post_recv:  # queued on the worker: an op of another thread, nobody waiting on it
            work = comm.recv(np.zeros(4, np.float32), 1, async_op=True)
        out["close"] = failure(comm.close)
        if post_recv:
            out["recv"] = failure(work.wait)
        op.join(30)
        out["op_done"] = not op.is_alive()
    else:
        sys.stdin.readline()
        out["op"] = failure(lambda: comm.allreduce(x))
        out["close"] = failure(comm.close)
    out["sum"] = float(x[0])
    say(**out)


if __name__ == "__main__":
    main()
