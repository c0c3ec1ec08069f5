"""``DistributedOptimizer``: gradients all-reduced while backward still runs.

A hook on every parameter fires the moment autograd has accumulated its
gradient (``register_post_accumulate_grad_hook``) and submits that gradient to
the engine under the parameter's name, in place. Communication thus overlaps the
rest of the backward pass; ``step()`` waits for the reductions, then steps.
Ranks may produce gradients in any order: the engine negotiates by name.

The wrapped optimizer is an instance of a subclass of the original optimizer's
class built on the same parameter groups, so ``isinstance`` checks, schedulers
and ``state_dict()`` keep working. It carries Horovod's attributes too
(``_parameter_names``, ``backward_passes_per_step``, ``op``,
``gradient_predivide_factor``, ``sparse_as_dense``, ``process_set``,
``set_backward_passes_per_step()``).

``op=hvd.Adasum`` follows Horovod's Adasum optimizer: no gradient is reduced;
``step()`` applies the wrapped optimizer to the local gradients, then combines
every rank's parameter change with Adasum and applies the combination to the
parameters as they were before the step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from unison.collectives import adasum
from unison.common import runtime
from unison.common.compression import Compression
from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet, global_process_set, set_size
from unison.common.ops import Average, Max, ReduceOp, parse_op
from unison.common.zero import DEFAULT_BUCKET_BYTES, check_stage
from unison.torch_backend.embedding import follow_backward_passes
from unison.torch_backend.grad_hooks import weak_grad_hooks
from unison.torch_backend.handles import Adasum, is_adasum
from unison.torch_backend.mpi_ops import grouped_allreduce
from unison.torch_backend.tensors import from_numpy, to_numpy
from unison.torch_backend.zero import make_zero_optimizer
from unison.torch_backend.zero_state import agree_on_stage

__all__ = ["DistributedOptimizer"]


class _Pending:
    """One parameter's in-flight reduction and how to write its result back."""

    __slots__ = ("handle", "target", "ctx", "sparse", "resparse")

    def __init__(self, handle: Any, target: np.ndarray | None, ctx: Any = None, sparse: Any = None,
                 resparse: bool = False) -> None:
        self.handle, self.target, self.ctx, self.sparse = handle, target, ctx, sparse
        self.resparse = resparse  # a sparse gradient reduced dense (sparse_as_dense): sparse again after


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into a subclass of the user's optimizer class by :func:`DistributedOptimizer`."""

    _unison_distributed = True

    def __init__(self, params: Any, named_parameters: list[tuple[str, torch.Tensor]], compression: Any,
                 backward_passes_per_step: int, op: ReduceOp, gradient_predivide_factor: float,
                 groups: list[list[torch.Tensor]] | None, sparse_as_dense: bool,
                 process_set: ProcessSet | None) -> None:
        super(self.__class__, self).__init__(params)  # the user's optimizer class, same param groups
        self._compression = compression
        self._passes = backward_passes_per_step
        self._op = op
        self._prescale = 1.0 / gradient_predivide_factor
        self._postscale = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        self._process_set = process_set
        self._names = {p: name for name, p in named_parameters}
        self._params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        self._delay = {p: self._passes for p in self._params}
        self._pending: dict[torch.Tensor, _Pending] = {}
        self._group_of: dict[torch.Tensor, int] = {}
        self._groups = [list(g) for g in groups] if groups else []
        for gid, group in enumerate(self._groups):
            for p in group:
                self._group_of[p] = gid
        self._group_ready: dict[int, list[torch.Tensor]] = {}
        # each parameter's gradient kind once some rank has seen one: 1 dense, 2 + k sparse with k sparse
        # dimensions ([Note: a sparse gradient missing on some ranks])
        self._kinds: dict[torch.Tensor, int] = {}
        self._kinds_settled = False
        self._synchronized = False
        self._should_synchronize = True
        # Horovod's attributes, which user code reads
        self._parameter_names = self._names
        self.backward_passes_per_step = backward_passes_per_step
        follow_backward_passes(self)  # [Note: the passes of the optimizer that trains the table] in embedding.py
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set if process_set is not None else global_process_set
        self._adasum = op is Adasum
        if self._adasum and runtime.size() > 1:  # at construction, on every rank: a failing step() left each
            adasum.check_size(runtime.size())  # rank at its own local step (before 2026-12-05)
        # a rank outside the process set steps on its own gradients (Horovod's rule)
        self._reduces = runtime.size() > 1 and not self._adasum and (process_set is None or process_set.included())
        self._hooks = []
        if self._reduces:
            # the hooks hold the optimizer weakly and go with it (Horovod's hang on gradient
            # accumulators the optimizer owns): a dropped optimizer neither stays alive through its
            # parameters nor goes on reducing their gradients beside its successor's
            self._hooks = weak_grad_hooks(self, self._params)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Horovod's setter: accumulate ``passes`` backward passes locally per step from now on."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self.backward_passes_per_step = self._passes = passes
        self._delay = {p: passes for p in self._params}
        follow_backward_passes(self)  # (registered when made: the count is read from self)

    # ------------------------------------------------------------- hooks
    def _on_grad(self, p: torch.Tensor) -> None:
        # (a member waiting for its group is not pending yet, but its count is spent: before 2026-12-07 its
        # extra pass counted it twice in the group, which then raised DuplicateNameError on its own name)
        if p in self._pending or self._delay[p] <= 0:
            raise RuntimeError(
                f"the gradient of {self._names[p]!r} was computed more than backward_passes_per_step="
                f"{self._passes} times before optimizer.step(); increase backward_passes_per_step to "
                "accumulate gradients locally, or call step() after every backward pass")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        gid = self._group_of.get(p)
        if gid is None:
            self._pending[p] = self._submit(p)
            return
        ready = self._group_ready.setdefault(gid, [])
        ready.append(p)
        if len(ready) == len(self._groups[gid]):  # the whole group at once, so it fuses
            for q in ready:
                self._pending[q] = self._submit(q)
            del self._group_ready[gid]

    def _submit(self, p: torch.Tensor) -> _Pending:
        name = self._names[p]
        if p.grad is None:
            p.grad = self._missing_gradient(p)
        elif not self._kinds_settled:
            self._note_kind(p)
        grad = p.grad
        resparse = grad.is_sparse
        kind = self._kinds.get(p, 1)
        if resparse:
            if not self._sparse_as_dense and kind != 1:
                return self._submit_sparse(p, name)
            grad = p.grad = grad.to_dense()  # (agreed dense: see [Note: a sparse gradient missing on some ranks])
        elif kind != 1 and not self._sparse_as_dense:  # dense here, agreed sparse: gathered as the others are
            p.grad = grad.to_sparse(kind - 2)
            return self._submit_sparse(p, name)
        # the compressor gets the torch gradient, as Horovod's does (before 2026-12-07 a numpy view: a compressor
        # written for Horovod, tensor.type(torch.float16), failed in backward(), and Compression.fp16 sent
        # bfloat16 gradients uncompressed where hvd.allreduce(compression=...) cast them)
        wire, ctx = self._compression.compress(grad)
        arr = to_numpy(wire)
        in_place = wire is grad and grad.is_contiguous() and not grad.is_neg()
        handle = frontend.allreduce_async(arr, self._op, name, self._prescale, self._postscale,
                                          self._process_set, out=arr if in_place else None)
        return _Pending(handle, None if in_place else arr, ctx, resparse=resparse)

    # [Note: a sparse gradient missing on some ranks]
    # A rank whose step gave a parameter no gradient contributes zeros. For a dense gradient
    # that is a zero tensor reduced with the rest; a sparse one (nn.Embedding(sparse=True)) is
    # all-gathered under other names (indices and values), so zeros sent dense waited for ever
    # for the other ranks' all-reduce (a hang). A rank cannot tell the kind from a parameter
    # that has no gradient, so the first synchronize() all-reduces (Max) each rank's kinds (1
    # dense, 2 + k sparse with k sparse dimensions, 0 not seen) before it submits the missing
    # gradients; a rank then sends an empty sparse gradient (no rows) where the others send
    # sparse ones. That is the only agreement (a dense model pays one small all-reduce, in its
    # first step): a parameter no rank saw then is settled as dense, and a sparse gradient it
    # gets later, on any rank, is reduced dense and made sparse again (as sparse_as_dense does),
    # which every rank does alike without asking (a rank that had none keeps a dense zero
    # gradient then). With sparse_as_dense every gradient is reduced dense; the agreement only
    # tells a rank without one whether to make its result sparse again, as the others do.
    def _note_kind(self, p: torch.Tensor) -> None:
        g = p.grad
        self._kinds.setdefault(p, 2 + g.sparse_dim() if g is not None and g.is_sparse else 1)

    def _missing_gradient(self, p: torch.Tensor) -> torch.Tensor:
        kind = self._kinds.get(p, 1)
        if kind == 1:
            return torch.zeros_like(p)
        k = kind - 2
        return torch.sparse_coo_tensor(torch.zeros((k, 0), dtype=torch.int64),
                                       torch.zeros((0, *p.shape[k:]), dtype=p.dtype), p.shape)

    def _agree_on_kinds(self) -> None:
        """Every rank's gradient kinds, combined (see the Note); a parameter dense on one rank and
        sparse on another in the first step raises on every rank (their reductions already differ),
        unless sparse_as_dense reduces both densely."""
        self._kinds_settled = True
        for p in self._params:
            if p.grad is not None:
                self._note_kind(p)
        seen = np.array([self._kinds.get(p, 0) for p in self._params], np.int64)
        both = np.concatenate([seen, np.where(seen > 0, -seen, -(2**40))])  # max, and -(min of the seen)
        agreed = frontend.allreduce_async(both, Max, "DistributedOptimizer.gradient_kinds", 1.0, 1.0,
                                          self._process_set).wait()
        n = len(self._params)
        for p, most, least in zip(self._params, agreed[:n], -agreed[n:], strict=True):
            if most and least != most and not self._sparse_as_dense:
                raise ValueError(f"the gradient of {self._names[p]!r} is dense on some ranks and sparse on others "
                                 f"(or sparse with different sparse dimensions): every rank must compute it the "
                                 f"same way (the same module with the same sparse= flag)")
            self._kinds[p] = int(most) if most else 1

    def _submit_sparse(self, p: torch.Tensor, name: str) -> _Pending:
        if self._op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            # the ranks' rows are all-gathered and summed where they meet: Horovod does that for
            # every op, so a Min/Max/Product of sparse gradients is silently a sum there. Submitted with
            # the error in place of the rows, so every rank raises it (raised here, in this rank's backward
            # alone, the others waited in step() for ever: found by an audit, 2026-12-05)
            error = ValueError(f"DistributedOptimizer(op={self._op!r}) got a sparse gradient for {name!r}: sparse "
                               "gradients are all-gathered and their rows summed, which is a sum, not "
                               f"{self._op!r}. Pass sparse_as_dense=True to reduce them densely with that op, "
                               "or use op=Average/Sum")
            refused = tuple(frontend.allgather_async(frontend.Refused(error), f"{name}.{part}", self._process_set)
                            for part in ("indices", "values"))
            return _Pending(refused, None, sparse=p.grad.shape)
        g = p.grad.coalesce()
        indices = frontend.allgather_async(g.indices().t().contiguous().numpy(), f"{name}.indices",
                                           self._process_set)
        values = frontend.allgather_async(to_numpy(g.values()), f"{name}.values", self._process_set)
        return _Pending((indices, values), None, sparse=g.shape)

    def _finish(self, p: torch.Tensor, pend: _Pending) -> None:
        if pend.sparse is not None:
            idx, vals = (h.wait() for h in pend.handle)
            values = from_numpy(vals)
            if self._op == Average:
                values = values / set_size(self._process_set)
            p.grad = torch.sparse_coo_tensor(torch.from_numpy(idx).t(), values, pend.sparse).coalesce()
            return
        result = pend.handle.wait()
        if pend.target is not None:  # compressed or non-contiguous: copy back into the gradient
            with torch.no_grad():
                p.grad.copy_(self._compression.decompress(from_numpy(result), pend.ctx).view(p.grad.shape))
        if pend.resparse:  # as Horovod: an optimizer that takes only sparse gradients still gets one
            p.grad = p.grad.to_sparse()

    # ------------------------------------------------------------- public
    def synchronize(self) -> None:
        """Wait for every gradient's reduction; parameters without a gradient contribute zeros.

        Also waits for the pushes of every ShardedEmbedding (their tables apply them).
        """
        from unison.torch_backend.embedding import synchronize_embeddings

        synchronize_embeddings()
        if self._reduces:
            if not self._kinds_settled:
                self._agree_on_kinds()
            for p in self._params:
                if p not in self._pending:  # no gradient this step, or passes not yet complete
                    self._pending[p] = self._submit(p)
            for p, pend in self._pending.items():
                self._finish(p, pend)
        self._pending.clear()
        self._group_ready.clear()
        self._delay = {p: self._passes for p in self._params}
        self._synchronized = True

    def reset_pending(self) -> None:
        """Forget reductions in flight (elastic recovery: their engine is gone); the next backward
        pass starts afresh."""
        self._pending.clear()
        self._group_ready.clear()
        self._delay = {p: self._passes for p in self._params}
        self._synchronized = False

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize: call ``synchronize()`` yourself first.

        For gradient clipping::

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def _adasum_step(self, closure: Any) -> Any:
        """Horovod's Adasum optimizer: a local step, then the Adasum of every rank's parameter change."""
        starts = [p.detach().clone() for p in self._params]
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        loss = super(self.__class__, self).step(closure)
        if runtime.size() > 1 and self._params:
            with torch.no_grad():
                deltas = [p.detach() - s for p, s in zip(self._params, starts, strict=True)]
                combined = grouped_allreduce(deltas, op=Adasum, name="DistributedOptimizer.adasum")
                for p, s, d in zip(self._params, starts, combined, strict=True):
                    p.copy_(s + d)
        self._synchronized = False
        return loss

    def step(self, closure: Any = None) -> Any:
        if self._adasum:
            return self._adasum_step(closure)
        if closure is not None and self._should_synchronize and not self._pending:
            # the closure's backward starts the reductions: each evaluation is reduced before the
            # optimizer reads the gradients (step() reduced first and read them while the
            # closure's reductions were still writing them: the ranks drifted apart)
            def reduced() -> Any:
                loss = closure()
                self.synchronize()
                return loss

            try:
                return super(self.__class__, self).step(reduced)
            finally:
                self._synchronized = False
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without the "
                              "optimizer.skip_synchronize() context: the gradients are reduced twice. "
                              "Wrap step() in `with optimizer.skip_synchronize():`", stacklevel=2)
            self.synchronize()
        elif self._pending or not self._synchronized:
            raise RuntimeError("optimizer.step() inside skip_synchronize() needs optimizer.synchronize() "
                               "first; the gradients have not been reduced yet")
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        if self._pending or any(left != self._passes for left in self._delay.values()):
            raise RuntimeError("optimizer.zero_grad() was called after loss.backward() but before "
                               "optimizer.step() or optimizer.synchronize(): the gradients are still "
                               "being reduced (or accumulated over backward_passes_per_step="
                               f"{self._passes} passes, which zeroing would lose). Call step() (or "
                               "synchronize()) first")
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's, then a fresh start: reductions in flight are waited for and
        forgotten, and the next backward pass counts from one (as Horovod's)."""
        for pend in self._pending.values():
            for handle in pend.handle if isinstance(pend.handle, tuple) else (pend.handle,):
                with contextlib.suppress(Exception):
                    handle.wait()
        self.reset_pending()
        self._should_synchronize = True
        super(self.__class__, self).load_state_dict(state_dict)


def _check_combination(op: Any, compression: Any, backward_passes_per_step: int, num_groups: int,
                       groups: Any, process_set: ProcessSet | None) -> None:
    """Refuse option combinations that would be silently ignored (docs/horovod.md, "Options that combine").

    ``op=Adasum`` combines parameter changes after a local step (Horovod's Adasum optimizer):
    our version of it runs on the whole job, uncompressed, one backward pass per step.
    """
    if op is not Adasum:
        return
    given = []
    if compression is not Compression.none:
        given.append(f"compression={getattr(compression, '__name__', compression)!r}")
    if backward_passes_per_step != 1:
        given.append(f"backward_passes_per_step={backward_passes_per_step}")
    if num_groups or groups:
        given.append("num_groups/groups")
    if process_set is not None and process_set is not global_process_set and process_set.ranks is not None:
        given.append(f"process_set={process_set!r}")
    if given:
        raise ValueError(f"DistributedOptimizer(op=Adasum) does not combine with {', '.join(given)}: the "
                         "Adasum optimizer combines every rank's uncompressed parameter change after each "
                         "step. Drop those options, or use op=Average (docs/horovod.md lists which options "
                         "combine)")


def _check_zero(stage: int, op: Any, num_groups: int, groups: Any) -> None:
    """Refuse what a ZeRO stage cannot honour (docs/zero.md)."""
    if stage == 3:
        raise ValueError("zero_stage=3 shards the weights, which an optimizer cannot do alone: call "
                         "unison.torch_backend.shard_module(model) first and build a plain torch optimizer over "
                         "the sharded model's parameters (docs/zero.md)")
    if stage and op is Adasum:
        raise ValueError(f"zero_stage={stage} does not combine with op=Adasum (Adasum combines whole-model "
                         "parameter changes); use op=Average")
    if stage and (num_groups or groups):
        raise ValueError(f"zero_stage={stage} fuses gradients into its own buckets; drop num_groups/groups")


def _init_refuses_params_alone(cls: type) -> str | None:
    """Why ``cls(param_groups)`` cannot be called (an ``__init__`` with another required argument), or None."""
    import inspect

    try:
        inspect.signature(cls.__init__).bind(None, [])
    except TypeError as exc:
        return str(exc)
    except ValueError:  # no signature to read (a C-implemented __init__): let it try
        return None
    return None


def parameters_signature(named: list[tuple[str, torch.Tensor]]) -> str:
    """A short digest of the wrapped parameters' names, shapes and dtypes: ranks that wrapped
    different parameter sets would wait for each other's gradients for ever."""
    import hashlib

    text = repr(sorted((n, tuple(p.shape), str(p.dtype)) for n, p in named))
    return f"{len(named)} parameters, digest {hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _named(optimizer: torch.optim.Optimizer,
           named_parameters: Iterable[tuple[str, torch.Tensor]] | None) -> list[tuple[str, torch.Tensor]]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    seen: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in seen:  # (two hooks on one parameter: a misleading backward_passes_per_step error)
            raise ValueError(f"the optimizer lists one parameter twice (positions {seen[id(p)]} and {i} of its "
                             "parameter groups); list each parameter once (torch warns that it will refuse "
                             "duplicates)")
        seen[id(p)] = i
    if named_parameters is None:
        return _default_names(optimizer)
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters holds duplicate names {dups}; every parameter needs a unique "
                         "name (it is what ranks match gradients by)")
    known = {id(p) for _, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in known]
    if missing:
        raise ValueError(f"named_parameters does not cover {len(missing)} of the optimizer's {len(params)} "
                         f"parameters (positions {missing[:10]}); pass model.named_parameters() for the "
                         "model whose parameters the optimizer updates")
    return named


def _default_names(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Names of a namespace of their own: ``DistributedOptimizer.noname.<k>.<group>.<index>``.

    Unnamed collectives are ``<op>.noname.<n>``; the optimizer's names must never equal one of
    them (a user's unnamed ``allreduce_async`` in flight during backward would collide), nor
    another unnamed optimizer's (``k`` numbers the optimizers, identically on every rank as long
    as ranks wrap them in the same order).
    """
    base = frontend._auto_name("DistributedOptimizer", None)
    return [(f"{base}.{g}.{j}", p) for g, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])]


def _groups(optimizer: torch.optim.Optimizer, num_groups: int,
            groups: Any) -> list[list[torch.Tensor]] | None:
    if groups is None and not num_groups:
        return None
    if isinstance(groups, int) or (groups is None and num_groups):
        n = groups if isinstance(groups, int) else num_groups
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_groups/groups={n!r} must be a positive number of groups")
        base, extra = divmod(len(params), n)  # n consecutive groups, sizes differing by at most one
        bounds = np.cumsum([0] + [base + (1 if i < extra else 0) for i in range(n)]).tolist()
        return [params[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
    out: list[list[torch.Tensor]] = []
    seen: set[int] = set()
    for index, group in enumerate(groups):
        group = list(group)
        if any(not isinstance(p, torch.Tensor) for p in group):
            bad = next(type(p).__name__ for p in group if not isinstance(p, torch.Tensor))
            raise ValueError(f"groups= must be lists of the model's parameters (torch.Tensor); got a {bad}")
        if any(id(p) not in owned for p in group):
            raise ValueError("groups= lists a parameter the optimizer does not update")
        for entry, p in enumerate(group):  # Horovod's rule; before 2026-12-07 a repeat was taken, and its first
            if id(p) in seen:  # group, one short for ever, waited for step() (reduced after backward, not in it)
                raise ValueError(f"a parameter can only appear once in groups=: entry {entry} of group {index} "
                                 "is listed before; list each parameter in one group")
            seen.add(id(p))
        # a frozen parameter gets no gradient: its group would complete only in step(), every member reduced
        # there, after backward (before 2026-12-07); Horovod leaves such parameters out of the groups too
        group = [p for p in group if p.requires_grad]
        if group:
            out.append(group)
    return out


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Any = Compression.none, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet | None = None, zero_stage: int = 0,
                         zero_bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so gradients are averaged across ranks, overlapping backward.

    Args:
        optimizer: any ``torch.optim`` optimizer, not already wrapped.
        named_parameters: ``model.named_parameters()``; names are how ranks match gradients
            (use names your own collectives do not use). Without it, parameters are named
            ``DistributedOptimizer.noname.<k>.<group>.<index>``.
        compression: ``Compression.none`` or ``Compression.fp16`` for the wire.
        backward_passes_per_step: backward passes accumulated locally per step (scale the
            loss by its inverse to average them).
        op: ``Average`` (default), ``Sum`` ..., or ``Adasum`` (Horovod's Adasum optimizer: see the
            module docstring; a power-of-two number of ranks, the global process set).
        gradient_predivide_factor: divide by this before the sum and by ``size / factor``
            after (Average only), to keep fp16 sums in range.
        num_groups / groups: reduce parameters in groups (fused together) instead of one by one.
        sparse_as_dense: reduce sparse gradients densely instead of by all-gather.
        process_set: reduce over this process set only.
        zero_stage: 0 (default) keeps full copies on every rank; 1 shards the optimizer state
            and 2 also the gradients across the ranks (ZeRO, see unison/torch_backend/zero.py and
            docs/zero.md); for 3 (the weights too) use ``shard_module(model)``.
        zero_bucket_bytes: with ``zero_stage`` 1 or 2, the size of the gradient buckets that are
            reduce-scattered as backward fills them.

    Raises:
        ValueError: the optimizer is already wrapped; bad or incomplete ``named_parameters``;
            ``gradient_predivide_factor`` with an op other than Average.
    """
    runtime.state("DistributedOptimizer")
    try:
        rop, stage, named, chosen = _checked(optimizer, named_parameters, compression, backward_passes_per_step,
                                             op, gradient_predivide_factor, num_groups, groups, process_set,
                                             zero_stage)
    except (ValueError, TypeError, NotImplementedError) as exc:  # on this rank: the others raise it too
        if process_set is None or process_set.included():
            agree_on_stage(-1, None, process_set, refusal=exc)
        raise
    # the options too: ranks with different sparse_as_dense made different collectives for one gradient (a
    # hang), and different backward_passes_per_step stepped on the wrong reduction
    options = (f"op={rop!r} compression={getattr(compression, '__name__', type(compression).__name__)} "
               f"backward_passes_per_step={backward_passes_per_step} sparse_as_dense={bool(sparse_as_dense)} "
               f"gradient_predivide_factor={float(gradient_predivide_factor)}")
    if stage:
        wrapped = make_zero_optimizer(optimizer, named, stage, compression, backward_passes_per_step, rop,
                                      gradient_predivide_factor, process_set, zero_bucket_bytes, options)
        wrapped.defaults = dict(optimizer.defaults)  # (see below)
        return wrapped
    if process_set is None or process_set.included():  # (outside the set: local steps, nothing to agree)
        agree_on_stage(0, f"{parameters_signature(named)}; {options}", process_set)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__))
    wrapped = cls(optimizer.param_groups, named, compression, backward_passes_per_step, rop,
                  gradient_predivide_factor, chosen, sparse_as_dense, process_set)
    # the user's defaults, not the class's: a group added later (add_param_group) takes its missing settings
    # from them (it got torch's lr=0.001, momentum=0 before 2026-12-05)
    wrapped.defaults = dict(optimizer.defaults)
    if optimizer.state:
        wrapped.load_state_dict(optimizer.state_dict())
    return wrapped


def _checked(optimizer: torch.optim.Optimizer, named_parameters: Any, compression: Any,
             backward_passes_per_step: int, op: Any, gradient_predivide_factor: float, num_groups: int,
             groups: Any, process_set: ProcessSet | None, zero_stage: int) -> tuple[Any, int, list, Any]:
    """``DistributedOptimizer``'s argument checks: (the op, the ZeRO stage, the named parameters, the groups).

    [Note: a refusal on one rank] They may fail on one rank alone (an argument computed per rank, a
    model built differently); the caller then takes part in the agreement the other ranks make, so that
    every rank raises (see :func:`~unison.torch_backend.zero_state.agree_on_stage`).
    """
    if getattr(optimizer, "_unison_distributed", False):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original optimizer "
                         "once")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
    rop = Adasum if is_adasum(op) else parse_op(op)
    if gradient_predivide_factor != 1.0 and rop != Average:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} only applies to "
                         f"op=Average; got op={rop!r}")
    stage = check_stage(zero_stage)
    _check_combination(rop, compression, backward_passes_per_step, num_groups, groups, process_set)
    _check_zero(stage, rop, num_groups, groups)
    named = _named(optimizer, named_parameters)
    from unison.torch_backend.tensor_parallel import shards_across

    shards_across(named, process_set, "DistributedOptimizer")
    sharded = [n for n, p in named if getattr(p, "_unison_zero3_shard", False)]
    if sharded:
        raise ValueError(f"parameters {sharded[:3]} are shards made by shard_module, which reduce-scatters their "
                         "gradients itself; step them with a plain torch.optim optimizer, not "
                         "DistributedOptimizer")
    refused = _init_refuses_params_alone(optimizer.__class__)
    if refused is not None:  # (the same on every rank: the same class)
        raise TypeError(f"DistributedOptimizer makes a {optimizer.__class__.__name__} again from the parameter "
                        f"groups alone (as Horovod does), and its __init__ needs more ({refused}); give its other "
                        "arguments defaults (the groups keep the values you passed)")
    return rop, stage, named, _groups(optimizer, num_groups, groups)

