"""``RINGCOMM_PORT_RANGE``: the tcp ports a rank listens on (its links' receiving sockets and
its control socket) come from the range, for a firewall that admits only those.

Real groups: two ranks of this process (``ringcomm.init`` on threads, one store) over tcp
(``RINGCOMM_TRANSPORT=tcp``, as between hosts). A range with room is used for every tcp
address a rank listens on, and the group works; a range with too little room is an
``ArgumentError`` naming the range and how many ports the ranks need, on every rank and
at once (the rank that ran out tells the others through its link record); a malformed
range is an ``ArgumentError`` at init saying what is wrong and the form it takes.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import threading
import time
from typing import Any

import numpy as np
import pytest
from mp_helpers import free_port

import ringcomm
from ringcomm import ArgumentError
from ringcomm.core import config

TIMEOUT = 20.0  # a rank's init timeout: far above what a failure may take (asserted < 5 s)


def free_ports(count: int) -> tuple[int, int]:
    """``count`` consecutive tcp ports of 127.0.0.1 that nothing holds now, below the
    system's range for ports it picks (so that no other test's socket takes one meanwhile)."""
    for _ in range(50):
        low = random.randrange(20000, 32000 - count)
        with contextlib.ExitStack() as held:
            try:
                for port in range(low, low + count):
                    s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return low, low + count - 1
    raise AssertionError(f"no {count} free consecutive ports found")


def pair(fn: Any) -> list[Any]:
    """``fn(comm)`` on ranks 0 and 1 of a real group, one thread each; a rank's error (from
    init or from ``fn``) is returned in its slot with the seconds it took."""
    store = f"127.0.0.1:{free_port()}"
    results: list[Any] = [None, None]
    done = threading.Barrier(2)

    def rank_main(r: int) -> None:
        start = time.monotonic()
        try:
            with ringcomm.init(rank=r, world_size=2, store=store, timeout=TIMEOUT) as comm:
                results[r] = fn(comm)
                done.wait(TIMEOUT)  # neither closes while the other still runs ``fn``
        except BaseException as err:  # noqa: BLE001 - returned to the test
            results[r] = (err, time.monotonic() - start)

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 5)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


@pytest.fixture
def over_tcp(monkeypatch):
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "tcp")
    monkeypatch.delenv("RINGCOMM_AUTH_TOKEN", raising=False)

    def with_range(low: int, high: int) -> None:
        monkeypatch.setenv("RINGCOMM_PORT_RANGE", f"{low}-{high}")
    return with_range


@pytest.mark.timeout(30)
def test_every_tcp_port_a_rank_listens_on_is_in_the_range(over_tcp):
    low, high = free_ports(8)  # room for the 4 the two ranks need, and for a stranger's
    over_tcp(low, high)

    def run(comm):
        x = np.full(5, comm.rank + 1.0)
        comm.allreduce(x)
        return comm.transport.listening(), x.tolist()

    results = pair(run)
    for r, res in enumerate(results):
        assert not isinstance(res, tuple) or not isinstance(res[0], BaseException), res
        listening, summed = res
        assert summed == [3.0] * 5, summed
        ports = [int(a.rsplit(":", 1)[1]) for a in listening if a.startswith("tcp://")]
        assert len(ports) == 2, listening  # its link from the peer, its control socket
        assert all(low <= p <= high for p in ports), (r, listening, (low, high))


@pytest.mark.timeout(30)
def test_a_range_too_small_for_the_ranks_of_a_host_is_named_on_every_rank_at_once(
        over_tcp):
    """Each rank needs 2 ports (a link, its control socket), the two of this host 4, and
    the range has 3: the rank that runs out says so, the other hears of it from it."""
    low, high = free_ports(3)
    over_tcp(low, high)
    results = pair(lambda comm: "joined")
    short = (f"no free tcp port left in RINGCOMM_PORT_RANGE={low}-{high} (3 ports) on "
             "127.0.0.1: rank {} of this group listens on 2 (1 link to the peers it "
             "reaches over tcp")
    shown = []
    for r, res in enumerate(results):
        assert isinstance(res, tuple), (r, res)
        err, took = res
        assert isinstance(err, ArgumentError), (r, repr(err))
        assert took < 5.0, (r, took, err)  # not the 20 s timeout
        assert any(short.format(ran_out) in str(err) for ran_out in (0, 1)), err
        assert "the 2 ranks of this host listen on 4 in all" in str(err), err
        assert "Widen the range" in str(err), err
        shown.append(str(err))
    told = [m for m in shown if re.search(r"rank \d could not set up its links", m)]
    assert len(told) == 1, shown  # one ran out, the other was told


@pytest.mark.timeout(30)
@pytest.mark.parametrize("raw,says", [
    ("abc", "is not a range of tcp ports"),
    ("40000", "is not a range of tcp ports"),
    ("40000-4x", "is not a range of tcp ports"),
    ("5-3", "ends below where it starts"),
    ("0-70000", "names a port outside 1-65535"),
    ("40000-65536", "names a port outside 1-65535"),
])
def test_a_malformed_range_is_refused_at_init_saying_what_it_takes(monkeypatch, raw, says):
    monkeypatch.setenv("RINGCOMM_PORT_RANGE", raw)
    form = "use LOW-HIGH, ports from 1 to 65535 with LOW <= HIGH, such as 40000-40999"
    with pytest.raises(ArgumentError) as caught:
        ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}", timeout=10)
    assert f"RINGCOMM_PORT_RANGE={raw!r} {says}; {form}; unset it" in str(caught.value)


@pytest.mark.timeout(30)
def test_a_malformed_range_is_an_error_on_every_rank_before_any_link(monkeypatch):
    monkeypatch.setenv("RINGCOMM_PORT_RANGE", "5-3")
    for r, res in enumerate(pair(lambda comm: "joined")):
        assert isinstance(res, tuple) and isinstance(res[0], ArgumentError), (r, res)
        assert "RINGCOMM_PORT_RANGE='5-3' ends below where it starts" in str(res[0])
        assert res[1] < 5.0, res


def test_the_range_is_a_local_setting_with_its_ends_in():
    row = config.BY_NAME["port_range"]
    assert row.scope is config.Scope.LOCAL and row.env == "RINGCOMM_PORT_RANGE"
    assert row.parse is not None
    assert row.parse(" 40000 - 40999 ") == (40000, 40999)
    assert row.parse("1-65535") == (1, 65535)
    assert row.parse("7-7") == (7, 7)
