"""Writes this rank's results of a fixed set of all-reduces to ``OUT/rank-R.npz``.

Run on one host and across test hosts (``tests/test_hosts_mpi.py``) with the same rank count:
the files are compared byte for byte. Inputs depend only on the rank and the tensor's index,
so two runs of the same layout feed the same numbers.
"""

from __future__ import annotations

import sys

import numpy as np

import unison
from unison.collectives import api

SIZES = (3, 1000, 70_001, 300_000, 1_500_000)  # inline, MPI-sized, ring-sized


def inputs(rank: int) -> list[np.ndarray]:
    return [np.random.default_rng([i, rank]).standard_normal(n).astype(np.float32)
            for i, n in enumerate(SIZES)]


def main(out: str) -> None:
    unison.init()
    rank = unison.rank()
    xs = inputs(rank)
    results = {}
    for algorithm in ("ring", "rhd", "auto"):
        for i, x in enumerate(xs):
            results[f"direct.{algorithm}.{i}"] = api.allreduce(x, op=unison.Sum, algorithm=algorithm)
    # the same tensors through the engine: fused in one buffer, then one at a time
    handles = [unison.allreduce_async(x, op=unison.Sum, name=f"fused.{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        results[f"engine.fused.{i}"] = unison.synchronize(h)
    for i, x in enumerate(xs):
        results[f"engine.single.{i}"] = unison.synchronize(
            unison.allreduce_async(x, op=unison.Sum, name=f"single.{i}"))
    for algorithm in ("ring", "rhd"):  # one at a time (no fusion), the algorithm forced: the same bits anywhere
        for i, x in enumerate(xs):
            results[f"engine.{algorithm}.{i}"] = unison.synchronize(
                unison.allreduce_async(x, op=unison.Sum, name=f"{algorithm}.{i}", algorithm=algorithm))
    np.savez(f"{out}/rank-{rank}.npz", **results)
    unison.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
