"""How many bytes per parameter each ZeRO stage should hold on one rank: the formula benchmarks check.

With ``P`` parameter elements on ``N`` ranks, weights of ``w`` bytes, gradients of ``g`` bytes and
optimizer state of ``k`` bytes per element (Adam in fp32: 8, the two moments; fp32 master weights of
half-precision parameters add 4 more), a rank holds::

    stage 0:  (w + g + k) * P            plain data parallelism (16 P for Adam in fp32)
    stage 1:  (w + g) * P + k * P / N    the optimizer state sharded
    stage 2:  w * P + (g + k) * P / N    the gradients too
    stage 3:  (w + g + k) * P / N        the weights too

plus the declared working buffers (the buckets in flight, a gathered layer under stage 3), which
:func:`formula_bytes` takes as an argument rather than guessing.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from unison.common.zero.plan import check_stage

__all__ = ["BytesPerParam", "formula_bytes"]


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter element: ``weights``, ``grads`` and ``optimizer`` state (``master`` included)."""

    weights: int = 4
    grads: int = 4
    optimizer: int = 8

    @classmethod
    def adam(cls, param_bytes: int = 4, master_weights: bool = False) -> BytesPerParam:
        """Adam's two moments in fp32, plus fp32 master weights for half-precision parameters."""
        return cls(param_bytes, param_bytes, 8 + (4 if master_weights else 0))


def formula_bytes(stage: int, params: int, world: int, per: BytesPerParam = BytesPerParam(),
                  working_bytes: int = 0) -> int:
    """Bytes one rank should hold at ``stage`` (see the module docstring).

    Raises:
        ValueError: ``stage`` outside 0-3, ``world`` < 1 or ``params`` < 0.
    """
    stage = check_stage(stage)
    whole = all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (world, params))
    if not whole or world < 1 or params < 0:  # (2.5 ranks or 10.5 parameters gave a number before 2026-12-07)
        raise ValueError(f"formula_bytes needs integers world >= 1 and params >= 0; got world={world!r}, "
                         f"params={params!r}")
    if min(per.weights, per.grads, per.optimizer) < 0:
        raise ValueError(f"formula_bytes: bytes per parameter must be >= 0; got {per}")
    w, g, k = per.weights * params, per.grads * params, per.optimizer * params
    sharded = {0: 0, 1: k, 2: g + k, 3: w + g + k}[stage]
    return int(w + g + k - sharded + sharded / world) + int(working_bytes)
