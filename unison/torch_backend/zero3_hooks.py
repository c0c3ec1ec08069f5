"""The hooks that drive ZeRO stage 3: gather before use, prefetch, free, reduce-scatter gradients.

See :mod:`unison.torch_backend.zero3` for the design. One :class:`Sharded` object per sharded
model holds its units and installs:

- on every unit's module a forward pre-hook (gather, prefetch the next unit, enter the
  saved-tensor hooks) and a forward hook that runs even when forward raises (leave them, free);
- on the model a forward hook that frees whatever was prefetched but not used;
- on every parameter view a post-accumulate-grad hook (count the unit's gradients; when all are
  in, reduce-scatter them and free the unit's weights);
- from the first hook of a backward pass, an end-of-backward callback that reduce-scatters the
  units still owing a reduction (parameters unused this pass count as zeros), waits for every
  reduce-scatter, adds the results into the shards' ``.grad`` and frees every gathered unit.

[Note: ZeRO-3 re-gather in backward]
Autograd keeps references to the weights an op needs for its backward (``linear`` saves its
weight; ``embedding`` does not). While a unit's forward runs, a ``saved_tensors_hooks`` pack hook
tags each saved tensor whose storage is one of a gathered unit's full buffers; the unpack hook,
which autograd calls when backward reaches the op, re-gathers that unit if it was freed. So a unit
is gathered in backward only if backward really needs its weights, exactly when it needs them,
and the units that needed it in an earlier step are prefetched one ahead in reverse forward order.

[Note: the saved-tensor hooks around a unit] Autograd applies only the innermost saved-tensor hooks.
A unit's hooks used to replace whatever hooks were active around it (activation checkpointing's,
``save_on_cpu``'s, a user's offload): numbers right, memory not saved (an audit measured 105 MB of
forward growth with and without checkpointing, the unsharded model 106 and 56 MB; before
2026-12-07). A unit's hooks now keep the unit weights they tag and hand every other tensor to the
hooks that were active when the unit's forward began (and those tensors back to them in backward),
so checkpointing saves inside units what it saves outside them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from unison.torch_backend.zero3_unit import Unit

__all__: list[str] = []

log = logging.getLogger(__name__)


logger = logging.getLogger(__name__)

class _Outer:
    """A tensor the hooks around a unit packed (see [Note: the saved-tensor hooks around a unit])."""

    __slots__ = ("unpack", "packed")

    def __init__(self, unpack: Any, packed: Any) -> None:
        self.unpack, self.packed = unpack, packed


def _active_hooks() -> tuple[Any, Any] | None:
    """The saved-tensor hooks active now (innermost), or None (a torch without the query: none kept)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return None if top is None else top(False)


class _Saved:
    """A saved tensor that lives in ``unit``'s full buffer (see [Note: ZeRO-3 re-gather in backward])."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: Unit, tensor: torch.Tensor) -> None:
        self.unit, self.tensor = unit, tensor


class Sharded:
    """A stage-3 model's units, hooks and per-step state.

    Attributes:
        units: every unit, in module order. order: units in the order the first forward ran them.
        keys: the original ``state_dict`` keys, each ``("param", unit, index)`` or
            ``("buffer", module, name)``.
        prefetch: whether to gather one unit ahead in forward and backward.
    """

    def __init__(self, model: torch.nn.Module, units: list[Unit], keys: dict[str, tuple], prefetch: bool,
                 process_set: Any, tag: str) -> None:
        self.model, self.units, self.keys, self.prefetch = model, units, keys, prefetch
        self.process_set, self.tag = process_set, tag
        self.order: list[Unit] = []
        self.needed_in_backward: set[int] = set()  # id(unit) of units that unpack re-gathered
        self.callback_queued = False
        self.peak_gathered_bytes = 0  # the most full-weight bytes held at once (a measurement)
        self._by_ptr: dict[int, Unit] = {}
        self._handles: list[Any] = []

    # ------------------------------------------------------------- install
    def install_hooks(self) -> None:
        """Register every hook (see the module docstring)."""
        for unit in self.units:
            # first of the module's pre-hooks: one registered earlier (weight_norm's, spectral_norm's, a
            # user's) read the empty placeholders (weight_norm's then divided by zero: the process died)
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_hook(unit), prepend=True))
            self._handles.append(unit.module.register_forward_hook(self._post_hook(unit), always_call=True))
            for v in unit.views:
                if v.requires_grad:
                    self._handles.append(v.register_post_accumulate_grad_hook(self._grad_hook(unit)))
        self._handles.append(self.model.register_forward_hook(self._model_post_hook, always_call=True))

    def _check_between_passes(self, unit: Unit) -> None:
        """Run by ``unit``'s forward pre-hook outside a backward pass (a forward recomputed by
        activation checkpointing runs inside one, where the flag below is rightly set).

        A backward pass that raised (a NaN check, a failing custom Function) never ran
        :meth:`end_of_backward`: torch drops its queued callback. Its flag stayed set, so no later pass
        queued one again, and no shard got a gradient again (training stopped, silently). The next
        forward drops that pass's partial reductions and starts clean, as torch does after a failed
        backward. A unit whose parameters were frozen or unfrozen after sharding is refused here too."""
        if torch._C._current_graph_task_id() != -1:
            return
        for key, flat in unit.flats.items():
            if flat.shard.requires_grad == key.endswith("_frozen"):
                raise ValueError(
                    f"shard_module: unit {unit.name or '(the model)'!r}'s shard {key!r} was made "
                    f"{'frozen' if key.endswith('_frozen') else 'trainable'} and now has requires_grad="
                    f"{flat.shard.requires_grad}: a sharded module's parameters cannot be frozen or unfrozen "
                    "after shard_module (the gradient hooks and buckets were laid out for the old state, and "
                    "it would train nothing). Set requires_grad before shard_module, or shard the model "
                    "again from load_full_state_dict")
        if not self.callback_queued:
            return
        logger.warning("shard_module: the last backward pass did not finish (it raised); its partial "
                       "gradients are dropped")
        self.callback_queued = False
        self.needed_in_backward.clear()
        for other in self.units:
            other.discard_reduce()
            if other.active == 0:
                self.free(other)

    def _pre_hook(self, unit: Unit) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._check_between_passes(unit)
            if all(u is not unit for u in self.order):
                self.order.append(unit)
            self.gather(unit)
            if self.prefetch:
                nxt = self._neighbour(unit, +1)
                if nxt is not None and nxt.active == 0:
                    nxt.start_gather()
            unit.active += 1
            if torch.is_grad_enabled():
                unit.needs_reduce = True
            outer = _active_hooks()
            if outer is None:
                ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            else:
                outer_pack, outer_unpack = outer

                def pack(t: torch.Tensor) -> Any:
                    mine = self._pack(t)
                    return mine if mine is not t else _Outer(outer_unpack, outer_pack(t))
                ctx = torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)
            ctx.__enter__()
            unit_stack(module).append(ctx)
        return hook

    def _post_hook(self, unit: Unit) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            stack = unit_stack(module)
            if stack:
                stack.pop().__exit__(None, None, None)
            unit.active = max(0, unit.active - 1)
            if unit.active == 0:
                self.free(unit)
        return hook

    def _model_post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for unit in self.units:
            if unit.active == 0 and (unit.gathers or unit.full_bytes()):
                self.free(unit)

    # ------------------------------------------------------------- gather / free
    def gather(self, unit: Unit) -> None:
        """Make ``unit``'s full weights available (waiting for a prefetch in flight)."""
        if unit.is_gathered():
            return
        unit.finish_gather()
        for flat in unit.flats.values():
            self._by_ptr[flat.full.untyped_storage().data_ptr()] = unit
        held = sum(u.full_bytes() for u in self.units)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, held)

    def free(self, unit: Unit) -> None:
        """Drop ``unit``'s full weights."""
        for flat in unit.flats.values():
            self._by_ptr.pop(flat.full.untyped_storage().data_ptr(), None)
        unit.free()

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        for i, u in enumerate(self.order):
            if u is unit:
                j = i + step
                return self.order[j] if 0 <= j < len(self.order) else None
        return None

    # ------------------------------------------------------------- saved tensors
    def _pack(self, t: torch.Tensor) -> Any:
        try:
            unit = self._by_ptr.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less tensors
            return t
        return t if unit is None else _Saved(unit, t)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is _Outer:
            return saved.unpack(saved.packed)
        if not isinstance(saved, _Saved):
            return saved
        if torch.is_grad_enabled():  # only a backward with create_graph=True differentiates with grad on
            # its graph would keep views of the gathered weights that end_of_backward frees (resizes to 0):
            # the second backward read freed storage (an out-of-bounds error, or garbage)
            raise NotImplementedError(
                "a backward with create_graph=True (a double backward, e.g. a gradient penalty) through a "
                "module sharded by shard_module (ZeRO stage 3) is not supported: its graph would hold "
                "weights the shards free after the backward. Use zero_stage=1 or 2 for such a loss")
        unit = saved.unit
        if not unit.is_gathered():
            self._queue_callback()
            self.needed_in_backward.add(id(unit))
            self.gather(unit)
            prev = self._neighbour(unit, -1) if self.prefetch else None
            if prev is not None and id(prev) in self.needed_in_backward:
                prev.start_gather()
        return saved.tensor

    # ------------------------------------------------------------- gradients
    def _grad_hook(self, unit: Unit) -> Any:
        def hook(view: torch.Tensor) -> None:
            self._queue_callback()
            unit.grads_seen += 1
            if unit.grads_seen == unit.trainable:
                unit.start_reduce()
                if unit.active == 0:
                    self.free(unit)
        return hook

    def _queue_callback(self) -> None:
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_of_backward)
            self.callback_queued = True

    def end_of_backward(self) -> None:
        """Reduce-scatter what is still owed, land every result in the shards' ``.grad``, free all."""
        self.callback_queued = False
        for unit in self.units:
            if unit.trainable and (unit.needs_reduce or unit.grads_seen):
                unit.start_reduce()
        for unit in self.units:
            unit.finish_reduce()
        for unit in self.units:
            if unit.active == 0:
                self.free(unit)

    def drain(self) -> None:
        """Land every gather in flight (a prefetch) and free the units not running.

        [Note: no prefetch across a change of the shards] A prefetch reads the shards when it starts. One
        left in flight (a forward entered through a submodule between backward and ``step()``) was used by
        the next forward after the optimizer had changed the shards: stale weights, silently (before
        2026-12-07). An optimizer's step, loading and ``full_state_dict`` drain first. Every rank submitted
        the same prefetches (forward order is the same everywhere), so waiting for them is collective-safe.
        """
        for unit in self.units:
            if unit.gathers:
                unit.finish_gather()
                if unit.active == 0:
                    self.free(unit)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def unit_stack(module: torch.nn.Module) -> list:
    """The saved-tensor hook contexts entered by ``module``'s running forward calls."""
    stack = module.__dict__.get("_unison_zero3_ctx")
    if stack is None:
        stack = module.__dict__["_unison_zero3_ctx"] = []
    return stack
