"""ZeRO stages 1 and 2 for PyTorch: ``hvd.DistributedOptimizer(opt, ..., zero_stage=1|2)``.

The layout is the core's :class:`~unison.common.zero.ShardPlan` ([Note: ZeRO buckets]): the
parameters that train are moved into one flat buffer per bucket (each ``param.data`` becomes a
view of it, so the model is unchanged for its user), and rank r owns segment r of every bucket.
The user's optimizer class is instantiated again over the *segments* only, one flat tensor per
bucket, so its state (Adam's two moments: 8 of the 16 bytes per parameter) exists for 1/N of
the model on each rank::

    backward ──► bucket full ──► reduce-scatter (average) ──► segment gradient
                                                                  │ inner optimizer steps
    model params (views) ◄── all-gather of the updated segments ◄─┘ the segment only

Stage 1 keeps full gradients: they accumulate locally (as views of one flat gradient buffer per
bucket) for ``backward_passes_per_step`` passes and each bucket is reduce-scattered when its
last pass completes. Stage 2 keeps none: a parameter's gradient is copied into its bucket's
staging buffer and freed the moment autograd has produced it; a bucket is reduce-scattered
(every pass, into the segment's gradient, which accumulates) as soon as it is complete, and its
staging buffer is freed after the reduction. Communication equals plain all-reduce (a
reduce-scatter plus an all-gather) in both stages.

Half-precision parameters (float16, bfloat16) get fp32 master copies of their segments: the
optimizer steps those and the result is cast back into the model. After ``step()`` every rank
holds the same full weights; the model's ``.grad`` of stage 1 holds the *local* gradient (stage 2:
a zero placeholder, [Note: unzeroed gradients]), so clip with :meth:`clip_grad_norm_` (global norm
over every shard), not ``torch.nn.utils.clip_grad_norm_`` on the model.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from unison.common import runtime
from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.ops import Average, ReduceOp, Sum
from unison.common.zero import DEFAULT_BUCKET_BYTES, Bucket, ParamSpec, ShardPlan
from unison.torch_backend.embedding import follow_backward_passes, synchronize_embeddings
from unison.torch_backend.grad_hooks import weak_grad_hooks
from unison.torch_backend.tensors import from_numpy, to_numpy
from unison.torch_backend.zero_state import ZeroStateMixin, agree_on_stage, check_optimizer

__all__ = ["make_zero_optimizer"]

_HALF = (torch.float16, torch.bfloat16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class _BucketState:
    """One bucket on this rank: the flat weights, its segment, gradients and what is in flight."""

    __slots__ = ("bucket", "params", "flat", "segment", "master", "grad_flat", "staging", "fired",
                 "handle", "ctx", "gather", "gather_out", "pos", "grad_views", "fresh")

    def __init__(self, bucket: Bucket, params: list[torch.Tensor], flat: torch.Tensor, rank: int) -> None:
        self.bucket, self.params, self.flat = bucket, params, flat
        self.pos = {id(p): i for i, p in enumerate(params)}  # (list.index would compare tensors)
        self.grad_views: list[torch.Tensor] = []  # stage 1: each parameter's view of grad_flat
        lo, hi = bucket.segment(rank)
        self.segment = flat[lo:hi]
        self.master: torch.nn.Parameter | None = None
        self.grad_flat: torch.Tensor | None = None
        self.fresh = True  # stage 2: the next reduce-scatter result replaces master.grad (not added)
        self.staging: torch.Tensor | None = None
        self.fired: set[int] = set()
        self.handle: Any = None
        self.ctx: Any = None
        self.gather: Any = None
        self.gather_out: np.ndarray | None = None  # the weights' own memory, where the gather may land


class _ZeroOptimizer(ZeroStateMixin):
    """Mixed into a subclass of the user's optimizer class by :func:`make_zero_optimizer`."""

    _unison_distributed = True

    def __init__(self, param_groups: list[dict], named: list[tuple[str, torch.Tensor]], zero_stage: int,
                 compression: Any, backward_passes_per_step: int, op: ReduceOp,
                 gradient_predivide_factor: float, process_set: ProcessSet | None, plan: ShardPlan,
                 inner_cls: type) -> None:
        inner_cls.__init__(self, param_groups)  # the user's class: its hyper-parameters and checks
        self.state.clear()  # state some classes create eagerly (Adagrad's sums): the shards' own is in _inner
        self.zero_stage = zero_stage
        self._compression, self._op = compression, op
        self._prescale, self._postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
        self.backward_passes_per_step = self._passes = backward_passes_per_step
        follow_backward_passes(self)  # [Note: the passes of the optimizer that trains the table] in embedding.py
        self.op, self.gradient_predivide_factor = op, gradient_predivide_factor
        self.process_set = process_set if process_set is not None else global_process_set
        self._pset = process_set
        self._world, self._rank = self.process_set.size(), self.process_set.rank()
        self._names = {p: n for n, p in named}
        self._parameter_names = self._names
        self._base = frontend._auto_name("ZeroOptimizer", None, process_set)
        self.plan = plan
        self._buckets = self._flatten()
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._inner = self._make_inner(inner_cls)
        self._delay = {p: self._passes for p in self._bucket_of}
        self._rounds = {id(st): 0 for st in self._buckets}
        self._synchronized = False
        self._should_synchronize = True
        self._backward_pending = False  # a gradient arrived since the last synchronize(): zero_grad() refuses
        self._placeholders: dict[int, tuple[torch.Tensor, int]] = {}  # stage 2: see [Note: unzeroed gradients]
        self._hooks = weak_grad_hooks(self, self._bucket_of)  # removed with the optimizer
        self._pre_hooks = _weak_pre_hooks(self, list(self._bucket_of)) if zero_stage == 2 else []

    # ------------------------------------------------------------- layout
    def _flatten(self) -> list[_BucketState]:
        """Move every trained parameter into its bucket's flat buffer; ``param.data`` becomes a view."""
        by_name = {n: p for p, n in self._names.items()}
        states = []
        for b in self.plan.buckets:
            params = [by_name[piece.name] for piece in b.pieces]
            flat = torch.zeros(b.padded, dtype=params[0].dtype)
            with torch.no_grad():
                for piece, p in zip(b.pieces, params, strict=True):
                    view = flat[piece.offset:piece.offset + piece.length].view(p.shape)
                    view.copy_(p.detach())
                    p.data = view
            st = _BucketState(b, params, flat, self._rank)
            if self.zero_stage == 1:
                st.grad_flat = torch.zeros_like(flat)
                st.grad_views = [st.grad_flat[pc.offset:pc.offset + pc.length].view(p.shape)
                                 for pc, p in zip(b.pieces, params, strict=True)]
                for p, view in zip(params, st.grad_views, strict=True):
                    p.grad = view
            else:
                for p in params:
                    p.grad = None
            states.append(st)
        return states

    def _make_inner(self, inner_cls: type) -> torch.optim.Optimizer:
        """The user's optimizer class over this rank's segments (fp32 masters for half precision)."""
        groups = []
        for gid, group in enumerate(self.param_groups):
            shards = []
            for st in self._buckets:
                if st.bucket.group != gid:
                    continue
                if st.segment.dtype in _HALF:
                    st.master = torch.nn.Parameter(st.segment.detach().float())
                else:
                    st.master = torch.nn.Parameter(st.segment)  # shares the bucket's storage
                shards.append(st.master)
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": shards})
        return inner_cls([g for g in groups if g["params"]])

    # ------------------------------------------------------------- gradients
    def _on_grad(self, p: torch.Tensor) -> None:
        self._synchronized = False  # a backward pass after synchronize(): those gradients need reducing too
        self._backward_pending = True  # (every rank runs the backward pass: zero_grad() refuses on each)
        st = self._bucket_of[p]
        if self.zero_stage == 1:
            self._stage1_grad(p, st)
        else:
            self._stage2_grad(p, st)

    def _stage1_grad(self, p: torch.Tensor, st: _BucketState) -> None:
        view = st.grad_views[st.pos[id(p)]]
        if p.grad.data_ptr() != view.data_ptr():  # model.zero_grad() dropped the view: take it back
            with torch.no_grad():
                view.copy_(p.grad)
            p.grad = view
        self._delay[p] -= 1
        if st.handle is not None or self._delay[p] < 0:
            raise RuntimeError(
                f"the gradient of {self._names[p]!r} was computed more than backward_passes_per_step="
                f"{self._passes} times before optimizer.step(); increase backward_passes_per_step or call "
                "step() after every backward pass")
        if self._delay[p] == 0:
            st.fired.add(id(p))
            if len(st.fired) == len(st.params):
                self._submit(st, st.grad_flat)

    def _gather_views(self, st: _BucketState) -> None:
        """Stage 1, before a bucket that did not fire is reduced: every gradient into its view.

        [Note: stage 1's gradient views] After ``zero_grad(set_to_none=True)`` (the default) the
        views are not cleared (a memset of every gradient, each step) but left stale: the first
        backward pass copies each new gradient into its view (``_stage1_grad``), later passes
        accumulate into it in place. A parameter that got no gradient this step still holds the
        last step's in its view, so it is zeroed here, and one whose ``.grad`` is some other
        tensor (assigned by hand) is copied in.
        """
        with torch.no_grad():
            for p, view in zip(st.params, st.grad_views, strict=True):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                else:
                    continue
                p.grad = view

    def _stage2_grad(self, p: torch.Tensor, st: _BucketState) -> None:
        if id(p) in st.fired:  # a new backward pass began before this bucket completed: flush it
            self._flush(st)
        piece = st.bucket.pieces[st.pos[id(p)]]
        if st.staging is None:
            st.staging = torch.zeros(st.bucket.padded, dtype=st.flat.dtype)
        with torch.no_grad():
            st.staging[piece.offset:piece.offset + piece.length].copy_(p.grad.reshape(-1))
        p.grad = None  # freed now: the bucket's staging buffer holds it until the reduce-scatter
        st.fired.add(id(p))
        if len(st.fired) == len(st.params):
            self._flush(st)

    def _flush(self, st: _BucketState) -> None:
        """Stage 2: reduce-scatter whatever the bucket holds (missing gradients count as zeros).

        Every rank reduce-scatters each bucket exactly ``backward_passes_per_step`` times per step
        (``synchronize`` tops up with zeros), so ranks whose passes touched different parameters
        still issue the same collectives.
        """
        if self._rounds[id(st)] >= self._passes:
            raise RuntimeError(
                f"bucket {st.bucket.index} ({', '.join(p.name for p in st.bucket.pieces[:3])} ...) received "
                f"gradients in more than backward_passes_per_step={self._passes} backward passes before "
                "optimizer.step(); increase backward_passes_per_step or call step() after every backward pass")
        if st.handle is not None:
            self._finish(st)
        staging = st.staging if st.staging is not None else torch.zeros(st.bucket.padded, dtype=st.flat.dtype)
        st.staging = None
        self._rounds[id(st)] += 1
        self._submit(st, staging)

    def _submit(self, st: _BucketState, flat_grad: torch.Tensor) -> None:
        if flat_grad.dtype == torch.float16:
            # [Note: float16 gradients reduce in float32] A float16 sum overflows where the average does not
            # (two ranks' gradients of 40000 averaged to inf before 2026-12-05, and dividing each by N first
            # loses a small gradient's bits), so a bucket is reduce-scattered in float32, as ZeRO-3's: twice
            # the bytes; the segment then feeds the float32 master without a rounding. (Compression.fp16 still
            # sends float16, as asked.) bfloat16 has float32's range and goes as it is.
            flat_grad = flat_grad.float()
        wire, st.ctx = self._compression.compress(flat_grad)  # (a torch tensor, as Horovod's compressors take)
        st.handle = frontend.reducescatter_async(to_numpy(wire), self._op, f"{self._base}.rs{st.bucket.index}",
                                                 self._prescale, self._postscale, self._pset)
        st.fired = set()

    def _finish(self, st: _BucketState) -> None:
        """Wait for the bucket's reduce-scatter and put (stage 2: add) the result in the shard's gradient."""
        seg = self._compression.decompress(from_numpy(st.handle.wait()), st.ctx)
        st.handle = None
        # [Note: stage 1 keeps local gradients] The averaged segment is the shard's own gradient,
        # not written into grad_flat: the model's .grad keeps the local gradients, so a backward
        # pass without zero_grad() adds to them and the next reduction averages the sum, as stage 0
        # (and one process) accumulate. Before 2026-12-05 this rank's segment of grad_flat held the
        # average, and the next pass added local gradients to it (silently wrong numbers).
        if st.master.grad is None or self.zero_stage == 1 or st.fresh:
            st.master.grad = seg.to(st.master.dtype)
        else:
            st.master.grad.add_(seg.to(st.master.dtype))
        st.fresh = False

    def zero_working_bytes(self) -> int:
        """Bytes held now beyond ZeRO's formula (docs/zero.md): the fp32 gradients of half-precision
        weights' master segments (the formula counts gradients in the weights' dtype), and at stage 1
        the shards' averaged gradients between the reduction and ``step()``."""
        extra = 0
        for st in self._buckets:
            g = st.master.grad
            if g is not None and self.zero_stage == 1:  # (freed at step(): [Note: stage 1 keeps local gradients])
                extra += g.numel() * g.element_size()
            elif g is not None and g.dtype != st.flat.dtype:
                extra += g.numel() * (g.element_size() - st.flat.element_size())
        return extra

    # ------------------------------------------------------------- public
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once built: the parameters are sharded into buckets when the optimizer is made.

        Raises:
            ValueError: always after construction (the class's own ``__init__`` adds its groups).
        """
        if hasattr(self, "plan"):
            raise ValueError("a ZeRO DistributedOptimizer's parameters are fixed when it is built (they are "
                             "sharded into buckets over the ranks); a group added later would never be "
                             "trained. Build the plain optimizer over every parameter group first, then wrap it "
                             "again with DistributedOptimizer(..., zero_stage=...)")
        super().add_param_group(param_group)  # type: ignore[misc]

    def discard_gradients(self) -> None:
        """Forget the reduced gradients of a step that is not taken (``GradScaler`` skipped it): the next
        backward pass starts afresh, as after ``zero_grad()``, which ``model.zero_grad()`` cannot do for
        the shards' gradients."""
        for st in self._buckets:
            st.fresh = True
            st.master.grad = None
        self._synchronized = False
        self._backward_pending = False

    def _check_unsharded(self) -> None:
        """Raise when a parameter the optimizer holds has a gradient but is in no bucket (it did not
        require a gradient when the optimizer was built), instead of never training it."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p not in self._bucket_of:
                    name = self._names.get(p, f"of shape {tuple(p.shape)}")
                    raise ValueError(f"parameter {name!r} has a gradient but was frozen (requires_grad=False) "
                                     "when this ZeRO DistributedOptimizer was built, so it is in no shard and "
                                     "would never be trained. Build the optimizer again after unfreezing it")

    def synchronize(self) -> None:
        """Wait for every bucket's reduce-scatter; parameters without a gradient contribute zeros.

        Also pushes and waits for the rows of every ShardedEmbedding (their tables apply them)."""
        synchronize_embeddings()
        self._settle_placeholders()  # (no backward pass since step(): nothing else settled them)
        if self.zero_stage == 2:
            # a gradient assigned by hand (p.grad = g, from torch.autograd.grad say) fired no hook: taken as a
            # backward pass's own (before 2026-12-07 it was left unread and the step used zeros; an audit)
            for st in self._buckets:
                for p in st.params:
                    if p.grad is not None and id(p) not in st.fired:
                        self._stage2_grad(p, st)
        for st in self._buckets:
            if self.zero_stage == 1:
                if st.handle is None:
                    self._gather_views(st)
                    self._submit(st, st.grad_flat)
                continue
            if st.fired or st.staging is not None:
                self._flush(st)
            while self._rounds[id(st)] < self._passes:
                self._flush(st)
        for st in self._buckets:
            if st.handle is not None:
                self._finish(st)
        self._delay = {p: self._passes for p in self._bucket_of}
        self._rounds = {id(st): 0 for st in self._buckets}
        self._synchronized = True
        self._backward_pending = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """As on the plain DistributedOptimizer: ``step()`` inside does not synchronize."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self.backward_passes_per_step = self._passes = passes
        self._delay = {p: passes for p in self._bucket_of}
        follow_backward_passes(self)  # (registered when made: the count is read from self)

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("a ZeRO DistributedOptimizer does not take a closure: every rank steps only its "
                             "shard, so the closure's loss could not be re-evaluated. Call loss.backward() "
                             "before step()")
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
        elif not self._synchronized:
            raise RuntimeError("optimizer.step() inside skip_synchronize() needs optimizer.synchronize() "
                               "first; the gradients have not been reduced yet")
        self._check_unsharded()
        self._sync_hyperparameters()
        self._step_and_gather()
        for st in self._buckets:
            if self.zero_stage == 1:
                st.master.grad = None  # stepped: [Note: stage 1 keeps local gradients]
            st.fresh = True  # stage 2: replaced next unless not zeroed ([Note: unzeroed gradients])
        if self.zero_stage == 2:
            self._place_placeholders()
        self._synchronized = False
        return None

    def _place_placeholders(self) -> None:
        """Stage 2, after ``step()``: every parameter's ``.grad`` becomes a zero placeholder.

        [Note: unzeroed gradients] Stage 2 frees each full gradient, so ``model.zero_grad()`` had
        nothing to clear and a loop without any zero_grad() looked the same: the next step's
        reduction replaced the shard's gradient, where torch (and stages 0 and 1) add the new
        gradients to the old (before 2026-12-05: silently wrong numbers without zero_grad()). A
        stride-0 zero tensor (one element of memory) as ``.grad`` tells them apart: either
        zero_grad() sets it to None, or zeroes it in place (its version counter moves). At the
        next backward pass (a tensor pre-hook, before autograd adds into it) or ``synchronize()``,
        placeholders all left untouched mean the shards' gradients accumulate; all cleared, that
        they are replaced. Every rank runs the same zero_grad() calls, so every rank decides alike.
        """
        self._placeholders = {}
        for p in self._bucket_of:
            grad = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
            p.grad = grad
            self._placeholders[id(p)] = (grad, grad._version)

    def _before_grad(self) -> None:
        """Stage 2 tensor pre-hook: settle the placeholders before autograd adds into one."""
        self._settle_placeholders()

    def _settle_placeholders(self) -> None:
        """Drop the placeholders; none cleared since ``step()``: the shards' gradients accumulate.

        Raises:
            RuntimeError: some placeholders were cleared and others not (on every rank alike).
        """
        if not self._placeholders:
            return
        kept, cleared = [], []
        for p in self._bucket_of:
            grad, version = self._placeholders[id(p)]
            g = p.grad
            untouched = g is not None and g.data_ptr() == grad.data_ptr() and g._version == version
            (kept if untouched else cleared).append(p)
            if g is not None and g.data_ptr() == grad.data_ptr():
                p.grad = None
        self._placeholders = {}
        if kept and cleared:
            raise RuntimeError(
                f"the gradient of {self._names[cleared[0]]!r} was zeroed since the last step() but not that of "
                f"{self._names[kept[0]]!r}; a zero_stage=2 shard holds the reduced gradients of several "
                "parameters together, so zero them all (optimizer.zero_grad() or model.zero_grad()) or none")
        if kept:
            for st in self._buckets:
                st.fresh = False  # no zero_grad(): the next reductions add to the last step's gradients

    def _sync_hyperparameters(self) -> None:
        """Schedulers change ``self.param_groups``; the inner optimizer's groups follow them."""
        inner_groups = iter(self._inner.param_groups)
        for gid, group in enumerate(self.param_groups):
            if not any(st.bucket.group == gid for st in self._buckets):
                continue
            target = next(inner_groups)
            for k, v in group.items():
                if k != "params":
                    target[k] = v

    def _step_and_gather(self) -> None:
        """Step the segments bucket by bucket, all-gathering each as soon as it is updated.

        The engine thread all-gathers bucket i while this thread steps bucket i + 1, so most of the
        all-gather hides behind the optimizer's arithmetic; at most three gathered buckets are held.
        Stepping one bucket at a time is the same update: a torch optimizer's state is per
        parameter (here, per segment), and each bucket is stepped with its own group's settings.
        """
        groups = self._inner.param_groups
        group_of = {id(p): g for g in groups for p in g["params"]}
        window: list[_BucketState] = []
        try:
            for st in self._buckets:
                half = st.master.data_ptr() != st.segment.data_ptr()  # an fp32 master of half weights
                if half and not torch.equal(st.segment, st.master.detach().to(st.segment.dtype)):
                    with torch.no_grad():  # the weights were set from outside since the last step
                        st.master.copy_(st.segment)  # (load_state_dict, load_sharded, a broadcast): they win
                self._inner.param_groups = [{**group_of[id(st.master)], "params": [st.master]}]
                self._inner.step()
                with torch.no_grad():
                    if half:
                        st.segment.copy_(st.master.detach())
                # gathered into the weights where they lie ([Note: out= beyond the all-reduce] in
                # common/engine/executor.py): no array of the bucket's size per step, no copy back
                st.gather_out = to_numpy(st.flat) if st.flat.is_contiguous() else None
                st.gather = frontend.allgather_async(to_numpy(st.segment), f"{self._base}.ag{st.bucket.index}",
                                                     self._pset, out=st.gather_out)
                window.append(st)
                if len(window) > 2:
                    self._land(window.pop(0))
        finally:
            self._inner.param_groups = groups
        for st in window:
            self._land(st)

    def _land(self, st: _BucketState) -> None:
        result, out = st.gather.wait(), st.gather_out
        st.gather = st.gather_out = None
        if out is not None and result is out:  # written in place, through numpy: bump the weights' version
            torch.autograd.graph.increment_version(st.flat)  # as the copies below do (a saved graph raises)
            return
        full = from_numpy(result).view(-1)
        lo, hi = st.bucket.segment(self._rank)  # this rank's own segment is in place already
        with torch.no_grad():
            st.flat[:lo].copy_(full[:lo])
            st.flat[hi:].copy_(full[hi:])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (the model's and the shards').

        Raises:
            RuntimeError: between ``loss.backward()`` and ``step()``/``synchronize()``, on every rank
                (before 2026-12-05 only where a bucket's reduction had started: a rank on which a
                parameter was unused dropped its gradients and went on).
        """
        if self._backward_pending or any(st.handle is not None for st in self._buckets):
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the gradients are still being "
                               "reduced. Call step() (or synchronize()) first")
        for st in self._buckets:
            if st.grad_flat is not None and set_to_none:  # see [Note: stage 1's gradient views]
                for p in st.params:
                    p.grad = None
            elif st.grad_flat is not None:
                st.grad_flat.zero_()
                for p, view in zip(st.params, st.grad_views, strict=True):
                    p.grad = view
            else:
                st.staging = None
                for p in st.params:
                    p.grad = None
            st.fired = set()
            st.fresh = True
            if st.master is not None:
                st.master.grad = None
        self._placeholders = {}
        self._delay = {p: self._passes for p in self._bucket_of}
        self._rounds = {id(st): 0 for st in self._buckets}
        self._synchronized = False


def _weak_pre_hooks(owner: _ZeroOptimizer, params: list[torch.Tensor]) -> list[Any]:
    """Stage 2: a tensor hook on each parameter (before autograd accumulates its gradient) that calls
    ``owner._before_grad()`` while ``owner`` lives, held weakly as ``weak_grad_hooks`` holds its hooks."""
    this = weakref.ref(owner)

    def hook_of(p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        node = p.view_as(p).grad_fn.next_functions[0][0]  # p's AccumulateGrad (kept alive by the hook)

        def hook(grad: torch.Tensor) -> None:
            target = this()
            if target is not None and _accumulates(node):
                target._before_grad()  # noqa: SLF001
        return hook

    hooks = [p.register_hook(hook_of(p)) for p in params]
    weakref.finalize(owner, _remove_hooks, hooks)
    return hooks


def _accumulates(node: Any) -> bool:
    """Whether the running backward pass will add into the ``.grad`` of the parameter whose
    AccumulateGrad ``node`` this is: ``loss.backward()`` does, ``torch.autograd.grad(...)`` does not
    (its gradients are returned). A tensor hook runs for both; before 2026-12-05 an
    ``autograd.grad`` between ``step()`` and ``zero_grad()`` settled the placeholders as "not
    zeroed" ([Note: unzeroed gradients]), and the next step added the old gradients, silently."""
    check = getattr(torch._C, "_will_engine_execute_node", None)
    if check is None:  # (an older torch: every hook counts, as before)
        return True
    try:
        return bool(check(node))
    except RuntimeError:  # "... currently running autograd.grad()": nothing lands in .grad
        return False


def _remove_hooks(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()


def _specs(optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]]) -> list[ParamSpec]:
    """The trained parameters (``requires_grad``), each once, with their group."""
    names = {id(p): n for n, p in named}
    specs, seen = [], set()
    for gid, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if p.is_sparse:
                raise ValueError(f"parameter {names[id(p)]!r} is sparse; ZeRO shards dense parameters only")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                specs.append(ParamSpec(names[id(p)], tuple(p.shape), _dtype_name(p.dtype), gid))
    if not specs:
        raise ValueError("the optimizer has no parameter that requires a gradient; nothing to shard")
    return specs


def make_zero_optimizer(optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]],
                        zero_stage: int, compression: Any = Compression.none,
                        backward_passes_per_step: int = 1, op: ReduceOp = Average,
                        gradient_predivide_factor: float = 1.0, process_set: ProcessSet | None = None,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES, options: str = "") -> torch.optim.Optimizer:
    """Build the stage 1/2 optimizer (called by ``DistributedOptimizer(..., zero_stage=1|2)``);
    ``options`` (the wrapper's settings as text) are agreed with the plan.

    Raises:
        ValueError: an optimizer whose update is not elementwise, an op other than Average/Sum,
            sparse parameters, or ranks that disagree on the stage or the model.
    """
    if process_set is not None and not process_set.included():
        raise ValueError(f"this rank ({runtime.rank()}) is not a member of {process_set!r}; a ZeRO optimizer "
                         "shards over the ranks of its process set, so only members may build it")
    try:
        check_optimizer(optimizer)
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"zero_bucket_bytes={bucket_bytes!r} must be a positive number of bytes")
        if op not in (Average, Sum):
            raise ValueError(f"zero_stage={zero_stage} reduces gradients with op=Average or op=Sum; got op={op!r}")
        set_ = process_set if process_set is not None else global_process_set
        plan = ShardPlan.build(_specs(optimizer, named), set_.size(), bucket_bytes)
    except (ValueError, TypeError, NotImplementedError) as exc:  # raised on every member ([Note: a refusal on
        agree_on_stage(zero_stage, None, process_set, refusal=exc)  # one rank] in optimizer.py)
        raise
    agree_on_stage(zero_stage, plan.signature() + (f"; {options}" if options else ""), process_set)  # before
    # anything changes (the options too: ranks with different backward_passes_per_step reduce-scattered on
    # different passes, before 2026-12-05)
    cls = type(optimizer.__class__.__name__, (_ZeroOptimizer, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, named, zero_stage, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, process_set, plan, optimizer.__class__)
    if optimizer.state:
        wrapped.load_state_dict(optimizer.state_dict())
    return wrapped

