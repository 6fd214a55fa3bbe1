"""``ringcomm trace plot``: a merged timeline drawn as a picture, for people who will not open
Perfetto.

One row per rank and track (its engines, then its links), time along the x axis: each op is
a pale bar across its row, labelled with its collective and algorithm where it is wide
enough; inside it each step is a bar coloured by what it did (send, receive, reduce, copy,
post, take), and the time a step spent waiting for a peer is grey. Message rows show each
message to or from that peer. matplotlib comes with the ``bench`` extra.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from .._support import install_hint
from ..errors import ArgumentError
from .merge import load_timeline

STEP_COLOURS = {
    "send": "#4C72B0", "recv": "#55A868", "recv+reduce": "#C44E52",
    "recv+reduce+send": "#8172B2", "copy": "#CCB974", "post": "#64B5CD",
    "take": "#55A868", "take+reduce": "#C44E52",
}
WAIT_COLOUR = "#B0B0B0"
OP_COLOUR = "#E8E8F4"
MESSAGE_COLOURS = {"send": "#4C72B0", "recv": "#55A868"}


def _rows(events: list[dict[str, Any]]) -> tuple[list[tuple[int, int]], dict[tuple[int, int], str]]:
    names: dict[tuple[int, int], str] = {}
    used = set()
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e.get("ph") == "X":
            used.add((e["pid"], e["tid"]))
    return sorted(used), names


def plot(trace: dict[str, Any], output: str | Path, *, title: str | None = None) -> Path:
    """Draw ``trace`` (a merged or single-rank timeline) into ``output`` (PNG, SVG...). A
    timeline with nothing to draw is refused before matplotlib (seconds to import) loads."""
    events = trace["traceEvents"]
    rows, names = _rows(events)
    if not rows:
        raise ArgumentError("the timeline holds no events to draw: trace a run that "
                            "runs at least one op")
    spans = [e for e in events if e.get("ph") == "X"]
    t0 = min(e["ts"] for e in spans)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as err:
        raise SystemExit("ringcomm trace plot needs matplotlib: "
                         f"{install_hint('bench')}") from err
    index = {row: i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(14, 0.45 * len(rows) + 1.6))
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in spans:
        by_cat[e.get("cat", "")].append(e)

    def bars(items: list[dict[str, Any]], height: float, colour: Any, z: int) -> None:
        for e in items:
            y = index[(e["pid"], e["tid"])]
            start, width = (e["ts"] - t0) / 1000, max(e["dur"], 0.5) / 1000
            ax.broken_barh([(start, width)], (y - height / 2, height),
                           facecolors=colour(e) if callable(colour) else colour,
                           edgecolor="none", zorder=z)

    bars(by_cat["op"], 0.9, OP_COLOUR, 1)
    bars(by_cat["step"], 0.6, lambda e: STEP_COLOURS.get(e["name"], "#999999"), 2)
    bars(by_cat["wait"], 0.6, WAIT_COLOUR, 3)
    bars(by_cat["message"], 0.5,
         lambda e: MESSAGE_COLOURS.get(e.get("args", {}).get("direction"), "#999999"), 2)
    bars(by_cat["post"] + by_cat["take"], 0.5,
         lambda e: STEP_COLOURS.get(e["cat"], "#999999"), 2)
    span_ms = (max(e["ts"] + e["dur"] for e in spans) - t0) / 1000
    for e in by_cat["op"]:
        if e["dur"] / 1000 > span_ms / 25:
            args = e.get("args", {})
            ax.text((e["ts"] - t0 + e["dur"] / 2) / 1000, index[(e["pid"], e["tid"])] + 0.47,
                    f"{e['name']} ({args.get('algorithm', '?')})", ha="center",
                    va="bottom", fontsize=7, zorder=4)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {pid}: {names.get((pid, tid), f'track {tid}')}"
                        for pid, tid in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms, rank 0's clock)")
    ax.set_title(title or "ringcomm timeline")
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(color=OP_COLOUR, label="op"), Patch(color=WAIT_COLOUR, label="waiting")]
    legend += [Patch(color=c, label=k) for k, c in STEP_COLOURS.items()
               if k in {e["name"] for e in by_cat["step"]}]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(rows)),
              ncol=min(len(legend), 8), fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(output)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main(path: str, output: str) -> str:
    """``ringcomm trace plot``: what it prints. A file that is not a timeline, or holds
    events without the fields drawn, is an ``ArgumentError`` naming it."""
    trace = load_timeline(path)
    try:
        drawn = plot(trace, output, title=Path(path).name)
    except (AttributeError, KeyError, TypeError) as err:
        raise ArgumentError(f"{path} holds events that cannot be drawn ({type(err).__name__}: "
                            f"{err}); plot draws timelines that RINGCOMM_TRACE or `ringcomm "
                            "trace merge` wrote") from None
    return f"wrote {drawn}"
