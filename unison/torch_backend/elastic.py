"""Horovod's elastic API for PyTorch (``hvd.elastic``): in-place recovery on ULFM.

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader):      # loader over state.sampler
                ...; optimizer.step()
                state.sampler.record_batch(state.batch, batch_size)
                if state.batch % 10 == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)

    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, batch=0)
    train(state)

When a rank dies (``unisonrun --elastic``), every survivor's pending collective raises
:class:`UnisonInternalError`; ``run`` restores the last commit, rebuilds Unison on the
survivors (``unison.common.elastic.recover``: new ``size()`` and ``rank()``), broadcasts
the state from the new rank 0, calls the reset callbacks and calls ``train`` again.
See docs/elastic.md.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch

from unison.common import runtime
from unison.common.elastic import ObjectState, SamplerCore, agree_structure, recover, run_fn
from unison.common.elastic import State as _State
from unison.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt, UnisonInternalError
from unison.torch_backend.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)

__all__ = ["run", "TorchState", "ObjectState", "State", "ElasticSampler", "UnisonInternalError",
           "HorovodInternalError", "HostsUpdatedInterrupt"]

logger = logging.getLogger(__name__)

State = _State


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: run ``func(state, ...)`` and recover in place when a rank fails (Horovod's ``run``)."""
    return run_fn(func, recover)


class ElasticSampler(torch.utils.data.Sampler):
    """A sampler that resumes mid-epoch on any number of ranks (Horovod's ``ElasticSampler``).

    Each epoch's samples are shuffled with ``seed + epoch`` and dealt round-robin over the
    ranks. Call ``record_batch(batch_idx, batch_size)`` after each batch and keep the
    sampler in the :class:`TorchState` (``sampler=...``): after a reset the samples that
    the last commit did not cover are dealt over the new world, none twice, none skipped
    ([Note: elastic sampling] in ``unison/common/elastic/sampler.py``). Call
    ``set_epoch(e)`` when an epoch ends.

    Args:
        dataset: anything with ``len()``.
        shuffle: shuffle each epoch.
        seed: the shuffle's seed (the same on every rank).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self._core = SamplerCore(len(dataset), shuffle, seed)
        self.reset()

    @property
    def epoch(self) -> int:
        return self._core.epoch

    @property
    def processed_indices(self) -> set[int]:
        return self._core.processed_indices

    def reset(self) -> None:
        """Deal the remaining samples over the current ranks (also called after a reset)."""
        st = runtime._state
        self._core.reset(st.rank if st else 0, st.size if st else 1)

    def set_epoch(self, epoch: int) -> None:
        self._core.set_epoch(epoch)
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self._core.record_batch(batch_idx, batch_size)

    def record_indices(self, indices: Any) -> None:
        self._core.record_indices(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's samples of batch ``batch_idx``."""
        return self._core.batch_indices(batch_idx, batch_size)

    def state_dict(self) -> dict[str, Any]:
        return self._core.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        st = runtime._state
        self._core.load_state_dict(state_dict, st.rank if st else 0, st.size if st else 1)

    def __iter__(self) -> Any:
        return iter(list(self._core.indices))

    def __len__(self) -> int:
        return len(self._core)


def _copy_into(saved: Any, current: Any) -> Any:
    """A deep copy of ``current`` (a ``state_dict()``) that reuses ``saved``'s tensors where they match.

    A commit copies the whole state every time; ``copy.deepcopy`` allocates it anew, and fresh
    memory is paid in page faults: 33 ms for the 20M-parameter benchmark MLP here, against 4.5 ms
    to copy into the previous commit's tensors. Tensors of another shape, dtype, device or layout,
    and everything that is not a tensor, dict or list, are deep-copied as before. The caller makes
    sure nothing still reads ``saved`` (the background spill of the last commit, see TorchState.save).
    """
    if isinstance(current, torch.Tensor):
        if (isinstance(saved, torch.Tensor) and saved is not current and saved.shape == current.shape
                and saved.dtype == current.dtype and saved.device == current.device
                and saved.layout == current.layout == torch.strided and not current.requires_grad
                and saved.is_contiguous()):
            with torch.no_grad():
                saved.copy_(current)
            return saved
        return copy.deepcopy(current)
    if isinstance(current, dict) and isinstance(saved, dict):
        out = copy.copy(current)  # the same mapping type, with its attributes (a state_dict's _metadata)
        for key, value in current.items():
            out[key] = _copy_into(saved.get(key), value)
        if hasattr(current, "__dict__"):
            out.__dict__.update(copy.deepcopy(current.__dict__))
        return out
    if type(current) is list and type(saved) is list and len(saved) == len(current):
        return [_copy_into(old, new) for old, new in zip(saved, current, strict=True)]
    return copy.deepcopy(current)


class _HostArray:
    """A CPU tensor of a commit spilled to disk, pickled as the numpy array over its memory.

    torch pickles a tensor through ``torch.save`` of its storage: 72 ms to pickle and 62 ms to
    unpickle the 80 MB state of the benchmark MLP here, against 36 ms and 4.5 ms as numpy arrays
    (protocol 5 keeps them writable). The spill runs beside training and the unpickling is on a
    restarted job's way to its first step.
    """

    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _HostArray, (self.array,)


class _HostBytes:
    """A CPU tensor of a dtype that numpy lacks and that torch cannot unpickle, spilled as its bytes.

    [Note: dtypes torch pickles but cannot unpickle]
    torch 2.13 pickles a float8 (``float8_e4m3fn`` ...), ``complex32``, ``bits*`` or sub-byte integer
    tensor, but unpickling it fails (AttributeError: 'UntypedStorage' object has no attribute 'dtype',
    or a KeyError): one such buffer made every commit spilled to disk unreadable, and a restarted job
    warned that no host held a commit and started from scratch (before 2026-12-05). Such a tensor is
    spilled as the numpy ``uint8`` array over its bytes, with its dtype's name and shape, and viewed
    back on load. ``bfloat16``, which torch unpickles, is still pickled by torch.
    """

    __slots__ = ("array", "dtype", "shape")

    def __init__(self, array: Any, dtype: str, shape: tuple[int, ...]) -> None:
        self.array, self.dtype, self.shape = array, dtype, shape

    def __reduce__(self) -> tuple[Any, tuple[Any, str, tuple[int, ...]]]:
        return _HostBytes, (self.array, self.dtype, self.shape)

    @classmethod
    def of(cls, value: torch.Tensor) -> _HostBytes:
        flat = value.contiguous().reshape(-1)  # (a view of a contiguous tensor; 0-d ones too)
        return cls(flat.view(torch.uint8).numpy(), str(value.dtype).removeprefix("torch."), tuple(value.shape))

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.array).view(getattr(torch, self.dtype)).reshape(self.shape)


#: the dtypes torch pickles but cannot unpickle, spilled as bytes (see [Note: dtypes torch pickles but cannot
#: unpickle]); every other tensor numpy cannot view (bfloat16, a lazily negated or conjugated one, a quantized
#: one with its scale and zero point) is left to torch's pickling, which reads it back
_AS_BYTES = frozenset(getattr(torch, name) for name in dir(torch)
                      if name.startswith(("float8_", "bits")) or name in ("complex32",)
                      or name in {f"{u}int{k}" for u in ("", "u") for k in range(1, 8)})


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` (a state_dict: dicts and lists of tensors and values) with ``leaf`` applied to everything
    that is neither; mapping types and their attributes (a state_dict's ``_metadata``) are kept."""
    if isinstance(value, dict):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = _map_leaves(item, leaf)
        return out
    if type(value) is list:
        return [_map_leaves(item, leaf) for item in value]
    return leaf(value)


def _host_leaf(value: Any) -> Any:
    if (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided
            and not value.requires_grad):
        try:
            return _HostArray(value.numpy())
        except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), a lazy negation...: torch pickles it
            if value.dtype in _AS_BYTES:
                return _HostBytes.of(value.resolve_conj().resolve_neg())
            return value
    return value


def _from_host_leaf(leaf: Any) -> Any:
    if isinstance(leaf, _HostArray):
        return torch.from_numpy(leaf.array)
    return leaf.tensor() if isinstance(leaf, _HostBytes) else leaf


def _to_host(value: Any) -> Any:
    """``value`` (a state_dict) with its plain CPU tensors as :class:`_HostArray` (sharing their memory)."""
    return _map_leaves(value, _host_leaf)


def _from_host(value: Any) -> Any:
    """The inverse of :func:`_to_host`: tensors over the unpickled arrays."""
    return _map_leaves(value, _from_host_leaf)


class _Handler:
    """Save / restore / sync of one stateful object kept in a :class:`TorchState`."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self._saved: Any = None
        self.save()

    def save(self) -> None:
        self._saved = _copy_into(self._saved, self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))


class _ModelHandler(_Handler):
    def restore(self) -> None:
        # a module copies every tensor of the state_dict into its own (load_state_dict): no copy needed first,
        # unless the module keeps extra state, which it may take by reference
        if all(isinstance(v, torch.Tensor) for v in self._saved.values()):
            self.value.load_state_dict(self._saved)
        else:
            super().restore()
        # the gradients of the step cut short belong to no commit: a loop that zeroes them after
        # step() would add them to the next step's (one local step of the failed batch, silently)
        self.value.zero_grad(set_to_none=True)

    def sync(self) -> None:
        """Rank 0's tensors (broadcast in place) and extra state (``get_extra_state()``: any object, sent
        with ``broadcast_object`` and loaded with ``load_state_dict``). Before 2026-12-05 the extra state
        went to ``broadcast_parameters`` too, which refused it: such a model could not start ``run``."""
        current = self.value.state_dict()
        tensors = {k: v for k, v in current.items() if isinstance(v, torch.Tensor)}
        # (by name: broadcast_parameters sends them sorted, so their order may differ between ranks)
        agree_structure("model", sorted((k, tuple(v.shape), str(v.dtype)) for k, v in tensors.items()))
        broadcast_parameters(tensors, root_rank=0, prefix="elastic.")
        others = {k: v for k, v in current.items() if k not in tensors}
        # (on every rank, even with nothing to send: a rank that skipped it would leave the others waiting)
        others = broadcast_object(others, root_rank=0, name="elastic.model.extra_state")
        if others and runtime.rank() != 0:
            self.value.load_state_dict({**tensors, **others})


class _OptimizerHandler(_Handler):
    def __init__(self, value: Any) -> None:
        if getattr(value, "zero_stage", 0):
            raise NotImplementedError(
                f"elastic training with a ZeRO optimizer (zero_stage={value.zero_stage}) is not supported yet: "
                "its shards are laid out for the old number of ranks. Use zero_stage=0 with hvd.elastic, or "
                "resume a ZeRO job from hvd.save_sharded checkpoints, which load at any rank count")
        super().__init__(value)

    def restore(self) -> None:
        _drop_pending_reductions(self.value)
        super().restore()
        self.value.zero_grad(set_to_none=True)  # (as the model's: also its parameters outside any model)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0, prefix="elastic.")


class _StatefulHandler(_Handler):
    """An object with ``state_dict``/``load_state_dict`` (a learning-rate scheduler, as Horovod's
    ``LRSchedulerStateHandler``; a ``GradScaler``; one of the user's): committed, restored and broadcast in
    place, so the object the training loop holds is the one rolled back. The rates in the optimizer travel
    with the optimizer's state. [Note: stateful objects in place] Before 2026-12-07 only schedulers were
    handled; a ``GradScaler`` was a plain value, and restore() put a copy in ``state.scaler`` while the
    loop's own scaler kept the failed steps' scale (ranks apart after a reset). An empty state (a disabled
    scaler's) is left alone: ``load_state_dict({})`` refuses it."""

    def restore(self) -> None:
        if self._saved:
            super().restore()

    def sync(self) -> None:
        state = broadcast_object(self.value.state_dict(), root_rank=0, name="elastic.stateful")
        if state:
            self.value.load_state_dict(state)


_SchedulerHandler = _StatefulHandler


class _SamplerHandler(_Handler):
    def sync(self, commit_id: int = 0) -> None:
        """Rank 0's progress, with the samples the ranks recorded at that same commit.

        record_batch marks every rank's samples alike, record_indices only this rank's own: the job's
        progress is the union of the ranks' (as Horovod's handler), but only of the ranks whose last
        commit (``commit_id``) and epoch are rank 0's. A rank that committed once more before the
        failure recorded samples that rank 0's model never trained on: in the union they were skipped
        for the rest of the epoch (and a rank already in the next epoch marked the next epoch's)."""
        state = self.value.state_dict()
        every = allgather_object((commit_id, state["epoch"], state["processed_indices"]),
                                 name="elastic.sampler.processed")
        root_commit, root_epoch, _ = every[0]
        merged = set().union(*(seen for c, e, seen in every if c == root_commit and e == root_epoch))
        self.value.load_state_dict({"epoch": root_epoch, "processed_indices": sorted(merged)})


def _drop_pending_reductions(optimizer: Any) -> None:
    """Forget a ``DistributedOptimizer``'s reductions cut short by a failure (their handles
    belong to the engine that stopped), so the next backward pass starts afresh."""
    if getattr(optimizer, "_unison_distributed", False):
        optimizer.reset_pending()


def _handler_class(value: Any) -> type[_Handler] | None:
    if isinstance(value, torch.nn.Module):
        return _ModelHandler
    if isinstance(value, torch.optim.Optimizer):
        return _OptimizerHandler
    if isinstance(value, ElasticSampler):
        return _SamplerHandler
    if isinstance(value, torch.optim.lr_scheduler.LRScheduler):  # ReduceLROnPlateau too
        return _SchedulerHandler
    if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)) \
            and not isinstance(value, type):  # a GradScaler, a user's: [Note: stateful objects in place]
        return _StatefulHandler
    return None


def _handler(value: Any) -> _Handler | None:
    cls = _handler_class(value)
    return None if cls is None else cls(value)


class TorchState(ObjectState):
    """Model, optimizer, samplers and any picklable values, committed in memory (Horovod's name).

    ``state.model``, ``state.optimizer`` and each keyword are attributes. ``commit()``
    copies the model's and optimizer's ``state_dict()``, each sampler's progress and the
    other values; ``restore()`` loads those copies; ``sync()`` broadcasts rank 0's to every
    rank (``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``) and
    commits the result, so every rank's commit is the same afterwards.

    ``restore()`` also drops the gradients (``zero_grad(set_to_none=True)`` on each model and
    optimizer): those of the step a failure cut short belong to no commit. Assigning another
    object to a tracked name (``state.model = other``) tracks it from then on and commits its
    state at once, as Horovod does.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer``, a ``DistributedOptimizer`` too (or None).
        **kwargs: more modules, optimizers, learning-rate schedulers, :class:`ElasticSampler` s,
            or picklable values.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        self._refuse_taken_names(kwargs)  # (tracked objects too: save=Module hid the method, before 2026-12-05)
        named = dict(kwargs)
        if model is not None:
            named["model"] = model
        if optimizer is not None:
            named["optimizer"] = optimizer
        self._handlers: dict[str, _Handler] = {}
        plain = {}
        for name, value in named.items():
            handler = _handler(value)
            if handler is None:
                plain[name] = value
            else:
                self._handlers[name] = handler
                setattr(self, name, value)
        super().__init__(bcast_object=_bcast_values, **plain)
        self._agrees_before_sync = True  # (_bcast_values is Unison's broadcast)

    def __setattr__(self, name: str, value: Any) -> None:
        handler = self.__dict__.get("_handlers", {}).get(name)
        if handler is not None and value is not handler.value:
            cls = _handler_class(value)
            if cls is not type(handler):
                raise TypeError(f"TorchState.{name} tracks a {type(handler.value).__name__}; assign one of the "
                                f"same kind (got {type(value).__name__}), or make a new TorchState")
            self.wait_for_spill()
            self._handlers[name] = cls(value)  # (its checks, and a commit of its state)
        super().__setattr__(name, value)

    def save(self) -> None:
        self.wait_for_spill()  # the spill reads the tensors this save copies into
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync_structure(self) -> list[str]:
        """The values' names, and each tracked object's name and kind (a sampler's seed, shuffle and
        length too): [Note: a sync agrees on what it syncs]."""
        tracked = []
        for name, handler in self._handlers.items():
            entry = f"{name}: {type(handler.value).__name__}"
            if isinstance(handler, _SamplerHandler):
                core = handler.value._core
                entry += f" (seed {core.seed}, shuffle {core.shuffle}, {core.num_samples_total} samples)"
            tracked.append(entry)
        return [*super().sync_structure(), *sorted(tracked)]

    def sync(self) -> None:
        self.agree_before_sync()  # before the first broadcast: one a rank alone made hung the others
        for _, handler in sorted(self._handlers.items()):  # (by name: each waits for its broadcast)
            if isinstance(handler, _SamplerHandler):
                handler.sync(self.commit_id)
            else:
                handler.sync()
        self._sync_values()
        self.save()

    def commit_payload(self) -> dict[str, Any]:
        return {**super().commit_payload(),
                "handlers": {name: _to_host(h._saved) for name, h in self._handlers.items()}}

    def load_commit(self, payload: dict[str, Any]) -> None:
        super().load_commit(payload)
        for name, saved in payload["handlers"].items():
            self._handlers[name]._saved = _from_host(saved)

    def reset(self) -> None:
        for handler in self._handlers.values():
            if isinstance(handler, _SamplerHandler):
                handler.value.reset()


def _bcast_values(obj: Any, root_rank: int = 0) -> Any:
    return broadcast_object(obj, root_rank=root_rank, name="elastic.values")
