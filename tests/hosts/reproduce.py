"""Writes this rank's results of a fixed workload to ``OUT/rank-R.npz``: ``reproduce.py OUT [MODE]``.

Run on one host and across test hosts (``tests/test_hosts_mpi.py``) with the same rank count:
the files are compared byte for byte. Inputs depend only on the rank and the tensor's index (or
the training step), so two runs of the same layout feed the same numbers. Modes:

* ``collectives`` (the default): the all-reduces below, directly with each algorithm and through
  the engine (fused, one at a time, and one at a time with the algorithm forced);
* ``rounds``: the same tensors through the engine, fused, :data:`ROUNDS` times over, for a run
  with ``UNISON_AUTOTUNE=1`` whose trials change the fusion threshold (and cycle time) between and
  within rounds;
* ``train``: :data:`STEPS` steps of ``DistributedOptimizer`` (SGD with momentum) on a seeded MLP,
  each rank on its own batches; the weights at the end.
"""

from __future__ import annotations

import sys

import numpy as np

import unison
from unison.collectives import api

SIZES = (3, 1000, 70_001, 300_000, 1_500_000)  # inline, MPI-sized, ring-sized
ROUNDS = 12  # autotune's trials: 6 fusion thresholds, then 5 cycle times
STEPS = 4
BATCH = 8


def inputs(rank: int) -> list[np.ndarray]:
    return [np.random.default_rng([i, rank]).standard_normal(n).astype(np.float32)
            for i, n in enumerate(SIZES)]


def collectives(xs: list[np.ndarray]) -> dict[str, np.ndarray]:
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
    return results


def rounds(xs: list[np.ndarray]) -> dict[str, np.ndarray]:
    results = {}
    for k in range(ROUNDS):
        handles = [unison.allreduce_async(x, op=unison.Sum, name=f"tuned.{i}") for i, x in enumerate(xs)]
        for i, h in enumerate(handles):
            results[f"engine.tuned.{k}.{i}"] = unison.synchronize(h)
    return results


def train(rank: int) -> dict[str, np.ndarray]:
    import torch

    import unison.torch_backend as hvd

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64),
                                torch.nn.Tanh(), torch.nn.Linear(64, 1))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 1, generator=g)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return {f"train.{name}": p.detach().numpy().copy() for name, p in model.named_parameters()}


def main(out: str, mode: str = "collectives") -> None:
    unison.init()
    rank = unison.rank()
    if mode == "collectives":
        results = collectives(inputs(rank))
    elif mode == "rounds":
        results = rounds(inputs(rank))
    elif mode == "train":
        results = train(rank)
    else:
        raise ValueError(f"mode {mode!r} is not one of collectives, rounds, train")
    np.savez(f"{out}/rank-{rank}.npz", **results)
    unison.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
