"""``ddp.Reducer`` and ``ddp.DistributedDataParallel`` over real processes, on ringcomm and
gloo: float64 gradients and weights equal to one process training on the whole batch in
every mode, unused parameters, ``no_sync``, the launch order and bucket order from
observation, and each kind of bad input as a clear error on every rank.

The jobs are in ``tests/ddp_jobs.py``; two of the session's shared rank processes run them.
"""

from __future__ import annotations

import pytest
import torch
from torch_jobs import OnThePool

BACKENDS = ["ringcomm", "gloo"]


@pytest.fixture(scope="module")
def ranks(cluster):
    """2 ranks for the jobs of ``ddp_jobs``: the session's shared rank processes."""
    return OnThePool(cluster, 2, "ddp_jobs")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_and_weights_equal_one_process_on_the_full_batch(ranks, backend):
    """One bucket, several buckets, gradient_as_bucket_view, static_graph and the static
    reverse registration order: three SGD steps each."""
    res = ranks.run("job_equivalence", 2, timeout=80, backend=backend)
    assert res[0] == res[1]
    modes = res[0]
    assert modes["default"]["buckets"] == 1
    for name in ("several buckets", "gradient_as_bucket_view", "static_graph",
                 "registration order"):
        assert modes[name]["buckets"] >= 3, modes[name]
    for name, mode in modes.items():
        assert mode["launch_order"] == list(range(mode["buckets"])), (name, mode)
    assert modes["gradient_as_bucket_view"]["grads_are_views"]
    assert not modes["several buckets"]["grads_are_views"]
    assert modes["several buckets"]["rebuilds"] == [1]  # after the first step only
    assert modes["static_graph"]["rebuilds"] == [1]
    assert modes["registration order"]["rebuilds"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU and a CUDA build of torch (the ranks share GPU 0)")
@pytest.mark.timeout(180)
def test_on_cuda_gradients_and_weights_equal_one_process(ranks):
    """Every mode of the test above with the model, its gradients and the batches on the
    GPU both ranks share: ``ddp/`` over ringcomm equals one process on the whole batch."""
    res = ranks.run("job_on_cuda", 2, timeout=170, inner="job_equivalence",
                    backend="ringcomm")
    assert res[0] == res[1]
    modes = res[0]
    assert set(modes) == {"default", "several buckets", "gradient_as_bucket_view",
                          "static_graph", "registration order"}
    assert modes["gradient_as_bucket_view"]["grads_are_views"]
    assert modes["several buckets"]["rebuilds"] == [1]
    assert modes["registration order"]["rebuilds"] == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_find_unused_parameters_matches_one_process_step_by_step(ranks, backend):
    """A branch unused by every rank (its gradient stays None), used by every rank, and
    used by rank 0 only; copying gradients and as bucket views."""
    assert ranks.run("job_unused", 2, timeout=50, backend=backend) == [["copy", "view"]] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_sync_accumulates_locally_then_averages_once(ranks, backend):
    """Also with find_unused_parameters, where a parameter is used under no_sync only (by
    every rank, or by one): the synced step averages what it accumulated, as one process
    on the full batch gets it."""
    assert ranks.run("job_no_sync", 2, timeout=50, backend=backend, steps=3) == [
        ["copy", "view", "unused, used under no_sync by every rank",
         "unused, used under no_sync by rank 0"]] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_a_clear_error_on_every_rank(ranks, backend):
    res = ranks.run("job_bad_input", 2, timeout=50, backend=backend)
    for rank, out in enumerate(res):
        kind, text, took = out["mismatched"]
        assert kind == "ValueError" and took < 10, out["mismatched"]
        assert "parameter or buffer 0 is '0.weight' of shape (32, 6)" in text, text
        assert "on rank 1" in text and "(33, 6)" in text, text

        kind, text, _ = out["different caps"]
        assert kind == "RuntimeError" and "bucket layout differs across ranks" in text, text
        assert "ranks 1 would reduce" in text, text

        kind, text, _ = out["integer"]
        assert kind == "TypeError" and "'parameter 1' has dtype torch.int64" in text, text

        kind, text, took = out["unused"]
        assert kind == "RuntimeError" and took < 10, out["unused"]
        assert "no gradient in this backward pass for 'branch.weight', 'branch.bias'" in text
        assert "find_unused_parameters=True" in text
        assert out["after"] == "ok", (rank, out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_buckets_follow_the_observed_order_and_every_rank_rebuilds_together(ranks, backend):
    """The head is registered first but its gradient comes first: after the first step it is
    in the first bucket, which then launches after the fewest gradients. When the branch
    joins in step 3 on the last rank only, that rank flags it in step 4's first bucket and
    every rank rebuilds after step 4 (rank 0's order decides); static_graph keeps the first
    rebuild only."""
    res = ranks.run("job_bucket_order", 2, timeout=50, backend=backend)
    orders = [[r[kind].pop("ready_order") for kind in ("observed", "static")] for r in res]
    assert res[0] == res[1]  # the same layouts, rebuilds, reasons and log on every rank
    assert "branch.bias" not in orders[0][0] and "branch.bias" in orders[1][0]
    observed, static = res[0]["observed"], res[0]["static"]
    assert observed["first_bucket"][0] == ["branch.bias", "branch.weight"]  # reverse order
    assert observed["first_bucket"][1][0] == "head.bias"  # what came first in step 0
    assert orders[0][0][:2] == ["head.bias", "head.weight"]
    assert [step for step, _ in observed["rebuilds"]] == [1, 5]
    assert "1 rank(s) saw the gradient order change in sync step 4" in observed["rebuilds"][1][1]
    assert observed["first_bucket"][5][0] == "head.bias"
    assert [step for step, _ in static["rebuilds"]] == [1]
    log = res[0]["log"]
    assert len(log) == 3 and all(m.startswith("ddp: rank R: ") for m in log), log
    assert "rebuilt buckets after sync step 1 (the first step's order)" in log[0]
    assert "after sync step 5 (1 rank(s) saw the gradient order change in sync step 4)" in log[1]
    assert observed["ready_before_first_launch"][1] == 2  # the head's bias and weight


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_observed_order_launches_the_first_allreduce_earlier(ranks, backend, capsys):
    """On a model run in the reverse of its registration order, the first bucket under the
    static reverse registration order waits for the last gradient; under the observed order
    it goes out after the first layer's. Measured (median over 12 steps on each rank)."""
    res = ranks.run("job_first_launch", 2, timeout=110, backend=backend)
    for out in res:
        static, observed = out["registration"], out["observed"]
        assert static["ready_before_first_launch"] == 12  # every gradient
        assert observed["ready_before_first_launch"] == 2  # the first layer's weight and bias
        assert observed["first_launch_ms"] < 0.5 * static["first_launch_ms"], out
    with capsys.disabled():
        for rank, out in enumerate(res):
            print(f"\n{backend} rank {rank}: " + "; ".join(
                f"{k}: first allreduce at {v['first_launch_ms']:.2f} ms of "
                f"{v['backward_ms']:.2f} ms backward" for k, v in out.items()))
