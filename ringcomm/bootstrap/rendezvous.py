"""``ringcomm.init``: from environment or arguments to a connected communicator.

Where the store comes from:
- a ``Store`` object: used as it is (tests, the torch backend's adapter);
- under torchrun with its agent store (``TORCHELASTIC_USE_AGENT_STORE=True``): torchrun
  already serves a TCPStore on ``MASTER_ADDR:MASTER_PORT``, so every rank joins it as a
  client (binding that port would fail);
- otherwise ``"host:port"`` (or ``MASTER_ADDR``/``MASTER_PORT``): rank 0 serves a ringcomm
  store there and every rank, rank 0 included, connects to it.

The store rank 0 serves belongs to its group and lives as long as any rank of the group
still uses it (``_StoreUse``): each rank's close says ``leave`` after its last use of the
store (the device lanes' close is the last), and rank 0's close waits, for a few seconds at
most, until every rank has left or gone before it closes the server. Meanwhile that store
turns away clients it has never seen, which ask again until the next group's store answers
(``store_server``), so a process may init and close on one address any number of times,
whichever of its ranks is quickest to come back. A group that rank 0 makes on an address
while an earlier group of its process lives there holds the same store, which then stays
until the last of them has left (``_serve_unless_served``).

Every communicator made on one store gets its own key prefix, so re-initialising in the
same job (or under a torchrun restart) never reads stale addresses.

Before any link exists the ranks agree (``ringcomm.plan.settings.agree``): each publishes its
settings and its facts (host, cores), every rank checks the settings that must match and
takes rank 0's agreed ones, and every rank ends up holding the same table of facts. The
links and every later decision are built from that, never from a local look.
"""

from __future__ import annotations

import errno
import logging
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .._support import check_platform
from .._version import __version__
from ..core import config, variables, waits
from ..engines.exchange import StoreExchange
from ..errors import ArgumentError, CommError, StoreError
from ..observe.clock import through_store
from ..plan.settings import agree, propose
from ..plan.topology import RankFacts
from ..runtime.communicator import Communicator
from ..runtime.devices import gpu_facts
from ..transport.group import GroupTransport
from .link_probe import measure_remote
from .store import PrefixStore, Store, StoreClient, StoreServer, TorchStore

log = logging.getLogger("ringcomm")


def init(
    rank: int | None = None,
    world_size: int | None = None,
    store: Store | str | None = None,
    *,
    timeout: float | timedelta = 300.0,
    segment_bytes: int | None = None,
    transport: str | None = None,
    host: str | None = None,
    trace: str | os.PathLike[str] | None = None,
    auth_token: str | None = None,
    device: str | None = None,
) -> Communicator:
    """Join a group and return its communicator.

    Unset arguments come from ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``,
    as torchrun sets them. ``timeout`` (seconds, or a ``timedelta`` as torch takes it)
    bounds the rendezvous and every op; one longer than a week, ``inf`` included, is taken
    as a week (``ringcomm.core.waits.MAX_TIMEOUT``: the OS's and ZeroMQ's waits take at most
    about 24.8 days), on every rank alike.
    ``transport`` forces ``"ipc"`` or ``"tcp"`` (default: ipc on one host, tcp across).
    ``host`` is the address peers reach this rank at (default: ``RINGCOMM_IFADDR``, else
    the IPv4 address of the interface named by ``RINGCOMM_SOCKET_IFNAME``, else the local
    end of a route to the store's host). ``trace`` (or ``RINGCOMM_TRACE``) names a folder
    this rank writes its timeline to (``rank<r>.json``, when the communicator closes);
    every rank's clock is measured against rank 0's through the store for it.
    ``auth_token`` (or ``RINGCOMM_AUTH_TOKEN``) is a shared secret: ringcomm's store and
    every tcp link between ranks admit only peers holding it, and encrypt (torch's store,
    under torchrun, is not covered); a rank or store with another token is an ``AuthError``.
    ``device`` (or ``RINGCOMM_DEVICE``): ``"cuda"`` reduces CuPy arrays and CUDA tensors on
    the GPU (over CUDA IPC on one host, through host staging across hosts), ``"fake"`` does
    the same on the strict numpy runtime (tests), ``"off"`` stages device arrays through
    the host; ``"auto"`` (the default) is cuda where CuPy sees a GPU. Must match.
    """
    check_platform()  # Linux only: say so before anything else
    _warn_of_unknown_variables()
    rank = rank if rank is not None else env_int("RANK")
    world_size = world_size if world_size is not None else env_int("WORLD_SIZE")
    if rank is None or world_size is None:
        raise ArgumentError(
            "rank and world size are unknown: pass rank= and world_size=, or launch under "
            "torchrun (which sets RANK and WORLD_SIZE)")
    if world_size < 1:
        raise ArgumentError(f"world_size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ArgumentError(f"rank {rank} is out of range for world_size {world_size}")
    timeout = _seconds(timeout)
    if auth_token is None:
        auth_token = config.value("auth_token")
    elif not isinstance(auth_token, str):
        raise ArgumentError(f"auth_token must be a str, got {type(auth_token).__name__}")

    closers: list[Callable[[], None]] = []  # run in this order, at close or on a failure
    address = None
    use = None
    if store is None:
        address = _master_address()
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
            store = _torchrun_store(address, timeout)
            closers.append(store.close)
    if store is None or isinstance(store, str):
        address = address or store
        assert address is not None  # no store: the master's address was read above
        store_host, port = _split_address(address)  # not `host`: that is this rank's address
        served = _serve_unless_served(store_host, port, auth_token, timeout) if rank == 0 \
            else None
        try:
            store = StoreClient(f"{store_host}:{port}", timeout=timeout, auth_token=auth_token)
        except BaseException:
            if served is not None:
                _retire(*served, 0)
            raise
        use = _StoreUse(store, served, rank, timeout)
        closers.append(use.close)
    elif not isinstance(store, Store):
        raise ArgumentError(
            f"store must be a ringcomm Store or 'host:port', got {type(store).__name__}")

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        # Count communicators per rank *on this store*, not per process: a process that made
        # more (or fewer) communicators before must still agree with its peers on the prefix.
        generation = store.add(f"ringcomm/{restart}/generation/{rank}", 1)
        group = f"ringcomm/{restart}/{generation}"
        if use is not None:
            use.joined(group, world_size)
        scoped = PrefixStore(group, store)
        try:  # this rank's own settings and address; a mistake here is told to every rank
            config.check_all()  # every setting this rank reads later, read now
            proposal, failure = propose(segment_bytes=segment_bytes, transport=transport,
                                        device=device), None
            host = host or _reachable_host(address)
            trace = trace if trace is not None else config.value("trace")
        except ArgumentError as err:
            proposal, failure = None, err
        settings, topology = agree(scoped, rank, world_size, timeout, proposal=proposal,
                                   failure=failure,
                                   facts=RankFacts.here(traces=bool(trace), **gpu_facts(
                                       proposal["match"]["device"] if proposal else None)))
        assert host is not None  # found above, or agree raised the failure on every rank
        chans = GroupTransport(rank, world_size, scoped, hosts=[f.host for f in topology.ranks],
                             host=host, mode=settings.transport, timeout=timeout,
                             auth_token=auth_token, segment_bytes=settings.segment_bytes)
    except BaseException:
        for close in closers:
            close()
        raise
    def connect(members: tuple[int, ...], tag: str) -> GroupTransport:
        """Channels among ``members`` for ``comm.split``, set up through the same store."""
        return GroupTransport(members.index(rank), len(members), PrefixStore(tag, scoped),
                            hosts=[topology.ranks[m].host for m in members], host=host,
                            mode=settings.transport, timeout=timeout, auth_token=auth_token,
                            segment_bytes=settings.segment_bytes)

    try:
        comm = Communicator(chans, timeout=timeout, settings=settings, topology=topology,
                            on_close=closers, store_done=None if use is None else use.leave,
                            connect=connect, store=scoped, faults_live=False,
                            exchange=StoreExchange(scoped, "device", rank))
    except BaseException:  # the device set-up failed: nothing of the group stays open
        chans.close()
        for close in closers:
            close()
        raise
    try:
        comm.barrier()  # every rank is connected and done with the store's set-up keys
        measure_remote(comm)  # several hosts: the link between them, agreed
        tracing = [r for r, facts in enumerate(topology.ranks) if facts.traces]
        if tracing:  # every rank's clock against rank 0's, for the timelines to line up
            clock = through_store(scoped, rank, tracing, timeout)
            if trace:
                comm.keep_timeline(_timeline_folder(trace, generation), clock)
        comm.start_faults()  # injected faults count the job's ops, not the set-up's
    except CommError:
        comm.close()
        raise
    if log.isEnabledFor(logging.INFO):
        log.info("%s", summary(comm))
    return comm


_WARNED_OF: set[str] = set()  # the unknown variables already named in this process


def _warn_of_unknown_variables() -> None:
    """Log a warning naming each ``RINGCOMM_*`` variable set here that ringcomm does not
    know, with the setting it likely stands for: a misspelled one would otherwise leave its
    setting at the default without a word. A warning, not an error, since a variable of the
    user's own may share the prefix; once per name per process."""
    for name, meant in variables.unknown().items():
        if name not in _WARNED_OF:
            _WARNED_OF.add(name)
            log.warning("%s; `ringcomm env` lists the settings",
                        variables.unknown_message(name, meant))


def _timeline_folder(trace: str | os.PathLike[str], generation: int) -> str:
    """Where this communicator's timeline goes: the folder itself for a job's first group on
    its store, ``group<n>/`` in it for later ones (torch's ``new_group``), so that no two
    groups write the same file and ``ringcomm trace merge`` reads one. (A ``comm.split``
    subgroup keeps no timeline of its own.)"""
    return str(trace) if generation == 1 else os.path.join(str(trace), f"group{generation}")


def summary(comm: Communicator) -> str:
    """One line about this rank of a group that has just started (``RINGCOMM_DEBUG=INFO``):
    where it runs, how it reaches each peer, what the ranks agreed, which versions."""
    me = comm.topology.ranks[comm.rank]
    host_index = next(i for i, ranks in enumerate(comm.hosts) if comm.rank in ranks)
    links = "; ".join(f"rank {peer}: {link.describe()}"
                      for peer, link in enumerate(comm.transport.links) if link is not None)
    agreed = ", ".join(f"{k}={v}" for k, v in comm.settings.describe().items())
    versions = {"ringcomm": __version__, "python": platform.python_version()}
    for name in ("numpy", "zmq", "torch"):  # only what is loaded already: no imports here
        module = sys.modules.get(name)
        if module is not None:
            versions["pyzmq" if name == "zmq" else name] = getattr(module, "__version__", "?")
    return (f"rank {comm.rank} of {comm.world_size} on {me.hostname} (host {host_index} of "
            f"{len(comm.hosts)}, pid {me.pid}, {len(me.cpus)} cores) | links: "
            f"{links or 'none'} | agreed: {agreed}, timeout={comm.timeout:g}s | "
            + ", ".join(f"{k} {v}" for k, v in versions.items()))


_LEAVE_WAIT = 10.0  # s: the most rank 0's close waits for its group to leave its store
_LEAVE_ANSWER = 2.0  # s: the most a rank's close waits for the store to hear it leave


class _StoreUse:
    """This rank's use of the store ``init`` reached by address: its client, and on rank 0
    the server it serves and its hold on it (``StoreServer.hold``; no server where a store
    served apart answered there).

    It ends in the order that lets the store outlive every rank's last use of it. ``leave``
    comes first, from the communicator's close as soon as the device lanes (the last users
    of the store) are closed: the rank says ``leave`` to the store (from then on the store
    rank 0 serves turns newcomers away, unless another group holds it; one that does not
    answer within ``_LEAVE_ANSWER`` s is taken to be gone). ``close`` comes last, once the
    links are closed too (or from ``init`` on a failure, saying ``leave`` first if that has
    not been said): the rank closes its client, and rank 0 retires its hold: where no other
    group of this process holds the store, it waits until every rank has left or gone, for
    ``_LEAVE_WAIT`` s at most (never longer than the group's timeout), and closes it."""

    def __init__(self, client: StoreClient, served: tuple[StoreServer, int] | None,
                 rank: int, timeout: float) -> None:
        self.client = client
        self.served = served
        self.rank = rank
        self.wait = min(timeout, _LEAVE_WAIT)
        self.group: str | None = None
        self._left = self._closed = False

    def joined(self, group: str, world_size: int) -> None:
        """The group this rank joins on the store is ``group``, of ``world_size`` ranks
        (rank 0's hold on the server it serves is that group's from now on)."""
        self.group = group
        if self.served is not None:
            server, hold = self.served
            server.own(hold, group, world_size)

    def leave(self) -> None:
        """Tell the store that this rank is done with it (once; nothing before a group met)."""
        if self._left or self.group is None:
            return
        self._left = True
        try:
            self.client.leave(self.group, self.rank, timeout=min(self.wait, _LEAVE_ANSWER))
        except StoreError as err:  # the store is gone already: nothing to tell it
            log.debug("rank %d could not say it leaves the store: %s", self.rank, err)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.leave()
        finally:
            self.client.close()
            if self.served is not None:
                _retire(*self.served, self.wait)


# The stores this process serves, by port and token: a later group of this process on the
# same address while an earlier one lives holds the same store (``StoreServer.hold``).
_SERVED: dict[tuple[int, str], StoreServer] = {}
_SERVED_LOCK = threading.Lock()


def _retire(server: StoreServer, hold: int, wait: float) -> None:
    """Give back ``hold`` on ``server`` (``StoreServer.retire``), and forget a server that
    has closed."""
    server.retire(hold, wait)
    if server.closed:
        with _SERVED_LOCK:
            for key in [k for k, v in _SERVED.items() if v is server]:
                del _SERVED[key]


def _serve_unless_served(host: str, port: int, auth_token: str | None,
                         timeout: float) -> tuple[StoreServer, int] | None:
    """Rank 0 serves the store, and holds it for its group, unless one already answers at
    ``host:port`` (``RINGCOMM_STORE``: ``auto``). Where this process serves it already (for
    another group that still lives), the new group holds that one too. Where another serves
    it (``ringcomm store`` started apart from the ranks), every rank, rank 0 included, uses
    that one (None), and rank 0 says so in a warning: a store it did not start sees every
    rank's addresses and writes the records the ranks connect by. ``serve`` refuses such a
    store (a ``StoreError``: rank 0 was to serve it, so something else holds the port);
    ``join`` serves nothing and joins what answers there, quietly. A port held by something
    that is not a store stays an error (after one more try to bind it: a store may have
    gone between the two looks). A store there that is going away with its own group (its
    rank 0, another process, is still closing) is waited out, up to ``timeout`` s, and then
    this rank serves the port."""
    key = (port, auth_token or "")
    with _SERVED_LOCK:
        mine = _SERVED.get(key)
        hold = mine.hold() if mine is not None else None
        if mine is not None and hold is not None:
            return mine, hold
    role = config.value("store_role")
    if role == "join":
        return None
    deadline = time.monotonic() + timeout
    while True:
        try:
            return _serve(host, port, auth_token, key)
        except StoreError as err:
            refused = err
        probe = StoreClient(f"{host}:{port}", timeout=0.5,  # a store answers in ms
                            auth_token=auth_token)
        try:
            probe.ping()
        except StoreError:
            if probe.turned_away and time.monotonic() < deadline:
                continue  # a store going away: wait it out
        else:
            _joined_apart(host, port, role)
            return None
        finally:
            probe.close()
        try:  # no store answered: the one that held the port may have gone just now
            return _serve(host, port, auth_token, key)
        except StoreError:
            raise refused from None


def _joined_apart(host: str, port: int, role: str) -> None:
    """A store that rank 0 did not start answers at ``host:port``: refused where rank 0 was
    to serve it (``RINGCOMM_STORE=serve``), else joined with a warning."""
    if role == "serve":
        raise StoreError(
            f"rank 0 was to serve the store at {host}:{port} (RINGCOMM_STORE=serve), but a "
            "store it did not start answers there already, and would see every rank's "
            "addresses and write the records they connect by; stop what holds the port (or "
            "use another port), or set RINGCOMM_STORE=join if a store served apart from the "
            "ranks is meant", rank=0)
    log.warning("rank 0 joins the store at %s:%d, which it did not start (one answered "
                "there already): every rank's addresses go through it. If it is not a "
                "`ringcomm store` started for this job, stop the job; RINGCOMM_STORE=serve "
                "refuses such a store, RINGCOMM_STORE=join expects one (and says nothing)",
                host, port)


def _serve(host: str, port: int, auth_token: str | None,
           key: tuple[int, str]) -> tuple[StoreServer, int]:
    """A new store on ``port``, held for this rank's group and known as this process's."""
    server = StoreServer(_bind_host(host), port, auth_token=auth_token)
    hold = server.hold()
    assert hold is not None  # a new server is not closing
    with _SERVED_LOCK:
        _SERVED[key] = server
    return server, hold


def _seconds(timeout: Any) -> float:
    """``timeout`` as positive seconds: a number or a ``timedelta``, else an error. Longer
    than ``waits.MAX_TIMEOUT`` (a week), ``inf`` included, is taken as that: every rank
    does the same, so ranks given any size of timeout agree (the OS's and ZeroMQ's waits
    take at most about 24.8 days)."""
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ArgumentError(f"timeout must be seconds (a number) or a datetime.timedelta, got "
                            f"{type(timeout).__name__}")
    if not timeout > 0:  # (NaN too)
        raise ArgumentError(f"timeout must be positive, got {timeout:g} s")
    return waits.clamp(float(timeout))


def env_int(name: str) -> int | None:
    """A launcher's integer variable (``RANK``, ``WORLD_SIZE``), None where unset."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ArgumentError(f"environment variable {name}={value!r} is not an integer") from None


def _master_address() -> str:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise ArgumentError(
            "no store given and MASTER_ADDR/MASTER_PORT are not set: pass store='host:port' "
            "or launch under torchrun")
    return f"{addr}:{port}"


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ArgumentError(f"store address {address!r} is not of the form 'host:port'")
    return host.strip("[]"), int(port)


def _bind_host(host: str) -> str:
    """Serve on the master address when it is one of ours, else on every interface."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        return "0.0.0.0"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
        return ip
    except OSError:
        return "0.0.0.0"


def _reachable_host(address: str | None) -> str:
    """The address peers can reach this rank at: ``RINGCOMM_IFADDR``, else the IPv4 address
    of the first interface named in ``RINGCOMM_SOCKET_IFNAME`` that has one, else the local
    end of a route to the store host (loopback when the store is local). ``init(host=)``
    comes before all of these (the caller passes it instead of asking here)."""
    forced: str | None = config.value("host")
    if forced:
        return forced
    ifname: str = config.value("socket_ifname") or ""
    if ifname.replace(",", "").strip():  # names no interface: as if unset
        return _interface_address(ifname)
    if not address:
        return "127.0.0.1"
    host, _ = _split_address(address)
    try:
        ip = socket.gethostbyname(host)
        if ip.startswith("127."):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((ip, 9))
            local: str = probe.getsockname()[0]
            return local
    except OSError:
        return "127.0.0.1"


def _interface_address(names: str) -> str:
    """The IPv4 address of the first interface in ``names`` (comma-separated, as in
    ``RINGCOMM_SOCKET_IFNAME=eth0,ib0``) that exists and has one. Raises ``ArgumentError``
    naming the interfaces asked for and listing those that exist, with their addresses."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    for name in wanted:
        ip = _ipv4_of(name)
        if ip is not None:
            return ip
    have = ", ".join(f"{n} ({_ipv4_of(n) or 'no IPv4 address'})" for n in _interfaces())
    what = (f"interface {wanted[0]!r} does not exist or has no IPv4 address" if len(wanted) == 1
            else f"none of the interfaces {', '.join(map(repr, wanted))} exists with an IPv4 "
            "address")
    raise ArgumentError(
        f"RINGCOMM_SOCKET_IFNAME={names!r}: {what}; the interfaces here are: "
        f"{have or 'none found'}. Name one of them (or a comma-separated list, first match "
        "wins), or set RINGCOMM_IFADDR to an address")


_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (primary) IPv4 address
_IFNAMSIZ = 16


def _interfaces() -> list[str]:
    """Names of this network namespace's interfaces, in index order."""
    try:
        return [name for _, name in sorted(socket.if_nameindex())]
    except OSError:
        return sorted(_ip_addr_show())


def _ipv4_of(name: str) -> str | None:
    """The IPv4 address of interface ``name``; None if there is no such interface or it has
    none. The ``SIOCGIFADDR`` ioctl; ``ip -o -4 addr show`` only where the ioctl is missing."""
    raw = name.encode()
    if not raw or len(raw) >= _IFNAMSIZ or b"\0" in raw or b"/" in raw:
        return None  # no interface can have this name
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", raw))
        return socket.inet_ntoa(reply[20:24])  # struct ifreq: name[16], sockaddr_in
    except OSError as err:
        if err.errno in (errno.ENODEV, errno.EADDRNOTAVAIL, errno.ENXIO):
            return None  # no such interface / it has no IPv4 address
        return _ip_addr_show().get(name)
    except ImportError:
        return _ip_addr_show().get(name)


def _ip_addr_show() -> dict[str, str]:
    """Interface name -> first IPv4 address, from ``ip -o -4 addr show`` (the fallback)."""
    import subprocess

    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                             text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, str] = {}
    for line in out.splitlines():  # "2: eth0    inet 10.0.0.2/24 brd ... scope global eth0"
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "inet":
            found.setdefault(parts[1].split("@")[0], parts[3].split("/")[0])
    return found


def _torchrun_store(address: str, timeout: float) -> Store:
    from datetime import timedelta

    from torch.distributed import TCPStore

    host, port = _split_address(address)
    try:
        c10d = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except Exception as err:  # noqa: BLE001 - torch raises several types here
        raise CommError(f"could not join torchrun's store at {address}: {err}") from err
    return TorchStore(c10d, timeout=timeout)
