"""Registered memory on the kernel path (``Communicator.register``,
``ringcomm.engines.registered``): ops on registered arrays run where they lie and equal numpy,
a registration is exported and opened once per allocation, it holds the array until every
peer closed its mapping, it is refused with the reason where it cannot be, and ranks agree
whether an op runs in place. On the fake runtime; on a GPU where one is at hand."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from kernel_cases import GPU_PAIRS, pairs
from registration_cases import block, ddp_rank, fill, registered_everything

from ringcomm.core.algorithms import CUDA_KERNEL
from ringcomm.core.device.kinds import torch_allocator_problem
from ringcomm.errors import ArgumentError
from ringcomm.runtime.local import run_group


def _gathered_pairs() -> int:
    return len({name for name, _, _ in pairs()})


def test_every_dtype_and_op_on_registered_blocks_runs_in_place_and_equals_numpy(
        fake_devices):
    """Three ranks with GPUs of their own: the two-shot allreduce, the reduce-scatter and
    the all-gather of every dtype and op on blocks of one segment (none an allocation's
    base, at odd offsets) registered on every rank: each equals numpy, ran where the memory
    lies (the rank's region never held a byte), one export per segment."""
    gc.collect()
    live = fake_devices.live_allocations()
    results = run_group(3, registered_everything(29), device="fake", gpus=[0, 1, 2])
    every = len(list(pairs()))
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["wrong"] == []
        assert r["ops"] == 2 * every + _gathered_pairs()
        assert r["in_place"] == r["ops"]
        assert r["untouched"]
        assert r["exported"] == every and r["opens"] == 0  # threads: pointers, no opens
        assert r["live"] == 0
    assert fake_devices.live_allocations() == live


@pytest.mark.parametrize("world", [1, 2, 4])
def test_registered_ops_at_other_world_sizes(fake_devices, world):
    only = (("float32", "sum"), ("float32", "avg"), ("bfloat16", "sum"), ("int64", "max"))
    for r in run_group(world, registered_everything(23, only), device="fake",
                       gpus=list(range(world))):
        assert r["wrong"] == [] and r["in_place"] == r["ops"] and r["untouched"]


def test_ranks_in_processes_map_each_allocation_once(cluster):
    """Real processes sharing fake device 0 under MPS: the training dtypes and ops in place
    and right, every rank's segment exported once and opened once by each peer although
    three blocks of it are registered, and close leaves no device memory."""
    world = 3
    res = cluster.run(world, "registration_cases.job_registered", timeout=120)
    assert len({r["digest"] for r in res}) == 1
    for r in res:
        assert r["wrong"] == [] and r["in_place"] == r["ops"] and r["untouched"]
        assert r["exported"] == len(GPU_PAIRS)
        assert r["opens"] == len(GPU_PAIRS) * (world - 1)
        assert r["left"] == 0


@pytest.mark.parametrize("deregister", [True, False])
def test_a_registration_holds_the_array_until_every_peer_closed_its_mapping(cluster,
                                                                         deregister):
    """The caller drops its array; the registration keeps it (its peers map it: the fake
    refuses a free while they do), until ``deregister`` or the communicator's close has
    every peer close its mapping first: then it is freed, and nothing is left."""
    res = cluster.run(3, "registration_cases.job_held_until_deregistered",
                      deregister=deregister, timeout=60)
    for r in res:
        assert r["error"] == "", r
        assert r["held"] == 1 + 2 and r["value"] == 6.0  # its array, its peers' mappings
        if deregister:
            assert r["after"] == 0
        assert r["left"] == 0


@pytest.mark.parametrize("how", ["open", "read"])
def test_a_registration_that_fails_on_one_rank_fails_on_every_rank_and_leaves_nothing(
        cluster, how):
    """Rank 1 cannot open a peer's allocation, or fails to read its peers' records after its
    own went out: every rank raises, naming it, within seconds (not the 30 s timeout), the
    peers that had opened rank 1's allocation close it again (no rank is left holding
    mappings another does not know of), and a registration after it works in place."""
    res = cluster.run(3, "registration_cases.job_an_open_fails", how=how, timeout=60)
    for r in res:
        assert r["error"], r
        assert "rank 1" in r["error"] or r["error"].startswith("TimeoutError"), r
        if how == "open":
            assert "cudaErrorMapBufferObjectFailed" in r["error"], r
        assert r["seconds"] < 10, r
        assert r["left_after_failure"] == 0, r
        assert r["registered"] and r["in_place"] == 1 and r["value"] == 6.0, r


def test_an_op_runs_in_place_only_where_every_rank_registered_its_buffer(fake_devices):
    """Rank 0's buffer is registered, rank 1's is not (it registered another array): both
    copy through their regions, agreed through the op's headers, and are right."""

    def fn(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        x = FakeDeviceArray.from_host(np.arange(40, dtype=np.float32) * (comm.rank + 1))
        other = FakeDeviceArray.from_host(np.zeros(40, np.float32))
        with comm.register(x if comm.rank == 0 else other):
            comm.allreduce(x, algorithm="kernel-twoshot")
            in_place = comm.wiring.lanes[CUDA_KERNEL].channel.in_place
            return x.to_host().tolist(), in_place

    for got, in_place in run_group(2, fn, device="fake", gpus=[0, 1]):
        assert got == (np.arange(40) * 3.0).tolist() and in_place == 0


def test_each_rank_reads_its_peers_buffers_where_their_headers_say(fake_devices):
    """Ranks whose buffers lie at different offsets of their registrations (and in
    registrations of different numbers): each reads and writes every peer's at the place
    that peer's header named, so the two-shot, the reduce-scatter and the all-gather are
    right in place."""

    def fn(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        rank, world, rt = comm.rank, comm.world_size, comm.device
        first = FakeDeviceArray.from_host(np.zeros(64, np.float32))
        second = FakeDeviceArray.from_host(np.zeros(256, np.float32))
        with comm.register(first), comm.register(second):
            x = block(first if rank % 2 else second, 4 * rank + 1, 24)
            fill(rt, x, np.arange(24, dtype=np.float32) * (rank + 1))
            comm.allreduce(x, algorithm="kernel-twoshot")
            out = FakeDeviceArray.from_host(np.zeros(8, np.float32))
            comm.reduce_scatter(out, x)
            gathered = FakeDeviceArray.from_host(np.zeros(24 * world, np.float32))
            comm.allgather(gathered, x)
            channel = comm.wiring.lanes[CUDA_KERNEL].channel
            return (x.to_host().tolist(), out.to_host().tolist(),
                    gathered.to_host().tolist(), channel.in_place)

    world = 3
    total = np.arange(24, dtype=np.float32) * 6
    for rank, (reduced, scattered, gathered, in_place) in enumerate(
            run_group(world, fn, device="fake", gpus=[0, 1, 2])):
        assert reduced == total.tolist()
        assert scattered == (total[8 * rank:8 * rank + 8] * world).tolist()
        assert gathered == np.tile(total, world).tolist()
        assert in_place == 3


def test_after_deregister_an_array_is_copied_again_and_its_mappings_are_gone(fake_devices):
    """Deregistered, a block is an ordinary buffer again: ops on it copy through the region
    (nothing reads the closed mapping), a later registration of the same segment exports it
    anew, and an output overlapping a registered input is not run in place."""

    def fn(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        rt, channel = comm.device, comm.wiring.lanes[CUDA_KERNEL].channel
        segment = FakeDeviceArray.from_host(np.zeros(64, np.float32))
        x = block(segment, 8, 16)
        registration = comm.register(x)
        fill(rt, x, np.full(16, comm.rank + 1.0, np.float32))
        comm.allreduce(x, algorithm="kernel-twoshot")
        first = (channel.in_place, float(x.to_host()[0]))
        said = comm.describe()
        registration.deregister()
        registration.deregister()  # once only
        fill(rt, x, np.full(16, comm.rank + 1.0, np.float32))
        comm.allreduce(x, algorithm="kernel-twoshot")
        second = (channel.in_place, float(x.to_host()[0]))
        with comm.register(segment) as whole:
            out = block(segment, 8 + comm.rank * 8, 8)  # its own block of the input
            comm.reduce_scatter(out, x)
            third = (channel.in_place, float(out.to_host()[0]), whole.in_place)
        exported = channel.registry.exported
        with comm.register(segment):
            comm.close()  # ends the registration: its deregister afterwards does nothing
        return first, second, third, exported, said

    for first, second, third, exported, said in run_group(2, fn, device="fake", gpus=[0, 1]):
        assert "1 arrays registered, 1 ops where they lie" in said
        assert first == (1, 3.0)
        assert second == (1, 3.0)
        assert third == (1, 6.0, True)
        assert exported == 2


def test_refusals_name_what_was_wrong_on_every_rank(fake_devices):
    """Host memory, and memory without an IPC handle (as cuMemCreate maps it: torch's
    expandable segments): refused with the reason on the rank that passed it, and its
    peers refuse too, naming it (no rank waits for a record that never comes)."""

    def host_on_rank_0(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        x = np.zeros(4, np.float32) if comm.rank == 0 else \
            FakeDeviceArray.from_host(np.zeros(4, np.float32))
        comm.register(x)

    def mapped(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        comm.register(FakeDeviceArray(8, np.float32, mapped=True))

    zero, one = run_group(2, host_on_rank_0, device="fake", gpus=[0, 1],
                          return_errors=True, timeout=20)
    assert isinstance(zero, ArgumentError) and "host memory" in str(zero)
    assert isinstance(one, ArgumentError) and "rank 0 could not register" in str(one)
    for err in run_group(2, mapped, device="fake", gpus=[0, 1], return_errors=True,
                         timeout=20):
        assert isinstance(err, ArgumentError), err
        assert "cuMemCreate" in str(err) and "expandable" in str(err)
        assert "op=register" in repr(err) or "register" in str(err)


def test_torchs_allocator_settings_that_have_no_ipc_handles_are_named():
    assert torch_allocator_problem("", "native") == ""
    assert torch_allocator_problem("max_split_size_mb:128", "native") == ""
    assert "expandable_segments" in torch_allocator_problem(
        "max_split_size_mb:128, expandable_segments:True", "native")
    assert torch_allocator_problem("expandable_segments:False", "native") == ""
    assert "cudaMallocAsync" in torch_allocator_problem("", "cudaMallocAsync")


def test_without_the_kernel_path_a_registration_holds_nothing_and_says_why(fake_devices):
    """Ranks sharing a GPU without MPS have no kernel path: a registration holds nothing,
    says why, and ops run as before; host memory is refused all the same."""

    def fn(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        x = FakeDeviceArray.from_host(np.ones(8, np.float32))
        registration = comm.register(x)
        comm.allreduce(x)
        with pytest.raises(ArgumentError, match="host memory"):
            comm.register(np.ones(4))
        registration.deregister()
        return registration.in_place, registration.why, float(x.to_host()[0])

    for in_place, why, value in run_group(2, fn, device="fake"):
        assert not in_place and "without MPS" in why and value == 2.0


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_registered_memory_on_the_test_runtime(cluster, gpu_runtime, gpu_device, world):
    """On a GPU: CuPy arrays' blocks of one pool allocation registered (base + offset through
    cuMemGetAddressRange), the training dtypes in place, equal numpy on every rank, each
    allocation opened once per peer (the fake runtime where RINGCOMM_TEST_RUNTIME=fake)."""
    if gpu_device == "cuda" and gpu_runtime.device_count() < world and \
            not gpu_runtime.mps().on:
        pytest.skip(f"{world} ranks share a GPU here without MPS: no kernel path "
                    "(bench/gpu_check.sh starts MPS)")
    count = 300_001 if gpu_device == "cuda" else 37
    res = cluster.run(world, "registration_cases.job_registered", device_name=gpu_device,
                      count=count, timeout=280)
    assert len({r["digest"] for r in res}) == 1
    for r in res:
        assert r["wrong"] == [], r["wrong"]
        assert r["in_place"] == r["ops"] and r["untouched"]
        assert r["left"] == 0


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_our_ddp_registers_its_buckets_and_reduces_them_where_they_lie(gpu_runtime):
    """On a GPU under MPS (or a GPU per rank), through torch: our DDP registers its CUDA
    buckets with the ringcomm group, every bucket's allreduce runs where it lies, and the
    gradients equal the average of every rank's to float32 rounding."""
    import torch
    from mp_helpers import spawned_ranks

    world = 2
    if gpu_runtime.name != "cupy" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU, CuPy and a CUDA build of torch (none here)")
    if gpu_runtime.device_count() < world and not gpu_runtime.mps().on:
        pytest.skip("the ranks would share a GPU without MPS: no kernel path "
                    "(bench/gpu_check.sh starts MPS)")
    for r in spawned_ranks(ddp_rank, world):
        assert r["registered"] and all(r["registered"]), r
        assert r["in_place"] >= 3 * len(r["registered"]), r
        assert r["worst"] < 1e-5, r
