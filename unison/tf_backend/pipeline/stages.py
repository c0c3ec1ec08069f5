"""The Keras side of a pipeline: this rank's stages as a :class:`StageWorker` over gradient tapes.

The driver (``unison.common.pipeline.driver``) calls ``forward``/``backward`` (or the split
``backward_input``/``backward_weight``) per stage and microbatch with numpy arrays at the stage
boundaries. A stage's forward is one ``tf.function`` (traced once per stage and input shape); a
tape that records a call of it keeps the intermediates its backward needs, so the backward
runs as a traced graph too. Each microbatch keeps what its backward needs until then::

    no checkpoint   F: call the compiled stage under a GradientTape; keep the tape (it holds the
                       activations)
                    B: one tape.gradient for the weights and the input; drop the tape
    checkpoint      F: call the compiled stage without a tape; keep only the input and the
                       stage's state
                    B: put the state back, then ONE compiled call recomputes the stage under a
                       tape and differentiates it; put the current state back
    split (zb-h1)   see [Note: splitting a Keras backward]

Gradients are summed per stage over the step's microbatches; the executor applies them.

[Note: Keras recompute replays the RNG] Keras layers draw their randomness (Dropout's mask,
GaussianNoise) from ``SeedGenerator`` state variables that each call advances, and
``non_trainable_variables`` includes them (and BatchNormalization's moving statistics). A
checkpointed forward records the values of the stage's non-trainable variables; the recompute
runs with those values and afterwards gets back the values it found. So it draws the same mask
as the first forward, updates no statistics twice, and later forwards continue the random
sequence as if nothing had been recomputed. Randomness outside a layer's ``SeedGenerator``
(``tf.random.*`` ops, ``keras.random`` calls without a seed generator) is not replayed.

[Note: splitting a Keras backward] TensorFlow differentiates a recorded ``tf.function`` call
for all of its inputs at once: asking a tape for the input gradient alone, then for the weight
gradients, runs the stage's whole backward twice (measured on four 512-wide Dense layers, 64
rows, one thread: 4.0 + 3.9 ms against 2.8 ms for one B). Inside a traced function, though,
the graph keeps only what its outputs need. So:

    no checkpoint   I: ONE tape.gradient for the input and the weights (the cost of B); the
                       weight gradients are added right away and the tape is dropped
                    W: nothing is left to do
    checkpoint      I: replay the state, one compiled recompute that returns the input gradient
                       only (TensorFlow prunes the weight-gradient work); keep input and state
                    W: replay the state again, one compiled recompute that returns the weight
                       gradients only

Without checkpointing zb-h1 thus costs what 1F1B costs, with its order; with checkpointing ``I``
is shorter than a recomputing ``B`` (2.8 against 3.7 ms on the same layers, 64 rows) and ``W``
(3.3 ms) fills the drain, at the price of a second recompute.

[Note: no gradient through integers] A stage whose input is not floating (integer ids cast from
an activation upstream) has no input gradient: it sends the empty ``_NO_GRADIENT`` upstream, and a
stage that receives it skips its backward, so its variables get no gradient (None, not zeros:
the optimizer leaves them alone, as Keras does in one process, warning that they have none).
Before 2026-12-07 the integer input was watched and "differentiated", and stage 0 failed inside
``tape.gradient`` on every rank with TensorFlow's bare "'str' object has no attribute
'_type_enum'" (found by an audit); the PyTorch executor already did this.

[Note: Keras loss scaling] The last stage differentiates ``loss(targets, outputs) * scale``.
``scale`` is ``1 / chunks`` for a mean (a Keras loss with ``"sum_over_batch_size"``, the default,
or any callable; a callable's per-example values are averaged, as ``compile`` does), and 1 for
``reduction="sum"``. With equal microbatches, the step's loss and gradients then equal those
of one process computing the loss over the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from unison.common.pipeline import PipelineError
from unison.common.pipeline.runner import microbatch_shares

__all__: list[str] = []

_NO_GRADIENT = np.empty(0, np.float32)  # what an evaluation pass, or a stage with integer input, sends upstream
_ZERO = tf.UnconnectedGradients.ZERO


def scaled_loss(loss: Any, chunks: int) -> tuple[Callable[[Any, Any], tf.Tensor], bool]:
    """``(fn, is_mean)``: ``fn(y_true, y_pred)`` is one microbatch's share of the step's loss.

    See [Note: Keras loss scaling]. ``is_mean`` is False only for ``reduction="sum"``: then
    data-parallel replicas add their losses and gradients instead of averaging them.

    Raises:
        TypeError: ``loss`` is neither a loss name, a Keras loss nor a callable.
    """
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    if not callable(fn):
        raise TypeError(f"loss must be a Keras loss, a loss name or a callable (y_true, y_pred) -> loss; "
                        f"received {type(loss).__name__}")
    is_mean = getattr(fn, "reduction", None) != "sum"
    scale = 1.0 / chunks if is_mean else 1.0

    def share(y_true: Any, y_pred: Any) -> tf.Tensor:
        value = fn(y_true, y_pred)
        if value.dtype in (tf.float16, tf.bfloat16):  # (only low precision is raised: a float64 model's loss
            value = tf.cast(value, tf.float32)       # was cut to float32, 3.5e-8 off one process)
        return tf.reduce_mean(value) * scale  # a no-op mean for a reduced (scalar) loss

    share.unison_loss = fn  # type: ignore[attr-defined]  # (read by counted_weights)
    return share, is_mean


def counted_weights(loss: Any, targets: Sequence[Any] | None) -> list[float] | None:
    """The number of each microbatch's counted targets where ``loss``'s mean divides by it: a
    ``SparseCategoricalCrossentropy`` with ``ignore_class`` (reduction ``"sum_over_batch_size"``), whose mean is
    over the targets other than that class; None for any other loss or targets this rank does not hold
    (runner [Note: weighted microbatches])."""
    fn = getattr(loss, "unison_loss", loss)
    if targets is None or not isinstance(fn, keras.losses.SparseCategoricalCrossentropy):
        return None
    config = fn.get_config()
    ignored = config.get("ignore_class")
    if ignored is None or config.get("reduction") != "sum_over_batch_size":
        return None
    return [float(np.count_nonzero(np.asarray(t) != ignored)) for t in targets]


class KerasStage:
    """One stage: its layers and variables, and its compiled forward, inference and recompute.

    Args:
        index: the stage's number in the pipeline.
        layers: its Keras layers, in order, already built.
        loss: on the last stage, ``loss(y_true, y_pred)`` -> the microbatch's scaled loss; else None.
    """

    def __init__(self, index: int, layers: Sequence[keras.Layer], loss: Callable[..., Any] | None) -> None:
        self.index = index
        self.layers = list(layers)
        self.loss = loss
        self.weights = _unique(v for layer in self.layers for v in layer.trainable_variables)
        #: every weight, trainable or not (no seed generator states): what replicas must agree on
        self.all_weights = _unique(v for layer in self.layers for v in layer.weights)
        #: the non-trainable floating-point weights (moving statistics; no seed generator states, no integer
        #: counters): each replica updates them from its own rows, so a grid averages them after each step
        self.statistics = [v for v in self.all_weights
                           if not v.trainable and keras.backend.is_float_dtype(v.dtype)]
        self.state = _unique(v for layer in self.layers for v in layer.non_trainable_variables)
        self._forward = tf.function(self.target, reduce_retracing=True)
        self._infer = tf.function(lambda x: self(x, training=False), reduce_retracing=True)
        self._recompute = tf.function(self._recompute_gradients, reduce_retracing=True)

    def __call__(self, x: tf.Tensor, training: bool = True) -> tf.Tensor:
        for layer in self.layers:
            x = layer(x, training=training)
        return x

    def target(self, x: tf.Tensor, y_true: Any = None) -> tf.Tensor:
        """What the backward differentiates: the output, or on the last stage the scaled loss."""
        y = self(x)
        return y if self.loss is None else self.loss(y_true, y)

    def compiled_target(self, x: tf.Tensor, y_true: Any = None) -> tf.Tensor:
        return self._forward(x, y_true)

    def infer(self, x: tf.Tensor) -> tf.Tensor:
        """The output with training off (Dropout passes everything), compiled."""
        return self._infer(x)

    def record(self, x: tf.Tensor, y_true: Any) -> tuple[tf.GradientTape, tf.Tensor]:
        """Run the stage under a new tape (watching ``x`` past stage 0); return it and the target."""
        tape = tf.GradientTape()
        with tape:
            if self.differentiates_input(x):
                tape.watch(x)
            out = self._forward(x, y_true) if tf.executing_eagerly() else self.target(x, y_true)
        return tape, out

    def differentiates_input(self, x: tf.Tensor) -> bool:
        """Whether the stage's input has a gradient: past stage 0, and floating (integer ids have none)."""
        return self.index > 0 and x.dtype.is_floating

    def gradients(self, tape: tf.GradientTape, out: tf.Tensor, x: tf.Tensor, dy: tf.Tensor | None,
                  weights: bool = True, inputs: bool = True) -> list[tf.Tensor]:
        """Gradients of ``out`` (weighted by ``dy``) wrt the weights and/or the input (where
        :meth:`differentiates_input`), in that order."""
        sources = (self.weights if weights else []) + ([x] if inputs and self.differentiates_input(x) else [])
        if not sources:
            return []
        return tape.gradient(out, sources, output_gradients=dy, unconnected_gradients=_ZERO)

    def recompute_gradients(self, x: tf.Tensor, dy: tf.Tensor | None, y_true: Any, weights: bool = True,
                            inputs: bool = True) -> list[tf.Tensor]:
        """Recompute the stage and differentiate it in one compiled call (one trace per choice).

        Returns the weight gradients (if ``weights``), then (if ``inputs`` and the stage
        :meth:`differentiates_input`) the input gradient; the graph computes nothing else.
        """
        return self._recompute(x, dy, y_true, weights, inputs)

    def _recompute_gradients(self, x: tf.Tensor, dy: tf.Tensor | None, y_true: Any, weights: bool,
                             inputs: bool) -> list[tf.Tensor]:
        tape, out = self.record(x, y_true)
        return self.gradients(tape, out, x, dy, weights, inputs)

    def snapshot(self) -> list[tf.Tensor]:
        """The current values of the stage's non-trainable variables (seed generators included)."""
        return [tf.identity(v) for v in self.state]

    @contextmanager
    def replayed(self, values: list[tf.Tensor]) -> Iterator[None]:
        """Run the block with the state ``values``, then put back what was there; see the Note."""
        now = self.snapshot()
        _assign(self.state, values)
        try:
            yield
        finally:
            _assign(self.state, now)


@dataclass
class _Kept:
    """What a microbatch keeps between its forward and its backward on one stage."""

    x: tf.Tensor
    tape: tf.GradientTape | None = None
    out: tf.Tensor | None = None  # what the tape differentiates: the output or the scaled loss
    state: list[tf.Tensor] | None = None  # set when the forward is to be recomputed
    dy: tf.Tensor | None = None  # checkpointed split backward: the output gradient, for W


class KerasStages:
    """This rank's stages, driven one (stage, microbatch) action at a time.

    Args:
        stages: stage index -> :class:`KerasStage`.
        num_stages: stages in the whole pipeline.
        checkpoint: one of ``unison.common.pipeline.runner.CHECKPOINTS``.
    """

    def __init__(self, stages: dict[int, KerasStage], num_stages: int, checkpoint: str) -> None:
        self.stages = stages
        self.last = num_stages - 1
        self.checkpoint = checkpoint
        self.begin(None, None, 1, train=True)

    def begin(self, inputs: Sequence[Any] | None, targets: Sequence[Any] | None, chunks: int,
              train: bool) -> None:
        """Start a step: this rank's microbatches of inputs and targets (None where not held)."""
        self.inputs, self.targets, self.chunks, self.train = inputs, targets, chunks, train
        last = self.stages.get(self.last)
        weights = counted_weights(last.loss, targets) if last is not None else None
        factors, self.weight_total = microbatch_shares(weights, chunks)
        #: per microbatch, its factor over the ``1 / chunks`` the compiled loss applies (runner [Note: weighted
        #: microbatches]); None: every microbatch counts alike
        self.ratios = None if weights is None else [f * chunks for f in factors]
        self._loss_dtype = tf.float32
        self.kept: dict[tuple[int, int], _Kept] = {}
        self.grads: dict[int, list[tf.Tensor]] = {}
        self.loss = 0.0
        self.outputs: dict[int, np.ndarray] = {}

    # ------------------------------------------------------------------ the StageWorker calls
    def forward(self, stage: int, mb: int, x: np.ndarray | None) -> np.ndarray | None:
        st, inp, y_true = self.stages[stage], self._input(stage, mb, x), self._target(stage, mb)
        if y_true is not None:
            self._check_rows(stage, mb, inp, y_true)
        if not self.train:
            out = st.infer(inp)
            if stage != self.last:
                return _boundary(st, out)
            self.outputs[mb] = out.numpy()
            if y_true is not None:
                self.loss += float(st.loss(y_true, out)) * self._ratio(mb)  # type: ignore[misc]  # (it has one)
            return None
        if self.checkpoint == "always" or (self.checkpoint == "except_last" and mb < self.chunks - 1):
            kept = _Kept(inp, state=st.snapshot())
            out = st.compiled_target(inp, y_true)
        else:
            tape, out = st.record(inp, y_true)
            kept = _Kept(inp, tape, out)
        self.kept[(stage, mb)] = kept
        if stage == self.last:
            self.loss += float(out) * self._ratio(mb)
            self._loss_dtype = out.dtype  # (what _loss_gradient's scale must be)
            return None
        return _boundary(st, out)

    def backward(self, stage: int, mb: int, grad: np.ndarray | None) -> np.ndarray | None:
        if not self.train:
            return None if stage == 0 else _NO_GRADIENT
        st, kept = self.stages[stage], self.kept.pop((stage, mb))
        if stage != self.last and grad is not None and grad.size == 0:
            # [Note: no gradient through integers] the stage downstream took integers: nothing to back-propagate
            return None if stage == 0 else _NO_GRADIENT
        dy = self._loss_gradient(mb) if stage == self.last else _tensor(grad)
        if kept.state is not None:
            with st.replayed(kept.state):
                grads = st.recompute_gradients(kept.x, dy, self._target(stage, mb))
        else:
            grads = st.gradients(kept.tape, kept.out, kept.x, dy)
        self._add(stage, grads[:len(st.weights)])
        if stage == 0:
            return None
        return grads[-1].numpy() if st.differentiates_input(kept.x) else _NO_GRADIENT

    def backward_input(self, stage: int, mb: int, grad: np.ndarray | None) -> np.ndarray | None:
        st, kept = self.stages[stage], self.kept[(stage, mb)]
        if kept.state is None:  # [Note: splitting a Keras backward]: the whole backward, now
            return self.backward(stage, mb, grad)
        if stage != self.last and grad is not None and grad.size == 0:  # [Note: no gradient through integers]
            del self.kept[(stage, mb)]  # (and W finds nothing to do)
            return None if stage == 0 else _NO_GRADIENT
        kept.dy = self._loss_gradient(mb) if stage == self.last else _tensor(grad)
        if stage == 0:
            return None  # nobody needs stage 0's input gradient; W does all its work
        if not st.differentiates_input(kept.x):
            return _NO_GRADIENT
        with st.replayed(kept.state):
            (dx,) = st.recompute_gradients(kept.x, kept.dy, self._target(stage, mb), weights=False)
        return dx.numpy()

    def backward_weight(self, stage: int, mb: int) -> None:
        kept = self.kept.pop((stage, mb), None)
        if kept is None:
            return  # not checkpointed: I added the weight gradients already
        st = self.stages[stage]
        with st.replayed(kept.state):  # type: ignore[arg-type]  # kept only when checkpointed
            self._add(stage, st.recompute_gradients(kept.x, kept.dy, self._target(stage, mb), inputs=False))

    # ------------------------------------------------------------------ helpers
    def _ratio(self, mb: int) -> float:
        return 1.0 if self.ratios is None else self.ratios[mb]

    def _loss_gradient(self, mb: int) -> tf.Tensor | None:
        """The last stage's output gradient: None (the compiled loss's own scale), or the microbatch's ratio
        to it when the microbatches count unequally (the gradients are linear in it)."""
        return None if self.ratios is None else tf.constant(self.ratios[mb], self._loss_dtype)

    def _input(self, stage: int, mb: int, x: np.ndarray | None) -> tf.Tensor:
        if stage > 0:
            return tf.convert_to_tensor(x)
        if self.inputs is None:
            raise PipelineError("stage 0 has no inputs; pass x to train_step on the ranks holding stage 0")
        return tf.convert_to_tensor(self.inputs[mb])

    def _target(self, stage: int, mb: int) -> Any:
        if stage != self.last or (self.targets is None and not self.train):
            return None
        if self.targets is None:
            raise PipelineError(f"stage {stage} is the last stage but has no targets; pass y to train_step on "
                                "the ranks holding the last stage")
        return tf.convert_to_tensor(self.targets[mb])

    def _check_rows(self, stage: int, mb: int, inp: tf.Tensor, y_true: tf.Tensor) -> None:
        """Targets and activations must have one row each per example: else the loss would broadcast.

        The inputs (stage 0) and the targets (last stage) live on different ranks, so the
        pre-flight check cannot compare their rows; the last stage compares them here.

        Raises:
            ValueError: the microbatch of targets has another row count than the activation.
        """
        n, k = int(inp.shape[0]), int(y_true.shape[0])
        if n != k:
            raise ValueError(f"microbatch {mb} of y has {k} rows but the activation reaching the last stage "
                             f"({stage}) has {n}: y has {k * self.chunks} rows for the {n * self.chunks} of x; "
                             "pass y with as many rows as x")

    def _add(self, stage: int, grads: list[tf.Tensor]) -> None:
        # an embedding's gradient is tf.IndexedSlices (no "+"): summed over microbatches as a dense tensor
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
        held = self.grads.get(stage)
        self.grads[stage] = list(grads) if held is None else [a + g for a, g in zip(held, grads, strict=True)]


def _boundary(stage: KerasStage, out: Any) -> np.ndarray:
    """``stage``'s output as it travels to the next stage: one tensor (the PyTorch executor's rule).

    Raises:
        TypeError: anything else (a tuple, a dict), naming the stage, its last layer and the fix (before
            2026-12-07 every rank got AttributeError "'tuple' object has no attribute 'numpy'").
    """
    if not isinstance(out, tf.Tensor):
        last = stage.layers[-1]
        raise TypeError(f"stage {stage.index} returned a {type(out).__name__} (from its last layer, "
                        f"{last.name!r} ({type(last).__name__})); what crosses a stage boundary is one tensor. "
                        "Make the stage's last layer return a single tensor (concatenate the parts), or choose a "
                        "balance that puts the layers consuming the parts in the same stage")
    return out.numpy()  # type: ignore[no-any-return]


def _tensor(array: np.ndarray | None) -> tf.Tensor | None:
    return None if array is None else tf.convert_to_tensor(array)


def _assign(variables: list[Any], values: list[tf.Tensor]) -> None:
    for var, value in zip(variables, values, strict=True):
        var.assign(value)


def _unique(variables: Any) -> list[Any]:
    """Variables in order, each once (layers may share one)."""
    seen: set[int] = set()
    out = []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out
