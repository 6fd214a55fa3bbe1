"""The disagreement hunt: random ops on which ranks disagree in exactly one respect.

A *case* gives every rank its own ``Call`` (collective, element count, dtype, reduce op,
root, algorithm, segment size). In a *disagreement* the ranks fall into two or more groups
that differ in exactly one of those; in a *control* they all agree. A rank runs its call,
then an all-to-all of one element per pair and a barrier (``play``), and reports what
happened. The rules (``judge``):

- no rank returns an output that is wrong for its own call (computed from its own call
  alone: the data are small integers, exact in every dtype, whatever the reduction order);
- in a disagreement every rank has raised a typed ``CommError`` by the end of the
  barrier, within the op timeout plus a margin (never a hang); a rank that received a
  message of the disagreeing ranks raised in the op itself (there is no other way for the
  difference to reach its output), while a rank whose role only sends (every rank, when
  they disagree about a gather's root) may return its right output and raise at its next
  op;
- in a control every rank returns the right output, and reductions are bitwise identical
  on every rank.

Reproducible: every failure prints the seed and the case, and ``cases(seed, n)`` rebuilds
the same cases (``RINGCOMM_HUNT_SEED`` replays a seed in the tests).
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import ml_dtypes
import numpy as np

from ringcomm import CommError
from ringcomm.plan.collectives import COLLECTIVES as TABLE

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "gather",
               "scatter", "alltoall")
STEPS = ("op", "follow-up", "barrier")
REDUCING = {c for c in COLLECTIVES if TABLE[c].reduces}
ROOTED = {c for c in COLLECTIVES if TABLE[c].rooted}
FIELDS = ("count", "dtype", "op", "root", "collective", "algorithm", "segment")
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int16")
OPS = ("sum", "prod", "min", "max")
ALGORITHMS = ("ring", "tree", "dbtree", "hd", "rd")
SEGMENTS = (64, 1024, 32 << 10, 2 << 20)  # bytes; small ones pipeline many messages
# elements per rank (per block for the block collectives); weighted towards the small
COUNTS = (1, 2, 3, 5, 17, 100, 1000, 4099, 65536, 65539, 1 << 18, 1 << 20, (1 << 20) + 8)
COUNT_WEIGHTS = (6, 4, 4, 4, 4, 4, 4, 3, 2, 2, 1, 1, 1)
MAX_BYTES = 8 << 20
MAX_MESSAGES = 512


@dataclass(frozen=True)
class Call:
    collective: str
    count: int
    dtype: str
    op: str = "sum"
    root: int = 0
    algorithm: str | None = None
    segment: int = 2 << 20

    def describe(self) -> str:
        extra = []
        if self.collective in REDUCING:
            extra.append(self.op)
        if self.collective in ROOTED:
            extra.append(f"root {self.root}")
        if self.algorithm:
            extra.append(self.algorithm)
        return (f"{self.collective}({self.count} x {self.dtype}{', ' if extra else ''}"
                f"{', '.join(extra)}, seg {self.segment})")


@dataclass(frozen=True)
class Case:
    seed: int
    index: int
    world: int
    field: str | None  # what differs; None for a control
    calls: tuple[Call, ...]

    def describe(self) -> str:
        what = f"ranks differ in {self.field}" if self.field else "control (ranks agree)"
        per_rank = "; ".join(f"rank {r}: {c.describe()}" for r, c in enumerate(self.calls))
        return f"seed {self.seed} case {self.index}, world {self.world}, {what}: {per_rank}"


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _base_call(rng: random.Random, world: int, max_bytes: int, auto: float | None,
               collectives: tuple[str, ...]) -> Call:
    collective = rng.choice(collectives)
    dtype = rng.choice(DTYPES)
    per_rank_limit = max(1, max_bytes // _dtype(dtype).itemsize)
    if TABLE[collective].blocked:
        per_rank_limit //= world  # the larger buffer is world blocks
    count = min(rng.choices(COUNTS, COUNT_WEIGHTS)[0], max(1, per_rank_limit))
    nbytes = count * _dtype(dtype).itemsize * world
    return Call(collective, count, dtype,
                op=rng.choice(OPS) if collective in REDUCING else "sum",
                root=rng.randrange(world) if collective in ROOTED else 0,
                algorithm=_algorithm(rng, auto) if collective == "allreduce" else None,
                segment=rng.choice(_segments(nbytes)))


def _algorithm(rng: random.Random, auto: float | None) -> str | None:
    """An allreduce's forced algorithm, or None for the communicator's own choice (the
    shared board's one-shot or two-shot where the group has one): with probability
    ``auto``, or as one of the algorithms alike when ``auto`` is None."""
    if auto is None:
        return rng.choice((None, *ALGORITHMS))
    return None if rng.random() < auto else rng.choice(ALGORITHMS)


def _segments(nbytes: int) -> list[int]:
    """Segment sizes that cut ``nbytes`` into at most a few hundred messages: more is only
    slower, not a different case."""
    return [s for s in SEGMENTS if nbytes // s <= MAX_MESSAGES] or [SEGMENTS[-1]]


def _variant(rng: random.Random, call: Call, field: str, world: int,
             same_size: float = 0.0) -> Call | None:
    """``call`` with ``field`` changed, or None where the field means nothing for it. A
    dtype changes to one of the same size with probability ``same_size``: then only the
    header's dtype tells the ranks apart, not the size of what they send."""
    if field == "count":
        return replace(call, count=call.count + rng.choice((1, 2, 3, -1)) if call.count > 1
                       else call.count + rng.choice((1, 2, 3)))
    if field == "dtype":
        others = [d for d in DTYPES if d != call.dtype]
        if same_size and rng.random() < same_size:
            others = [d for d in others if _dtype(d).itemsize == _dtype(call.dtype).itemsize]
        return replace(call, dtype=rng.choice(others))
    if field == "op":
        if call.collective not in REDUCING:
            return None
        return replace(call, op=rng.choice([o for o in OPS if o != call.op]))
    if field == "root":
        if call.collective not in ROOTED or world < 2:
            return None
        return replace(call, root=rng.choice([r for r in range(world) if r != call.root]))
    if field == "collective":
        other = rng.choice([c for c in COLLECTIVES if c != call.collective])
        return replace(call, collective=other,
                       op=call.op if other in REDUCING else "sum",
                       root=call.root if other in ROOTED else 0,
                       algorithm=call.algorithm if other == "allreduce" else None)
    if field == "algorithm":
        if call.collective != "allreduce":
            return None
        choices = [a for a in ALGORITHMS if a != call.algorithm]
        return replace(call, algorithm=rng.choice(choices))
    if field == "segment":
        nbytes = call.count * _dtype(call.dtype).itemsize * world
        others = [s for s in _segments(nbytes) if s != call.segment]
        return replace(call, segment=rng.choice(others)) if others else None
    raise ValueError(field)


def cases(seed: int, n: int, *, worlds: tuple[int, ...] = (2, 3, 4, 5),
          max_bytes: int = MAX_BYTES, controls: float = 0.2,
          auto: float | None = None, collectives: tuple[str, ...] = COLLECTIVES,
          same_size: float = 0.0) -> list[Case]:
    """``n`` cases from ``seed``: about ``controls`` of them controls, the rest disagreements
    in one field between two or more groups of ranks. ``auto``: the share of allreduces
    that leave the algorithm to the communicator (by default one in six, like each forced
    algorithm); ``collectives``: what an op is drawn from (one that stands in it more than
    once is drawn more often); ``same_size``: the share of dtype disagreements between
    dtypes of one size."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        world = rng.choice(worlds)
        base = _base_call(rng, world, max_bytes, auto, collectives)
        if rng.random() < controls:
            out.append(Case(seed, len(out), world, None, (base,) * world))
            continue
        field = rng.choice(FIELDS)
        other = _variant(rng, base, field, world, same_size)
        if other is None or other == base:
            continue
        odd = rng.sample(range(world), rng.randint(1, world - 1))  # both groups non-empty
        calls = tuple(other if r in odd else base for r in range(world))
        out.append(Case(seed, len(out), world, field, calls))
    return out


# --------------------------------------------------------------------------- one rank's part


def data(rank: int, count: int, dtype: str, salt: int = 0) -> np.ndarray:
    """Values in -2..2: sums and products over a few ranks are exact in every dtype.
    Element ``k`` is ``(7 k + 13 rank + 3 salt) % 5 - 2``, which repeats every five
    elements: each of the five is written into its every fifth place (every case's ranks
    make these several times over, megabytes of them in the large cases)."""
    values = np.empty(count, _dtype(dtype))
    for k in range(min(count, 5)):
        values[k::5] = (k * 7 + rank * 13 + salt * 3) % 5 - 2
    return values


def contribution(call: Call, rank: int, world: int) -> np.ndarray | None:
    """What ``rank`` contributes to ``call``: its buffer of the collective's source role
    (a scatter's root holds one made for each rank; the other ranks hold none)."""
    spec, n, dt = TABLE[call.collective], call.count, call.dtype
    if call.collective == "scatter":
        return np.concatenate([data(100 + r, n, dt) for r in range(world)]) \
            if rank == call.root else None
    return data(rank, spec.sizes(n, world)[spec.source], dt)


def expected(call: Call, rank: int, world: int) -> np.ndarray | None:
    """What ``call`` must leave on ``rank`` if every rank made the same call."""
    everyone = [contribution(call, r, world) for r in range(world)]
    return TABLE[call.collective].reference(everyone, call.op, call.root)[rank]


def run_call(comm: Any, call: Call) -> np.ndarray | None:
    """Make ``call`` on ``comm`` (whose segment size the caller has set) and return the
    output it produced."""
    rank, world, n, dt = comm.rank, comm.world_size, call.count, call.dtype
    c = call.collective
    x = contribution(call, rank, world)
    if c == "allreduce":
        comm.allreduce(x, call.op, algorithm=call.algorithm)
        return x
    if c == "broadcast":
        comm.broadcast(x, root=call.root)
        return x
    if c == "reduce":
        comm.reduce(x, root=call.root, op=call.op)
        return x
    if c == "allgather":
        out = np.empty(n * world, _dtype(dt))
        comm.allgather(out, x)
        return out
    if c == "reduce_scatter":
        out = np.empty(n, _dtype(dt))
        comm.reduce_scatter(out, x, call.op)
        return out
    if c == "gather":
        out = np.empty(n * world, _dtype(dt)) if rank == call.root else None
        comm.gather(out, x, root=call.root)
        return out
    if c == "scatter":
        out = np.empty(n, _dtype(dt))
        comm.scatter(out, x, root=call.root)
        return out
    if c == "alltoall":
        out = np.empty(n * world, _dtype(dt))
        comm.alltoall(out, x)
        return out
    raise ValueError(c)


def play(comm: Any, call: Call) -> dict:
    """Run ``call``, then an all-to-all, then a barrier. The report says whether the op
    returned an output that is right for this rank's own call (and a digest of it, to
    compare ranks), and where the first error came: in the op, in the all-to-all after it
    (every pair exchanges there, so a message left over on any pair is found), or in the
    barrier (which no rank leaves while another has failed: a rank whose part of the op
    the disagreement did not touch returns its right result, and hears of the failure at
    its next op)."""
    start = time.monotonic()
    report: dict[str, Any] = {"returned": False, "right": None, "digest": None,
                              "error": None, "in": None, "elapsed": 0.0}
    try:
        out = run_call(comm, call)
        want = expected(call, comm.rank, comm.world_size)
        report["returned"] = True
        report["right"] = (want is None) == (out is None) and (
            want is None or out.tobytes() == want.tobytes())
        report["digest"] = None if out is None else hashlib.sha1(out.tobytes()).hexdigest()
        report["in"] = "follow-up"
        got = np.empty(comm.world_size, np.float64)
        comm.alltoall(got, np.full(comm.world_size, float(comm.rank)))
        assert (got == np.arange(comm.world_size)).all(), got
        report["in"] = "barrier"
        comm.barrier()
        report["in"] = None
    except CommError as err:
        report["error"] = err
        report["in"] = report["in"] or "op"
    report["elapsed"] = time.monotonic() - start
    return report


def judge(case: Case, reports: list[dict], *, timeout: float, margin: float) -> list[str]:
    """Every broken rule, in words (empty when the case passed)."""
    problems = []
    for rank, (call, rep) in enumerate(zip(case.calls, reports, strict=True)):
        err = rep["error"]
        if err is not None and not isinstance(err, CommError):
            problems.append(f"rank {rank}: untyped error {err!r}")
        if rep["returned"] and not rep["right"]:
            problems.append(f"rank {rank}: returned a wrong output from {call.describe()}")
        if case.field is None and err is not None:
            problems.append(f"rank {rank}: error although the ranks agree: {err}")
        if case.field is not None and err is None:
            problems.append(f"rank {rank}: no error although the ranks disagree in "
                            f"{case.field}")
        if case.field is not None and rep["in"] != "op" and not rep["right"]:
            problems.append(f"rank {rank}: finished {call.describe()} with a wrong output")
        if err is not None and rep["elapsed"] > timeout + margin:
            problems.append(f"rank {rank}: its error took {rep['elapsed']:.1f} s "
                            f"(timeout {timeout} s): {err}")
    reduced = case.field is None and case.calls[0].collective == "allreduce"
    if reduced and len({rep["digest"] for rep in reports}) != 1:
        problems.append("the reduced results differ between ranks")
    return problems
