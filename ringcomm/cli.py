"""ringcomm's command line: print schedules, serve a store, tune, benchmark, report.

    ringcomm schedule allreduce --world-size 4 --count 8      # every rank's steps
    ringcomm schedule allreduce -n 4 -c 8 --rank 1 --segment 1
    ringcomm schedule allreduce_dbtree -n 8 -c 16 --rank 3      # the other algorithms
    ringcomm schedule --choices -n 4                           # what runs, by size, and why
    ringcomm explain --algo ring -n 4 --svg ring.svg           # round by round, with buffers
    ringcomm trace merge traces/ -o trace.json                 # RINGCOMM_TRACE's files
    ringcomm trace plot trace.json -o timeline.png
    ringcomm store --port 29500                                # a stand-alone store
    ringcomm tune -n 2 4                                       # fit the cost model here
    ringcomm bench --quick                                     # against gloo (and nccl)
    ringcomm env                                               # for bug reports
    ringcomm --version                                         # also: python -m ringcomm

``schedule`` prints exactly the step lists the executor runs, so a reader can follow a
collective rank by rank: which chunk goes to which neighbour in which round; with
``--choices`` it prints what the selector runs for each collective and size, and why.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ._support import install_hint
from ._version import __version__
from .errors import ArgumentError
from .plan.collectives import COLLECTIVES, Collective
from .schedules import HOST_AWARE, Schedule
from .transport.board import SLOT_BYTES

# builder(rank, world_size, count, segment, root) -> that rank's schedule
_Builder = Callable[[int, int, int, int, int], Schedule]


def _schedule_entries() -> dict[str, tuple[str, _Builder]]:
    """``ringcomm schedule``'s names, from the table of collectives: each collective's main
    algorithm under the collective's name, its others as ``NAME_WORD`` (``allreduce_tree``,
    ``broadcast_binomial``); none that needs the hosts' layout, which this command has no
    option for. Name -> (help, builder(rank, world_size, count, segment, root))."""
    entries: dict[str, tuple[str, _Builder]] = {}
    for spec in COLLECTIVES.values():
        for i, algorithm in enumerate(spec.algorithms.values()):
            if algorithm.name in HOST_AWARE:
                continue
            name = spec.name if i == 0 else f"{spec.name}_{algorithm.word}"
            entries[name] = (algorithm.summary, _builder(spec, algorithm.name))
    return entries


def _builder(spec: Collective, algorithm: str) -> _Builder:
    """``spec``'s schedules by ``algorithm``, called the way this command calls them all."""

    def build(rank: int, world_size: int, count: int, segment: int, root: int) -> Schedule:
        return spec.schedule(rank, world_size, count, segment, root=root, algorithm=algorithm,
                             piece=SLOT_BYTES // 4)  # a post's worth of float32
    return build


_SCHEDULES = _schedule_entries()


_EPILOG = ("Most users meet ringcomm through torch: dist.init_process_group(\"ringcomm\") "
           "under torchrun. RINGCOMM_DEBUG=INFO prints one line per rank at start-up, "
           "DEBUG one per op.")


def _check_output(path: str | None, option: str, *, makes_folders: bool = False) -> None:
    """Refuse an output file that cannot be written before the work that ends by writing it
    (a whole run, for ``explain`` and ``tune``), rather than fail with a traceback after.
    ``makes_folders``: the command creates missing folders itself, so only the nearest
    existing one must be writable."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise ArgumentError(f"{option} {path} is a folder: name a file to write")
    folder = target.parent
    if makes_folders:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
    elif not folder.exists():
        raise ArgumentError(f"{option} {path}: the folder {folder} does not exist; create it "
                            "or name a file in a folder that does")
    if not folder.is_dir():
        raise ArgumentError(f"{option} {path}: {folder} is a file, not a folder; name a file "
                            "in a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ArgumentError(f"{option} {path}: the folder {folder} is not writable here; "
                            "name a file in one that is")


def _print_choices(args: argparse.Namespace) -> None:
    """The selector's table for a group of this machine's kind: ``--world-size`` ranks on
    one host (with the shared board where this host has one, unless ``--no-board``), or
    ``--hosts HxR``."""
    from .plan.select import Group, Selector, choices
    from .plan.settings import Settings
    from .plan.topology import Topology, hosts_layout
    from .runtime.local import simulated_hosts
    from .transport import board, shm_ring

    if args.hosts:
        layout = hosts_layout(args.hosts)
        world = sum(len(ranks) for ranks in layout)
        topology = simulated_hosts(world, layout)
        has_board = False
    else:
        world = args.world_size
        if world < 1:
            raise ArgumentError(f"--world-size must be at least 1, got {world}")
        topology = Topology.single_host(world)
        has_board = world > 1 and not args.no_board and board.wanted() and \
            shm_ring.available()
    settings = Settings.local()
    selector = Selector(Group(world, has_board, settings, topology, settings.segment_bytes))
    collectives = [args.collective] if args.collective else None
    where = f"{args.hosts} hosts x ranks" if args.hosts else \
        f"one host, {'with' if has_board else 'without'} a shared board"
    print(f"what runs for {world} ranks ({where}), by size (float32, sizes at powers of two):")
    rows = [("collective", "sizes", "engine", "algorithm", "why")]
    for band in choices(selector, collectives):
        rows.append((band.collective, band.sizes, band.choice.engine, band.choice.algorithm,
                     band.choice.why))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        print("  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4]))
              + "  " + row[4])


def _print_schedules(args: argparse.Namespace) -> None:
    if args.choices:
        _print_choices(args)
        return
    if args.collective is None:
        raise ArgumentError("name a collective to print its steps, or pass --choices")
    if args.world_size < 1:
        raise ArgumentError(f"--world-size must be at least 1, got {args.world_size}")
    if args.count < 0:
        raise ArgumentError(f"--count must not be negative, got {args.count}")
    if not 0 <= args.root < args.world_size:
        raise ArgumentError(f"--root {args.root} is out of range for world size "
                            f"{args.world_size}")
    segment = args.segment if args.segment else max(args.count, 1)
    if segment < 1:
        raise ArgumentError(f"--segment must be positive, got {args.segment}")
    ranks = [args.rank] if args.rank is not None else range(args.world_size)
    build = _SCHEDULES[args.collective][1]
    for i, rank in enumerate(ranks):
        if not 0 <= rank < args.world_size:
            raise ArgumentError(f"--rank {rank} is out of range for world size "
                                f"{args.world_size}")
        if i:
            print()
        print(build(rank, args.world_size, args.count, segment, args.root))


def _explain(args: argparse.Namespace) -> None:
    from .plan.topology import hosts_layout
    from .teach import explain

    if args.world_size < 1:
        raise ArgumentError(f"--world-size must be at least 1, got {args.world_size}")
    _check_output(args.svg, "--svg")
    _check_output(args.html, "--html")
    ex = explain(args.collective, args.algo, args.world_size, args.count, root=args.root,
                 op=args.op, segment=args.segment,
                 hosts=hosts_layout(args.hosts) if args.hosts else None)
    if args.animate:
        from .teach.animate import animate

        animate(ex, delay=args.delay)
    else:
        from .teach.text import render

        print(render(ex))
    from .teach import page, svg

    for path, make in ((args.svg, svg.draw), (args.html, page.page)):
        if path:
            with open(path, "w", encoding="utf-8") as out:
                out.write(make(ex))
            print(f"wrote {path}")


def _serve_store(args: argparse.Namespace) -> None:
    from .bootstrap.store import serve
    from .errors import StoreError

    try:
        serve(args.host, args.port)
    except StoreError as err:  # the port is taken, the address is not this host's...
        raise SystemExit(f"ringcomm store: error: {err}") from None


def _tune(args: argparse.Namespace) -> None:
    from . import tune

    _check_output(args.output, "-o", makes_folders=True)
    argv = ["-n", *map(str, args.world_sizes)] + (["--quick"] if args.quick else [])
    argv += ["--device", args.device] if args.device else []
    tune.main(argv + (["-o", args.output] if args.output else []))


def _env(args: argparse.Namespace) -> None:
    from .environment import problems, report

    print(report())
    if found := problems():
        print(f"ringcomm env: {found} RINGCOMM_* variable{'s' if found > 1 else ''} set here "
              f"{'are' if found > 1 else 'is'} invalid or unknown: see the lines marked ! "
              "under settings", file=sys.stderr)


def _trace(args: argparse.Namespace) -> None:
    if args.action == "merge":
        from .observe.merge import main as merge

        output = args.output or "trace.json"
        _check_output(output, "-o")
        print(merge(args.source, output))
    else:
        from .observe.plot import main as plot

        output = args.output or "timeline.png"
        _check_output(output, "-o")
        print(plot(args.source, output))


def _plugin(name: str, argv: list[str]) -> None:
    """A command another package provides through the ``ringcomm.commands`` entry points:
    ``bench`` is the harness in ``bench/`` (installed as ``ringcomm_bench``), which depends
    on ringcomm, never the other way round. It says itself which extra a run needs."""
    from importlib.metadata import entry_points

    found = [ep for ep in entry_points(group="ringcomm.commands") if ep.name == name]
    try:
        if not found:
            raise ImportError(f"no installed package provides the command {name!r} (an "
                              "install older than its entry point: reinstall ringcomm)")
        command = found[0].load()
    except ImportError as err:
        raise SystemExit(f"ringcomm {name}: the benchmark harness cannot be loaded ({err}); "
                         f"install ringcomm with its extra: {install_hint('bench')}") from None
    raise SystemExit(command(argv))


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its options are its own, parsed by the bench package
        _plugin("bench", argv[1:])
    parser = argparse.ArgumentParser(
        prog="ringcomm", description=__doc__.split("\n\n")[0] + "\n\n" + _EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ringcomm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sched = sub.add_parser("schedule", help="print a collective's steps, rank by rank",
                           description="Print the step lists the executor runs.")
    sched.add_argument("collective", nargs="?", choices=sorted(_SCHEDULES),
                       help="; ".join(f"{k}: {v[0]}" for k, v in _SCHEDULES.items()))
    sched.add_argument("--choices", action="store_true",
                       help="print what the selector runs for each collective (or the one "
                       "named) and size band, on which engine, and why")
    sched.add_argument("--hosts", default=None, metavar="HxR",
                       help="with --choices: H hosts of R ranks each (no shared board)")
    sched.add_argument("--no-board", action="store_true",
                       help="with --choices: a group without the shared board")
    sched.add_argument("-n", "--world-size", type=int, default=4)
    sched.add_argument("-c", "--count", type=int, default=8, help="elements")
    sched.add_argument("-s", "--segment", type=int, default=0,
                       help="elements per message (default: whole chunks)")
    sched.add_argument("--rank", type=int, default=None, help="only this rank")
    sched.add_argument("--root", type=int, default=0)
    sched.set_defaults(run=_print_schedules)

    explain = sub.add_parser(
        "explain", help="run a collective in-process and explain it round by round",
        description="Run one collective for real over in-memory links and show, round by "
        "round, which chunk each rank sends, receives and reduces, every rank's buffers "
        "after each round (rank r starts with (r + 1) * (i + 1) at element i), the result "
        "checked against numpy, and the cost by the cost model against an everyone-to-"
        "everyone exchange and a parameter server. --svg draws the rounds, --html writes an "
        "animated page, --animate steps through them in the terminal.")
    explain.add_argument("--algo", default=None, metavar="NAME",
                         help="the algorithm: for allreduce ring (default), tree, dbtree, hd, "
                         "rd, hier (with --hosts); for broadcast chain (default) or binomial; the "
                         "others have one")
    explain.add_argument("--collective", default="allreduce", choices=list(COLLECTIVES))
    explain.add_argument("-n", "--world-size", type=int, default=4)
    explain.add_argument("-c", "--count", type=int, default=None,
                         help="elements of the vector, or of one rank's block for the "
                         "collectives with a block per rank (default: one element per "
                         "rank for a vector, two for a block)")
    explain.add_argument("-s", "--segment", type=int, default=0,
                         help="elements per message (default: whole chunks)")
    explain.add_argument("--hosts", default=None, metavar="HxR",
                         help="H hosts of R ranks each (sets the world size); hier needs it")
    explain.add_argument("--root", type=int, default=0)
    explain.add_argument("--op", default="sum", choices=["sum", "prod", "min", "max"])
    explain.add_argument("--svg", default=None, metavar="FILE", help="draw the rounds")
    explain.add_argument("--html", default=None, metavar="FILE",
                         help="write one self-contained page that animates the rounds")
    explain.add_argument("--animate", action="store_true",
                         help="step through the rounds in this terminal")
    explain.add_argument("--delay", type=float, default=1.5,
                         help="seconds a round stays on screen with --animate")
    explain.set_defaults(run=_explain)

    store = sub.add_parser(
        "store", help="serve a rendezvous store until interrupted",
        description="Serve the key-value store ranks meet through, apart from any rank: "
        "start it, then give every rank store='HOST:PORT' (ringcomm.init), and rank 0 "
        "joins it instead of serving one itself: quietly with RINGCOMM_STORE=join, with "
        "a warning by default (RINGCOMM_STORE=serve refuses it).")
    store.add_argument("--host", default="127.0.0.1",
                       help="interface address to listen on (default: loopback, for ranks "
                       "of this host only; 0.0.0.0 for all, then set RINGCOMM_AUTH_TOKEN too)")
    store.add_argument("--port", type=int, default=29500,
                       help="TCP port to listen on (default: 29500)")
    store.set_defaults(run=_serve_store)

    env = sub.add_parser("env", help="versions, cores, settings and links here (for bug "
                         "reports)", description="Print what a bug report needs: versions, "
                         "platform, cores and affinity, the cost profile in use, every "
                         "RINGCOMM_* setting and its class, and what links this host has.")
    env.set_defaults(run=_env)

    tune = sub.add_parser("tune", help="measure this machine and fit the cost model",
                          description="Time every allreduce algorithm on localhost ranks and "
                          "write the fitted cost profile that the communicator reads.")
    tune.add_argument("-n", "--world-sizes", type=int, nargs="+", default=[2, 4])
    tune.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    tune.add_argument("-o", "--output", default=None, help="profile file (default: "
                      "$RINGCOMM_PROFILE or ~/.cache/ringcomm/profile.json)")
    tune.add_argument("--device", choices=["cuda", "fake"], default=None,
                      help="tune the device engines (cuda-ipc, staged) on this device "
                      "instead, keeping the host constants the profile file holds")
    tune.set_defaults(run=_tune)

    trace = sub.add_parser("trace", help="merge the timelines of RINGCOMM_TRACE, or plot one",
                           description="merge FOLDER: every rank's timeline (rank<N>.json) on "
                           "rank 0's clock, in one Chrome trace-event file for Perfetto or "
                           "chrome://tracing, with each clock's offset and error. plot FILE: "
                           "draw a timeline as a PNG (matplotlib).")
    trace.add_argument("action", choices=("merge", "plot"))
    trace.add_argument("source", help="merge: the folder of rank files; plot: a timeline")
    trace.add_argument("-o", "--output", default=None,
                       help="default: trace.json (merge), timeline.png (plot)")
    trace.set_defaults(run=_trace)

    sub.add_parser("bench", add_help=False,
                   help="benchmark the collectives against gloo and nccl, or DDP training "
                   "(ringcomm bench --help, ringcomm bench ddp --help)")

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ArgumentError as err:
        parser.exit(2, f"ringcomm: error: {err}\n")
    except BrokenPipeError:  # the reader left (``ringcomm explain ... | head``): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)  # the interpreter's own flush at exit
        os.dup2(devnull, sys.stdout.fileno())       # must not fail on the closed pipe either
        raise SystemExit(0) from None


if __name__ == "__main__":
    main()
