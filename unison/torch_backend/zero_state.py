"""What a ZeRO optimizer shows the outside: ``state_dict()`` in torch's own format, the global
gradient norm (``clip_grad_norm_``), which optimizers can be sharded at all, and the check that
every rank asked for the same sharding (``agree_on_stage``).

``state_dict()`` is *consolidated*: every rank all-gathers the segments of each piece of state
and returns the dictionary a plain ``torch.optim`` optimizer of the same class would have
(keyed by parameter index, full shapes), so it loads into an unsharded optimizer, and
``load_state_dict()`` accepts it on any number of ranks (each rank keeps its own slices).
It is collective: every rank of the optimizer's process set must call it, and it holds the
full state on every rank for a moment. For models whose state does not fit once per rank,
save shards instead (``unison.torch_backend.save_sharded``, docs/zero.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from unison.common import runtime
from unison.common.engine import frontend, objects
from unison.common.engine.objects import agree_on_values, allgather_object
from unison.common.engine.process_sets import ProcessSet, set_rank
from unison.common.ops import Max, Sum
from unison.torch_backend.tensor_parallel import shard_groups as tensor_parallel_groups
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__ = ["ZeroStateMixin", "check_optimizer", "agree_on_stage", "clip_grad_norm_", "ELEMENTWISE",
           "NOT_SHARDABLE", "tensor_parallel_groups", "tensor_group", "norm_part", "global_norm"]

# Optimizers whose update of each element depends only on that element's gradient and state:
# stepping a flat slice gives the same numbers as stepping the whole tensors.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "Adagrad", "Adadelta",
               "ASGD")
NOT_SHARDABLE = {
    "LBFGS": "its step re-evaluates a closure and keeps a history of whole-model directions",
    "SparseAdam": "it needs sparse gradients, which a bucket's reduce-scatter makes dense",
    "Adafactor": "it factors the second moment of each matrix into row and column statistics, which a "
                 "flat slice of the matrix does not have",
    "Muon": "it orthogonalises each whole matrix update, which needs the full matrix",
}


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise unless ``optimizer``'s update is elementwise (so a flat shard of it is exact).

    Raises:
        ValueError: a known non-elementwise optimizer, or an unknown class not marked
            ``_unison_elementwise = True``.
    """
    cls = type(optimizer)
    for klass in cls.__mro__:
        if getattr(klass, "_unison_elementwise", False):
            return
        if klass.__module__.startswith("torch.optim") and klass.__name__ in NOT_SHARDABLE:
            raise ValueError(f"{cls.__name__} cannot be sharded with zero_stage: {NOT_SHARDABLE[klass.__name__]}."
                             " Use zero_stage=0, or an elementwise optimizer (Adam, AdamW, SGD, ...)")
        if klass.__module__.startswith("torch.optim") and klass.__name__ in ELEMENTWISE:
            return
    raise ValueError(f"{cls.__name__} is not a torch.optim optimizer known to be elementwise, so Unison cannot "
                     "tell whether stepping a flat slice of the parameters gives the same numbers. If each "
                     "element's update depends only on that element's gradient and state, set "
                     f"`{cls.__name__}._unison_elementwise = True`; otherwise use zero_stage=0")


_MISSING = object()


def _same_value(a: Any, b: Any) -> bool:
    """Equal per-parameter state values (tensors: same dtype, shape and elements)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return (torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape
                and bool(torch.equal(a.cpu(), b.cpu())))
    try:
        return bool(a == b)
    except Exception:  # (values whose == is not a truth value)
        return a is b


def _show(value: Any) -> str:
    if torch.is_tensor(value) and value.numel() == 1:
        return repr(value.item())
    return repr(value)


class ZeroStateMixin:
    """State dictionaries and gradient clipping for ``_ZeroOptimizer`` (uses its buckets and plan)."""

    # ------------------------------------------------------------- state_dict
    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """Torch's format, full shapes, on every rank (collective; see the module docstring)."""
        self._sync_hyperparameters()
        self._agree_on_state_keys()
        index = {id(p): i for i, p in enumerate(self._all_params())}
        state: dict[int, dict[str, Any]] = {}
        for st in self._buckets:
            inner = self._inner.state.get(st.master, {})
            for key in sorted(inner):
                value = inner[key]
                if torch.is_tensor(value) and value.shape == st.master.shape:
                    full = from_numpy(frontend.allgather(to_numpy(value.detach()),
                                                         f"{self._base}.sd{st.bucket.index}.{key}", self._pset))
                    for piece, p in zip(st.bucket.pieces, st.params, strict=True):
                        part = full[piece.offset:piece.offset + piece.length].view(p.shape).clone()
                        state.setdefault(index[id(p)], {})[key] = part
                else:
                    for p in st.params:
                        copy = value.clone() if torch.is_tensor(value) else value
                        state.setdefault(index[id(p)], {})[key] = copy
        groups, start = [], 0
        for g in self.param_groups:
            n = len(g["params"])
            hyper = {k: v for k, v in g.items() if k != "params"}
            groups.append({**hyper, "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def _agree_on_state_keys(self) -> None:
        """Raise :class:`MismatchError` on every rank unless every rank holds the same state keys for each bucket.

        ``state_dict`` gathers one collective per bucket and key, so a rank holding other keys waited for
        ever: Horovod's resume recipe (``load_state_dict`` on rank 0 alone, then ``broadcast_optimizer_state``)
        hung here before 2026-12-05. A ZeRO optimizer cannot follow that recipe anyway: each rank keeps only its
        segment of what it loads, so rank 0 no longer holds the others' state to send.
        """
        keys = {f"bucket {st.bucket.index}": ", ".join(sorted(self._inner.state.get(st.master, {}))) or "(none)"
                for st in self._buckets}
        agree_on_values("a ZeRO optimizer's state_dict()", keys, f"{self._base}.sd.keys", self._pset,
                        fix="The ranks' optimizer states differ: each rank of a ZeRO optimizer holds its own "
                            "segment of the state, so call load_state_dict(...) with the whole state dict on "
                            "every rank (each keeps its segment), not on one rank before "
                            "broadcast_optimizer_state, and take a step on every rank alike")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's format (from this or a plain optimizer, saved on any number of ranks).

        Raises:
            ValueError: the parameter groups or sizes do not match this optimizer's.
        """
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"]) for a, b in zip(groups, self.param_groups, strict=True)):
            raise ValueError("the state dict's parameter groups "
                             f"{[len(g['params']) for g in groups]} do not match this optimizer's "
                             f"{[len(g['params']) for g in self.param_groups]}; load a state dict saved from "
                             "an optimizer over the same parameters")
        params = self._all_params()
        saved_state = {int(k): v for k, v in state_dict["state"].items()}
        by_param = {id(params[i]): s for i, s in saved_state.items()}
        # every bucket's slice first: a state dict this optimizer cannot hold raises before anything changes
        segments = [self._segment_state(st, by_param) for st in self._buckets]
        for mine, saved in zip(self.param_groups, groups, strict=True):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        for st, state in zip(self._buckets, segments, strict=True):
            with torch.no_grad():
                if st.master.data_ptr() != st.segment.data_ptr():  # fp32 master of half weights
                    st.master.copy_(st.segment.float())
            self._inner.state[st.master] = state
        self._sync_hyperparameters()

    def _per_element_keys(self, st: Any) -> frozenset[str] | None:
        """The state keys the wrapped class keeps per element (``exp_avg``) rather than per
        parameter (``step``), learned from one step of a fresh instance on a 2-element probe
        with the bucket's group's hyper-parameters; None when the probe cannot step.

        The shape alone cannot tell them apart for a 0-d parameter (a learned temperature): its
        ``exp_avg`` is 0-d like ``step``, and a bucket of such parameters got one scalar state
        for all of them (its next step failed on every rank).
        """
        hyper = {k: v for k, v in self.param_groups[st.bucket.group].items() if k != "params"}
        try:
            probe = torch.nn.Parameter(torch.zeros(2, dtype=st.master.dtype))
            opt = type(self._inner)([{**hyper, "params": [probe]}])
            probe.grad = torch.ones_like(probe)
            opt.step()
            return frozenset(k for k, v in opt.state[probe].items() if torch.is_tensor(v) and v.shape == (2,))
        except Exception:  # (a class that needs a closure or sparse gradients): judge by shape
            return None

    def _segment_state(self, st: Any, by_param: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """This rank's slice of the saved state of the bucket's parameters.

        A bucket's shard keeps one state (one ``step`` too) for all its parameters, so either every
        parameter of the bucket has each per-element state or none has: a plain optimizer creates
        a parameter's state at its first gradient, and one saved before every parameter had one
        cannot be sharded. Checked over the whole bucket, not only this rank's pieces, so every
        rank raises alike.

        Raises:
            ValueError: a parameter of the bucket without a state the others have (or of another shape).
        """
        have = [(p, by_param[id(p)]) for p in st.params if id(p) in by_param]
        if not have:
            return {}
        names = {id(p): piece.name for piece, p in zip(st.bucket.pieces, st.params, strict=True)}
        first, values = have[0]
        out: dict[str, Any] = {}
        owned = st.bucket.owned(self._rank)
        element_keys = self._per_element_keys(st)
        for key, value in values.items():
            if not torch.is_tensor(value):
                per_element = False
            elif element_keys is not None:
                per_element = key in element_keys
            else:
                per_element = value.dim() > 0
            if per_element and value.shape == first.shape:
                for p in st.params:
                    src = by_param.get(id(p), {}).get(key)
                    if src is None or tuple(src.shape) != tuple(p.shape):
                        raise ValueError(
                            f"the saved optimizer state {key!r} of parameter {names[id(p)]!r} is "
                            f"{'missing' if src is None else 'of shape ' + str(tuple(src.shape))} (expected "
                            f"{tuple(p.shape)}) while {names[id(first)]!r} of the same ZeRO bucket has it. "
                            "A plain optimizer creates a parameter's state at its first gradient; a ZeRO "
                            "shard keeps one state for the whole bucket. Save the state after a step in which "
                            "every parameter had a gradient, or from the ZeRO optimizer itself")
                seg = torch.zeros(st.master.shape, dtype=st.master.dtype)
                for piece in owned:
                    p = st.params[[q.name for q in st.bucket.pieces].index(piece.name)]
                    src = by_param[id(p)][key]
                    seg[piece.offset:piece.offset + piece.length] = src.reshape(-1)[
                        piece.param_offset:piece.param_offset + piece.length].to(seg.dtype)
                out[key] = seg
            else:
                out[key] = value.clone() if torch.is_tensor(value) else value
        for key in sorted(out.keys() - (element_keys or set())):  # after the per-element checks: theirs says more
            if not (torch.is_tensor(out[key]) and out[key].shape == st.master.shape):
                self._check_same_scalar(st, key, first, values[key], by_param, names)
        return out

    @staticmethod
    def _check_same_scalar(st: Any, key: str, first: torch.Tensor, value: Any, by_param: dict[int, dict[str, Any]],
                           names: dict[int, str]) -> None:
        """Raise unless every parameter of the bucket has ``value`` as its per-parameter ``key``.

        A shard keeps one ``step`` for its whole bucket; a plain optimizer's parameters that
        stepped a different number of times (a head trained on some steps only) cannot share it
        (before 2026-12-05 the first parameter's count was given to all, silently: Adam's bias
        correction then differed from one process's). Checked over the whole bucket, on every rank.

        Raises:
            ValueError: a parameter of the bucket whose value differs or is missing.
        """
        for p in st.params:
            other = by_param.get(id(p), {}).get(key, _MISSING)
            if _same_value(other, value):
                continue
            shown = "missing" if other is _MISSING else _show(other)
            raise ValueError(
                f"the saved optimizer state {key!r} of parameter {names[id(p)]!r} is {shown} while "
                f"{names[id(first)]!r} of the same ZeRO bucket has {_show(value)}. A ZeRO shard keeps one "
                f"{key!r} for the whole bucket. Load this state dict with zero_stage=0, or train the parameters "
                "that step at different rates in separate parameter groups (each group has its own buckets) "
                "and save again")

    # ------------------------------------------------------------- clipping
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every shard's gradient by the *global* norm (all ranks' shards together); return it.

        Synchronizes first when ``step()`` has not; the next ``step()`` then does not again.
        Equals ``torch.nn.utils.clip_grad_norm_`` over the full averaged gradients, also when the
        model is tensor-parallel ([Note: the global norm of a tensor-parallel model]).

        Raises:
            ValueError: on every rank, the parameters' tensor-parallel shards span two tensor groups.
        """
        if not self._synchronized:
            self.synchronize()
        norm_type = float(norm_type)
        params = [p for st in self._buckets for p in st.params]
        groups = tensor_parallel_groups(params)
        group = tensor_group(groups, "clip_grad_norm_")
        grads = [st.master.grad for st in self._buckets if st.master.grad is not None]
        if group is None:
            split, rest = 0.0, norm_part(grads, norm_type)
        else:
            parts: dict[bool, list[torch.Tensor]] = {True: [], False: []}
            split_ids = {id(p) for p, g in zip(params, groups, strict=True) if g is not None}
            for st in self._buckets:
                if st.master.grad is None:
                    continue
                by_name = {piece.name: p for piece, p in zip(st.bucket.pieces, st.params, strict=True)}
                for piece in st.bucket.owned(self._rank):
                    parts[id(by_name[piece.name]) in split_ids].append(
                        st.master.grad[piece.offset:piece.offset + piece.length])
            split, rest = norm_part(parts[True], norm_type), norm_part(parts[False], norm_type)
        total = global_norm(split, rest, norm_type, f"{self._base}.clipnorm", self._pset, group)
        coef = float(max_norm) / (total + 1e-6)
        if not coef >= 1.0:  # (NaN too: every gradient NaN, as torch's clip_grad_norm_; kept before 2026-12-07)
            for g in grads:
                g.mul_(coef)
        return torch.tensor(total)


def norm_part(grads: list[torch.Tensor], norm_type: float) -> float:
    """``sum |g|^p`` over ``grads`` (their largest ``|g|`` for ``inf``), in float64."""
    if math.isinf(norm_type):
        return max((float(g.detach().abs().max()) for g in grads if g.numel()), default=0.0)
    return sum(float((g.detach().double().abs() ** norm_type).sum()) for g in grads)


def tensor_group(groups: list[ProcessSet | None], what: str) -> ProcessSet | None:
    """The one tensor group among ``groups`` (:func:`tensor_parallel_groups` of some tensors), or None
    when none of the tensors is a shard.

    Raises:
        ValueError: shards of two tensor groups (the same verdict on every rank: the model is built alike).
    """
    found = {tuple(g.ranks) if g.ranks is not None else None: g for g in groups if g is not None}
    if len(found) > 1:
        shown = ", ".join("every rank" if ranks is None else str(list(ranks)) for ranks in found)
        raise ValueError(f"{what}: the parameters hold shards of tensor-parallel layers split over different "
                         f"tensor groups ({shown}); a global gradient norm is summed over one tensor group. Build "
                         "every parallel layer of the model on the same group (Grid(...).register().tp)")
    return next(iter(found.values()), None)


def global_norm(split: float, rest: float, norm_type: float, name: str, data_set: ProcessSet | None,
                group: ProcessSet | None) -> float:
    """The global gradient norm from this rank's parts: ``sum |g|^p`` (the largest ``|g|`` for ``inf``)
    over its pieces of tensor-parallel shards (``split``) and over the rest (``rest``).

    [Note: the global norm of a tensor-parallel model]
    ZeRO shards each parameter over the data set, so summing over it gives this rank's tensor shard's
    whole parameters. With a tensor group (``group``) that is one shard of each split parameter: the
    shards' sums are added over the tensor group too, while the replicated parameters (layer norms,
    a row layer's bias), whose copies and gradients are equal on every rank of the group, are counted
    by its first rank only. Before 2026-12-07 the sum stopped at the data set, so each tensor shard
    was clipped by its own norm (0.66 where one process had 1.04), and the replicated parameters
    drifted apart across the tensor group.
    """
    infinite = math.isinf(norm_type)
    first = group is None or set_rank(group) == 0
    mine = float(np.maximum(split, rest)) if infinite else split + (rest if first else 0.0)  # (NaN stays NaN)
    op = Max if infinite else Sum
    total = float(frontend.allreduce(np.array([mine], np.float64), op, name, process_set=data_set)[0])
    if group is not None:  # (named alike on the group's ranks: ``name`` holds the data set's id, theirs differ)
        total = float(frontend.allreduce(np.array([total], np.float64), op, "zero.clip_grad_norm_.tensor_group",
                                         process_set=group)[0])
    return total if infinite else total ** (1 / norm_type)


#: the signature of a rank whose own checks refused its DistributedOptimizer
REFUSED = "refused on this rank: "


def agree_on_stage(zero_stage: int, signature: str | None, process_set: ProcessSet | None,
                   refusal: Exception | None = None) -> None:
    """Every rank of the set compares ``(zero_stage, plan signature)``; a mismatch raises everywhere.

    ``refusal``: this rank's own checks refused the optimizer (an argument bad on this rank alone). It
    takes part in the agreement all the same and raises that error, while every other rank raises a
    ``ValueError`` naming it: raised before the agreement (before 2026-12-07), it left the other ranks
    waiting in it until the deadlock check, which named no cause (or for ever with that check off).

    Raises:
        ValueError: ranks wrapped different models, or asked for different stages, or a rank's checks
            refused it; ``refusal`` itself on the rank that refused.
    """
    if runtime.size() == 1:
        if refusal is not None:
            raise refusal
        return
    mine = (zero_stage, signature if refusal is None else f"{REFUSED}{type(refusal).__name__}: {refusal}")
    name = frontend._auto_name("DistributedOptimizer.agree", None, process_set)
    everyone = allgather_object(mine, name, process_set)
    if refusal is not None:
        raise refusal
    ranks = objects._members(len(everyone), process_set)  # (job ranks, also on a process set)
    refused = [(r, sig) for r, (_, sig) in zip(ranks, everyone, strict=True)
               if isinstance(sig, str) and sig.startswith(REFUSED)]
    if refused:
        raise ValueError("DistributedOptimizer was refused on " + "; ".join(
            f"rank {r} ({sig[len(REFUSED):]})" for r, sig in refused) + ": fix the arguments there (every "
            "rank must wrap its optimizer alike)")
    if len(set(everyone)) > 1:
        table = ", ".join(f"rank {r}: zero_stage={s}" + (f" plan {sig}" if sig else "")
                          for r, (s, sig) in zip(ranks, everyone, strict=True))
        raise ValueError(f"ranks disagree on the DistributedOptimizer's sharding ({table}); every rank must "
                         "wrap the same model's parameters with the same zero_stage and options")

def clip_grad_norm_(target: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip sharded gradients by their global norm (every rank's shards together); return the norm.

    ``target`` is a ZeRO stage 1/2 ``DistributedOptimizer`` (its ``clip_grad_norm_``) or a model
    sharded by ``shard_module`` (stage 3). Call it on every rank, after backward, before ``step()``.

    Raises:
        TypeError: ``target`` is neither; for plain data parallelism call ``optimizer.synchronize()``
            and ``torch.nn.utils.clip_grad_norm_`` inside ``optimizer.skip_synchronize()``.
    """
    if getattr(target, "zero_stage", 0) in (1, 2):
        return target.clip_grad_norm_(max_norm, norm_type)
    if isinstance(target, torch.nn.Module):
        from unison.torch_backend.zero3 import clip_sharded_grad_norm_

        return clip_sharded_grad_norm_(target, max_norm, norm_type)
    raise TypeError(f"clip_grad_norm_ takes a ZeRO DistributedOptimizer (zero_stage=1 or 2) or a model sharded by "
                    f"shard_module; got {type(target).__name__}. Without ZeRO, call optimizer.synchronize() and "
                    "torch.nn.utils.clip_grad_norm_ inside optimizer.skip_synchronize()")
