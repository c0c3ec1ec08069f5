"""The PyTorch side of a pipeline: this rank's stage modules as a :class:`StageWorker`.

The driver (``unison.common.pipeline.driver``) calls ``forward``/``backward`` (or the split
``backward_input``/``backward_weight``) per stage and microbatch, with numpy arrays at the
stage boundaries. Here those become tensors on the stage's device (CUDA tensors are staged
through host memory), and each microbatch keeps what its backward needs:

    no checkpoint   F: (input leaf, output, each layer's output) with the autograd graph
    checkpoint      F: (input, RNG state) only; the graph is rebuilt right before B or I
    split (zb-h1)   I: one pass for the gradients of the stage input and of the output of
                    every layer with parameters (retain_graph); W: per such layer, its weight
                    gradients from its output gradient, added into ``.grad``

[Note: splitting backward] Asking autograd for the parameters' gradients from the stage
output would run the input-gradient chain of every layer again (measured: I + W = 1.8x one
full B on a 4-layer MLP stage). I instead stops at each parameterised layer's output; W then
runs only that layer's own nodes, which compute just the weight half (autograd masks the
outputs nobody asked for). I + W then cost one B, plus keeping each such output's gradient
until W. A stage whose layers share a parameter (a module used twice, tied weights) cannot
be split so: a later layer's output depends on the shared weight through the earlier layer
too, so its own W would count the earlier use again (and walk a graph the earlier W freed).
There I computes the input gradient alone and W asks for all the stage's parameters from its
output at once (``shared_weights``), the unsplit cost for that stage only.

The last stage applies the loss to its output and the microbatch's targets, scaled by
``1 / chunks`` so that a step's gradient is that of the mean loss over the whole batch; a
cross-entropy with ignored or class-weighted targets by each microbatch's share of the counted
weight instead (runner [Note: weighted microbatches]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from unison.common.pipeline import PipelineError
from unison.common.pipeline.runner import microbatch_shares
from unison.torch_backend.pipeline.recompute import RngState, capture, replay, starts_in_place
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__: list[str] = []

_NO_GRADIENT = np.empty(0, np.float32)  # what an evaluation pass sends upstream


@dataclass
class _Kept:
    """What a microbatch keeps between its forward and its backward on one stage."""

    x: torch.Tensor
    out: torch.Tensor | None = None  # the output (the scaled loss on the last stage)
    rng: RngState | None = None  # set when the forward is to be recomputed
    # the buffers a checkpointed forward wrote (BatchNorm's statistics): (module, name, the tensor
    # the forward found there when it assigned a new one, else None)
    buffers: list[tuple[nn.Module, str, torch.Tensor | None]] | None = None
    grad: torch.Tensor | None = None  # the output gradient
    outs: list[torch.Tensor] | None = None  # each layer's output (for the split backward)
    # split backward, after I: (output of a layer with parameters, its gradient, the parameters)
    pending: list[tuple[torch.Tensor, torch.Tensor, list[nn.Parameter]]] | None = None


class TorchStages:
    """Stage modules of one rank, driven one (stage, microbatch) action at a time.

    Args:
        modules: stage index -> the stage's layers, already on ``device``.
        num_stages: stages in the whole pipeline.
        loss_fn: ``loss_fn(output, target)`` on the last stage, a scalar tensor.
        checkpoint: one of ``unison.common.pipeline.runner.CHECKPOINTS``.
        device: where the stages compute.
    """

    def __init__(self, modules: dict[int, nn.Module], num_stages: int, loss_fn: Callable[..., Any],
                 checkpoint: str, device: torch.device) -> None:
        self.modules = modules
        self.last = num_stages - 1
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        self.device = device
        self.begin(None, None, 1, train=True)

    def begin(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None, chunks: int,
              train: bool) -> None:
        """Start a step: the microbatches of this rank's inputs and targets (None where not held).

        The modules' train/eval modes are the caller's: before 2026-12-05 a training step put every
        submodule into training mode, which retrained a BatchNorm the user had frozen with ``eval()``.
        """
        self.inputs, self.targets, self.chunks, self.train = inputs, targets, chunks, train
        # (read per step: a layer frozen or unfrozen after the pipeline was built is seen; the lists made
        # once at build left an unfrozen layer without gradients under zb-h1, silently, before 2026-12-06)
        self.params = {s: [p for p in m.parameters() if p.requires_grad] for s, m in self.modules.items()}
        #: per stage, per layer: the layer's trainable parameters
        self.layer_params = {s: [[p for p in layer.parameters() if p.requires_grad] for layer in m]
                             for s, m in self.modules.items()}
        #: stages whose layers share a parameter: W is not split per layer there ([Note: splitting backward])
        self.shared_weights = {s for s, layers in self.layer_params.items()
                               if len({id(p) for ps in layers for p in ps}) < sum(len(ps) for ps in layers)}
        #: each microbatch's factor in this replica's loss, and the replica's total target weight (None: every
        #: target counts alike) (runner [Note: weighted microbatches])
        #: why this rank cannot run the step, found here (agreed over the ranks before the step runs)
        self.problem: str | None = None
        try:
            self.weights = counted_weights(self.loss_fn, targets)
        except (ValueError, RuntimeError, IndexError) as exc:  # (raised here alone, the others waited: a hang)
            self.weights, self.problem = None, f"the loss's targets: {exc}"
        self.factors, self.weight_total = microbatch_shares(self.weights, chunks)
        self.kept: dict[tuple[int, int], _Kept] = {}
        #: per stage, the most microbatches whose activations this worker held at once
        self.live_peak: dict[int, int] = dict.fromkeys(self.modules, 0)
        self.loss = 0.0
        self.outputs: dict[int, torch.Tensor] = {}
        #: stages that sent a real input gradient upstream in this step (see _gradient_upstream)
        self.sent_gradient: set[int] = set()

    # ------------------------------------------------------------------ the StageWorker calls
    def forward(self, stage: int, mb: int, x: np.ndarray | None) -> np.ndarray | None:
        inp = self._input(stage, mb, x)
        if not self.train:
            with torch.no_grad():
                out = self._loss_or_output(stage, mb, self.modules[stage](self._enter(stage, inp)))
            return None if stage == self.last else _boundary(stage, out)
        if self.checkpoint == "always" or (self.checkpoint == "except_last" and mb < self.chunks - 1):
            rng = capture(self.device)
            with torch.no_grad():
                versions = [(m, name, b, b._version) for m in self.modules[stage].modules()
                            for name, b in m._buffers.items() if b is not None]
                out = self._loss_or_output(stage, mb, self.modules[stage](self._enter(stage, inp)))
            # (a normalisation's native kernel updates its running statistics without bumping
            # their version counters: such modules' buffers count as written when training; a module
            # that assigns a new tensor (``self.ema = 0.5 * self.ema + ...``) wrote its buffer too,
            # and the old tensor still holds what the forward read: the recompute reads it again)
            written = [(m, name, b if m._buffers[name] is not b else None) for m, name, b, v in versions
                       if m._buffers[name] is not b or m._buffers[name]._version != v
                       or (m.training and isinstance(m, _NormBase))]
            self._keep(stage, mb, _Kept(inp, rng=rng, buffers=written))
        else:
            y, outs = self._layers(stage, self._enter(stage, inp))
            out = self._loss_or_output(stage, mb, y)
            self._keep(stage, mb, _Kept(inp, out, outs=outs))
        return None if stage == self.last else _boundary(stage, out)

    def backward(self, stage: int, mb: int, grad: np.ndarray | None) -> np.ndarray | None:
        if not self.train:
            return None if stage == 0 else _NO_GRADIENT
        kept = self._graph(stage, mb, grad)
        self.kept.pop((stage, mb))
        if kept.out is not None and kept.out.requires_grad:
            torch.autograd.backward(kept.out, kept.grad)
        return None if stage == 0 else self._gradient_upstream(stage, kept.x.grad, kept.x)

    def backward_input(self, stage: int, mb: int, grad: np.ndarray | None) -> np.ndarray | None:
        kept = self._graph(stage, mb, grad)
        if stage == 0:
            return None  # nobody needs stage 0's input gradient; W does all its work
        if kept.out is None or not kept.out.requires_grad:
            return self._gradient_upstream(stage, None, kept.x)
        # see [Note: splitting backward]
        # an input that takes no gradient (integer ids) sends no gradient upstream, as backward does
        wrt = [kept.x] if kept.x.requires_grad else []
        if stage in self.shared_weights or not _splittable(kept.outs or [], self.layer_params[stage]):
            # pending stays None: W takes every parameter from the stage's output
            grads = torch.autograd.grad(kept.out, wrt, kept.grad, retain_graph=True, allow_unused=True) \
                if wrt else ()
        else:
            layers = [(o, ps) for o, ps in zip(kept.outs or [], self.layer_params[stage], strict=True)
                      if ps and o.requires_grad]
            grads = torch.autograd.grad(kept.out, [*wrt, *[o for o, _ in layers]], kept.grad,
                                        retain_graph=True, allow_unused=True)
            kept.pending = [(o, g, ps) for (o, ps), g in zip(layers, grads[len(wrt):], strict=True)
                            if g is not None]
        kept.outs = None
        return self._gradient_upstream(stage, grads[0] if wrt else None, kept.x)

    def backward_weight(self, stage: int, mb: int) -> None:
        kept = self.kept.pop((stage, mb))
        if kept.pending is not None:  # after our I: each layer's weights from its output gradient
            for out, grad, params in kept.pending:
                _accumulate(params, torch.autograd.grad(out, params, grad, allow_unused=True))
            return
        params = self.params[stage]
        if not params or kept.out is None or not kept.out.requires_grad:
            return
        _accumulate(params, torch.autograd.grad(kept.out, params, kept.grad, allow_unused=True))

    # ------------------------------------------------------------------ helpers
    def _keep(self, stage: int, mb: int, kept: _Kept) -> None:
        self.kept[(stage, mb)] = kept
        live = sum(1 for s, _ in self.kept if s == stage)
        self.live_peak[stage] = max(self.live_peak[stage], live)

    def _enter(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        """What the stage's layers receive: a copy of the input when they write it in place.

        A received input is an autograd leaf; stage 0's microbatch is a view of the user's batch,
        which the layers must not change: the recompute of a checkpointed microbatch reads it
        again, and the other microbatches are views of the same storage (before 2026-12-05 stage 0
        was not copied: wrong gradients with checkpointing, an autograd error without).
        """
        return x.clone() if (x.requires_grad or stage == 0) and starts_in_place(self.modules[stage]) else x

    def _layers(self, stage: int, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage's output and each of its layers' outputs."""
        outs = []
        for layer in self.modules[stage]:
            x = layer(x)
            outs.append(x)
        return x, outs

    def _input(self, stage: int, mb: int, x: np.ndarray | None) -> torch.Tensor:
        if stage == 0:
            if self.inputs is None:
                raise PipelineError("stage 0 has no inputs; pass inputs to train_step on the rank holding stage 0")
            return self.inputs[mb].to(self.device)
        inp = from_numpy(x).to(self.device)  # type: ignore[arg-type]  # the driver gives arrays past stage 0
        if self.train and inp.is_floating_point():
            inp.requires_grad_()
        return inp

    def _loss_or_output(self, stage: int, mb: int, out: torch.Tensor, count: bool = True) -> torch.Tensor:
        """On the last stage: the microbatch's loss / chunks (added to ``self.loss`` if ``count``)."""
        if stage != self.last:
            return out
        if not self.train:
            self.outputs[mb] = out
        if self.targets is None:
            if self.train:
                raise PipelineError(f"stage {stage} is the last stage but has no targets; pass targets to "
                                    "train_step on the rank holding the last stage")
            if not isinstance(out, torch.Tensor):  # raised in the step: on every rank (before 2026-12-05 on one)
                raise TypeError(f"predict returns the last stage's output as one tensor, but stage {stage} "
                                f"returned a {type(out).__name__}; make the model's last layer return a single "
                                "tensor, or use evaluate() with a loss_fn that takes it")
            return out
        target = self.targets[mb]
        if isinstance(out, torch.Tensor) and target.shape[:1] != out.shape[:1]:  # loss_fn may take a tuple
            raise ValueError(f"microbatch {mb} reaches the last stage with {out.shape[0]} rows but its targets "
                             f"have {target.shape[0]} rows ({target.shape[0] * self.chunks} target rows in all): "
                             "pass targets with as many rows as the inputs on the rank holding stage 0")
        loss = self.loss_fn(out, target.to(self.device))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise PipelineError(f"loss_fn must return a scalar tensor (a mean over the microbatch); it "
                                f"returned {got}. Use reduction='mean'")
        if self.weights is not None and self.weights[mb] == 0:
            loss = _nothing_from(out)  # (its mean is 0/0: NaN, and its gradient too)
        else:
            loss = loss.reshape(()) * self.factors[mb]
        if count:
            self.loss += float(loss.detach())
        return loss

    def _graph(self, stage: int, mb: int, grad: np.ndarray | None) -> _Kept:
        """The microbatch's graph (recomputed when checkpointed) and output gradient.

        When the empty :data:`_NO_GRADIENT` arrives (nothing downstream depends on this stage's
        output), ``out`` is None: there is nothing to back-propagate or recompute.
        """
        kept = self.kept[(stage, mb)]
        if grad is not None and grad.size == 0:
            kept.out = kept.outs = kept.rng = kept.buffers = kept.grad = None
            return kept
        if kept.rng is not None:
            # [Note: recompute leaves the buffers alone] The buffers the first forward wrote
            # (BatchNorm's running statistics; found by their version counters and by module type,
            # so static buffers such as masks are never copied) are swapped for throwaway copies during the
            # recompute: its updates land in the copies, and each microbatch moves the real
            # buffers once, as without checkpointing. The real ones are swapped out and back,
            # never written (a write would bump their autograd version, which a graph that saved
            # them checks). (A training-mode BatchNorm's output does not read the statistics.)
            # A buffer the first forward replaced by a new tensor (before 2026-12-05 only version
            # counters were compared, so the recompute updated such a buffer a second time) is
            # swapped for a copy of the tensor that forward read.
            swapped = kept.buffers or []
            real = [m._buffers[name] for m, name, _ in swapped]
            for (m, name, before), tensor in zip(swapped, real, strict=True):
                m._buffers[name] = (before if before is not None else tensor).detach().clone()
            try:
                with replay(kept.rng):
                    y, kept.outs = self._layers(stage, self._enter(stage, kept.x))
                    kept.out = self._loss_or_output(stage, mb, y, count=False)
            finally:
                for (m, name, _), tensor in zip(swapped, real, strict=True):
                    m._buffers[name] = tensor
            kept.rng = kept.buffers = None
        kept.grad = None if grad is None else from_numpy(grad).to(self.device)
        return kept

    def _gradient_upstream(self, stage: int, dx: torch.Tensor | None, x: torch.Tensor) -> np.ndarray:
        """What stage ``stage`` sends upstream for its input gradient ``dx``.

        An input that got no gradient (integer ids, a stop-gradient in the stage, a loss that
        does not depend on it) sends the empty :data:`_NO_GRADIENT`, and the stage upstream skips
        its backward: its parameters keep no gradient, as in one process (before 2026-12-05 it
        sent zeros, and the upstream parameters got zero gradients that weight decay and momentum
        acted on). Once a stage has sent a real gradient in a step, it sends zeros instead of the
        marker (exact: the upstream gradients exist already), as a step carries one shape per boundary.
        """
        if dx is not None:
            self.sent_gradient.add(stage)
            return _host(dx)
        return _host(torch.zeros_like(x)) if stage in self.sent_gradient else _NO_GRADIENT


def _accumulate(params: list[nn.Parameter], grads: tuple[torch.Tensor | None, ...]) -> None:
    for param, g in zip(params, grads, strict=True):
        if g is None:
            continue
        if param.grad is None:
            param.grad = g.detach()
        else:
            param.grad.add_(g)


def _splittable(outs: list[Any], layer_params: list[list[nn.Parameter]]) -> bool:
    """Whether W can run layer by layer ([Note: splitting backward]): every layer with parameters
    returned a tensor of its own. A tuple (``nn.LSTM``) has no single output to stop at, and a
    layer with parameters that writes its input in place (``LayerScale(inplace=True)``) returns the
    tensor the layer before returned, whose W would walk (and free) the later layer's nodes too.
    Such a stage's W takes all its parameters at once (before 2026-12-05 zb-h1 failed on them)."""
    mine = [o for o, ps in zip(outs, layer_params, strict=True) if ps]
    return all(isinstance(o, torch.Tensor) for o in mine) and len({id(o) for o in mine}) == len(mine)


def counted_weights(loss_fn: Any, targets: list[torch.Tensor] | None) -> list[float] | None:
    """The weight of each microbatch's counted targets, where ``loss_fn``'s mean divides by it: an
    ``nn.CrossEntropyLoss`` or ``nn.NLLLoss`` (reduction ``"mean"``) on class indices, whose mean divides by
    the class weights of the targets other than ``ignore_index`` (their count without weights); None for
    any other loss, or probability targets (a plain mean over the rows), or targets this rank does not hold
    (runner [Note: weighted microbatches]). A callable computing the same from ``F.cross_entropy`` is
    not recognised: it is taken as a plain mean. One host sync for all the microbatches.

    Raises:
        ValueError: a target outside the class weights (the loss would refuse it too).
    """
    if (not targets or not isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss))
            or loss_fn.reduction != "mean"):
        return None
    if any(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in targets):
        return None
    weight = loss_fn.weight
    sums = []
    for target in targets:
        counted = target != loss_fn.ignore_index
        if weight is None:
            sums.append(counted.sum().to(torch.float64))
            continue
        classes = torch.where(counted, target, torch.zeros_like(target)).long()  # (uint8 would index as a mask)
        if bool(((classes < 0) | (classes >= weight.numel())).any()):
            raise ValueError(f"a target is outside the loss's {weight.numel()} class weights (and is not its "
                             f"ignore_index={loss_fn.ignore_index})")
        sums.append((weight.detach().to(target.device, torch.float64)[classes] * counted).sum())
    return [float(v) for v in torch.stack(sums).cpu().tolist()]


def _nothing_from(out: Any) -> torch.Tensor:
    """A zero loss whose gradient is exactly zero for every floating tensor of ``out`` (even where ``out``
    holds inf or NaN): a microbatch whose targets the loss does not count."""
    total = torch.zeros(())
    for t in _tensors(out):
        if t.is_floating_point() and t.requires_grad:
            zero = torch.zeros((), dtype=t.dtype, device=t.device)
            total = total.to(t.device) + torch.where(zero.bool(), t, zero).sum()
    return total


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _boundary(stage: int, out: Any) -> np.ndarray:
    """Stage ``stage``'s output as it travels to the next stage: one tensor.

    Raises:
        TypeError: anything else (a tuple, a dict), naming the stage and the fix.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"stage {stage} returned a {type(out).__name__}; what crosses a stage boundary is one "
                        "tensor. Make the stage's last layer return a single tensor (concatenate the parts, or "
                        "balance the stages so that the layers consuming the parts sit in the same stage)")
    return _host(out)


def _host(t: torch.Tensor) -> np.ndarray:
    """A host numpy array of ``t`` (a view on the CPU, a copy from a GPU)."""
    return to_numpy(t.detach().cpu())
