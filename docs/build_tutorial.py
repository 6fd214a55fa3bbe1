"""Builds docs/tutorial.md, "Teaching ring allreduce", and its figures from the code.

    python docs/build_tutorial.py            # write docs/tutorial.md and docs/tutorial/*,
                                             # and the README's docs/ring_allreduce.*
    python docs/build_tutorial.py --check    # exit 1, with a diff, where they fall behind
    python docs/build_tutorial.py --record   # run the traced ddp/ job again, then build

Every number, code block and figure of the page is computed here, when it is built: the
arithmetic of averaging gradients (numpy), the rounds of ring and tree allreduce
(``ringcomm.teach.explain``, its text and its SVG), every predicted time (the cost model,
with its default constants, never this machine's profile), the measured sweep
(``bench/results/allreduce.json``, written by ``make bench``) and the DDP timeline
(``bench/results/ddp_trace.json``, written by ``--record``: a real traced run of ``ddp/``
on 2 ranks under torchrun). So the page is reproducible: building it twice gives the same
bytes, and ``--check`` (run by ``tests/test_tutorial.py``) says when the code has moved on.
The timeline PNG depends on matplotlib's version, so ``--check`` only asks that it exists.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringcomm.teach.text import duration, size  # as explain prints them

ROOT = Path(__file__).resolve().parent.parent
PAGE = Path("docs/tutorial.md")
FIGURES = Path("docs/tutorial")
TIMELINE_PNG = FIGURES / "ddp_timeline.png"
README_SVG, README_PAGE = Path("docs/ring_allreduce.svg"), Path("docs/ring_allreduce.html")
SWEEP = Path("bench/results/allreduce.json")
TRACE = Path("bench/results/ddp_trace.json")

MIB = 1 << 20

# ----------------------------------------------------------------------------- formatting


def ms(us: float) -> str:
    return f"{us / 1000:.2f} ms"


def vector(v: np.ndarray) -> str:
    return "[" + ", ".join(f"{x:.6f}" for x in v) + "]"


def table(head: list[str], rows: list[list[str]], right: tuple[int, ...] = ()) -> str:
    align = ["---:" if i in right else "---" for i in range(len(head))]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def code(text: str) -> str:
    return "```text\n" + text.rstrip("\n") + "\n```"


def claim(holds: bool, what: str) -> None:
    """The prose says ``what``; stop the build when the numbers no longer bear it out."""
    if not holds:
        raise SystemExit(f"the tutorial's text no longer holds: {what}; revise "
                         "docs/build_tutorial.py")


WIDTH = 92  # the page's prose is wrapped here; code blocks and tables are left as they are
_ITEM = re.compile(r"(- |\d+\. )")
_CODE_SPAN = re.compile(r"`[^`]*`")
_KEEP = "\0"  # a space inside a code span while wrapping: never a place to break the line


def reflow(page: str) -> str:
    """Wrap every paragraph and list item of ``page`` at ``WIDTH`` columns."""
    out: list[str] = []
    para: list[str] = []
    indent = ""
    fence = False

    def flush() -> None:
        nonlocal para, indent
        if para:
            text = _CODE_SPAN.sub(lambda m: m.group().replace(" ", _KEEP),
                                  " ".join(s.strip() for s in para))
            lines = [line.replace(_KEEP, " ") for line in textwrap.wrap(
                text, WIDTH, subsequent_indent=indent, break_long_words=False,
                break_on_hyphens=False)]
            for line in lines[1:]:  # a wrapped line must not read as markdown syntax
                if _ITEM.match(line.strip()) or line.lstrip().startswith(("#", ">", "|", "+")):
                    raise SystemExit(f"a wrapped line reads as markdown syntax: {line!r}")
            out.extend(lines)
        para, indent = [], ""

    for line in page.split("\n"):
        if line.startswith("```"):
            flush()
            fence = not fence
            out.append(line)
        elif fence:
            out.append(line)
        elif (not line.strip() or line.startswith(("|", "#", "![", "<!--"))
              or (line.startswith("    ") and not para)):
            flush()
            out.append(line)
        else:
            item = _ITEM.match(line)
            if item:
                flush()
                indent = " " * len(item.group(1))
            para.append(line)
    flush()
    return "\n".join(out)


# ----------------------------------------------------------------------------- 1. the math

# f(x) = mean((x W)^3) over a batch x of 2-feature rows: a loss with one "parameter" W.
W = np.array([[0.3], [0.4]])
X = np.array([[1.0, 2.0], [0.5, -1.0], [2.0, 0.0], [-1.0, 1.5], [1.5, 1.0], [0.0, -2.0]])
EQUAL = (2, 2, 2)  # local batch sizes of three ranks
UNEQUAL = (3, 2, 1)


def loss(x: np.ndarray, w: np.ndarray) -> float:
    return float(np.mean((x @ w) ** 3))


def gradient(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """d/dW of mean((x W)^3) = 3/B * sum_i (x_i W)^2 x_i, as a flat vector."""
    return (3 * (x @ w) ** 2 * x).mean(axis=0)


def finite_difference(x: np.ndarray, w: np.ndarray, h: float = 1e-6) -> np.ndarray:
    out = np.zeros(w.size)
    for j in range(w.size):
        step = np.zeros_like(w)
        step.flat[j] = h
        out[j] = (loss(x, w + step) - loss(x, w - step)) / (2 * h)
    return out


@dataclass(frozen=True)
class Split:
    sizes: tuple[int, ...]
    local: list[np.ndarray]  # each rank's gradient of the mean over its own samples
    plain: np.ndarray  # the plain average of the local gradients
    weighted: np.ndarray  # sum of B_i / B times each local gradient


@dataclass(frozen=True)
class Math:
    full: np.ndarray  # the gradient of the mean over the whole batch
    checked: float  # largest difference from a central finite difference
    splits: tuple[Split, Split]  # equal, then unequal local batches


def ddp_math() -> Math:
    """The full-batch gradient, and what ranks holding parts of the batch can make of it."""
    full = gradient(X, W)
    splits = []
    for sizes in (EQUAL, UNEQUAL):
        bounds = np.cumsum((0,) + sizes)
        local = [gradient(X[a:b], W) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        plain = np.mean(local, axis=0)
        weighted = sum(b / len(X) * g for b, g in zip(sizes, local, strict=True))
        splits.append(Split(sizes, local, plain, np.asarray(weighted)))
    checked = float(np.abs(finite_difference(X, W) - full).max())
    return Math(full, checked, (splits[0], splits[1]))


def section_math() -> str:
    m = ddp_math()
    assert m.checked < 1e-8, f"the gradient formula disagrees with finite differences: {m.checked}"
    equal, unequal = m.splits
    rows = [[f"x{i}", f"{r[0]:+.1f}", f"{r[1]:+.1f}", f"{(r @ W)[0]:+.2f}"]
            for i, r in enumerate(X)]

    def split_table(s: Split) -> str:
        out = []
        start = 0
        for rank, (n, g) in enumerate(zip(s.sizes, s.local, strict=True)):
            names = ", ".join(f"x{i}" for i in range(start, start + n))
            out.append([f"rank {rank}", names, f"{n}/{len(X)}", vector(g)])
            start += n
        return table(["rank", "its samples", "B_i / B", "gradient of its local mean"], out)

    def gap(v: np.ndarray) -> str:
        g = float(np.abs(v - m.full).max())
        return "less than 1e-12" if g < 1e-12 else f"{g:.6f}"

    claim(float(np.abs(equal.plain - m.full).max()) < 1e-12
          and float(np.abs(unequal.weighted - m.full).max()) < 1e-12
          and float(np.abs(unequal.plain - m.full).max()) > 1e-3,
          "equal batches: plain average exact; unequal: weighted exact, plain wrong")

    uw = " + ".join(f"{n}/{len(X)} g{i}" for i, n in enumerate(unequal.sizes))
    return f"""## 1. Why averaging local gradients gives the full-batch gradient

Data parallelism keeps one copy of the model on every rank and gives each rank a part of the
batch. The loss of a batch is a mean over its samples, and a gradient is linear: the
gradient of a mean is the mean of the gradients. Split a batch of B samples into local
batches of B_1, ..., B_n samples, let g_i be the gradient of rank i's own mean loss, and

    full-batch gradient = (B_1/B) g_1 + (B_2/B) g_2 + ... + (B_n/B) g_n

When every rank holds B/n samples each weight is 1/n and this is the plain average of the
g_i, which is what an allreduce followed by a division by n computes. When the local batches
differ, only the weighted sum is right.

A small check, in numbers. One parameter W = [[0.3], [0.4]], a batch of {len(X)} samples with 2
features, and the loss f(x) = mean((xW)^3), whose gradient is 3/B sum_i (x_i W)^2 x_i
(it agrees with a finite-difference check to within 1e-8):

{table(["sample", "feature 1", "feature 2", "x W"], rows, right=(1, 2, 3))}

The gradient over the whole batch is **{vector(m.full)}**.

With equal local batches ({", ".join(map(str, equal.sizes))} samples on 3 ranks):

{split_table(equal)}

Their plain average is {vector(equal.plain)}: the full-batch gradient (they differ by
{gap(equal.plain)}, rounding).

With unequal local batches ({", ".join(map(str, unequal.sizes))} samples):

{split_table(unequal)}

- plain average (g0 + g1 + g2) / 3 = {vector(unequal.plain)}: **wrong**, off by up to
  {gap(unequal.plain)};
- weighted {uw} = {vector(unequal.weighted)}: the full-batch gradient (they
  differ by {gap(unequal.weighted)}, rounding).

ringcomm's own DDP (`import ringcomm_ddp as ddp`, from the `ddp/` folder) does the weighted
version with `ddp.DistributedDataParallel(model, average="samples")`: each rank
multiplies its gradients by B_i before the allreduce, the total B travels in the same
allreduce, and the sum is divided by it. Everything else on this page is about the
allreduce itself: how to add up one vector per rank, fast, so every rank gets the sum.
"""


# ----------------------------------------------------------------------------- costs


def cost_params() -> Any:
    from ringcomm.plan.cost import DEFAULT_PARAMS

    return DEFAULT_PARAMS[4]


SOURCE = "the model's default constants for 4 ranks"


def explained(collective: str, algorithm: str | None, world_size: int) -> Any:
    """``ringcomm explain``'s run with the 4-rank defaults, labelled as explain labels its
    defaults where no profile is found (so a quoted printout reads as explain prints it)."""
    from ringcomm.teach import explain
    from ringcomm.teach.costs import DEFAULTS_SOURCE

    return explain(collective, algorithm, world_size, params=cost_params(),
                   source=DEFAULTS_SOURCE)


def explain_defaults(world_size: int) -> Any:
    """The constants ``ringcomm explain -n world_size`` uses where no profile is found."""
    from ringcomm.plan.cost import Profile

    return Profile().for_world(world_size)


def model_time(algorithm: str, world_size: int, nbytes: int) -> Any:
    """The cost model's terms for a float32 allreduce of ``nbytes`` (one core a rank)."""
    from ringcomm.plan.cost import DEFAULT_SEGMENT_BYTES, allreduce_cost

    return allreduce_cost(algorithm, world_size, nbytes // 4, 4, DEFAULT_SEGMENT_BYTES // 4)


def section_intro() -> str:
    p = cost_params()
    return f"""# Teaching ring allreduce

<!-- Generated by docs/build_tutorial.py (make docs): do not edit by hand. -->

This page builds up ring allreduce, the collective at the heart of data-parallel training,
from one requirement: after every backward pass, every rank must hold the gradient of the
whole batch. It is generated by `docs/build_tutorial.py` (`make docs`): every number, every
printout and every figure below is what ringcomm's code prints today, or comes from a run
recorded under `bench/results/`, and `tests/test_tutorial.py` fails when the page falls
behind the code.

Where the page *predicts* a time, it uses ringcomm's cost model (`ringcomm/plan/cost.py`)
with {SOURCE}: a message costs alpha = {p.alpha * 1e6:.1f} us, each byte moved
beta = {p.beta * 1e9:.3f} ns and each byte reduced (added) gamma = {p.gamma * 1e9:.3f} ns,
and each rank has a core of its own. The model replays every rank's schedule step by step,
waits included (`ringcomm tune` fits the three constants on your machine; this page does not
use your profile, so that it reads the same everywhere). Where it *measures*, it says which
run.
"""


def section_allgather() -> str:
    from ringcomm.teach.costs import LARGE_BYTES

    rows = []
    p = cost_params()
    ratios = []
    for n in (2, 4, 8, 16):
        ring_ex, gather_ex = explained("allreduce", "ring", n), explained("allgather", None, n)
        ring, gather = ring_ex.costs.lines[0], gather_ex.costs.lines[0]
        add = (n - 1) * LARGE_BYTES * p.gamma  # adding the n - 1 gathered vectors
        # bytes the busiest rank sends, in vectors: explain's vector is `block` int64s
        ring_n = ring.sent_bytes / (ring_ex.call.block * 8)
        gather_n = gather.sent_bytes / (gather_ex.call.block * 8)
        ratios.append((gather.large_time + add) / ring.large_time)
        rows.append([str(n), f"{ring_n:.2f} N", duration(ring.large_time),
                     f"{gather_n:.2f} N", duration(gather.large_time), duration(add),
                     duration(gather.large_time + add), f"{ratios[-1]:.1f}x"])
    claim(all(r > 1 for r in ratios) and ratios == sorted(ratios),
          "all-gather + add costs more than ring allreduce, the more so the more ranks")
    algorithm = explained("allgather", None, 4).call.algorithm
    p4 = cost_params()
    same = [n for n in (2, 4, 8, 16) if explain_defaults(n) == p4]
    other = [n for n in (2, 4, 8, 16) if explain_defaults(n) != p4]
    claim(4 in same, "explain -n 4 uses the constants of these tables")
    rows_text = " and ".join(f"`-n {n}`" for n in same if n != 4)
    if other:
        q = explain_defaults(other[0])
        claim(all(explain_defaults(n) == q for n in other), "one other set of defaults")
        caveat = (f" For {' and '.join(f'`-n {n}`' for n in other)} explain takes the model's "
                  f"defaults for {other[0]} ranks (alpha = {q.alpha * 1e6:.1f} us, beta = "
                  f"{q.beta * 1e9:.3f} ns, gamma = {q.gamma * 1e9:.3f} ns), where this table "
                  "keeps one set of constants for every row.")
    else:
        caveat = ""
    return f"""## 2. All-gather the gradients? It works, but costs more

The simplest correct scheme: every rank sends its whole gradient to every other rank (an
*all-gather*), and each rank adds up the n vectors it now holds. Every rank gets the same
sum. But each rank receives n - 1 whole vectors of N bytes, keeps n of them in memory and
adds n - 1 of them, and all of that grows with the number of ranks. An allreduce only needs
each rank to end with the *sum*, and ring allreduce (section 4) sends each rank
2(n-1)/n × N bytes: less than 2N, however many ranks there are.

By the cost model, for a gradient of N = {size(LARGE_BYTES)} (float32), ringcomm's ring
allreduce against ringcomm's own all-gather (its {algorithm} algorithm) followed by the local
sum:

{table(["ranks", "ring allreduce sends", "its time", "all-gather sends", "its time",
        "then adding", "all-gather + add", "against ring"], rows,
       right=(1, 2, 3, 4, 5, 6, 7))}

"Sends" is what each rank sends, in vectors of N bytes. The all-gather's time is what
`ringcomm explain --collective allgather -n 4` predicts where no profile is found (with
{rows_text} for those rows); the adding is (n-1) × N × gamma.{caveat}
"""


def section_server() -> str:
    from ringcomm.teach.costs import LARGE_BYTES
    from ringcomm.teach.text import cost_lines

    ex = explained("allreduce", "ring", 4)
    rows = []
    ratios, ring_times = [], []
    for n in (2, 4, 8, 16):
        lines = {line.name: line for line in explained("allreduce", "ring", n).costs.lines}
        ring, server = lines["ring"], lines["parameter server (rank 0)"]
        everyone = lines["everyone to everyone"]
        ratios.append(server.large_time / ring.large_time)
        ring_times.append(ring.large_time)
        rows.append([str(n), duration(ring.large_time), duration(server.large_time),
                     duration(everyone.large_time), f"{ratios[-1]:.1f}x"])
    claim(all(r > 1 for r in ratios) and ratios == sorted(ratios)
          and ring_times[-1] < 2 * ring_times[0],
          "the server falls further behind with more ranks; the ring's time hardly grows")
    tiny = {line.name: line for line in ex.costs.lines}
    ahead = [name for name, line in tiny.items() if line.time < tiny["ring"].time]
    claim(tiny["ring"].messages > max(tiny[name].messages for name in ahead) if ahead else True,
          "the designs ahead of the ring on a tiny vector send fewer messages")
    plain = {"everyone to everyone": "everyone-to-everyone",
             "parameter server (rank 0)": "the parameter server"}
    ahead = [plain.get(name, name) for name in ahead]
    tiny_text = (f"there {' and '.join(ahead)} {'is' if len(ahead) == 1 else 'are'} ahead "
                 f"of the ring, whose {tiny['ring'].messages} messages follow one another"
                 if ahead else "even there the ring keeps up")
    return f"""## 3. A parameter server, and its bottleneck

Another natural design: one rank (the *server*) receives every worker's gradient, adds
them, and sends the sum back to each. Every worker sends N bytes and receives N bytes, which
looks cheap, but the server receives (n-1) × N bytes and sends as many: all the traffic
goes through one rank's link and one rank's core, one message after another, while the
others wait.

`ringcomm explain --algo ring -n 4` ends with the model's view of the three designs, for its
tiny vector (4 int64 elements) and for {size(LARGE_BYTES)}:

{code(chr(10).join(cost_lines(ex)))}

For tiny vectors the number of messages in a row decides (alpha); {tiny_text}. For large
ones the bytes decide
(beta and gamma), and the more ranks, the further the server falls behind ({size(LARGE_BYTES)},
float32):

{table(["ranks", "ring", "parameter server", "everyone to everyone", "server against ring"],
       rows, right=(1, 2, 3, 4))}

The ring's time hardly grows with the number of ranks; the server's grows in proportion to
it, because its one rank moves 2(n-1) × N bytes.
"""


def section_ring(svg_path: str) -> str:
    from ringcomm.teach.text import render

    ex = explained("allreduce", "ring", 4)
    rounds = ex.rounds[-1].number
    phases = {}
    for rnd in ex.rounds:
        for phase in rnd.phases:
            phases[phase] = phases.get(phase, 0) + 1
    assert ex.correct, "ring allreduce's result differs from numpy's"
    messages, nbytes = ex.costs.per_rank[0]
    per_message = nbytes // messages // 8  # int64 elements
    claim(all(m == messages and b == nbytes for m, b in ex.costs.per_rank)
          and per_message * messages * 8 == nbytes, "every rank sends as many equal messages")
    split = ", ".join(f"{count} rounds of {phase}" for phase, count in phases.items())
    return f"""## 4. Ring allreduce: a reduce-scatter, then an all-gather

Put the ranks on a ring, each sending only to its right-hand neighbour, and cut the vector
into n chunks. Then

1. **reduce-scatter**: in each of n - 1 rounds every rank sends one chunk to its neighbour,
   which adds it into its own copy of that chunk and passes the sum on in the next round.
   After n - 1 rounds each rank holds the full sum of one chunk;
2. **all-gather**: in n - 1 more rounds the finished chunks travel once around the ring,
   each copied over the stale one, until every rank holds every summed chunk.

Every round, every link carries one chunk of N / n bytes, all at the same time, so no link
and no rank is a bottleneck: each rank sends 2(n-1) chunks, 2(n-1)/n × N bytes in all.

`ringcomm explain --algo ring -n 4` runs it for real: 4 ranks (threads, over in-memory links,
with the same code that runs between processes), rank r starting with `(r+1)*(i+1)` at
element i, so you can add the sums by eye. Here: {rounds} rounds ({split}); each rank sends
{messages} messages of {per_message} element{"s" if per_message != 1 else ""} each
({size(nbytes)} of int64 in all), and the result is
checked against numpy's sum.

{code(render(ex))}

The same run as a picture (`ringcomm explain --algo ring -n 4 --svg ring.svg`; its legend
says which arrows add into the receiver's buffer and which copy over it):

![ring allreduce on 4 ranks, round by round]({svg_path})

Seen this way, the reduce-scatter half alone is `reduce_scatter`, and the all-gather half
alone is `allgather`: `ringcomm explain --collective reduce_scatter -n 4` and
`--collective allgather` show them on their own.
"""


def section_tree(svg_path: str) -> str:
    from ringcomm.teach.text import render

    p = cost_params()
    ex = explained("allreduce", "tree", 4)
    assert ex.correct, "tree allreduce's result differs from numpy's"
    sizes = [8, 1 << 10, 64 << 10, 1 * MIB, 16 * MIB, 256 * MIB]
    rows = []
    for nbytes in sizes:
        row = [size(nbytes)]
        times = {}
        for algo in ("ring", "tree"):
            c = model_time(algo, 4, nbytes)
            t = c.time(p, 1.0)
            times[algo] = t
            latency = p.alpha * c.critical.messages
            row += [duration(t), f"{c.critical.messages:g} x alpha = {duration(latency)}"]
        row.append(f"{times['tree'] / times['ring']:.2f}")
        rows.append(row)
    scan = [1 << k for k in range(3, 29)]
    ring_from = next(s for s in scan if all(
        model_time("ring", 4, t).time(p, 1.0) < model_time("tree", 4, t).time(p, 1.0)
        for t in scan if t >= s))
    small = {n: (model_time("ring", n, 8).critical.messages,
                 model_time("tree", n, 8).critical.messages) for n in (4, 8, 16)}
    small_text = "; ".join(f"{n} ranks: {r:g} against {t:g}" for n, (r, t) in small.items())
    claim(float(rows[0][-1]) < 1 < float(rows[-1][-1]),
          "the tree wins on the smallest size, the ring on the largest")
    claim(model_time("ring", 2, 8).critical.messages == model_time("tree", 2, 8).critical.messages,
          "with 2 ranks ring and tree send as many messages for a tiny vector")
    busiest = max(range(len(ex.costs.per_rank)), key=lambda r: ex.costs.per_rank[r][1])
    vectors = ex.costs.per_rank[busiest][1] / (ex.call.block * 8)
    return f"""## 5. Tree against ring

A ring pays for its fair share of bytes with many messages in a row: 2(n-1) rounds, each
costing at least one message's alpha. A *tree* allreduce (reduce up a binary tree to a root,
then broadcast back down) needs only about 2 log2(n) rounds, but every message carries the
whole vector, and a rank in the middle of the tree receives from its children and sends to
them: below, rank {busiest} sends {vectors:g} whole vectors, where a ring rank sends less than 2.

`ringcomm explain --algo tree -n 4`:

{code(render(ex))}

![tree allreduce on 4 ranks, round by round]({svg_path})

### By the cost model

Predicted float32 allreduce times on 4 ranks, with the part of each time that is the
*latency term* (alpha times the messages on the slowest rank's path, waits included); the
rest is the *bandwidth term* (beta per byte moved, gamma per byte reduced):

{table(["size", "ring", "ring: latency term", "tree", "tree: latency term", "tree / ring"],
       rows, right=(1, 2, 3, 4, 5))}

Small vectors are all latency, and the tree's shorter path wins; large ones are all
bandwidth, and the ring, which moves each byte fewer times, wins. In this model the ring is
faster from {size(ring_from)} up. The gap in messages widens with the number of ranks (messages
in a row for 8 bytes, ring against tree: {small_text}), which is why libraries switch
algorithm by size and world size; ringcomm's selector asks this same model for each call.
"""


def section_sweep() -> str:
    data = json.loads((ROOT / SWEEP).read_text())
    rows_by = {(r["backend"], r["world_size"], r["bytes"]): r for r in data["rows"]}
    machine = data["machine"]
    sizes = [8, 1 << 10, 64 << 10, 1 * MIB, 16 * MIB, 256 * MIB]
    parts = []
    for world in data["settings"]["world_sizes"]:
        rows = []
        for nbytes in sizes:
            ring = rows_by[("ringcomm:ring", world, nbytes)]
            tree = rows_by[("ringcomm:tree", world, nbytes)]
            gloo = rows_by.get(("gloo", world, nbytes))
            rows.append([size(nbytes), f"{ring['time_us']:.1f}", f"{tree['time_us']:.1f}",
                         f"{tree['time_us'] / ring['time_us']:.2f}",
                         f"{gloo['time_us']:.1f}" if gloo else "-"])
        parts.append(f"{world} ranks:\n\n" + table(
            ["size", "ring (us)", "tree (us)", "tree / ring", "gloo (us)"], rows,
            right=(1, 2, 3, 4)))
    world = max(data["settings"]["world_sizes"])
    every = data["settings"]["sizes"]

    def crossover(key: str) -> int:
        return next(s for s in every if all(
            rows_by[("ringcomm:ring", world, t)][key] < rows_by[("ringcomm:tree", world, t)][key]
            for t in every if t >= s))

    measured = crossover("time_us")
    below = [s for s in every if s < measured]
    tree_won = sum(rows_by[("ringcomm:tree", world, s)]["time_us"]
                   < rows_by[("ringcomm:ring", world, s)]["time_us"] for s in below)
    predicted = crossover("predicted_us")
    shared = world > machine["cpus"]
    cores = (f"its {world} ranks shared {machine['cpus']} cores" if shared
             else f"each of its {world} ranks had a core")
    return f"""### By a measured sweep

`make bench` runs

```sh
{data["command"]}
```

and records every time in `{SWEEP.as_posix()}` (median of {data["settings"]["reps"]}
repetitions; a machine with {machine["cpus"]} cores, torch {machine["torch"]}, ringcomm at
commit {machine["git_commit"]}). Its allreduce times with the ring and the tree forced, and
gloo's for scale:

{(chr(10) * 2).join(parts)}

With 2 ranks a tree and a ring are the same exchange for small vectors, and the ring's
pipelined chunks win for large ones. With {world} ranks the tree was faster at {tree_won} of
the {len(below)} sizes below {size(measured)}, and the ring at every size from {size(measured)}
up. The crossover differs from the model's above because in this run {cores}: while a
tree's leaves wait they leave their core to others, which the model run alongside the sweep
knew (it put the crossover at {size(predicted)}). The whole sweep, with every algorithm and
the automatic choice, is plotted in `bench/results/plots/`; [benchmarks.md](benchmarks.md)
has its tables.
"""


# ----------------------------------------------------------------------------- 6. DDP

JOB = {"world_size": 2, "layers": 6, "width": 384, "batch": 16, "bucket_cap_mb": 1.0,
       "first_bucket_mb": 0.5, "steps": 10, "kept": 3}
COMPUTE_TRACK = 10  # the tid of the training spans added to the merged timeline
FINISHING = "finishing (last allreduce, averaging)"  # last gradient -> averaged param.grad


def ddp_job(folder: str) -> None:
    """One rank of the recorded job (run under torchrun with RINGCOMM_TRACE=folder)."""
    from time import perf_counter

    import torch
    import torch.distributed as dist
    from torch import nn

    import ringcomm  # noqa: F401 - registers the backend
    import ringcomm_ddp as ddp

    dist.init_process_group("ringcomm")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(JOB["layers"]):
        layers += [nn.Linear(JOB["width"], JOB["width"]), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(JOB["width"], 1))
    model = ddp.DistributedDataParallel(net, bucket_cap_mb=JOB["bucket_cap_mb"],
                                        first_bucket_mb=JOB["first_bucket_mb"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batch = JOB["batch"]
    steps = []
    for _ in range(JOB["steps"]):
        x = torch.randn(batch * world, JOB["width"], generator=g)[rank * batch:(rank + 1) * batch]
        y = x.sum(dim=1, keepdim=True)
        t0 = perf_counter()
        out = nn.functional.mse_loss(model(x), y)
        t1 = perf_counter()
        opt.zero_grad()
        t2 = perf_counter()
        out.backward()
        t3 = perf_counter()
        record = model.reducer.last_step
        assert record is not None
        opt.step()
        t4 = perf_counter()
        steps.append({"forward": [t0, t1], "backward": [t2, record.ready_times[-1]],
                      "finish": record.finish_time, "returned": t3, "optimizer": [t3, t4],
                      "launch_order": record.launch_order})
    layout = model.reducer.layout
    params = list(model.module.parameters())
    bucket_bytes = [sum(params[i].numel() * params[i].element_size() for i in b) for b in layout]
    Path(folder, f"compute{rank}.json").write_text(json.dumps(
        {"rank": rank, "steps": steps, "layout": layout, "bucket_bytes": bucket_bytes,
         "torch": torch.__version__, "rebuilds": model.reducer.rebuilds}))
    dist.destroy_process_group()


def record() -> Path:
    """Run the traced job on 2 ranks and keep its last steps in ``TRACE``."""
    from ringcomm.observe.merge import merge, read_rank_files

    with tempfile.TemporaryDirectory() as tmp:
        traces = Path(tmp, "traces")
        traces.mkdir()
        env = dict(os.environ, RINGCOMM_TRACE=str(traces), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(JOB["world_size"]), str(Path(__file__)),
                        "--ddp-job", str(traces)], check=True, env=env, cwd=ROOT, timeout=600)
        merged = merge(read_rank_files(traces))
        computes = [json.loads(Path(traces, f"compute{r}.json").read_text())
                    for r in range(JOB["world_size"])]
    trace = merged.trace
    kept = range(JOB["steps"] - JOB["kept"], JOB["steps"])
    extra: list[dict[str, Any]] = []
    for c in computes:
        rank, offset = c["rank"], merged.offsets_us[c["rank"]]
        extra.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMPUTE_TRACK,
                      "args": {"name": "training (forward, backward, optimizer)"}})
        extra.append({"ph": "M", "name": "thread_sort_index", "pid": rank,
                      "tid": COMPUTE_TRACK, "args": {"sort_index": 0}})

        def span(name: str, start: float, end: float, args: dict[str, Any],
                 rank: int = rank, offset: float = offset) -> None:
            ts = start * 1e6 + offset
            extra.append({"ph": "X", "name": name, "cat": "compute", "pid": rank,
                          "tid": COMPUTE_TRACK, "ts": round(ts, 3),
                          "dur": round(max(end * 1e6 + offset - ts, 0.0), 3), "args": args})

        for k in kept:
            s = c["steps"][k]
            span("forward", *s["forward"], {"step": k})
            span("backward", *s["backward"], {"step": k, "launch_order": s["launch_order"]})
            span(FINISHING, s["backward"][1], s["finish"], {"step": k})
            span("optimizer step", *s["optimizer"], {"step": k})
    lo = min(e["ts"] for e in extra if "ts" in e)
    hi = max(e["ts"] + e["dur"] for e in extra if "ts" in e)
    events = []
    for e in trace["traceEvents"] + extra:
        if "ts" in e:
            if e["ts"] < lo or e["ts"] + e.get("dur", 0) > hi:
                continue
            e = dict(e, ts=round(e["ts"] - lo, 3))
        events.append(e)
    used = {(e["pid"], e["tid"]) for e in events if "ts" in e}
    events = [e for e in events if e["ph"] != "M" or e["name"] in ("process_name",
              "process_sort_index") or (e["pid"], e["tid"]) in used]
    first = computes[0]
    trace["traceEvents"] = events
    trace["otherData"]["recorded"] = {
        "command": "python docs/build_tutorial.py --record", "job": JOB,
        "steps_kept": list(kept), "cpus": os.cpu_count(), "torch": first["torch"],
        "layout": first["layout"], "bucket_bytes": first["bucket_bytes"],
        "rebuilds": first["rebuilds"], "time_origin_us": "the first kept forward pass"}
    out = ROOT / TRACE
    out.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
    return out


@dataclass(frozen=True)
class StepView:
    rank: int
    step: int
    forward: tuple[float, float]
    backward: tuple[float, float]  # until the last gradient was ready
    finish: float  # averaged gradients written
    optimizer: tuple[float, float]
    ops: list[tuple[float, float, int]]  # the step's allreduces: start, end, bucket

    @property
    def allreduce_us(self) -> float:
        return sum(b - a for a, b, _ in self.ops)

    @property
    def overlapped_us(self) -> float:
        lo, hi = self.backward
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b, _ in self.ops)

    @property
    def after_us(self) -> float:
        """Allreduce time after backward's last gradient."""
        hi = self.backward[1]
        return sum(max(0.0, b - max(a, hi)) for a, b, _ in self.ops)

    @property
    def finishing_us(self) -> float:
        """From the last gradient to every ``param.grad`` averaged."""
        return self.finish - self.backward[1]


def step_views(trace: dict[str, Any]) -> list[StepView]:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    views = []
    ranks = trace["otherData"]["ranks"]
    for rank in ranks:
        mine = [e for e in events if e["pid"] == rank]
        compute = [e for e in mine if e["cat"] == "compute"]
        ops = sorted((e for e in mine if e["cat"] == "op"
                      and e["args"].get("collective") == "allreduce"), key=lambda e: e["ts"])
        for bwd in (e for e in compute if e["name"] == "backward"):
            k = bwd["args"]["step"]

            def find(name: str, k: int = k, compute: list[Any] = compute
                     ) -> tuple[float, float]:
                e = next(e for e in compute if e["name"] == name and e["args"]["step"] == k)
                return e["ts"], e["ts"] + e["dur"]

            wait = find(FINISHING)
            start = bwd["ts"]
            mine_ops = [e for e in ops if start <= e["ts"] <= wait[1]]
            order = bwd["args"]["launch_order"]
            labels = order if len(order) == len(mine_ops) else [-1] * len(mine_ops)
            views.append(StepView(
                rank, k, find("forward"), (start, start + bwd["dur"]), wait[1],
                find("optimizer step"),
                [(e["ts"], e["ts"] + e["dur"], b) for e, b in zip(mine_ops, labels,
                                                                  strict=True)]))
    return views


def plot_timeline(trace: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    views = step_views(trace)
    ranks = sorted({v.rank for v in views})
    colours = {"forward": "#4C72B0", "backward": "#DD8452", FINISHING: "#B0B0B0",
               "optimizer step": "#55A868", "allreduce": "#8172B2"}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.9 * len(ranks) * 2))
    labels = []
    for i, rank in enumerate(ranks):
        train, comm = 2 * i, 2 * i + 1
        labels += [f"rank {rank}: training", f"rank {rank}: allreduce (ringcomm)"]
        for v in (v for v in views if v.rank == rank):
            for name, (a, b) in (("forward", v.forward), ("backward", v.backward),
                                 (FINISHING, (v.backward[1], v.finish)),
                                 ("optimizer step", v.optimizer)):
                ax.broken_barh([(a / 1000, (b - a) / 1000)], (train - 0.35, 0.7),
                               facecolors=colours[name], edgecolor="none")
            for a, b, bucket in v.ops:
                ax.broken_barh([(a / 1000, (b - a) / 1000)], (comm - 0.35, 0.7),
                               facecolors=colours["allreduce"], edgecolor="white",
                               linewidth=0.5)
                if bucket >= 0:
                    ax.text((a + b) / 2000, comm + 0.5, f"b{bucket}", ha="center",
                            va="bottom", fontsize=7)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms, rank 0's clock, from the first forward pass shown)")
    ax.set_title(f"ddp/ on {len(ranks)} ranks: {len({v.step for v in views})} training steps, "
                 "each bucket's allreduce (b0, b1, ...) while backward still runs")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colours.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8,
              frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def section_ddp(png_path: str) -> str:
    trace = json.loads((ROOT / TRACE).read_text())
    rec = trace["otherData"]["recorded"]
    job = rec["job"]
    views = step_views(trace)
    rows = []
    for v in views:
        rows.append([str(v.rank), str(v.step), ms(v.backward[1] - v.backward[0]),
                     f"{len(v.ops)} ({ms(v.allreduce_us)})", ms(v.overlapped_us),
                     ms(v.after_us), ms(v.finishing_us)])
    total = sum(v.allreduce_us for v in views)
    overlapped = sum(v.overlapped_us for v in views)
    after = sum(v.after_us for v in views)
    finishing = sum(v.finishing_us for v in views)
    claim(all(v.ops and v.ops[0][1] < v.backward[1] for v in views),
          "in every step shown the first bucket's allreduce ended before backward did")
    buckets = ", ".join(size(b) for b in rec["bucket_bytes"])
    ran = sorted({(e["args"]["engine"], e["args"]["algorithm"]) for e in trace["traceEvents"]
                  if e.get("cat") == "op"})
    ran_text = " and ".join(f"its `{engine}` engine, algorithm {algorithm}"
                            for engine, algorithm in ran)
    params = job["layers"] * (job["width"] ** 2 + job["width"]) + job["width"] + 1
    clock = trace["otherData"]["clock"]
    error = max((c["error_us"] for c in clock.values() if c["error_us"] is not None),
                default=None)
    aligned = (f" (the merge put both ranks on rank 0's clock to within {error:.1f} us)"
               if error is not None else "")
    return f"""## 6. DDP: buckets, and overlapping backward

A training step cannot allreduce the gradients before backward has computed them, but it
need not wait for *all* of them: backward runs the model from the last layer to the first,
so the last layer's gradients are final long before the first layer's. DDP (here ringcomm's
own, `ringcomm_ddp`) groups the gradients into *buckets* of about `bucket_cap_mb` each, in the order
backward produces them, and launches an asynchronous allreduce of a bucket as soon as its
last gradient is in, while backward goes on computing the rest. One allreduce per parameter
would pay alpha hundreds of times a step; one for the whole model could only start at the
end. Buckets sit in between. (And as section 1 showed, what the allreduce sums must be
weighted when the local batches differ: `average="samples"`.)

A real run, recorded by `python docs/build_tutorial.py --record`: {job["world_size"]} ranks under
torchrun on a machine with {rec["cpus"]} cores, each training an MLP of {job["layers"]} hidden
layers of {job["width"]} ({params:,} float32 parameters) on {job["batch"]} samples a step, with
`bucket_cap_mb={job["bucket_cap_mb"]}` and `first_bucket_mb={job["first_bucket_mb"]}`:
{len(rec["bucket_bytes"])} buckets of {buckets}, traced with `RINGCOMM_TRACE` and merged
with `ringcomm trace merge`{aligned}. The last {len(rec["steps_kept"])} of
{job["steps"]} steps are kept in `{TRACE.as_posix()}` (open it in
[Perfetto](https://ui.perfetto.dev), or `ringcomm trace plot` it to see every step of every
allreduce); the training spans in it are the job's own `time.perf_counter()` readings, on
the same clock:

![a timeline of ddp/ training on 2 ranks]({png_path})

Read it per rank: the top row is the training loop (forward in blue, backward in orange
until its last gradient, then in grey the step's finish: the last bucket's allreduce, and
every bucket divided by the number of ranks and written to `param.grad`; the optimizer in
green), the row under it each bucket's allreduce as ringcomm ran it (on {ran_text}), from
when it started until the sum was in, waiting for the other rank included. In every step the
first bucket's allreduce is over before backward is.

{table(["rank", "step", "backward", "allreduces (in flight)", "during backward",
        "after backward", "finishing"], rows, right=(2, 3, 4, 5, 6))}

Over these steps and ranks the allreduces were in flight for {ms(total)}: {ms(overlapped)} of
it ({overlapped / total:.0%}) while backward was still computing, and only {ms(after)} after
its last gradient. Launched only once backward was over, all of it would have added to the
step. The
finishing took {ms(finishing)} in all: those {ms(after)} of allreduce, and the Reducer's own
work after backward (waiting on each bucket's future, dividing, writing `param.grad`).
(Both ranks share {rec["cpus"]} cores with their communication threads, and each process's
threads take turns at Python's GIL, so on a CPU the overlap is also a contest for cores;
on a GPU the computation and the communication run on different hardware.)
"""


# ----------------------------------------------------------------------------- 7. GPU


def section_gpu() -> str:
    return """## 7. Where the GPU engines fit

Everything above is a *schedule*: a list of steps per rank (send this chunk, receive and add
that one) that ringcomm prints, prices and runs. An *engine* is what carries out a schedule's
steps, and the same schedules run on each:

- `links`: messages between pairs of ranks, over named pipes and shared memory on one host,
  ZeroMQ `tcp://` between hosts (what the sweep's forced ring and tree above use; `explain`
  runs the same engine over in-memory links);
- `board`: one host's shared-memory board, where ranks post their data and read each
  other's: one-shot for small vectors, two-shot (a reduce-scatter and an all-gather again)
  for larger ones (what ran the DDP allreduces above);
- `cuda-ipc`: for GPU memory, ranks on one host; chunks stay on the device, each rank's
  peers read its staging slots directly, and the additions run on the GPU;
- `staged`: for GPU memory between hosts; each chunk goes device -> pinned host memory ->
  the link -> device, double-buffered;
- `nccl`: for GPU memory through NVIDIA's NCCL (asked for with
  `RINGCOMM_DEVICE_ENGINE=nccl`). The same schedules run as NCCL's sends and receives, in
  *group calls*: an NCCL send waits for its peer's receive, so a ring step's send and
  receive must be issued together, and ringcomm gives every message a level both its ends
  share, so that each rank's group l meets its peers' group l. NCCL's own allreduce is one
  more algorithm beside them, priced by the same cost model.

So ring against tree, buckets and overlap work the same way on a GPU; what changes are the
constants (alpha, beta, gamma), and so where the crossovers fall. ringcomm's defaults for
the device engines come from documented figures, not from a run; `ringcomm tune --device
cuda` fits those of `cuda-ipc` and `staged` on a GPU machine (`nccl` keeps its defaults). No
figure of a GPU run is in `bench/results/` yet, so this page shows none; [gpu.md](gpu.md)
explains the device path and how it is tested.
"""


def section_try() -> str:
    return """## Try it

```sh
.venv/bin/ringcomm explain --algo ring -n 4                   # section 4, in your terminal
.venv/bin/ringcomm explain --algo tree -n 8 --svg tree.svg    # more ranks, as a picture
.venv/bin/ringcomm explain --algo ring -n 4 --animate         # round by round
.venv/bin/ringcomm explain --algo ring -n 4 --html ring.html  # an animated page
.venv/bin/ringcomm trace plot bench/results/ddp_trace.json -o ddp.png  # every step of section 6
make docs                                                     # this page, again
```

`ringcomm explain --help` lists the other algorithms (`dbtree`, `hd`, `rd`, and `hier` for
several hosts) and the other collectives.
"""


# ----------------------------------------------------------------------------- building


def build() -> dict[Path, str]:
    """The page and its SVGs, by path relative to the repository."""
    from ringcomm.teach.page import page as explain_page
    from ringcomm.teach.svg import draw

    ring_svg, tree_svg = FIGURES / "ring.svg", FIGURES / "tree.svg"

    def rel(path: Path) -> str:
        return path.relative_to(PAGE.parent).as_posix()

    page = "\n".join([section_intro(), section_math(), section_allgather(), section_server(),
                      section_ring(rel(ring_svg)), section_tree(rel(tree_svg)),
                      section_sweep(), section_ddp(rel(TIMELINE_PNG)), section_gpu(),
                      section_try()])
    ring = explained("allreduce", "ring", 4)
    return {PAGE: reflow(page).rstrip("\n") + "\n",
            ring_svg: draw(ring),
            tree_svg: draw(explained("allreduce", "tree", 4)),
            # the README's picture and the page it links
            README_SVG: draw(ring), README_PAGE: explain_page(ring)}


def write() -> None:
    for path, text in build().items():
        (ROOT / path).parent.mkdir(parents=True, exist_ok=True)
        (ROOT / path).write_text(text)
        print(f"wrote {path.as_posix()}")
    plot_timeline(json.loads((ROOT / TRACE).read_text()), ROOT / TIMELINE_PNG)
    print(f"wrote {TIMELINE_PNG.as_posix()}")


def check() -> list[str]:
    """What differs between the checked-in page and figures and what the code makes now,
    each as a unified diff (empty: all up to date)."""
    problems = []
    for path, text in build().items():
        target = ROOT / path
        if not target.exists():
            problems.append(f"{path.as_posix()} is missing: run make docs")
            continue
        old = target.read_text()
        if old != text:
            diff = difflib.unified_diff(old.splitlines(keepends=True),
                                        text.splitlines(keepends=True),
                                        f"{path.as_posix()} (checked in)",
                                        f"{path.as_posix()} (what the code makes now)")
            problems.append("".join(diff) + f"\n{path.as_posix()} is out of date: run make docs")
    if not (ROOT / TIMELINE_PNG).exists():
        problems.append(f"{TIMELINE_PNG.as_posix()} is missing: run make docs")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="compare with the checked-in files; exit 1 with a diff if they differ")
    mode.add_argument("--record", action="store_true",
                      help=f"run the traced ddp/ job into {TRACE.as_posix()}, then build")
    mode.add_argument("--ddp-job", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # ddp/ and ringcomm/ from this checkout when not installed
    if args.ddp_job:
        ddp_job(args.ddp_job)
        return 0
    if args.check:
        problems = check()
        for problem in problems:
            print(problem)
        return 1 if problems else 0
    if args.record:
        print(f"wrote {record().relative_to(ROOT).as_posix()}")
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
