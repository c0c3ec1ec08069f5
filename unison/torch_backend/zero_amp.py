"""``unison.torch_backend.GradScaler``: dynamic loss scaling whose skip decision every rank agrees on.

Under ZeRO a gradient element that overflowed lands, after the reduce-scatter, in the shard of
one rank only. torch's ``GradScaler`` checks the gradients each process can see, so that rank
would skip the step and lower its scale while the others step: the replicas drift apart
silently. This subclass (i) unscales and checks the *shards* of a ZeRO optimizer (stage 1/2;
the model's ``.grad`` hold local or no gradients there) after waiting for their reduction, and
(ii) all-reduces the found-inf flag (maximum) across the ranks for every optimizer, so every
rank skips the same steps and keeps the same scale. A plain (stage 0) ``DistributedOptimizer``'s
gradients are reduced (``synchronize()``) before they are unscaled, and its step then runs without
reducing again (before 2026-12-05 they were unscaled while their reductions were still writing them:
weights far off and different on every rank in some runs; and a skipped step left its reductions
pending, so the next ``zero_grad()`` raised). Use it exactly like ``torch.amp.GradScaler``::

    scaler = hvd.GradScaler("cpu")
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)            # optional, e.g. before hvd.clip_grad_norm_(optimizer, 1.0)
    scaler.step(optimizer)
    scaler.update()
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unison.common import runtime
from unison.common.engine import frontend
from unison.common.ops import Max

__all__ = ["GradScaler"]


class _Shards:
    """What ``_unscale_grads_`` reads: the parameter groups of a ZeRO optimizer's shards."""

    def __init__(self, optimizer: Any) -> None:
        self.param_groups = optimizer._inner.param_groups


def _plain_distributed(optimizer: Any) -> bool:
    """A stage-0 ``DistributedOptimizer`` (it reduces whole gradients at ``synchronize()``)."""
    return (getattr(optimizer, "zero_stage", 0) == 0 and hasattr(optimizer, "skip_synchronize")
            and hasattr(optimizer, "_synchronized"))


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the skip decision agreed across ranks (see the module docstring)."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        target: Any = optimizer
        if _plain_distributed(optimizer) and not optimizer._synchronized:
            optimizer.synchronize()  # the reduced gradients are what is unscaled and checked
        if getattr(optimizer, "zero_stage", 0) in (1, 2):
            if not optimizer._synchronized:
                optimizer.synchronize()
            target = _Shards(optimizer)
            allow_fp16 = True  # the shards' gradients are the optimizer's own (fp32 masters for half weights)
        per_device = super()._unscale_grads_(target, inv_scale, found_inf, allow_fp16)
        if runtime.is_initialized() and runtime.size() > 1:
            self._agree(optimizer, per_device, found_inf)
        return per_device

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any,
                        **kwargs: Any) -> Any:
        """torch's step-or-skip; a skipped ZeRO step also drops its reduced gradients, which the
        optimizer holds in its shards where the user's ``model.zero_grad()`` cannot clear them (the
        next backward pass would add to the overflowed ones, and every later step be skipped)."""
        skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        if _plain_distributed(optimizer) and optimizer._synchronized:
            if skipped:  # no step() to end the synchronized state: the next step reduces afresh
                optimizer._synchronized = False
                return None
            with optimizer.skip_synchronize():  # reduced in _unscale_grads_: not twice
                return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        result = super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        if skipped and getattr(optimizer, "zero_stage", 0) in (1, 2):
            optimizer.discard_gradients()
        return result

    @staticmethod
    def _agree(optimizer: Any, per_device: dict[torch.device, torch.Tensor], found_inf: torch.Tensor) -> None:
        """Every rank ends with the largest found-inf of any rank (for each device it checked)."""
        mine = max([float(t.item()) for t in per_device.values()], default=0.0)
        pset = getattr(optimizer, "process_set", None)
        agreed = float(frontend.allreduce(np.array([mine], np.float32), Max, "GradScaler.found_inf",
                                          process_set=pset)[0])
        if not per_device:  # this rank had no gradient at all: it still records the agreed flag
            per_device[found_inf.device] = found_inf
        for t in per_device.values():
            t.fill_(agreed)
