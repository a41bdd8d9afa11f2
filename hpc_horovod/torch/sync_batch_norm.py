"""Batch normalization with statistics over the whole global batch (Horovod's
``hvd.SyncBatchNorm``), on CPU and GPU tensors alike.

Forward: every rank gathers each rank's (count, mean, biased variance) per channel in one
allgather and combines them exactly. Backward: the two per-channel sums the input gradient
depends on are summed over ranks in one allreduce. Written with plain tensor operations, since
torch's fused kernels for this (``batch_norm_stats`` ...) exist only for CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..common.basics import size
from ..common.ops import synchronous
from ..common.types import Sum
from .mpi_ops import allgather_async, allreduce_async, synchronize


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` whose training statistics span all ranks.

    Arguments as in ``torch.nn.BatchNorm2d``: ``num_features`` (channels C of an input
    ``(N, C, ...)``), ``eps``, ``momentum`` (None: cumulative average), ``affine``,
    ``track_running_stats``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, use_batch_stats, factor, self.eps)
        running_mean = self.running_mean if self.training else None
        running_var = self.running_var if self.training else None
        return _SyncBatchNorm.apply(input, self.weight, self.bias, running_mean, running_var,
                                    self.eps, factor)


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    @synchronous
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        x = input.contiguous()
        compute = torch.promote_types(x.dtype, torch.float32)
        xc = x.to(compute)
        channels = x.shape[1]
        dims = _reduce_dims(x)
        count = x.numel() // channels
        if count:
            mean = xc.mean(dims)
            var = xc.var(dims, unbiased=False)
        else:
            mean = var = torch.zeros(channels, dtype=compute, device=x.device)
        stats = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=x.device),
                           mean.double(), var.double()])
        gathered = synchronize(allgather_async(stats.unsqueeze(0),
                                               name="sync_batch_norm.stats"))
        counts = gathered[:, :1]
        means, variances = gathered[:, 1:channels + 1], gathered[:, channels + 1:]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError("Expected more than 1 value per channel when training, got input "
                             f"size {list(input.shape)} on this rank and {total:g} values in all")
        global_mean = (counts * means).sum(0) / total
        global_var = (counts * (variances + (means - global_mean) ** 2)).sum(0) / total
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(momentum * global_mean.to(running_mean.dtype))
        if running_var is not None:
            unbiased = global_var * (total / (total - 1))
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        mean = global_mean.to(compute)
        invstd = torch.rsqrt(global_var + eps).to(compute)
        shape = _channel_shape(x)
        out = (xc - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(compute).view(shape)
        if bias is not None:
            out = out + bias.to(compute).view(shape)
        ctx.save_for_backward(xc, weight, mean, invstd)
        ctx.total = total
        return out.to(input.dtype)

    @staticmethod
    @synchronous
    def backward(ctx, grad_output):
        xc, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        shape = _channel_shape(xc)
        dims = _reduce_dims(xc)
        dy = grad_output.contiguous().to(xc.dtype)
        xmu = xc - mean.view(shape)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_input = grad_weight = grad_bias = None
        if need_input:
            sums = synchronize(allreduce_async(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                                               name="sync_batch_norm.grad_sums"))
            channels = xc.shape[1]
            mean_dy = (sums[:channels] / ctx.total).view(shape)
            mean_dy_xmu = (sums[channels:] / ctx.total).view(shape)
            scale = invstd if weight is None else invstd * weight.to(xc.dtype)
            grad_input = scale.view(shape) * (dy - mean_dy - xmu * invstd.view(shape) ** 2
                                              * mean_dy_xmu)
            grad_input = grad_input.to(grad_output.dtype)
        # The weight and bias gradients stay local: DistributedOptimizer averages them.
        if weight is not None and need_weight:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if need_bias:
            grad_bias = sum_dy.to(weight.dtype if weight is not None else grad_output.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
