"""``ringcomm bench ddp``: training step time of torch's DistributedDataParallel and of ours
(``ringcomm_ddp``, the ``ddp/`` folder) over ringcomm and over Gloo, in the same processes.

    ringcomm bench ddp                       # a small MLP and a small convnet, world 2
    ringcomm bench ddp -n 2 4 --json ddp.json
    ringcomm bench ddp --ddp ours            # only our DDP, on both backends

Why this and not only the sweep: DDP is what data-parallel training actually runs. It cuts
the gradients into buckets and all-reduces each one asynchronously while backward is still
computing the rest, so what counts is how the backend shares the cores with autograd, not
only its bandwidth. Every rank joins Gloo as the default group and ringcomm through
``dist.new_group(backend="ringcomm")``; the same model, starting from the same weights,
is wrapped once per group and DDP implementation (torch's ``nn.parallel`` one and
``ddp.DistributedDataParallel``, both with their default buckets: 1 MiB first, 25 MiB cap).
Repetitions take turns (in a new shuffled order each time),
each ``--steps`` steps of forward, backward (with DDP's all-reduces) and SGD; a
repetition's time is the slowest rank's, and the step time is the median over
repetitions. The ``local`` row runs the same step without DDP: the compute alone, the
floor for both backends. The ``none`` row runs torch's DDP with a comm hook that returns at
once: DDP's own cost (its buckets' copies, its hooks), the same on any backend, with no
communication at all; *beyond DDP's own* compares what each backend adds over that row.

Every replica sees the same batches, so after the run the weights trained by every DDP
replica must agree (up to the order of floating-point additions); ``max diff`` is the
largest difference, and a run where they disagree fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .backends import RUNNERS, TORCH, RankContext
from .common import RankFailed, free_port, launch, machine_info, turn_order

MODELS = ("mlp", "convnet")
# each backend of this benchmark -> the runner (``backends.RUNNERS``) its DDP trains over:
# ringcomm through torch.distributed, as DDP runs it; Gloo, the default group, joins first
DDP_RUNNERS = {"gloo": "gloo", "ringcomm": TORCH}
BACKENDS = ("ringcomm", "gloo")
NO_COMM = "none"  # the backend name of torch's DDP with a hook that communicates nothing
DDPS = ("torch", "ours")  # torch.nn.parallel.DistributedDataParallel, ddp.DistributedDataParallel


def build_model(kind: str) -> tuple[Any, Any]:
    """A small model and a function giving one rank's batch: ``(inputs, targets)``."""
    import torch
    from torch import nn

    if kind == "mlp":  # MNIST-sized: 1.9 M parameters, 7.1 MiB of gradients
        model = nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(),
                              nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        shape, batch = (1, 28, 28), 64
    elif kind == "convnet":  # CIFAR-sized: 1.1 M parameters, mostly in the first linear layer
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(), nn.Linear(256, 10))
        shape, batch = (3, 32, 32), 32
    else:
        raise ValueError(f"unknown model {kind!r}; choose from {', '.join(MODELS)}")

    def batch_for(rank: int, step: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(1000 * step + rank)
        return (torch.randn(batch, *shape, generator=g),
                torch.randint(0, 10, (batch,), generator=g))
    return model, batch_for


def _no_communication(state, bucket):
    """A DDP comm hook that communicates nothing: the bucket, as it is, at once. (Without
    annotations: DDP refuses a hook whose annotations are not its own types, and this
    module's are strings.)"""
    import torch

    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def rank_main(rank: int, world: int, report: Any, args: argparse.Namespace) -> None:
    """One rank: both process groups, then every model on every backend, interleaved."""
    import torch

    torch.set_num_threads(1)
    # Gloo's store on the port given; this benchmark never joins the Communicator itself
    where = RankContext(rank, world, "127.0.0.1", (args.port, 0), args.timeout, report)
    runners = {name: RUNNERS[runner] for name, runner in DDP_RUNNERS.items()}
    groups = {name: runner.join(where) for name, runner in runners.items()}  # Gloo first
    for kind in args.models:
        rows = _bench_model(kind, rank, world, args, groups, report)
        if rank == 0:
            report("rows", rows)
    for name, runner in reversed(runners.items()):
        runner.leave(groups[name])


PHASES = ("forward", "backward", "tail", "optimizer")  # of a step, see ``_Replica``


class _Replica:
    """One copy of the model (DDP over one group, or plain: ``wrap`` None), its optimizer and
    its batches. Each step's time is split into ``PHASES``: the forward pass, backward up to
    the moment the last gradient is accumulated, the *tail* from there until ``backward()``
    returns (DDP's last bucket: its launch, the wait for it and every bucket's copy back into
    the gradients), and the optimizer's step. The moment of the last gradient is taken by a
    hook on every parameter registered before DDP wraps the model, so it runs before DDP's own."""

    def __init__(self, model: Any, batches: list, wrap: Any = None, lr: float = 0.01) -> None:
        import torch
        from torch import nn

        self._last_gradient = 0.0
        for param in model.parameters():
            param.register_post_accumulate_grad_hook(self._gradient)
        self.model = model if wrap is None else wrap(model)
        self.batches, self.done = batches, 0
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.loss_fn = nn.CrossEntropyLoss()
        self.phases: list[tuple[float, ...]] = []  # seconds of each of ``PHASES``, per step

    def _gradient(self, param: Any) -> None:
        self._last_gradient = time.perf_counter()

    def step(self) -> None:
        x, y = self.batches[self.done % len(self.batches)]
        self.done += 1
        self.opt.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss = self.loss_fn(self.model(x), y)
        forward = time.perf_counter()
        loss.backward()  # DDP all-reduces buckets during this
        backward = time.perf_counter()
        self.opt.step()
        last = max(forward, min(self._last_gradient, backward))
        self.phases.append((forward - start, last - forward, backward - last,
                            time.perf_counter() - backward))


def _bench_model(kind: str, rank: int, world: int, args: argparse.Namespace,
                 groups: dict[str, Any], report: Any) -> list[dict]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    import ringcomm_ddp as ddp

    wrappers = {"torch": TorchDDP, "ours": ddp.DistributedDataParallel}
    torch.manual_seed(0)
    base, batch_for = build_model(kind)
    batches = [batch_for(rank, i) for i in range(8)]
    replicas: dict[tuple[str, str | None], _Replica] = {
        ("local", None): _Replica(copy.deepcopy(base), batches)}
    for name in args.backends:
        for impl in args.ddp:
            replicas[name, impl] = _Replica(
                copy.deepcopy(base), batches,
                lambda m, impl=impl, name=name: wrappers[impl](m, process_group=groups[name]))
    if "torch" in args.ddp:  # DDP's own cost: its hook answers at once, nothing is sent
        def alone(m: Any) -> Any:
            wrapped = TorchDDP(m, process_group=groups["gloo"])
            wrapped.register_comm_hook(None, _no_communication)
            return wrapped
        replicas[NO_COMM, "torch"] = _Replica(copy.deepcopy(base), batches, alone)
    names = list(replicas)
    for replica in replicas.values():
        for _ in range(args.warmup):
            replica.step()
        replica.phases.clear()
    times: dict[tuple, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in (names[i] for i in turn_order(len(names), rep)):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                replicas[name].step()
            elapsed = torch.tensor([(time.perf_counter() - start) / args.steps],
                                   dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
        if rank == 0:
            report("progress", (kind, rep))
    # same batches, same start, same number of steps: the DDP replicas must agree (but the
    # one that communicates nothing, whose ranks each follow their own gradients)
    synced = [name for name in replicas if name[1] is not None and name[0] != NO_COMM]
    flat = [torch.cat([p.detach().reshape(-1) for p in replicas[name].model.parameters()])
            for name in synced]
    diff = torch.tensor([max(float((f - flat[0]).abs().max()) for f in flat)],
                        dtype=torch.float64)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    params = sum(p.numel() for p in base.parameters())
    # each phase's median over this rank's steps, the slowest rank's
    phases = torch.tensor([[statistics.median(column)
                            for column in zip(*replicas[n].phases, strict=True)]
                           for n in names], dtype=torch.float64)
    dist.all_reduce(phases, op=dist.ReduceOp.MAX)
    phase_ms = {n: dict(zip(PHASES, (v * 1e3 for v in phases[i].tolist()), strict=True))
                for i, n in enumerate(names)}
    return [{
        "model": kind, "world_size": world, "backend": name, "ddp": impl, "params": params,
        "grad_MiB": params * 4 / 2**20, "step_ms": statistics.median(t) * 1e3,
        "min_step_ms": min(t) * 1e3, "rep_step_ms": [v * 1e3 for v in t],
        "max_weight_diff": float(diff) if (name, impl) in synced else None,
        "phase_ms": phase_ms[name, impl],
        "steps": args.steps, "reps": args.reps, "warmup": args.warmup,
    } for (name, impl), t in times.items()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringcomm bench ddp", description=" ".join(
        __doc__.split("\n\n")[0].replace("``", "").split()))
    p.add_argument("-n", "--world-sizes", type=int, nargs="+", default=[2])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--ddp", nargs="+", default=list(DDPS), choices=DDPS,
                   help="DDP implementations: torch's, ours (ringcomm_ddp, the ddp/ folder), "
                   "or both")
    p.add_argument("--steps", type=int, default=10, help="training steps per repetition")
    p.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per replica")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    p.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds without progress before the run is declared hung")
    return p


def print_table(rows: list[dict], console: Any) -> None:
    from rich.table import Table

    table = Table(title="DDP training step (median over repetitions, slowest rank)",
                  title_justify="left", show_edge=False, pad_edge=False)
    for name in ("model", "world", "params", "grads (MiB)", "backend", "DDP", "step (ms)",
                 "min (ms)", "vs gloo", "added vs gloo's", "beyond DDP's own", "vs torch's",
                 "max diff"):
        table.add_column(name, justify="left" if name in ("model", "backend", "DDP")
                         else "right")

    def ratio(r: dict, **match: Any) -> str:
        """``r``'s step time over that of the row like it but for ``match``."""
        other = next((o for o in rows if o["model"] == r["model"]
                      and o["world_size"] == r["world_size"]
                      and all(o.get(k) == v for k, v in match.items())), None)
        return f"{r['step_ms'] / other['step_ms']:.2f}x" if other and other is not r else "-"

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for r in rows:
        impl: str | None = r.get("ddp")
        ours = r["backend"] == "ringcomm"
        added = added_ratio(rows, r["model"], r["world_size"], impl) if impl and ours else None
        beyond = added_ratio(rows, r["model"], r["world_size"], over=NO_COMM) \
            if ours and impl == "torch" else None  # the DDP-alone row is torch's DDP
        compared = impl and r["backend"] != NO_COMM
        table.add_row(r["model"], str(r["world_size"]), f"{r['params']:,}",
                      f"{r['grad_MiB']:.1f}", r["backend"], impl or "-",
                      f"{r['step_ms']:.2f}", f"{r['min_step_ms']:.2f}",
                      ratio(r, backend="gloo", ddp=impl) if compared else "-",
                      shown(added), shown(beyond),
                      ratio(r, backend=r["backend"], ddp="torch") if impl == "ours" else "-",
                      "-" if r["max_weight_diff"] is None else f"{r['max_weight_diff']:.1e}")
    console.print(table)


def print_phases(rows: list[dict], console: Any) -> None:
    """Where each row's step goes (``PHASES``: medians per step, the slowest rank's), and
    what the backward pass and its tail add over the local step's: the time DDP and the
    backend add, split into what runs while gradients are still being computed and what
    runs after the last one."""
    from rich.table import Table

    if not any("phase_ms" in r for r in rows):
        return
    table = Table(title="where a step goes (ms per step, medians, slowest rank)",
                  title_justify="left", show_edge=False, pad_edge=False,
                  caption="backward: to the last gradient accumulated; tail: from there until "
                  "backward() returns (DDP's last bucket and every bucket's copy back); "
                  "+: over the local step's", caption_justify="left")
    for name in ("model", "world", "backend", "DDP", *PHASES, "+backward", "+tail"):
        table.add_column(name, justify="left" if name in ("model", "backend", "DDP")
                         else "right")
    for r in rows:
        local = next((o for o in rows if o["model"] == r["model"]
                      and o["world_size"] == r["world_size"] and o["backend"] == "local"), None)
        phase = r.get("phase_ms", {})
        added = [f"{phase[p] - local['phase_ms'][p]:+.2f}" if local and r is not local
                 else "-" for p in ("backward", "tail")]
        table.add_row(r["model"], str(r["world_size"]), r["backend"], r.get("ddp") or "-",
                      *(f"{phase[p]:.2f}" if p in phase else "-" for p in PHASES), *added)
    console.print(table)


def step_ms(rows: list[dict], model: str, world: int, backend: str,
            ddp: str | None) -> float | None:
    """The step time of ``model`` at ``world`` on ``backend`` under DDP implementation
    ``ddp`` (None: the local step); None where the run has no such row."""
    return next((r["step_ms"] for r in rows if r["model"] == model
                 and r["world_size"] == world and r["backend"] == backend
                 and r.get("ddp") == ddp), None)


def added_ratio(rows: list[dict], model: str, world: int, ddp: str = "torch",
                over: str = "local") -> float | None:
    """The time DDP adds over the local step with ringcomm, over the time it adds with Gloo
    (``(ringcomm - local) / (gloo - local)``, DDP implementation ``ddp``); with
    ``over=NO_COMM``, over the step of torch's DDP that communicates nothing instead of the
    local one: what each backend adds beyond DDP's own cost. None where a row is missing."""
    floor = step_ms(rows, model, world, "local", None) if over == "local" else \
        step_ms(rows, model, world, over, "torch")
    ours = step_ms(rows, model, world, "ringcomm", ddp)
    gloo = step_ms(rows, model, world, "gloo", ddp)
    if floor is None or ours is None or gloo is None or gloo <= floor:
        return None
    return (ours - floor) / (gloo - floor)


def markdown(rows: list[dict]) -> str:
    """The DDP table docs/benchmarks.md quotes: per model and world size, the step times
    and the added-time ratios of ringcomm to Gloo under torch's DDP (over the local step,
    and beyond DDP's own cost)."""
    def cell(model: str, world: int, backend: str, impl: str | None) -> str:
        ms = step_ms(rows, model, world, backend, impl)
        return "-" if ms is None else f"{ms:.2f}"

    def shown(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = ["| model | world | local (ms) | DDP alone (ms) | ringcomm, torch's DDP (ms) "
             "| Gloo, torch's DDP (ms) | added: ringcomm / Gloo | beyond DDP's own: ringcomm "
             "/ Gloo | ringcomm, our DDP (ms) | Gloo, our DDP (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model, world in dict.fromkeys((r["model"], r["world_size"]) for r in rows):
        lines.append(" | ".join([
            f"| {model}", str(world), cell(model, world, "local", None),
            cell(model, world, NO_COMM, "torch"),
            cell(model, world, "ringcomm", "torch"), cell(model, world, "gloo", "torch"),
            shown(added_ratio(rows, model, world)),
            shown(added_ratio(rows, model, world, over=NO_COMM)),
            cell(model, world, "ringcomm", "ours"), cell(model, world, "gloo", "ours")]) + " |")
    phased = [r for r in rows if "phase_ms" in r and r["backend"] != "local"]
    if phased:  # where the added time goes: over the local step's, per phase
        lines += ["", "Where DDP's added time goes, over the local step's (ms per step): "
                  "*backward* up to the last gradient (the buckets reduced while gradients "
                  "are still computed), the *tail* from there until `backward()` returns (the "
                  "last bucket, the waits, every bucket's copy back into the gradients):", "",
                  "| model | world | backend | DDP | +backward | +tail | +forward and "
                  "optimizer |", "|---|---|---|---|---|---|---|"]
        for r in phased:
            local = next((o for o in rows if o["model"] == r["model"] and "phase_ms" in o
                          and o["world_size"] == r["world_size"] and o["backend"] == "local"),
                         None)
            if local is None:
                continue
            mine, base = r["phase_ms"], local["phase_ms"]
            rest = sum(mine[p] - base[p] for p in ("forward", "optimizer"))
            lines.append(f"| {r['model']} | {r['world_size']} | {r['backend']} | {r['ddp']} | "
                         f"{mine['backward'] - base['backward']:+.2f} | "
                         f"{mine['tail'] - base['tail']:+.2f} | {rest:+.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ringcomm bench ddp``; returns the exit status."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.reps, args.warmup = min(args.steps, 4), min(args.reps, 3), 1
    if args.steps < 1 or args.reps < 1 or args.warmup < 0:
        parser.error("--steps and --reps must be at least 1 and --warmup not negative")
    if any(w < 1 for w in args.world_sizes):
        parser.error(f"world sizes must be at least 1, got {args.world_sizes}")
    args.models = list(dict.fromkeys(args.models))
    args.backends = list(dict.fromkeys(args.backends))
    args.ddp = list(dict.fromkeys(args.ddp))
    err = Console(stderr=True)
    rows: list[dict] = []
    started = time.time()
    try:
        with Progress(*Progress.get_default_columns()[:1], BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err) as progress:
            task = progress.add_task("DDP", total=len(args.world_sizes) * len(args.models)
                                     * args.reps)
            for world in args.world_sizes:
                args.port = free_port()
                for kind, _rank, payload in launch(world, rank_main, (args,), args.timeout):
                    if kind == "rows":
                        rows += payload
                    else:
                        progress.update(task, advance=1,
                                        description=f"world {world}: {payload[0]}")
    except RankFailed as failure:
        err.print(f"ringcomm bench ddp: {failure}", style="red", markup=False,
                  highlight=False)
        return 1
    out = Console(width=None if sys.stdout.isatty() else 140)
    print_table(rows, out)
    print_phases(rows, out)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "benchmark": "ringcomm bench ddp",
            "command": shlex.join(["ringcomm", "bench", "ddp", *argv]),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "duration_s": round(time.time() - started, 1),
            "machine": machine_info(),
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "port")},
            "rows": rows,
        }, indent=1) + "\n")
        out.print(f"wrote {args.json}")
    bad = [r for r in rows if r["max_weight_diff"] is not None and r["max_weight_diff"] > 1e-3]
    if bad:
        err.print(f"the weights trained by the DDP replicas differ by up to "
                  f"{max(r['max_weight_diff'] for r in bad):.2e}: one backend or DDP computed "
                  "wrong gradients")
        return 1
    return 0
