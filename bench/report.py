"""Presenting sweep rows: terminal tables, the JSON file and PNG plots.

Rows are the plain dicts ``sweep`` produces, so a saved JSON file can be re-plotted or
re-tabulated (``python -m ringcomm_bench.report results.json --plot-dir DIR``) without re-running.
"""

from __future__ import annotations

import argparse
import json
import operator
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Any

from .common import format_size, parse_size
from .floors import API_FLOOR, TORCH_FLOOR

GroupKey = tuple[str, int, str, str]


def _group_key(row: dict) -> GroupKey:
    return row["collective"], row["world_size"], row["dtype"], row["op"]


def groups(rows: Iterable[dict]) -> dict[GroupKey, list[dict]]:
    """Rows by (collective, world size, dtype, op), in the order they were measured."""
    out: dict[GroupKey, list[dict]] = {}
    for row in rows:
        out.setdefault(_group_key(row), []).append(row)
    return out


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


PEERS = ("gloo", "nccl", "mpi")  # the libraries ringcomm is compared with
TORCH = "ringcomm/torch"


def _auto(rows: Iterable[dict]) -> dict | None:
    """ringcomm's own choice through the Communicator (the direct path)."""
    return next((r for r in rows if r["library"] == "ringcomm"
                 and r["algorithm"] in (None, "auto")), None)


def ours(rows: Iterable[dict]) -> dict | None:
    """The ringcomm row that stands for ringcomm at one size: the torch path where it was
    measured, since that is what users run (``dist.all_reduce``, DDP), else the direct one."""
    rows = list(rows)
    return next((r for r in rows if r["library"] == TORCH), None) or _auto(rows)


def print_tables(rows: list[dict], console: Any) -> None:
    """One nccl-tests-style table per collective, world size, dtype and op.

    ``vs gloo`` is Gloo's time over this backend's (above 1: faster than Gloo), ``vs mpi``
    MPI's (where MPI ran); ``vs best``, on the automatic choice's rows (direct and through
    torch), is its time over the best forced algorithm's."""
    from rich.table import Table

    for (collective, world, dtype, op), group in groups(rows).items():
        title = f"{collective}, world size {world}, {dtype}" + ("" if op == "none" else f" {op}")
        table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
        algos = any(r["chosen"] for r in group)
        mpi = any(r["library"] == "mpi" for r in group)
        names = [n for n in ("size (B)", "count", "type", "redop", "backend", "algo",
                             "time (us)", "min (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong",
                             "pred (us)", "vs gloo", "vs mpi", "vs best")
                 if (algos or n not in ("algo", "vs best")) and (mpi or n != "vs mpi")]
        for name in names:
            text = name in ("backend", "algo", "type", "redop")
            table.add_column(name, justify="left" if text else "right", no_wrap=text)
        for i, (nbytes, of_size) in enumerate(groupby(group, key=lambda r: r["bytes"])):
            same = list(of_size)
            peer = {p: next((r for r in same if r["library"] == p), None) for p in PEERS}
            forced = [r["time_us"] for r in same if r["library"] == "ringcomm"
                      and r["algorithm"] not in (None, "auto")]
            if i:
                table.add_section()
            for r in same:
                ratio = {f"vs {p}": "-" if (other := peer[p]) is None
                         else f"{other['time_us'] / r['time_us']:.2f}x" for p in ("gloo", "mpi")}
                algo = r["chosen"] or ""
                if r["algorithm"] == "auto":
                    algo = f"auto: {algo}"
                cells = {
                    "size (B)": f"{nbytes:,}", "count": f"{r['count']:,}", "type": r["dtype"],
                    "redop": r["op"], "backend": r["backend"], "algo": algo,
                    "time (us)": _us(r["time_us"]), "min (us)": _us(r["min_time_us"]),
                    "algbw (GB/s)": f"{r['algbw_GBps']:.3f}",
                    "busbw (GB/s)": f"{r['busbw_GBps']:.3f}",
                    "#wrong": f"[red]{r['wrong']}[/]" if r["wrong"] else "0",
                    "pred (us)": _us(r["predicted_us"]), **ratio,
                    "vs best": (f"{r['time_us'] / min(forced):.2f}x"
                                if r["algorithm"] == "auto" and forced else "")}
                table.add_row(*(cells[n] for n in names))
        console.print(table)
        console.print()


@dataclass(frozen=True)
class Target:
    """One of the issue's targets for allreduce on one host.

    ``kind`` says what is measured at each size, ``ours`` being the torch row where it was
    measured, else the direct one (``ours()``):

    - ``speedup``: ``peer``'s time / ours, at least ``bound``;
    - ``extra_us``: the torch row's time minus the direct row's, at most ``bound`` us;
    - ``over_floor_us``: the torch row's time minus torch's floor (``floors``) and
      ``peer``'s time, at most ``bound`` us: what ringcomm adds to torch beyond the peer;
    - ``direct_speedup``: ``peer``'s time / the direct row's, at least ``bound``;
    - ``time_us``: our time, at most ``bound`` us (a dict: per world size, none elsewhere);
    - ``auto``: the direct automatic choice's time / the best forced algorithm's;
    - ``choice``: the same question asked of the forced runs only: the time of the
      algorithm the model picks / the best one's;
    - ``same``: the direct automatic run against the forced run of the very algorithm it
      chose: one schedule measured twice, so what separates them is noise.

    The last three are about the cost model's choice, made the same way on both paths;
    algorithms can only be forced through the Communicator, so they use the direct rows."""

    what: str
    sizes: tuple[int, int]
    bound: float | dict[int, float]
    kind: str
    peer: str | None = None

    def bound_for(self, world: int) -> float | None:
        return self.bound.get(world) if isinstance(self.bound, dict) else self.bound

    @property
    def higher_is_better(self) -> bool:
        return self.kind in ("speedup", "direct_speedup")

    @property
    def unit(self) -> str:
        return "us" if self.kind.endswith("_us") else "x"


EVERY_SIZE = (0, 1 << 62)
TARGETS = [
    Target("busbw vs gloo, 1 MiB-256 MiB", (1 << 20, 256 << 20), 1.5, "speedup", "gloo"),
    Target("busbw vs gloo, 64 KiB", (64 << 10, 64 << 10), 1.2, "speedup", "gloo"),
    Target("latency vs gloo, 8 B-4 KiB (time ratio)", (8, 4 << 10), 2.0, "speedup", "gloo"),
    Target("vs mpi, 64 KiB-256 MiB: at most its time", (64 << 10, 256 << 20), 1.0, "speedup",
           "mpi"),
    Target("vs mpi, every size: at most 3x its time", EVERY_SIZE, {4: 1 / 3}, "speedup", "mpi"),
    Target("torch, 8 B-4 KiB: over torch's floor + mpi (us)", (8, 4 << 10), {2: 0.0},
           "over_floor_us", "mpi"),
    Target("direct, 8 B-4 KiB: at most 2x mpi's time", (8, 4 << 10), {2: 0.5},
           "direct_speedup", "mpi"),
    Target("torch path over direct, every size (us)", EVERY_SIZE, 10.0, "extra_us"),
    Target("time at 8 B (us)", (8, 8), {2: 10.0, 4: 60.0}, "time_us"),
    Target("auto vs best algorithm (time ratio)", EVERY_SIZE, 1.1, "auto"),
    Target("chosen vs best algorithm, forced runs", EVERY_SIZE, 1.1, "choice"),
    Target("noise: auto vs its own algorithm forced", EVERY_SIZE, 1.1, "same"),
]

# What the summary calls noise, beside every target: the band the target's own value moves
# in from one repetition to the next at its worst size. Each repetition times every backend
# (MPI too) back to back, so the value can be taken repetition by repetition (Gloo's time /
# ours in repetition k, and so on); the band is the lower to the upper quartile of those
# values (with 5 repetitions the 2nd to the 4th, with 9 the 3rd to the 7th: the median lies
# in that range with about 60% and 80% confidence). Where the bound lies inside the band,
# the target is marked "within noise": this run cannot say whether it is met. The "same" row
# is noise seen another way: one schedule timed twice in the run (auto and its own
# algorithm forced), their medians apart by that factor.
NOISE_NOTE = ("noise: the band (lower to upper quartile) the target's value moves in from "
              "one repetition to the next at the worst size, each repetition timing every "
              "backend back to back; 'within noise': the bound lies inside it, so this run "
              "cannot say whether the target is met.")
SAME_NOTE = ("The 'noise: auto vs its own algorithm forced' row: one schedule timed twice "
             "(auto, and its algorithm forced), their medians apart by that factor.")


def noise_note(summary: list[dict]) -> str:
    """``NOISE_NOTE``, and ``SAME_NOTE`` where the summary has that row (a run that forced
    the algorithm its automatic choice took)."""
    same = any(t.get("kind") == "same" for t in summary)
    return f"{NOISE_NOTE} {SAME_NOTE}" if same else NOISE_NOTE


def _reps(row: dict) -> list[float]:
    return row.get("rep_times_us") or []


def _per_rep(a: dict, b: dict, combine: Any) -> list[float]:
    ra, rb = _reps(a), _reps(b)
    return [combine(x, y) for x, y in zip(ra, rb, strict=True)] if len(ra) == len(rb) else []


def _band(values: list[float]) -> tuple[float, float] | None:
    """Lower and upper quartile of ``values``; None with fewer than two."""
    if len(values) < 2:
        return None
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, high


def _time(row: dict) -> float:
    return row["time_us"]


def _measure_target(t: Target, same: list[dict]) -> tuple[float, list[float], str] | None:
    """``t``'s value at one size, its value in each repetition, and the backend that stood
    for ringcomm; None where the rows it needs were not measured."""
    auto, mine = _auto(same), ours(same)
    if t.kind == "time_us":
        return None if mine is None else (_time(mine), _reps(mine), mine["backend"])
    if t.kind == "extra_us":
        if mine is None or mine["library"] != TORCH or auto is None:
            return None
        return (_time(mine) - _time(auto), _per_rep(mine, auto, operator.sub),
                mine["backend"])
    peer = next((r for r in same if r["library"] == t.peer), None)
    if t.kind == "over_floor_us":
        floor = next((r for r in same if r["library"] == TORCH_FLOOR), None)
        if mine is None or mine["library"] != TORCH or floor is None or peer is None:
            return None
        over = _per_rep(mine, floor, operator.sub)
        over = [x - y for x, y in zip(over, _reps(peer), strict=True)] \
            if len(over) == len(_reps(peer)) else []
        return _time(mine) - _time(floor) - _time(peer), over, mine["backend"]
    if t.kind == "direct_speedup":
        if auto is None or peer is None:
            return None
        return _time(peer) / _time(auto), _per_rep(peer, auto, operator.truediv), "ringcomm"
    forced = [r for r in same
              if r["library"] == "ringcomm" and r["algorithm"] not in (None, "auto")]
    best = min(forced, key=_time) if forced else None
    own = next((r for r in forced if auto and r["algorithm"] == auto["chosen"]), None)
    pair: tuple[dict | None, dict | None]
    if t.kind == "speedup":
        pair = peer, mine
    elif t.kind == "auto":
        pair = auto, best
    elif t.kind == "choice":
        pair = own, best
    else:  # "same": the slower of the two runs over the faster
        pair = (max(own, auto, key=_time), min(own, auto, key=_time)) if own and auto else (
            None, None)
    a, b = pair
    if a is None or b is None:
        return None
    return (_time(a) / _time(b), _per_rep(a, b, operator.truediv),
            b["backend"] if t.kind == "speedup" else "ringcomm")


def _meets(t: Target, value: float, bound: float) -> bool:
    return value >= bound if t.higher_is_better else value <= bound


def target_summary(rows: list[dict]) -> list[dict]:
    """How the allreduce rows measure up to ``TARGETS``: per world size and dtype, the
    worst value over the target's sizes, at which size, its noise there (``NOISE_NOTE``),
    and whether the bound holds. Latency against Gloo is reported as a speedup too (time
    ratio <= 0.5x is a speedup >= 2x), and so is the bound against MPI (our time at most
    1.5x MPI's is MPI's time / ours at least 0.67x)."""
    out = []
    for (collective, world, dtype, op), group in groups(rows).items():
        if collective != "allreduce":
            continue
        by_size: dict[int, list[dict]] = {}
        for r in group:
            by_size.setdefault(r["bytes"], []).append(r)
        for t in TARGETS:
            bound = t.bound_for(world)
            if bound is None:
                continue
            lo, hi = t.sizes
            found = {nbytes: m for nbytes, same in by_size.items()
                     if lo <= nbytes <= hi and (m := _measure_target(t, same)) is not None}
            if not found:
                continue
            pick = min if t.higher_is_better else max
            worst = pick(found, key=lambda n: found[n][0])
            value, per_rep, row = found[worst]
            band = _band(per_rep)
            out.append({"world_size": world, "dtype": dtype, "op": op, "target": t.what,
                        "bound": round(bound, 6), "kind": t.kind, "unit": t.unit,
                        "row": row, "worst": round(value, 3), "at_bytes": worst,
                        "noise": None if band is None else [round(x, 3) for x in band],
                        "met": _meets(t, value, bound),
                        "within_noise": band is not None and band[0] <= bound <= band[1],
                        "sizes_met": sum(1 for v, _, _ in found.values() if _meets(t, v, bound)),
                        "sizes": len(found)})
    return out


def _value(t: dict, value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" if t.get("unit", "x") == "x" else f"{value:.1f} us"


def _noise(t: dict) -> str:
    band = t.get("noise")
    if not band:
        return "-"
    low, high = band
    return (f"{low:.2f}-{high:.2f}x" if t.get("unit", "x") == "x"
            else f"{low:.1f} to {high:.1f} us")


def _bound(t: dict) -> str:
    sign = ">=" if t["kind"] == "speedup" else "<="
    return f"{sign} {_value(t, t['bound'])}"


def print_targets(summary: list[dict], console: Any) -> None:
    """The target summary as a table, noise beside each target (nothing when no allreduce
    row had a peer)."""
    if not summary:
        return
    from rich.table import Table

    table = Table(title="allreduce targets (worst size)", title_justify="left",
                  show_edge=False, pad_edge=False, caption=noise_note(summary),
                  caption_justify="left")
    for name in ("world", "dtype", "target", "row", "bound", "worst", "at size", "noise",
                 "sizes met", ""):
        table.add_column(name, justify="left" if name in ("target", "dtype", "row", "")
                         else "right")
    for t in summary:
        verdict = "[green]met[/]" if t["met"] else "[red]missed[/]"
        if t.get("within_noise"):
            verdict += " (within noise)"
        table.add_row(str(t["world_size"]), t["dtype"], t["target"], t.get("row", ""),
                      _bound(t), _value(t, t["worst"]), format_size(t["at_bytes"]),
                      _noise(t), f"{t['sizes_met']}/{t['sizes']}", verdict)
    console.print(table)
    console.print()


SMALL = 64 << 10  # the sizes whose time the floors explain: below this, fixed costs rule


def floor_split(rows: list[dict]) -> list[dict]:
    """Where a small allreduce's time goes, per world size and size up to ``SMALL`` where
    the floors were measured (``floors``): torch's dispatch (``floor/torch``), ringcomm's
    own cost through torch (the torch row less that floor), and of the direct call its fixed
    cost with nothing to exchange (``floor/ringcomm``) and the exchange (the rest); beside
    MPI's time where it ran, the torch row's gap to MPI split into torch's part and
    ringcomm's. Times are medians over repetitions (us)."""
    out = []
    for (collective, world, dtype, op), group in groups(rows).items():
        if collective != "allreduce":
            continue
        for nbytes, of_size in groupby(group, key=lambda r: r["bytes"]):
            same = list(of_size)
            row = {lib: next((r["time_us"] for r in same if r["library"] == lib
                              and r["algorithm"] in (None, "auto")), None)
                   for lib in (TORCH_FLOOR, API_FLOOR, "ringcomm", TORCH, "mpi")}
            torch_floor, api_floor = row[TORCH_FLOOR], row[API_FLOOR]
            torch_path, direct, mpi = row[TORCH], row["ringcomm"], row["mpi"]
            if nbytes > SMALL or torch_floor is None or api_floor is None or direct is None:
                continue
            entry = {"world_size": world, "dtype": dtype, "op": op, "bytes": nbytes,
                     "mpi_us": mpi, "torch_floor_us": torch_floor, "api_floor_us": api_floor,
                     "direct_us": direct, "torch_us": torch_path,
                     "exchange_us": direct - api_floor,
                     "ringcomm_in_torch_us": None if torch_path is None
                     else torch_path - torch_floor}
            if torch_path is not None and mpi is not None:  # the gap, torch's and ours
                entry["gap_to_mpi_us"] = torch_path - mpi
                entry["gap_torch_us"] = torch_floor
                entry["gap_ringcomm_us"] = torch_path - torch_floor - mpi
            out.append(entry)
    return out


def print_floor_split(split: list[dict], console: Any) -> None:
    """``floor_split`` as a table (nothing where the floors were not measured)."""
    if not split:
        return
    from rich.table import Table

    table = Table(title="small allreduces: where the time goes (us, medians)",
                  title_justify="left", show_edge=False, pad_edge=False,
                  caption="torch = torch's floor (its dispatch on a backend that does nothing)"
                  " + ringcomm's part; direct = ringcomm's fixed cost (its API on one rank) + "
                  "the exchange; gap to mpi = torch's floor + ringcomm's part beyond mpi's "
                  "time.", caption_justify="left")
    columns = [("world", "world_size"), ("size", "bytes"), ("mpi", "mpi_us"),
               ("torch floor", "torch_floor_us"), ("ringcomm/torch", "torch_us"),
               ("ringcomm's part", "ringcomm_in_torch_us"), ("api floor", "api_floor_us"),
               ("direct", "direct_us"), ("exchange", "exchange_us"),
               ("gap: ringcomm's", "gap_ringcomm_us")]
    for name, _ in columns:
        table.add_column(name, justify="right")
    for entry in split:
        table.add_row(*(format_size(entry[key]) if key == "bytes" else
                        str(entry[key]) if key == "world_size" else _us(entry.get(key))
                        for _, key in columns))
    console.print(table)
    console.print()


def markdown(rows: list[dict], sizes: set[int] | None = None) -> str:
    """The tables docs/benchmarks.md quotes: per collective and world size, ringcomm's own
    choice (direct and, where measured, through torch) against Gloo, NCCL and MPI where
    measured, each peer's time over ours (the torch row where measured) at each size; then
    the target summary."""
    out = []
    for (collective, world, dtype, op), group in groups(rows).items():
        peers = [b for b in PEERS if any(r["library"] == b for r in group)]
        torch_rows = any(r["library"] == TORCH for r in group)
        head = ["size", "ringcomm (us)", "algorithm", "busbw (GB/s)"]
        if torch_rows:
            head += [f"{TORCH} (us)", "torch busbw"]
        for b in peers:
            head += [f"{b} (us)", f"{b} busbw",
                     f"{b} time / {TORCH if torch_rows else 'ringcomm'}"]
        out += [f"{collective}, world size {world}, {dtype}" + ("" if op == "none" else f" {op}")
                + ":", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for nbytes, of_size in groupby(group, key=lambda r: r["bytes"]):
            if sizes is not None and nbytes not in sizes:
                continue
            same = list(of_size)
            direct, mine = _auto(same), ours(same)
            if mine is None:  # then there is no direct row either
                continue
            cells = [format_size(nbytes)]
            cells += (["-"] * 3 if direct is None else
                      [_us(direct["time_us"]), direct["chosen"] or "-",
                       f"{direct['busbw_GBps']:.2f}"])
            if torch_rows:
                via = next((r for r in same if r["library"] == TORCH), None)
                cells += (["-"] * 2 if via is None else
                          [_us(via["time_us"]), f"{via['busbw_GBps']:.2f}"])
            for b in peers:
                peer = next((r for r in same if r["library"] == b), None)
                cells += (["-"] * 3 if peer is None else
                          [_us(peer["time_us"]), f"{peer['busbw_GBps']:.2f}",
                           f"{peer['time_us'] / mine['time_us']:.2f}x"])
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    split = floor_split(rows)
    if split:
        out += ["Small allreduces, where the time goes (us, medians): through torch, torch's "
                "floor (its dispatch on a backend that does nothing) and ringcomm's part; "
                "directly, ringcomm's fixed cost (its API on one rank) and the exchange; and "
                "what ringcomm adds to torch's floor beyond MPI's time:", "",
                "| world | size | mpi | torch floor | ringcomm/torch | ringcomm's part | "
                "api floor | direct | exchange | beyond floor + mpi |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for e in split:
            out.append(f"| {e['world_size']} | {format_size(e['bytes'])} | "
                       + " | ".join(_us(e.get(k)) for k in (
                           "mpi_us", "torch_floor_us", "torch_us", "ringcomm_in_torch_us",
                           "api_floor_us", "direct_us", "exchange_us", "gap_ringcomm_us"))
                       + " |")
        out.append("")
    summary = target_summary(rows)
    if summary:
        out += ["| world | target | row | bound | worst (at size) | noise | sizes met |",
                "|---|---|---|---|---|---|---|"]
        for t in summary:
            flag = ", within noise" if t.get("within_noise") else ""
            out.append(f"| {t['world_size']} | {t['target']} | {t.get('row', 'ringcomm')} | "
                       f"{_bound(t)} | {_value(t, t['worst'])} ({format_size(t['at_bytes'])}"
                       f"{flag}) | {_noise(t)} | "
                       f"{t['sizes_met']}/{t['sizes']} |")
        out += ["", noise_note(summary)]
    return "\n".join(out)


def write_json(path: Path, rows: list[dict], meta: dict) -> None:
    """The run's facts first (command, machine, settings), then every row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")


def _file_stem(kind: str, key: GroupKey) -> str:
    collective, world, dtype, op = key
    return f"{kind}_{collective}_n{world}_{dtype}" + ("" if op == "none" else f"_{op}")


def _size_axis(ax: Any, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    if len(ticks) > 10:  # every other size, so labels stay readable
        ticks = ticks[::-(-len(ticks) // 10)]
    ax.set_xticks(ticks)
    ax.set_xticklabels([format_size(t).replace(" ", "") for t in ticks], rotation=45,
                       ha="right")
    ax.minorticks_off()
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def _backend_lines(ax: Any, group: list[dict], backends: list[str], key: str) -> None:
    """One line of ``key`` against size per backend (ringcomm's solid, peers' dashed)."""
    for name in backends:
        mine = [r for r in group if r["backend"] == name]
        ax.plot([r["bytes"] for r in mine], [r[key] for r in mine], marker="o",
                markersize=3, label=name,
                linestyle="-" if mine[0]["library"] in ("ringcomm", TORCH) else "--")
    _size_axis(ax, [r["bytes"] for r in group])


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """Bus bandwidth and time per call against size per backend, and ringcomm's measured
    against predicted time, one PNG of each per collective, world size, dtype and op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key, group in groups(rows).items():
        collective, world, dtype, op = key
        backends = list(dict.fromkeys(r["backend"] for r in group))
        fig, ax = plt.subplots(figsize=(8, 5))
        _backend_lines(ax, group, backends, "busbw_GBps")
        ax.set_ylabel("busbw (GB/s), median")
        ax.set_title(f"{collective} bus bandwidth, world size {world}, {dtype} "
                     f"{'' if op == 'none' else op}")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{_file_stem('busbw', key)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        fig, ax = plt.subplots(figsize=(8, 5))
        _backend_lines(ax, group, backends, "time_us")
        ax.set_yscale("log")
        ax.set_ylabel("time per call (us), median")
        ax.set_title(f"{collective} time per call, world size {world}, {dtype} "
                     f"{'' if op == 'none' else op}")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"{_file_stem('time', key)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

        predicted = [r for r in group if r.get("predicted_us")]
        if not predicted:
            continue
        fig, ax = plt.subplots(figsize=(8, 5))
        for name in dict.fromkeys(r["backend"] for r in predicted):
            mine = [r for r in predicted if r["backend"] == name]
            line, = ax.plot([r["bytes"] for r in mine], [r["time_us"] for r in mine],
                            marker="o", markersize=3, label=f"{name} measured")
            ax.plot([r["bytes"] for r in mine], [r["predicted_us"] for r in mine],
                    linestyle="--", color=line.get_color(), label=f"{name} predicted")
        _size_axis(ax, [r["bytes"] for r in predicted])
        ax.set_yscale("log")
        ax.set_ylabel("time per call (us)")
        ax.set_title(f"{collective}: measured vs cost model, world size {world}, {dtype}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"{_file_stem('predicted', key)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """Re-tabulate and re-plot a saved JSON file."""
    from rich.console import Console

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("json", type=Path)
    p.add_argument("--plot-dir", type=Path, default=None)
    p.add_argument("--markdown", action="store_true",
                   help="print the markdown tables docs/benchmarks.md quotes")
    p.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                   help="only these sizes in the markdown tables (e.g. 8 64K 1M)")
    args = p.parse_args(argv)
    saved = json.loads(args.json.read_text())
    rows = saved["rows"]
    if saved.get("benchmark") == "ringcomm bench ddp":  # a training run: its own table
        from . import ddp_step

        if args.sizes is not None or args.plot_dir is not None:
            p.error(f"{args.json} holds a DDP run: --sizes and --plot-dir apply to the "
                    "collective sweeps' files")

        if args.markdown:
            print(ddp_step.markdown(rows))
        else:
            ddp_step.print_table(rows, Console(width=None if sys.stdout.isatty() else 180))
        return
    if args.markdown:
        print(markdown(rows, None if args.sizes is None else set(args.sizes)))
        return
    console = Console(width=None if sys.stdout.isatty() else 180)
    print_tables(rows, console)
    print_targets(target_summary(rows), console)
    if args.plot_dir:
        for path in plot(rows, args.plot_dir):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
