"""torch.distributed.checkpoint on the unison backend: ``save`` at one rank count, ``load`` at another.

    python mpi_torch_dcp.py FOLDER save|load

Every rank rebuilds the same trained model and optimizer from seeds; ``save`` writes them with
``dcp.save``, ``load`` reads them into fresh objects with ``dcp.load`` and checks every value.
Each rank prints ``rank R: ok``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import unison.torch_backend  # noqa: F401 - registers the backend


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    opt.step()
    return model, opt


def main(folder: str, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("unison")
    model, opt = trained()
    if mode == "save":
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=folder)
    else:
        torch.manual_seed(123)  # different weights and no momentum: the load must replace them
        fresh = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        fresh(torch.zeros(1, 5)).sum().backward()
        fresh_opt.step()  # creates the momentum buffers the load fills in
        state = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
        dcp.load(state, checkpoint_id=folder)
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optim"])
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b), "weights differ after dcp.load"
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
            assert torch.equal(fresh_opt.state[a]["momentum_buffer"], opt.state[b]["momentum_buffer"])
    dist.barrier()
    print(f"rank {dist.get_rank()}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
