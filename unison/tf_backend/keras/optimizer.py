"""Horovod-style Keras ``DistributedOptimizer`` for Keras 3 optimizers, with plain ``model.fit``.

The wrapped optimizer is an instance of a subclass of the original optimizer's
class (same config), whose ``apply`` first averages the step's gradients over
the ranks in one grouped call (see :func:`unison.tf_backend.functions.reduce_gradients`),
then applies them. A gradient that is None on some ranks but not on others is
reduced with zeros from the ranks without one; one that is None on every rank
stays None (Keras then skips its variable), as in one process. No strategy is
involved: each rank feeds its own shard of data, as in a Horovod Keras script.

Variables registered with ``register_local_var`` (or the ``local_layers`` of
:func:`PartialDistributedOptimizer`) keep this rank's gradient, divided by the
process set's size when ``scale_local_gradients`` (Horovod 0.28's behaviour).

[Note: backward_passes_per_step]
``backward_passes_per_step=k`` uses Keras's own gradient accumulation, which
applies the MEAN of the k accumulated gradients. Horovod applies their SUM unless
``average_aggregated_gradients=True``; so without it the gradients are scaled by
k after the reduction, and the applied update is Horovod's.
"""

from __future__ import annotations

import functools
from typing import Any

import keras

from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.ops import Average, Sum, parse_op
from unison.keras.optimizer import agree_at_build, rebuilt, run_deferred_agreement
from unison.tf_backend.functions import check_groups, local_layer_variables, reduce_partial, source_key
from unison.tf_backend.op_base import call_name

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]


def DistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,  # noqa: N802
                         device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: Any = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
                         process_set: Any = None,
                         scale_local_gradients: bool = True, zero_stage: int = 0) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so gradients are averaged across ranks before each update.

    Horovod 0.28's signature (``horovod.tensorflow.keras.DistributedOptimizer``).

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` (not already wrapped).
        name: base of the engine names of the reductions.
        device_dense, device_sparse: accepted for Horovod's signature and ignored (CPU tensors).
        compression: ``Compression.none`` / ``.fp16`` for the wire.
        sparse_as_dense: reduce ``IndexedSlices`` densely instead of by all-gather.
        gradient_predivide_factor: divide before the sum, the rest after (Average only).
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: gradients of this many steps are accumulated (with
            Keras's own ``gradient_accumulation_steps``) before the variables change.
        average_aggregated_gradients: apply the mean of the accumulated gradients
            instead of their sum (see [Note: backward_passes_per_step]).
        num_groups, groups: Horovod's fusion groups: validated; the numbers do not depend on them
            (every gradient of a step is reduced in one grouped call).
        process_set: the ranks that average together.
        scale_local_gradients: divide the gradients of variables registered with
            ``register_local_var`` by the process set's size.
        zero_stage: 0 (default) plain data parallelism; 1 shards the optimizer state over
            the ranks, 2 also the gradients (see ``unison/tf_backend/zero.py``). Every rank
            must pass the same value: the ranks compare it when the optimizer is built.

    Raises:
        ValueError: already wrapped, an op other than Average or Sum (Horovod's error), a predivide
            factor with an op other than Average,
            ``backward_passes_per_step`` < 1, bad ``groups``, ``zero_stage`` outside 0-2, an
            optimizer ZeRO cannot shard, or an option ZeRO does not support.
    """
    from unison.common.engine.process_sets import global_process_set
    from unison.tf_backend import zero

    if getattr(optimizer, "_unison_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original once")
    if parse_op(op) not in (Average, Sum):
        # Horovod's check (since 2026-12-05; before, Adasum/Min/Max/Product were taken: with Adasum and
        # backward_passes_per_step > 1 the update was the sum of per-step Adasums, not Horovod's number)
        raise ValueError(f"op currently only supports Average and Sum; got op={op!r}. Pass op=hvd.Average "
                         "or op=hvd.Sum, as horovod.tensorflow.keras requires")
    zero_stage = zero.check_keras_stage(zero_stage)
    if zero_stage:
        check_groups(num_groups, groups)  # (validated as at stage 0: the shards' buckets ignore them)
        return _sharded(optimizer, zero_stage, name=name, compression=compression, op=op,
                        gradient_predivide_factor=gradient_predivide_factor,
                        backward_passes_per_step=backward_passes_per_step, process_set=process_set)
    rop = parse_op(op)
    if gradient_predivide_factor != 1.0 and rop != Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} only applies to op=Average")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    check_groups(num_groups, groups)
    # (the set's own counter: [Note: a counter per process set]; a subset's optimizer left the other ranks'
    # next one a number behind, its reductions under another name: a hang, before 2026-12-07)
    base = name or frontend._auto_name("keras.DistributedOptimizer", None, process_set)
    pre, post = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    # Keras's accumulation applies the mean of the k gradients; Horovod their sum unless averaging
    factor = 1.0 if average_aggregated_gradients else float(backward_passes_per_step)

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        # the variables give the zeros of a gradient that is None here but not on another rank
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        variables = trainable_variables or getattr(self, "_trainable_variables", None)
        reduced = reduce_partial(list(grads), variables, _local_vars(self), scale_local_gradients, rop,
                                 pre, post * factor, compression, sparse_as_dense, call_name(base), process_set,
                                 local_factor=factor)
        # a build check kept for later runs here, where an unbuilt optimizer's build (in super().apply)
        # runs its own: [Note: a build check left for later] in unison/keras/optimizer.py
        run_deferred_agreement(self)
        return super(cls, self).apply(reduced, trainable_variables)

    def register_local_var(self: Any, var: Any) -> None:
        """Keep ``var``'s gradient local: never reduced over the ranks (Horovod's ``register_local_var``)."""
        _local_vars(self).add(source_key(var))

    def build(self: Any, variables: Any) -> None:
        # every rank must wrap with the same zero_stage: they compare it here, over every rank, so only with
        # the global set (ZeRO takes no other): on a subset it waited for ranks that never build one (before
        # 2026-12-07 a model trained by some ranks only hung in its first step), as Horovod runs nothing here
        if not self.built and process_set in (None, global_process_set):
            agree_at_build(self, functools.partial(zero.agree, 0, "", f"{type(self).__name__}.build"))
        super(cls, self).build(variables)

    base_cls = optimizer.__class__
    cls = type(base_cls.__name__, (base_cls,),
               {"apply": apply, "build": build, "register_local_var": register_local_var,
                # saved under the optimizer's own class, so that the model loads without Unison (Horovod's
                # way) and hvd.load_model wraps it again (before 2026-12-07 saved as this module's class: every
                # checkpoint of the whole model failed to load, hvd.load_model too)
                "__module__": base_cls.__module__, "__qualname__": base_cls.__qualname__,
                "_unison_distributed": True, "_unison_process_set": process_set,
                # what the applied update is, in means of the accumulated steps (a ShardedEmbedding that
                # follows this optimizer pushes the same: tf_backend/embedding.py)
                "_unison_accumulation_factor": factor})
    _agree_on_loss_scale_skips()
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    return rebuilt(cls, optimizer, config)


def _agree_on_loss_scale_skips() -> None:
    """A ``LossScaleOptimizer`` around a ``DistributedOptimizer`` (``compile`` adds one under a
    ``mixed_float16`` policy) skips a step when every rank would (any rank's gradients overflowed).

    Its check looks at this rank's own gradients, before the all-reduce inside the inner optimizer's
    ``apply``: a rank whose batch overflowed skipped alone and halved its scale, and the others waited
    in an all-reduce it never joined (or, later, paired its steps with their next ones). The
    agreement is over every rank: an optimizer on a process set keeps Keras's own check (known).
    The hook is ``unison.keras``'s (one for both; that module's optimizers have their own class).
    """
    from unison.keras.optimizer import agree_on_loss_scale_skips
    from unison.tf_backend import zero_optimizer

    agree_on_loss_scale_skips(_takes, zero_optimizer._agreeing_loss_scale_class)


def _takes(inner: Any) -> bool:
    # the global process set is every rank, as None is (before 2026-12-05 it was taken for a subset: the
    # horovod.tensorflow-style wrapper passes it by default, so under mixed_float16 a rank that overflowed
    # skipped alone and the others waited for it)
    from unison.common.engine.process_sets import global_process_set

    return (getattr(inner, "_unison_distributed", False) and not getattr(inner, "_unison_keras_distributed", False)
            and getattr(inner, "_unison_process_set", None) in (None, global_process_set))


def _sharded(optimizer: Any, stage: int, **options: Any) -> keras.optimizers.Optimizer:
    """``optimizer`` sharded at ``stage`` over every rank, refusing the options ZeRO does not take.

    Raises:
        ValueError: an option other than its default (``name`` aside).
    """
    from unison.common.engine.process_sets import global_process_set
    from unison.tf_backend import zero_optimizer

    defaults = {"compression": Compression.none, "op": Average, "gradient_predivide_factor": 1.0,
                "backward_passes_per_step": 1}
    bad = {k: options[k] for k, v in defaults.items() if options[k] is not v and options[k] != v}
    if options["process_set"] not in (None, global_process_set):
        bad["process_set"] = options["process_set"]
    if bad:
        raise ValueError(f"DistributedOptimizer(zero_stage={stage}) does not support {bad} yet; leave them at "
                         "their defaults or use zero_stage=0")
    wrapped = zero_optimizer.make_sharded(optimizer, stage, Average, in_place=False)
    wrapped.__dict__["_unison_distributed"] = True
    # the LossScaleOptimizer compile adds under mixed_float16 skips when any rank overflowed (before
    # 2026-12-05 only stage 0 installed the agreement: a rank that overflowed alone skipped alone and
    # the others waited in the reduce-scatter)
    _agree_on_loss_scale_skips()
    return wrapped


def _local_vars(optimizer: Any) -> set[Any]:
    """The keys of ``optimizer``'s registered local variables (made on first use: ``from_config`` skips it)."""
    if "_unison_local_vars" not in optimizer.__dict__:
        optimizer._unison_local_vars = set()
    return optimizer._unison_local_vars


def PartialDistributedOptimizer(optimizer: keras.optimizers.Optimizer, name: str | None = None,  # noqa: N802
                                device_dense: str = "", device_sparse: str = "",
                                compression: Any = Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: Any = Average,
                                backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                                groups: Any = None, process_set: Any = None, local_layers: Any = None,
                                scale_local_gradients: bool = True) -> keras.optimizers.Optimizer:
    """A :func:`DistributedOptimizer` whose ``local_layers``' variables keep their local gradients.

    ``local_layers``: a Keras layer or a collection of them (None: a plain
    ``DistributedOptimizer``). Their trainable variables are registered with
    ``register_local_var``.

    Raises:
        ValueError: an entry of ``local_layers`` is not a Keras layer, or as ``DistributedOptimizer``.
    """
    local = local_layer_variables(local_layers)
    wrapped = DistributedOptimizer(optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
                                   compression=compression, sparse_as_dense=sparse_as_dense,
                                   gradient_predivide_factor=gradient_predivide_factor, op=op,
                                   backward_passes_per_step=backward_passes_per_step,
                                   average_aggregated_gradients=average_aggregated_gradients, groups=groups,
                                   process_set=process_set, scale_local_gradients=scale_local_gradients)
    for var in local:
        wrapped.register_local_var(var)
    return wrapped
