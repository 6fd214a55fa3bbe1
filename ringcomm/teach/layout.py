"""Where each rank is drawn: the shape an algorithm's messages make.

A ring's ranks sit on a circle; a tree's in levels under its root (the parents read off the
messages that ran, so the drawing is the tree that ran); the double binary tree's in two
such trees side by side, each with its own messages; halving-doubling's and recursive
doubling's on the corners of a hypercube, laid flat so that every exchange runs along
one axis; ``hier``'s in one box per host, leaders on top. Coordinates are in a unit
square; ``svg`` and ``page`` scale them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..schedules.halving_doubling import real_rank
from .explanation import Explanation
from .rounds import Transfer

Point = tuple[float, float]


@dataclass(frozen=True)
class Panel:
    """One drawing of the ranks: ``positions`` by rank, ``phases`` whose messages it shows
    (empty: all), ``boxes`` around groups of ranks (hosts)."""

    title: str
    positions: dict[int, Point]
    phases: str = ""  # the prefix of the phases this panel shows
    boxes: tuple[tuple[str, tuple[int, ...]], ...] = field(default=())


@dataclass(frozen=True)
class Layout:
    """The panels of one drawing; ``aspect`` where the positions keep their proportions (a
    circle, a cube), so a panel drawn wider must be drawn taller too."""

    shape: str
    panels: tuple[Panel, ...]
    aspect: float = 0.0  # height over width to keep; 0: any

    def panel_of(self, transfer: Transfer) -> int:
        for i, panel in enumerate(self.panels):
            if panel.phases and transfer.phase.startswith(panel.phases):
                return i
        return 0


def layout(ex: Explanation) -> Layout:
    call = ex.call
    n = call.world_size
    transfers = [t for r in ex.rounds for t in r.transfers]
    if call.algorithm == "hier" and call.hosts is not None:
        return Layout("two levels", (_hosts(call.hosts),))
    if call.algorithm in ("hd", "rd"):
        cube = _hypercube(n)
        return Layout("hypercube", (Panel("hypercube", _fit(cube)),), aspect(cube))
    if call.algorithm == "dbtree":
        return Layout("two trees", tuple(
            Panel(name, _tree(n, [t for t in transfers if t.phase.startswith(name)]), name)
            for name in ("tree A", "tree B")))
    if call.algorithm in ("tree", "binomial"):
        return Layout("tree", (Panel("tree", _tree(n, transfers)),))
    return Layout("ring", (Panel("ring", _circle(n)),), 1.0)


def _circle(n: int) -> dict[int, Point]:
    if n == 1:
        return {0: (0.5, 0.5)}
    return {r: (0.5 + 0.38 * math.sin(2 * math.pi * r / n),
                0.5 - 0.38 * math.cos(2 * math.pi * r / n)) for r in range(n)}


def _tree(n: int, transfers: list[Transfer]) -> dict[int, Point]:
    """Levels under the root: a message of a reduce phase goes from child to parent, any
    other from parent to child."""
    parent: dict[int, int] = {}
    for t in transfers:
        if "reduce" in t.phase:
            parent.setdefault(t.sender, t.receiver)
        else:
            parent.setdefault(t.receiver, t.sender)
    children: dict[int, list[int]] = {}
    for child, up in parent.items():
        children.setdefault(up, []).append(child)
    roots = [r for r in range(n) if r not in parent]
    depth: dict[int, int] = {}
    x: dict[int, float] = {}
    leaves = [0]

    def place(r: int, d: int) -> None:
        depth[r] = d
        kids = sorted(children.get(r, []))
        for k in kids:
            place(k, d + 1)
        if kids:
            x[r] = sum(x[k] for k in kids) / len(kids)
        else:
            x[r] = leaves[0]
            leaves[0] += 1
    for root in roots:
        place(root, 0)
    levels = max(depth.values(), default=0)
    wide = max(leaves[0] - 1, 1)
    return {r: (0.1 + 0.8 * x[r] / wide if leaves[0] > 1 else 0.5,
                0.12 + 0.76 * depth[r] / levels if levels else 0.5) for r in range(n)}


def _hypercube(n: int) -> dict[int, Point]:
    """The ``p`` ranks that exchange (``p`` the largest power of two up to ``n``) at the
    corners of a hypercube laid flat: bit 0 of a rank's number among them goes across,
    bit 1 down, so pairs of a step are squares; bit 2 moves a square aside and down, so
    two squares make a cube; the next three bits repeat that at a larger scale. A rank
    folded into a partner sits below it."""
    p = 1 << (n.bit_length() - 1)
    axes = [(1.0, 0.0), (0.0, 1.0), (1.5, 0.45)]
    spots: dict[int, Point] = {}
    for v in range(p):
        x = y = 0.0
        for bit in range(p.bit_length() - 1):
            if v >> bit & 1:
                dx, dy = axes[bit % 3]
                scale = 2.2 ** (bit // 3)  # the next cube, beside and below
                x, y = x + dx * scale, y + dy * scale
        spots[real_rank(v, n)] = (x, y)
    for r in range(n):  # folded ranks, below the partner they fold into
        if r not in spots:
            px, py = spots[r - 1]
            spots[r] = (px, py + 0.6)
    return spots


def _fit(spots: dict[int, Point]) -> dict[int, Point]:
    """``spots`` stretched over the unit square, each axis on its own (``aspect`` says how
    tall to draw it)."""
    xs = [x for x, _ in spots.values()]
    ys = [y for _, y in spots.values()]
    wide, tall = max(xs) - min(xs) or 1.0, max(ys) - min(ys) or 1.0
    return {r: (0.08 + 0.84 * (x - min(xs)) / wide, 0.1 + 0.8 * (y - min(ys)) / tall)
            for r, (x, y) in spots.items()}


def aspect(spots: dict[int, Point]) -> float:
    """Height over width of ``spots`` as laid out before ``_fit``."""
    xs = [x for x, _ in spots.values()]
    ys = [y for _, y in spots.values()]
    return (max(ys) - min(ys)) / ((max(xs) - min(xs)) or 1.0) if len(spots) > 1 else 1.0


def _hosts(hosts: tuple[tuple[int, ...], ...]) -> Panel:
    spots: dict[int, Point] = {}
    count = len(hosts)
    for h, ranks in enumerate(hosts):
        cx = (h + 0.5) / count
        for i, r in enumerate(ranks):
            spots[r] = (cx, 0.2 + 0.6 * i / max(len(ranks) - 1, 1) if len(ranks) > 1 else 0.4)
    boxes = tuple((f"host {h}", ranks) for h, ranks in enumerate(hosts))
    return Panel("hosts", spots, boxes=boxes)
