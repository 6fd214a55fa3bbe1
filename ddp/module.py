"""``DistributedDataParallel``: a module wrapper that trains one replica per rank in lockstep.

A drop-in for torch's DDP for the arguments it takes, built on ``Reducer`` and on public
``torch.distributed`` calls only, so the same training code runs over ringcomm, gloo or
nccl and can be compared with torch's own DDP. At construction every rank checks that it
holds the same parameters and buffers as rank 0 and takes rank 0's values; each forward
that will sync takes rank 0's buffers again (``broadcast_buffers``), runs the module and
hands the Reducer what its backward needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from .consistency import describe, verify_same_across_ranks
from .graph import tensors_in
from .join import DDPJoinHook
from .reducer import CommHook, Reducer
from .sync_batchnorm import SyncBatchNorm


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism over ``process_group`` (the default group when ``None``).

    ``bucket_cap_mb`` and ``first_bucket_mb`` size the buckets; ``find_unused_parameters``
    walks each forward's graph so parameters it did not use are not waited for;
    ``gradient_as_bucket_view`` makes each ``param.grad`` a view into its bucket (no copy
    back, less memory); ``broadcast_buffers`` takes rank 0's buffers before every forward;
    ``static_graph`` skips the per-step check of the gradient order. ``average`` is "ranks"
    (the mean of the ranks' gradients, as torch's DDP) or "samples" (each rank weighted by
    its local batch size: the gradient of the mean loss over the whole batch, also when
    ranks hold different numbers of samples). ``bucket_order="registration"`` keeps the
    reverse registration order instead of the observed one.

    Example::

        >>> model = ddp.DistributedDataParallel(net, average="samples")
        >>> loss_fn(model(x), y).backward()   # x: this rank's samples, any number of them
        >>> opt.step()
    """

    def __init__(self, module: nn.Module, process_group: Any = None,
                 bucket_cap_mb: float | None = 25.0, first_bucket_mb: float = 1.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 broadcast_buffers: bool = True, static_graph: bool = False,
                 average: str = "ranks", *, bucket_order: str = "observed") -> None:
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError("ddp: call torch.distributed.init_process_group first")
        self.module = module
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.broadcast_buffers = broadcast_buffers
        # walking the modules for buffers costs a few microseconds per module and forward
        self._syncs_buffers = broadcast_buffers and any(True for _ in module.buffers())
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        named = list(module.named_parameters())
        # one comparison of everything every rank must share, before anything else
        verify_same_across_ranks(
            [describe(n, p) for n, p in named]
            + [describe(f"buffer {n}", b) for n, b in module.named_buffers()],
            self.process_group, "parameter or buffer")
        trained = [(n, p) for n, p in named if p.requires_grad]
        self.reducer = Reducer(
            [p for _, p in trained], self.process_group,
            bucket_cap_mb=25.0 if bucket_cap_mb is None else bucket_cap_mb,
            first_bucket_mb=first_bucket_mb, find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph,
            average=average, bucket_order=bucket_order, param_names=[n for n, _ in trained],
            verify=False)
        _broadcast([p for _, p in named] + list(module.buffers()), self.process_group, src=0)
        for m in module.modules():
            if isinstance(m, SyncBatchNorm):
                m.average = average

    # ------------------------------------------------------------------ training

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled()
        sync = grad and self.require_backward_grad_sync
        if self._join_config.enable:
            Join.notify_join_context(self)
            self._announce_sync(sync)
        if sync and self._syncs_buffers:
            self._sync_buffers(active=True)
        if grad:  # the backward of this forward syncs or not, whatever comes in between
            self.reducer.require_sync = self.require_backward_grad_sync
        output = self.module(*inputs, **kwargs)
        if sync:
            first = next(iter(tensors_in((inputs, kwargs))), None)
            local_batch = first.shape[0] if first is not None and first.dim() > 0 else None
            self.reducer.prepare_for_backward(output, local_batch)
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the forward and backward passes run inside; the
        first synchronised backward after it averages the accumulated sums."""
        before = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def set_local_batch_size(self, n: int | None) -> None:
        """This rank's batch size for the following steps (``average="samples"``), where the
        first tensor argument of forward does not say it; ``None`` infers it again."""
        self.reducer.set_local_batch_size(n)

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """``hook(state, bucket) -> Future`` reduces each bucket (see ``ddp.hooks``)."""
        self.reducer.register_comm_hook(state, hook)

    # ------------------------------------------------------------------ join

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """A context manager for ranks with different numbers of batches, as torch's.

        A rank that runs out of batches shadows the others' collectives, contributing zero
        gradients (and zero samples), until every rank is done; then all ranks take the
        parameters of one that trained to the end. ``divide_by_initial_world_size=False``
        averages over the ranks still training (``average="ranks"``; with "samples" the
        average is over the samples that exist anyway).
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        self.reducer.divide_by_initial_world_size = kwargs.get(
            "divide_by_initial_world_size", True)
        return DDPJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.reducer.device

    @property
    def join_process_group(self) -> Any:
        return self.process_group

    def shadow_step(self) -> None:
        """On a rank that has joined, for each step the others still train (``join``
        calls it): the collectives a training rank issues in one step, in the same order,
        with zero contributions. Whether the step syncs, then if it does the buffers, the
        step's bookkeeping and every bucket (``Reducer.shadow_step``)."""
        if not self._agree_on_sync_as_joined():
            return
        if self._syncs_buffers:
            self._sync_buffers(active=False)
        self.reducer.shadow_step()

    def take_model_of_last_joiner(self, is_last_joiner: bool) -> None:
        """After join: every rank takes the parameters and buffers of one rank that trained
        to the end (the highest such rank), so all replicas end identical."""
        src = self._common_rank(is_last_joiner)
        _broadcast(list(self.module.parameters()) + list(self.module.buffers()),
                   self.process_group, src)

    def _announce_sync(self, sync: bool) -> None:
        """Tell joined ranks whether this step syncs: they add 0 and read the sum
        (``shadow_step``); training ranks need not wait for it."""
        flag = torch.tensor([1.0 if sync else 0.0], device=self.join_device)
        dist.all_reduce(flag, group=self.process_group, async_op=True)

    def _agree_on_sync_as_joined(self) -> bool:
        flag = torch.zeros(1, device=self.join_device)
        dist.all_reduce(flag, group=self.process_group)
        return bool(flag.item())

    def _sync_buffers(self, active: bool) -> None:
        buffers = list(self.module.buffers())  # read again: a buffer may have been replaced
        src = self._common_rank(active) if self._join_config.enable else 0
        _broadcast(buffers, self.process_group, src)

    def _common_rank(self, candidate: bool) -> int:
        """The highest group rank for which ``candidate`` is true on that rank."""
        rank = dist.get_rank(self.process_group)
        t = torch.tensor([rank if candidate else -1], device=self.join_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return int(t.item())


@torch.no_grad()
def _broadcast(tensors: Sequence[torch.Tensor], group: Any, src: int) -> None:
    """Every rank takes group rank ``src``'s values of ``tensors``: one broadcast per device
    and dtype."""
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.device, t.dtype), []).append(t)
    src_global = dist.get_global_rank(group, src)
    for same in kinds.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src_global, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
