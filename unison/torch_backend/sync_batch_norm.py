"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

[Note: stable synchronized statistics]
``E[x^2] - E[x]^2`` in the input dtype loses everything when the mean is large
next to the spread (bf16 keeps 8 bits: ``randn + 100`` squared cancels to
noise, even NaN after the square root). So each rank computes, in float32
(float64 for float64 input), its count, its per-channel mean and its sum of
squared deviations from that mean (M2); one all-gather brings every rank's
triple, and the ranks combine them in float64 with the parallel-variance
formula of Chan et al.::

    n = sum n_r,   mean = sum n_r mean_r / n,
    M2 = sum M2_r + sum n_r (mean_r - mean)^2

Every term is non-negative, so nothing cancels. Counts travel as float64
(exact to 2^53). The output is computed in the compute dtype and returned in
the input dtype.

The backward pass is written out (as in one process's batch norm on the
concatenated batch): with ``xmu = x - mean`` and the global per-channel sums
``S1 = sum dy`` and ``S2 = sum dy * xmu`` (one all-reduce),
``dx = w * invstd * (dy - S1 / n - xmu * invstd^2 * S2 / n)``. The weight and
bias gradients stay local sums, as for any parameter under data parallelism.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from torch.autograd.function import once_differentiable

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet
from unison.common.ops import Sum

__all__ = ["SyncBatchNorm"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _layout(x: torch.Tensor) -> tuple[list[int], list[int]]:
    """(reduced dims, the broadcast shape of a per-channel vector) for an (N, C, ...) input."""
    return [0] + list(range(2, x.dim())), [1, x.shape[1]] + [1] * (x.dim() - 2)


def _local_moments(x: torch.Tensor) -> np.ndarray:
    """This rank's ``[count, mean (C), M2 (C)]`` as one float64 row."""
    dims, shape = _layout(x)
    c = x.shape[1]
    count = x.numel() // c if c else 0
    if count == 0:
        return np.zeros((1, 2 * c + 1), np.float64)
    mean = x.mean(dims)
    m2 = ((x - mean.view(shape)) ** 2).sum(dims)
    row = np.concatenate([[float(count)], mean.double().numpy(), m2.double().numpy()])
    return row.reshape(1, -1)


def _combine(rows: np.ndarray, c: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Chan et al.'s combination of every rank's ``[count, mean, M2]`` -> (n, mean, M2)."""
    counts, means, m2s = rows[:, 0], rows[:, 1:1 + c], rows[:, 1 + c:]
    n = float(counts.sum())
    mean = (counts[:, None] * means).sum(0) / n
    m2 = m2s.sum(0) + (counts[:, None] * (means - mean) ** 2).sum(0)
    return n, mean, m2


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalize with given global statistics; backward all-reduces the two channel sums."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                mean: torch.Tensor, invstd: torch.Tensor, n: float, name: str,
                process_set: ProcessSet | None) -> torch.Tensor:
        _, shape = _layout(x)
        out = (x.to(mean.dtype) - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            out = out * weight.to(mean.dtype).view(shape) + bias.to(mean.dtype).view(shape)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.n, ctx.name, ctx.process_set = n, name, process_set
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable  # (a gradient penalty's double backward gets torch's own clear error)
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        x, weight, mean, invstd = ctx.saved_tensors
        dims, shape = _layout(x)
        dy = grad_out.to(mean.dtype)
        xmu = x.to(mean.dtype) - mean.view(shape)
        sum_dy, sum_dy_xmu = dy.sum(dims), (dy * xmu).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(dy, xmu, weight, invstd, sum_dy, sum_dy_xmu, ctx).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = (sum_dy_xmu * invstd).to(weight.dtype)
        if weight is not None and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _input_grad(dy: torch.Tensor, xmu: torch.Tensor, weight: torch.Tensor | None, invstd: torch.Tensor,
                sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor, ctx: Any) -> torch.Tensor:
    """The input gradient through the GLOBAL statistics: the channel sums are summed over ranks."""
    _, shape = _layout(dy)
    c = dy.shape[1]
    local = torch.cat([sum_dy, sum_dy_xmu]).double().numpy()
    total = torch.from_numpy(np.asarray(frontend.allreduce(local, Sum, ctx.name,
                                                           process_set=ctx.process_set)))
    total = total.to(dy.dtype)
    mean_dy, mean_dy_xmu = total[:c] / ctx.n, total[c:] / ctx.n
    scale = invstd if weight is None else invstd * weight.to(dy.dtype)
    return (dy - mean_dy.view(shape) - xmu * (invstd * invstd * mean_dy_xmu).view(shape)) * scale.view(shape)


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` whose batch statistics span all ranks.

    Statistics are computed in float32 (float64 for float64 input) and combined
    stably across ranks (see [Note: stable synchronized statistics]), so bf16/fp16
    input and activations with a large mean are safe; the output has the input's dtype.
    Ranks may hold batches of different sizes.

    Args:
        num_features, eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``.
        process_set: synchronize over this process set only.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_set: ProcessSet | None = None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    # names must match across ranks: the training-mode forward calls are numbered in the order they
    # run on each process set (as every rank runs them), not by instance, so a rank may build
    # instances the others do not (an eval or EMA copy) without shifting every later name. The
    # numbers are the engine's unnamed-call counters ([Note: a counter per process set]): a set's
    # restart when its id is reused after a new init() (a class-level count per id went on from the
    # old set's calls on its members only: a hang, before 2026-12-05), and an elastic reset restarts them

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (N, C, ...); got {input.dim()}-D")
        if not input.is_floating_point():  # (normalized in float32 and cast back: [[-1, -1], [-1, 0], ...] for
            # values whose statistics are -1.53, -1.50, ..., silently, before 2026-12-07; found by an audit)
            raise ValueError(f"SyncBatchNorm normalizes floating-point input; got {input.dtype}, as "
                             "torch.nn.BatchNorm refuses it. Convert it first (input.float())")
        if input.shape[1] != self.num_features and (self.affine or self.track_running_stats):
            # (a bare "size of tensor a (3) must match ... (5)" from the running statistics, or a mismatch of
            # the statistics' internal shapes when one rank was wrong, before 2026-12-07; found by an audit)
            raise ValueError(f"SyncBatchNorm({self.num_features}) got input of {input.shape[1]} channels "
                             f"(shape {tuple(input.shape)}, channels in dimension 1); give it "
                             f"{self.num_features} channels, or build it with num_features={input.shape[1]}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:  # never synchronized, as torch.nn.SyncBatchNorm: without running statistics,
            # this rank's own batch statistics (before 2026-12-05 they were the ranks', and one rank
            # evaluating alone waited for the others for ever). Horovod's synchronizes in that one case: a
            # deliberate difference (docs/horovod.md)
            self._check_input_dim(input)
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                not self.track_running_stats, 0.0, self.eps)
        name = frontend._auto_name("sync_batch_norm", None, self.process_set)
        try:
            self._check_input_dim(input)
        except ValueError as exc:  # submitted in place of the moments, so every rank raises it (raised here
            if frontend.running_engine() is not None:  # alone, the others' statistics paired with this rank's
                try:  # next batch's); this rank raises its own error, as before
                    frontend.allgather(frontend.Refused(exc), name, self.process_set)
                except ValueError:
                    pass
            raise
        cdt = _compute_dtype(input.dtype)
        with torch.no_grad():
            n, mean, m2 = self._global_moments(input.detach().to(cdt), name)
            if self.training and self.track_running_stats:
                self._update_running(n, mean, m2)
            var = m2 / n
            invstd = torch.from_numpy(1.0 / np.sqrt(var + self.eps)).to(cdt)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, torch.from_numpy(mean).to(cdt),
                                            invstd, n, name + ".grad", self.process_set)

    def _global_moments(self, x: torch.Tensor, name: str) -> tuple[float, np.ndarray, np.ndarray]:
        rows = np.asarray(frontend.allgather(_local_moments(x), name, self.process_set))
        n, mean, m2 = _combine(rows, x.shape[1])
        if n < 2:
            raise ValueError(f"SyncBatchNorm needs more than 1 value per channel over all ranks when "
                             f"training; got {int(n)} (input shape on this rank: {tuple(x.shape)}). "
                             "Use a larger batch, or eval() mode")
        return n, mean, m2

    def _update_running(self, n: float, mean: np.ndarray, m2: np.ndarray) -> None:
        """As ``torch.nn.BatchNorm``: an exponential (or cumulative) average, unbiased variance."""
        self.num_batches_tracked += 1
        momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        for buf, value in ((self.running_mean, mean), (self.running_var, m2 / (n - 1))):
            new = buf.double() * (1 - momentum) + momentum * torch.from_numpy(value)
            buf.copy_(new.to(buf.dtype))
