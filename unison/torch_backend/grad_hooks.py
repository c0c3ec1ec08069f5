"""Gradient hooks that hold their optimizer weakly and go away with it.

A distributed optimizer learns that a parameter's gradient is ready from
``register_post_accumulate_grad_hook``. A hook that is a bound method keeps the
optimizer alive as long as the parameter lives, and keeps it submitting that
gradient at every backward pass: an optimizer the user dropped (or replaced by a
new one over the same parameters) would go on reducing beside its successor,
under the same names. These hooks reach the optimizer through a weak reference,
and a finalizer removes them when it is collected.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["weak_grad_hooks"]


def weak_grad_hooks(owner: Any, params: Iterable[torch.Tensor]) -> list[Any]:
    """Register a hook on each of ``params`` that calls ``owner._on_grad(param)`` while ``owner`` lives.

    Returns the hooks' removable handles; they are removed when ``owner`` is collected.
    """
    this = weakref.ref(owner)
    hooks = [p.register_post_accumulate_grad_hook(_forward_to(this)) for p in params]
    weakref.finalize(owner, _remove, hooks)
    return hooks


def _forward_to(owner: weakref.ref[Any]) -> Any:
    def hook(p: torch.Tensor) -> None:
        target = owner()
        if target is not None:
            target._on_grad(p)  # noqa: SLF001
    return hook


def _remove(hooks: list[Any]) -> None:
    for h in hooks:
        h.remove()
