"""``ringcomm explain --svg``: every round as a small picture of the ranks, one arrow per
message, each rank's result buffer written under it.

Built with ``xml.etree`` so the file is well-formed whatever the labels hold. Each message
is one ``<g class="transfer">`` carrying its round, sender and receiver as data attributes
and its description as a tooltip, so a reader (or a test) can count and follow them.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import numpy as np

from .explanation import Explanation
from .layout import Layout, Panel, layout
from .rounds import Round, Transfer
from .text import UNKNOWN, headline, round_title

CELL_W, CELL_H = 280, 240  # one panel of one round, at least
MAX_CELL_W = 1100
MAX_ROW_W = 1400  # rounds side by side up to this width
TITLE_H = 22
CHAR_W = 5.2  # the width of a digit at the values' font size, roughly
NODE_R = 13
REDUCE_COLOUR = "#d95f02"  # a message added into the receiver's buffer
COPY_COLOUR = "#1b7fb3"  # a message copied over it
MAX_SHOWN = 12  # buffer values written under a rank; more are cut with an ellipsis


@dataclass(frozen=True)
class Frame:
    """The drawing's geometry: the ranks' layout and one panel's width, wide enough that
    the values written under ranks side by side do not run into each other."""

    layout: Layout
    panel_w: float
    panel_h: float = CELL_H

    @property
    def cell(self) -> tuple[int, int]:
        """One round's width and height (its panels side by side)."""
        return int(self.panel_w * len(self.layout.panels)), int(self.panel_h + TITLE_H)

    def xy(self, panel: Panel, rank: int) -> tuple[float, float]:
        x, y = panel.positions[rank]
        return 20 + x * (self.panel_w - 40), 18 + y * (self.panel_h - 58)


def frame(ex: Explanation) -> Frame:
    lay = layout(ex)
    widest = max((len(values_text(state[role], rnd.known[r][role])) for rnd in ex.rounds
                  for r, state in enumerate(rnd.buffers) for role in [ex.call.spec.result]
                  if role in state), default=1) * CHAR_W + 8
    need = float(CELL_W)
    for panel in lay.panels:
        spots = list(panel.positions.values())
        for i, (x1, y1) in enumerate(spots):
            for x2, y2 in spots[i + 1:]:
                if abs(y1 - y2) * (CELL_H - 58) < 26 and abs(x1 - x2) > 0.02:
                    need = max(need, widest / abs(x1 - x2) + 40)
    width = min(need, MAX_CELL_W)
    tall = (width - 40) * lay.aspect * 0.85 + 58 if lay.aspect else CELL_H
    return Frame(lay, width, max(CELL_H, tall))


def draw(ex: Explanation, *, columns: int = 3) -> str:
    """The whole run as one SVG document: a legend, then the rounds in a grid."""
    fr = frame(ex)
    rounds = [r for r in ex.rounds if r.transfers or r.number == 0]
    width, height = fr.cell
    per_row = max(1, min(columns, int(MAX_ROW_W // width)))
    rows = math.ceil(len(rounds) / per_row)
    head = 54
    svg = ET.Element("svg", xmlns="http://www.w3.org/2000/svg", width=str(width * per_row),
                     height=str(head + rows * height), viewBox=f"0 0 {width * per_row} "
                     f"{head + rows * height}", attrib={"font-family": "sans-serif"})
    _defs(svg)
    ET.SubElement(svg, "rect", width="100%", height="100%", fill="white")
    _text(svg, 10, 20, headline(ex), size=14, weight="bold")
    legend = ET.SubElement(svg, "g", attrib={"class": "legend"})
    _text(legend, 10, 40, "added into the receiver's buffer", size=11, fill=REDUCE_COLOUR)
    _text(legend, 210, 40, "copied over it", size=11, fill=COPY_COLOUR)
    _text(legend, 310, 40, "under each rank: its result buffer after the round", size=11,
          fill="#555")
    for i, rnd in enumerate(rounds):
        x, y = (i % per_row) * width, head + (i // per_row) * height
        cell = ET.SubElement(svg, "g", transform=f"translate({x},{y})",
                             attrib={"class": "round", "data-round": str(rnd.number)})
        draw_round(cell, ex, fr, rnd)
    ET.indent(svg)
    return ET.tostring(svg, encoding="unicode") + "\n"


def draw_one(ex: Explanation, rnd: Round, fr: Frame | None = None) -> str:
    """One round as an SVG element of its own (the page shows one at a time; pass it the
    ``frame(ex)`` it made once)."""
    fr = fr or frame(ex)
    width, height = fr.cell
    svg = ET.Element("svg", xmlns="http://www.w3.org/2000/svg", width=str(width),
                     height=str(height), viewBox=f"0 0 {width} {height}",
                     attrib={"font-family": "sans-serif", "class": "round",
                             "data-round": str(rnd.number)})
    prefix = f"r{rnd.number}-"  # marker ids unique on a page of several
    _defs(svg, prefix)
    draw_round(svg, ex, fr, rnd, prefix)
    ET.indent(svg)
    return ET.tostring(svg, encoding="unicode")


def draw_round(parent: ET.Element, ex: Explanation, fr: Frame, rnd: Round,
               prefix: str = "") -> None:
    """One round: its title, then each panel's ranks and the messages that panel shows."""
    title = round_title(rnd, ex)
    if len(title) * 6.6 > fr.cell[0] - 12:  # too long for the cell: without the count
        title = title.rpartition(":")[0] or title
    _text(parent, 8, 16, title, size=12, weight="bold")
    by_panel: dict[int, list[Transfer]] = {}
    for t in rnd.transfers:
        by_panel.setdefault(fr.layout.panel_of(t), []).append(t)
    for p, panel in enumerate(fr.layout.panels):
        group = ET.SubElement(parent, "g",
                              transform=f"translate({p * fr.panel_w:.0f},{TITLE_H})")
        if len(fr.layout.panels) > 1:
            _text(group, fr.panel_w / 2, 12, panel.title, size=11, anchor="middle",
                  fill="#555")
        _boxes(group, fr, panel)
        _arrows(group, fr, panel, by_panel.get(p, []), prefix)
        _nodes(group, ex, fr, panel, rnd)


def _defs(svg: ET.Element, prefix: str = "") -> None:
    defs = ET.SubElement(svg, "defs")
    for name, colour in (("reduce", REDUCE_COLOUR), ("copy", COPY_COLOUR)):
        marker = ET.SubElement(defs, "marker", id=f"{prefix}head-{name}", viewBox="0 0 10 10",
                               refX="9", refY="5", markerWidth="7", markerHeight="7",
                               orient="auto-start-reverse")
        ET.SubElement(marker, "path", d="M 0 0 L 10 5 L 0 10 z", fill=colour)


def _boxes(parent: ET.Element, fr: Frame, panel: Panel) -> None:
    half = (fr.panel_w - 40) / max(len(panel.boxes), 1) / 2 - 4  # hosts side by side
    for label, ranks in panel.boxes:
        xs = [fr.xy(panel, r)[0] for r in ranks]
        ys = [fr.xy(panel, r)[1] for r in ranks]
        left, top = min(xs) - half, min(ys) - 26
        ET.SubElement(parent, "rect", x=f"{left:.1f}", y=f"{top:.1f}",
                      width=f"{max(xs) - min(xs) + 2 * half:.1f}",
                      height=f"{max(ys) - min(ys) + 62:.1f}", rx="8", fill="#f4f4f4",
                      stroke="#bbb", attrib={"class": "host"})
        _text(parent, left + 6, top + 12, label, size=10, fill="#777")


def _arrows(parent: ET.Element, fr: Frame, panel: Panel, transfers: list[Transfer],
            prefix: str = "") -> None:
    """One arrow per message; several between one pair in one round are drawn side by
    side, the two ways of a pair on either side of the line between them."""
    seen: dict[tuple[int, int], int] = {}
    for t in transfers:
        pair = (min(t.sender, t.receiver), max(t.sender, t.receiver))
        k = seen[pair] = seen.get(pair, -1) + 1
        (x1, y1), (x2, y2) = fr.xy(panel, t.sender), fr.xy(panel, t.receiver)
        dx, dy = x2 - x1, y2 - y1
        length = math.hypot(dx, dy) or 1.0
        ux, uy = dx / length, dy / length
        side = 5.0 * (k + 1) * (1 if t.sender < t.receiver else -1)  # a pair's two ways apart
        ox, oy = -uy * side, ux * side
        colour, kind = (REDUCE_COLOUR, "reduce") if t.reduces else (COPY_COLOUR, "copy")
        g = ET.SubElement(parent, "g", attrib={
            "class": "transfer", "data-round": str(t.round), "data-sender": str(t.sender),
            "data-receiver": str(t.receiver), "data-reduces": str(int(t.reduces))})
        ET.SubElement(g, "title").text = t.describe()
        ET.SubElement(g, "line", x1=f"{x1 + ux * NODE_R + ox:.1f}",
                      y1=f"{y1 + uy * NODE_R + oy:.1f}", x2=f"{x2 - ux * (NODE_R + 2) + ox:.1f}",
                      y2=f"{y2 - uy * (NODE_R + 2) + oy:.1f}", stroke=colour,
                      attrib={"stroke-width": "2", "marker-end": f"url(#{prefix}head-{kind})"})
        if t.chunk >= 0:
            _text(g, (x1 + x2) / 2 + ox * 2.2, (y1 + y2) / 2 + oy * 2.2 + 3, f"c{t.chunk}",
                  size=9, anchor="middle", fill=colour)


def _nodes(parent: ET.Element, ex: Explanation, fr: Frame, panel: Panel, rnd: Round) -> None:
    role = ex.call.spec.result
    for rank in sorted(panel.positions):
        x, y = fr.xy(panel, rank)
        g = ET.SubElement(parent, "g", attrib={"class": "rank", "data-rank": str(rank)})
        ET.SubElement(g, "circle", cx=f"{x:.1f}", cy=f"{y:.1f}", r=str(NODE_R), fill="white",
                      stroke="#333", attrib={"stroke-width": "1.5"})
        _text(g, x, y + 4, str(rank), size=12, anchor="middle", weight="bold")
        state = rnd.buffers[rank]
        if role in state:
            _text(g, x, y + NODE_R + 12, values_text(state[role], rnd.known[rank][role]),
                  size=9, anchor="middle", fill="#333", cls="values")


def values_text(values: np.ndarray, known: np.ndarray) -> str:
    shown = [str(v) if k else UNKNOWN
             for v, k in zip(values.tolist(), known.tolist(), strict=True)]
    if len(shown) > MAX_SHOWN:
        shown = shown[:MAX_SHOWN - 1] + ["…"]
    return " ".join(shown)


def _text(parent: ET.Element, x: float, y: float, text: str, *, size: int,
          anchor: str = "start", weight: str = "normal", fill: str = "#000",
          cls: str = "") -> ET.Element:
    attrib = {"font-size": str(size), "text-anchor": anchor, "font-weight": weight}
    if cls:
        attrib["class"] = cls
    el = ET.SubElement(parent, "text", x=f"{x:.1f}", y=f"{y:.1f}", fill=fill, attrib=attrib)
    el.text = text
    return el
