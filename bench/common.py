"""What every benchmark here shares: size parsing, ports, machine facts, and launching ranks.

Ranks are spawned (not forked) so each one starts torch and ZeroMQ from a clean state, as a
training job's ranks would. They report to the parent through one queue: progress and rows
as they go, then ``done``; a rank that raises sends its traceback, so the parent can say
which rank failed and why instead of waiting out a timeout.
"""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import re
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Generator
from typing import Any

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``8``, ``64K``, ``1M``, ``256M``, ``1GiB`` -> bytes (K, M, G are powers of 1024)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise ValueError(f"cannot read {text!r} as a size: use bytes or a K, M, G suffix "
                         "(8, 64K, 1M, 256M)")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def format_size(nbytes: int) -> str:
    """Bytes as the shortest exact power-of-1024 form: 8 B, 64 KiB, 256 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: cores, CPU, memory, library versions."""
    import numpy as np
    import torch
    import zmq

    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "zmq": zmq.zmq_version(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    with contextlib.suppress(AttributeError):
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        info["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f
                                  if line.startswith("model name")), None)
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        info["memory_GiB"] = next((round(int(line.split()[1]) / (1 << 20), 1) for line in f
                                   if line.startswith("MemTotal")), None)
    with contextlib.suppress(OSError, AttributeError):
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]  # others' work skews times
    if info["cuda_devices"]:
        info["cuda_device_names"] = [torch.cuda.get_device_name(i)
                                     for i in range(info["cuda_devices"])]
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            timeout=5, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def turn_order(n: int, rep: int, salt: int = 0) -> list[int]:
    """The order ``n`` backends take turns in repetition ``rep``: shuffled, the same on every
    rank (seeded by ``rep`` and ``salt``, e.g. the message size). A fixed rotation would give
    each backend the same predecessor every time, and whatever one backend leaves behind
    (busy threads, cold caches) would be charged to the same neighbour in every repetition;
    the salt keeps one size's orders from repeating at the next."""
    import random

    return random.Random(rep * 1_000_003 + salt).sample(range(n), n)


def timed(run: Callable[[], object], iters: int, sync: Callable[[], object]) -> float:
    """Seconds per call of ``iters`` back-to-back calls of ``run``, ``sync`` waiting at the
    end for what they left running (a device's queue)."""
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - start) / iters


class RankFailed(RuntimeError):
    """A benchmark rank raised or died; the message names the rank and carries its error."""


def _rank_entry(rank: int, world: int, target: Callable, args: tuple, out: Any) -> None:
    """Run ``target`` in a spawned rank and turn any exception into a message for the parent."""
    def report(kind: str, payload: Any = None) -> None:
        out.put((kind, rank, payload))

    try:
        target(rank, world, report, *args)
    except BaseException:  # the parent must hear about every failure, KeyboardInterrupt too
        report("error", traceback.format_exc())
        raise SystemExit(1) from None
    report("done")


def launch(world: int, target: Callable, args: tuple,
           timeout: float) -> Generator[tuple, None, None]:
    """Spawn ``world`` ranks running ``target(rank, world, report, *args)``; yield their reports.

    Yields ``(kind, rank, payload)`` as they arrive, except ``done``. Raises ``RankFailed``
    if a rank raises, exits without finishing, or nothing is heard for ``timeout`` seconds;
    the remaining ranks are then killed, since their peers are gone.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, target, args, out), daemon=True,
                         name=f"bench-rank{r}") for r in range(world)]
    for p in procs:
        p.start()
    done: set[int] = set()
    last = time.monotonic()
    try:
        while len(done) < world:
            try:
                kind, rank, payload = out.get(timeout=1.0)
            except queue.Empty:
                dead = [p for r, p in enumerate(procs)
                        if r not in done and p.exitcode not in (None, 0)]
                if dead:
                    # a traceback may still be in the pipe: give it a moment to arrive
                    try:
                        kind, rank, payload = out.get(timeout=2.0)
                    except queue.Empty:
                        raise RankFailed(
                            f"rank {procs.index(dead[0])} of {world} died with exit code "
                            f"{dead[0].exitcode} before finishing (out of memory? see its "
                            "output above)") from None
                elif time.monotonic() - last > timeout:
                    raise RankFailed(
                        f"no word from any of the {world} ranks for {timeout:.0f} s; they "
                        "are hung or far slower than expected (raise --timeout if the "
                        "sizes are large)") from None
                else:
                    continue
            last = time.monotonic()
            if kind == "done":
                done.add(rank)
            elif kind == "error":
                raise RankFailed(f"rank {rank} of {world} failed:\n{payload}")
            else:
                yield kind, rank, payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(done) == world else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
