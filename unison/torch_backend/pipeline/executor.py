"""Pipeline-parallel training of an ``nn.Sequential`` across ranks.

The model's layers are cut into ``p * v`` stages (by an explicit balance, or by parameter
count); each rank keeps only its stages. A step splits the batch into ``chunks``
microbatches and runs a schedule from ``unison.common.pipeline`` through the
framework-neutral driver, which moves activations and gradients point to point and makes a
failure on any rank raise the same :class:`PipelineError` on every rank. The last stage
computes the loss. On a data x pipeline grid, each stage's gradients are then averaged over
the ranks that hold the same stage, and each rank's optimizer steps its own parameters.

A step computes exactly the gradient of the mean loss over the whole batch, so ``k`` steps
equal the unpartitioned model trained in one process on the same batches (models whose
layers mix rows of a batch, such as BatchNorm, differ by their microbatch statistics).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from unison.common.ops import Average
from unison.common.pipeline import Schedule
from unison.common.pipeline.grid import PipelineGrid, check_pipeline_grid, pipeline_grid
from unison.common.pipeline.runner import PipelineRunner, agreed, check_ties, layer_ranges, plan_stages
from unison.torch_backend.mpi_ops import broadcast, grouped_allreduce_
from unison.torch_backend.pipeline.balance import as_layers, balance_by_params
from unison.torch_backend.pipeline.stages import TorchStages

__all__ = ["Pipeline"]

_instances = itertools.count()


@dataclass(frozen=True)
class _Plan:
    layers: list[nn.Module]
    balance: list[int]
    schedule: Schedule
    checkpoint: str
    device: torch.device


class Pipeline(PipelineRunner):
    """A model split into pipeline stages across ranks; collective (every rank, same arguments).

    Args:
        module: an ``nn.Sequential`` or a list of layers, built the same way on every rank. The
            pipeline references only this rank's layers: drop your own reference to the whole
            model to free the rest.
        balance: layers per stage, ``p * v`` numbers summing to the layer count; default
            :func:`balance_by_params`.
        chunks: microbatches per step; every batch must be a multiple of it.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
        virtual_stages: ``v``, stages per rank (the interleaved schedule needs ``v >= 2``).
        checkpoint: ``"never"``, ``"always"`` or ``"except_last"`` (every microbatch but the
            last): forget activations in forward and recompute them, with the same random
            numbers, before backward.
        loss_fn: ``loss_fn(output, target) -> scalar`` (a mean over the microbatch), on the
            last stage.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` for this rank's parameters;
            None to step yourself. A rank whose stages have no parameters gets no optimizer.
        grid: a :func:`pipeline_grid` for data x pipeline; default: one pipeline of all ranks.
        device: where this rank's stages compute (CUDA tensors travel through host memory).

    Raises:
        PipelineError: on every rank, for a balance, schedule, chunks or layout that cannot
            run; the message names the values and the fix.
    """

    def __init__(self, module: nn.Sequential | Sequence[nn.Module], balance: Sequence[int] | None = None,
                 chunks: int = 1, schedule: str = "1f1b", virtual_stages: int = 1, checkpoint: str = "never",
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                 grid: PipelineGrid | None = None, device: torch.device | str | None = None) -> None:
        grid = grid if grid is not None else pipeline_grid(dp=1)
        check_pipeline_grid(grid)  # (every rank is given the same kind: each raises)
        plan = agreed(lambda: _plan(module, balance, chunks, schedule, virtual_stages, checkpoint, loss_fn,
                                    optimizer, grid, device))
        super().__init__(plan.schedule, chunks, grid, balance=plan.balance, checkpoint=plan.checkpoint,
                         layers=len(plan.layers))
        try:
            self.balance, self.device = plan.balance, plan.device
            #: stage -> the indices of its layers in the model
            self.layer_ranges = layer_ranges(plan.balance, self.schedule.stages_of(grid.position))
            # agreed: a stage that cannot move to this rank's device (no CUDA, out of memory) raises
            # on every rank (before 2026-12-05 the other ranks waited for this one forever)
            self.stages = agreed(lambda: {s: nn.Sequential(*plan.layers[r.start:r.stop]).to(plan.device)
                                          for s, r in self.layer_ranges.items()},
                                 failed=f"moving stages {sorted(self.layer_ranges)} to {plan.device}")
            self._worker = TorchStages(self.stages, self.schedule.num_stages, loss_fn,  # type: ignore[arg-type]
                                       plan.checkpoint, plan.device)
            self._name = f"pipeline.{next(_instances)}"
            if grid.dp > 1:
                self._broadcast_state()
            self.optimizer = self._make_optimizer(optimizer)
        except BaseException:
            self.close()  # every rank raises here together (agreed/collective calls): free the communicators
            raise
        #: per stage on this rank, the most microbatches whose activations the last step held at
        #: once (counted where they are kept, unlike ``stats.peak_per_stage``, which counts the
        #: schedule's F and B/W)
        self.live_peak_per_stage: dict[int, int] = {}

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def local_module(self) -> nn.Module:
        """This rank's layers under their indices in the whole model (layer 2's weight is ``2.weight``,
        as in ``nn.Sequential(*layers)``): ``save_tensor_parallel(path, pipe)`` writes these, so the
        stages together write the whole model, and ``load_tensor_parallel(path, pipe)`` reads them."""
        holder = nn.Module()
        for s, span in sorted(self.layer_ranges.items()):
            for i, layer in enumerate(self.stages[s]):
                holder.add_module(str(span.start + i), layer)
        return holder

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, stage by stage, each once (a module used in two of this rank's
        stages, tied weights, lists its parameters once: before 2026-12-05 twice, and the
        optimizer stepped them twice)."""
        return list({id(p): p for s in sorted(self.stages) for p in self.stages[s].parameters()}.values())

    def train_step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float:
        """One step on a batch: forward, backward, gradient averaging over ``dp``, optimizer step.

        Args:
            inputs: the batch, on the rank holding stage 0 (ignored elsewhere).
            targets: its targets, on the rank holding the last stage (ignored elsewhere).

        Returns:
            The mean loss over the batch (over every replica's batch on a grid), on every rank.

        Raises:
            PipelineError: on every rank, when a batch does not split into ``chunks``, a rank
                lacks its inputs or targets, gradients are off (``torch.no_grad()``), any stage
                fails, or the optimizer's step fails on any rank.
        """
        inputs, targets, problem = self._batch(inputs, targets, need_targets=True)
        if problem is None and not torch.is_grad_enabled():
            # one process raises at loss.backward(); before 2026-12-05 the step returned a loss and trained nothing
            problem = ("train_step was called with gradients disabled (inside torch.no_grad() or "
                       "torch.inference_mode()); call it outside, or use evaluate() for a loss without training")
        problem = self._begin(inputs, targets, problem, train=True)
        for p in self.parameters():
            p.grad = None
        try:
            self.run(self._worker, problem, train=True)
        finally:
            self.live_peak_per_stage = dict(self._worker.live_peak)
            self._worker.kept.clear()  # a failed step leaves graphs behind
        share = self.replica_share(inputs, self._worker.weight_total)
        if self.grid.dp > 1:
            self._average_gradients(share)
        # agreed on every rank (one without an optimizer too): the ranks go on to global_loss, a
        # collective, together (before 2026-12-05 a failed step left the others waiting there)
        agreed(self.optimizer.step if self.optimizer is not None else lambda: None,
               failed=f"optimizer.step() for stages {sorted(self.stages)}")
        return self.global_loss(self._worker.loss * share)

    def evaluate(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> float:
        """The mean loss over a batch without training (dropout off), on every rank."""
        self._forward_only(inputs, targets, need_targets=True)
        return self.global_loss(self._worker.loss * self.replica_share(inputs, self._worker.weight_total))

    def predict(self, inputs: torch.Tensor | None = None) -> torch.Tensor | None:
        """The model's output for a batch, on the rank holding the last stage (None elsewhere)."""
        self._forward_only(inputs, None, need_targets=False)
        outputs = self._worker.outputs
        # agreed: outputs whose shapes differ between microbatches raised on the last stage's ranks alone
        # (before 2026-12-07; found by an audit)
        return agreed(lambda: torch.cat([outputs[k] for k in sorted(outputs)]) if self.holds_last else None,
                      failed="predict()'s joining of the last stage's microbatch outputs (they must have the same "
                             "shape but for the batch dimension)")

    # ------------------------------------------------------------------ helpers
    def _make_optimizer(self, factory: Any) -> torch.optim.Optimizer | None:
        """``factory(params)``, or None without a factory or (a stage of activations only) parameters."""
        params = self.parameters()
        return agreed(lambda: factory(params) if factory is not None and params else None,
                      failed=f"optimizer(params) for stages {sorted(self.stages)}")

    def _forward_only(self, inputs: Any, targets: Any, need_targets: bool) -> None:
        """Every stage's forward in evaluation mode; backward sends only empty arrays.

        Each submodule's mode is put back afterwards as it was (before 2026-12-05 every
        submodule was left in training mode, a BatchNorm frozen with ``eval()`` included).
        """
        inputs, targets, problem = self._batch(inputs, targets, need_targets)
        problem = self._begin(inputs, targets, problem, train=False)
        modes = [(m, m.training) for stage in self.stages.values() for m in stage.modules()]
        for stage in self.stages.values():
            stage.eval()
        try:
            self.run(self._worker, problem, train=False, purpose="evaluate" if need_targets else "predict")
        finally:
            for m, training in modes:
                m.training = training

    def _batch(self, inputs: Any, targets: Any, need_targets: bool) -> tuple[Any, Any, str | None]:
        """This rank's batches as tensors (numpy arrays are wrapped), and why a step cannot run."""
        def tensor(batch: Any, held: bool, name: str) -> tuple[Any, str | None]:
            if not held or batch is None or isinstance(batch, torch.Tensor):
                return batch, None
            if isinstance(batch, np.ndarray):
                try:  # (refused on this rank alone, it raised here while the others waited in the step: a hang)
                    return torch.from_numpy(batch), None
                except (TypeError, ValueError) as exc:
                    return batch, (f"{name} is a numpy array torch cannot take "
                                   f"({exc}); pass a copy of a numeric dtype in native byte order, e.g. "
                                   f"np.ascontiguousarray({name}, dtype=np.float32)")
            return batch, (f"{name} must be a torch.Tensor or a numpy array; received "
                           f"{type(batch).__name__}")

        inputs, bad_inputs = tensor(inputs, self.holds_first, "inputs")
        targets, bad_targets = tensor(targets, self.holds_last, "targets")
        return inputs, targets, bad_inputs or bad_targets or self.batch_problem(inputs, targets, need_targets)

    def _begin(self, inputs: Any, targets: Any, problem: str | None, train: bool) -> str | None:
        """Hand this rank's microbatches to the worker (none when the step will not run); return why the step
        cannot run (``problem``, or one the worker found in the batch)."""
        def split(batch: Any, held: bool) -> list[torch.Tensor] | None:
            ok = held and problem is None and batch is not None
            return list(batch.split(batch.shape[0] // self.chunks)) if ok else None

        self._worker.begin(split(inputs, self.holds_first), split(targets, self.holds_last), self.chunks, train)
        return problem or self._worker.problem

    def _broadcast_state(self) -> None:
        """Every replica of a stage starts from pipeline 0's parameters and buffers (one data-parallel group)."""
        tensors = list({id(t): t for s in sorted(self.stages)
                        for t in [*self.stages[s].parameters(), *self.stages[s].buffers()]}.values())
        ranks = self.grid.data_set.ranks if self.grid.data_set is not None else None
        root = ranks[0] if ranks else 0  # Horovod's rule: root_rank is a global rank, also with a process set
        for i, t in enumerate(tensors):
            host = t.detach().cpu()
            out = broadcast(host, root_rank=root, name=f"{self._name}.init.{i}",  # the set's first: pipeline 0
                            process_set=self.grid.data_set)
            with torch.no_grad():
                t.copy_(out.to(t.device))

    def _average_gradients(self, share: float = 1.0) -> None:
        """Average each gradient over the ranks that hold the same stages (through host memory),
        each replica's weighted by its ``share`` of the global batch (see :meth:`replica_share`).

        Only trainable parameters take part (a frozen one keeps no gradient, so the optimizer
        leaves it alone). A replica without a gradient for a parameter contributes zeros; a
        parameter no replica produced a gradient for keeps none (as one process on the global
        batch would), which the ranks learn from a flag per parameter reduced with the gradients.
        """
        params = [p for p in self.parameters() if p.requires_grad]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if share != 1.0:
            grads = [g * share for g in grads]
        host = [g.detach().cpu() if g.device.type != "cpu" else g for g in grads]
        had = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64)
        grouped_allreduce_([*host, had], op=Average, name=f"{self._name}.grads.{self.grid.position}",
                           process_set=self.grid.data_set)
        for p, g, h, some in zip(params, grads, host, had.tolist(), strict=True):
            p.grad = (g if h is g else h.to(g.device)) if some > 0 else None


def _plan(module: Any, balance: Any, chunks: Any, schedule: Any, v: Any, checkpoint: Any, loss_fn: Any,
          optimizer: Any, grid: PipelineGrid, device: Any) -> _Plan:
    """Check the arguments; raises ValueError or TypeError with the values and the fix."""
    layers = as_layers(module)
    if not callable(loss_fn):
        raise TypeError("Pipeline needs loss_fn(output, target) -> scalar tensor, applied on the last stage; "
                        f"received {loss_fn!r}")
    if getattr(loss_fn, "reduction", "mean") == "sum":  # (it trained at 1/chunks of the step, silently)
        raise ValueError(f"Pipeline's loss_fn must be a mean over the microbatch (each microbatch's loss is "
                         f"divided by chunks); {loss_fn!r} has reduction='sum'. Use reduction='mean' (and scale "
                         "the learning rate by the global batch size for a summed loss's step)")
    if optimizer is not None and not callable(optimizer):
        raise TypeError("optimizer must be a factory: optimizer(params) -> torch.optim.Optimizer, e.g. "
                        f"lambda params: torch.optim.SGD(params, lr=0.1); received {type(optimizer).__name__}")
    built, sizes = plan_stages(len(layers), balance, lambda stages: balance_by_params(layers, stages), chunks,
                               schedule, v, checkpoint, grid.pp)
    check_ties([[(id(p), n) for n, p in layer.named_parameters()] for layer in layers], sizes, built)
    return _Plan(layers, sizes, built, checkpoint, torch.device(device if device is not None else "cpu"))
