"""The soak: seeded random faults in random ops over real rank processes, counted.

Each trial draws a world size (2-4), an op (a collective on a chosen engine and algorithm, or
point-to-point sends around the ring), a size, a fault (kill, delay below or above the
timeout, drop, corrupt with checksums on), the rank that acts and which of its outgoing
messages, and runs it on a pool of long-lived rank processes (``fault_harness.RankPool``).
What every rank saw is counted by type, and ``fault_harness.judge`` says whether it was what
the issue promises. Trial ``i`` of seed ``s`` is the same wherever it runs, so a bad one is
re-run alone with ``--seed s --only i``.

    python tests/fault_soak.py --trials 300            # what ``make soak`` runs
    python tests/fault_soak.py --seed 7 --only 41 -v   # one trial again, every rank's report
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from fault_harness import ACTIONS, KIB, P2P, Case, Op, Outcome, RankPool, judge

WORLD_SIZES = (2, 3, 4)
ALGORITHMS = ("ring", "tree", "hd", "rd")
# op kind -> the blocks (elements of float32) a trial draws from
SIZES = {
    "allreduce/board": (1, 7, 300, 16 * KIB, 200 * KIB),  # one-shot; two-shot above 512 KiB
    "allreduce/links": (1, 5, 3000, 12 * KIB, 40 * KIB),
    "broadcast": (1, 100, 16 * KIB, 24 * KIB),  # the board or a tree; a chain above 64 KiB
    "allgather": (1, 100, 24 * KIB),
    "reduce_scatter": (1, 5, 8 * KIB),
    "alltoall": (1, 5, 8 * KIB),
    "barrier": (0,),
    "send/recv": (1, 100, 12 * KIB),
}
OUTCOMES = ("ok", "CommTimeout", "DesyncError", "RemoteError", "PeerLostError",
            "ChecksumError", "killed", "other")


def draw_op(rng: random.Random) -> Op:
    kind = rng.choice(sorted(SIZES))
    block = rng.choice(SIZES[kind])
    if kind == "allreduce/board":
        return Op(kind, "allreduce", block)
    if kind == "allreduce/links":
        algorithm = rng.choice(ALGORITHMS)
        return Op(f"allreduce/{algorithm}", "allreduce", block, algorithm=algorithm,
                  board=False)
    board = rng.random() < 0.5  # the board where it is chosen, else over links
    collective = P2P if kind == "send/recv" else kind
    label = kind + ("" if board or collective == P2P else " (no board)")
    return Op(label, collective, block, board=board or collective == P2P)


def draw(seed: int, index: int, world_sizes: tuple[int, ...] = WORLD_SIZES) -> Case:
    """Trial ``index`` of ``seed``: the same case wherever and whenever it is drawn."""
    rng = random.Random(f"{seed}/{index}")
    world = rng.choice(world_sizes)
    op = draw_op(rng)
    if op.collective == "broadcast":
        op = Op(op.label, op.collective, op.block, board=op.board, root=rng.randrange(world))
    senders = [r for r in range(world) if op.messages(r, world) > 0]
    actor = rng.choice(senders)
    return Case(world, op, rng.choice(ACTIONS), actor,
                rng.randrange(op.messages(actor, world)))


@dataclass
class Summary:
    """Counts over trials, by action: trials, and every rank's outcome by type."""

    seed: int
    trials: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    hangs: int = 0
    crashes: int = 0
    wrong: int = 0
    unexpected: list[tuple[int, Outcome, list[str]]] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, index: int, outcome: Outcome) -> None:
        case = outcome.case
        self.trials[case.action] += 1
        counts = self.outcomes.setdefault(case.action, Counter())
        for r, report in enumerate(outcome.ranks):
            status = report["status"]
            if status == "died" and case.action == "kill" and r == case.actor:
                counts["killed"] += 1
            elif status == "error":
                counts[report["type"] if report["type"] in OUTCOMES else "other"] += 1
            elif status == "ok":
                counts["ok"] += 1
            elif status == "hang":
                self.hangs += 1
            elif status == "wrong":
                self.wrong += 1
            else:  # died, crash, setup: a survivor that did not survive
                self.crashes += 1
        problems = judge(outcome)
        if problems:
            self.unexpected.append((index, outcome, problems))

    @property
    def total(self) -> int:
        return sum(self.trials.values())

    def table(self) -> str:
        """The counts as a markdown table, with the totals and the seed."""
        head = ["action", "trials", *(f"{o}" for o in OUTCOMES)]
        rows = [head, ["---"] * len(head)]
        for action in ACTIONS:
            counts = self.outcomes.get(action, Counter())
            rows.append([action, str(self.trials[action]),
                         *(str(counts[o]) for o in OUTCOMES)])
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        lines.append("")
        lines.append(f"seed {self.seed}: {self.total} trials in {self.seconds:.0f} s; "
                     f"hangs {self.hangs}, crashes of survivors {self.crashes}, wrong results "
                     f"returned without an error {self.wrong}, trials not as expected "
                     f"{len(self.unexpected)} (outcomes are counted per rank)")
        return "\n".join(lines)


def soak(seed: int, trials: int, *, only: int | None = None,
         world_sizes: tuple[int, ...] = WORLD_SIZES,
         progress: Callable[[int, Outcome], None] | None = None) -> Summary:
    """Run ``trials`` trials of ``seed`` (or trial ``only`` alone) and count them."""
    summary = Summary(seed)
    start = time.monotonic()
    indexes = [only] if only is not None else list(range(trials))
    with RankPool(max(world_sizes)) as pool:
        for i in indexes:
            outcome = pool.run(draw(seed, i, world_sizes))
            summary.add(i, outcome)
            if progress is not None:
                progress(i, outcome)
    summary.seconds = time.monotonic() - start
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--seed", type=int, default=None,
                        help="the trials' seed (default: drawn, and printed)")
    parser.add_argument("--only", type=int, default=None, help="run only trial ONLY")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print every trial and every rank's report")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
    print(f"soak: seed {seed}, {1 if args.only is not None else args.trials} trials",
          flush=True)

    def progress(i: int, outcome: Outcome) -> None:
        problems = judge(outcome)
        if args.verbose or problems:
            print(f"trial {i}: {outcome.case.describe()} ({outcome.wall:.1f} s)"
                  + "".join(f"\n  ! {p}" for p in problems), flush=True)
            if args.verbose:
                for r, report in enumerate(outcome.ranks):
                    print(f"    rank {r}: {report}", flush=True)
        elif (i + 1) % 25 == 0:
            print(f"  {i + 1} trials", flush=True)

    summary = soak(seed, args.trials, only=args.only, progress=progress)
    print(summary.table())
    for i, outcome, _ in summary.unexpected:
        print(f"again: python tests/fault_soak.py --seed {seed} --only {i} -v"
              f"   # {outcome.case.describe()}")
    bad = summary.hangs or summary.crashes or summary.wrong or summary.unexpected
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
