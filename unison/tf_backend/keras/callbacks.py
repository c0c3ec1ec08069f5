"""Horovod's Keras callbacks, for Keras 3."""

from __future__ import annotations

import fnmatch
import functools
import itertools
import json
import logging
import os
import shutil
import uuid
from typing import Any

import keras
import numpy as np

from unison.common import runtime
from unison.common.engine import frontend, objects
from unison.common.exceptions import UnisonError
from unison.common.files import atomic_keras_save, atomic_path, makedirs_durable, remove_leftovers
from unison.keras.callbacks import (
    LearningRateScheduleCallback,  # (Horovod's schedule: one for every backend)
    MetricAverageCallback,
    agreed_optimizer_variables,
    check_broadcast_target,
    check_warmup_arguments,
    rank0_saves,
    split_layers,
)
from unison.keras.data_parallel import without_seed_states
from unison.keras.optimizer import run_deferred_agreement
from unison.tf_backend.functions import without_rank_local

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateWarmupCallback",
           "LearningRateScheduleCallback", "BackupAndRestore", "ModelCheckpoint", "BestModelCheckpoint"]

logger = logging.getLogger(__name__)


def _broadcast_all(variables: list[Any], root_rank: int, tag: str, process_set: Any = None) -> None:
    ranks = getattr(process_set, "ranks", None)
    if ranks is not None and root_rank not in ranks:
        raise ValueError(f"root_rank={root_rank} is not a member of {process_set!r}: as in Horovod, root_rank is "
                         "a rank of the job (unison.rank()) that belongs to the process set")
    root = root_rank if ranks is None else list(ranks).index(root_rank)  # the engine's root is a rank of the set
    for i, var in enumerate(without_rank_local(variables)):  # (a sharded optimizer's segments are each rank's)
        value = frontend.broadcast(np.asarray(var.numpy()), root, f"{tag}.{i}", process_set=process_set)
        var.assign(np.asarray(value).reshape(var.shape))


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from ``root_rank``'s model and optimizer variables.

    ``device`` is accepted for Horovod's signature and ignored: the broadcast runs on host memory.
    ``process_set`` broadcasts within that set only: a model with tensor-parallel layers passes
    its data-parallel group (each rank of a tensor group holds other shards); without it such a
    model raises a ``ValueError`` on every rank at ``fit`` (see
    :class:`unison.keras.BroadcastGlobalVariablesCallback`).

    The model and optimizer variables go together, before the first step, the optimizer built
    first on the ranks where it is not (a checkpoint restored on rank 0 alone: [Note: ranks that
    restored alone] in ``unison/keras/callbacks.py``); a model Keras builds in the first step (no
    ``Input``) goes with its optimizer after that step, Horovod's moment.
    """

    def __init__(self, root_rank: int = 0, device: str = "", process_set: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self._done = False

    def on_train_begin(self, logs: Any = None) -> None:
        check_broadcast_target(self.model, self.root_rank, self.process_set)
        self._done = self._broadcast("BroadcastGlobalVariables")

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._done:
            self._done = self._broadcast("BroadcastGlobalVariables.built")

    def _broadcast(self, tag: str) -> bool:
        """Broadcast the model's and optimizer's variables, unless some rank's model is still unbuilt."""
        optimizer_variables = agreed_optimizer_variables(self.model, self.process_set, f"{tag}.agree")
        if optimizer_variables is None:
            return False
        variables = without_seed_states(self.model, list(self.model.variables))  # random state stays each rank's
        _broadcast_all(variables + optimizer_variables, self.root_rank, tag, self.process_set)
        return True


def _lr(model: Any) -> float:
    return float(np.asarray(model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Horovod 0.28's warmup (Goyal et al.): the rate climbs batch by batch from about
    ``initial_lr / size`` and reaches ``initial_lr`` at the last batch of epoch ``warmup_epochs - 1``.

    At fractional epoch e (plus one step, so that epochs end on round numbers) the rate is
    ``initial_lr * ((e + 1 / steps_per_epoch) * (size - 1) / warmup_epochs + 1) / size``.

    Raises:
        ValueError: at construction, for ``warmup_epochs`` not above 0 or ``steps_per_epoch`` below 1.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        check_warmup_arguments(warmup_epochs, steps_per_epoch)

        def multiplier(epoch: float) -> float:
            size = runtime.size()  # when the rate is set, as Horovod's (an elastic job's size changes)
            epoch += 1.0 / self.steps_per_epoch
            return (epoch * (size - 1) / warmup_epochs + 1) / size

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose and runtime.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished learning-rate warmup to {_lr(self.model):g}.")


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras's ``BackupAndRestore`` for a job of many ranks; ``backup_dir`` must be readable by every rank.

    [Note: one backup, named by a manifest]
    Rank 0 writes the weights to a new, uniquely named file, then the manifest
    ``unison-backup.json`` (epoch, batch, that file's name and size), each through
    :func:`~unison.common.files.atomic_path` (temporary, fsync, rename, fsync of the
    folder). Renaming the manifest is the one step that moves the backup forward: a
    crash before it leaves the previous backup whole, a crash after it the new one,
    never new weights at an old epoch. Restores read only the file the manifest
    names; weights files it no longer names are removed after each save. With
    ``double_checkpoint=True`` the manifest also names the previous backup (whose
    weights are kept), restored when the current one cannot be loaded on some rank.

    Every rank takes part in every step, so no rank goes on alone:

    * after a save, rank 0 broadcasts its outcome: if the save failed, every rank
      raises the same error (path and reason); then every rank checks that it sees
      the new weights file, and raises on every rank if some do not (a folder that
      is not shared);
    * at restore, what each rank finds (the manifest's epoch and file, or nothing)
      is gathered; ranks that disagree raise on every rank, naming who sees what;
      a file that fails to load on any rank fails (or falls back) on every rank.
    """

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 double_checkpoint: bool = False, delete_checkpoint: bool = True) -> None:
        if not isinstance(double_checkpoint, bool):
            raise TypeError(f"double_checkpoint must be True or False, got {double_checkpoint!r}")
        super().__init__(os.fspath(backup_dir) if backup_dir else backup_dir, save_freq=save_freq,
                         double_checkpoint=double_checkpoint, delete_checkpoint=delete_checkpoint)
        self._manifest_path = os.path.join(self.backup_dir, MANIFEST)
        self._calls = itertools.count()

    def _name(self, what: str) -> str:
        """A collective name, the same on every rank (each rank makes the same calls in order)."""
        return f"unison.BackupAndRestore.{what}.{next(self._calls)}"

    # restore ---------------------------------------------------------------------------------
    def on_train_begin(self, logs: Any = None) -> None:
        if not self.model.built:
            raise ValueError(f"BackupAndRestore needs a built model before fit(); model {self.model.name} is "
                             "not built. Build it first (model.build(input_shape) or call it on a batch)")
        if _sharded_optimizer(self.model.optimizer):  # (its save writes no optimizer variable: see below)
            raise ValueError(f"BackupAndRestore saves the weights file Keras writes, where a sharded optimizer "
                             f"(zero_stage 1/2) keeps no state: {type(self.model.optimizer).__name__}'s moments "
                             "and step count would start fresh on resume. Save and resume it with "
                             "unison.tf_backend.save_sharded / load_sharded (docs/zero.md), or use zero_stage=0")
        split = split_layers(self.model)
        if split:  # rank 0 writes its weights only: they would come back as every rank's shards
            raise ValueError(f"BackupAndRestore saves rank 0's weights, but the model's layers {split[:3]} are "
                             "split over a tensor group (each rank holds other shards): save and restore it "
                             "with save_tensor_parallel / load_tensor_parallel instead")
        frontend.barrier()  # rank 0's last save or deletion is complete before anyone reads
        manifest = self._agreed_manifest()
        if manifest is None:
            return
        entries = [manifest["current"]]
        if self.double_checkpoint and manifest.get("previous"):
            entries.append(manifest["previous"])
        failures = []
        for entry in entries:
            failed = self._load_everywhere(entry)
            if not failed:
                self.model._initial_epoch = int(entry["epoch"])
                return
            failures.append(failed)
        raise UnisonError(f"BackupAndRestore cannot resume from the backup in {self.backup_dir!r}: "
                          + "; then ".join(failures) + ". Delete the folder to start from scratch"
                          + ("" if self.double_checkpoint else
                             ", or pass double_checkpoint=True to keep the previous backup as well"))

    def _agreed_manifest(self) -> dict | None:
        """This rank's manifest, once every rank has found the same one.

        Raises:
            UnisonError: on every rank, when ranks found different things or none could read it.
        """
        manifest, seen = _read_manifest(self._manifest_path)
        views = objects.allgather_object((seen, self.backup_dir), self._name("restore"))
        if len({s for s, _ in views}) > 1:
            groups: dict[str, list[int]] = {}
            for r, (s, folder) in enumerate(views):
                groups.setdefault(f"{s} in {folder!r}", []).append(r)
            found = "; ".join(f"{_ranks(rs)} {'sees' if len(rs) == 1 else 'see'} {what}"
                              for what, rs in groups.items())
            raise UnisonError(f"BackupAndRestore: the ranks found different backups, so they would resume from "
                              f"different states: {found}. Every rank must read the same backup: give "
                              "backup_dir a folder every rank can read (on a shared filesystem), the same "
                              "one on every rank")
        if manifest is None and seen != _NONE:
            raise UnisonError(f"BackupAndRestore cannot resume: {seen}. Delete {self._manifest_path!r} to "
                              "start from scratch")
        return manifest

    def _load_everywhere(self, entry: dict) -> str:
        """Load ``entry``'s weights on every rank; '' if all succeeded, else what failed where."""
        path = os.path.join(self.backup_dir, entry["weights"])
        error = ""
        try:
            _check_size(path, int(entry["size"]))
            if self.model.optimizer is not None and not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)  # its variables are saved too
            # (a check another rank's build just ran: [Note: a build check left for later])
            run_deferred_agreement(self.model.optimizer)
            self.model.load_weights(path)
        except Exception as exc:  # every rank must learn of it, not just this one
            error = f"{type(exc).__name__}: {exc}"
        errors = objects.allgather_object(error, self._name("load"))
        failed = {r: e for r, e in enumerate(errors) if e}
        return "; ".join(f"rank {r} could not load {path!r} (epoch {entry['epoch']}): {e}"
                         for r, e in failed.items())

    # save ------------------------------------------------------------------------------------
    def _save_model(self) -> None:
        error, name = None, None
        if runtime.rank() == 0:
            try:
                name = self._write_backup()
            except Exception as exc:  # shared with every rank below, then raised
                error = f"{type(exc).__name__}: {exc}"
                logger.error("BackupAndRestore: saving the backup in %s failed", self.backup_dir,
                             exc_info=True)
        error, name, folder = objects.broadcast_object((error, name, self.backup_dir), 0, self._name("save"))
        if error is not None:
            raise UnisonError(f"BackupAndRestore: rank 0 could not save the backup of epoch {self._current_epoch} "
                              f"in {folder!r}: {error}. Training stops on every rank so none goes on without "
                              "a backup; give backup_dir a folder rank 0 can write (with free space)")
        self._check_visible(name, folder)

    def _write_backup(self) -> str:
        """Rank 0: write the weights under a new name, then the manifest naming them; return the name."""
        makedirs_durable(self.backup_dir)  # (a new folder's entry flushed too)
        name = f"backup-e{self._current_epoch}-b{self._last_batch_seen}-{uuid.uuid4().hex[:12]}.weights.h5"
        path = os.path.join(self.backup_dir, name)
        _write_weights(self.model, path)
        entry = {"epoch": self._current_epoch, "batch": self._last_batch_seen, "weights": name,
                 "size": os.path.getsize(path)}
        manifest: dict[str, Any] = {"format": 1, "current": entry}
        if self.double_checkpoint:
            last, _ = _read_manifest(self._manifest_path)
            if last is not None:
                manifest["previous"] = last["current"]
        _write_manifest(self._manifest_path, manifest)
        try:  # (the backup is committed: tidying up must not fail it, or stop every rank's training)
            _remove_unnamed(self.backup_dir, manifest)
        except OSError as exc:
            logger.warning("BackupAndRestore: the backup of epoch %s in %s is saved, but removing older backup "
                           "files failed (%s: %s); the next save tries again", self._current_epoch,
                           self.backup_dir, type(exc).__name__, exc)
        return name

    def _check_visible(self, name: str, folder: str) -> None:
        """Every rank sees the weights rank 0 just wrote, or every rank raises."""
        sees = os.path.exists(os.path.join(self.backup_dir, name))
        views = objects.allgather_object((sees, self.backup_dir), self._name("visible"))
        blind = [r for r, (s, _) in enumerate(views) if not s]
        if blind:
            where = "; ".join(f"rank {r} looks in {views[r][1]!r}" for r in blind)
            raise UnisonError(f"BackupAndRestore: {_ranks(blind)} cannot see the backup rank 0 just wrote "
                              f"({name} in {folder!r}; {where}), so they could not resume from it. Give "
                              "backup_dir a folder every rank can read (on a shared filesystem), the same one "
                              "on every rank")

    def on_train_end(self, logs: Any = None) -> None:
        error = None
        if runtime.rank() == 0 and self.delete_checkpoint and os.path.exists(self.backup_dir):
            try:
                shutil.rmtree(self.backup_dir)
            except Exception as exc:  # shared with every rank below, then raised
                error = f"{type(exc).__name__}: {exc}"
        error = objects.broadcast_object(error, 0, self._name("delete"))
        if error is not None:
            raise UnisonError(f"BackupAndRestore: rank 0 could not delete the finished backup in "
                              f"{self.backup_dir!r}: {error}. A later fit would resume from it; delete it "
                              "by hand, or pass delete_checkpoint=False to keep it on purpose")


MANIFEST = "unison-backup.json"
_NONE = "no backup"


def _sharded_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` (or the optimizer a ``LossScaleOptimizer`` wraps) keeps ZeRO shards."""
    from unison.tf_backend.zero_optimizer import is_sharded

    inner = getattr(optimizer, "inner_optimizer", None)
    return optimizer is not None and (is_sharded(optimizer) or is_sharded(inner))


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _read_manifest(path: str) -> tuple[dict | None, str]:
    """The manifest at ``path`` (None if absent or unreadable) and a one-line account of what was found."""
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        entry = manifest["current"]
        return manifest, f"the backup of epoch {entry['epoch']} ({entry['weights']})"
    except (FileNotFoundError, NotADirectoryError):  # no such file, or no such folder
        return None, _NONE
    except Exception as exc:  # reported to every rank by the caller
        return None, f"an unreadable manifest {path!r} ({type(exc).__name__}: {exc})"


def _check_size(path: str, size: int) -> None:
    found = os.path.getsize(path)
    if found != size:
        raise OSError(f"{path!r} holds {found} bytes, the manifest says {size}: the file is damaged")


def _write_weights(model: Any, path: str) -> None:
    with atomic_path(path) as tmp:
        model.save_weights(tmp, overwrite=True)


def _write_manifest(path: str, manifest: dict) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def _remove_unnamed(folder: str, manifest: dict) -> None:
    """Remove backup weights the manifest no longer names (older saves, saves cut short before it).

    Raises:
        OSError: the first entry that could not be removed, once the others were (a directory where a
            stale weights file was expected: before 2026-12-07 it stopped every rank's training, although
            the backup had been saved).
    """
    keep = {e["weights"] for e in (manifest["current"], manifest.get("previous")) if e}
    failed: list[OSError] = []
    for entry in os.listdir(folder):
        if fnmatch.fnmatch(entry, _WEIGHTS_PATTERN) and entry not in keep:
            try:
                os.remove(os.path.join(folder, entry))
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append(exc)
    remove_leftovers(folder, _WEIGHTS_PATTERN)
    if failed:
        raise failed[0]


_WEIGHTS_PATTERN = "backup-*.weights.h5"


def _strategy_model(model: Any) -> bool:
    from unison.tf_backend.strategy import _unison_model

    return _unison_model(model)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint`` that writes from rank 0 only (the others hold the same model)."""

    def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
        rank0_saves("ModelCheckpoint", lambda: self._save_on_rank0(epoch, batch, logs))

    def _save_on_rank0(self, epoch: int, batch: Any, logs: Any) -> None:
        model = self.model
        if _strategy_model(model):
            super()._save_model(epoch, batch, logs)  # (the strategy's save is atomic already)
            return
        # Keras writes the file in place: a save that failed part-way destroyed the last good checkpoint
        # (before 2026-12-05, for models outside a UnisonStrategy); through a temporary file and a rename
        saves = {name: getattr(model, name) for name in ("save", "save_weights")}
        for name, save in saves.items():
            model.__dict__[name] = functools.partial(atomic_keras_save, save)
        try:
            super()._save_model(epoch, batch, logs)
        finally:
            for name in saves:
                model.__dict__.pop(name, None)


class BestModelCheckpoint(ModelCheckpoint):
    """Horovod's ``BestModelCheckpoint``: rank 0 saves the model each time ``monitor`` improves.

    A :class:`ModelCheckpoint` with ``save_best_only=True`` (the whole model, not only
    the weights). As in Horovod, the path is not an argument: set ``filepath`` on the
    callback before ``fit`` (Horovod's Spark estimator does); ``filepath=`` is also
    accepted here as a keyword, a Unison addition.

    Raises:
        ValueError: at the first save, on every rank, when no ``filepath`` was set.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | os.PathLike[str] | None = None) -> None:
        # Keras checks the file name's extension at construction; the real path may come later
        super().__init__(os.fspath(filepath) if filepath is not None else "unset.keras", monitor=monitor,
                         verbose=verbose, save_best_only=True, save_weights_only=False, mode=mode,
                         save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
        if self.filepath is None:
            raise ValueError("BestModelCheckpoint has no filepath; set `callback.filepath = "
                             "'best.keras'` (a .keras or .h5 file) before fit(), or pass filepath=")
        super()._save_model(epoch, batch, logs)
