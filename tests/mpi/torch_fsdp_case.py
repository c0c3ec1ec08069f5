"""FSDP2 against one process, shared by the unison-backend rank suites (1-D mesh at np 3, HSDP at np 4)."""

from __future__ import annotations

from typing import Any

import torch


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
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    for x, y in batches:
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    model = build()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    mine = slice(4 * rank, 4 * rank + 4)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return list(model.parameters()), list(ref.parameters())
