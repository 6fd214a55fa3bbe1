"""``ringcomm bench --hosts HxR``: the sweep with its ranks on simulated hosts.

    ringcomm bench --hosts 2x2 --collectives allreduce -b 1M -e 64M -f 4 \\
        --backends ringcomm ringcomm:ring ringcomm:hier --rate 1gbit

``HxR`` is ``H`` hosts of ``R`` ranks each; ranks ``0..R-1`` are on the first host, and so on
(as torchrun numbers them). Each host is a network namespace of its own with its own
hostname (``bench/netns.py``, root only), so ringcomm sees ``H`` hosts: pipes and shared
memory inside a host, tcp between hosts over each host's ``data0``, which every rank is told
through ``RINGCOMM_SOCKET_IFNAME`` (and Gloo through ``GLOO_SOCKET_IFNAME``). ``--rate``
shapes every host's link with ``tc tbf`` at both of its ends. The machine's cores are split
between the hosts (each host's ranks pinned to cores of their own, as on separate machines)
unless ``--shared-cpus`` is given or there are fewer cores than hosts.

The ranks run the same ``sweep.rank_main`` as on one host, in processes started inside the
namespaces (``python -m ringcomm_bench.multihost rank DIR R``), so they cannot use the sweep's
multiprocessing queue. Instead each rank appends its reports to ``DIR/rankR.jsonl``, one
JSON line per report, flushed at once, its output going to ``DIR/rankR.log``; the driver
follows those files and watches the processes: a traceback, a rank that exits without
saying ``done``, or ``--timeout`` seconds without a word from any rank end the run with
``RankFailed`` naming the rank and carrying its traceback or the end of its output. The
namespaces, and whatever still runs in them, are removed however the run ends.

Predicted times on several hosts are the cost model's for the layout the communicator
found (``comm.hosts``), priced with the link constants its ranks agreed at init
(``comm.settings.remote``, measured by ``ringcomm.bootstrap.link_probe``), the agreed
local constants and the cores per rank of the agreed topology: what the communicator's own
choice is made from. ``python -m ringcomm_bench.multihost table A.json [B.json ...]`` prints
docs/benchmarks.md's table of saved runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import adapter
from .common import RankFailed, format_size, parse_size

ROOT = Path(__file__).resolve().parent.parent
STORE_PORTS = (29500, 29501)  # fresh namespaces every run: fixed ports cannot collide
_RATE = re.compile(r"^\d+(?:\.\d+)?(?:bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_RATE_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
              "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


@dataclass(frozen=True)
class Layout:
    """Where the ranks go: ``hosts`` simulated hosts of ``ranks`` ranks each."""

    hosts: int
    ranks: int
    rate: str | None = None  # tc's words, e.g. "1gbit"; None: unshaped
    shared_cpus: bool = False

    @property
    def world(self) -> int:
        return self.hosts * self.ranks

    def __str__(self) -> str:
        return f"{self.hosts}x{self.ranks}"

    def host_of(self, rank: int) -> int:
        return rank // self.ranks


def parse_layout(text: str) -> tuple[int, int]:
    """``"2x2"`` -> (2 hosts, 2 ranks each)."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"--hosts {text!r}: use HOSTSxRANKS, e.g. 2x2 (two hosts of two ranks)")
    hosts, ranks = int(match.group(1)), int(match.group(2))
    if hosts < 1 or ranks < 1:
        raise ValueError(f"--hosts {text!r}: at least one host of at least one rank")
    if hosts > 64:
        raise ValueError(f"--hosts {text!r}: at most 64 simulated hosts")
    return hosts, ranks


def parse_rate(text: str) -> str:
    """A ``tc`` rate (``1gbit``, ``200mbit``, ``100mbps``), lower-cased; else ValueError."""
    rate = text.strip().lower()
    if not _RATE.fullmatch(rate) or rate_bits(rate) <= 0:
        raise ValueError(f"--rate {text!r}: use a tc rate such as 1gbit, 200mbit or 100mbps")
    return rate


def rate_bits(rate: str) -> float:
    """A tc rate in bits per second (``mbps`` is megabytes per second, as tc reads it)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]+)", rate)
    assert match is not None
    return float(match.group(1)) * _RATE_BITS[match.group(2)]


def cpu_groups(hosts: int, shared: bool) -> list[list[int] | None]:
    """Each host's cores: this process's usable cores cut into ``hosts`` contiguous groups
    (None, every core, for all when ``shared`` or when there are fewer cores than hosts)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return [None] * hosts
    if shared or len(cpus) < hosts:
        return [None] * hosts
    per, extra = divmod(len(cpus), hosts)
    out: list[list[int] | None] = []
    start = 0
    for h in range(hosts):
        size = per + (h < extra)
        out.append(cpus[start:start + size])
        start += size
    return out


# --------------------------------------------------------------------------- the model


def modelled_on_hosts(collective: str, algorithm: str | None, comm: Any, nbytes: int,
                      itemsize: int) -> tuple[str | None, float | None]:
    """(the allreduce algorithm the communicator runs, None for other collectives; the cost
    model's seconds for one call) on ``comm``'s hosts, priced with its agreed constants."""
    from ringcomm.plan import cost

    n = comm.world_size
    params = comm.settings.cost_params(n)
    remote = comm.settings.remote or cost.DEFAULT_REMOTE_PARAMS
    share = comm.topology.cores_per_rank
    if collective == "allreduce":
        chosen: str = comm.allreduce_algorithm(nbytes, itemsize, algorithm)
        if nbytes == 0:
            return chosen, None
        return chosen, cost.predict("allreduce", chosen, n, nbytes, itemsize,
                                    segment_bytes=comm.segment_bytes, params=params,
                                    hosts=comm.hosts, remote=remote, share=share)
    if nbytes == 0:
        return None, None
    where = {rank: h for h, ranks in enumerate(comm.hosts) for rank in ranks}
    schedules = adapter.schedules_for(collective, n, nbytes // itemsize, itemsize,
                                      max(1, comm.segment_bytes // itemsize))
    replay = cost.simulate(schedules, itemsize, params, remote,
                           tuple(where[r] for r in range(n)))
    return None, replay.time(params, share, remote)


def layout_facts(comm: Any) -> dict[str, Any]:
    """What rank 0 tells the driver once: the layout the communicator found and the
    constants its ranks agreed (for the JSON file)."""
    remote = comm.settings.remote
    return {
        "hosts": [list(h) for h in comm.hosts],
        "hostnames": [f.hostname for f in comm.topology.ranks],
        "cpus": [list(f.cpus) for f in comm.topology.ranks],
        "cores_per_rank": comm.topology.cores_per_rank,
        "segment_bytes": comm.segment_bytes,
        "local": asdict(comm.settings.cost_params(comm.world_size)),
        "remote": asdict(remote) if remote is not None else None,
        "describe": comm.transport.describe(),
    }


# --------------------------------------------------------------------------- rank side


def rank_entry(run_dir: Path, rank: int) -> int:
    """One rank, inside its host: run the job in ``run_dir/job.pkl``, reporting to
    ``run_dir/rankR.jsonl`` (a traceback too, if it raises)."""
    events = open(run_dir / f"rank{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def report(kind: str, payload: Any = None) -> None:
        events.write(json.dumps([kind, rank, payload]) + "\n")
        events.flush()

    try:
        with open(run_dir / "job.pkl", "rb") as f:
            target, world, args = pickle.load(f)
        target(rank, world, report, *args)
    except BaseException:  # the driver must hear about every failure
        report("error", traceback.format_exc())
        events.close()
        return 1
    report("done")
    events.close()
    return 0


# --------------------------------------------------------------------------- driver side


class _Follow:
    """The complete lines a rank has appended to its report file since the last look."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self) -> list[Any]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *whole, self.partial = (self.partial + data).split(b"\n")
        return [json.loads(line) for line in whole if line.strip()]


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no output)"
    text = text[-chars:].strip()
    return text or "(no output)"


def _rank_env(ifname: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["RINGCOMM_SOCKET_IFNAME"] = ifname  # each host's own data interface, one name for all
    env["GLOO_SOCKET_IFNAME"] = ifname
    env.pop("RINGCOMM_IFADDR", None)  # an address of this machine's would be wrong in there
    return env


def launch(layout: Layout, target: Callable, args_for: Callable[[str], tuple],
           timeout: float) -> Generator[tuple, None, None]:
    """``common.launch`` on simulated hosts: make them, start ``target(rank, world, report,
    *args_for(first_host_address))`` in each host's namespace, and yield ``(kind, rank,
    payload)`` for every report but ``done``. Raises ``RankFailed`` when a rank fails or
    exits without finishing, or nothing is heard for ``timeout`` seconds. The hosts, and
    every process in them, are gone when this generator ends (close it: ``with
    contextlib.closing(...)``)."""
    from . import netns

    why = netns.available()
    if why is not None:
        raise RankFailed(f"--hosts needs simulated hosts, which cannot be made here: {why}")
    run_dir = Path(tempfile.mkdtemp(prefix="ringcomm-bench-hosts-"))
    try:
        with _made(netns, layout) as hosts:
            with open(run_dir / "job.pkl", "wb") as f:
                pickle.dump((target, layout.world, args_for(hosts[0].address)), f)
            cpus = cpu_groups(layout.hosts, layout.shared_cpus)
            procs = []
            for rank in range(layout.world):
                h = layout.host_of(rank)
                with open(run_dir / f"rank{rank}.log", "wb") as log:
                    procs.append(hosts[h].popen(
                        [sys.executable, "-m", "ringcomm_bench.multihost", "rank", str(run_dir),
                         str(rank)], cpus=cpus[h], env=_rank_env(hosts[h].ifname), cwd=ROOT,
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
            yield from _follow(procs, run_dir, timeout)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def _made(netns: Any, layout: Layout) -> Iterator[list]:
    """``netns.hosts`` for ``layout``, its failures to make them as ``RankFailed``."""
    try:
        made = netns.hosts(layout.hosts, layout.rate)
        hosts = made.__enter__()
    except netns.NetnsError as err:
        raise RankFailed(f"could not make {layout.hosts} simulated hosts: {err}") from None
    with contextlib.ExitStack() as stack:
        stack.push(made)  # its __exit__ removes them, whatever ends the block
        yield hosts


def _follow(procs: Sequence[subprocess.Popen], run_dir: Path,
            timeout: float) -> Iterator[tuple]:
    world = len(procs)
    files = [_Follow(run_dir / f"rank{r}.jsonl") for r in range(world)]
    done: set[int] = set()
    last = time.monotonic()

    def output(ranks: Sequence[int], chars: int) -> str:
        return "".join(f"\n--- rank {r}'s output:\n{_tail(run_dir / f'rank{r}.log', chars)}"
                       for r in ranks)

    while len(done) < world:
        heard = False
        for rank, follow in enumerate(files):
            for kind, _, payload in follow.lines():
                heard = True
                if kind == "done":
                    done.add(rank)
                elif kind == "error":
                    raise RankFailed(f"rank {rank} of {world} failed:\n{payload}")
                else:
                    yield kind, rank, payload
        if heard:
            last = time.monotonic()
            continue
        for rank, proc in enumerate(procs):
            code = proc.poll()
            if code is not None and rank not in done:
                for kind, _, payload in files[rank].lines():  # written just before it exited
                    if kind == "error":
                        raise RankFailed(f"rank {rank} of {world} failed:\n{payload}")
                    if kind == "done":
                        done.add(rank)
                if rank not in done:
                    raise RankFailed(f"rank {rank} of {world} exited with code {code} before "
                                     f"finishing (killed? out of memory?){output([rank], 3000)}")
        if len(done) < world and time.monotonic() - last > timeout:
            raise RankFailed(
                f"no word from any of the {world} ranks for {timeout:.0f} s; they are hung "
                f"or far slower than expected (raise --timeout if the sizes are large or the "
                f"link slow){output(range(world), 600)}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- summary


def summary(rows: list[dict]) -> list[dict]:
    """Per allreduce size on several hosts: ring, hier and the automatic choice side by
    side (busbw, time, predicted time), hier's busbw over the ring's, and the automatic
    choice's time over the faster of the two."""
    out = []
    by_size: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["collective"] == "allreduce" and r["library"] == "ringcomm":
            key = (r["world_size"], r["dtype"], r["op"], r["bytes"])
            by_size.setdefault(key, {})[r["algorithm"] or "auto"] = r
    for (world, dtype, op, nbytes), found in by_size.items():
        ring, hier, auto = found.get("ring"), found.get("hier"), found.get("auto")
        entry: dict[str, Any] = {"world_size": world, "dtype": dtype, "op": op,
                                 "bytes": nbytes}
        for name, row in (("ring", ring), ("hier", hier), ("auto", auto)):
            if row is not None:
                entry[name] = {"time_us": row["time_us"], "min_time_us": row["min_time_us"],
                               "busbw_GBps": row["busbw_GBps"],
                               "predicted_us": row["predicted_us"], "chosen": row["chosen"],
                               "wrong": row["wrong"]}
        if ring and hier:
            entry["hier_over_ring_busbw"] = hier["busbw_GBps"] / ring["busbw_GBps"]
            if auto:
                best = min(ring["time_us"], hier["time_us"])
                entry["auto_over_best_time"] = auto["time_us"] / best
        out.append(entry)
    return out


def print_summary(entries: list[dict], console: Any) -> None:
    """The summary as a table (nothing without ring and hier rows)."""
    entries = [e for e in entries if "hier_over_ring_busbw" in e]
    if not entries:
        return
    from rich.table import Table

    table = Table(title="allreduce on several hosts: hier against ring", title_justify="left",
                  show_edge=False, pad_edge=False)
    for name in ("world", "size", "ring busbw", "hier busbw", "hier / ring", "auto",
                 "auto / best"):
        table.add_column(name, justify="left" if name == "auto" else "right")
    for e in entries:
        auto = e.get("auto")
        table.add_row(str(e["world_size"]), format_size(e["bytes"]),
                      f"{e['ring']['busbw_GBps']:.3f}", f"{e['hier']['busbw_GBps']:.3f}",
                      f"{e['hier_over_ring_busbw']:.2f}x", auto["chosen"] if auto else "-",
                      f"{e['auto_over_best_time']:.2f}x" if auto else "-")
    console.print(table)
    console.print()


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:,.1f}"


def markdown(runs: list[dict], sizes: set[int] | None = None) -> str:
    """The table docs/benchmarks.md quotes: per saved run (one link each) and size, busbw
    and time of ring, hier and the automatic choice with the model's time beside each."""
    head = ["link", "size", "ring busbw (GB/s)", "ring ms (pred)", "hier busbw (GB/s)",
            "hier ms (pred)", "hier / ring busbw", "auto: chosen", "auto busbw (GB/s)",
            "auto ms (pred)", "auto / faster"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        link = (run.get("hosts") or {}).get("rate") or "unlimited"
        for e in summary(run["rows"]):
            if sizes is not None and e["bytes"] not in sizes:
                continue
            cells = [link, format_size(e["bytes"])]
            for name in ("ring", "hier"):
                r = e.get(name)
                cells += (["-", "-"] if r is None else
                          [f"{r['busbw_GBps']:.3f}",
                           f"{_ms(r['time_us'])} ({_ms(r['predicted_us'])})"])
            cells.append(f"{e['hier_over_ring_busbw']:.2f}x"
                         if "hier_over_ring_busbw" in e else "-")
            auto = e.get("auto")
            cells += (["-"] * 3 if auto is None else
                      [auto["chosen"] or "-", f"{auto['busbw_GBps']:.3f}",
                       f"{_ms(auto['time_us'])} ({_ms(auto['predicted_us'])})"])
            cells.append(f"{e['auto_over_best_time']:.2f}x" if "auto_over_best_time" in e
                         else "-")
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringcomm_bench.multihost",
                                description=__doc__.split("\n\n")[0].replace("``", ""))
    sub = p.add_subparsers(dest="what", required=True)
    rank = sub.add_parser("rank", help="one rank inside its host (started by the driver)")
    rank.add_argument("dir", type=Path)
    rank.add_argument("rank", type=int)
    table = sub.add_parser("table",
                           help="the table of saved --hosts runs docs/benchmarks.md quotes")
    table.add_argument("json", type=Path, nargs="+")
    table.add_argument("--sizes", nargs="+", type=parse_size, default=None,
                       help="only these sizes (e.g. 1M 16M 64M)")
    args = p.parse_args(argv)
    if args.what == "rank":
        return rank_entry(args.dir, args.rank)
    runs = [json.loads(path.read_text()) for path in args.json]
    print(markdown(runs, None if args.sizes is None else set(args.sizes)))
    with contextlib.suppress(KeyError):
        for run in runs:
            print(f"\n`{run['command']}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
