"""Where the kernel path (cuda-kernel) may run, and the selector's choice of it: the verdict
from the agreed facts (``ringcomm.plan.kernel_path``), the choice with and without it, and
what ``choose()`` and ``describe()`` say, on the fake runtime."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from kernel_cases import allreduce_everything, pairs, scatter_gather_everything

from ringcomm.core.algorithms import CUDA_IPC, CUDA_KERNEL, STAGED
from ringcomm.errors import ArgumentError
from ringcomm.plan import cost
from ringcomm.plan.kernel_path import Verdict, concurrency, kernel_path
from ringcomm.plan.select import Group, Selector
from ringcomm.plan.settings import Settings
from ringcomm.plan.topology import RankFacts, Topology
from ringcomm.runtime.local import run_group


def _facts(gpu: str = "", mps: bool = False, host: str = "h") -> RankFacts:
    return RankFacts(host, host, (0,), 1, gpu=gpu, mps=mps)


def _topology(*ranks: tuple[str, bool] | tuple[str, bool, str]) -> Topology:
    return Topology(tuple(_facts(*r) for r in ranks))


# (facts of each rank, runs at once, words the reason must hold)
VERDICTS = [
    ([("g0", False)], True, "one rank"),
    ([("g0", False), ("g1", False)], True, "ranks 0,1 run at once: each on its own GPU"),
    ([("g0", False), ("g1", False), ("g2", False), ("g3", False)], True,
     "kernels of ranks 0-3 run at once: each on its own GPU"),
    ([("g0", False), ("g0", False)], False,
     "ranks 0,1 share GPU g0 without MPS: their kernels take turns, so the kernel path "
     "would spin for ever"),
    ([("g0", True), ("g0", True)], True, "ranks 0,1 share GPU g0 under MPS"),
    ([("g0", True), ("g0", False)], False, "MPS serves only rank(s) 0"),
    ([("g0", True), ("g0", True), ("g1", False)], True,
     "ranks 0,1 share GPU g0 under MPS; rank(s) 2 each on a GPU of its own"),
    ([("g0", True), ("g1", False), ("g1", False), ("g0", True)], False,
     "ranks 1,2 share GPU g1 without MPS"),
    ([("g0", False), ("", False)], False, "the GPU of rank(s) 1 is unknown"),
    # one identity on two hosts is two GPUs
    ([("g0", False, "a"), ("g0", False, "b")], True, "each on its own GPU"),
]


@pytest.mark.parametrize(("ranks", "ok", "words"), VERDICTS)
def test_the_verdict_follows_from_the_agreed_facts(ranks, ok, words):
    verdict = concurrency(_topology(*ranks))
    assert verdict.ok is ok
    assert words in verdict.why


def test_the_path_also_needs_one_host_few_ranks_a_launch_and_the_engine():
    own = _topology(("g0", False), ("g1", False))
    assert kernel_path(own).ok
    assert "spin for ever" in kernel_path(_topology(("g0", False), ("g0", False))).why
    hosts = kernel_path(_topology(("g0", False, "a"), ("g0", False, "b")))
    assert not hosts.ok and "span 2 hosts" in hosts.why
    nine = kernel_path(Topology(tuple(_facts(f"g{i}") for i in range(9))))
    assert not nine.ok and "at most 8" in nine.why
    launch = kernel_path(own, "CuPy's launch of the kernels is not written yet")
    assert not launch.ok and launch.why.endswith("not written yet")
    assert "each on its own GPU" in launch.why
    assert "no cuda-kernel engine" in kernel_path(own, engine=False).why


def test_the_fake_launches_them_for_threads_and_processes():
    from ringcomm.testing.fake_device import FakeRuntime

    fake = object.__new__(FakeRuntime)
    assert FakeRuntime.kernel_launch(fake) == ""
    assert FakeRuntime.kernel_launch(fake, [7, 7, 7]) == ""  # threads of one process
    assert FakeRuntime.kernel_launch(fake, [7, 8]) == ""  # processes: regions mapped
    assert FakeRuntime.kernel_path_checked  # its launch is the kernels' mirror


def _selector(world: int, kernel: Verdict | None) -> Selector:
    topology = Topology(tuple(_facts(f"g{r}") for r in range(world)))
    return Selector(Group(world, False, Settings(), topology, 1 << 20,
                          (CUDA_IPC, STAGED), "fake-cuda", kernel))


@pytest.mark.parametrize("world", [2, 4])
def test_the_selector_takes_the_kernel_path_only_where_the_verdict_holds(world):
    yes = _selector(world, Verdict(True, "each on its own GPU"))
    small = yes.choose("allreduce", 1024, memory="fake-cuda")
    large = yes.choose("allreduce", 256 << 20, memory="fake-cuda")
    assert (small.engine, small.algorithm) == (CUDA_KERNEL, "kernel-oneshot")
    assert (large.engine, large.algorithm) == (CUDA_KERNEL, "kernel-twoshot")
    assert "each on its own GPU" in small.why and "one-shot" in small.why
    assert "default kernel constants" in large.why and "two-shot" in large.why
    # host memory never takes it; reduce-scatter and all-gather take its one kernel, the
    # other collectives never
    assert yes.choose("allreduce", 1024).engine != CUDA_KERNEL
    for collective in ("allgather", "reduce_scatter"):
        choice = yes.choose(collective, 1024, memory="fake-cuda")
        assert (choice.engine, choice.algorithm) == (CUDA_KERNEL, "kernel-direct")
    assert yes.choose("broadcast", 1024, memory="fake-cuda").engine == CUDA_IPC
    forced = yes.choose("allgather", 1024, memory="fake-cuda", forced="kernel-direct")
    assert forced.algorithm == "kernel-direct" and "forced" in forced.why
    no = _selector(world, Verdict(False, "ranks 0,1 share GPU g0 without MPS"))
    for collective, size in (("allreduce", 1024), ("allreduce", 256 << 20),
                             ("allgather", 1024), ("reduce_scatter", 1024)):
        choice = no.choose(collective, size, memory="fake-cuda")
        assert choice.engine == CUDA_IPC
        assert "not the kernel path (cuda-kernel): ranks 0,1 share GPU g0 without MPS" \
            in choice.why
    with pytest.raises(ArgumentError, match="runs on the kernel path.*without MPS"):
        no.choose("reduce_scatter", 1024, memory="fake-cuda", forced="kernel-direct")


def test_one_and_two_shot_are_priced_and_cross_over():
    params = {a: cost.DEFAULT_DEVICE_PARAMS[a] for a in ("kernel-oneshot", "kernel-twoshot")}
    for world in (2, 4, 8):
        def cheaper(nbytes: int, world: int = world) -> str:
            return min(params, key=lambda a: cost.kernel_allreduce(a, world, nbytes, params[a]))
        assert cheaper(8) == "kernel-oneshot"
        assert cheaper(1 << 30) == "kernel-twoshot"
    with pytest.raises(ValueError, match="no algorithm of the kernel path"):
        cost.kernel_allreduce("ring", 2, 8, params["kernel-oneshot"])


def test_a_forced_kernel_algorithm_runs_where_the_verdict_holds_and_is_refused_elsewhere():
    yes = _selector(2, Verdict(True, "each on its own GPU"))
    forced = yes.choose("allreduce", 1 << 30, memory="fake-cuda", forced="kernel-oneshot")
    assert (forced.engine, forced.algorithm) == (CUDA_KERNEL, "kernel-oneshot")
    assert "forced by algorithm=" in forced.why
    link = yes.choose("allreduce", 1024, memory="fake-cuda", forced="ring")
    assert (link.engine, link.algorithm) == (CUDA_IPC, "ring")
    with pytest.raises(ArgumentError, match="on device memory only"):
        yes.choose("allreduce", 1024, forced="kernel-twoshot")
    no = _selector(2, Verdict(False, "ranks 0,1 share GPU g0 without MPS"))
    with pytest.raises(ArgumentError, match="cannot take: ranks 0,1 share GPU g0 without"):
        no.choose("allreduce", 1024, memory="fake-cuda", forced="kernel-twoshot")


def _said(comm):
    memory = comm.device.memory
    return ([line for line in comm.describe().splitlines() if "kernel path" in line],
            comm.choose("allreduce", 1024, memory=memory),
            comm.selector.group.kernel)


def test_the_fake_reports_shared_devices_without_mps_by_default(fake_devices):
    for lines, choice, kernel in run_group(2, _said, device="fake"):
        assert not kernel.ok
        assert lines == ["kernel path (cuda-kernel, device allreduce): no: ranks 0,1 share "
                         "GPU fake:0 without MPS: their kernels take turns, so the kernel "
                         "path would spin for ever"]
        assert choice.engine == CUDA_IPC and "without MPS" in choice.why


def test_the_fake_reports_devices_of_their_own_and_mps_as_the_test_says(fake_devices):
    results = run_group(3, _said, device="fake", gpus=[0, 1, 2])
    verdicts = {kernel for _, _, kernel in results}
    assert len(verdicts) == 1  # the same on every rank
    (kernel,) = verdicts
    assert "kernels of ranks 0-2 run at once: each on its own GPU" in kernel.why
    fake_devices.mps_on = True
    (_, _, shared), _ = run_group(2, _said, device="fake")
    assert "ranks 0,1 share GPU fake:0 under MPS" in shared.why
    with pytest.raises(ValueError, match="one device index per rank"):
        run_group(2, _said, device="fake", gpus=[0])


def test_a_device_engine_setting_other_than_auto_keeps_the_kernel_path_off(monkeypatch,
                                                                        fake_devices):
    monkeypatch.setenv("RINGCOMM_DEVICE_ENGINE", "staged")
    (_, choice, kernel), _ = run_group(2, _said, device="fake", gpus=[0, 1])
    assert not kernel.ok and kernel.why == "RINGCOMM_DEVICE_ENGINE=staged"
    assert choice.engine == STAGED



# ----------------------------------------------------------------------------- the engine

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_dtype_and_op_through_the_engine_equals_numpy(fake_devices, world):
    """Every dtype and op at worlds 1-4 through ``comm.allreduce`` of a fake device array,
    by each kernel (forced) and by the selector's choice, on ranks with GPUs of their own:
    copied in, run by the mirror, copied out, equal to numpy on every rank."""
    gc.collect()  # arrays earlier tests' errors held
    live = fake_devices.live_allocations()
    results = run_group(world, allreduce_everything(45, ("kernel-oneshot", "kernel-twoshot",
                                                          None)),
                        device="fake", gpus=list(range(world)))
    every = len(list(pairs()))
    assert len({digest for *_, digest in results}) == 1
    for wrong, ops, choice, _ in results:
        assert wrong == []
        assert ops == 3 * every  # every one of them on the kernel path
        assert choice.engine == CUDA_KERNEL
    assert fake_devices.live_allocations() == live  # regions given back at close


@pytest.mark.parametrize("mps", [True, False])
def test_ranks_in_processes_map_each_others_regions(cluster, mps):
    """Real processes on the fake runtime (its memory shared between them, its kernels'
    blocks spinning on pads another process writes): three ranks sharing device 0 under MPS,
    or each on its own device. Every dtype and op by both kernels and the selector's choice
    equals numpy with the same bits on every rank, the verdict says why, and close leaves no
    device memory (each rank closes its mappings before the owner frees)."""
    world = 3
    res = cluster.run(world, "kernel_cases.job_kernel_path", mps=mps, timeout=120)
    assert len({r["digest"] for r in res}) == 1
    every = len(list(pairs()))
    for r in res:
        assert r["wrong"] == []
        assert r["ops"] == 3 * every and r["engine"] == CUDA_KERNEL
        assert r["chosen"] == ["allgather cuda-kernel:kernel-direct",
                               "reduce_scatter cuda-kernel:kernel-direct"]
        assert r["live"] == 0
    said = "share GPU fake:0 under MPS" if mps else "each on its own GPU"
    assert said in res[0]["verdict"]


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_the_kernel_path_on_the_test_runtime(cluster, gpu_runtime, gpu_device, world):
    """On a GPU: CuPy's launch of the kernels (``RINGCOMM_DEVICE_ENGINE=cuda-kernel``),
    ranks on GPUs of their own or sharing GPU 0 under MPS, the dtypes and ops training uses,
    sizes that take vectors, several blocks and pieces of the region, equal numpy's with the
    same bits on every rank (the fake runtime's mirror where RINGCOMM_TEST_RUNTIME=fake)."""
    if gpu_device == "cuda" and gpu_runtime.device_count() < world and \
            not gpu_runtime.mps().on:
        pytest.skip(f"{world} ranks share a GPU here without MPS: their kernels would take "
                    "turns (bench/gpu_check.sh starts MPS)")
    count = 300_001 if gpu_device == "cuda" else 45
    res = cluster.run(world, "kernel_cases.job_kernel_path", device_name=gpu_device,
                      count=count, timeout=280)
    assert len({r["digest"] for r in res}) == 1
    for r in res:
        assert r["wrong"] == [], r["wrong"]
        assert r["engine"] == CUDA_KERNEL, r["verdict"]
        assert r["live"] == 0


def test_a_rank_killed_under_a_waiting_kernel_gives_typed_errors_in_time(cluster):
    """Never a hang: rank 0's kernel waits for a rank that was killed, rank 1 for that
    rank's header. Both raise a typed error within the group's timeout (5 s), the kernel
    ends (its host sets the abort word), and the abort after it frees every region (it
    could not while a kernel still ran)."""
    cluster.run(3, "fault_jobs.job_ready", timeout=60)  # a replaced rank starts up first
    res = cluster.run(3, "kernel_cases.job_killed_in_kernel", dies=(2,), timeout=60)
    for r in res[:2]:
        assert r["first"] == [3.0] * 4 and r["engine"] == CUDA_KERNEL, r
        assert r["type"] in ("PeerLostError", "RemoteError", "CommTimeout"), r
        assert "rank 2" in r["msg"], r
        assert r["elapsed"] < 5.0 + 2.0, r
        assert r["abort_s"] < 4.0, r  # waits for the other survivor's "closed" only
        assert r["left"] == 0, r


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_and_allgather_take_one_kernel_and_equal_numpy(fake_devices, world):
    """Every dtype and op by ``comm.reduce_scatter`` and every dtype by ``comm.allgather``
    on fake device arrays, at worlds 1-4 with a GPU per rank: the kernel path's one kernel
    each, equal to numpy on every rank."""
    gc.collect()
    live = fake_devices.live_allocations()
    results = run_group(world, scatter_gather_everything(45), device="fake",
                        gpus=list(range(world)))
    for wrong, chosen, _ in results:
        assert wrong == []
        assert chosen == ["allgather cuda-kernel:kernel-direct",
                          "reduce_scatter cuda-kernel:kernel-direct"]
    assert fake_devices.live_allocations() == live


def test_reduce_scatter_and_allgather_larger_than_the_region_run_in_pieces(fake_devices,
                                                                          monkeypatch):
    """A region of 128 B: the reduce-scatter's blocks and the all-gather's bytes go in
    pieces, each piece of every block where the next kernel expects it (the reduce-scatter's
    in whole 16-byte vectors, so every rank's block of a piece starts aligned)."""
    from ringcomm.engines import kernel

    monkeypatch.setattr(kernel, "REGION_BYTES", kernel.MIN_REGION_BYTES)

    def fn(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        world, rank = comm.world_size, comm.rank
        x = FakeDeviceArray.from_host(np.arange(45 * world, dtype=np.float64) * (rank + 1))
        out = FakeDeviceArray.from_host(np.zeros(45))
        comm.reduce_scatter(out, x)
        y = FakeDeviceArray.from_host(np.arange(100, dtype=np.int16) + 100 * rank)
        gathered = FakeDeviceArray.from_host(np.zeros(100 * world, np.int16))
        comm.allgather(gathered, y)
        return out.to_host(), gathered.to_host(), comm.wiring.lanes[CUDA_KERNEL].channel.op_number

    for rank, (out, gathered, launches) in enumerate(run_group(3, fn, device="fake",
                                                               gpus=[0, 1, 2])):
        want = np.arange(45 * 3, dtype=np.float64)[rank * 45:(rank + 1) * 45] * 6
        assert out.tolist() == want.tolist()
        assert gathered.tolist() == [v + 100 * r for r in range(3) for v in range(100)]
        # 128 B hold 4 float64 (two whole vectors) of each of 3 blocks: 12 pieces of 45;
        # or 128 of the 200 B: 2 pieces
        assert launches == 12 + 2


def test_a_rank_whose_launch_fails_ends_its_channel_and_its_peers_are_told(fake_devices,
                                                                          monkeypatch):
    """Rank 1's launch of the second op fails after the headers were swapped, so rank 0's
    kernel waits for a kernel that never comes: rank 1 raises its error and aborts its
    channel (later ops refused, never run with op numbers that no longer agree); rank 0
    gets a typed error well within its timeout, not a hang."""
    import time

    from ringcomm.errors import CommAborted, CommError
    from ringcomm.testing.fake_kernels import StreamLauncher

    launch = StreamLauncher.launch_kernel

    def failing(self, **kw):
        if kw["rank"] == 1 and kw["op_number"] == 2:
            raise RuntimeError("the launch failed")
        return launch(self, **kw)

    monkeypatch.setattr(StreamLauncher, "launch_kernel", failing)

    def fn(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        x = FakeDeviceArray.from_host(np.ones(64, np.float32))
        comm.allreduce(x)
        started = time.monotonic()
        try:
            comm.allreduce(x)
            x.to_host()
        except (CommError, RuntimeError) as err:
            outcome = (type(err).__name__, str(err), time.monotonic() - started)
        else:
            outcome = ("none", "", 0.0)
        if comm.rank == 1:
            with pytest.raises(CommAborted, match="cuda-kernel engine cannot be used"):
                comm.allreduce(x)
        return outcome

    (zero, one) = run_group(2, fn, device="fake", gpus=[0, 1], timeout=5)
    assert one[0] == "RuntimeError" and "the launch failed" in one[1]
    assert zero[0] in ("RemoteError", "CommTimeout", "PeerLostError"), zero
    assert zero[2] < 5 + 2


def test_an_allreduce_larger_than_the_region_runs_in_pieces(fake_devices, monkeypatch):
    from ringcomm.engines import kernel

    monkeypatch.setattr(kernel, "REGION_BYTES", kernel.MIN_REGION_BYTES)  # 128 B

    def fn(comm):
        import numpy as np

        from ringcomm.testing.fake_device import FakeDeviceArray

        values = [np.arange(45, dtype=np.float64) * (r + 1) for r in range(comm.world_size)]
        out = {}
        for algorithm in ("kernel-oneshot", "kernel-twoshot"):
            x = FakeDeviceArray.from_host(values[comm.rank])
            comm.allreduce(x, "sum", algorithm=algorithm)
            out[algorithm] = x.to_host()
        return out, comm.wiring.lanes[CUDA_KERNEL].channel.op_number

    for out, launches in run_group(3, fn, device="fake", gpus=[0, 1, 2]):
        for got in out.values():
            assert got.tolist() == (np.arange(45) * 6.0).tolist()
        assert launches == 2 * 3  # 360 B in pieces of 128 B, twice


def test_ranks_that_launch_different_kernels_get_a_desync(fake_devices):
    from ringcomm.errors import DesyncError, RemoteError

    def fn(comm):
        from ringcomm.testing.fake_device import FakeDeviceArray

        x = FakeDeviceArray.from_host(np.ones(8 + comm.rank, np.float32))
        comm.allreduce(x, algorithm="kernel-oneshot")

    results = run_group(2, fn, device="fake", gpus=[0, 1], return_errors=True, timeout=10)
    assert all(isinstance(r, (DesyncError, RemoteError)) for r in results), results
    (desync,) = [r for r in results if isinstance(r, DesyncError)]
    assert "count" in str(desync), desync  # what differs, before any kernel was launched


def test_a_subgroup_makes_regions_of_its_own(fake_devices):
    """A split of a group on the kernel path takes it too, with its own regions (its records
    go through the parent's exchange under the subgroup's keys), and both give them back."""
    from ringcomm.testing.fake_device import FakeDeviceArray

    gc.collect()  # arrays earlier tests' errors held
    live = fake_devices.live_allocations()

    def fn(comm):
        sub = comm.split(comm.rank % 2)
        x = FakeDeviceArray.from_host(np.full(100, comm.rank + 1.0))
        sub.allreduce(x)
        y = FakeDeviceArray.from_host(np.full(100, comm.rank + 1.0))
        comm.allreduce(y)
        said = (x.to_host()[0], y.to_host()[0], sub.choose("allreduce", x).engine)
        sub.close()
        return said

    assert run_group(4, fn, device="fake", gpus=[0, 1, 2, 3]) == [
        (4.0, 10.0, CUDA_KERNEL), (6.0, 10.0, CUDA_KERNEL)] * 2
    assert fake_devices.live_allocations() == live
