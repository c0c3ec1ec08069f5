"""One rank of ``benchmarks/elastic.py``: train, lose a rank at a fixed step, log every step.

    unisonrun -np 3 --elastic python benchmarks/elastic_worker.py unison OUT [options]
    torchrun --standalone --nproc-per-node=3 --max-restarts=3 --monitor-interval=0.1 \\
        benchmarks/elastic_worker.py torchrun OUT [options]

Both train the torch benchmark MLP (``torch_training.build_model("mlp")``, ~20M parameters)
with SGD on a fixed synthetic batch per rank, commit every ``--commit-every`` steps, and the
rank ``--victim`` SIGKILLs itself before step ``--kill-at`` of the first attempt.

* ``unison``: ``hvd.DistributedOptimizer`` under ``hvd.elastic.run`` with a ``TorchState``;
  a commit is the state's in-memory copy; the survivors recover in place and go on as 2 ranks.
* ``torchrun``: ``DistributedDataParallel`` over gloo; a commit is a checkpoint file written by
  rank 0 (atomically, fsynced) that every (re)started worker loads; torchrun restarts all 3.

Each process appends JSON lines to ``OUT/<mode>-<pid>.jsonl``: ``start`` (after imports and
set-up), ``step`` (after each step: its index, the world size), ``commit`` (its seconds),
``kill`` (the victim, just before dying), ``grow`` (rank 0, when it wrote the new host list
under ``--grow-file``) and ``done``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_training import LR, build_model, synthetic_batch  # noqa: E402


class Log:
    """Appends one JSON object per event, flushed at once (a SIGKILL loses nothing written)."""

    def __init__(self, out: Path, mode: str) -> None:
        self._f = open(out / f"{mode}-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115

    def __call__(self, event: str, **fields: Any) -> None:
        self._f.write(json.dumps({"event": event, "t": time.time(), **fields}) + "\n")


def _die(log: Log, step: int) -> None:
    log("kill", step=step)
    os.kill(os.getpid(), 9)


def _step(model: Any, opt: Any, x: Any, y: Any) -> None:
    import torch

    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def run_unison(args: argparse.Namespace, log: Log) -> None:
    import torch

    import unison.torch_backend as hvd
    from unison.torch_backend import elastic

    hvd.init()
    model = build_model("mlp")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                   named_parameters=model.named_parameters())
    state = elastic.TorchState(model, opt, step=0)
    attempt = int(os.environ.get("UNISON_ELASTIC_ATTEMPT", "0"))  # unisonrun's elastic driver: jobs started before
    log("start", rank=hvd.rank(), size=hvd.size(), attempt=attempt)

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        x, y = synthetic_batch("mlp", args.batch, hvd.rank())
        while state.step < args.steps:
            if args.grow_file is not None:
                if state.step == args.kill_at and attempt == 0 and hvd.rank() == 0:
                    args.grow_file.write_text(f"localhost:{args.world + 1}\n")  # the discovery script's output
                    log("grow", step=state.step, size=hvd.size())
            elif (state.step == args.kill_at and attempt == 0 and hvd.size() == args.world
                    and hvd.rank() == args.victim):
                _die(log, state.step)
            _step(model, opt, x, y)
            state.step += 1
            log("step", step=state.step, size=hvd.size(), rank=hvd.rank())
            if state.step % args.commit_every == 0:
                begin = time.perf_counter()
                state.commit()
                log("commit", step=state.step, seconds=time.perf_counter() - begin)

    train(state)
    log("done", step=state.step, size=hvd.size())
    hvd.shutdown()


def _save(path: Path, payload: dict[str, Any]) -> None:
    """Rank 0's checkpoint: written beside ``path``, fsynced, renamed over it."""
    import torch

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_torchrun(args: argparse.Namespace, log: Log, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # [Note: torchrun's store after a restart] With init_method env:// the restarted workers of
    # torch 2.13 read the dead attempt's gloo addresses from torchrun's store ("connectFullMesh
    # failed ... Connection refused") and never start; keys of their own attempt avoid that.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                            world_size=size)
    model = build_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ckpt = out / "torchrun-checkpoint.pt"
    step = 0
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
    ddp = DistributedDataParallel(model)
    x, y = synthetic_batch("mlp", args.batch, rank)
    log("start", rank=rank, size=size, attempt=attempt, step=step)
    while step < args.steps:
        if step == args.kill_at and attempt == 0 and rank == args.victim:
            _die(log, step)
        _step(ddp, opt, x, y)
        step += 1
        log("step", step=step, size=size, rank=rank)
        if step % args.commit_every == 0:
            begin = time.perf_counter()
            if rank == 0:
                _save(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})
            dist.barrier()  # nobody runs ahead of a commit that is not on disk yet
            log("commit", step=step, seconds=time.perf_counter() - begin)
    log("done", step=step, size=size)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("unison", "torchrun"))
    parser.add_argument("out", type=Path, help="folder for the event logs (and torchrun's checkpoint)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=25, help="the victim dies before this step")
    parser.add_argument("--victim", type=int, default=2)
    parser.add_argument("--world", type=int, default=3, help="ranks at the start")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--grow-file", type=Path, help="nobody dies: before step --kill-at rank 0 writes "
                        "'localhost:<world + 1>' here (what the discovery script prints)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import torch

    args = parse_args(argv)
    torch.set_num_threads(1)
    log = Log(args.out, args.mode)
    if args.mode == "unison":
        run_unison(args, log)
    else:
        run_torchrun(args, log, args.out)


if __name__ == "__main__":
    main()
