"""One configuration of ``benchmarks/tensor_parallel.py``, run on every rank of one mpirun launch.

The driver starts one launch per configuration; this file is what every rank runs. It can be
started by hand (``mpirun -np 2 python benchmarks/tensor_parallel_worker.py --config tp2 --out
r.json``).

What one launch does, on every rank:

1. Builds the unsplit model from one seed (the same weights on every rank): ``layers`` pre-norm
   transformer blocks, each ``x + attn(ln1(x))`` then ``+ fc2(gelu(fc1(ln2(.))))`` from
   ``nn.LayerNorm``, ``nn.MultiheadAttention`` (self-attention, ``batch_first``) and two
   ``nn.Linear``, float32. Then the configuration, all with SGD:

   - ``tp1``: the unsplit blocks, ``hvd.DistributedOptimizer`` over the whole job (plain data
     parallelism; every rank holds every weight).
   - ``tp2``/``tp4``: ``Grid(tp=k).register()``; each block becomes
     ``hvd.ParallelTransformerBlock.from_modules(...)`` on the tensor set; the gradients are
     averaged over the data set with ``hvd.DistributedOptimizer`` (a plain SGD when the data
     group is one rank).
   - ``torch-tp2``: torch's own tensor parallelism: gloo (``init_process_group("gloo",
     "env://")`` from the driver's ``MASTER_ADDR``/``MASTER_PORT``, ``RANK``/``WORLD_SIZE`` from
     Open MPI's), ``init_device_mesh("cpu", (dp, 2), ("dp", "tp"))`` and ``parallelize_module``
     of each block: ``ColwiseParallel`` on the fused q/k/v projection and fc1, ``RowwiseParallel``
     on the attention output and fc2 (torch's tutorial splits q, k and v as three layers; one
     fused layer, its rows reordered so torch's even split hands each rank its own heads' q, k
     and v, costs one backward all-reduce instead of three, as Unison's layer does). With a
     data group of 2 the local gradients are flattened and all-reduced once over the mesh's
     ``dp`` group after each backward. Any exception while building it or running
     its first step is recorded (every rank agrees) and the configuration is reported as failed.

2. Each step: a global batch of ``--batch`` sequences of ``--seq`` positions (random, fixed
   seed); data replica ``d`` of ``dp`` takes its ``batch / dp`` of them, so every configuration
   does the same work per step. Loss: mean squared error against a random target.
3. ``--warmup`` steps, then ``--repeats`` runs of ``--steps`` steps, each from a barrier; a run's
   time is the slowest rank's and the fastest run counts.
4. Counts, on every rank:

   - parameter bytes: ``untyped_storage().nbytes()`` of the unique storages of the model's
     parameters (a DTensor's local tensor), after the unsplit model is gone;
   - tensor-parallel communication: the worker wraps ``allreduce_async``, ``allgather_async`` and
     ``reducescatter_async`` in ``unison.torch_backend.tensor_parallel_comm``'s namespace (the
     calls every tensor-parallel operator makes; the data group's gradient all-reduce goes
     through the optimizer's own reference and is not counted) and adds up, per timed step,
     the calls and the bytes of the whole tensor each works on (all-reduce: the tensor;
     all-gather: the gathered result; reduce-scatter: the input);
   - for ``torch-tp2``: the collective calls of one extra step under torch's ``CommDebugMode``.

Rank 0 writes one JSON object to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_worker import agreed_error, first_line  # noqa: E402

SEED, LR = 1234, 1e-3
CONFIGS = ("tp1", "tp2", "tp4", "torch-tp2")
#: the collectives of tensor_parallel_comm that the worker counts, and what "the whole tensor" is
COUNTED = {"allreduce_async": 1, "allgather_async": "tp", "reducescatter_async": 1}


def tp_of(config: str) -> int:
    """``"tp2" -> 2``, ``"torch-tp2" -> 2``."""
    return int(config.rsplit("tp", 1)[1])


def block_params(hidden: int, ffn: int) -> int:
    """Parameters of one block: 2 layer norms, attention (q/k/v and output, biases), the MLP."""
    return 4 * hidden + 4 * hidden * hidden + 4 * hidden + 2 * hidden * ffn + ffn + hidden


# --- models -------------------------------------------------------------------------------------


def plain_blocks(args: argparse.Namespace) -> Any:
    """The unsplit model, from one seed: ``layers`` pre-norm blocks (see the module docstring)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(args.hidden), nn.LayerNorm(args.hidden)
            self.attn = nn.MultiheadAttention(args.hidden, args.heads, batch_first=True)
            self.fc1, self.fc2 = nn.Linear(args.hidden, args.ffn), nn.Linear(args.ffn, args.hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    torch.manual_seed(SEED)
    return nn.Sequential(*[Block() for _ in range(args.layers)])


def unison_model(plain: Any, tp: int, hvd: Any) -> tuple[Any, Any, int]:
    """``(model, data set or None, dp)`` for ``tp1`` (the plain model) or ``tp2``/``tp4``."""
    from torch import nn

    from unison.common.tensor_parallel import Grid

    grid = Grid(tp=tp)
    sets = grid.register()
    if tp == 1:
        return plain, sets.dp, grid.dp
    blocks = [hvd.ParallelTransformerBlock.from_modules(b.ln1, b.attn, b.ln2, b.fc1, b.fc2, process_set=sets.tp)
              for b in plain]
    return nn.Sequential(*blocks), sets.dp, grid.dp


def shard_major_rows(weight: Any, hidden: int, tp: int) -> Any:
    """A fused ``(3 * hidden, ...)`` q/k/v tensor reordered shard by shard: shard ``r``'s q rows, k rows,
    v rows, then shard ``r + 1``'s, so that an even split of the rows into ``tp`` pieces (what
    ``ColwiseParallel`` does) gives each rank its own heads' q, k and v."""
    import torch

    piece = hidden // tp
    return torch.cat([weight[part * hidden + r * piece:part * hidden + (r + 1) * piece]
                      for r in range(tp) for part in range(3)])


def torch_tp_block(block: Any, heads: int, tp: int) -> Any:
    """A copy of a plain block with q/k/v as one ``nn.Linear`` whose rows are in shard-major order
    (:func:`shard_major_rows`), so ``ColwiseParallel`` splits it by heads as Unison's layer does."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    hidden = block.attn.embed_dim
    head_dim = hidden // heads

    class TorchTPBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2, self.fc1, self.fc2 = block.ln1, block.ln2, block.fc1, block.fc2
            self.qkv, self.out = nn.Linear(hidden, 3 * hidden), block.attn.out_proj
            with torch.no_grad():
                self.qkv.weight.copy_(shard_major_rows(block.attn.in_proj_weight, hidden, tp))
                self.qkv.bias.copy_(shard_major_rows(block.attn.in_proj_bias, hidden, tp))

        def _heads(self, t: torch.Tensor) -> torch.Tensor:
            batch, seq, width = t.shape  # width: this rank's heads only
            return t.view(batch, seq, width // head_dim, head_dim).transpose(1, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = (self._heads(t) for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
            ctx = F.scaled_dot_product_attention(q, k, v)
            batch, _, seq, _ = ctx.shape
            x = x + self.out(ctx.transpose(1, 2).reshape(batch, seq, -1))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    return TorchTPBlock()


def torch_model(plain: Any, tp: int, world_size: int, heads: int) -> tuple[Any, Any, int]:
    """``(model, mesh, dp)``: each block under ``parallelize_module`` on the mesh's ``tp`` dimension."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.setdefault("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    os.environ.setdefault("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    dp = world_size // tp
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"qkv": ColwiseParallel(), "out": RowwiseParallel(), "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    blocks = [parallelize_module(torch_tp_block(b, heads, tp), mesh["tp"], plan) for b in plain]
    return nn.Sequential(*blocks), mesh, dp


# --- measuring ----------------------------------------------------------------------------------


def param_bytes(model: Any) -> int:
    """Bytes of the unique storages of ``model``'s parameters (a DTensor's local shard)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        s = local.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


class CommCounter:
    """Wraps the collectives ``tensor_parallel_comm`` calls; counts calls and whole-tensor bytes."""

    def __init__(self) -> None:
        self.calls, self.bytes = 0, 0

    def install(self) -> None:
        from unison.common.engine.process_sets import set_size
        from unison.torch_backend import tensor_parallel_comm as comm

        for name, factor in COUNTED.items():
            if hasattr(comm, name):
                setattr(comm, name, self._wrap(getattr(comm, name), factor, set_size))

    def _wrap(self, fn: Callable[..., Any], factor: int | str, set_size: Callable[[Any], int]
              ) -> Callable[..., Any]:
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            scale = set_size(kwargs.get("process_set", args[-1] if args else None)) if factor == "tp" else factor
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size() * int(scale)
            return fn(tensor, *args, **kwargs)
        return counted

    def reset(self) -> None:
        self.calls, self.bytes = 0, 0


def torch_comm_counts(step: Callable[[], float]) -> dict[str, int]:
    """Collective calls of one step of the torch anchor, by op, from ``CommDebugMode``."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        step()
    return {str(op).rsplit(".", 1)[-1]: int(n) for op, n in mode.get_comm_counts().items()}


# --- one launch ---------------------------------------------------------------------------------


def data(args: argparse.Namespace, replica: int, dp: int) -> tuple[Any, Any]:
    """This data replica's ``batch / dp`` sequences of the global batch and their targets."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
    y = torch.randn(args.batch, args.seq, args.hidden, generator=gen)
    per = args.batch // dp
    return x[replica * per:(replica + 1) * per].contiguous(), y[replica * per:(replica + 1) * per].contiguous()


def build(args: argparse.Namespace, world: Any) -> tuple[Callable[[], float], Any, int]:
    """``(one step -> loss, model, dp)`` for ``args.config``."""
    import torch
    from torch.nn import functional as F

    tp, plain = tp_of(args.config), plain_blocks(args)
    rank = world.Get_rank()
    if args.config.startswith("torch"):
        model, mesh, dp = torch_model(plain, tp, world.Get_size(), args.heads)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        reduce = dp_reducer(model, mesh, dp)
    else:
        import unison.torch_backend as hvd

        hvd.init()
        model, dp_set, dp = unison_model(plain, tp, hvd)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if dp > 1:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), process_set=dp_set)
        reduce = None
    del plain
    x, y = data(args, (rank // tp) % dp, dp)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if reduce is not None:
            reduce()
        opt.step()
        return float(loss.detach())
    return step, model, dp


def dp_reducer(model: Any, mesh: Any, dp: int) -> Callable[[], None] | None:
    """Average the torch anchor's local gradients over the mesh's ``dp`` group: one flat all-reduce."""
    if dp == 1:
        return None
    import torch
    import torch.distributed as dist

    group = mesh["dp"].get_group()

    def reduce() -> None:
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    return reduce


def timed(world: Any, args: argparse.Namespace, step: Callable[[], float], counter: CommCounter, first: float
          ) -> tuple[list[float], float, float]:
    """``(seconds of each run (max over ranks), first loss, last loss)`` after the first step (its loss
    ``first``) and the rest of the warm-up; losses averaged over ranks."""
    last = first
    for _ in range(args.warmup - 1):
        step()
    counter.reset()
    elapsed = []
    for _ in range(args.repeats):
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            last = step()
        elapsed.append(time.perf_counter() - t0)
    world.Barrier()
    slowest = [max(ts) for ts in zip(*world.allgather(elapsed), strict=True)]
    n = world.Get_size()
    return slowest, world.allreduce(first) / n, world.allreduce(last) / n


def run(world: Any, args: argparse.Namespace) -> dict[str, Any]:
    tp = tp_of(args.config)
    record: dict[str, Any] = {"config": args.config, "np": world.Get_size(), "tp": tp,
                              **{k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "seq", "batch",
                                                               "steps", "repeats", "warmup")},
                              "whole_param_bytes": 4 * args.layers * block_params(args.hidden, args.ffn)}
    counter = CommCounter()
    counter.install()
    built, err, first = None, "", 0.0
    try:
        built = build(args, world)
        first = built[0]()  # the first step: a configuration that cannot run fails here, on every rank
    except Exception as exc:  # noqa: BLE001 - the anchor is recorded as failed with its error
        if not args.config.startswith("torch"):
            raise
        err = f"{type(exc).__name__}: {first_line(exc)}"
    err = agreed_error(world, err)
    if err or built is None:
        return {**record, "error": err}
    step, model, dp = built
    elapsed, first, last = timed(world, args, step, counter, first)
    runs = args.repeats * args.steps
    mine = {"param_bytes": param_bytes(model), "comm_bytes": counter.bytes / runs,
            "comm_calls": counter.calls / runs}
    record.update(dp=dp, samples_per_s=args.batch * args.steps / min(elapsed), run_s=elapsed, first_loss=first,
                  last_loss=last, per_rank=world.gather(mine, root=0))
    if args.config.startswith("torch"):
        record["torch_comm_calls"] = torch_comm_counts(step)
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="One configuration of benchmarks/tensor_parallel.py (under mpirun).")
    p.add_argument("--config", choices=CONFIGS, required=True)
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1024, help="MLP hidden size")
    p.add_argument("--seq", type=int, default=16, help="positions per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step, all data replicas together")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs of --steps steps; the fastest counts")
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes the JSON result here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    from zero_worker import write_result

    world = MPI.COMM_WORLD
    write_result(world, run(world, args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
