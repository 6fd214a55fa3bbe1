"""Several hosts: choosing the address by interface name (``RINGCOMM_SOCKET_IFNAME``), and
real ranks on simulated hosts (``bench/netns.py``: network + UTS namespaces on a bridge).

The first part needs nothing (``lo`` exists everywhere). The rest needs root and
``ip netns``; it is skipped, with the reason, where namespaces cannot be made. Two hosts of
two ranks each, as a cluster would have them: every host has its data interface ``data0``
and a management network ``mgmt0`` on which the store lives, so a rank that took the
default address (the route to the store) would land on the management network; every rank
is told ``RINGCOMM_SOCKET_IFNAME=data0`` instead, one setting for all hosts. The ranks run
``tests/multihost_rank.py`` (numpy only, half a second to start) or, under torchrun,
``multihost_rank.py torch``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ringcomm import ArgumentError
from ringcomm.bootstrap import rendezvous
from ringcomm.plan import cost
from ringcomm.plan.settings import SETTINGS, Scope
from ringcomm.schedules import ALLREDUCE
from ringcomm_bench import netns

ROOT = Path(__file__).resolve().parent.parent
RUNNER = str(ROOT / "tests" / "multihost_rank.py")
IFNAME = "RINGCOMM_SOCKET_IFNAME"
STORE_PORT = 29500  # every run has fresh namespaces: fixed ports never collide


# --------------------------------------------------------------------------- the setting


@pytest.fixture
def env(monkeypatch):
    for var in ("RINGCOMM_IFADDR", IFNAME):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _interfaces_from_ip() -> dict[str, str] | None:
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=10).stdout
    except OSError:
        return None
    found: dict[str, str] = {}
    for line in out.splitlines():
        parts = line.split()  # "3: data0@if4    inet 10.231.8.1/24 ..."
        found.setdefault(parts[1].split("@")[0], parts[3].split("/")[0])
    return found


def test_socket_ifname_is_a_classified_local_setting():
    row = next(s for s in SETTINGS if s.env == IFNAME)
    assert (row.name, row.scope, row.argument) == ("socket_ifname", Scope.LOCAL, None)


def test_socket_ifname_gives_that_interfaces_address(env):
    env.setenv(IFNAME, "lo")
    assert rendezvous._reachable_host(None) == "127.0.0.1"
    assert rendezvous._reachable_host("127.0.0.1:29500") == "127.0.0.1"


def test_socket_ifname_reads_every_interface_as_ip_does(env):
    """The ioctl's answer for every interface equals ``ip -o -4 addr show``'s first address."""
    seen = _interfaces_from_ip()
    if not seen:
        pytest.skip("`ip` is not available to compare with")
    for _, name in socket.if_nameindex():
        assert rendezvous._ipv4_of(name) == seen.get(name), name


def test_socket_ifname_beats_the_route_to_the_store_and_loses_to_ifaddr(env):
    fake = {"data0": "10.9.8.7", "mgmt0": "10.9.9.7", "lo": "127.0.0.1"}
    env.setattr(rendezvous, "_ipv4_of", fake.get)
    env.setattr(rendezvous, "_interfaces", lambda: list(fake))
    env.setenv(IFNAME, "data0")
    assert rendezvous._reachable_host("127.0.0.1:29500") == "10.9.8.7"  # not the route's
    assert rendezvous._reachable_host(None) == "10.9.8.7"
    env.setenv("RINGCOMM_IFADDR", "10.1.2.3")
    assert rendezvous._reachable_host("127.0.0.1:29500") == "10.1.2.3"
    env.setenv(IFNAME, "nosuch0")  # not even looked at when RINGCOMM_IFADDR is set
    assert rendezvous._reachable_host(None) == "10.1.2.3"


@pytest.mark.parametrize("value,want", [
    ("nosuch0,lo", "127.0.0.1"), (" nosuch0 , lo ", "127.0.0.1"), ("lo,nosuch0", "127.0.0.1"),
    ("ib0,mgmt0,data0", "10.9.9.7"), ("data0,mgmt0", "10.9.8.7"),
])
def test_socket_ifname_list_first_that_exists_with_ipv4_wins(env, value, want):
    real = rendezvous._ipv4_of
    fake = {"data0": "10.9.8.7", "mgmt0": "10.9.9.7", "ib0": None}
    env.setattr(rendezvous, "_ipv4_of", lambda n: fake[n] if n in fake else real(n))
    env.setenv(IFNAME, value)
    assert rendezvous._reachable_host(None) == want


@pytest.mark.parametrize("value", ["", "  ", ","])
def test_an_empty_socket_ifname_is_unset(env, value):
    env.setenv(IFNAME, value)
    assert rendezvous._reachable_host("127.0.0.1:1") == "127.0.0.1"


def test_a_missing_interface_is_an_argument_error_listing_those_that_exist(env):
    env.setenv(IFNAME, "nosuch0")
    with pytest.raises(ArgumentError) as caught:
        rendezvous._reachable_host("127.0.0.1:29500")
    msg = str(caught.value)
    assert msg.startswith("RINGCOMM_SOCKET_IFNAME='nosuch0': interface 'nosuch0' does not "
                          "exist or has no IPv4 address; the interfaces here are: "), msg
    assert "lo (127.0.0.1)" in msg
    for _, name in socket.if_nameindex():
        assert f"{name} (" in msg
    env.setenv(IFNAME, "nosuch0,nosuch1,a-name-longer-than-ifnamsiz")
    with pytest.raises(ArgumentError, match=r"none of the interfaces 'nosuch0', 'nosuch1', "
                                            r"'a-name-longer-than-ifnamsiz' exists"):
        rendezvous._reachable_host(None)


def test_an_interface_without_ipv4_is_an_argument_error(env):
    bare = [n for _, n in socket.if_nameindex() if rendezvous._ipv4_of(n) is None]
    if not bare:
        pytest.skip("every interface here has an IPv4 address")
    env.setenv(IFNAME, bare[0])
    with pytest.raises(ArgumentError, match=rf"interface '{re.escape(bare[0])}' does not exist "
                                            rf"or has no IPv4 address.*{re.escape(bare[0])} "
                                            r"\(no IPv4 address\)"):
        rendezvous._reachable_host(None)


def test_ip_output_is_the_fallback_where_the_ioctl_fails(env):
    import errno
    import fcntl

    if not _interfaces_from_ip():
        pytest.skip("`ip` is not available")

    def refuse(*_):
        raise OSError(errno.EPERM, "refused")

    env.setattr(fcntl, "ioctl", refuse)
    assert rendezvous._ipv4_of("lo") == "127.0.0.1"
    assert rendezvous._ipv4_of("nosuch0") is None


def test_init_host_argument_comes_first(env):
    """``init(host=)`` is used as it is: a wrong RINGCOMM_SOCKET_IFNAME is not consulted;
    without it, init names the interface. (init used to overwrite ``host`` with the store's
    host when the store was given as "host:port", so neither host= nor the environment was
    ever used and a rank on another host bound its sockets to the store host's address.)"""
    import ringcomm

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    env.setenv(IFNAME, "nosuch0")
    with ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{port()}", timeout=10,
                       host="127.0.0.1") as comm:
        assert comm.world_size == 1
    with pytest.raises(ArgumentError, match="interface 'nosuch0' does not exist"):
        ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{port()}", timeout=10)


# --------------------------------------------------------------------------- simulated hosts


@pytest.fixture
def sim():
    why = netns.available()
    if why is not None:
        pytest.skip(f"simulated hosts unavailable: {why}")
    with netns.hosts(2, mgmt=True) as hs:
        yield hs


def _cpus() -> tuple[list[int], list[int]]:
    """Host A gets every core of ours, host B one: different core counts (where possible)."""
    mine = sorted(os.sched_getaffinity(0))
    return mine, mine[-1:]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGCOMM_", "PYTEST_"))}
    env.update(PYTHONPATH=str(ROOT), **extra)
    env[IFNAME] = "data0"  # the same for every host: each host's own data interface
    return env


def _launch(host, args, log: Path, env: dict[str, str], cpus=None) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - closed with the process
    try:
        return host.popen([sys.executable, *args], cpus=cpus, env=env, cwd=ROOT,
                          stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()


def _logs(tmp_path: Path) -> str:
    parts = []
    for log in sorted(tmp_path.glob("*.log")):
        text = log.read_text(errors="replace")[-3000:]
        parts.append(f"--- {log.name}\n{text}")
    return "\n".join(parts)


def _wait_all(procs, deadline: float, tmp_path: Path) -> None:
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"a rank did not finish in time (hang)\n{_logs(tmp_path)}")


def _read(path: Path, tmp_path: Path) -> dict:
    if not path.exists():
        pytest.fail(f"{path.name} was not written\n{_logs(tmp_path)}")
    return json.loads(path.read_text())


def _links(describe: str) -> dict[int, tuple[str, str]]:
    """``comm.transport.describe()`` as peer -> (how this rank's messages reach it, which
    kind of link the registry chose for the pair and why)."""
    found = {}
    for line in describe.splitlines():
        m = re.fullmatch(r"rank \d+ -> rank (\d+): (.*) \[(.*)\]", line)
        assert m, line
        found[int(m.group(1))] = (m.group(2), m.group(3))
    return found


def _check_links(res: list[dict], where: dict[int, netns.Host]) -> None:
    """Local pairs on pipes + shared memory; remote pairs on tcp to the peer's data0."""
    for r, x in enumerate(res):
        links = _links(x["describe"])
        assert sorted(links) == [p for p in range(len(res)) if p != r], x["describe"]
        for peer, (how, why) in links.items():
            if where[peer] is where[r]:
                assert how.startswith("pipe + shared memory"), (r, peer, how)
                assert why == "local: same host, both offer pipes and shared memory", why
            else:
                assert re.fullmatch(rf"tcp://{re.escape(where[peer].address)}:\d+", how), \
                    (r, peer, how, f"expected {where[peer].name}'s data0 "
                     f"{where[peer].address}, not its mgmt0 {where[peer].mgmt_address}")
                assert why == (f"socket: ZeroMQ tcp (another host) (not local: rank {peer} "
                               "is on another host)"), why
        assert x["counters"]["socket"] > 0 and x["counters"]["shm"] > 0, x["counters"]


def _profile(path: Path, segment: int, alpha: float, beta: float) -> str:
    path.write_text(json.dumps({"segment_bytes": segment, "params": {
        "4": {"alpha": alpha, "beta": beta, "gamma": 1e-10}}}))
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_two_hosts_every_collective_and_algorithm_agreeing(sim, tmp_path):
    """2 hosts x 2 ranks through ``ringcomm.init``: every collective and every allreduce
    algorithm (``ALLREDUCE``, however many there are) right at 1 element, 4099 and 4 MiB;
    host A tuned one way and given two cores, host B tuned another way and given one, yet
    every rank reports the same settings (rank 0's) and the same choice per size; local
    pairs on pipes + shared memory, remote pairs on tcp to the data0 address."""
    a, b = sim
    cpus_a, cpus_b = _cpus()
    prof_a = _profile(tmp_path / "a.json", 512 << 10, alpha=1e-3, beta=1e-12)
    prof_b = _profile(tmp_path / "b.json", 4 << 20, alpha=1e-9, beta=1e-9)
    where = {0: a, 1: a, 2: b, 3: b}
    store = f"{a.mgmt_address}:{STORE_PORT}"
    procs = []
    for r, host in where.items():
        env = _env(RINGCOMM_PROFILE=prof_a if host is a else prof_b)
        procs.append(_launch(host, [RUNNER, "collectives", "--rank", str(r), "--world", "4",
                                    "--store", store, "--out", str(tmp_path / f"r{r}.json")],
                             tmp_path / f"r{r}.log", env, cpus_a if host is a else cpus_b))
    _wait_all(procs, time.monotonic() + 50, tmp_path)
    res = [_read(tmp_path / f"r{r}.json", tmp_path) for r in range(4)]
    for r, x in enumerate(res):
        assert "error" not in x, f"rank {r}: {x.get('traceback')}\n{_logs(tmp_path)}"
    for r, x in enumerate(res):
        for count in (1, 4099, 1 << 20):
            assert {f"allreduce {name} x{count}" for name in ALLREDUCE} <= set(x["checks"])
        # per count: every algorithm, auto, avg; broadcast, reduce, scatter at roots 0 and 3
        # (gather checked on its root only); allgather, reduce_scatter, alltoall, barrier
        per_count = len(ALLREDUCE) + 2 + 6 + (r in (0, 3)) + 4
        assert len(x["checks"]) == 3 * per_count, x["checks"]
    # who ran where: the hostnames and affinities every rank holds, the same on all
    facts = [[h.name, cpus_a if h is a else cpus_b] for h in where.values()]
    assert all(x["facts"] == facts for x in res), [x["facts"] for x in res]
    assert [x["hostname"] for x in res] == [h.name for h in where.values()]
    # one agreement: rank 0's profile and segment size everywhere, one choice per size
    assert all(x["settings_all"] == res[0]["settings_all"] for x in res)
    assert all(x["settings"] == res[0]["settings"] for x in res)
    assert res[0]["settings"]["profile"] == prof_a and res[0]["segment"] == 512 << 10
    assert all(x["params"] == {"alpha": 1e-3, "beta": 1e-12, "gamma": 1e-10} for x in res)
    assert all(x["chosen"] == res[0]["chosen"] for x in res), [x["chosen"] for x in res]
    assert len({x["cores_per_rank"] for x in res}) == 1
    # ...where each host alone would have chosen differently (so agreement is tested)
    sizes = [int(n) for n in res[0]["chosen"]]
    own = [[cost.choose("allreduce", 4, n, 4, segment_bytes=seg, params=cost.CostParams(
        alpha, beta, 1e-10), share=res[0]["cores_per_rank"]) for n in sizes]
        for seg, alpha, beta in ((512 << 10, 1e-3, 1e-12), (4 << 20, 1e-9, 1e-9))]
    assert own[0] != own[1], own
    _check_links(res, where)
    assert all(x["env_ifname"] == "data0" for x in res)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_torchrun_on_two_nodes(sim, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d``, one identical
    command line in each host, the rendezvous at ``host0`` (its management address):
    ``dist.*`` collectives on backend
    "ringcomm" give checked values on every rank, the ranks of a node share its host, and
    remote pairs go over data0 (found through RINGCOMM_SOCKET_IFNAME under torchrun too)."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this python")
    a, b = sim
    procs = []
    for host in sim:
        env = _env(RINGCOMM_PROFILE=str(tmp_path / "none.json"), OMP_NUM_THREADS="1")
        # the same command line on every node: the hostname host0 resolves to its mgmt0
        cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{a.name}:29400", "--rdzv-id", "multihost",
               "--max-restarts", "0", "--monitor-interval", "0.5",
               RUNNER, "torch", "--out", str(tmp_path)]
        log = open(tmp_path / f"{host.name}.log", "w")  # noqa: SIM115
        procs.append(host.popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    _wait_all(procs, time.monotonic() + 80, tmp_path)
    assert [p.returncode for p in procs] == [0, 0], _logs(tmp_path)
    res = [_read(tmp_path / f"rank{r}.json", tmp_path) for r in range(4)]
    by_name = {h.name: h for h in sim}
    where = {r: by_name[x["hostname"]] for r, x in enumerate(res)}
    assert sorted(h.name for h in where.values()) == ["host0", "host0", "host1", "host1"]
    for x in res:
        assert len(x["checks"]) == 3 * 5, x["checks"]
        assert [y["group_rank"] for y in res if y["hostname"] == x["hostname"]] == \
            [x["group_rank"]] * 2  # a node's ranks are on one host
    _check_links(res, where)


def _start_loop(sim, tmp_path: Path, timeout: float) -> tuple[list, dict]:
    a, b = sim
    where = {0: a, 1: a, 2: b, 3: b}
    store = f"{a.mgmt_address}:{STORE_PORT}"
    procs = [_launch(h, [RUNNER, "loop", "--rank", str(r), "--world", "4", "--store", store,
                         "--out", str(tmp_path / f"r{r}.json"), "--timeout", str(timeout)],
                     tmp_path / f"r{r}.log", _env()) for r, h in where.items()]
    deadline = time.monotonic() + 20
    while not all((tmp_path / f"r{r}.json.looping").exists() for r in range(4)):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            pytest.fail(f"the ranks did not all start looping\n{_logs(tmp_path)}")
        time.sleep(0.05)
    time.sleep(0.3)  # well inside the loop: every rank is in some allreduce
    return procs, where


OP_TIMEOUT = 5.0


@pytest.mark.slow
@pytest.mark.timeout(40)
@pytest.mark.parametrize("how", ["kill", "link-down"])
def test_a_host_lost_mid_allreduce_ends_every_survivor_with_a_typed_error(sim, tmp_path, how):
    """Host B's ranks SIGKILLed, or B's data0 taken down, while every rank loops over 4 MiB
    allreduces: every surviving rank (A's two when B is killed; all four when the link is
    down) raises a ringcomm error (PeerLostError, RemoteError or CommTimeout) within the
    op timeout + 2 s, and exits; none hangs."""
    procs, where = _start_loop(sim, tmp_path, OP_TIMEOUT)
    a, b = sim
    t_lost = time.time()
    if how == "kill":
        b.kill(signal.SIGKILL)
        survivors = [0, 1]
    else:
        b.set_link(False)
        survivors = [0, 1, 2, 3]
    _wait_all([procs[r] for r in survivors], time.monotonic() + OP_TIMEOUT + 15, tmp_path)
    errs = {r: _read(tmp_path / f"r{r}.json", tmp_path) for r in survivors}
    print(f"{how}: " + ", ".join(f"rank {r} {x.get('error')} after "
                                 f"{x.get('t_error', t_lost) - t_lost:.2f} s"
                                 for r, x in errs.items()))
    for r, x in errs.items():
        assert x.get("is_comm_error"), f"rank {r}: {x}\n{_logs(tmp_path)}"
        assert x["error"] in ("PeerLostError", "RemoteError", "CommTimeout"), (r, x["msg"])
        assert x["msg"].startswith(f"[rank {r}, allreduce #"), x["msg"]
        late = x["t_error"] - t_lost
        assert late <= OP_TIMEOUT + 2, (r, late, x["msg"])
        assert x["iterations"] >= 3
        assert "close_error" not in x or x["close_error"]["is_comm_error"], x["close_error"]
    if how == "kill":
        # nobody waits for the op timeout: the dead ranks' closed connections tell at once
        assert "PeerLostError" in {x["error"] for x in errs.values()}, errs
        assert all(x["t_error"] - t_lost < 2.0 for x in errs.values()), errs


# --------------------------------------------------------------------------- the helper itself


_CHILD = """
import os, signal, sys, time
# as a program started from a shell: SIGTERM neither ignored nor blocked, whatever the test
# process that starts this one has done with it (children inherit both)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {{signal.SIGTERM, signal.SIGINT}})
sys.path.insert(0, {root!r})
from ringcomm_bench import netns
with netns.hosts(2, rate="100mbit") as hs:
    print(hs[0].netns.rsplit("-", 1)[0], flush=True)
    sys.stdin.readline()  # the test has counted the namespaces
    if sys.argv[1] == "raise":
        raise RuntimeError("boom")
    if sys.argv[1] == "exit":
        os._exit(3)  # no cleanup at all: what SIGKILL leaves
    print("sleeping", flush=True)  # the test signals it now
    time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("end", ["raise", "sigterm", "sigint", "exit"])
def test_netns_hosts_leave_nothing_behind(end):
    why = netns.available()
    if why is not None:
        pytest.skip(f"simulated hosts unavailable: {why}")
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT)), end],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    prefix = child.stdout.readline().strip()
    assert prefix.startswith("rcns-"), child.stderr.read()
    ours = [ns for ns in netns._listed() if ns.startswith(prefix + "-")]
    assert len(ours) == 3  # two hosts and the bridge
    child.stdin.write("go\n")
    child.stdin.flush()
    if end in ("sigterm", "sigint"):
        child.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGINT)
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail(f"the child did not end within 30 s ({end}); it said: "
                    f"{child.stderr.read()[-2000:]}")
    if end == "exit":
        assert [ns for ns in netns._listed() if ns.startswith(prefix)] == ours
        with netns.hosts(1):  # any later run sweeps a dead run's leftovers first
            pass
    assert [ns for ns in netns._listed() if ns.startswith(prefix)] == []
    assert not list(netns.NETNS_ETC.glob(prefix + "*"))
    assert not list(netns.RUN_DIR.glob(prefix + "*"))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_netns_rate_shapes_the_link(sim):
    """Unshaped and at 200mbit: one TCP stream host0 -> host1 (the helper's own measure)."""
    free = netns.measure(sim[0], sim[1], 64 << 20)
    with netns.hosts(2, rate="200mbit") as (a, b):
        shaped = netns.measure(a, b, 8 << 20)
    print(f"one tcp stream host0 -> host1: {free / 1e9:.2f} GB/s unshaped, "
          f"{shaped * 8 / 1e6:.0f} Mbit/s at 200mbit")
    assert 18e6 < shaped < 27e6, shaped  # 200 Mbit/s = 25 MB/s
    assert free > 4 * shaped, (free, shaped)
