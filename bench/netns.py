"""Simulated hosts on one machine: network namespaces with their own hostnames, on a bridge.

Root only. ``hosts(n)`` makes ``n`` "hosts", each a network namespace whose processes run
in their own UTS namespace (their own hostname, so ringcomm's host identity differs) and
see their own ``/etc/hosts`` (``/etc/netns/NS/hosts``, which ``ip netns exec`` mounts over
it). Every host has one interface, ``data0`` (the same name on every host, as a cluster's
NIC would be), joined by a veth pair to a bridge that lives in a namespace of its own, so
any number of hosts share one subnet::

    host0 ns: data0 10.231.X.1 --veth-- d0 ]
    host1 ns: data0 10.231.X.2 --veth-- d1 ]-- br0   (bridge ns)
    ...                                   ]
    (with mgmt=True, also mgmt0 10.231.X+1.k on a second bridge br1: a "management"
     network to put a rendezvous store on, so that a rank that picks its address by the
     route to the store lands on the wrong network unless told otherwise)

Every host's hosts file names every host: ``hostK`` is its data0 address, or, with
``mgmt``, its mgmt0 address (as a cluster's hostnames usually are) and ``hostK-data`` its
data0 address.

``rate`` shapes every data link with ``tc ... tbf`` on both of its ends (``netem`` does
not exist on these kernels). Traffic only ever goes to addresses inside namespaces made
here (or loopback).

Names carry a per-run prefix ``rcns-PID-TOKEN`` and a marker file under
``/run/ringcomm-netns`` records the run's process, so parallel runs never collide and a
sweep (run at every start) removes what dead runs left behind. Everything is removed on
exit from the ``with`` block, on exceptions, and on SIGTERM/SIGINT/SIGHUP (the signal is
turned into an exception inside the block; cleanup then runs before it propagates).

    from ringcomm_bench import netns
    if (why := netns.available()) is None:
        with netns.hosts(2, rate="1gbit") as (a, b):
            p = b.popen([sys.executable, "-c", "import socket; print(socket.gethostname())"])

The command line runs one command on every host (``{index}``, ``{addr}``, ``{name}`` and
``{hosts}`` in it are filled in per host), or measures a link::

    python -m ringcomm_bench.netns --hosts 2 -- sh -c 'hostname; ip -4 -o addr show data0'
    python -m ringcomm_bench.netns --hosts 2 --rate 1gbit --measure
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

PREFIX = "rcns"
RUN_DIR = Path("/run/ringcomm-netns")  # one marker file per live run: its pid and start time
NETNS_ETC = Path("/etc/netns")
DATA_IF = "data0"
MGMT_IF = "mgmt0"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})(?:-|$)")


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made (the message carries ``ip``'s words)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise NetnsError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


# --------------------------------------------------------------------------- can we?


@lru_cache(maxsize=1)
def available() -> str | None:
    """None when simulated hosts can be made here, else why not (for ``pytest.skip``)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN): not root"
    for tool in ("ip", "unshare", "hostname", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` fails: {made.stderr.strip() or made.returncode}"
    try:
        steps = [("veth", ["-n", probe, "link", "add", "name", "a", "type", "veth", "peer",
                           "name", "b"]),
                 ("bridge", ["-n", probe, "link", "add", "name", "br", "type", "bridge"])]
        for what, args in steps:
            proc = _ip(*args, check=False)
            if proc.returncode:
                return f"cannot make a {what} in a namespace: {proc.stderr.strip()}"
        proc = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--uts", "hostname",
                               "probe"], capture_output=True, text=True, timeout=30)
        if proc.returncode:
            return f"`unshare --uts` fails in a namespace: {proc.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


# --------------------------------------------------------------------------- hosts


@dataclass
class Host:
    """One simulated host: its hostname, namespace, address and interface."""

    index: int
    name: str  # its hostname (inside its UTS namespace); resolves in every host's /etc/hosts
    netns: str
    address: str  # on the data network
    ifname: str  # the data interface, inside the namespace
    mgmt_address: str | None = None
    mgmt_ifname: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def argv(self, cmd: Sequence[str] | str, cpus: Sequence[int] | None = None) -> list[str]:
        """``cmd`` as it runs inside this host, with its hostname, optionally on ``cpus``."""
        cmd = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if cpus is not None:
            cmd = ["taskset", "-c", ",".join(map(str, cpus)), *cmd]
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.name, *cmd]

    def popen(self, cmd: Sequence[str] | str, *, cpus: Sequence[int] | None = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``cmd`` here (in a session of its own, so it and its children can be killed
        as one process group); it is killed when the hosts go away, if still running."""
        kw.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.argv(cmd, cpus), **kw)
        self.procs.append(proc)
        return proc

    def run(self, cmd: Sequence[str] | str, *, timeout: float = 60,
            **kw: Any) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(self.argv(cmd), timeout=timeout, **kw)

    def set_link(self, up: bool, ifname: str | None = None) -> None:
        """Take this host's data link (or ``ifname``) down, or bring it back up."""
        _ip("-n", self.netns, "link", "set", ifname or self.ifname, "up" if up else "down")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal every process group started here with ``popen``."""
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if os.getpgid(proc.pid) == proc.pid:  # its own group (the default)
                        os.killpg(proc.pid, sig)
                    else:
                        proc.send_signal(sig)


class _Interrupted(BaseException):
    """SIGTERM or SIGHUP inside ``hosts()``: unwinds the block so cleanup runs."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def hosts(n: int, rate: str | None = None, *, mgmt: bool = False,
          ifname: str = DATA_IF) -> Iterator[list[Host]]:
    """``n`` simulated hosts on one bridge, removed again on the way out however it goes.

    ``rate`` (``"1gbit"``, ``"200mbit"``) shapes each data link in both directions with
    ``tc tbf``. ``mgmt`` adds a second, unshaped network (``mgmt0``), for a store.
    """
    why = available()
    if why is not None:
        raise NetnsError(f"cannot make simulated hosts: {why}")
    if n < 1:
        raise ValueError(f"need at least one host, got {n}")
    sweep()
    run = _Run(n, rate, mgmt, ifname)
    previous = _catch_signals()
    atexit.register(run.cleanup)
    try:
        run.build()
        yield run.hosts
    finally:
        quiet = _quiet_signals()
        try:
            run.cleanup()
        finally:
            atexit.unregister(run.cleanup)
            _restore_signals({**quiet, **previous})


def _catch_signals() -> dict[int, Any]:
    """SIGTERM and SIGHUP raise inside the block (SIGINT already raises KeyboardInterrupt);
    only from the main thread, and only where nobody else handles them."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def handler(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            previous[sig] = signal.signal(sig, handler)
    return previous


def _quiet_signals() -> dict[int, Any]:
    """Cleanup is short: let no signal interrupt it half-way (restored afterwards)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, signal.SIG_IGN)
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}


def _restore_signals(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with
    the pid, it names one process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":  # -4: IPv4 addresses only
            nets.append(ipaddress.IPv4Interface(parts[3]).network)
    return nets


def _pick_subnet(count: int) -> list[ipaddress.IPv4Network]:
    """``count`` consecutive /24s in 10.231.0.0/16 that no interface here is on."""
    used = _subnets_in_use()
    start = (os.getpid() * 7) % 240  # spread parallel runs (they could share: each is isolated)
    for k in range(240):
        x = (start + k) % 240 + 8
        nets = [ipaddress.IPv4Network(f"10.231.{x + j}.0/24") for j in range(count)]
        if not any(a.overlaps(b) for a in nets for b in used):
            return nets
    raise NetnsError("no free /24 in 10.231.0.0/16 for the simulated hosts")


class _Run:
    """One set of simulated hosts: what was made, so that exactly that is removed."""

    def __init__(self, n: int, rate: str | None, mgmt: bool, ifname: str) -> None:
        self.n, self.rate, self.mgmt, self.ifname = n, rate, mgmt, ifname
        self.prefix = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge_ns = f"{self.prefix}-br"
        self.namespaces: list[str] = []
        self.hosts: list[Host] = []
        self.marker = RUN_DIR / self.prefix
        self._done = False

    def build(self) -> None:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(json.dumps({"pid": os.getpid(),
                                           "start": _start_time(os.getpid())}))
        nets = _pick_subnet(2 if self.mgmt else 1)
        self._netns(self.bridge_ns)
        links = [("br0", self.ifname, "d", nets[0])]
        if self.mgmt:
            links.append(("br1", MGMT_IF, "m", nets[1]))
        for bridge, *_ in links:
            _ip("-n", self.bridge_ns, "link", "add", "name", bridge, "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", bridge, "up")
        for i in range(self.n):
            ns = f"{self.prefix}-h{i}"
            self._netns(ns)
            host = Host(i, f"host{i}", ns, "", self.ifname)
            for bridge, inner, outer, net in links:
                peer = f"{outer}{i}"
                # created straight inside the two namespaces: no name ever exists outside
                _ip("link", "add", "name", inner, "netns", ns, "type", "veth", "peer", "name",
                    peer, "netns", self.bridge_ns)
                addr = str(net.network_address + i + 1)
                _ip("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", inner)
                _ip("-n", ns, "link", "set", inner, "up")
                _ip("-n", self.bridge_ns, "link", "set", peer, "master", bridge)
                _ip("-n", self.bridge_ns, "link", "set", peer, "up")
                if inner == self.ifname:
                    host.address = addr
                    if self.rate:
                        self._shape(ns, inner)
                        self._shape(self.bridge_ns, peer)
                else:
                    host.mgmt_address, host.mgmt_ifname = addr, inner
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts.append(host)
        lines = ["127.0.0.1 localhost"]
        for h in self.hosts:  # as in clusters: the hostname is on the management network
            if h.mgmt_address:
                lines += [f"{h.mgmt_address} {h.name}", f"{h.address} {h.name}-data"]
            else:
                lines.append(f"{h.address} {h.name}")
        for h in self.hosts:
            etc = NETNS_ETC / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def _netns(self, name: str) -> None:
        self.namespaces.append(name)  # before making it: a half-made one is removed too
        _ip("netns", "add", name)

    def _shape(self, ns: str, dev: str) -> None:
        proc = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf",
                               "rate", str(self.rate), "burst", "64kb", "latency", "50ms"],
                              capture_output=True, text=True, timeout=30)
        if proc.returncode:
            raise NetnsError(f"tc tbf on {dev} in {ns} failed: {proc.stderr.strip()}")

    def cleanup(self) -> None:
        if self._done:
            return
        self._done = True
        for h in self.hosts:  # our own process groups first, then anything left inside
            h.kill(signal.SIGKILL)
            for proc in h.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        for ns in self.namespaces:
            _kill_inside(ns)
        _remove(self.namespaces)
        with contextlib.suppress(OSError):
            self.marker.unlink()
        with contextlib.suppress(OSError):
            RUN_DIR.rmdir()  # only if no other run is live


def _kill_inside(ns: str) -> None:
    """Kill what still runs in one of *our* namespaces (descendants of what we started)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove(namespaces: Sequence[str]) -> None:
    for ns in namespaces:  # deleting a namespace deletes its veths, and so their peers
        _ip("netns", "del", ns, check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        NETNS_ETC.rmdir()  # only if empty: ours made it, nobody else uses it


def _listed() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _run_of(name: str) -> str | None:
    """``rcns-PID-TOKEN`` of a namespace, folder or marker made here; None if not ours."""
    match = _NAME.match(name)
    return match.group(0).rstrip("-") if match else None


def _alive(run: str) -> bool:
    """Whether the process that made run ``rcns-PID-TOKEN`` still runs. Its marker holds the
    process's start time, so a reused pid does not keep a dead run's leftovers alive; a run
    without a marker (a probe of ``available()``) is alive while its pid is."""
    pid = int(run.split("-")[1])
    now = _start_time(pid)
    try:
        recorded = json.loads((RUN_DIR / run).read_text())
    except (OSError, ValueError):
        return now is not None
    return now is not None and recorded.get("start") == now


def sweep() -> list[str]:
    """Remove the namespaces, /etc/netns folders and markers of runs whose process is gone
    (killed with SIGKILL, say). Returns the namespaces removed."""
    if os.geteuid() != 0:
        return []
    stale = [ns for ns in _listed() if (run := _run_of(ns)) and not _alive(run)]
    _remove(stale)
    if NETNS_ETC.is_dir():
        for d in NETNS_ETC.iterdir():
            run = _run_of(d.name)
            if run and not _alive(run) and not (Path("/run/netns") / d.name).exists():
                shutil.rmtree(d, ignore_errors=True)
    if RUN_DIR.is_dir():
        for marker in RUN_DIR.iterdir():
            run = _run_of(marker.name)
            if run and not _alive(run):
                with contextlib.suppress(OSError):
                    marker.unlink()
    return stale


# --------------------------------------------------------------------------- measuring

_RECEIVER = """
import socket, sys, time
n = int(sys.argv[2]); buf = bytearray(1 << 20); view = memoryview(buf)
srv = socket.create_server((sys.argv[1], 5201)); print("ready", flush=True)
conn, _ = srv.accept(); got = 0; t0 = None
while got < n:
    k = conn.recv_into(view)
    if not k: break
    if t0 is None: t0 = time.perf_counter()
    got += k
print(got, time.perf_counter() - t0, flush=True)
"""
_SENDER = """
import socket, sys
n = int(sys.argv[2]); chunk = bytes(1 << 20); s = socket.create_connection((sys.argv[1], 5201))
while n > 0:
    s.sendall(chunk[:min(n, len(chunk))]); n -= len(chunk)
s.close()
"""


def measure(src: Host, dst: Host, nbytes: int = 1 << 30) -> float:
    """Bytes per second of one TCP stream from ``src`` to ``dst`` (1 MiB sends)."""
    rx = dst.popen([sys.executable, "-c", _RECEIVER, dst.address, str(nbytes)],
                   stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    if rx.stdout.readline().strip() != "ready":
        raise NetnsError("the receiver did not start")
    tx = src.popen([sys.executable, "-c", _SENDER, dst.address, str(nbytes)])
    tx.wait(120)
    got, seconds = rx.stdout.readline().split()
    rx.wait(10)
    return int(got) / float(seconds)


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ringcomm_bench.netns", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    parser.add_argument("--rate", help="shape each link, e.g. 1gbit (tc tbf, both ends)")
    parser.add_argument("--mgmt", action="store_true", help="add a second network (mgmt0)")
    parser.add_argument("--measure", action="store_true",
                        help="measure one TCP stream host0 -> host1 and print it")
    parser.add_argument("--sweep", action="store_true",
                        help="only remove what dead runs left behind")
    parser.add_argument("cmd", nargs=argparse.REMAINDER,
                        help="-- CMD ... run on every host; {index} {addr} {name} {hosts} "
                             "are filled in")
    args = parser.parse_args(argv)
    if args.sweep:
        print("removed:", " ".join(sweep()) or "nothing")
        return 0
    why = available()
    if why is not None:
        print(f"cannot make simulated hosts: {why}", file=sys.stderr)
        return 2
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    with hosts(args.hosts, args.rate, mgmt=args.mgmt) as hs:
        for h in hs:
            print(f"{h.name}: netns {h.netns}, {h.ifname} {h.address}"
                  + (f", {h.mgmt_ifname} {h.mgmt_address}" if h.mgmt_address else ""))
        if args.measure and len(hs) >= 2:
            for _ in range(3):
                start = time.perf_counter()
                bw = measure(hs[0], hs[1])
                print(f"host0 -> host1: {bw / 1e9:.2f} GB/s ({bw * 8 / 1e9:.2f} Gbit/s), "
                      f"{time.perf_counter() - start:.1f} s")
        if cmd:
            all_addrs = ",".join(h.address for h in hs)
            procs = [h.popen([c.format(index=h.index, addr=h.address, name=h.name,
                                       hosts=all_addrs) for c in cmd]) for h in hs]
            return max(p.wait() for p in procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
