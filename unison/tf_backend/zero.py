"""ZeRO stages 1 and 2 for Keras 3 optimizers: each rank keeps and steps only its shard.

Both ``UnisonStrategy(zero_stage=...)`` and the Keras ``DistributedOptimizer(..., zero_stage=...)``
end here. The optimizer is turned into a *sharded* optimizer (:func:`sharded_class`): a subclass of
its own class whose ``build`` lays the model's trainable variables out with the framework-neutral
:class:`~unison.common.zero.plan.ShardPlan` (see [Note: ZeRO buckets]) and builds the user's
optimizer on flat 1-D *shard variables* (this rank's segment of each bucket) instead of on the
model's variables. Keras creates slots per variable it is built on, so Adam's moments, SGD's momentum,
gradient accumulators... exist for this rank's segments only: on the other ranks the memory is
never allocated.

[Note: a sharded Keras step]
One ``apply(grads, model_variables)``::

    grads (full, from the tape) --flatten per bucket--> | w3 | w2 | b2 |pad|
        stage 1: all-reduce the bucket, keep segment r     (a full reduced bucket exists a moment)
        stage 2: reduce-scatter the bucket -> segment r     (only the segment comes back)
    segment r of the bucket --------------------------> gradient of that bucket's shard variable
    model variables' owned runs -----------------------> shard variables (refreshed every step)
    optimizer.apply(shard gradients, shard variables)     Keras's own update: lr schedules,
                                                          clipvalue, accumulation, iterations
    shard variable --all-gather--> bucket --split--> model variables (then constraints)

There is one shard variable per bucket (see [Note: one shard variable per bucket]).

The shard variable is a working copy of this rank's segments, refreshed from the model's
variables at the start of every step (so ``set_weights``/``load_weights`` between steps are
honoured); it is not optimizer state and not in ``optimizer.variables``. The model's variables
stay full on every rank after the all-gather: ``model.save``, ``predict`` and ``evaluate`` see
ordinary weights.

What TensorFlow allows for stage 2: the tape returns every gradient of the step as a full tensor
(one cannot make it write into a shard), so the full gradients exist transiently in both stages.
Stage 2 never materialises more than that: each bucket's flat copy is handed to a reduce-scatter
as soon as its gradients exist (the submit runs independently of the step's other stateful ops)
and only the 1/N segment comes back; stage 1 gets the whole reduced bucket back and slices it.
TensorFlow frees a gradient once its bucket's flat copy has been made (its last consumer).

Gradients arrive averaged over the ranks: under ``UnisonStrategy`` Keras has already divided the
loss by the replica count, so the reduction is a sum; under the Keras ``DistributedOptimizer``
each rank's gradient is its local mean, so the reduction is an average.

Only *elementwise* optimizers give the same numbers on a flat slice as on whole tensors (SGD,
Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Adadelta, Ftrl, Lion); others (Adafactor's
factored moments, Lamb's per-variable trust ratio, Muon's matrix update, ``clipnorm``'s
per-variable norm, EMA of the weights) raise a ``ValueError`` that names them;
``global_clipnorm`` sums the shards' squared norms over the ranks. Keras weight decay
(``weight_decay=``, AdamW) is applied by this module with a per-element mask, so
``exclude_from_weight_decay`` by variable or by name still works.

Saving: a sharded optimizer writes *no* variables into ``.keras`` / ``.weights.h5`` files (a
rank's shard of Adam's moments would be garbage anywhere else); the file holds the full weights
and the optimizer's config under its plain class name, so it loads in a plain Keras process,
whose optimizer then starts fresh (Keras warns that it skipped the optimizer's variables).
Loading a file into a sharded optimizer likewise leaves its state alone. The optimizer state is
saved and resumed, on any rank count, by ``save_sharded`` / ``load_sharded`` (``zero_checkpoint.py``);
``tf.train.Checkpoint`` of a sharded optimizer raises on every rank (see [Note: no
tf.train.Checkpoint of a sharded optimizer] in ``zero_optimizer.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from unison.common import runtime
from unison.common.engine import frontend
from unison.common.ops import Average, Sum
from unison.common.zero.plan import ParamSpec, Piece, ShardPlan, check_stage
from unison.tf_backend.strategy import _enqueue, _host_collective, _op_name, grouped_max

__all__: list[str] = []

log = logging.getLogger(__name__)

KERAS_STAGES = (0, 1, 2)
BUCKET_BYTES: int | None = None  # the plan's bucket cap; None: its default (tests set it small)
_names = itertools.count()
_agreements = itertools.count()  # every rank reaches its agreements in the same order


def check_keras_stage(zero_stage: object) -> int:
    """``zero_stage`` as an int in 0-2, or a ``ValueError`` that says stage 3 is torch-only."""
    if isinstance(zero_stage, (int, np.integer)) and not isinstance(zero_stage, bool) and int(zero_stage) == 3:
        raise ValueError("zero_stage=3 (sharded weights) is PyTorch-only (unison.torch_backend.shard_module); "
                         "Keras/TensorFlow supports zero_stage 0, 1 or 2")
    return check_stage(zero_stage, KERAS_STAGES)


# -------------------------------------------------------------------- agreement across ranks
def agree(stage: int, signature: str, what: str, layout: str = "", names: Sequence[str] = ()) -> None:
    """Raise on every rank unless every rank has the same ``stage`` and plan ``signature``.

    A blocking all-gather of one fixed-size record; every rank must reach it (at strategy
    construction, or at optimizer build).

    ``layout`` (:meth:`ShardPlan.layout_signature`) and ``names`` (this rank's variable names)
    make the message say so when the plans differ in the variables' names only.

    Raises:
        ValueError: the ranks disagree; the message lists every rank's values.
    """
    if runtime.size() == 1:
        return
    record = np.zeros(40, np.uint8)
    text = f"{stage}:{signature}:{layout}".encode()[:40]
    record[:len(text)] = np.frombuffer(text, np.uint8)
    name = f"unison.zero.agree.{next(_agreements)}"
    everyone = np.asarray(frontend.allgather(record, name=name)).reshape(-1, 40)
    seen = [bytes(r).rstrip(b"\0").decode() for r in everyone]
    if any(s != seen[0] for s in seen) and layout and all(s.split(":")[0] == seen[0].split(":")[0] and
                                                          s.split(":")[2] == layout for s in seen):
        shown = ", ".join(repr(n) for n in list(names)[:6]) + (", ..." if len(names) > 6 else "")
        raise ValueError(f"{what}: the ranks' models have the same variable shapes and dtypes but different "
                         f"variable names (this rank's: {shown}). The sharded optimizer's collectives and "
                         "checkpoints are keyed by name: Keras numbers unnamed layers per process, so create the "
                         "same layers in the same order on every rank (or give them names)")
    if any(s != seen[0] for s in seen):
        def stage_of(s: str) -> str:
            return "invalid" if s.split(":")[0] == "-1" else s.split(":")[0]

        listing = ", ".join(f"rank {i}: stage {stage_of(s)} plan {s.split(':')[1] or '-'}"
                            for i, s in enumerate(seen))
        raise ValueError(f"{what}: every rank must use the same zero_stage and the same model variables "
                         f"(ShardPlan signature); got {listing}. Pass the same zero_stage on every rank "
                         "and build the same model everywhere")


# -------------------------------------------------------------------- host collectives
def _submit_reduce(name: str, op: Any, a: np.ndarray, scatter: bool) -> np.int64:
    """Hand one flat bucket to the engine: a reduce-scatter (stage 2) or an all-reduce (stage 1)."""
    a = np.ascontiguousarray(a)
    if scatter:
        handle = frontend.reducescatter_async(a, op=op, name=name)
        return _enqueue(handle, [(a.dtype, (a.shape[0] // runtime.size(),))])
    return _enqueue(frontend.allreduce_async(a, op=op, name=name), [(a.dtype, a.shape)])


def _submit_allgather(name: str, a: np.ndarray) -> np.int64:
    a = np.ascontiguousarray(a)
    return _enqueue(frontend.allgather_async(a, name), [(a.dtype, (a.shape[0] * runtime.size(),))])


# -------------------------------------------------------------------- the layout
def one_key_per_bucket(plan: ShardPlan) -> ShardPlan:
    """``plan``'s buckets, each made its own (group, dtype) key: one shard variable per bucket.

    [Note: one shard variable per bucket]
    The plan's shard of a key is all its buckets' segments end to end. Built on that as one
    variable, Keras's update makes temporaries as large as the whole shard (Adam: several per
    step), and above glibc's largest mmap threshold (32 MiB) each is a fresh ``mmap`` that the
    step page-faults in and unmaps again: Adam on one 96 MB variable took 0.76 s a step here,
    0.32 s of it in the kernel, and 0.38 s on the same elements as three 32 MB variables. At
    2 ranks the 50M-parameter MLP of ``benchmarks/zero.py`` had a 100 MB shard and stage 1/2
    ran at 0.65x stage 0 (whose optimizer steps the model's own 16 MB variables). So each
    bucket's segment is a shard variable of its own: at most ``bucket_bytes / N``, or one
    parameter larger than the cap (alone in its bucket), which stage 0 updates whole as well.
    Giving each bucket its own key keeps the plan's vocabulary (``keys``, ``shard_numel``,
    ``owned``) meaning what ``zero_checkpoint.py`` reads. The buckets, and so the collectives
    and every rank's segments, are unchanged: re-keyed, a bucket's parameters fill its cap in
    the same order again. Each bucket's all-gather now also depends on its own update only.
    """
    specs = [dataclasses.replace(p, group=plan.bucket_of(p.name).index) for p in plan.params]
    keyed = ShardPlan.build(specs, plan.world, bucket_bytes=plan.bucket_bytes)
    if len(keyed.buckets) != len(plan.buckets):  # an internal invariant: never a user's doing
        raise AssertionError(f"re-keying the ZeRO plan made {len(keyed.buckets)} buckets of {len(plan.buckets)}")
    return keyed


class ShardLayout:
    """A model's trainable variables laid into a :class:`ShardPlan`, and this rank's shard variables.

    Args:
        variables: the model's trainable variables (Keras variables), in the order Keras passes them;
            those Keras overwrites with their gradient stay out of the plan (``overwritten``, see
            :meth:`overwrite`).
        stage: 1 or 2. op: ``Sum`` (gradients already divided by N) or ``Average``.
        make_variable: ``(shape, dtype, name) -> variable``; the caller decides where it lives.
        bucket_bytes: bucket cap of the plan.
        what: the call named in the error when the ranks' stages or plans differ.

    Raises:
        ValueError: on every rank, when some rank has another stage or plan (:func:`agree`).

    [Note: agree before naming]
    The ranks agree on the plan *before* this layout takes its collective-name tag (a per-process
    counter) and creates its shard variables (which a strategy broadcasts): a rank that raises here
    has then advanced no counter the others have not, so the next layout's collectives still carry
    the same names on every rank.
    """

    def __init__(self, variables: Sequence[Any], stage: int, op: Any, make_variable: Any,
                 bucket_bytes: int | None = None, what: str = "ShardLayout") -> None:
        self.built_on = list(variables)  # what apply(grads) without variables pairs grads with
        self.overwritten = [v for v in self.built_on if overwrites(v)]
        self.variables = [v for v in self.built_on if not overwrites(v)]
        self.stage, self.op = stage, op
        self.rank, self.world = runtime.rank(), runtime.size()
        self.names = [f"{i}:{_path(v)}" for i, v in enumerate(self.variables)]
        specs = [ParamSpec(n, tuple(int(d) for d in v.shape), tf.as_dtype(v.dtype).name)
                 for n, v in zip(self.names, self.variables, strict=True)]
        bucket_bytes = BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        kwargs = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        plan = ShardPlan.build(specs, self.world, **kwargs)
        agree(stage, plan.signature(), what, plan.layout_signature(),  # first: see [Note: agree before naming]
              [_path(v) for v in self.variables])
        self.tag = f"{next(_names)}.{plan.signature()}"
        self.plan = one_key_per_bucket(plan)  # see [Note: one shard variable per bucket]
        self.keys = self.plan.keys()  # keys[i] is buckets[i]'s: shards[i] is this rank's segment of it
        self.by_name = dict(zip(self.names, self.variables, strict=True))
        self.shards = [make_variable((self.plan.shard_numel(k),), k[1], f"zero_shard_{k[0]}_{k[1]}")
                       for k in self.keys]
        owned = self.plan.owned(self.rank)
        self.runs: list[list[Piece]] = [sorted((p for n in self.names for p in owned.get(n, [])
                                                if self._key(n) == k), key=lambda p: p.offset)
                                        for k in self.keys]

    def _key(self, name: str) -> tuple[int, str]:
        b = self.plan.bucket_of(name)
        return (b.group, b.dtype)

    def numel(self) -> int:
        """Elements of this rank's shard variables (padding included)."""
        return sum(self.plan.shard_numel(k) for k in self.keys)

    # ---------------------------------------------------------- gradients -> shard gradients
    def shard_gradients(self, grads: Sequence[Any]) -> list[tf.Tensor]:
        """This rank's reduced segment of every bucket: the gradient of each shard variable, in order.

        See [Note: a sharded Keras step].
        """
        by_name = dict(zip(self.names, grads, strict=True))
        flats = [self._flat_bucket(b, by_name) for b in self.plan.buckets]
        reduced = self._reduce(flats)
        if self.stage == 2 or self.world == 1:
            return reduced
        return [r[slice(*b.segment(self.rank))] for b, r in zip(self.plan.buckets, reduced, strict=True)]

    def _flat_bucket(self, bucket: Any, by_name: dict[str, Any]) -> tf.Tensor:
        dtype = tf.as_dtype(bucket.dtype)
        parts = [tf.reshape(tf.cast(tf.convert_to_tensor(by_name[p.name]), dtype), [-1]) for p in bucket.pieces]
        if bucket.padded > bucket.numel:
            parts.append(tf.zeros([bucket.padded - bucket.numel], dtype))
        return tf.concat(parts, 0) if len(parts) > 1 else parts[0]

    def _reduce(self, flats: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each bucket reduced over the ranks; float16 ones in float32, rounded once at the end (the torch
        adapter's [Note: float16 gradients reduce in float32]: a float16 sum of two gradients of 40000 made
        the average inf before 2026-12-05)."""
        if self.world == 1:
            return flats
        scatter = self.stage == 2
        base = _op_name(f"unison.zero{self.stage}.{self.tag}")
        wire = [tf.cast(f, tf.float32) if f.dtype == tf.float16 else f for f in flats]
        submits = [(lambda a, i=i: _submit_reduce(f"{base}.b{i}", self.op, a, scatter), [w])
                   for i, w in enumerate(wire)]
        outputs = [(w.dtype, [b.segment_size if scatter else b.padded])
                   for w, b in zip(wire, self.plan.buckets, strict=True)]
        reduced = _host_collective(submits, outputs)
        return [r if r.dtype == f.dtype else tf.cast(r, f.dtype) for r, f in zip(reduced, flats, strict=True)]

    # ---------------------------------------------------------- model variables <-> shard
    def load_shards(self) -> None:
        """Copy this rank's runs of the model's variables into the shard variables (padding zero)."""
        for key, shard, runs in zip(self.keys, self.shards, self.runs, strict=True):
            shard.assign(self._owned_values(key, runs))

    def _owned_values(self, key: tuple[int, str], runs: list[Piece]) -> tf.Tensor:
        dtype, parts, at = tf.as_dtype(key[1]), [], 0
        for p in runs:
            if p.offset > at:
                parts.append(tf.zeros([p.offset - at], dtype))
            flat = tf.reshape(_read(self.by_name[p.name]), [-1])
            parts.append(flat[p.param_offset:p.param_offset + p.length])
            at = p.offset + p.length
        total = self.plan.shard_numel(key)
        if total > at:
            parts.append(tf.zeros([total - at], dtype))
        return tf.concat(parts, 0) if len(parts) > 1 else parts[0]

    def store_shards(self) -> None:
        """All-gather every bucket's updated segments and write the model's variables (then constraints)."""
        full = self._gather()
        for b, flat in zip(self.plan.buckets, full, strict=True):
            for p in b.pieces:
                var = self.by_name[p.name]
                var.assign(tf.reshape(flat[p.offset:p.offset + p.length], var.shape))
        for var in self.variables:
            if getattr(var, "constraint", None) is not None:
                var.assign(var.constraint(var))

    def _gather(self) -> list[tf.Tensor]:
        segments = [_read(shard) for shard in self.shards]  # shards[i] is bucket i's segment
        if self.world == 1:
            return segments
        base = _op_name(f"unison.zero.gather.{self.tag}")
        submits = [(lambda a, i=i: _submit_allgather(f"{base}.b{i}", a), [s]) for i, s in enumerate(segments)]
        return _host_collective(submits, [(s.dtype, [b.padded]) for s, b in zip(segments, self.plan.buckets,
                                                                                 strict=True)])

    # ---------------------------------------------------------- overwritten variables
    def overwrite(self, optimizer: Any, grads: Sequence[Any], accumulators: Sequence[Any] | None) -> None:
        """Keras's treatment of the ``overwritten`` variables: each becomes its gradient, the maximum
        over the ranks (``grads[i]`` is ``overwritten[i]``'s, None: no rank has one, left alone).

        [Note: overwritten variables at ZeRO stages 1/2]
        float8 layers' ``*_scale`` and ``*_amax_history`` (``overwrite_with_gradient=True``) take
        their gradient as their new value, with no update, weight decay or clipping; Keras does it in
        ``apply`` (``_overwrite_variables_directly_with_gradients``). Laid into the flat shard they
        were stepped like weights (an Adam-stepped scale of 0.96 where one process had 0.0065, before
        2026-12-07), so they stay out of the plan and get that treatment here, with the gradient
        reduced by maximum (see [Note: float8 scales over the ranks] in ``strategy.py``). With
        ``gradient_accumulation_steps`` Keras keeps the running maximum in an accumulator
        (``accumulators``) and assigns it on the update step, as here.
        """
        present = [(g, i) for i, g in enumerate(grads) if g is not None]
        if not present:
            return
        reduced = grouped_max([g for g, _ in present], f"unison.zero.overwrite.{self.tag}")
        steps = optimizer.gradient_accumulation_steps
        for g, (_, i) in zip(reduced, present, strict=True):
            var = self.overwritten[i]
            g = tf.cast(g, var.dtype)
            if not steps:
                var.assign(g)
                continue
            acc = accumulators[i]
            update = tf.equal((optimizer._iterations + 1) % steps, 0)
            running = tf.maximum(g, _read(acc))
            var.assign(tf.where(update, running, _read(var)))
            acc.assign(tf.where(update, tf.zeros_like(g), running))

    # ---------------------------------------------------------- weight decay
    def decay_masks(self, uses_decay: Any) -> list[np.ndarray | None]:
        """Per key, 1.0 where the element's variable takes weight decay and 0.0 elsewhere (padding too);
        None where every element of the shard takes it."""
        masks: list[np.ndarray | None] = []
        for key, runs in zip(self.keys, self.runs, strict=True):
            mask = np.zeros(self.plan.shard_numel(key), np.dtype("float32"))
            for p in runs:
                if uses_decay(self.by_name[p.name]):
                    mask[p.offset:p.offset + p.length] = 1.0
            masks.append(None if mask.all() else mask)
        return masks


def reduce_op(op: Any) -> Any:
    """The engine op for gradients that are local means (``Average``) or already divided by N (``Sum``)."""
    return Sum if op is Sum else Average


def overwrites(var: Any) -> bool:
    """Whether Keras overwrites ``var`` with its gradient instead of stepping it (float8 scales)."""
    return bool(getattr(var, "overwrite_with_gradient", False))


def _read(var: Any) -> tf.Tensor:
    """A Keras or TensorFlow variable's value, without the autocast a Keras variable applies in a scope."""
    return tf.convert_to_tensor(getattr(var, "value", var))


def _path(var: Any) -> str:
    return str(getattr(var, "path", None) or getattr(var, "name", "variable"))
