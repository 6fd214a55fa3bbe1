"""``ringcomm trace merge``: every rank's timeline on rank 0's clock, in one file.

Each rank's file (``Timeline.write``) holds its events in its own clock and the offset of
that clock from rank 0's, with its error (``clock``). Merging adds each rank's offset to
its events' times, so one file shows every rank on one time axis (Perfetto and
``chrome://tracing`` show one process per rank), and reports the offsets and their errors:
two events of different ranks closer together than the sum of their ranks' errors cannot
be ordered by their times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ArgumentError
from .timeline import FORMAT


@dataclass(frozen=True)
class Merged:
    """A merged timeline and what it says about the clocks."""

    trace: dict[str, Any]
    offsets_us: dict[int, float]
    errors_us: dict[int, float | None]
    dropped: dict[int, int]

    @property
    def worst_error_us(self) -> float | None:
        known = [e for e in self.errors_us.values() if e is not None]
        return max(known) if known else None

    def report(self) -> str:
        """One line per rank: its offset, the offset's error, events it dropped."""
        lines = []
        for rank in sorted(self.offsets_us):
            error = self.errors_us[rank]
            err = f"+/- {error:.1f} us" if error is not None else "(not measured)"
            dropped = f", {self.dropped[rank]} events dropped" if self.dropped[rank] else ""
            lines.append(f"rank {rank}: clock offset {self.offsets_us[rank]:+.1f} us {err}"
                         f"{dropped}")
        worst = self.worst_error_us
        if worst is not None:
            lines.append(f"events of different ranks line up to within {worst:.1f} us")
        return "\n".join(lines)


def load_timeline(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; an ``ArgumentError`` saying what is wrong with a file
    that is missing, unreadable, not JSON or not a trace (a dict with a list of
    ``traceEvents``), so that the commands name the file instead of showing a traceback."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ArgumentError(f"{path}: no such file; name a timeline that RINGCOMM_TRACE or "
                            "`ringcomm trace merge` wrote") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ArgumentError(f"{path} cannot be read ({err}); name a timeline that "
                            "RINGCOMM_TRACE or `ringcomm trace merge` wrote") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise ArgumentError(f"{path} is not JSON ({err.msg} at line {err.lineno}, column "
                            f"{err.colno}); name a timeline that RINGCOMM_TRACE or "
                            "`ringcomm trace merge` wrote") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("traceEvents"), list):
        raise ArgumentError(f"{path} is JSON but not a trace (no list of traceEvents); name "
                            "a timeline that RINGCOMM_TRACE or `ringcomm trace merge` wrote")
    return raw


def read_rank_files(folder: str | Path) -> list[dict[str, Any]]:
    """Every rank's timeline in ``folder`` (``rank<r>.json``), in rank order; an
    ``ArgumentError`` naming what is wrong with a folder or file that is not such a run."""
    if not Path(folder).is_dir():
        what = "is a file, not a folder" if Path(folder).exists() else "does not exist"
        raise ArgumentError(f"{folder} {what}: merge reads the folder RINGCOMM_TRACE named, "
                            "with a rank<N>.json per rank (plot draws one file)")
    paths = sorted(Path(folder).glob("rank*.json"),
                   key=lambda p: int(p.stem[4:]) if p.stem[4:].isdigit() else -1)
    if not paths:
        raise ArgumentError(f"no timelines (rank<N>.json) in {folder}: run with "
                            "RINGCOMM_TRACE set to that folder first")
    files = []
    for path in paths:
        raw = load_timeline(path)
        other = raw.get("otherData")
        if not isinstance(other, dict) or other.get("format") != FORMAT:
            raise ArgumentError(f"{path} is not a ringcomm timeline ({FORMAT}); leave only "
                                "the rank<N>.json files of one traced run in the folder")
        files.append(raw)
    return files


def merge(files: list[dict[str, Any]]) -> Merged:
    """The ranks' timelines on rank 0's clock."""
    events: list[dict[str, Any]] = []
    offsets: dict[int, float] = {}
    errors: dict[int, float | None] = {}
    dropped: dict[int, int] = {}
    for raw in files:
        other = raw["otherData"]
        rank = int(other["rank"])
        if rank in offsets:
            raise ArgumentError(f"two timelines of rank {rank}: merge one run at a time")
        offset = float(other["clock"]["offset_us"])
        offsets[rank] = offset
        errors[rank] = other["clock"]["error_us"]
        dropped[rank] = int(other.get("dropped", 0))
        for event in raw["traceEvents"]:
            if "ts" in event:
                event = dict(event, ts=round(event["ts"] + offset, 3))
            events.append(event)
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {
        "format": FORMAT + "+merged", "ranks": sorted(offsets),
        "clock": {str(r): {"offset_us": offsets[r], "error_us": errors[r]}
                  for r in sorted(offsets)}}}
    return Merged(trace, offsets, errors, dropped)


def main(folder: str, output: str) -> str:
    """``ringcomm trace merge``: what it prints. A rank file whose fields are damaged is an
    ``ArgumentError`` naming the folder, like any other bad input."""
    files = read_rank_files(folder)
    try:
        merged = merge(files)
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        if isinstance(err, ArgumentError):
            raise
        raise ArgumentError(f"the timelines in {folder} are damaged ({type(err).__name__}: "
                            f"{err}); trace the run again") from None
    Path(output).write_text(json.dumps(merged.trace))
    return merged.report() + f"\nwrote {output} ({len(merged.trace['traceEvents'])} events)"
