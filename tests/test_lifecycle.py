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
# the device runtime of each run: the fake everywhere; CuPy's where the gpu tests run
DEVICES = ["fake"] + [pytest.param("cuda", marks=pytest.mark.gpu)
                      for _ in [1] if TEST_RUNTIME == "cupy"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [2, 3])
def test_twenty_cycles_on_one_address_on_cuda_ipc(cluster, device, world):
    """init -> device allreduce (checked) -> close, 20 times on one store address, every
    rank a process: each cycle's channel opens its peers' events afresh (the same handle
    bytes as the cycle before) and gives everything back."""
    results = cluster.run(world, "lifecycle_jobs.job_cycles", engine="cuda-ipc", cycles=20,
                          device=device, timeout=110)
    for rank, got in enumerate(results):
        assert got["engines"] == ["cuda-ipc"], (rank, got)
        assert got["live"][0] == got["live"][1], (rank, got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_init_and_close_again_on_every_engine(cluster, device, engine, world):
    results = cluster.run(world, "lifecycle_jobs.job_cycles", engine=engine, cycles=3,
                          device=device, timeout=110)
    for rank, got in enumerate(results):
        assert got["engines"] == [engine], (rank, got)
        assert got["live"][0] == got["live"][1], (rank, got)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_twenty_cycles_on_every_engine(cluster, device, engine, world):
    results = cluster.run(world, "lifecycle_jobs.job_cycles", engine=engine, cycles=20,
                          device=device, timeout=560)
    for rank, got in enumerate(results):
        assert got["engines"] == [engine], (rank, got)
        assert got["live"][0] == got["live"][1], (rank, got)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ENGINES)
def test_several_communicators_at_once(cluster, device, engine):
    results = cluster.run(4, "lifecycle_jobs.job_several_at_once", engine=engine,
                          device=device, timeout=110)
    for rank, got in enumerate(results):
        assert got["engines"] == [engine], (rank, got)
        assert got["live"][0] == got["live"][1], (rank, got)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("engine", ["cuda-ipc", "nccl"])
def test_a_torch_group_with_two_new_groups(cluster, device, engine):
    """torch's default group and two new_groups (one of the even ranks), live at once, on
    device memory and CPU tensors; every group's device engine is the forced one."""
    results = cluster.run(4, "lifecycle_jobs.job_torch_groups", engine=engine, device=device,
                          timeout=140)
    for rank, got in enumerate(results):
        assert got["engines"] == [engine], (rank, got)
        assert got["live"][0] == got["live"][1], (rank, got)
