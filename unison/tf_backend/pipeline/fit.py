"""``Pipeline.fit``: epochs of pipeline steps over in-memory arrays, with Keras's progress bar on rank 0.

Every rank walks the same batches in the same (seeded) order, so the ranks agree on the number
of steps without talking. On a data x pipeline grid, each global batch of ``batch_size`` rows
is cut into ``dp`` equal shares, one per pipeline, so the result does not depend on ``dp``:
``k`` steps equal one process training on the same ``batch_size`` batches.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from unison.common.pipeline import raise_together

if TYPE_CHECKING:
    from unison.tf_backend.pipeline.executor import Pipeline

__all__: list[str] = []


def fit(pipe: Pipeline, x: Any, y: Any, batch_size: int, epochs: int = 1, verbose: int = 1,
        shuffle: bool = True, seed: int = 0) -> list[float]:
    """Train ``pipe`` on ``(x, y)``; see :meth:`Pipeline.fit`."""
    world = pipe._world
    everyone = world.allgather((_rows(x), _rows(y)))
    known = sorted({r for pair in everyone for r in pair if r is not None})
    raise_together(world, _problem(everyone, known, batch_size, epochs, pipe.grid.dp * pipe.chunks))
    n = known[0]
    steps = n // batch_size
    share = batch_size // pipe.grid.dp
    # a replica's rows: the tp pipelines of one tensor group run its shards on the same rows (pipeline =
    # replica * tp + shard; each shard read the next replica's rows, silently, before 2026-12-06)
    lo = (pipe.grid.pipeline // pipe.grid.tp) * share
    show = verbose and world.Get_rank() == 0
    history = []
    # the epochs of earlier fit calls count: a loop of fit(epochs=1) trained one order over and over (before
    # 2026-12-07; Keras's fit draws a new order at every call); the same on every rank, as each calls fit alike
    done = pipe.__dict__.get("_epochs_fitted", 0)
    for epoch in range(epochs):
        pipe._epochs_fitted = done + epoch + 1
        order = np.random.default_rng([seed, done + epoch]).permutation(n) if shuffle else np.arange(n)
        if show:
            sys.stdout.write(f"Epoch {epoch + 1}/{epochs}\n")
        bar = keras.utils.Progbar(steps, verbose=verbose, stateful_metrics=["loss"]) if show else None
        losses = []
        for step in range(steps):
            rows_now = order[step * batch_size + lo:step * batch_size + lo + share]
            losses.append(pipe.train_step(_take(x, rows_now, pipe.holds_first),
                                          _take(y, rows_now, pipe.holds_last)))
            if bar is not None:
                bar.update(step + 1, [("loss", float(np.mean(losses)))])  # the epoch's mean so far, as Keras shows
        history.append(float(np.mean(losses)))
    return history


def _rows(a: Any) -> int | None:
    """The rows of ``a`` (None: not passed). A list counts by its length: read by shape alone, a list was
    not compared, and a shorter one raised in one rank's ``_take`` while the others waited (a hang)."""
    if a is None:
        return None
    shape = getattr(a, "shape", None)
    if shape:
        return int(shape[0])
    try:
        return len(a)
    except TypeError:
        return None


def _take(a: Any, rows: np.ndarray, needed: bool) -> Any:
    return np.asarray(a)[rows] if needed and a is not None else None


def _problem(everyone: list[tuple[int | None, int | None]], known: list[int], batch_size: Any, epochs: Any,
             split: int) -> str | None:
    if not known:
        return ("fit needs x (on the ranks holding stage 0) and y (on the ranks holding the last stage); "
                "no rank passed either")
    if len(known) > 1:
        seen = "; ".join(f"rank {r}: x {xr if xr is not None else '-'}, y {yr if yr is not None else '-'}"
                         for r, (xr, yr) in enumerate(everyone))
        return (f"fit: x and y must have the same number of rows on every rank that passes them; rows passed: "
                f"{seen}. Pass the same x and y (or None) on every rank")
    for name, value in (("batch_size", batch_size), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"fit: {name} must be a positive integer; received {name}={value!r}"
    if batch_size % split:
        return (f"fit: batch_size={batch_size} must be a multiple of dp * chunks = {split} (each pipeline's "
                f"share splits into equal microbatches); use {max(split, batch_size // split * split)} or "
                f"{batch_size // split * split + split}")
    if known[0] < batch_size:
        return (f"fit: the data has {known[0]} rows, fewer than one batch of {batch_size}; use a smaller "
                "batch_size")
    return None
