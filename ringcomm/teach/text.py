"""``ringcomm explain``'s text: round by round, what moved and every rank's buffers after,
then the result checked and the cost priced."""

from __future__ import annotations

import numpy as np

from .costs import LARGE_BYTES
from .explanation import Explanation
from .rounds import Round

UNKNOWN = "."  # an element of an output or scratch buffer no step has written yet


def headline(ex: Explanation) -> str:
    call = ex.call
    where = f"{call.world_size} ranks"
    if call.hosts is not None:
        where += f" on {len(call.hosts)} hosts of {len(call.hosts[0])}"
    what = f"{call.collective} ({call.algorithm}) on {where}, {call.block} elements"
    if call.spec.blocked:
        what += " per block"
    if call.spec.reduces:
        what += f", {call.op}"
    if call.spec.rooted:
        what += f", root {call.root}"
    return what


def render(ex: Explanation) -> str:
    """The whole explanation as plain text."""
    width = value_width(ex)
    lines = [headline(ex),
             "inputs: rank r holds (r + 1) * (i + 1) at element i; "
             f"'{UNKNOWN}' is an element not written yet, '*' one written in this round", ""]
    previous: Round | None = None
    for rnd in ex.rounds:
        lines.append(round_title(rnd, ex))
        for t in rnd.transfers:
            lines.append(f"  {t.describe()}")
        for c in rnd.copies:
            lines.append(f"  rank {c.rank} copies {c.src} into {c.dst}")
        lines += buffer_lines(ex, rnd, previous, width)
        lines.append("")
        previous = rnd
    lines += result_lines(ex)
    lines.append("")
    lines += cost_lines(ex)
    return "\n".join(lines)


def round_title(rnd: Round, ex: Explanation) -> str:
    if rnd.number == 0:
        head = "before the first message"
        if rnd.copies:
            head += " (local copies)"
        return head
    phases = ", ".join(rnd.phases)
    messages = len(rnd.transfers)
    return f"round {rnd.number} of {ex.rounds[-1].number}" + (f" ({phases})" if phases else "") \
        + f": {messages} message{'s' if messages != 1 else ''}"


def value_width(ex: Explanation) -> int:
    biggest = 1
    for rnd in ex.rounds:
        for state in rnd.buffers:
            for role, values in state.items():
                if role in ex.roles and values.size:
                    biggest = max(biggest, len(str(int(np.abs(values).max()))) + 1)
    return biggest


def cells(values: np.ndarray, known: np.ndarray, changed: np.ndarray, width: int) -> str:
    out = []
    for v, k, c in zip(values.tolist(), known.tolist(), changed.tolist(), strict=True):
        text = str(v) if k else UNKNOWN
        out.append(text.rjust(width) + ("*" if c else " "))
    return "".join(out).rstrip()


def buffer_lines(ex: Explanation, rnd: Round, previous: Round | None, width: int) -> list[str]:
    lines = []
    roles = [r for r in ex.roles if any(r in s for s in rnd.buffers)]
    label = max(len(r) for r in roles) if roles else 0
    for rank, state in enumerate(rnd.buffers):
        for i, role in enumerate(r for r in roles if shown(ex, rank, r)):
            head = f"rank {rank}" if i == 0 else ""
            changed = rnd.changed(rank, previous, role)
            lines.append(f"    {head:<8}{role:<{label}}  "
                         f"{cells(state[role], rnd.known[rank][role], changed, width)}")
    return lines


def shown(ex: Explanation, rank: int, role: str) -> bool:
    """Whether ``rank``'s ``role`` buffer is worth a line: it holds one, and scratch only
    where a step of the rank writes it."""
    last = ex.rounds[-1]
    if role not in last.buffers[rank]:
        return False
    return role != "scratch" or bool(last.known[rank][role].any())


def result_lines(ex: Explanation) -> list[str]:
    verdict = "equal" if ex.correct else "DIFFER FROM"
    lines = [f"result: each rank's {ex.call.spec.result} buffer; they {verdict} numpy's "
             f"{ex.call.collective} of the inputs"]
    for rank, result in enumerate(ex.results):
        shown = "(none on this rank)" if result is None else " ".join(map(str, result.tolist()))
        lines.append(f"  rank {rank}: {shown}")
    return lines


def cost_lines(ex: Explanation) -> list[str]:
    c = ex.costs
    p = c.params
    lines = [f"cost: alpha {p.alpha * 1e6:.1f} us a message, beta {p.beta * 1e9:.3f} ns a "
             f"byte moved, gamma {p.gamma * 1e9:.3f} ns a byte reduced ({c.source}); "
             "one core a rank",
             "  sent: " + ", ".join(f"rank {r} {m} message{'s' if m != 1 else ''} "
                                    f"({size(b)})" for r, (m, b) in enumerate(c.per_rank))]
    name_width = max(len(line.name) for line in c.lines)
    small = size(ex.call.block * 8 * (ex.call.world_size if ex.call.spec.blocked else 1))
    lines.append(f"  {'':<{name_width}}  busiest rank sends      predicted time")
    lines.append(f"  {'':<{name_width}}  messages      bytes   at {small:>8}  "
                 f"at {size(LARGE_BYTES)} (float32)")
    for line in c.lines:
        lines.append(f"  {line.name:<{name_width}}  {line.messages:>8}  {size(line.sent_bytes):>9}"
                     f"   {duration(line.time):>11}  {duration(line.large_time):>11}")
    return lines


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{int(nbytes)} B"


def duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"
