"""Cutting a model's layers into pipeline stages.

A pipeline runs at the pace of its slowest stage, so the layers (with measured or estimated
per-layer costs) are cut into contiguous groups whose largest sum is as small as possible.
The result is a *balance*: the number of layers per stage, as torchgpipe calls it. The
framework backends measure costs (time or parameter counts) and call :func:`balance_by_cost`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from unison.common.pipeline.schedule import ScheduleError

__all__ = ["balance_by_cost", "check_balance"]


def balance_by_cost(costs: Sequence[float], p: int) -> list[int]:
    """Split per-layer ``costs`` into ``p`` contiguous non-empty stages, minimising the largest sum.

    Exact dynamic programming in ``O(p n^2)``. Among equally good cuts, later stages take as
    many layers as they can: under 1F1B the early stages hold the most microbatches, so they
    are the ones to keep light.

    Args:
        costs: non-negative cost of each layer, in model order.
        p: number of stages (``p * v`` for the interleaved schedule).

    Returns:
        Layers per stage; ``len == p`` and ``sum == len(costs)``.

    Raises:
        ScheduleError: ``p`` is not a positive integer, a cost is negative or not finite,
            or there are fewer layers than stages.
    """
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ScheduleError(f"p is the number of stages and must be a positive integer; received p={p!r}")
    values = [float(c) for c in costs]
    if any(not (math.isfinite(c) and c >= 0) for c in values):
        raise ScheduleError(f"layer costs must be finite and non-negative; received {values}")
    n = len(values)
    if n < p:
        raise ScheduleError(f"cannot cut {n} layers into {p} non-empty stages; use at most {n} stages "
                            "or split the model into more layers")
    prefix = [0.0]
    for c in values:
        prefix.append(prefix[-1] + c)
    # best[k][j]: the smallest possible largest sum when the first j layers form k stages.
    best = [[math.inf] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n - (p - k) + 1):
            best[k][j] = min(max(best[k - 1][i], prefix[j] - prefix[i]) for i in range(k - 1, j))
    return _cut_from_the_end(prefix, p, best[p][n])


def _cut_from_the_end(prefix: list[float], p: int, limit: float) -> list[int]:
    """The stage sizes, last stage first, each as large as ``limit`` and the rest allow."""
    slack = 1e-12 * max(1.0, prefix[-1])
    end = len(prefix) - 1
    sizes = []
    for left in range(p - 1, -1, -1):
        start = 0 if left == 0 else end - 1
        while start > left and prefix[end] - prefix[start - 1] <= limit + slack:
            start -= 1
        sizes.append(end - start)
        end = start
    return sizes[::-1]


def check_balance(balance: Sequence[int], num_layers: int, p: int, v: int = 1) -> list[int]:
    """Check that ``balance`` gives every one of ``p * v`` stages at least one of ``num_layers`` layers.

    Returns:
        The balance as a list of ints.

    Raises:
        ScheduleError: wrong length, a stage without layers or a wrong sum; the message
            gives the rule, the received balance and the fix.
    """
    stages = p * v
    want = f"p={p}" if v == 1 else f"p*v={p}*{v}={stages}"
    sizes = list(balance)
    if any(isinstance(b, bool) or not isinstance(b, numbers.Integral) for b in sizes):
        raise ScheduleError(f"balance {sizes} must hold whole numbers of layers; give {want} integers")
    sizes = [int(b) for b in sizes]  # (numpy integers too: np.array([2, 2]) was refused before 2026-12-07)
    if num_layers < stages:
        raise ScheduleError(f"the model has {num_layers} layers, too few for {stages} stages (each needs at "
                            f"least one); use at most {num_layers} stages")
    if len(sizes) != stages:
        more = "more stages than" if len(sizes) > stages else "fewer stages than"
        raise ScheduleError(f"balance {sizes} has {len(sizes)} stages, {more} the {stages} the pipeline "
                            f"runs ({want}); give {want} stage sizes that sum to {num_layers}")
    empty = [i for i, b in enumerate(sizes) if b < 1]
    if empty:
        raise ScheduleError(f"balance {sizes} gives stage {empty[0]} {sizes[empty[0]]} layers; every stage "
                            "needs at least one")
    if sum(sizes) != num_layers:
        raise ScheduleError(f"balance {sizes} sums to {sum(sizes)} but the model has {num_layers} layers; "
                            f"give {want} stage sizes that sum to {num_layers}")
    return sizes
