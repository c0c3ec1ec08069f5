"""Where this rank sits in a tensor group (a registered process set), and the group's agreement on how a
layer was built; both backends' layers ask."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.engine.objects import agree_on_values
from unison.common.engine.process_sets import ProcessSet, set_rank, set_size

__all__ = ["group_position", "agree_on_layer", "describe"]


def group_position(process_set: ProcessSet, owner: str) -> tuple[int, int]:
    """``(tp, shard index)`` of this rank in the tensor group ``process_set``.

    Raises:
        ValueError: this rank is not a member of ``process_set``.
    """
    tp, index = set_size(process_set), set_rank(process_set)
    if index < 0:
        raise ValueError(f"{owner}: this rank ({runtime.rank()}) is not in the tensor group {process_set!r}; "
                         "build tensor-parallel layers only on the ranks of their group")
    return tp, index


def describe(value: Any) -> str:
    """A text for ``value`` that is the same on every rank when the ranks passed the same thing: a function by
    its module and name (its ``repr`` holds an address), a partial by its function and arguments, a numpy
    scalar as the Python number it holds, an object with a configuration (a Keras layer or activation) by its
    class and configuration without its name (a per-process counter), other objects by their ``repr`` when it
    holds no address, else by their class."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, functools.partial):
        return f"partial({describe(value.func)}, {value.args!r}, {sorted(value.keywords.items())!r})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if callable(getattr(value, "get_config", None)):
        try:
            config = {k: v for k, v in value.get_config().items() if k != "name"}
        except Exception:  # noqa: BLE001 - no usable configuration: described as other objects are
            pass
        else:
            return f"{kind}({sorted((k, describe(v)) for k, v in config.items())})"
    text = repr(value)
    if " at 0x" in text:
        return f"a {kind}"
    return text


def agree_on_layer(owner: str, process_set: ProcessSet, **fields: Any) -> None:
    """Return when every rank of the tensor group built ``owner`` with the same ``fields`` (sizes, options,
    dtype); else raise :class:`~unison.common.exceptions.MismatchError` on every rank of the group, naming the
    fields that differ and where.

    [Note: a layer built alike on every rank] Each rank of a tensor group holds 1/tp of ONE layer, so every
    rank must build it with the same arguments. Before 2026-12-05 nothing checked it: a vocabulary, a width or
    a head count that differed on one rank ran and gave wrong values silently (each rank's shard is cut from
    its own sizes), and ``gather_output`` or ``sequence_parallel`` on one rank only left the others waiting in
    a collective it never made. The check runs when the layer is built, which is eager in both frameworks (a
    first forward may be traced or compiled); building one is thus collective over its group, as its forward
    is. One 16-byte all-gather per layer or block (a block's layers check theirs too); none for a group of one.
    """
    if set_size(process_set) <= 1:
        return
    values = {"layer": owner, **{key: describe(value) for key, value in fields.items()}}
    agree_on_values(owner, values, process_set=process_set,
                    fix="Every rank of a tensor group must build each parallel layer with the same arguments "
                        "(each holds one shard of one layer)")
