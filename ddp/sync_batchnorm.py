"""``SyncBatchNorm``: batch normalisation over the whole batch, spread across ranks, on CPU.

torch's ``nn.SyncBatchNorm`` runs on CUDA only. This one uses two collectives per training
step on any backend and device: in forward one ``all_gather`` of each rank's per-channel
count, mean and sum of squared deviations (combined exactly as in Chan et al.'s parallel
variance, so ranks may hold different numbers of samples, and the result equals
``BatchNorm`` on the full batch), and in backward one ``all_reduce`` of the two per-channel
sums the input gradient needs.

The backward pass knows how ``DistributedDataParallel`` will weight this rank's gradients
(``average``): with "ranks" each rank counts 1/W, with "samples" n_i/N. The sums are
weighted the same way, so the input gradient each rank computes, once averaged by DDP, is
the gradient of the full-batch loss. DDP sets ``average`` on the layers it wraps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation whose statistics cover every rank's part of the batch.

    Takes inputs of shape ``(N, C, ...)``. In eval mode (with running statistics) it is
    plain ``BatchNorm`` and communicates nothing. Every rank must call it the same number
    of times per step; it is not shadowed under ``join`` (as torch's is not).

    Example::

        >>> model = ddp.SyncBatchNorm.convert_sync_batchnorm(model)
        >>> model = ddp.DistributedDataParallel(model)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Any = None, average: str = "ranks", device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_group = process_group
        self.average = average

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        use_batch_stats = self.training or (self.running_mean is None
                                            and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if not use_batch_stats:
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return _SyncBatchNorm.apply(input, self.weight, self.bias, running_mean, running_var,
                                    self.eps, factor, group, self.average)

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Any = None
                               ) -> nn.Module:
        """``module`` with every ``BatchNorm*D`` replaced by a ``SyncBatchNorm`` holding the
        same parameters, buffers and mode (the module itself when it is one)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_group)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out


class _SyncBatchNorm(torch.autograd.Function):
    """Forward and backward of batch normalisation with statistics gathered across ranks."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float, group: Any,
                average: str) -> torch.Tensor:
        channels = x.shape[1]
        compute = torch.promote_types(x.dtype, torch.float32)
        per_channel = x.detach().transpose(0, 1).reshape(channels, -1).to(compute)
        count = per_channel.shape[1]
        if count:
            mean = per_channel.mean(1)
            m2 = (per_channel - mean[:, None]).square().sum(1)
        else:
            mean = m2 = torch.zeros(channels, dtype=compute, device=x.device)
        mine = torch.cat([torch.tensor([float(count)], dtype=compute, device=x.device),
                          mean, m2])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        stats = torch.stack(everyone)
        counts = stats[:, :1]
        means, m2s = stats[:, 1:1 + channels], stats[:, 1 + channels:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"expected more than 1 value per channel across all ranks when "
                             f"training, got {total:g}")
        global_mean = (counts * means).sum(0) / total
        global_m2 = m2s.sum(0) + (counts * (means - global_mean).square()).sum(0)
        invstd = torch.rsqrt(global_m2 / total + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype),
                                                 alpha=momentum)
        if running_var is not None:
            unbiased = global_m2 / (total - 1)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (x.to(compute) - global_mean.view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.to(compute).view(shape)
        if bias is not None:
            y = y + bias.to(compute).view(shape)
        # how DDP will weight this rank's gradients: 1/W, or this rank's share of the samples
        ctx.rank_weight = (count / total if average == "samples"
                           else 1.0 / dist.get_world_size(group))
        ctx.total, ctx.group, ctx.compute = total, group, compute
        ctx.save_for_backward(x, weight, global_mean, invstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, weight, mean, invstd = ctx.saved_tensors
        channels = x.shape[1]
        shape = [1, channels] + [1] * (x.dim() - 2)
        dims = [0] + list(range(2, x.dim()))
        dy = dy.to(ctx.compute)
        xhat = (x.to(ctx.compute) - mean.view(shape)) * invstd.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat).sum(dims)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # the full batch's sums, each rank's weighted as DDP will weight its gradients
            sums = torch.cat([sum_dy, sum_dy_xhat]) * ctx.rank_weight
            dist.all_reduce(sums, group=ctx.group)
            if ctx.rank_weight:
                per_sample = sums / (ctx.rank_weight * ctx.total)
                mean_dy, mean_dy_xhat = per_sample[:channels], per_sample[channels:]
                scale = invstd if weight is None else invstd * weight.to(ctx.compute)
                grad_x = (scale.view(shape) * (dy - mean_dy.view(shape)
                                               - xhat * mean_dy_xhat.view(shape)))
            else:  # no samples on this rank
                grad_x = torch.zeros_like(dy)
            grad_x = grad_x.to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(dy.dtype if weight is None else weight.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None
