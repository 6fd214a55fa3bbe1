"""torch.distributed on the "ringcomm" backend, with real processes on 127.0.0.1.

The ranks are the session's shared rank processes (``conftest.cluster``), given one job of
``tests/torch_jobs.py`` per test; every job creates torch's default group (tcp://, file://
or env://), checks values on every rank, and destroys it, so every job after the first is
also a re-init in a process that had a group before. The examples are run as the programs they are.

The default suite runs the collectives, the staging of tensors the group cannot use in
place and its copies back (blocking and async), and another default device, at world 2;
the rest of the matrix, DDP and the examples are marked slow.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch_jobs import ONE_BITS, OnThePool, free_port, vals

import ringcomm
from ringcomm import torch_backend

ROOT = Path(__file__).resolve().parent.parent
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(cluster):
    """Three ranks for the jobs of ``torch_jobs``: the session's shared rank processes, each
    started by the first job that needs it."""
    return OnThePool(cluster, 3)


# --------------------------------------------------------------------------- registration


@slow
@pytest.mark.timeout(60)
def test_registered_by_import_and_by_the_entry_point_without_it(tmp_path):
    assert "RINGCOMM" in dist.Backend._plugins  # this module imported ringcomm
    installed = [e.value for e in entry_points(group="torch.backends") if e.name == "ringcomm"]
    assert installed == ["ringcomm.torch_entry:_autoload"], (
        "the torch.backends entry point is not installed: reinstall ringcomm "
        "(pip install -e .), pyproject.toml declares it")

    def run(code: str, **env: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                              text=True, timeout=50, check=True,
                              env=dict(os.environ, **env)).stdout.split()

    code = ("import sys, torch.distributed as dist; "
            "print('RINGCOMM' in dist.Backend._plugins, 'ringcomm' in sys.modules)")
    assert run(code) == ["True", "True"]  # `import torch` ran the entry point
    code = ("import ringcomm, sys; assert 'torch' not in sys.modules; "
            "import torch.distributed as dist; print('RINGCOMM' in dist.Backend._plugins)")
    assert run(code, TORCH_DEVICE_BACKEND_AUTOLOAD="0") == ["True"]  # imported before torch


@pytest.mark.timeout(10)
def test_the_entry_point_never_raises(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("registry is broken")

    monkeypatch.setattr(dist.Backend, "register_backend", broken)
    torch_backend._autoload()  # an exception here would break every `import torch`
    assert "could not register" in caplog.text


# --------------------------------------------------------------------------- collectives


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,how", [(2, "tcp"), pytest.param(3, "file", marks=slow)])
def test_every_collective_gives_checked_values(ranks, world, how):
    """All reduce ops on float, int and bool dtypes, coalesced all-reduce and the
    coalescing manager, broadcast and reduce from every root, all_gather (lists, into a
    tensor, coalesced, a dtype moved as bytes), reduce_scatter (list and tensor), gather and
    scatter, all_to_all (uneven lists), all_to_all_single (even and uneven splits), barrier,
    the object collectives and the functional collectives; non-contiguous, 0-dim, complex
    and 3 MiB tensors."""
    checks = ranks.run("job_collectives", world, how=how)
    assert len(set(checks)) == 1 and checks[0] > 70, checks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=slow)])
def test_async_calls_copy_staged_results_back_when_they_complete(ranks, world):
    """A column, a transposed view, gather into and scatter out of views, all_gather of a
    dtype moved as bytes into a list: async, each op queued for the worker; the values are
    in the caller's tensors once ``wait`` returns, and when the future's callbacks run."""
    everyone = range(world)
    total = sum(r + 1 for r in everyone)
    for rank, got in enumerate(ranks.run("job_staged_async", world)):
        m = torch.arange(24.0).reshape(4, 6) * (rank + 1)
        m[:, 1] = torch.arange(24.0).reshape(4, 6)[:, 1] * total
        assert got["all_reduce"] == m.tolist(), rank  # the column summed, the rest kept
        assert got["broadcast"] == (torch.arange(6) + 10 * (world - 1)).reshape(2, 3).t(
            ).tolist(), rank
        assert got["gather"] == (None if rank else [vals(r, 8).reshape(4, 2).tolist()
                                                    for r in everyone]), rank
        assert got["scatter"] == (torch.arange(6.0).reshape(3, 2) + 10 * rank).tolist(), rank
        assert got["all_gather"] == [[60000 + r] * 3 for r in everyone], rank
        assert got["completed"], rank


@slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,how", [(2, "env"), (3, "tcp")])
def test_point_to_point_in_any_order_and_from_any_source(ranks, world, how):
    res = ranks.run("job_p2p", world, how=how)
    assert res[0]["sources"] == sorted(list(range(1, world)) * 2)


@slow
@pytest.mark.timeout(60)
def test_recv_from_any_source_ignores_a_rank_that_left(ranks):
    assert ranks.run("job_any_source_after_a_rank_left", 3) == [1, "sent", "left"]


@slow
@pytest.mark.timeout(60)
def test_new_group_and_new_subgroups_get_their_own_communicators(ranks):
    res = ranks.run("job_groups", 3)
    assert all(r["threads_after"] == [] for r in res), res  # all of them shut down
    assert [r["subgroups"] for r in res] == [3, 3, 3]


@slow
@pytest.mark.timeout(60)
def test_errors_are_typed_through_work_and_future(ranks):
    res = ranks.run("job_errors", 2)
    name, waited = res[1]["wait_timeout"]
    assert name == "CommTimeout" and 0.29 < waited < 2.0  # the wait honoured its timeout
    assert res[1]["late_recv"]  # and the receive still completed afterwards
    assert "Rank 0 timed out in monitoredBarrier after 0 ms" in res[0]["monitored"]
    assert [r["bad_arg"] for r in res] == ["ArgumentError"] * 2
    assert all("cannot reduce" in r["bad_dtype"] and "float32" in r["bad_dtype"] for r in res)
    kinds = [r["desync"] for r in res]
    assert set(kinds) <= {"DesyncError", "RemoteError"} and "DesyncError" in kinds, kinds
    assert all(("DesyncError" in r["future"]) or ("RemoteError" in r["future"]) for r in res)
    assert [r["after"] for r in res] == ["CommAborted"] * 2  # a failed group stays failed
    assert all(r["threads"] == [] for r in res)


@slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_sizes_that_differ_by_a_little_fail_in_the_call_itself_on_every_rank(ranks, world):
    """2^20 against 2^20 + 8 floats through dist.all_reduce: the first message between the
    ranks carries the counts, so the call raises at once, naming both."""
    res = ranks.run("job_size_mismatch", world)
    assert all(r["type"] in ("DesyncError", "RemoteError") for r in res), res
    assert all(r["elapsed"] < 5.0 for r in res), res
    n = 1 << 20
    texts = [r["msg"] for r in res if r["type"] == "DesyncError"]
    assert texts and all(
        re.search(rf"rank 1 reduces {n + 8} elements, rank [02] {n}\.", t) or
        re.search(rf"rank [02] reduces {n} elements, rank 1 {n + 8}\.", t)
        for t in texts), texts
    for r in res:
        if r["type"] == "RemoteError":
            assert "failed and aborted the group: DesyncError" in r["msg"]


def _row_then_column(world: int) -> list[torch.Tensor]:
    """Every rank's 4 x 4 matrix (rank r's: 0..15 times r + 1) after a sum of elements 1-4
    and then of column 1, whose first element is element 1."""
    ms = [torch.arange(16.0).reshape(4, 4) * (r + 1) for r in range(world)]
    row = sum(m.view(-1)[1:5] for m in ms)
    for m in ms:
        m.view(-1)[1:5] = row
    column = sum(m[:, 1] for m in ms)
    for m in ms:
        m[:, 1] = column
    return ms


@slow
@pytest.mark.timeout(60)
def test_the_short_way_reduces_the_tensor_it_is_given(ranks):
    """The blocking all_reduce of a contiguous CPU tensor reuses a view per address, size
    and dtype: a tensor that shares an address with an earlier one but is another part of
    the storage, another dtype, a negated view or a strided column of the same address and
    size is still reduced as itself."""
    for rank, got in enumerate(ranks.run("job_short_way", 2)):
        total = got["total"]
        assert got["parts"] == [i * total for i in range(8)] + [
            i * (rank + 1.0) for i in range(8, 12)]  # the rest of the storage untouched
        assert got["other dtype"] == [2 * ONE_BITS + 1] * 4  # added as int32
        assert got["negated"] == ([-1.0] * 3, [1.0] * 3)  # max of -(r + 1) is -1
        assert got["column"] == _row_then_column(2)[rank].tolist()
        assert got["fresh 1.0"] == [float(total)] * 16
        assert got["fresh 2.0"] == [2.0 * total] * 16
        assert not got["kept alive"], "a reduced tensor stays alive after its last reference"


@slow
@pytest.mark.timeout(60)
def test_a_blocking_call_that_raises_leaves_no_op_running_on_its_memory(ranks):
    """The short way lends the communicator a view of the caller's memory that keeps
    nothing alive; a blocking call must not return or raise while an op still uses it."""
    for got in ranks.run("job_blocking_call_leaves_nothing_running", 2):
        assert got["raised"] == "ValueError"
        assert got["idle"], "an op of the call still runs after it raised"
        assert got["gathered"] == [1.0, 2.0]  # the first pair's op ran to its end


@slow
@pytest.mark.timeout(60)
def test_destroy_leaves_nothing_behind_and_reinit_works(ranks):
    assert ranks.run("job_reinit", 2) == [{"left": []}] * 2


# --------------------------------------------------------------------------- DDP


@slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3])
def test_ddp_gradients_equal_one_process_on_the_full_batch(ranks, world):
    """torch's own DistributedDataParallel, float64: plain, find_unused_parameters,
    static_graph, gradient_as_bucket_view and tiny buckets (one bucket per parameter) for
    three SGD steps; no_sync; the fp16 compression hook (to fp16 precision); a branch used
    in one step only; and Join with a different number of batches per rank."""
    done = ranks.run("job_ddp", world, timeout=110)
    assert done == [["plain", "find_unused_parameters", "static_graph",
                     "gradient_as_bucket_view", "small buckets", "no_sync",
                     "fp16_compress_hook", "unused branch", "Join"]] * world


# --------------------------------------------------------------------------- devices


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=slow)])
def test_another_default_device_leaves_the_group_on_the_host(ranks, world):
    total = sum(r + 1 for r in range(world))
    last = (torch.arange(6.0) + 10 * (world - 1)).reshape(2, 3).t().flatten().tolist()
    for rank, got in enumerate(ranks.run("job_another_default_device", world)):
        assert got == {
            "all_reduce": [1.0 * total, 5.0 * total, 9.0 * total],
            "broadcast": last,
            "group's broadcast": last,
            "group's all_gather": [[float(r)] * 2 for r in range(world)],
            "group's all_to_all": [float(10 * j + rank) for j in range(world)],
            "group's sparse all_reduce": [float(r + 1) for r in range(world)],
            "all_gather": [[float(r)] * 2 for r in range(world)],
            "reduce_scatter": [world * 2.0 * rank, world * (2.0 * rank + 1)],
        }, rank


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the ranks share GPU 0)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_tensors_give_the_values_cpu_tensors_give(ranks, world):
    """Every collective of ``test_every_collective_gives_checked_values`` and every DDP
    mode of ``test_ddp_gradients_equal_one_process_on_the_full_batch`` again, on CUDA
    tensors the ranks' shared GPU reduces: the results land in the tensors given, equal to
    the CPU's and to one process training on the whole batch."""
    checks = ranks.run("job_on_cuda", world, timeout=200, inner="job_collectives")
    assert len(set(checks)) == 1 and checks[0] > 70, checks
    done = ranks.run("job_on_cuda", world, timeout=200, inner="job_ddp")
    assert done == [["plain", "find_unused_parameters", "static_graph",
                     "gradient_as_bucket_view", "small buckets", "no_sync",
                     "fp16_compress_hook", "unused branch", "Join"]] * world


# --------------------------------------------------------------------------- examples


@slow
@pytest.mark.timeout(120)
def test_the_classic_programs_run_with_only_the_backend_name_changed():
    """The DDP design note's example, synchronous SGD with send/recv and per-parameter
    all_reduce, and the torchrun example; run side by side, each on its own port."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    runs = {
        "ddp_design_note": [sys.executable, "examples/ddp_design_note.py"],
        "sync_sgd": [sys.executable, "examples/sync_sgd.py", "--world-size", "3"],
        "torchrun_ddp": [str(torchrun), "--standalone", "--nproc-per-node", "2",
                         "examples/torchrun_ddp.py"],
    }
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=dict(env, MASTER_PORT=str(free_port())),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in runs.items()}
    outs = {name: p.communicate(timeout=110)[0] for name, p in procs.items()}
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{outs[name][-3000:]}"
    sums = {line.split()[-1] for line in outs["ddp_design_note"].splitlines()
            if "weight sum" in line}
    assert len(sums) == 1, outs["ddp_design_note"]  # both ranks hold the same weights
    assert outs["sync_sgd"].count("weights equal on all 3 ranks") == 3, outs["sync_sgd"]
    assert "2 ranks on ringcomm: weights equal on every rank" in outs["torchrun_ddp"]


def test_version_is_exported():
    assert ringcomm.__version__
