"""``ddp`` beyond plain averaging, over real processes on ringcomm and gloo: exact gradients
for unequal local batches (``average="samples"``), ``SyncBatchNorm`` against ``BatchNorm`` on
the full batch, the communication hooks within their precision, and ``join`` with uneven
numbers of batches. Jobs in ``tests/ddp_jobs.py``, run by three of the session's shared rank
processes.
"""

from __future__ import annotations

import pytest
from torch_jobs import OnThePool

BACKENDS = ["ringcomm", "gloo"]


@pytest.fixture(scope="module")
def ranks(cluster):
    """3 ranks for the jobs of ``ddp_jobs``: the session's shared rank processes."""
    return OnThePool(cluster, 3, "ddp_jobs")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_average_samples_is_exact_for_unequal_local_batches(ranks, backend):
    res = ranks.run("job_samples", 3, timeout=50, backend=backend, sizes=[2, 3, 5])
    for out in res:
        assert out["fused"] == "fused" and out["hook"] == "separate", out
        assert out["set"]
        assert out["ranks_exact"] is False  # the mean over ranks is not the full-batch one


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", [[4, 4], [2, 3, 5]], ids=["equal", "unequal"])
def test_sync_batchnorm_equals_batchnorm_on_the_full_batch(ranks, backend, sizes):
    res = ranks.run("job_sync_batchnorm", len(sizes), timeout=50, backend=backend,
                    sizes=sizes)
    want = "ranks" if len(set(sizes)) == 1 else "samples"
    assert res == [{"type": "SyncBatchNorm", "average": want}] * len(sizes)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", BACKENDS)
def test_compression_hooks_stay_within_their_precision(ranks, backend):
    res = ranks.run("job_hooks", 2, timeout=50, backend=backend)
    for out in res:
        assert out["allreduce"] < 1e-12
        assert min(out["fp16"], out["bf16"], out["int8"]) > 0, out
        assert out["torch fp16"] == pytest.approx(out["fp16"], rel=0.5)
        assert "bucket 0 holds inf or nan on some rank" in out["nan"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", BACKENDS)
def test_join_with_uneven_batches_ends_with_identical_replicas(ranks, backend):
    """Rank r has 2 + r batches (then r: rank 0 has none and shadows from the start,
    through the first rebuild), divided by the world size or by the ranks still training,
    with average="samples", and through the fp16 hook."""
    cases = [dict(counts=[2, 3, 4]), dict(counts=[0, 1, 2]),
             dict(counts=[2, 3, 4], divide_by_initial_world_size=False),
             dict(counts=[1, 3, 2], average="samples"), dict(counts=[1, 2, 3], fp16=True)]
    for case in cases:
        res = ranks.run("job_join", 3, timeout=40, backend=backend, **case)
        longest = max(case["counts"])
        assert res == [{"identical": True, "calls": longest, "rebuilds": [1]}] * 3, (case, res)
