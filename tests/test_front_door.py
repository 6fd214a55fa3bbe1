"""What a new user meets first: the command line, the debug switch, init's arguments and its
errors, and a store started apart from the ranks.

Command lines run in fresh interpreters, as a user types them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from mp_helpers import free_port

import ringcomm
from ringcomm import ArgumentError, StoreError, StoreTimeout


def run(args: list[str], *, env: dict | None = None, timeout: float = 60,
        check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def python(code: str, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", textwrap.dedent(code)], **kw)


# --------------------------------------------------------------------------- the command line


RINGCOMM = str(Path(sys.executable).with_name("ringcomm"))  # the script, beside this python


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [[RINGCOMM], [sys.executable, "-m", "ringcomm"]],
                         ids=["script", "python -m"])
def test_version_and_help(command):
    assert run([*command, "--version"]).stdout.strip() == f"ringcomm {ringcomm.__version__}"
    text = run([*command, "--help"]).stdout
    assert "print schedules, serve a store, tune, benchmark, report" in text
    assert "env" in text and "RINGCOMM_DEBUG" in text
    store = run([*command, "store", "--help"]).stdout
    assert "interface address to listen on" in store and "TCP port to listen on" in store


@pytest.mark.timeout(60)
def test_env_reports_versions_settings_and_their_class():
    out = run([RINGCOMM, "env"], env={"RINGCOMM_ALGO": "ring",
                                        "RINGCOMM_SPIN_US": "0"}).stdout
    import numpy
    import zmq

    assert f"ringcomm: {ringcomm.__version__}" in out
    assert f"numpy: {numpy.__version__}" in out and f"pyzmq: {zmq.__version__}" in out
    assert "RINGCOMM_ALGO = 'ring'  [must match]" in out
    assert "RINGCOMM_PROFILE = unset  [agreed]" in out or "RINGCOMM_PROFILE = '" in out
    assert "RINGCOMM_SPIN_US = '0'  [local]" in out
    assert f"this process may use {len(os.sched_getaffinity(0))}" in out
    assert "shared memory (/dev/shm)" in out and "cost profile" in out
    assert "the shared board's one-shot round: compiled (" in out
    off = run([RINGCOMM, "env"], env={"RINGCOMM_BOARD_COMPILED": "0"}).stdout
    assert "the shared board's one-shot round: in Python (RINGCOMM_BOARD_COMPILED=0)" in off


def test_env_says_how_to_build_the_board_round_where_it_was_not_built(monkeypatch):
    from ringcomm import environment
    from ringcomm.transport import board

    monkeypatch.setattr(board, "_compiled", None)  # as installed without a C compiler
    assert "the shared board's one-shot round: in Python: not compiled (the install found " \
           "no C compiler; with one, `pip install -e .`" in environment.report()


# --------------------------------------------------------------------------- the debug switch

INIT_AND_ALLREDUCE = """
import numpy as np, ringcomm
with ringcomm.init(rank=0, world_size=1, store="127.0.0.1:{port}", timeout=10) as comm:
    comm.allreduce(np.ones(4, np.float32))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", ["", "INFO", "DEBUG"])
def test_ringcomm_debug_prints_a_start_line_at_info_and_a_line_per_op_at_debug(level):
    err = python(INIT_AND_ALLREDUCE.format(port=free_port()),
                 env={"RINGCOMM_DEBUG": level}).stderr
    start = [line for line in err.splitlines() if "rank 0 of 1 on" in line]
    ops = [line for line in err.splitlines() if "allreduce #" in line]
    if not level:
        assert err == ""
        return
    assert len(start) == 1, err
    assert "links: none" in start[0] and "agreed: algorithm=auto" in start[0]
    assert f"ringcomm {ringcomm.__version__}" in start[0] and "numpy" in start[0]
    if level == "INFO":
        assert ops == [], err
    else:
        assert len(ops) == 1 and "16 B float32 sum" in ops[0] and " us" in ops[0], err


@pytest.mark.timeout(60)
def test_an_unknown_debug_level_is_a_warning_not_an_error():
    err = python("import ringcomm", env={"RINGCOMM_DEBUG": "LOUD"}).stderr
    assert "RINGCOMM_DEBUG='LOUD' is not one of INFO, DEBUG or WARN; ignored" in err


DETAIL_PAIR = """
import sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("ringcomm", rank=rank, world_size=2,
                        init_method="tcp://127.0.0.1:{port}")
try:
    dist.all_reduce(torch.ones(4 + rank))
except Exception as err:
    print(type(err).__name__, err)
"""


@pytest.mark.timeout(90)
def test_torch_detail_debug_is_noted_and_ringcomm_checks_what_it_would():
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks shapes across ranks for gloo; for
    ringcomm the same mismatch is caught by its own header checks, DETAIL or not."""
    script = DETAIL_PAIR.format(port=free_port())
    env = dict(os.environ, TORCH_DISTRIBUTED_DEBUG="DETAIL", RINGCOMM_DEBUG="INFO")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    outs = [p.communicate(timeout=80) for p in procs]
    for out, err in outs:
        assert "DesyncError" in out, (out, err)
        assert ("rank 1 reduces 5 elements, rank 0 4" in out
                or "rank 0 reduces 4 elements, rank 1 5" in out), out
        assert "TORCH_DISTRIBUTED_DEBUG=DETAIL: ringcomm checks" in err, err


# --------------------------------------------------------------------------- init


@pytest.mark.timeout(30)
def test_init_takes_a_timedelta_and_refuses_other_timeouts():
    port = free_port()
    with ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{port}",
                       timeout=timedelta(seconds=7)) as comm:
        assert comm.timeout == 7.0
    for bad, match in (("10", "seconds .* or a datetime.timedelta, got str"),
                       (timedelta(0), "must be positive, got 0 s"), (-1, "must be positive")):
        with pytest.raises(ArgumentError, match=match):
            ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}", timeout=bad)


@pytest.mark.timeout(30)
def test_ranks_that_never_join_are_named():
    started = time.monotonic()
    with pytest.raises(StoreTimeout, match=r"ranks 1-2 never joined within 1 s: were they "
                       r"started, with the same store address .* and world size \(3\)"):
        ringcomm.init(rank=0, world_size=3, store=f"127.0.0.1:{free_port()}", timeout=1)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_a_store_served_apart_from_the_ranks_is_used_by_rank_0_too():
    port = free_port()
    server = subprocess.Popen([RINGCOMM, "store", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "serving" in server.stdout.readline()
        results: list = [None, None]

        def rank(r: int) -> None:
            try:
                with ringcomm.init(rank=r, world_size=2, store=f"127.0.0.1:{port}",
                                   timeout=15) as comm:
                    x = np.full(3, r + 1.0)
                    comm.allreduce(x)
                    results[r] = x.tolist()
            except BaseException as err:  # noqa: BLE001 - reported below
                results[r] = err

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [[3.0] * 3, [3.0] * 3], results
    finally:
        server.terminate()
        server.wait(10)


@pytest.mark.timeout(30)
def test_a_port_held_by_something_else_is_still_an_error():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(StoreError, match="the port is in use"):
            ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{port}", timeout=5)
