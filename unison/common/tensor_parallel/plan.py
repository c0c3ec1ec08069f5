"""Tensor-parallel plans: which layer of an existing model becomes which parallel layer.

A plan maps regular expressions over layer paths (``"blocks.0.mlp.fc1"``; a path matches when
the whole path matches) to a style::

    {r"blocks\\.\\d+\\.mlp\\.fc1": "colwise",                   ColumnParallelLinear
     r"blocks\\.\\d+\\.mlp\\.fc2": "rowwise",                   RowParallelLinear
     "embed": "vocab",                                      VocabParallelEmbedding
     "head": {"style": "colwise", "gather_output": True}}   options of the parallel layer

This module does the part that needs no framework: it matches the plan against the model's
``(path, kind)`` list and checks it, so both backends give the same answer and the same errors.
A backend lists its layers (kind ``"linear"``, ``"embedding"``, or any other name for a layer
no style accepts) and does the module surgery with what :func:`resolve_plan` returns. Every
rank holds the same model and plan, so a bad plan raises the same error on every rank, before
any layer is replaced or any collective runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

__all__ = ["Placement", "resolve_plan", "STYLES"]

#: style -> (the layer kind it splits, the options it takes, with their defaults)
STYLES: dict[str, tuple[str, dict[str, bool]]] = {
    "colwise": ("linear", {"gather_output": False}),
    "rowwise": ("linear", {"input_is_parallel": True}),
    "vocab": ("embedding", {}),
}
_PATHS_SHOWN = 8


class Placement(NamedTuple):
    """What one layer becomes: its ``style`` and the parallel layer's options (defaults filled in)."""

    style: str
    options: dict[str, bool]


def _entry(pattern: str, value: Any) -> Placement:
    """One plan value (a style name or ``{"style": ..., option: ...}``) checked and with defaults."""
    options = dict(value) if isinstance(value, Mapping) else {"style": value}
    style = options.pop("style", None)
    if style not in STYLES:
        raise ValueError(f"plan entry {pattern!r}: the style must be one of {sorted(STYLES)}; received "
                         f"{value!r}. Write e.g. {{{pattern!r}: 'colwise'}} or "
                         f"{{{pattern!r}: {{'style': 'colwise', 'gather_output': True}}}}")
    allowed = STYLES[style][1]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"plan entry {pattern!r}: style {style!r} takes the options {sorted(allowed)}; "
                         f"received {unknown}")
    bad = {k: v for k, v in options.items() if not isinstance(v, bool)}
    if bad:
        raise ValueError(f"plan entry {pattern!r}: options are True or False; received {bad}")
    return Placement(style, {**allowed, **options})


def _compile(pattern: Any) -> re.Pattern[str]:
    if not isinstance(pattern, str):
        raise ValueError(f"plan keys are regular expressions (str) over layer paths; received {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(f"plan entry {pattern!r} is not a valid regular expression ({err}); escape dots "
                         r"as '\.' and check brackets") from err


def _some(paths: Sequence[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:_PATHS_SHOWN])
    more = f" and {len(paths) - _PATHS_SHOWN} more" if len(paths) > _PATHS_SHOWN else ""
    return f"[{shown}{more}]" if paths else "[] (the model has no layers inside it)"


def _check_kind(pattern: str, path: str, kind: str, style: str, kind_names: Mapping[str, str]) -> None:
    want = STYLES[style][0]
    if kind != want:
        raise ValueError(f"plan entry {pattern!r}: style {style!r} splits a {kind_names.get(want, want)} layer, "
                         f"but {path!r} is a {kind_names.get(kind, kind)}; narrow the regular expression or "
                         f"use {[s for s, (k, _) in STYLES.items() if k == kind] or 'no style'} for it")


def resolve_plan(layers: Sequence[tuple[str, str]], plan: Mapping[str, Any],
                 kind_names: Mapping[str, str] | None = None) -> dict[str, Placement]:
    """Match ``plan`` against a model's layers; returns ``{path: Placement}`` in ``layers`` order.

    Args:
        layers: ``(path, kind)`` of every layer that may be matched, in the model's order; kind
            is ``"linear"``, ``"embedding"`` or any other name (a layer no style splits).
        plan: regular expression (matched against the whole path) -> style name
            (``"colwise"``, ``"rowwise"``, ``"vocab"``) or ``{"style": name, option: bool}``
            (``gather_output`` for colwise, ``input_is_parallel`` for rowwise).
        kind_names: how the backend calls each kind in messages (``{"linear": "torch.nn.Linear"}``).

    Raises:
        ValueError: an unknown style or option, a key that is not a valid regular expression, a
            key that matches no path (the message lists some paths), a path matched by two keys,
            or a match whose kind the style does not split.
    """
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(f"the plan must be a non-empty dict of regular expression -> style; received {plan!r}")
    names = dict(kind_names or {})
    entries = [(_compile(pattern), _entry(pattern, value)) for pattern, value in plan.items()]
    paths = [path for path, _ in layers]
    chosen: dict[str, tuple[str, Placement]] = {}
    for regex, placement in entries:
        hits = [(path, kind) for path, kind in layers if regex.fullmatch(path)]
        if not hits:
            raise ValueError(f"plan entry {regex.pattern!r} matches no layer path (the whole path must match); "
                             f"the model's paths are {_some(paths)}")
        for path, kind in hits:
            if path in chosen:
                raise ValueError(f"layer {path!r} is matched by two plan entries, {chosen[path][0]!r} and "
                                 f"{regex.pattern!r}; make the regular expressions exclusive")
            _check_kind(regex.pattern, path, kind, placement.style, names)
            chosen[path] = (regex.pattern, placement)
    return {path: chosen[path][1] for path in paths if path in chosen}
