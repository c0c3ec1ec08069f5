"""FSDP2 against one process, shared by the unison-backend rank suites (1-D mesh at np 3, HSDP at np 4)."""

from __future__ import annotations

from typing import Any

import torch


def sgd_steps(model: torch.nn.Module, batches: list, lr: float, rows: slice = slice(None)) -> None:
    """SGD with momentum 0.9 on the mean squared error, one step per (x, y) batch, on ``rows`` of each."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()


def train_fsdp_and_reference(mesh: Any, rank: int, size: int, outputs: int) -> tuple[list, list]:
    """Three SGD-momentum steps of a small MLP under ``fully_shard`` (per layer and the root) on ``mesh``,
    each rank on its 4 rows of the global batch, and of the same MLP in one process on the global batch.
    Returns (sharded parameters, reference parameters)."""
    from torch.distributed.fsdp import fully_shard

    def build() -> torch.nn.Module:
        torch.manual_seed(4)
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, outputs)).double()

    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(4 * size, 5, generator=g, dtype=torch.float64),
                torch.randn(4 * size, outputs, generator=g, dtype=torch.float64)) for _ in range(3)]
    ref = build()
    sgd_steps(ref, batches, 0.2)
    model = build()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sgd_steps(model, batches, 0.2, slice(4 * rank, 4 * rank + 4))
    return list(model.parameters()), list(ref.parameters())
