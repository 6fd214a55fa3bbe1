"""The cost model: predicts how long a schedule takes, to choose an algorithm per call.

Why simulate rather than use closed formulas: a schedule is plain data, so the model can
replay exactly what the executor will do, rank by rank, with its real segments, pipelining
and waits, instead of a formula that describes an idealised version of it. Every rank is
one thread that handles its steps in order, so it is modelled as one clock:

- ``send`` of ``m`` bytes costs the sender ``alpha / 2 + m * beta``; the message is ready for
  the receiver when the sender's clock has advanced past it;
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

from .algorithms import ALLREDUCE
from .algorithms.schedule import Kind, Schedule

DEFAULT_SEGMENT_BYTES = 2 << 20  # measured best here with shared memory (1 MiB: 20% slower)


@dataclass(frozen=True)
class CostParams:
    """Seconds per message (``alpha``), per byte moved (``beta``), per byte reduced (``gamma``)."""

    alpha: float = 60e-6  # `ringcomm tune` on 2 cores, world 2, local pipes + shared memory
    beta: float = 0.09e-9
    gamma: float = 0.09e-9  # segment-wise float32 sum over buffers beyond the cache


# Two runs of `ringcomm tune -n 2 4` on a quiet 2-core machine (median fit error 12-20%),
# rounded between them. With four ranks on two cores each message costs more (wake-ups wait
# for a core), which is why the worlds differ.
DEFAULT_PARAMS: dict[int, CostParams] = {
    2: CostParams(),
    4: CostParams(alpha=105e-6, beta=0.12e-9, gamma=0.09e-9),
}


@dataclass
class Profile:
    """Fitted parameters per world size, and the measured best segment size."""

    params: dict[int, CostParams] = field(default_factory=dict)
    segment_bytes: int | None = None
    source: str = "defaults"

    def for_world(self, world_size: int) -> CostParams:
        params = self.params or DEFAULT_PARAMS
        nearest = min(params, key=lambda n: (abs(n - world_size), -n))
        return params[nearest]

    def to_json(self) -> str:
        return json.dumps({
            "params": {str(n): asdict(p) for n, p in sorted(self.params.items())},
            "segment_bytes": self.segment_bytes,
        }, indent=2)

    @classmethod
    def from_json(cls, text: str, source: str) -> Profile:
        raw = json.loads(text)
        params = {int(n): CostParams(**p) for n, p in raw.get("params", {}).items()}
        return cls(params, raw.get("segment_bytes"), source)


def profile_path() -> Path:
    env = os.environ.get("RINGCOMM_PROFILE")
    if env:
        return Path(env)
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
    + beta * moved + gamma * reduced``. Linear in the parameters, which is what lets
    ``ringcomm tune`` fit them by least squares."""

    messages: float
    moved: float
    reduced: float

    def time(self, p: CostParams) -> float:
        return p.alpha * self.messages + p.beta * self.moved + p.gamma * self.reduced


@dataclass(frozen=True)
class ScheduleCost:
    """The two bounds on a collective's time: its critical path (the slowest rank's clock,
    waits included) and the work of all ranks together (for sharing cores)."""

    critical: Terms
    work: Terms
    world_size: int

    def time(self, params: CostParams, cores_per_rank: float = 1.0) -> float:
        """``cores_per_rank`` < 1 when the ranks of one host outnumber its cores."""
        shared = self.work.time(params) / self.world_size / min(1.0, cores_per_rank)
        return max(self.critical.time(params), shared)


def cores_per_rank(local_ranks: int) -> float:
    """Cores this host gives each of its ``local_ranks`` ranks (at most 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return min(1.0, cores / max(1, local_ranks))


def simulate(schedules: list[Schedule], itemsize: int, params: CostParams) -> ScheduleCost:
    """Replay every rank's schedule; return the critical path's and the total work's terms.

    Each clock carries, beside its time, the terms that built it, so the critical path's
    terms come out with the time."""
    n = len(schedules)
    clocks = [[0.0, 0.0, 0.0, 0.0] for _ in range(n)]  # time, messages, moved, reduced
    work = [0.0, 0.0, 0.0]
    cursor = [0] * n
    links: dict[tuple[int, int], deque] = {}
    blocked = set()
    runnable = deque(range(n))
    waiting: dict[tuple[int, int], int] = {}
    a, b, g = params.alpha, params.beta, params.gamma

    def advance(clock: list[float], msgs: float, moved: float, reduced: float) -> None:
        clock[0] += a * msgs + b * moved + g * reduced
        clock[1] += msgs
        clock[2] += moved
        clock[3] += reduced
        work[0] += msgs
        work[1] += moved
        work[2] += reduced

    while runnable:
        r = runnable.popleft()
        blocked.discard(r)
        steps, clock = schedules[r].steps, clocks[r]
        while cursor[r] < len(steps):
            step = steps[cursor[r]]
            if step.kind is Kind.SEND:
                m = step.src.count * itemsize
                advance(clock, 0.5, m, 0)
                links.setdefault((r, step.peer), deque()).append(tuple(clock))
                woken = waiting.pop((r, step.peer), None)
                if woken is not None:
                    runnable.append(woken)
            elif step.kind is Kind.COPY:
                advance(clock, 0, step.src.count * itemsize, 0)
            else:
                queue = links.get((step.peer, r))
                if not queue:
                    waiting[(step.peer, r)] = r
                    blocked.add(r)
                    break
                ready = queue.popleft()
                if ready[0] > clock[0]:
                    clock[:] = list(ready)
                m = step.dst.count * itemsize
                if step.kind is Kind.RECV:
                    advance(clock, 0.5, m, 0)
                elif step.kind is Kind.RECV_REDUCE:
                    advance(clock, 0.5, 0, m)
                else:  # fused: the reduction writes the outgoing message, no copy of its own
                    advance(clock, 1.0, 0, m)
                    links.setdefault((r, step.to), deque()).append(tuple(clock))
                    woken = waiting.pop((r, step.to), None)
                    if woken is not None:
                        runnable.append(woken)
            cursor[r] += 1
    if blocked:
        raise RuntimeError(f"schedules deadlock: ranks {sorted(blocked)} wait forever")
    slowest = max(clocks, key=lambda c: c[0])
    return ScheduleCost(Terms(*slowest[1:]), Terms(*work), n)


@lru_cache(maxsize=4096)
def allreduce_cost(algorithm: str, world_size: int, count: int, itemsize: int,
                   segment: int) -> ScheduleCost:
    """Cost terms of one allreduce, from its schedules on every rank."""
    make = ALLREDUCE[algorithm]
    schedules = [make(r, world_size, count, segment) for r in range(world_size)]
    # The critical path depends a little on the parameters; the defaults' shape is enough
    # to choose and to fit.
    return simulate(schedules, itemsize, CostParams())


def predict(collective: str, algorithm: str, world_size: int, nbytes: int, itemsize: int = 4,
            *, segment_bytes: int | None = None, params: CostParams | None = None,
            local_ranks: int | None = None) -> float:
    """Predicted seconds for one call (``collective`` is ``"allreduce"`` for now).

    ``local_ranks``: ranks per host (default: all of them on this one)."""
    if collective != "allreduce":
        raise ValueError(f"no cost model for {collective!r} yet; only allreduce is modelled")
    profile = load_profile()
    params = params or profile.for_world(world_size)
    segment = _segment_elems(segment_bytes, profile, itemsize)
    cost = allreduce_cost(algorithm, world_size, nbytes // itemsize, itemsize, segment)
    return cost.time(params, cores_per_rank(local_ranks or world_size))


def choose(collective: str, world_size: int, nbytes: int, itemsize: int = 4, *,
           segment_bytes: int | None = None, local_ranks: int | None = None,
           params: CostParams | None = None, share: float | None = None) -> str:
    """The algorithm with the smallest predicted time (ties go to the ring).

    A communicator passes ``segment_bytes``, ``params`` and ``share`` (cores per rank) as
    its ranks agreed on them, so the choice reads nothing local and is the same on every
    rank; what is left out comes from this machine (its profile, its affinity), for
    predictions made outside a group."""
    if params is None or segment_bytes is None:
        profile = load_profile()
        params = params or profile.for_world(world_size)
        segment_bytes = segment_bytes or profile.segment_bytes
    if share is None:
        share = cores_per_rank(local_ranks or world_size)
    return _choose(collective, world_size, nbytes, itemsize,
                   max(1, (segment_bytes or DEFAULT_SEGMENT_BYTES) // itemsize), params, share)


@lru_cache(maxsize=4096)
def _choose(collective: str, world_size: int, nbytes: int, itemsize: int, segment: int,
            params: CostParams, share: float) -> str:
    if world_size <= 1 or nbytes == 0:
        return "ring"  # nothing moves
    count = nbytes // itemsize
    times = {name: allreduce_cost(name, world_size, count, itemsize, segment).time(params, share)
             for name in ALLREDUCE}
    return min(times, key=lambda name: (times[name], name != "ring"))


def _segment_elems(segment_bytes: int | None, profile: Profile, itemsize: int) -> int:
    nbytes = segment_bytes or profile.segment_bytes or DEFAULT_SEGMENT_BYTES
    return max(1, nbytes // itemsize)
