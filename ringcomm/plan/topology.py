"""Facts about where each rank runs, gathered from every rank at init into one table.

Anything that differs per host or per process (which host, which cores) and that a
decision depends on must come from this table, which every rank holds identically, never
from a local look at ``os.sched_getaffinity``: two ranks that looked locally would choose
differently (one started under ``taskset``) and run different schedules.
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..errors import ArgumentError


def hosts_layout(text: str) -> tuple[tuple[int, ...], ...]:
    """``HxR`` (as ``--hosts`` takes it): H hosts of R ranks each, numbered host by host."""
    h, sep, r = text.lower().partition("x")
    if not sep or not h.isdigit() or not r.isdigit() or int(h) < 1 or int(r) < 1:
        raise ArgumentError(f"--hosts {text!r} is not HOSTSxRANKS, e.g. 2x2")
    per = int(r)
    return tuple(tuple(range(i * per, (i + 1) * per)) for i in range(int(h)))


def host_identity() -> str:
    """Equal on two ranks exactly when they can reach each other's ipc sockets and shared
    memory: the same machine (hostname, machine and boot ids) and the same temp folder."""
    parts = [socket.gethostname()]
    for path in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    parts.append(tempfile.gettempdir())
    return "|".join(parts)


def _affinity() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return tuple(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class RankFacts:
    """One rank's facts: its host's identity and name, the cores it may run on, its pid,
    whether it keeps a timeline (so that rank 0 answers its clock's questions at init), and,
    where it runs on a device, which GPU (``gpu``: its identity on the host) and whether an
    MPS daemon serves it (``mps``)."""

    host: str
    hostname: str
    cpus: tuple[int, ...]
    pid: int
    traces: bool = False
    gpu: str = ""
    mps: bool = False

    @classmethod
    def here(cls, *, traces: bool = False, gpu: str = "", mps: bool = False) -> RankFacts:
        return cls(host_identity(), socket.gethostname(), _affinity(), os.getpid(), traces,
                   gpu, mps)

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "hostname": self.hostname, "cpus": list(self.cpus),
                "pid": self.pid, "traces": self.traces, "gpu": self.gpu, "mps": self.mps}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RankFacts:
        return cls(str(raw["host"]), str(raw["hostname"]), tuple(int(c) for c in raw["cpus"]),
                   int(raw["pid"]), bool(raw.get("traces", False)), str(raw.get("gpu", "")),
                   bool(raw.get("mps", False)))


@dataclass(frozen=True)
class Topology:
    """Every rank's facts, in rank order: the same object on every rank of a group."""

    ranks: tuple[RankFacts, ...]

    @classmethod
    def single_host(cls, world_size: int) -> Topology:
        """Every rank on this host with this process's facts: a group inside one process."""
        here = RankFacts.here()
        return cls((here,) * world_size)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @cached_property
    def hosts(self) -> tuple[tuple[int, ...], ...]:
        """The ranks of each host, hosts in the order of their lowest rank."""
        by_host: dict[str, list[int]] = {}
        for rank, facts in enumerate(self.ranks):
            by_host.setdefault(facts.host, []).append(rank)
        return tuple(tuple(ranks) for ranks in by_host.values())

    def same_host(self, a: int, b: int) -> bool:
        return self.ranks[a].host == self.ranks[b].host

    @cached_property
    def shared_gpus(self) -> tuple[tuple[int, ...], ...]:
        """The groups of two or more ranks that run on one GPU of one host (by its
        identity), in the order of their lowest rank: their kernels take turns on it
        unless an MPS daemon serves them."""
        by_gpu: dict[tuple[str, str], list[int]] = {}
        for rank, facts in enumerate(self.ranks):
            if facts.gpu:
                by_gpu.setdefault((facts.host, facts.gpu), []).append(rank)
        return tuple(tuple(ranks) for ranks in by_gpu.values() if len(ranks) > 1)

    def gpu_sharing(self) -> str:
        """The ranks that share a GPU, and whether MPS serves them, in words ("" where none
        share one)."""
        lines = []
        for ranks in self.shared_gpus:
            facts = self.ranks[ranks[0]]
            served = [r for r in ranks if self.ranks[r].mps]
            if len(served) == len(ranks):
                how = "MPS serves them: their kernels run at once"
            else:
                how = ("no MPS" if not served else f"MPS serves only rank(s) "
                       f"{', '.join(map(str, served))}") + (
                    ": their kernels take turns on the GPU (every switch between "
                    "processes costs time); an MPS daemon lets them run at once "
                    "(docs/gpu.md)")
            lines.append(f"ranks {', '.join(map(str, ranks))} share GPU {facts.gpu} on "
                         f"{facts.hostname}; {how}")
        return "; ".join(lines)

    def host_cores(self, ranks: tuple[int, ...]) -> int:
        """Cores the given ranks of one host may use between them (the union of their
        affinities)."""
        return len(set().union(*(self.ranks[r].cpus for r in ranks)))

    def spare_core(self, rank: int) -> bool:
        """Whether ``rank``'s host has two cores per rank: one for each rank and one for its
        worker thread. Without, a worker competes for its own rank's core, and handing an op
        to it costs more than the overlap gains."""
        ranks = next(group for group in self.hosts if rank in group)
        return self.host_cores(ranks) >= 2 * len(ranks)

    @cached_property
    def cores_per_rank(self) -> float:
        """Cores per rank on the most crowded host (at most 1): below 1 the ranks of a host
        share cores, which the cost model prices."""
        return min(min(1.0, self.host_cores(ranks) / len(ranks)) for ranks in self.hosts)
