"""Torch backend: each gradient starts its exchange as soon as backward has produced it.

Keras's torch trainer runs the step eagerly: ``loss.backward()``, then
``optimizer.apply(grads)``. A post-accumulate-grad hook on every trainable
parameter hands its gradient to a :class:`~unison.common.data_parallel.GradientStream`
the moment backward finishes it, so the reductions run (on the engine's thread)
while backward computes the earlier layers' gradients; ``apply`` then only waits for
them. The hooks act only inside a data-parallel ``train_step``: a backward pass of
the same model elsewhere (a user's own loop) exchanges nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from unison.common import runtime
from unison.common.data_parallel import GradientStream, max_overwritten
from unison.common.engine import frontend
from unison.common.ops import Max
from unison.keras import _host

__all__: list[str] = []


class Overlap:
    """The hooks and the current step's stream of one model."""

    def __init__(self, model: Any, prefix: str) -> None:
        self.model, self.prefix = model, prefix
        self.hooked: set[int] = set()
        self.keys: dict[int, int] = {}
        self.stream: GradientStream | None = None
        self.streamed = 0  # gradients handed over during backward, over the model's life

    def _hook(self, param: torch.Tensor) -> None:
        key = self.keys.get(id(param))
        if self.stream is not None and key is not None and param.grad is not None:
            self.stream.submit(key, _host.torch_to_numpy(param.grad))
            self.streamed += 1

    def step(self, rows: int | None, settings: tuple[Any, Any, float, float], run: Callable[[], Any]) -> Any:
        """Run one train step (``run``) with this step's gradients streamed as backward makes them."""
        params = [v.value for v in self.model.trainable_weights]
        # ([Note: gradients that are next values] in unison/common/data_parallel.py: not averaged, not streamed)
        maxed = set(max_overwritten(self.model.trainable_weights))
        self.keys = {id(p): i for i, p in enumerate(params) if i not in maxed}
        for p in params:
            if id(p) not in self.hooked and p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)
                self.hooked.add(id(p))
        op, compression, pre, post = settings
        optimizer = self.model.optimizer
        self.stream = stream = GradientStream(rows, op, compression, pre, post, prefix=self.prefix)

        def pending(grads: list[Any]) -> tuple[list[int], list[torch.Tensor]]:
            """The reduced gradients of every variable some rank has one for, and their positions.

            [Note: streamed gradients missing on some ranks] A rank waits only for what it submitted,
            and a gradient that exists on some ranks only (a branch taken by some ranks' data) left
            each rank waiting for a reduction the others never started: a hang. So the ranks agree on
            which gradients exist anywhere (one all-reduce of a flag per variable), and a rank without
            one submits zeros under its name (one process's answer, as ``_agreed`` gives unstreamed)."""
            flags = np.array([g is not None for g in grads], np.int32)
            anywhere = frontend.allreduce(flags, Max, f"{self.prefix}.present") if runtime.size() > 1 else flags
            keys = [i for i in range(len(grads)) if anywhere[i]]
            values = {i: grads[i] if grads[i] is not None else torch.zeros_like(params[i]) for i in keys
                      if i in maxed or i not in stream.pending}  # none here (or not streamed): zeros, or itself
            for i in keys:
                if i not in maxed and i in values:
                    stream.submit(i, _host.torch_to_numpy(values[i]))
            top, rest = [i for i in keys if i in maxed], [i for i in keys if i not in maxed]
            arrays = dict(zip(rest, stream.results(rest), strict=True))
            if top:
                mine = [_host.torch_to_numpy(values[i]) for i in top]
                arrays.update(zip(top, frontend.grouped_allreduce(mine, Max, f"{self.prefix}.max")
                                  if runtime.size() > 1 else mine, strict=True))
            # on each parameter's device (they came back on the CPU before 2026-12-06)
            return keys, [_host.torch_from_numpy(arrays[i]).to(params[i].device) for i in keys]

        optimizer.__dict__["_unison_pending"] = pending
        try:
            return run()
        finally:
            self.stream = None
            optimizer.__dict__.pop("_unison_pending", None)
            stream.drain()
