"""The sharded Keras optimizer: the user's optimizer class, built on this rank's shard only.

:func:`sharded_class` makes (once per optimizer class) a subclass that keeps the original's name,
module and config, so a saved model names the plain class and loads in a plain Keras process.
It overrides four things (see [Note: a sharded Keras step] in ``zero.py``):

* ``build(model_variables)``: lays the variables out (:class:`~unison.tf_backend.zero.ShardLayout`),
  checks that every rank has the same stage and plan, and builds the original optimizer on the
  shard variables, so its slots are 1/N of the unsharded ones.
* ``apply(grads, model_variables)``: the variables Keras overwrites with their gradient (float8
  scales, kept out of the shards) overwritten as Keras does (``ShardLayout.overwrite``); then
  reduce(-scatter) -> Keras's own ``apply`` on the shard ->
  all-gather into the model's variables.
* ``_apply_weight_decay``: decoupled weight decay with a per-element mask (the shard variable has
  no name to match ``exclude_from_weight_decay`` against).
* ``save_own_variables`` / ``load_own_variables``: write and read nothing (see ``zero.py``).

``UnisonStrategy(zero_stage=k)`` turns every optimizer created in its scope into this class in
place (:func:`install`); the Keras ``DistributedOptimizer`` makes a new instance from the config.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import keras
import tensorflow as tf
from keras.src.optimizers import base_optimizer

from unison.common import runtime
from unison.common.ops import Average, Sum
from unison.keras.optimizer import rebuilt
from unison.tf_backend import zero
from unison.tf_backend.functions import fill_missing_gradients, source_key
from unison.tf_backend.strategy import UnisonStrategy, grouped_sum

__all__: list[str] = []

log = logging.getLogger(__name__)

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion")
_classes: dict[type, type] = {}
#: the sharded optimizers alive, whose shard variables and slots are each rank's own (see rank_local_keys)
_live: weakref.WeakSet[Any] = weakref.WeakSet()
_agreeing: dict[type, type] = {}  # LossScaleOptimizer classes with agreed skips, for zero_stage=0


def check_shardable(optimizer: Any) -> None:
    """Raise unless ``optimizer``'s update gives the same numbers on flat slices as on whole variables.

    Raises:
        ValueError: a non-elementwise optimizer, ``clipnorm``, ``use_ema``,
            or an optimizer that is already a ``DistributedOptimizer`` or sharded.
    """
    name = type(optimizer).__name__
    if getattr(optimizer, "_unison_distributed", False):
        raise ValueError(f"{name} is already a Unison DistributedOptimizer; under UnisonStrategy(zero_stage=...) "
                         "pass the plain Keras optimizer, or use DistributedOptimizer(..., zero_stage=...) "
                         "without the strategy")
    allowed = {getattr(keras.optimizers, n).update_step for n in ELEMENTWISE}
    if type(optimizer).update_step not in allowed:
        raise ValueError(f"zero_stage 1/2 shards optimizer state by flat slices, which is exact only for "
                         f"elementwise updates; {name}'s update is not one of {list(ELEMENTWISE)} (e.g. "
                         "Adafactor factors its moments, Lamb and Muon use whole-variable norms/matrices). "
                         f"Use zero_stage=0 for {name}")
    _refuse_whole_variable_options(optimizer)


def _refuse_whole_variable_options(optimizer: Any) -> None:
    """Raise for the options a shard cannot honour: at construction and, since Keras reads them at every
    apply, at each apply too (set after construction, ``clipnorm`` clipped each flat shard by its own
    norm: silently other numbers, before 2026-12-05)."""
    name = type(optimizer).__name__
    for attr, why in (("clipnorm", "clips each variable by its own norm"),
                      ("use_ema", "keeps a moving average of the full weights")):
        if getattr(optimizer, attr, None):
            raise ValueError(f"{name}({attr}={getattr(optimizer, attr)!r}) {why}, which a shard cannot compute "
                             f"alone; remove {attr} (clipvalue and global_clipnorm work) or use zero_stage=0")


def _refuse_local_var(self: Any, var: Any) -> None:
    raise ValueError(f"register_local_var: {type(self).__name__} is sharded (zero_stage "
                     f"{self.__dict__.get('_unison_zero_stage')}): every gradient is reduced into its rank's "
                     "shard, so a variable cannot stay local; use zero_stage=0 to keep local variables")


def sharded_class(base: type) -> type:
    """The sharded subclass of optimizer class ``base`` (made once)."""
    if base in _classes:
        return _classes[base]
    if base in _classes.values():
        return base
    cls = type(base.__name__, (base,), {
        "build": _build, "apply": _apply, "_apply_weight_decay": _apply_weight_decay,
        "_clip_gradients": _clip_gradients, "register_local_var": _refuse_local_var,
        "_all_reduce_sum_gradients": lambda self, pairs: list(pairs),
        "save_own_variables": lambda self, store: None, "load_own_variables": _load_own_variables,
        "_trackable_children": _refuse_tf_checkpoint,
        "_unison_zero_sharded": True, "__module__": base.__module__, "__qualname__": base.__qualname__})
    _classes[base] = cls
    return cls


def make_sharded(optimizer: Any, stage: int, op: Any, in_place: bool) -> Any:
    """``optimizer`` as a sharded optimizer of ``stage`` whose gradients are reduced with ``op``.

    ``in_place``: change the instance's class (an optimizer a strategy scope just created);
    otherwise a new instance from its config (the Keras ``DistributedOptimizer``).
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return _sharded_loss_scale(optimizer, stage, op, in_place)
    check_shardable(optimizer)
    cls = sharded_class(type(optimizer))
    if in_place:
        optimizer.__class__ = cls
    else:
        optimizer = rebuilt(cls, optimizer, optimizer.get_config())
    optimizer.__dict__["_unison_zero_stage"] = stage
    optimizer.__dict__["_unison_zero_op"] = Sum if op is Sum else Average
    return optimizer


def stage_of(optimizer: Any) -> int:
    """The ZeRO stage ``optimizer`` was sharded for (0 for a plain one); a ``LossScaleOptimizer`` around a
    sharded optimizer carries its stage too."""
    return int(getattr(optimizer, "__dict__", {}).get("_unison_zero_stage", 0) or 0)


def _sharded_loss_scale(optimizer: Any, stage: int, op: Any, in_place: bool) -> Any:
    """A ``LossScaleOptimizer`` whose skip decision every rank agrees on, around a sharded optimizer.

    [Note: agreed loss-scale skips]
    Keras decides to skip a step when *this rank's* gradients hold an inf or a NaN; under
    sharding one rank skipping while another steps would hang the collectives of the step
    (they run inside the decision's ``cond``) or desynchronise the shards. So the found-inf
    flag is summed over the ranks first: every rank skips when any rank overflowed, which is
    what one process on the global batch does (its gradients would hold the inf too).

    ``in_place`` is used from inside ``LossScaleOptimizer.__init__`` (the strategy hook),
    before the inner optimizer is set: the inner one is sharded when this one is built.
    """
    cls = _loss_scale_class(type(optimizer))
    if in_place:
        optimizer.__class__ = cls
    else:
        inner = make_sharded(optimizer.inner_optimizer, stage, op, in_place=False)
        optimizer = cls(inner, initial_scale=optimizer.initial_scale,
                        dynamic_growth_steps=optimizer.dynamic_growth_steps, name=optimizer.name)
    optimizer.__dict__["_unison_zero_stage"] = stage
    optimizer.__dict__["_unison_zero_op"] = Sum if op is Sum else Average
    return optimizer


def _agreeing_loss_scale_class(base: type) -> type:
    """``base`` (a ``LossScaleOptimizer`` class) deciding its skips on the found-inf flag of every rank.

    Used as is at ``zero_stage=0`` under ``UnisonStrategy`` (see [Note: agreed loss-scale skips]):
    there the gradients Keras checks are still this rank's own (the all-reduce runs inside the
    inner optimizer's ``apply``, inside the branch the decision picks), so without the agreement a
    rank whose batch overflowed skips alone, its scale halves, and the other ranks wait in an
    all-reduce it never joins.
    """
    if base in _agreeing:
        return _agreeing[base]
    if base in _agreeing.values() or getattr(base, "_unison_agrees_on_skips", False):
        return base

    def check_finite(self: Any, grads: Any) -> Any:
        """Keras's check on this rank's gradients, then true only where every rank's was."""
        finite = base.check_finite(self, grads)
        if runtime.size() == 1:
            return finite
        overflowed = tf.cast(tf.logical_not(tf.convert_to_tensor(finite)), tf.float32)
        return tf.equal(grouped_sum([overflowed], "unison.zero.finite")[0], 0.0)

    cls = type(base.__name__, (base,), {
        "check_finite": check_finite, "_unison_agrees_on_skips": True,
        "__module__": base.__module__, "__qualname__": base.__qualname__})
    _agreeing[base] = cls
    return cls


def _refuse_tf_checkpoint(self: Any, save_type: str = "checkpoint", **kwargs: Any) -> Any:
    """Refuse ``tf.train.Checkpoint`` (save and restore) of a sharded optimizer; other traversals pass.

    [Note: no tf.train.Checkpoint of a sharded optimizer]
    A TensorFlow checkpoint would name this rank's *shard* slots (built on the shard variables)
    as if they were the optimizer's state; under the strategy only rank 0 writes, so a restore
    would give every rank rank 0's shard: a silent wrong answer. Every rank traverses the
    checkpoint's objects (rank 0 to write, the others to decide not to), so every rank raises.
    """
    if save_type == "checkpoint":
        raise ValueError(f"tf.train.Checkpoint cannot save or restore the sharded optimizer {self.name!r} "
                         f"(zero_stage {self.__dict__.get('_unison_zero_stage')}): each rank holds only its "
                         "shard of the state. Use unison.tf_backend.save_sharded(path, model, optimizer) and "
                         "load_sharded(path, model, optimizer) (tf.train.Checkpoint(model=model) of a model "
                         "compiled with it includes the optimizer too)")
    return super(type(self), self)._trackable_children(save_type, **kwargs)


def _loss_scale_class(base: type) -> type:
    if base in _classes:
        return _classes[base]
    if base in _classes.values():
        return base
    original, base = base, _agreeing_loss_scale_class(base)

    def build(self: Any, var_list: Any) -> None:
        inner = self.inner_optimizer
        if not is_sharded(inner):
            if inner.built:
                raise ValueError(f"LossScaleOptimizer: its inner optimizer {type(inner).__name__} is already "
                                 "built unsharded; wrap an optimizer that has not been built yet")
            make_sharded(inner, self.__dict__["_unison_zero_stage"], self.__dict__["_unison_zero_op"],
                         in_place=True)
        base.build(self, var_list)

    cls = type(base.__name__, (base,), {
        "build": build, "save_own_variables": lambda self, store: None,
        "load_own_variables": _load_own_variables, "_trackable_children": _refuse_tf_checkpoint,
        "_unison_zero_sharded": True, "__module__": base.__module__, "__qualname__": base.__qualname__})
    _classes[original] = cls
    return cls


def is_sharded(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a sharded optimizer of this module."""
    return bool(getattr(type(optimizer), "_unison_zero_sharded", False))


def shard_numel(optimizer: Any) -> int:
    """Elements of ``optimizer``'s shard variables (0 before it is built)."""
    layout = optimizer.__dict__.get("_unison_zero")
    return 0 if layout is None else layout.numel()


# -------------------------------------------------------------------- the overrides
def _build(self: Any, variables: Any) -> None:
    if self.built:
        return
    variables = list(variables)
    stage = self.__dict__["_unison_zero_stage"]

    def make_variable(shape: tuple[int, ...], dtype: str, name: str) -> Any:
        return keras.Variable(initializer="zeros", shape=shape, dtype=dtype, trainable=False, name=name)

    with keras.name_scope(self.name, caller=self):  # the layout agrees with the other ranks first
        layout = zero.ShardLayout(variables, stage, self.__dict__["_unison_zero_op"], make_variable,
                                  what=f"{type(self).__name__}.build")
    self.__dict__["_unison_zero"] = layout
    self.__dict__["_unison_zero_masks"] = None
    log.debug("zero stage %d: %s", stage, layout.plan.describe())
    before = {id(v) for v in self.variables}
    super(type(self), self).build(layout.shards)
    own = [v for v in self.variables if id(v) not in before] + list(layout.shards)
    self.__dict__["_unison_rank_local"] = {source_key(v) for v in own}
    # the overwritten variables' running maxima, alike on every rank (see ShardLayout.overwrite); named as
    # Keras names their accumulators unsharded, so checkpoints of either kind carry them as the same slot
    self.__dict__["_unison_zero_accumulators"] = [
        self.add_variable_from_reference(v, name="gradient_accumulator") for v in layout.overwritten
    ] if self.gradient_accumulation_steps else None
    _live.add(self)


def rank_local_keys() -> set[Any]:
    """The keys (``source_key``) of every live sharded optimizer's per-rank variables: its shards and
    their slots (Adam's moments), which hold a different segment on each rank.

    [Note: a sharded optimizer's state is not broadcast] Horovod's recipe broadcasts
    ``optimizer.variables`` from rank 0 (``BroadcastGlobalVariablesCallback``,
    ``broadcast_variables``); the shards' shapes are alike on every rank, so the broadcast went
    through and put rank 0's segment of the moments into every rank's (silently wrong steps
    after it). :func:`unison.tf_backend.broadcast_variables` leaves these out: each rank's
    segment is its own, and the weights themselves agree after every step's all-gather.
    """
    keys: set[Any] = set()
    for optimizer in list(_live):
        keys |= optimizer.__dict__.get("_unison_rank_local", set())
    return keys


def _apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    _refuse_whole_variable_options(self)
    grads = list(grads)
    if not len(grads):
        return None
    if not self.built:
        if trainable_variables is None:
            raise ValueError("a sharded optimizer must be built before apply(grads) without variables: call "
                             "optimizer.build(model.trainable_variables) first")
        self.build(list(trainable_variables))
    layout = self.__dict__["_unison_zero"]
    _warn_if_sparse(self, grads)
    grads = _in_plan_order(layout, grads, trainable_variables, f"unison.zero.presence.{layout.tag}")
    n = len(layout.variables)
    # before Keras's apply, which counts the iteration: see [Note: overwritten variables at ZeRO stages 1/2]
    layout.overwrite(self, grads[n:], self.__dict__.get("_unison_zero_accumulators"))
    layout.load_shards()
    shard_grads = layout.shard_gradients(grads[:n])
    base_optimizer.BaseOptimizer.apply(self, shard_grads, layout.shards)
    layout.store_shards()
    return None


def _warn_if_sparse(optimizer: Any, grads: list[Any]) -> None:
    """Log once per optimizer (on rank 0) when a ``tf.IndexedSlices`` gradient meets an update that is not
    linear in the gradient.

    [Note: sparse gradients at ZeRO stages 1/2]
    A flat shard cannot keep an ``Embedding``'s rows, so its ``IndexedSlices`` gradient is summed
    densely: the true gradient of the global batch. One Keras process applies the slices row by row
    instead: Adam squares each looked-up row and scatter-adds, so a row looked up twice gets
    ``g1**2 + g2**2`` in its second moment where the dense sum gives ``(g1 + g2)**2``. The two agree
    for plain SGD (with or without momentum), whose update is linear in the gradient, and for
    batches without repeated rows; otherwise the weights differ from one process's (measured: 0.10
    after 3 Adam steps on a 3-row embedding). ``zero_stage=0`` keeps the slices.
    """
    if optimizer.__dict__.get("_unison_sparse_warned") or not any(isinstance(g, tf.IndexedSlices) for g in grads):
        return
    optimizer.__dict__["_unison_sparse_warned"] = True
    if type(optimizer).update_step is keras.optimizers.SGD.update_step or runtime.rank() != 0:
        return
    log.warning("zero_stage %s: %s gets a sparse (tf.IndexedSlices) gradient, e.g. an Embedding's; a sharded "
                "optimizer sums it densely (the true gradient), where Keras's %s in one process updates the "
                "looked-up rows one by one, so rows repeated in a batch make the weights differ from one "
                "process's. Use zero_stage=0 to keep the rows (see [Note: sparse gradients at ZeRO stages 1/2])",
                optimizer.__dict__.get("_unison_zero_stage"), type(optimizer).__name__, type(optimizer).__name__)


def _in_plan_order(layout: Any, grads: list[Any], variables: Any, name: str) -> list[Any]:
    """The gradients of ``layout.variables`` then ``layout.overwritten``, dense; zeros where only other
    ranks have one (an overwritten variable with a gradient on no rank keeps None: Keras skips it).

    A variable that has a gradient on some ranks only (a branch some ranks' data takes) is reduced
    with zeros from the others, as one process averages it (the ranks agree which exist: one small
    all-gather, eagerly each step, in a ``tf.function`` once at trace time); before 2026-12-05 the
    ranks without one raised alone and the others waited in the reduction. A variable with a
    gradient on no rank raises on every rank: its segment cannot be left out of the flat step.
    """
    if variables is None:
        variables = layout.built_on
    variables = list(variables)
    if len(variables) != len(grads):
        raise ValueError(f"apply got {len(grads)} gradients for {len(variables)} variables; pass one per variable")
    known = layout.variables + layout.overwritten
    index = {id(_unwrap(v)): i for i, v in enumerate(known)}
    out: list[Any] = [None] * len(known)
    for g, v in zip(grads, variables, strict=True):
        i = index.get(id(_unwrap(v)))
        if i is None:
            raise ValueError(f"variable {zero._path(v)} is not among the {len(known)} variables this "
                             "sharded optimizer was built with; build it on model.trainable_variables")
        out[i] = g
    out = fill_missing_gradients(out, known, name)
    missing = [zero._path(layout.variables[i]) for i, g in enumerate(out[:len(layout.variables)]) if g is None]
    if missing:
        raise ValueError(f"zero_stage 1/2 needs a gradient for every variable the optimizer was built with; "
                         f"{missing} have none on any rank. A sharded optimizer lays out its variables when it "
                         "is built: after freezing a layer (layer.trainable = False) compile again with a new "
                         "optimizer (or freeze before the first step); else use zero_stage=0")
    return [None if g is None else tf.convert_to_tensor(g) for g in out]


def _unwrap(v: Any) -> Any:
    return getattr(v, "value", v) if isinstance(v, keras.Variable) else v


def _apply_weight_decay(self: Any, variables: Any) -> None:
    if self.weight_decay is None:
        return
    layout = self.__dict__["_unison_zero"]
    if self.__dict__.get("_unison_zero_masks") is None:
        self.__dict__["_unison_zero_masks"] = layout.decay_masks(self._use_weight_decay)
    for shard, mask in zip(layout.shards, self.__dict__["_unison_zero_masks"], strict=True):
        lr = tf.cast(self.learning_rate, shard.dtype)
        wd = tf.cast(self.weight_decay, shard.dtype)
        decay = shard.value * wd * lr
        if mask is not None:
            decay = decay * tf.constant(mask, dtype=shard.dtype)
        shard.assign(shard.value - decay)


def _clip_gradients(self: Any, grads: list[Any]) -> list[Any]:
    """Keras's clipping, with ``global_clipnorm`` over the whole model: the shards' squared norms summed.

    The ranks' shards are disjoint (padding is zero), so the sum over the ranks of each shard's
    squared norm is the squared norm of the full gradient, as one process computes it.
    """
    if not (self.global_clipnorm and self.global_clipnorm > 0):
        return super(type(self), self)._clip_gradients(grads)
    local = tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in grads])
    norm = tf.sqrt(grouped_sum([local], "unison.zero.clipnorm")[0] if runtime.size() > 1 else local)
    clip = tf.constant(self.global_clipnorm, tf.float32)
    scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)  # NaN/inf norm propagates, as in Keras
    return [g * tf.cast(scale, g.dtype) for g in grads]


def _load_own_variables(self: Any, store: Any) -> None:
    if len(store.keys()):
        log.warning("optimizer %s is sharded (zero_stage %s): the %d optimizer variables in the file are not "
                    "loaded; its state starts fresh", self.name, self.__dict__.get("_unison_zero_stage"),
                    len(store.keys()))


# -------------------------------------------------------------------- UnisonStrategy hook
_INSTALLED = False


def install(stage_of: Any) -> None:
    """Make optimizers created in the scope of a strategy with ``stage_of(strategy) > 0`` sharded.

    A ``LossScaleOptimizer`` created in a ``UnisonStrategy``'s scope at ``zero_stage=0`` gets
    agreed skips (:func:`_agreeing_loss_scale_class`) and is otherwise unchanged.

    ``stage_of(strategy)``: that strategy's zero stage, or 0 for any other strategy.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    original = TFOptimizer.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        original(self, *args, **kwargs)
        strategy = tf.distribute.get_strategy()
        stage = stage_of(strategy)
        if stage > 0 and not is_sharded(self):
            make_sharded(self, stage, Sum, in_place=True)
        elif isinstance(self, keras.optimizers.LossScaleOptimizer) and isinstance(strategy, UnisonStrategy):
            self.__class__ = _agreeing_loss_scale_class(type(self))  # zero_stage=0: agree on skips too

    TFOptimizer.__init__ = __init__
    _INSTALLED = True


def check_compiled(model: Any, stage: int) -> None:
    """Refuse ``model.fit`` under a zero strategy when the model's optimizer is not sharded.

    Raises:
        ValueError: the optimizer was created outside the strategy's scope.
    """
    optimizer = getattr(model, "optimizer", None)
    if stage > 0 and optimizer is not None and not is_sharded(optimizer):
        raise ValueError(f"UnisonStrategy(zero_stage={stage}): the model's optimizer {type(optimizer).__name__} "
                         "was created outside `with strategy.scope():`, so it is not sharded. Create the "
                         "optimizer (or compile with its name) inside the scope")
