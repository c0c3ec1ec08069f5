"""Keras's own callbacks that write files, under ``DataParallel.fit``: rank 0 alone writes.

[Note: rank-0-only files under fit] Keras's ``CSVLogger`` wrote the same file from every rank (nothing
ordered the writes) and ``TensorBoard`` an event file per rank in one folder (duplicate runs), until
2026-12-06 (found by an audit). Now they run on rank 0 alone, inside :class:`OnRank0` on every rank: a
failure in a hook every rank reaches together (train, epoch and validation begin and end) raises a
``UnisonError`` on every rank (one small broadcast per such hook); one in a batch hook raises on rank 0
only. Only exactly these classes: a subclass may do more than write (a collective), and runs on every rank.

Keras's ``ModelCheckpoint`` saved through rank 0's ``save``, so a failed write raised on rank 0 alone and
the others trained on into a collective rank 0 never joined: its ``_save_model`` now runs on rank 0 with the
outcome shared (``rank0_saves``, as ``unison.keras.callbacks.ModelCheckpoint``): a ``UnisonError`` on every
rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from unison.common import runtime
from unison.common.engine import objects
from unison.common.exceptions import UnisonError

__all__: list[str] = []

#: Keras's callbacks that only write files: under DataParallel rank 0 alone runs them
RANK0_WRITERS = (keras.callbacks.CSVLogger, keras.callbacks.TensorBoard)
_SHARED_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_test_begin",
                 "on_test_end")
_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end")


def shared_outcome(run: Callable[[], Any],
                   name: str | None = None) -> tuple[Any, str | None, BaseException | None]:
    """``run()`` on rank 0: (its result there, its failure as text on every rank or None, the exception on
    rank 0). Collective: every rank calls it at one point. ``name`` names the collective, so that the
    deadlock check's report says what a rank that never comes should have done."""
    result, error, cause = None, None, None
    if runtime.rank() == 0:
        try:
            result = run()
        except Exception as exc:  # shared with every rank below
            error, cause = f"{type(exc).__name__}: {exc}", exc
    if runtime.size() > 1:
        error = objects.broadcast_object(error, 0, name)
    return result, error, cause


def on_rank0(what: str, run: Callable[[], Any]) -> None:
    """``run()`` on rank 0, its failure raised on every rank (collective: every rank calls it at one point)."""
    _, error, cause = shared_outcome(run)
    if error is not None:
        raise UnisonError(f"{what} failed on rank 0, which alone runs it under DataParallel ({error}); every "
                          "rank stops") from cause


class OnRank0(keras.callbacks.Callback):
    """``inner`` (a Keras callback) run by rank 0 alone; see [Note: rank-0-only files under fit]."""

    def __init__(self, inner: keras.callbacks.Callback) -> None:
        super().__init__()
        self.inner = inner

    def set_model(self, model: Any) -> None:
        """The inner callback's ``set_model`` on rank 0 alone: ``TensorBoard``'s creates its folders there
        (each rank made its own before 2026-12-06 evening, found when the tests ran with tensorboard
        installed); a failure raises on every rank (each reaches it when ``fit`` builds its callbacks)."""
        super().set_model(model)
        on_rank0(f"{type(self.inner).__name__}.set_model", lambda: self.inner.set_model(model))

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        self.inner.set_params(params)


def _shared(name: str) -> Callable[..., None]:
    def hook(self: OnRank0, *args: Any, **kwargs: Any) -> None:
        on_rank0(f"{type(self.inner).__name__}.{name}", lambda: getattr(self.inner, name)(*args, **kwargs))
    return hook


def _rank0_only(name: str) -> Callable[..., None]:
    def hook(self: OnRank0, *args: Any, **kwargs: Any) -> None:
        if runtime.rank() == 0:
            getattr(self.inner, name)(*args, **kwargs)
    return hook


for _name in _SHARED_HOOKS:
    setattr(OnRank0, _name, _shared(_name))
for _name in _BATCH_HOOKS:
    setattr(OnRank0, _name, _rank0_only(_name))


def fit_callbacks(callbacks: list[Any]) -> list[Any]:
    """``fit``'s callbacks under DataParallel: Keras's file writers in :class:`OnRank0`, Keras's own
    ``ModelCheckpoint`` sharing a failed write with every rank (see the module's note)."""
    from unison.keras.callbacks import rank0_saves

    kept = []
    for cb in callbacks:
        if type(cb) in RANK0_WRITERS:
            cb = OnRank0(cb)
        elif type(cb) is keras.callbacks.ModelCheckpoint and "_save_model" not in cb.__dict__:
            def shared(*args: Any, _save: Callable[..., Any] = cb._save_model, **kwargs: Any) -> Any:
                return rank0_saves("ModelCheckpoint", lambda: _save(*args, **kwargs))

            cb._save_model = shared
        kept.append(cb)
    return kept
