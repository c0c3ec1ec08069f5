"""torch.distributed.checkpoint on the unison backend: ``save`` at one rank count, ``load`` at another.

    python mpi_torch_dcp.py FOLDER save|load

Every rank rebuilds the same trained model and optimizer from seeds; ``save`` writes them with
``dcp.save``, ``load`` reads them into fresh objects with ``dcp.load`` and checks every value.
Then the same for the model sharded by FSDP2 on a 1-D mesh of every rank: its state dicts hold
DTensor shards (``get_state_dict``), so a save at 4 ranks and a load at 2 reshard them; every
gathered value must equal the unsharded model's. Each rank prints ``rank R: ok``.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import unison.torch_backend  # noqa: F401 - registers the backend


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()
    opt.step()
    return model, opt


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def sharded(seed: int, train: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model of ``trained()`` under FSDP2 (every rank the same batch: the average is that batch's gradient)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)) if train else torch.zeros(1, 5)
    model(x).pow(2).mean().backward()
    opt.step()
    return model, opt


def check_fsdp(folder: str, mode: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if mode == "save":
        m, o = sharded(0, train=True)
        model_sd, optim_sd = get_state_dict(m, o)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder + "-fsdp")
        return
    m, o = sharded(123, train=False)  # other weights, momentum of another step: the load must replace them
    model_sd, optim_sd = get_state_dict(m, o)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=folder + "-fsdp")
    set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for a, b in zip(m.parameters(), model.parameters(), strict=True):
        assert torch.allclose(a.full_tensor(), b, rtol=1e-6, atol=1e-7), "FSDP2 weights differ after dcp.load"
        assert torch.allclose(o.state[a]["momentum_buffer"].full_tensor(), opt.state[b]["momentum_buffer"],
                              rtol=1e-6, atol=1e-7), "FSDP2 momentum differs after dcp.load"


def main(folder: str, mode: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("unison")
    model, opt = trained()
    if mode == "save":
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=folder)
    else:
        fresh = build(123)  # different weights and no momentum: the load must replace them
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
    check_fsdp(folder, mode, model, opt)
    dist.barrier()
    print(f"rank {dist.get_rank()}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
