"""Horovod's Keras callbacks, for Keras 3."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from unison.common import runtime
from unison.common.engine import frontend
from unison.common.files import atomic_path
from unison.common.ops import Average

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback", "BackupAndRestore", "ModelCheckpoint"]


def _broadcast_all(variables: list[Any], root_rank: int, tag: str) -> None:
    for i, var in enumerate(variables):
        value = frontend.broadcast(np.asarray(var.numpy()), root_rank, f"{tag}.{i}")
        var.assign(np.asarray(value).reshape(var.shape))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from ``root_rank``'s model (and optimizer) variables."""

    def __init__(self, root_rank: int = 0) -> None:
        super().__init__()
        self.root_rank = root_rank
        self._done = False

    def on_train_begin(self, logs: Any = None) -> None:
        _broadcast_all(list(self.model.variables), self.root_rank, "BroadcastGlobalVariables.model")

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._done:  # the optimizer builds its slots at the first step
            _broadcast_all(list(self.model.optimizer.variables), self.root_rank,
                           "BroadcastGlobalVariables.optimizer")
            self._done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics over the ranks, so every rank logs the same numbers."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if isinstance(v, (int, float, np.floating)))
        values = frontend.allreduce(np.array([float(logs[k]) for k in keys]), Average,
                                    f"MetricAverage.{epoch}")
        for k, v in zip(keys, values.tolist(), strict=True):
            logs[k] = v


def _set_lr(model: Any, value: float) -> None:
    model.optimizer.learning_rate.assign(value)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """``lr = initial_lr * multiplier(epoch)`` between ``start_epoch`` and ``end_epoch``.

    ``multiplier`` is a number or a function of the (fractional, unless
    ``staircase``) epoch; ``steps_per_epoch`` enables per-batch updates.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float], start_epoch: int = 0,
                 end_epoch: int | None = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        if self._active(epoch):
            _set_lr(self.model, self.initial_lr * self.multiplier(epoch))

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.staircase or not self.steps_per_epoch:
            return
        epoch = self._epoch + batch / self.steps_per_epoch
        if self._active(epoch):
            _set_lr(self.model, self.initial_lr * self.multiplier(epoch))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the LR from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (Goyal et al.)."""

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        size = runtime.size()

        def multiplier(epoch: float) -> float:
            return (epoch * (size - 1) / warmup_epochs + 1) / size

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.end_epoch - 1 and self.verbose and runtime.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished learning-rate warmup to {self.initial_lr:g}.")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras's ``BackupAndRestore`` for a job of many ranks sharing ``backup_dir``.

    Rank 0 writes the backup (weights, then the epoch marker, each through a
    temporary file and a rename, so a crash never leaves a torn backup); every rank
    restores from it, so a resumed ``fit`` starts all ranks from the same state.
    """

    def on_train_begin(self, logs: Any = None) -> None:
        frontend.barrier()  # rank 0's last backup is complete before anyone reads it
        super().on_train_begin(logs)

    def _save_model(self) -> None:
        if runtime.rank() == 0:
            os.makedirs(self.backup_dir, exist_ok=True)
            with atomic_path(self._weights_path) as tmp:
                self.model.save_weights(tmp, overwrite=True)
            with atomic_path(self._training_metadata_path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                json.dump({"epoch": self._current_epoch, "batch": self._last_batch_seen}, f)
        frontend.barrier()

    def on_train_end(self, logs: Any = None) -> None:
        frontend.barrier()
        if runtime.rank() == 0:
            super().on_train_end(logs)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint`` that writes from rank 0 only (the others hold the same model)."""

    def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
        if runtime.rank() == 0:
            super()._save_model(epoch, batch, logs)
