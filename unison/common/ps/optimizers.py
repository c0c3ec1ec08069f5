"""Server-side optimizers of a sharded table: the shard applies pushed gradients to its rows.

Lazy: only the rows a push touches change, and only their per-row state (Adagrad's sum of
squares, Adam's moments and step count). For SGD and Adagrad that is exactly what the dense
optimizer does with a gradient that is zero on untouched rows (PyTorch's ``torch.optim.SGD`` and
``torch.optim.Adagrad`` formulas, defaults included), so a table trained with BSP matches dense
data-parallel training. Adam counts steps per row (each row's bias correction uses the number
of times that row was updated) with torch's formula; it is not dense Adam's update, nor TF-Addons'
``LazyAdam``'s (which uses the optimizer's global step and places epsilon otherwise), nor
``torch.optim.SparseAdam``'s (which counts steps per tensor: a row first updated at the optimizer's
fourth step moves by less there than a row's first update here).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["SGD", "Adagrad", "Adam", "Optimizer", "optimizer_from_config", "rows_of"]


def rows_of(array: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``array[index]`` (a copy of whole rows): ``np.take`` gathers rows ~3x faster than fancy indexing
    when the table is out of cache (10k rows of 64 float32 from 128 MB: 0.26 ms against 0.8 ms)."""
    return np.take(array, index, axis=0)


def _descend(weights: np.ndarray, local: np.ndarray, step: np.ndarray) -> None:
    """``weights[local] -= step``, gathering the rows with :func:`rows_of`."""
    rows = rows_of(weights, local)
    rows -= step
    weights[local] = rows


def _scaled(grads: np.ndarray, scale: float) -> np.ndarray:
    return grads if scale == 1.0 else grads * np.asarray(scale, grads.dtype)


@dataclass
class Optimizer:
    """Base: ``state_names`` are per-row arrays of the shard's shape (``steps`` is per row, 1-D)."""

    lr: float = 0.01
    state_names: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        self.lr = _real(self, "lr", self.lr, "the learning rate")

    def _non_negative(self, *names: str) -> None:
        """Check the named fields as :func:`_real` does, and that they are not negative (torch's rules)."""
        for name in names:
            value = _real(self, name, getattr(self, name), name)
            if value < 0:
                raise ValueError(f"{type(self).__name__}({name}={value!r}) must not be negative")
            setattr(self, name, value)

    def init_state(self, rows: int, dim: int, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {}

    def apply(
        self, weights: np.ndarray, state: dict[str, np.ndarray], local: np.ndarray, grads: np.ndarray,
        scale: float = 1.0,
    ) -> None:
        """Update ``weights[local]`` (unique local rows) with ``scale * grads`` in place."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "state_names"}
        out["name"] = type(self).__name__
        return out


def _real(opt: Optimizer, name: str, value: Any, what: str) -> float:
    """``value`` as a Python float: any finite real number, numpy's scalars included (not a bool)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{type(opt).__name__}({name}={value!r}): {what} must be a finite real number")
    return float(value)


@dataclass
class SGD(Optimizer):
    """``w -= lr * g`` on the pushed rows."""

    def apply(
        self, weights: np.ndarray, state: dict[str, np.ndarray], local: np.ndarray, grads: np.ndarray,
        scale: float = 1.0,
    ) -> None:
        _descend(weights, local, np.asarray(self.lr * scale, weights.dtype) * grads)  # the scale folded in


@dataclass
class Adagrad(Optimizer):
    """``sum += g*g; w -= lr * g / (sqrt(sum) + eps)`` per row (``torch.optim.Adagrad``'s defaults)."""

    initial_accumulator_value: float = 0.0
    eps: float = 1e-10

    def __post_init__(self) -> None:
        super().__post_init__()
        self._non_negative("initial_accumulator_value", "eps")  # a negative sum's root is NaN
        self.state_names = ("sum",)

    def init_state(self, rows: int, dim: int, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {"sum": np.full((rows, dim), self.initial_accumulator_value, dtype)}

    def apply(
        self, weights: np.ndarray, state: dict[str, np.ndarray], local: np.ndarray, grads: np.ndarray,
        scale: float = 1.0,
    ) -> None:
        grads = _scaled(grads, scale)
        acc = rows_of(state["sum"], local) + grads * grads
        state["sum"][local] = acc
        _descend(weights, local,
                 np.asarray(self.lr, weights.dtype) * grads / (np.sqrt(acc) + np.asarray(self.eps, acc.dtype)))


@dataclass
class Adam(Optimizer):
    """Adam with per-row moments and a per-row step count for the bias correction (lazy Adam)."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self) -> None:
        super().__post_init__()
        self._non_negative("eps")
        for name in ("beta1", "beta2"):
            value = _real(self, name, getattr(self, name), name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"Adam({name}={value!r}) must be in [0, 1)")
            setattr(self, name, value)
        self.state_names = ("m", "v", "steps")

    def init_state(self, rows: int, dim: int, dtype: np.dtype) -> dict[str, np.ndarray]:
        return {
            "m": np.zeros((rows, dim), dtype),
            "v": np.zeros((rows, dim), dtype),
            "steps": np.zeros(rows, np.int64),
        }

    def apply(
        self, weights: np.ndarray, state: dict[str, np.ndarray], local: np.ndarray, grads: np.ndarray,
        scale: float = 1.0,
    ) -> None:
        grads = _scaled(grads, scale)
        t = rows_of(state["steps"], local) + 1
        state["steps"][local] = t
        m = self.beta1 * rows_of(state["m"], local) + (1.0 - self.beta1) * grads
        v = self.beta2 * rows_of(state["v"], local) + (1.0 - self.beta2) * grads * grads
        state["m"][local], state["v"][local] = m, v
        c1 = (1.0 - self.beta1 ** t.astype(np.float64))[:, None]
        c2 = (1.0 - self.beta2 ** t.astype(np.float64))[:, None]
        step = self.lr * (m / c1) / (np.sqrt(v / c2) + self.eps)
        _descend(weights, local, step.astype(weights.dtype))


_KINDS: dict[str, type[Optimizer]] = {"SGD": SGD, "Adagrad": Adagrad, "Adam": Adam}


def optimizer_from_config(config: dict[str, Any]) -> Optimizer:
    args = dict(config)
    return _KINDS[args.pop("name")](**args)
