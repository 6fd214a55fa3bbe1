"""A process makes and closes communicators any number of times and holds several at once,
on every device engine, and gives back what it opened on the device each time.

On a GPU these once failed: a second communicator in a process could not open its peers'
events (CUDA gives a destroyed event's handle bytes to the next event, and a process-wide
table of opened handles refused them as "open already"), and the nccl engine never started
(CuPy 14's NCCL id is bytes). The fake runtime now does what the GPU was measured to do, so
these run on every CPU (``device="fake"``) and, on a GPU, for real (the ``cuda``
parameters, marked ``gpu``).
"""

from __future__ import annotations

import pytest
from conftest import TEST_RUNTIME

ENGINES = ["cuda-ipc", "staged", "nccl"]
# what a GPU may hold more after a job's cycles than before, all of ringcomm's given back:
# the CUDA context's and libraries' lazy allocations (a cycle's own slots are 16-48 MiB, so
# a leak of them shows within a few cycles)
SLACK_BYTES = 64 << 20


def check_given_back(rank: int, got: dict) -> None:
    """What the job's process holds on the device is where it was before it: ringcomm's
    allocations, mappings and events, and on a GPU the device's used bytes."""
    assert got["live"][0] == got["live"][1], (rank, got)
    before, after = got.get("used", (None, None))
    if before is not None:
        assert after - before <= SLACK_BYTES, (rank, got)
# the device runtime of each run: the fake everywhere; CuPy's where the gpu tests run
DEVICES = ["fake"] + [pytest.param("cuda", marks=pytest.mark.gpu)
                      for _ in [1] if TEST_RUNTIME == "cupy"]


slow = pytest.mark.slow


def check_every_rank(results: list[dict], engine: str) -> None:
    """Every rank ran on the engine asked for and gave back what it held."""
    for rank, got in enumerate(results):
        assert got["engines"] == [engine], (rank, got)
        check_given_back(rank, got)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [pytest.param(1, marks=slow), 2, pytest.param(3, marks=slow),
                                   pytest.param(4, marks=slow)])
def test_twenty_cycles_on_one_address(cluster, device, engine, world):
    """init -> device allreduce (checked) -> close, 20 times on one store address, every
    rank a process: each cycle opens its peers' events (on cuda-ipc: the same handle bytes
    as the cycle before) or a new NCCL communicator afresh, and gives everything back."""
    check_every_rank(cluster.run(world, "lifecycle_jobs.job_cycles", engine=engine, cycles=20,
                                 device=device, timeout=560), engine)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["cuda-ipc", pytest.param("staged", marks=slow),
                                    pytest.param("nccl", marks=slow)])
def test_several_communicators_at_once(cluster, device, engine):
    check_every_rank(cluster.run(4, "lifecycle_jobs.job_several_at_once", engine=engine,
                                 device=device, timeout=110), engine)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["cuda-ipc", pytest.param("nccl", marks=slow)])
def test_a_torch_group_with_two_new_groups(cluster, device, engine):
    """torch's default group and two new_groups (one of the even ranks), live at once, on
    device memory and CPU tensors; every group's device engine is the forced one."""
    check_every_rank(cluster.run(4, "lifecycle_jobs.job_torch_groups", engine=engine,
                                 device=device, timeout=140), engine)


@pytest.mark.timeout(60)
def test_a_group_of_processes_on_one_gpu_says_so(cluster) -> None:
    """Every rank's GPU and MPS state is agreed at init: each rank's describe() names the
    ranks that share its GPU, and whether MPS serves them (here, no daemon runs)."""
    said = cluster.run(2, "lifecycle_jobs.job_describe", device="fake")
    for text in said:
        line = next(ln for ln in text.splitlines() if ln.startswith("gpus: "))
        assert line.startswith("gpus: ranks 0, 1 share GPU fake:0 on "), line
        assert "no MPS: their kernels take turns" in line, line


@pytest.mark.timeout(90)
def test_a_rank_that_closes_late_is_waited_for_before_anything_is_freed(cluster) -> None:
    """Rank 2 closes 6 s after the others (longer than a close once waited): ranks 0 and 1
    wait for it to close its mappings of their slots, then free them (the fake refuses to
    free memory a living process maps), and everything is given back."""
    results = cluster.run(3, "lifecycle_jobs.job_late_closer", late=2, delay=6.0, timeout=80)
    for rank, got in enumerate(results):
        check_given_back(rank, got)
    assert results[0]["took"] > 4 and results[1]["took"] > 4, results  # they waited


@pytest.mark.timeout(90)
def test_a_rank_on_its_second_device_runs_ops_on_the_worker_thread_too(cluster):
    """A rank whose device is not the first (LOCAL_RANK 1 under torchrun): its async ops run
    on the worker thread with the rank's device made current there, as CUDA requires for
    kernels and event records; on every device engine."""
    results = cluster.run(2, "lifecycle_jobs.job_on_a_second_device", timeout=80)
    assert results == [ENGINES] * 2
