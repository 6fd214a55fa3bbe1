"""Jobs for the ``ddp/`` tests, run by real rank processes over ringcomm or gloo.

The pool is the session's shared rank processes (``torch_jobs.OnThePool`` over
``conftest.cluster``: one job per test, a hung job killed at its limit) running this
module's functions. Every job builds the same
float64 model on every rank and checks, on every rank, that the gradients and weights equal
those of one process training on the whole batch; a job returns what the test asserts on.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch_jobs import on_cuda

import ringcomm  # noqa: F401 - registers the backend
import ringcomm_ddp as ddp  # the ddp/ folder, as it is installed

# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def group(backend: str, rank: int, world: int, port: int, timeout: float = 30.0
          ) -> Iterator[None]:
    """torch's default group on ``backend`` for the duration of a job."""
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


class Net(nn.Module):
    """The head is registered first and used last, so the order gradients come in differs
    from reverse registration order; a branch is used only when asked."""

    def __init__(self, branch: bool = False, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.body = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh())
        self.norm = norm
        self.branch = nn.Linear(16, 16) if branch else None

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = self.body(x)
        if self.norm is not None:
            h = self.norm(h)
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def model(branch: bool = False, norm: nn.Module | None = None) -> Net:
    torch.manual_seed(0)
    return Net(branch, norm).double()


def batches(steps: int, total: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` full batches of ``total`` samples, the same on every rank and device (drawn
    on the CPU, then moved to the default device: ``job_on_cuda`` makes that CUDA)."""
    g = torch.Generator().manual_seed(seed)
    device = torch.get_default_device()
    return [(torch.randn(total, 6, generator=g, dtype=torch.float64, device="cpu").to(device),
             torch.randn(total, 3, generator=g, dtype=torch.float64, device="cpu").to(device))
            for _ in range(steps)]


def shard(sizes: list[int], rank: int) -> slice:
    """This rank's samples when rank r holds ``sizes[r]`` of them."""
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def grads(m: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in m.parameters()]


def close(got: list, want: list, what: str, rtol: float = 1e-10, atol: float = 1e-13) -> None:
    """Equal up to the order of float64 additions; ``None`` only where ``None`` is wanted."""
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}: parameter {i}: {a} vs {b}"
            continue
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=f"{what}: parameter {i}")


def params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


mse = nn.MSELoss()
#: about one bucket per layer of ``Net`` (float64), the first one a layer's bias and weight
SMALL_BUCKETS = {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.0003}


def train_and_compare(rank: int, world: int, wrapped: nn.Module, ref: nn.Module,
                      data: list, sizes: list[int], what: str, lr: float = 0.1,
                      rtol: float = 1e-10, atol: float = 1e-13) -> None:
    """SGD with momentum on ``data``: rank r trains on its ``sizes[r]`` samples of each batch,
    ``ref`` on the whole batch; gradients compared after every backward, weights at the end.
    Gradients are zeroed in place, so where they are bucket views autograd accumulates
    straight into the buckets."""
    opt = torch.optim.SGD(wrapped.parameters(), lr=lr, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    mine = shard(sizes, rank)
    for step, (x, y) in enumerate(data):
        opt.zero_grad(set_to_none=False)
        opt_ref.zero_grad(set_to_none=False)
        mse(wrapped(x[mine]), y[mine]).backward()
        mse(ref(x), y).backward()
        inner = wrapped.module if isinstance(wrapped, ddp.DistributedDataParallel) else wrapped
        close(grads(inner), grads(ref), f"{what}: gradients of step {step}", rtol, atol)
        opt.step()
        opt_ref.step()
    close(params(wrapped), params(ref), f"{what}: weights", rtol, atol)


# --------------------------------------------------------------------------- jobs: core


def job_on_cuda(rank: int, inner: str, **kwargs: Any) -> Any:
    """The job named ``inner`` with CUDA as torch's default device: the models (ours and
    the one-process reference), their gradients, buckets and batches live on the GPU that
    the ranks share, and ringcomm reduces them there."""
    return on_cuda(globals()[inner], rank=rank, **kwargs)


def job_equivalence(rank: int, world: int, port: int, backend: str, **_: Any) -> dict:
    """Several buckets, each DDP mode, three SGD steps each, against one process."""
    out: dict[str, Any] = {}
    small = SMALL_BUCKETS
    modes: dict[str, dict] = {
        "default": {},
        "several buckets": small,
        "gradient_as_bucket_view": dict(small, gradient_as_bucket_view=True),
        "static_graph": dict(small, static_graph=True),
        "registration order": dict(small, bucket_order="registration"),
    }
    with group(backend, rank, world, port):
        for name, kwargs in modes.items():
            wrapped = ddp.DistributedDataParallel(model(), **kwargs)
            train_and_compare(rank, world, wrapped, model(), batches(3, 4 * world),
                              [4] * world, name)
            r = wrapped.reducer
            views = all(p.grad.data_ptr() == r._buckets[r._where[i][0]].views[
                r._where[i][1]].data_ptr() for i, p in enumerate(wrapped.parameters()))
            out[name] = {"buckets": len(r.layout), "launch_order": r.last_step.launch_order,
                         "rebuilds": [s for s, _ in r.rebuilds], "grads_are_views": views}
    return out


def job_unused(rank: int, world: int, port: int, backend: str, **_: Any) -> list[str]:
    """find_unused_parameters: a branch no rank uses in some steps (its gradient stays None,
    as in one process), used by every rank in others, and used by rank 0 only in one step
    (locally unused elsewhere, still averaged); with gradient_as_bucket_view too."""
    done = []
    use = [[False] * world, [True] * world, [r == 0 for r in range(world)], [False] * world]
    with group(backend, rank, world, port):
        for kwargs in ({}, {"gradient_as_bucket_view": True}):
            wrapped = ddp.DistributedDataParallel(
                model(branch=True), find_unused_parameters=True, **SMALL_BUCKETS, **kwargs)
            ref = model(branch=True)
            for step, (x, y) in enumerate(batches(len(use), 4 * world)):
                for m in (wrapped, ref):
                    m.zero_grad(set_to_none=True)
                mse(wrapped(x[shard([4] * world, rank)], use_branch=use[step][rank]),
                    y[shard([4] * world, rank)]).backward()
                loss = sum(mse(ref(x[shard([4] * world, r)], use_branch=use[step][r]),
                               y[shard([4] * world, r)]) for r in range(world)) / world
                loss.backward()
                close(grads(wrapped.module), grads(ref), f"{kwargs} step {step}")
            done.append("view" if kwargs else "copy")
    return done


def job_no_sync(rank: int, world: int, port: int, backend: str, steps: int = 3,
                **_: Any) -> list[str]:
    """``steps`` micro-batches under no_sync, then one that syncs: the accumulated local
    sums are averaged once, equal to one process accumulating every micro-batch. Then
    with find_unused_parameters, a branch used in the first micro-batch only (under
    no_sync), by every rank or by rank 0 alone: the synced step, which does not use it,
    still averages what it accumulated; the next synced step leaves it alone."""
    done = []
    with group(backend, rank, world, port):
        for kwargs in ({}, {"gradient_as_bucket_view": True}):
            wrapped = ddp.DistributedDataParallel(model(), **SMALL_BUCKETS,
                                                  **kwargs)
            ref = model()
            data = batches(steps + 1, 4 * world)
            mine = shard([4] * world, rank)
            for i, (x, y) in enumerate(data):
                mse(ref(x), y).backward()
                if i < steps:
                    with wrapped.no_sync():
                        mse(wrapped(x[mine]), y[mine]).backward()
                    assert wrapped.reducer.last_step is None, "a step under no_sync reduced"
                else:
                    mse(wrapped(x[mine]), y[mine]).backward()
            close(grads(wrapped.module), grads(ref), f"no_sync {kwargs}")
            done.append("view" if kwargs else "copy")
        for users in ("every rank", "rank 0"):
            _no_sync_unused(rank, world, steps, [users == "every rank" or r == 0
                                                 for r in range(world)], users)
            done.append(f"unused, used under no_sync by {users}")
    return done


def _no_sync_unused(rank: int, world: int, steps: int, used: list[bool], what: str) -> None:
    """``job_no_sync``'s find_unused_parameters part: rank r uses the branch in micro-batch
    0 if ``used[r]``; compared with one process after the synced step and after one more."""
    wrapped = ddp.DistributedDataParallel(model(branch=True), find_unused_parameters=True,
                                          **SMALL_BUCKETS)
    ref = model(branch=True)
    data = batches(steps + 2, 4 * world)
    for i, (x, y) in enumerate(data):
        branch = [i == 0 and used[r] for r in range(world)]
        if i == steps + 1:  # a new accumulation: nobody uses the branch in it
            for m in (wrapped, ref):
                m.zero_grad(set_to_none=True)
        sum(mse(ref(x[shard([4] * world, r)], use_branch=branch[r]), y[shard([4] * world, r)])
            for r in range(world)).div(world).backward()
        mine = shard([4] * world, rank)
        if i < steps:
            with wrapped.no_sync():
                mse(wrapped(x[mine], use_branch=branch[rank]), y[mine]).backward()
        else:
            mse(wrapped(x[mine], use_branch=branch[rank]), y[mine]).backward()
            close(grads(wrapped.module), grads(ref), f"no_sync, branch used by {what}, "
                  f"micro-batch {i}")


def job_bad_input(rank: int, world: int, port: int, backend: str, **_: Any) -> dict:
    """Each mistake gives every rank a clear error, quickly."""
    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        start = time.monotonic()
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - the test reads the type and text
            out[name] = (type(err).__name__, str(err), time.monotonic() - start)
        else:
            out[name] = None

    with group(backend, rank, world, port, timeout=20):
        width = 32 if rank == 0 else 33
        mismatched = nn.Sequential(nn.Linear(6, width), nn.Linear(width, 3)).double()
        attempt("mismatched", lambda: ddp.DistributedDataParallel(mismatched))
        attempt("different caps", lambda: ddp.DistributedDataParallel(
            model(), bucket_cap_mb=0.001 if rank == 0 else 0.002, first_bucket_mb=0.0003))
        attempt("integer", lambda: ddp.Reducer(
            [nn.Parameter(torch.ones(3)), torch.zeros(3, dtype=torch.int64)]))

        def unused_without_flag() -> None:
            wrapped = ddp.DistributedDataParallel(model(branch=True), **SMALL_BUCKETS)
            x, y = batches(1, 4)[0]
            mse(wrapped(x), y).backward()
        attempt("unused", unused_without_flag)
        dist.barrier()  # the group still works after all of them
        out["after"] = "ok"
    return out


def job_bucket_order(rank: int, world: int, port: int, backend: str, **_: Any) -> dict:
    """The Reducer on its own over a model whose forward order is not its registration
    order: the layout follows the observed order after the first step; when the last rank's
    graph changes (its branch joins in step 3) every rank rebuilds after the same step, and
    the debug log says when and why; with static_graph only the first rebuild happens."""
    out: dict[str, Any] = {}
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger = logging.getLogger("ddp")
    keep = Keep()
    logger.addHandler(keep)
    logger.setLevel(logging.DEBUG)
    with group(backend, rank, world, port):
        for static in (False, True):
            m = model(branch=True)
            reducer = ddp.Reducer(m.parameters(), **SMALL_BUCKETS,
                                  static_graph=static, find_unused_parameters=True,
                                  param_names=[n for n, _ in m.named_parameters()])
            layouts, ready_first = [reducer.layout], []
            for step, (x, y) in enumerate(batches(6, 4 * world)):
                mine = shard([4] * world, rank)
                out_ = m(x[mine], use_branch=step >= 3 and rank == world - 1)
                reducer.prepare_for_backward(out_)
                mse(out_, y[mine]).backward()
                layouts.append(reducer.layout)
                ready_first.append(reducer.last_step.ready_before_launch[0])
                assert reducer.last_step.launch_order == sorted(
                    reducer.last_step.launch_order), reducer.last_step.launch_order
            names = [n for n, _ in m.named_parameters()]
            out["static" if static else "observed"] = {
                "first_bucket": [[names[i] for i in lay[0]] for lay in layouts],
                "ready_before_first_launch": ready_first,
                "rebuilds": reducer.rebuilds,
                "ready_order": [names[i] for i in reducer.last_step.ready_order],
            }
            reducer.remove()
    logger.removeHandler(keep)
    logger.setLevel(logging.NOTSET)
    out["log"] = [m.replace(f"ddp: rank {rank}:", "ddp: rank R:") for m in messages
                  if "sync step" in m]
    return out


# --------------------------------------------------------------------------- jobs: features


class FeaturesFirst(nn.Module):
    """``Net`` taking its input transposed, (features, samples): the leading dimension of
    the first argument is not the batch size, so ``average="samples"`` must be told it."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, xt: torch.Tensor) -> torch.Tensor:
        return self.net(xt.t())


def job_samples(rank: int, world: int, port: int, backend: str, sizes: list[int],
                **_: Any) -> dict:
    """average="samples" with ``sizes[r]`` samples on rank r: exact against one process on
    all of them, with the batch size read from forward's input or set by hand, through the
    default allreduce (bookkeeping fused into the first bucket; gradients copied or bucket
    views) and through a comm hook (bookkeeping in its own allreduce); average="ranks" is
    not, where sizes differ."""
    out: dict[str, Any] = {}
    total = sum(sizes)
    with group(backend, rank, world, port):
        wrapped = ddp.DistributedDataParallel(model(), average="samples", **SMALL_BUCKETS)
        train_and_compare(rank, world, wrapped, model(), batches(3, total), sizes, "samples")
        out["fused"] = wrapped.reducer._control_mode()

        wrapped = ddp.DistributedDataParallel(model(), average="samples",
                                              gradient_as_bucket_view=True, **SMALL_BUCKETS)
        train_and_compare(rank, world, wrapped, model(), batches(3, total), sizes,
                          "samples, gradients as bucket views")

        wrapped = ddp.DistributedDataParallel(model(), average="samples", **SMALL_BUCKETS)
        wrapped.register_comm_hook(None, ddp.hooks.allreduce_hook)
        train_and_compare(rank, world, wrapped, model(), batches(3, total), sizes, "hook")
        out["hook"] = wrapped.reducer._control_mode()

        wrapped = ddp.DistributedDataParallel(FeaturesFirst(), average="samples")
        wrapped.set_local_batch_size(sizes[rank])
        ref = model()
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        for x, y in batches(2, total):
            mine = shard(sizes, rank)
            opt.zero_grad()
            opt_ref.zero_grad()
            mse(wrapped(x[mine].t()), y[mine]).backward()
            mse(ref(x), y).backward()
            opt.step()
            opt_ref.step()
        close(params(wrapped.module.net), params(ref), "set_local_batch_size")
        out["set"] = True

        wrapped = ddp.DistributedDataParallel(model(), average="ranks")
        try:
            train_and_compare(rank, world, wrapped, model(), batches(1, total), sizes, "ranks")
            out["ranks_exact"] = True
        except AssertionError:
            out["ranks_exact"] = False
    return out


class Counter(nn.Module):
    """Counts its forward calls in a buffer (for ``broadcast_buffers`` under join)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return h


def job_sync_batchnorm(rank: int, world: int, port: int, backend: str, sizes: list[int],
                       **_: Any) -> dict:
    """SyncBatchNorm from convert_sync_batchnorm against BatchNorm1d on the full batch:
    gradients, weights, running statistics and the eval-mode output."""
    total = sum(sizes)
    average = "ranks" if len(set(sizes)) == 1 else "samples"
    with group(backend, rank, world, port):
        converted = ddp.SyncBatchNorm.convert_sync_batchnorm(model(norm=nn.BatchNorm1d(16)))
        wrapped = ddp.DistributedDataParallel(converted.double(), average=average,
                                              **SMALL_BUCKETS)
        ref = model(norm=nn.BatchNorm1d(16)).double()
        train_and_compare(rank, world, wrapped, ref, batches(3, total), sizes, "SyncBatchNorm")
        sync_norm, ref_norm = wrapped.module.norm, ref.norm
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(sync_norm, name), getattr(ref_norm, name),
                                       rtol=1e-10, atol=1e-13, msg=name)
        x, _ = batches(1, 5, seed=7)[0]
        wrapped.eval()
        ref.eval()
        with torch.no_grad():
            torch.testing.assert_close(wrapped(x), ref(x), rtol=1e-10, atol=1e-13)
    return {"type": type(sync_norm).__name__, "average": sync_norm.average}


def job_hooks(rank: int, world: int, port: int, backend: str, **_: Any) -> dict:
    """Each compression hook (and torch's own fp16 hook on our DDP) against the exact
    gradient: within its precision, and not exact (so it really compressed). For int8 the
    bound is the one its docstring states: m / (2 * (127 // W)) per element, m the bucket's
    largest magnitude on any rank."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    out: dict[str, Any] = {}
    sizes = [4] * world
    x, y = batches(1, 4 * world)[0]
    ref = model()
    mse(ref(x), y).backward()
    want = grads(ref)
    # every rank's own gradients, for the int8 bound
    local = []
    for r in range(world):
        m = model()
        mse(m(x[shard(sizes, r)]), y[shard(sizes, r)]).backward()
        local.append(grads(m))
    hooks = {"fp16": (ddp.hooks.fp16_compress_hook, 1e-3), "bf16": (ddp.hooks.bf16_compress_hook,
                                                                     1e-2),
             "int8": (ddp.hooks.int8_compress_hook, None),
             "torch fp16": (default_hooks.fp16_compress_hook, 1e-3),
             "allreduce": (ddp.hooks.allreduce_hook, 0.0)}
    with group(backend, rank, world, port):
        for name, (hook, rtol) in hooks.items():
            wrapped = ddp.DistributedDataParallel(model(), **SMALL_BUCKETS)
            wrapped.register_comm_hook(None, hook)
            mse(wrapped(x[shard(sizes, rank)]), y[shard(sizes, rank)]).backward()
            got = grads(wrapped.module)
            errors = [float((a - b).abs().max()) for a, b in zip(got, want, strict=True)]
            if name == "int8":
                levels = 127 // world
                bound = [0.0] * len(want)
                for bucket in wrapped.reducer.layout:
                    m = max(float(g[i].abs().max()) for g in local for i in bucket)
                    for i in bucket:
                        bound[i] = m / (2 * levels) * (1 + 1e-6)
                assert all(e <= b for e, b in zip(errors, bound, strict=True)), (errors, bound)
            elif rtol == 0.0:
                close(got, want, name)
            else:
                scale = max(float(w.abs().max()) for w in want)
                assert max(errors) <= rtol * scale, (name, errors, scale)
            out[name] = max(errors)
        # a bucket holding inf or nan on any rank: every rank refuses to quantise it
        bad = torch.tensor([1.0, float("nan") if rank == 1 else 2.0])
        try:
            ddp.hooks.int8_compress_hook(None, ddp.GradBucket(0, bad, True, [], []))
        except FloatingPointError as err:
            out["nan"] = str(err)
    return out


def job_join(rank: int, world: int, port: int, backend: str, counts: list[int],
             divide_by_initial_world_size: bool = True, average: str = "ranks",
             fp16: bool = False, **_: Any) -> dict:
    """Rank r trains on ``counts[r]`` batches under join(): the weights equal one process's
    whose step i averages over the ranks that still had a batch i (divided by the world
    size, or by those ranks); the buffers were taken from a rank still training before each
    forward; every replica ends identical. With ``fp16`` the buckets go through the fp16
    hook (joined ranks run it on zeros) and the weights agree to fp16's precision."""
    world_sizes = [4] * world
    data = batches(max(counts), 4 * world)
    with group(backend, rank, world, port):
        wrapped = ddp.DistributedDataParallel(model(norm=Counter()), average=average,
                                              **SMALL_BUCKETS)
        if fp16:
            wrapped.register_comm_hook(None, ddp.hooks.fp16_compress_hook)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        with wrapped.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for x, y in data[:counts[rank]]:
                opt.zero_grad()
                mse(wrapped(x[shard(world_sizes, rank)]), y[shard(world_sizes, rank)]).backward()
                opt.step()
        ref = model(norm=Counter())
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        for i, (x, y) in enumerate(data):
            active = [r for r in range(world) if i < counts[r]]
            opt_ref.zero_grad()
            loss = sum(mse(ref(x[shard(world_sizes, r)]), y[shard(world_sizes, r)])
                       for r in active)
            divisor = world if divide_by_initial_world_size and average == "ranks" else len(
                active)
            (loss / divisor).backward()
            opt_ref.step()
        tolerance = {"rtol": 1e-3, "atol": 1e-4} if fp16 else {}
        close(params(wrapped.module), params(ref), f"join {counts}", **tolerance)
        flat = torch.cat([p.detach().reshape(-1) for p in wrapped.parameters()])
        everyone = [torch.zeros_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat)
        identical = all(torch.equal(e, everyone[0]) for e in everyone)
    return {"identical": identical, "calls": int(wrapped.module.norm.calls),
            "rebuilds": [s for s, _ in wrapped.reducer.rebuilds]}


# --------------------------------------------------------------------------- jobs: timing


class ReversedChain(nn.Module):
    """Layers registered in one order and run in the other: reverse registration order puts
    the gradients that come last into the first bucket."""

    def __init__(self, width: int = 512, depth: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def job_first_launch(rank: int, world: int, port: int, backend: str, steps: int = 12,
                     **_: Any) -> dict:
    """When the first allreduce starts, as a fraction of backward, with the observed bucket
    order and with the static reverse registration order (torch's defaults: 1 MiB first
    bucket, 25 MiB cap; float32). Medians over ``steps`` after two warm-up steps."""
    import statistics

    out: dict[str, Any] = {}
    with group(backend, rank, world, port):
        for order in ("registration", "observed"):
            torch.manual_seed(0)
            wrapped = ddp.DistributedDataParallel(ReversedChain(), bucket_order=order)
            g = torch.Generator().manual_seed(rank)
            x, y = torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g)
            first, backward, ready = [], [], []
            for step in range(steps + 2):
                loss = mse(wrapped(x), y)
                dist.barrier()
                start = time.perf_counter()
                loss.backward()
                record = wrapped.reducer.last_step
                if step >= 2:
                    first.append(record.launch_times[0] - start)
                    backward.append(record.finish_time - start)
                    ready.append(record.ready_before_launch[0])
            out[order] = {"first_launch_ms": statistics.median(first) * 1e3,
                          "backward_ms": statistics.median(backward) * 1e3,
                          "ready_before_first_launch": statistics.median(ready),
                          "buckets": len(wrapped.reducer.layout)}
    return out
