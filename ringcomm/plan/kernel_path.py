"""Where the kernel path (``cuda-kernel``: one kernel per allreduce, ranks meeting through
flags in device memory) can run, decided from what every rank agreed at init.

Why it needs deciding: a block of the allreduce kernels waits until every peer's kernel
has written a flag into its signal pad (``ringcomm/engines/kernels/allreduce.cu``). That
wait ends only if the peers' kernels run *at the same time* as the waiting one. Ranks on
different GPUs run at once. Ranks (processes) that share one GPU run their kernels at once
only under MPS; without it the GPU time-slices between processes (about 250 us a switch,
measured on an H100: ``../shared/notes/gpu-design-facts.md``), a waiting kernel holds its
GPU's slice and the kernel it waits for never gets the SMs it needs while the waiter's
blocks occupy them: the kernel path would spin for ever. Today's cuda-ipc path (events
between steps, no spin) stays the path there.

What decides, and why only that: the table of facts every rank holds identically
(``Topology``: each rank's host, ``gpu`` identity, ``mps``), so every rank reaches the
same verdict without asking (``concurrency`` is a pure function of it). A bounded probe
(launch, wait a while) would measure the same thing but could disagree between ranks at
its deadline; the facts cannot.

The rule (``concurrency``): the ranks that share a GPU (same host, same ``gpu``) run at once
only where every one of them is an MPS client; ranks alone on their GPU always do; a rank
whose GPU is unknown (its runtime could not be read at init) is never assumed to. A group
of one rank has nobody to wait for. Besides that verdict the path needs (``kernel_path``):
every rank on one host (its regions are mapped with CUDA IPC), at most
``kernel_geometry.MAX_RANKS`` ranks (the signal pad's columns), and a runtime that can launch
the kernels (the fake: the numpy mirror, ``ringcomm.testing.fake_kernels``; CuPy: through
``cupy.RawModule``, taken only on request until a GPU run has checked it:
``ringcomm.runtime.devices.launch_problem``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.device.kernel_geometry import MAX_RANKS
from .topology import Topology


@dataclass(frozen=True)
class Verdict:
    """Whether the kernel path can run (``ok``), and why, in words (``why``)."""

    ok: bool
    why: str

    def __str__(self) -> str:
        return self.why


def ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    """``0-3`` for consecutive ranks, ``0,2`` otherwise."""
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def concurrency(topology: Topology) -> Verdict:
    """Whether the kernels of every rank of ``topology`` run at once (module docstring),
    with the reason: the same on every rank, since ``topology`` is."""
    world = topology.world_size
    every = ranks_text(list(range(world)))
    if world == 1:
        return Verdict(True, "one rank: its kernel waits for nobody")
    unknown = [r for r, facts in enumerate(topology.ranks) if not facts.gpu]
    if unknown:
        return Verdict(False, f"the GPU of rank(s) {ranks_text(unknown)} is unknown (no "
                              "device facts at init): their kernels may take turns with "
                              "others, so the kernel path could spin for ever")
    by_gpu: dict[tuple[str, str], list[int]] = {}
    for rank, facts in enumerate(topology.ranks):
        by_gpu.setdefault((facts.host, facts.gpu), []).append(rank)
    shared = [(gpu, ranks) for (_, gpu), ranks in by_gpu.items() if len(ranks) > 1]
    problems = []
    for gpu, ranks in shared:
        served = [r for r in ranks if topology.ranks[r].mps]
        if len(served) == len(ranks):
            continue
        how = "without MPS" if not served else \
            f"and MPS serves only rank(s) {ranks_text(served)}"
        problems.append(f"ranks {ranks_text(ranks)} share GPU {gpu} {how}: their kernels "
                        "take turns, so the kernel path would spin for ever")
    if problems:
        return Verdict(False, "; ".join(problems))
    if not shared:
        return Verdict(True, f"kernels of ranks {every} run at once: each on its own GPU")
    under = "; ".join(f"ranks {ranks_text(ranks)} share GPU {gpu} under MPS"
                      for gpu, ranks in shared)
    alone = [ranks[0] for ranks in by_gpu.values() if len(ranks) == 1]
    rest = f"; rank(s) {ranks_text(alone)} each on a GPU of its own" if alone else ""
    return Verdict(True, f"kernels of ranks {every} run at once: {under}{rest}")


def kernel_path(topology: Topology, launch_problem: str = "",
                engine: bool = True) -> Verdict:
    """Whether a group can take the kernel path: its kernels run at once
    (``concurrency``), its ranks are on one host and at most ``MAX_RANKS``, its runtime
    can launch the kernels (``launch_problem``: why not, "" where it can:
    ``DeviceRuntime.kernel_launch``) and it has the engine (``engine``: the group made
    its regions at set-up). Every input is agreed, so every rank gets the same verdict."""
    verdict = concurrency(topology)
    if not verdict.ok:
        return verdict
    hosts = len(topology.hosts)
    if hosts > 1:
        return Verdict(False, f"the ranks span {hosts} hosts: the kernel path maps memory "
                              "of one host only")
    if topology.world_size > MAX_RANKS:
        return Verdict(False, f"{topology.world_size} ranks: the kernels serve at most "
                              f"{MAX_RANKS} (the signal pad's columns)")
    if launch_problem:
        return Verdict(False, f"{verdict.why}, but {launch_problem}")
    if not engine:
        return Verdict(False, f"{verdict.why}, but this group has no cuda-kernel engine "
                              "(its regions were not made at set-up)")
    return verdict


__all__ = ["Verdict", "concurrency", "kernel_path", "ranks_text"]
