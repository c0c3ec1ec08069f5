"""Training throughput of Unison's DistributedOptimizer against PyTorch's DDP over gloo.

Run it inside one MPI job; every rank runs the same cases in the same order::

    unisonrun -np 1 python benchmarks/torch_training.py --json np1.json
    unisonrun -np 2 python benchmarks/torch_training.py --json np2.json --baseline-json np1.json

Why it exists: the issue that introduced ``unison.torch_backend`` set a target of
1.25x the samples/s of ``DistributedDataParallel`` over gloo at two ranks, the
alternative a PyTorch user on CPUs would otherwise pick. (For reference, C++
Horovod 0.28.1 over MPI reached 1.22x on the ``mlp`` case.) This script measures
both on the same model, data and batch, in one job.

What is measured, for each (model, impl):

* ``model`` is ``mlp`` (20 ``Linear`` layers, 19 of them 1024 x 1024, with biases:
  ~20M parameters in 40 tensors, so gradient exchange weighs as much as compute)
  or ``cnn`` (three 3x3 convolutions on 3x32x32 images, ~0.1M parameters, compute
  bound). The parameter and tensor counts are printed. Weights start from a fixed
  seed, the same for every impl.
* Data is synthetic: one batch per rank drawn once from a fixed seed (plus the
  rank, so ranks see different samples) and reused every step, so input loading
  is not measured. ``--batch`` is per rank.
* ``impl`` is ``unison`` (``hvd.DistributedOptimizer`` around ``torch.optim.SGD``,
  default settings) or ``ddp-gloo`` (``torch.nn.parallel.DistributedDataParallel``,
  default settings, around the same model, with the same ``SGD``; its gloo group
  is started inside this MPI job over TCP on 127.0.0.1, so single-host jobs only).
  At one rank both still run: Unison's collectives are then local and DDP has a
  world of one.
* A step is forward, cross-entropy loss, backward, ``optimizer.step()``,
  ``optimizer.zero_grad()``. Each case runs ``--warmup`` steps, then a barrier,
  then ``--steps`` timed steps, then a barrier; the time is the maximum over
  ranks, and ``samples_per_s = np * batch * steps / time``.
* After timing, the ranks' parameters are compared: data parallelism keeps the
  replicas equal, so a difference is reported as a failure.
* Scaling efficiency against one rank is ``samples_per_s(np) / (np *
  samples_per_s(np=1))`` for the same model and impl, taken from the records of an
  ``np=1`` run given with ``--baseline-json``; without one it is "n/a".

Every rank uses one intra-op thread (``torch.set_num_threads(1)``) and denormals
are flushed to zero for both impls. Outputs: a table and the targets on rank 0's
stdout; with ``--json``, a list of records ``{model, impl, np, batch, samples_per_s}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchutil import list_choices, ratio_target, selected, write_json

logger = logging.getLogger("benchmarks.torch_training")

MODELS = ("mlp", "cnn")
IMPLS = ("unison", "ddp-gloo")
DEFAULT_BATCH = {"mlp": 64, "cnn": 32}
MLP_WIDTH, MLP_HIDDEN_LAYERS, CLASSES = 1024, 19, 10
CNN_IMAGE = (3, 32, 32)
TARGET_NP, TARGET_RATIO = 2, 1.25
REFERENCE = "C++ Horovod 0.28.1 (MPI) reached 1.22x ddp-gloo on the mlp case at np=2"
LR, SEED = 0.01, 1234
SYNC_RTOL = 1e-5


@dataclass
class Record:
    """One measured case, as written to the JSON file."""

    model: str
    impl: str
    np: int
    batch: int
    samples_per_s: float


class OutOfSyncError(RuntimeError):
    """The ranks' parameters differ after training; raised on every rank alike."""


# --- models and data --------------------------------------------------------------------------


def build_model(name: str) -> Any:
    """A fresh ``mlp`` or ``cnn`` with weights drawn from :data:`SEED` (same on every call)."""
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    if name == "mlp":
        layers: list[nn.Module] = []
        for _ in range(MLP_HIDDEN_LAYERS):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, CLASSES))
    channels = CNN_IMAGE[0]
    return nn.Sequential(
        nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 16 x 16
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),        # 64 x 8 x 8
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, CLASSES),
    )


def synthetic_batch(name: str, batch: int, rank: int) -> tuple[Any, Any]:
    """This rank's inputs and labels for ``name``, from a seed fixed per rank."""
    import torch

    gen = torch.Generator().manual_seed(SEED + 1 + rank)
    shape = (batch, MLP_WIDTH) if name == "mlp" else (batch, *CNN_IMAGE)
    return torch.randn(shape, generator=gen), torch.randint(0, CLASSES, (batch,), generator=gen)


def count_parameters(model: Any) -> tuple[int, int]:
    """``(parameters, tensors)`` of ``model``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), len(params)


# --- the two impls ----------------------------------------------------------------------------


def make_unison(name: str, hvd: Any) -> tuple[Any, Any]:
    """The model with ``hvd.DistributedOptimizer`` around SGD, rank 0's weights broadcast."""
    import torch

    model = build_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def make_ddp(name: str) -> tuple[Any, Any]:
    """The model wrapped in ``DistributedDataParallel`` (it broadcasts rank 0's weights), and SGD."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(build_model(name))
    return model, torch.optim.SGD(model.parameters(), lr=LR)


def start_gloo(world: Any) -> None:
    """Starts torch.distributed's gloo group over TCP on a port rank 0 picks and broadcasts."""
    import torch.distributed as dist

    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())


# --- timing -----------------------------------------------------------------------------------


def make_step(model: Any, opt: Any, x: Any, y: Any) -> Callable[[], None]:
    """One training step: forward, loss, backward, ``opt.step()``, ``opt.zero_grad()``."""
    from torch.nn import functional as F

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def time_steps(world: Any, step: Callable[[], None], warmup: int, steps: int) -> float:
    """Seconds for ``steps`` calls of ``step`` after ``warmup`` untimed ones, max over ranks."""
    from mpi4py import MPI

    for _ in range(warmup):
        step()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - t0
    world.Barrier()
    return float(world.allreduce(elapsed, op=MPI.MAX))



def time_in_turns(world: Any, steps: Mapping[str, Callable[[], None]], rounds: int, n: int,
                  warmups: tuple[int, int] = (0, 0)) -> dict[str, list[float]]:
    """Seconds of each round of ``n`` steps per case, the cases taking turns ``rounds`` times.

    [Note: rounds] This machine's speed moves by tens of percent over minutes: cases timed one
    after the other in one pass would each meet a different phase of it, so each round runs
    every case once. ``warmups``: untimed steps of each case before its first round, and before
    each later one.
    """
    times: dict[str, list[float]] = {case: [] for case in steps}
    for turn in range(rounds):
        for case, step in steps.items():
            times[case].append(time_steps(world, step, warmups[0] if turn == 0 else warmups[1], n))
    return times


def check_in_sync(world: Any, model: Any, case: str) -> None:
    """Raises :class:`OutOfSyncError` on every rank unless all ranks hold the same weights.

    Compares a float64 checksum per tensor: cheap, and any lost or partial gradient
    exchange shows up in it.
    """
    import numpy as np

    sums = np.array([p.detach().double().sum().item() for p in model.parameters()])
    everyone = world.allgather(sums)
    worst = max(float(np.max(np.abs(s - sums) / (np.abs(sums) + 1e-12))) for s in everyone)
    if worst > SYNC_RTOL:
        raise OutOfSyncError(f"{case}: parameters differ across ranks after training "
                             f"(largest relative checksum difference {worst:.3g}, tolerance {SYNC_RTOL})")


def run_case(world: Any, hvd: Any, name: str, impl: str, batch: int, args: argparse.Namespace) -> Record:
    """Builds, warms up, times and checks one (model, impl) case on every rank."""
    x, y = synthetic_batch(name, batch, world.Get_rank())
    model, opt = make_unison(name, hvd) if impl == "unison" else make_ddp(name)
    elapsed = time_steps(world, make_step(model, opt, x, y), args.warmup, args.steps)
    check_in_sync(world, model, f"{name} {impl}")
    n = world.Get_size()
    return Record(name, impl, n, batch, n * batch * args.steps / elapsed)


# --- reporting --------------------------------------------------------------------------------


def load_baseline(path: Path) -> dict[tuple[str, str], float]:
    """``(model, impl) -> samples_per_s`` from the ``np=1`` records of a previous run's JSON.

    Raises:
        ValueError: the file holds no ``np=1`` record.
    """
    records = json.loads(path.read_text())
    base = {(r["model"], r["impl"]): float(r["samples_per_s"]) for r in records if r["np"] == 1}
    if not base:
        found = sorted({r["np"] for r in records})
        raise ValueError(f"--baseline-json {path} has no np=1 records (found np={found}); "
                         "give the JSON of a run with -np 1")
    return base


def efficiency(rec: Record, baseline: dict[tuple[str, str], float] | None) -> float | None:
    """Scaling efficiency against one rank, or None without a baseline for this case."""
    one = (baseline or {}).get((rec.model, rec.impl))
    return None if one is None else rec.samples_per_s / (rec.np * one)


def print_table(records: Sequence[Record], baseline: dict[tuple[str, str], float] | None) -> None:
    print(f"{'model':<7}{'impl':<10}{'np':>3}{'batch':>7}{'samples/s':>12}{'efficiency':>12}")
    for rec in records:
        eff = efficiency(rec, baseline)
        print(f"{rec.model:<7}{rec.impl:<10}{rec.np:>3}{rec.batch:>7}{rec.samples_per_s:>12.1f}"
              f"{'n/a' if eff is None else f'{eff:.2f}':>12}")
    if baseline is None:
        print("efficiency: n/a without --baseline-json (the JSON of an np=1 run)")


def print_targets(records: Sequence[Record], n: int) -> None:
    by = {(r.model, r.impl): r.samples_per_s for r in records}
    print(f"\ntargets (np={n}): unison samples/s / ddp-gloo samples/s >= {TARGET_RATIO} "
          f"at np={TARGET_NP}")
    for model in dict.fromkeys(r.model for r in records):
        note = "" if n == TARGET_NP else f"  (the target is set for np={TARGET_NP}; this is np={n})"
        print(ratio_target(f"{model:<5} unison / ddp-gloo", by.get((model, "unison")), by.get((model, "ddp-gloo")),
                           TARGET_RATIO, note))
    print(f"reference: {REFERENCE}")


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Time training steps of Unison's DistributedOptimizer against PyTorch DDP over "
                    "gloo on the same model, data and batch. Run under unisonrun/mpirun; rank 0 prints.",
        epilog="Lists take commas or spaces, e.g. --models mlp,cnn.")
    p.add_argument("--models", type=list_choices(MODELS), nargs="+", default=[list(MODELS)],
                   help=f"models to run (default: all of {', '.join(MODELS)})")
    p.add_argument("--impls", type=list_choices(IMPLS), nargs="+", default=[list(IMPLS)],
                   help=f"implementations to run (default: all of {', '.join(IMPLS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per case (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing (default 3)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch per rank for every model (default: "
                        + ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items()) + ")")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--baseline-json", type=Path, default=None,
                   help="JSON of an np=1 run of this script, for scaling efficiency")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.models = selected(args.models, MODELS)
    args.impls = selected(args.impls, IMPLS)
    if args.steps < 1 or args.warmup < 0 or (args.batch is not None and args.batch < 1):
        p.error(f"--steps and --batch must be at least 1 and --warmup at least 0 (got --steps "
                f"{args.steps}, --warmup {args.warmup}, --batch {args.batch})")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from mpi4py import MPI
    from tqdm import tqdm

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[torch_training rank {rank}] %(levelname)s %(message)s")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    baseline = load_baseline(args.baseline_json) if args.baseline_json is not None else None
    load_start = os.getloadavg()[0]

    hvd = None
    if "unison" in args.impls:
        import unison.torch_backend as hvd

        hvd.init()
        if hvd.size() != n:
            raise RuntimeError(f"unison sees {hvd.size()} ranks but MPI_COMM_WORLD has {n}")
    if "ddp-gloo" in args.impls:
        start_gloo(world)

    if rank == 0:
        print(f"np={n}, {torch.get_num_threads()} torch thread(s) per rank, torch {torch.__version__}")
        for name in args.models:
            params, tensors = count_parameters(build_model(name))
            print(f"{name}: {params:,} parameters in {tensors} tensors, batch "
                  f"{args.batch or DEFAULT_BATCH[name]} per rank")
    cases = [(m, i) for m in args.models for i in args.impls]
    records: list[Record] = []
    failures: list[str] = []
    bar = tqdm(cases, disable=rank != 0, file=sys.stderr, unit="case", dynamic_ncols=True)
    for name, impl in bar:
        bar.set_description(f"{name} {impl}")
        try:
            records.append(run_case(world, hvd, name, impl, args.batch or DEFAULT_BATCH[name], args))
        except OutOfSyncError as exc:
            failures.append(str(exc))
            if rank == 0:
                logger.error("%s", exc)
        except BaseException:
            logger.critical("%s %s failed on rank %d; the job ends", name, impl, rank)
            raise
        gc.collect()
    bar.close()

    if rank == 0:
        print_table(records, baseline)
        print_targets(records, n)
        for f in failures:
            print(f"FAILED: {f}")
        print(f"\nhost load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at "
              f"end, on {os.cpu_count()} CPUs with {n} rank(s); more than the ranks means other work "
              "shared the CPUs")
        if args.json is not None:
            write_json(args.json, records)
            print(f"wrote {args.json}")
    if "ddp-gloo" in args.impls:
        import torch.distributed as dist

        dist.destroy_process_group()
    if hvd is not None:
        hvd.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
