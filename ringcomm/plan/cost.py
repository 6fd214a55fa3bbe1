"""The cost model: predicts how long a schedule takes, to choose an algorithm per call.

Why simulate rather than use closed formulas: a schedule is plain data, so the model can
replay exactly what the executor will do, rank by rank, with its real segments, pipelining
and waits, instead of a formula that describes an idealised version of it. Every rank is
one thread that handles its steps in order, so it is modelled as one clock:

- ``send`` of ``m`` bytes costs the sender ``alpha / 2 + m * beta``; the message is ready for
  the receiver when the sender's clock has advanced past it. Between ranks of different
  hosts the remote link's ``alpha`` and ``beta`` apply (the receiver's copy stays local),
  and the bytes all ranks of a host send to others share that host's link: a third lower
  bound beside the critical path and the shared cores;
- ``recv`` waits for the message, then costs ``alpha / 2 + m * beta`` (copy it out);
- ``recv+reduce`` waits, then costs ``alpha / 2 + m * gamma`` (read both, write one);
- ``recv+reduce+send`` (fused) waits, then costs ``alpha + m * gamma``: the sum is written
  into the outgoing message, so it has no copy of its own;
- ``copy`` costs ``m * beta``.

The predicted time is the slowest rank's clock at the end, or, when ranks outnumber cores
(four ranks on two cores), the work of all ranks on a host divided by its cores, whichever
is larger: there the trees, whose leaves are idle, gain on the ring. ``alpha`` is the cost of one
message (system calls, wake-ups), ``beta`` the cost of moving a byte, ``gamma`` of reducing
one. The defaults are measured on a 2-core machine with shared memory; ``ringcomm tune``
measures them on yours and writes a profile (``RINGCOMM_PROFILE`` or
``~/.cache/ringcomm/profile.json``), per world size, together with the best segment size.
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from ..core import config
from ..schedules import ALLREDUCE, HOST_AWARE, allreduce_schedule
from ..schedules.schedule import Kind, Schedule

DEFAULT_SEGMENT_BYTES = 2 << 20  # measured best here with shared memory (1 MiB: 20% slower)


@dataclass(frozen=True)
class CostParams:
    """Seconds per message (``alpha``), per byte moved (``beta``), per byte reduced (``gamma``)."""

    alpha: float = 60e-6  # `ringcomm tune` on 2 cores, world 2, local pipes + shared memory
    beta: float = 0.09e-9
    gamma: float = 0.09e-9  # segment-wise float32 sum over buffers beyond the cache


# Links between hosts when nothing better is known: ZeroMQ over tcp, a round trip of about
# 80 us here, and about 1.25 GB/s (10 Gbit/s Ethernet; a veth pair here carries 2.4 GB/s).
DEFAULT_REMOTE_PARAMS = CostParams(alpha=100e-6, beta=0.8e-9, gamma=0.09e-9)

# Two runs of `ringcomm tune -n 2 4` on a quiet 2-core machine (median fit error 12-20%),
# rounded between them. With four ranks on two cores each message costs more (wake-ups wait
# for a core), which is why the worlds differ.
DEFAULT_PARAMS: dict[int, CostParams] = {
    2: CostParams(),
    4: CostParams(alpha=105e-6, beta=0.12e-9, gamma=0.09e-9),
}


# The device engines when no profile says better (``ringcomm tune`` on a GPU writes their
# own under "devices"). Not measured here (no GPU): derived from the machine's documented
# figures. cuda-ipc: a message is a copy into a slot and a notice on the local link (about
# 20 us with its event waits); a device-to-device copy moves about 1.5 TB/s (3.0 TB/s
# counting bytes read and written on an H100), a reduction reads two bytes and writes one
# per byte. staged: a message is a copy to host, a send, a copy to the device, each waited
# for (about 60 us), and its bytes cross PCIe twice (about 25 GB/s each way) besides the
# link's own copy.
DEFAULT_DEVICE_PARAMS: dict[str, CostParams] = {
    "cuda-ipc": CostParams(alpha=20e-6, beta=0.67e-12, gamma=1.0e-12),
    "staged": CostParams(alpha=60e-6, beta=0.17e-9, gamma=1.0e-12),
    # nccl: a message of ringcomm's schedules is a group launch (about 10 us); its bytes
    # move as NCCL's transport moves them (NVLink, PCIe, or sockets between hosts: taken
    # here as NVLink-class). Also not measured here.
    "nccl": CostParams(alpha=10e-6, beta=0.67e-12, gamma=1.0e-12),
}
# NCCL's own collective is one kernel: its ring's steps pay no launch each, about this
NCCL_STEP_ALPHA = 1e-6

# The kernel path (engine cuda-kernel), by algorithm. UNMEASURED DEFAULTS: no GPU has run
# these kernels yet; ``ringcomm tune --device cuda`` is to measure them (a profile's
# "devices" entries under these names replace them). alpha: the launch plus the blocks'
# two meetings through system-scope flags (vLLM's one-shot: about 7 us for 0.5 MB on an
# H100 pair, mostly this; the two-shot's grid does more per byte, so a little more).
# beta: per byte a rank's kernel reads or writes, its peers' mapped memory included (HBM
# at about 1.5 TB/s each way, shared by the ranks of one GPU); gamma: per byte reduced.
DEFAULT_KERNEL_PARAMS: dict[str, CostParams] = {
    "kernel-oneshot": CostParams(alpha=6e-6, beta=0.67e-12, gamma=0.5e-12),
    "kernel-twoshot": CostParams(alpha=10e-6, beta=0.67e-12, gamma=0.5e-12),
}
DEFAULT_DEVICE_PARAMS.update(DEFAULT_KERNEL_PARAMS)


def kernel_allreduce(algorithm: str, world_size: int, nbytes: int,
                     params: CostParams) -> float:
    """Predicted seconds of the kernel path's allreduce of ``nbytes``: one launch
    (``alpha``) plus the bytes one rank's kernel moves and reduces. One-shot: it reads
    every rank's ``nbytes`` and writes its own output, ``(p + 1) * nbytes`` moved, ``(p -
    1) * nbytes`` reduced; two-shot: it reads its 1/p slice from every rank and writes it
    to every rank, ``2 * nbytes`` moved, ``(p - 1) / p * nbytes`` reduced. So the one-shot
    wins small messages (its launch costs less) and the two-shot large ones (``ringcomm
    .plan.select``)."""
    return kernel_allreduce_terms(algorithm, world_size, nbytes).time(params)


def kernel_allreduce_terms(algorithm: str, world_size: int, nbytes: int) -> ScheduleCost:
    """``kernel_allreduce``'s terms (one launch, the bytes moved and reduced), as the
    schedules' are, so ``ringcomm tune`` fits the kernel path's constants as it fits the
    links'. Every rank's kernel does the same: the critical path is one rank's work."""
    p = world_size
    moved: float
    reduced: float
    if algorithm == "kernel-oneshot":
        moved, reduced = (p + 1) * nbytes, (p - 1) * nbytes
    elif algorithm == "kernel-twoshot":
        moved, reduced = 2 * nbytes, (p - 1) * nbytes / p
    else:
        raise ValueError(f"{algorithm!r} is no algorithm of the kernel path")
    one = Terms(1.0, moved, reduced)
    return ScheduleCost(one, Terms(p * 1.0, p * moved, p * reduced), p)


def nccl_own_allreduce(world_size: int, nbytes: int, itemsize: int,
                       params: CostParams) -> float:
    """Predicted seconds of NCCL's own allreduce: a ring (NCCL's for large sizes) whose
    steps cost ``NCCL_STEP_ALPHA`` instead of a launch each, plus one launch."""
    if world_size <= 1 or nbytes == 0:
        return params.alpha
    count = nbytes // itemsize
    ring = allreduce_cost("ring", world_size, count, itemsize, max(1, count))
    step = CostParams(NCCL_STEP_ALPHA, params.beta, params.gamma)
    return params.alpha + ring.time(step, 1.0)


@dataclass
class Profile:
    """Fitted parameters per world size, the measured best segment size, and the device
    engines' parameters where they were measured."""

    params: dict[int, CostParams] = field(default_factory=dict)
    segment_bytes: int | None = None
    source: str = "defaults"
    remote: CostParams | None = None  # links between hosts, where `ringcomm tune` measured them
    devices: dict[str, CostParams] = field(default_factory=dict)  # by device engine

    def for_world(self, world_size: int) -> CostParams:
        params = self.params or DEFAULT_PARAMS
        nearest = min(params, key=lambda n: (abs(n - world_size), -n))
        return params[nearest]

    def for_device(self, engine: str) -> CostParams:
        """The parameters of device engine ``engine``: measured, else the defaults."""
        return self.devices.get(engine) or DEFAULT_DEVICE_PARAMS[engine]

    def to_json(self) -> str:
        raw = {
            "params": {str(n): asdict(p) for n, p in sorted(self.params.items())},
            "segment_bytes": self.segment_bytes,
            "remote": asdict(self.remote) if self.remote else None,
        }
        if self.devices:
            raw["devices"] = {name: asdict(p) for name, p in sorted(self.devices.items())}
        return json.dumps(raw, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str) -> Profile:
        raw = json.loads(text)
        params = {int(n): CostParams(**p) for n, p in raw.get("params", {}).items()}
        remote = CostParams(**raw["remote"]) if raw.get("remote") else None
        devices = {name: CostParams(**p) for name, p in (raw.get("devices") or {}).items()}
        return cls(params, raw.get("segment_bytes"), source, remote, devices)


def profile_path() -> Path:
    forced: str | None = config.value("profile")
    if forced:
        return Path(forced)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ringcomm" / \
        "profile.json"


@lru_cache(maxsize=1)
def _profile_at(path: str, mtime: float) -> Profile:
    try:
        return Profile.from_json(Path(path).read_text(), source=path)
    except (OSError, ValueError, TypeError, KeyError):
        return Profile()  # an unreadable profile must not break communication


def load_profile() -> Profile:
    """The profile written by ``ringcomm tune``, or the defaults if there is none."""
    path = profile_path()
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return Profile()
    return _profile_at(str(path), mtime)


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Terms:
    """How often each parameter is paid on the slowest rank's path: ``time = alpha * messages
    + beta * moved + gamma * reduced``, plus the messages and bytes that cross between hosts,
    priced with the remote link's ``alpha`` and ``beta``. Linear in the parameters, which is
    what lets ``ringcomm tune`` fit them by least squares."""

    messages: float
    moved: float
    reduced: float
    remote_messages: float = 0.0
    remote_moved: float = 0.0

    def time(self, p: CostParams, remote: CostParams | None = None) -> float:
        r = remote or p
        return (p.alpha * self.messages + p.beta * self.moved + p.gamma * self.reduced
                + r.alpha * self.remote_messages + r.beta * self.remote_moved)


@dataclass(frozen=True)
class ScheduleCost:
    """The two bounds on a collective's time: its critical path (the slowest rank's clock,
    waits included) and the work of all ranks together (for sharing cores)."""

    critical: Terms
    work: Terms
    world_size: int
    link_bytes: float = 0.0  # bytes the busiest host sends to other hosts, all its ranks

    def time(self, params: CostParams, cores_per_rank: float = 1.0,
             remote: CostParams | None = None) -> float:
        """``cores_per_rank`` < 1 when the ranks of one host outnumber its cores; ``remote``
        prices what crosses between hosts (default: ``params``). A third bound: the ranks of
        a host share its one link to the others, so its bytes go out one after another."""
        shared = self.work.time(params, remote) / self.world_size / min(1.0, cores_per_rank)
        link = self.link_bytes * (remote or params).beta
        return max(self.critical.time(params, remote), shared, link)


def cores_per_rank(local_ranks: int) -> float:
    """Cores this host gives each of its ``local_ranks`` ranks (at most 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(1.0, cores / max(1, local_ranks))


def simulate(schedules: list[Schedule], itemsize: int, params: CostParams,
             remote: CostParams | None = None,
             host_of: tuple[int, ...] | None = None) -> ScheduleCost:
    """Replay every rank's schedule; return the critical path's and the total work's terms.

    ``host_of[r]`` is rank ``r``'s host (default: all on one); a message between ranks of
    different hosts pays ``remote``'s alpha and beta. Each clock carries, beside its time,
    the terms that built it, so the critical path's terms come out with the time."""
    n = len(schedules)
    # time, messages, moved, reduced, remote messages, remote bytes
    clocks = [[0.0] * 6 for _ in range(n)]
    work = [0.0] * 5
    cursor = [0] * n
    links: dict[tuple[int, int], deque] = {}
    blocked = set()
    runnable = deque(range(n))
    waiting: dict[tuple[int, int], int] = {}
    a, b, g = params.alpha, params.beta, params.gamma
    ra, rb = (remote.alpha, remote.beta) if remote else (a, b)
    host_out: dict[int, float] = {}  # bytes each host sends to other hosts
    hosts = (0,) * n if host_of is None else host_of

    def advance(clock: list[float], msgs: float, moved: float, reduced: float,
                far: bool = False) -> None:
        if far:
            clock[0] += ra * msgs + rb * moved + g * reduced
            terms = (0.0, 0.0, reduced, msgs, moved)
        else:
            clock[0] += a * msgs + b * moved + g * reduced
            terms = (msgs, moved, reduced, 0.0, 0.0)
        for i, t in enumerate(terms):
            clock[i + 1] += t
            work[i] += t

    def far(x: int, y: int) -> bool:
        return host_of is not None and hosts[x] != hosts[y]

    while runnable:
        r = runnable.popleft()
        blocked.discard(r)
        steps, clock = schedules[r].steps, clocks[r]
        while cursor[r] < len(steps):
            step = steps[cursor[r]]
            src, dst = step.src, step.dst
            if step.kind is Kind.SEND:
                assert src is not None
                m = src.count * itemsize
                advance(clock, 0.5, m, 0, far(r, step.peer))
                if far(r, step.peer):
                    host_out[hosts[r]] = host_out.get(hosts[r], 0.0) + m
                links.setdefault((r, step.peer), deque()).append(tuple(clock))
                woken = waiting.pop((r, step.peer), None)
                if woken is not None:
                    runnable.append(woken)
            elif step.kind is Kind.COPY:
                assert src is not None
                advance(clock, 0, src.count * itemsize, 0)
            else:
                queue = links.get((step.peer, r))
                if not queue:
                    waiting[(step.peer, r)] = r
                    blocked.add(r)
                    break
                ready = queue.popleft()
                if ready[0] > clock[0]:
                    clock[:] = list(ready)
                assert dst is not None
                m = dst.count * itemsize
                # the wire time of a message between hosts is the sender's; the receiver
                # pays the message's alpha and its own local copy or reduction
                advance(clock, 0.5, 0, 0, far(step.peer, r))
                if step.kind is Kind.RECV:
                    advance(clock, 0, m, 0)
                elif step.kind is Kind.RECV_REDUCE:
                    advance(clock, 0, 0, m)
                else:  # fused: the reduction writes the outgoing message, no copy of its own
                    advance(clock, 0, 0, m)
                    # ... unless it leaves the host: then the bytes still cross the link
                    advance(clock, 0.5, m if far(r, step.to) else 0, 0, far(r, step.to))
                    if far(r, step.to):
                        host_out[hosts[r]] = host_out.get(hosts[r], 0.0) + m
                    links.setdefault((r, step.to), deque()).append(tuple(clock))
                    woken = waiting.pop((r, step.to), None)
                    if woken is not None:
                        runnable.append(woken)
            cursor[r] += 1
    if blocked:
        raise RuntimeError(f"schedules deadlock: ranks {sorted(blocked)} wait forever")
    slowest = max(clocks, key=lambda c: c[0])
    return ScheduleCost(Terms(*slowest[1:]), Terms(*work), n, max(host_out.values(), default=0))


Hosts = tuple[tuple[int, ...], ...]


def _several(hosts: Hosts | None) -> Hosts | None:
    """``hosts`` when there are two or more of them, else None (one host: nothing remote)."""
    return hosts if hosts is not None and len(hosts) > 1 else None


@lru_cache(maxsize=4096)
def allreduce_cost(algorithm: str, world_size: int, count: int, itemsize: int,
                   segment: int, hosts: Hosts | None = None) -> ScheduleCost:
    """Cost terms of one allreduce, from its schedules on every rank; ``hosts`` lists the
    ranks of each host (default: all on one)."""
    hosts = _several(hosts)
    schedules = [allreduce_schedule(algorithm, r, world_size, count, segment, hosts)
                 for r in range(world_size)]
    host_of = None
    if hosts is not None:
        where = {rank: h for h, ranks in enumerate(hosts) for rank in ranks}
        host_of = tuple(where[r] for r in range(world_size))
    # The critical path depends a little on the parameters; the defaults' shape is enough
    # to choose and to fit.
    return simulate(schedules, itemsize, CostParams(), DEFAULT_REMOTE_PARAMS, host_of)


def predict(collective: str, algorithm: str, world_size: int, nbytes: int, itemsize: int = 4,
            *, segment_bytes: int | None = None, params: CostParams | None = None,
            local_ranks: int | None = None, hosts: Hosts | None = None,
            remote: CostParams | None = None, share: float | None = None) -> float:
    """Predicted seconds for one call (``collective`` is ``"allreduce"`` for now).

    ``hosts``: the ranks of each host (default: all on this one); ``remote`` prices the
    links between hosts (default: ``DEFAULT_REMOTE_PARAMS``); ``share``: cores per rank
    (default: this machine's cores over ``local_ranks``, itself the world size)."""
    if collective != "allreduce":
        raise ValueError(f"no cost model for {collective!r} yet; only allreduce is modelled")
    profile = load_profile()
    params = params or profile.for_world(world_size)
    segment = _segment_elems(segment_bytes, profile, itemsize)
    cost = allreduce_cost(algorithm, world_size, nbytes // itemsize, itemsize, segment,
                          _several(hosts))
    if share is None:
        share = cores_per_rank(local_ranks or world_size)
    return cost.time(params, share, remote or DEFAULT_REMOTE_PARAMS)


def choose(collective: str, world_size: int, nbytes: int, itemsize: int = 4, *,
           segment_bytes: int | None = None, local_ranks: int | None = None,
           params: CostParams | None = None, share: float | None = None,
           hosts: Hosts | None = None, remote: CostParams | None = None) -> str:
    """The algorithm with the smallest predicted time (ties go to the ring).

    A communicator passes ``segment_bytes``, ``params``, ``share`` (cores per rank),
    ``hosts`` and ``remote`` as its ranks agreed on them, so the choice reads nothing local
    and is the same on every rank; what is left out comes from this machine (its profile,
    its affinity), for predictions made outside a group."""
    if params is None or segment_bytes is None:
        profile = load_profile()
        params = params or profile.for_world(world_size)
        segment_bytes = segment_bytes or profile.segment_bytes
    if share is None:
        share = cores_per_rank(local_ranks or world_size)
    return _choose(collective, world_size, nbytes, itemsize,
                   max(1, (segment_bytes or DEFAULT_SEGMENT_BYTES) // itemsize), params, share,
                   _several(hosts), remote or DEFAULT_REMOTE_PARAMS)


@lru_cache(maxsize=4096)
def _choose(collective: str, world_size: int, nbytes: int, itemsize: int, segment: int,
            params: CostParams, share: float, hosts: Hosts | None = None,
            remote: CostParams = DEFAULT_REMOTE_PARAMS) -> str:
    if world_size <= 1 or nbytes == 0:
        return "ring"  # nothing moves
    count = nbytes // itemsize
    # on one host a host-aware algorithm is only a slower flat one
    names = [n for n in ALLREDUCE if hosts is not None or n not in HOST_AWARE]
    costs = {name: allreduce_cost(name, world_size, count, itemsize, segment, hosts)
             for name in names}
    times = {name: c.time(params, share, remote) for name, c in costs.items()}
    # Within a hair of the best (ranks sharing cores make the total work decide, and for a
    # few bytes it is the same for several), the one with the fewest messages in a row wins:
    # each costs a wake-up the model's average does not see.
    best = min(times.values())
    close = [name for name in names if times[name] <= best * (1 + _TIE)]
    return min(close, key=lambda name: (costs[name].critical.messages, times[name],
                                        name != "ring"))


_TIE = 1e-3  # relative: predicted times this close count as equal


def _segment_elems(segment_bytes: int | None, profile: Profile, itemsize: int) -> int:
    nbytes = segment_bytes or profile.segment_bytes or DEFAULT_SEGMENT_BYTES
    return max(1, nbytes // itemsize)
