"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

In training, each rank computes the sum and the sum of squares of its batch per
channel; one differentiable all-reduce (Sum) turns them into the global mean
and variance, so the gradient flows through the global statistics exactly as
it would through one process's batch norm on the concatenated batch.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F  # noqa: N812

from unison.common.engine.process_sets import ProcessSet
from unison.common.ops import Sum
from unison.torch_backend.mpi_ops import allreduce

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` whose batch statistics span all ranks.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
        process_set: synchronize over this process set only.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set
        # names must match across ranks: instances are numbered in construction order
        self._sbn_id = next(SyncBatchNorm._instances)
        self._calls = 0

    _instances = itertools.count()

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...); got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        dims = [0] + list(range(2, input.dim()))
        count = torch.tensor([input.numel() / input.shape[1]], dtype=input.dtype)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        self._calls += 1
        total = allreduce(local, op=Sum, name=f"sync_batch_norm.{self._sbn_id}.{self._calls}",
                          process_set=self.process_set)
        c = input.shape[1]
        n = total[2 * c]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean
        if self.training and self.track_running_stats:
            with torch.no_grad():
                momentum = self.momentum if self.momentum is not None else 1.0 / float(
                    self.num_batches_tracked + 1)
                self.num_batches_tracked += 1
                unbiased = var * n / (n - 1).clamp(min=1)
                self.running_mean.mul_(1 - momentum).add_(momentum * mean)
                self.running_var.mul_(1 - momentum).add_(momentum * unbiased)
        shape = [1, c] + [1] * (input.dim() - 2)
        out = (input - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out

