"""Two versions of ringcomm, one sweep: is the new one slower anywhere?

    python -m ringcomm_bench.versions OLD [NEW] [--rounds 3] [--json F] -- [ringcomm bench args]

Checks out ``OLD`` and ``NEW`` (commits; ``NEW`` defaults to the working tree) into temporary
worktrees and runs ``ringcomm bench`` from each in turn, round after round (old, new, old,
new...), so both see the same machine: a busy spell hits both, not one. Each run's rows are
its per-size medians; a version's time at a size is the median over its rounds. Each way
ringcomm was timed (the direct API, and ``ringcomm/torch``: both by default) is compared
with itself.

The noise row says how much a version differs from itself: at each size, the largest ratio
between two rounds of the same version. A size counts as slower only where new/old exceeds
that ratio; below it the run cannot tell the versions apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARGS = ["--collectives", "allreduce", "--backends", "ringcomm", "ringcomm/torch",
                "-n", "2", "4", "-b", "8", "-e", "64M", "-f", "8"]

Key = tuple[str, str, int, int]  # (collective, path, world size, bytes)
PATHS = ("ringcomm", "ringcomm/torch")  # the direct API and torch.distributed's


@contextlib.contextmanager
def checkout(commit: str | None) -> Iterator[Path]:
    """A temporary worktree at ``commit`` (None: this checkout as it is), removed after."""
    if commit is None:
        yield ROOT
        return
    where = Path(tempfile.mkdtemp(prefix="ringcomm-version-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(where),
                    commit], check=True)
    try:
        build_compiled(where)
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                       check=False)
        shutil.rmtree(where, ignore_errors=True)


def build_compiled(tree: Path) -> None:
    """Build a version's compiled parts (the board's round in C, from versions that have it)
    in its worktree, as its install would: without them it would run its Python round and
    be measured slower than it is."""
    if (tree / "ringcomm" / "transport" / "_board_round.c").exists():
        subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()",
                        "build_ext", "--inplace"], cwd=tree, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_bench(tree: Path, args: Sequence[str], out: Path) -> list[dict]:
    """One ``ringcomm bench`` run with the code in ``tree``, its harness included; its rows.

    The harness folder ``bench/`` imports as ``ringcomm_bench`` only where it is installed,
    which would be this checkout's; a link named so, after ``tree`` on the path, gives each
    tree its own (trees from before the rename import it as ``bench`` from ``tree``)."""
    with tempfile.TemporaryDirectory(prefix="ringcomm-harness-") as harness:
        (Path(harness) / "ringcomm_bench").symlink_to(tree / "bench", target_is_directory=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), harness]))
        subprocess.run([sys.executable, "-m", "ringcomm.cli", "bench", *args, "--json",
                        str(out)], cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    return data["rows"] if isinstance(data, dict) else data


def times(rows: list[dict]) -> dict[Key, float]:
    """Median time (us) of the automatic choice per (collective, path, world size, bytes),
    for each way ringcomm was timed (``PATHS``: each compared with itself only)."""
    return {(r.get("collective", "allreduce"), r["library"], r["world_size"], r["bytes"]):
            r["time_us"]
            for r in rows
            if r.get("library") in PATHS and r.get("algorithm") in (None, "auto")}


def compare(old_rounds: list[dict[Key, float]],
            new_rounds: list[dict[Key, float]]) -> list[dict]:
    """Per size: each version's median over its rounds, new/old, the noise (the larger of
    the two versions' spread between their own rounds) and whether new is slower beyond it."""
    keys = sorted(set.intersection(*(set(r) for r in old_rounds + new_rounds)))
    out = []
    for key in keys:
        old = [r[key] for r in old_rounds]
        new = [r[key] for r in new_rounds]
        noise = max(max(v) / min(v) for v in (old, new))
        ratio = statistics.median(new) / statistics.median(old)
        out.append({"collective": key[0], "path": key[1], "world_size": key[2],
                    "bytes": key[3],
                    "old_us": statistics.median(old),
                    "new_us": statistics.median(new), "new_over_old": ratio, "noise": noise,
                    "slower": ratio > noise, "old_rounds_us": old, "new_rounds_us": new})
    return out


def show(rows: list[dict], old: str, new: str) -> None:
    """One table per collective and path."""
    for collective, path in dict.fromkeys((r["collective"], r["path"]) for r in rows):
        table = Table(title=f"{collective} ({path}), {new} against {old} (medians of "
                      "interleaved rounds)")
        for col in ("world", "bytes", f"{old} (us)", f"{new} (us)", "new/old", "noise",
                    "slower?"):
            table.add_column(col, justify="right")
        for r in rows:
            if (r["collective"], r["path"]) == (collective, path):
                table.add_row(str(r["world_size"]), f"{r['bytes']:,}", f"{r['old_us']:,.1f}",
                              f"{r['new_us']:,.1f}", f"{r['new_over_old']:.2f}x",
                              f"{r['noise']:.2f}x", "[red]yes[/]" if r["slower"] else "no")
        Console().print(table)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = DEFAULT_ARGS
    if "--" in argv:
        at = argv.index("--")
        argv, bench_args = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(prog="python -m ringcomm_bench.versions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old", help="the commit to compare against")
    p.add_argument("new", nargs="?", default=None, help="default: this checkout as it is")
    p.add_argument("--rounds", type=int, default=3, help="runs of each version (default 3)")
    p.add_argument("--json", type=Path, default=None, help="write the comparison here")
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2: the noise row compares rounds")
    runs: dict[str, list[dict[Key, float]]] = {"old": [], "new": []}
    with checkout(args.old) as old_tree, checkout(args.new) as new_tree, \
            tempfile.TemporaryDirectory(prefix="ringcomm-versions-") as tmp:
        for i in range(args.rounds):
            for name, tree in (("old", old_tree), ("new", new_tree)):
                out = Path(tmp) / f"{name}-{i}.json"
                runs[name].append(times(run_bench(tree, bench_args, out)))
                print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
    rows = compare(runs["old"], runs["new"])
    show(rows, args.old, args.new or "this checkout")
    if args.json:
        args.json.write_text(json.dumps({"old": args.old, "new": args.new or "working tree",
                                         "bench_args": bench_args, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
