"""Where DDP's time goes on the unison backend: the same model trained six ways, milliseconds per step.

Run it inside one MPI job; every rank runs the same cases in the same order::

    unisonrun -np 2 python benchmarks/ddp_breakdown.py --model mlp --json out/ddp_breakdown.json

The cases, each on a fresh copy of the torch benchmark's model (benchmarks/torch_training.py) and
this rank's synthetic batch, SGD, ``--steps`` timed steps after ``--warmup``; the cases are all
built first and then take turns, ``--rounds`` times, each keeping its fastest round (time = the
slowest rank's):

* ``compute-only``: the plain model, no communication: what every case pays anyway;
* ``ddp-unison`` / ``ddp-gloo``: ``DistributedDataParallel`` (defaults: 25 MB buckets) on
  ``init_process_group("unison")`` and on a gloo group of the same ranks;
* ``ddp-unison-bucket-view`` / ``ddp-gloo-bucket-view``: the same with
  ``gradient_as_bucket_view=True`` (no copy of the gradients into the buckets and back);
* ``unison-optimizer``: Unison's ``DistributedOptimizer`` (Horovod's way).

It explains benchmarks/torch_distributed.py's DDP target lines (docs/torch_distributed.md); it has
no targets of its own. Outputs: the table on rank 0's stdout; ``--json`` writes the records.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import write_json  # noqa: E402
from torch_training import DEFAULT_BATCH, LR, build_model, make_step, synthetic_batch, time_in_turns  # noqa: E402

CASES = ("compute-only", "ddp-unison", "ddp-gloo", "ddp-unison-bucket-view", "ddp-gloo-bucket-view",
         "unison-optimizer")


@dataclass
class Record:
    model: str
    case: str
    np: int
    batch: int
    steps: int
    ms_per_step: float


def wrap(case: str, model: Any, gloo: Any, hvd: Any) -> tuple[Any, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817 - PyTorch's usual name

    if case == "compute-only":
        return model, torch.optim.SGD(model.parameters(), lr=LR)
    if case == "unison-optimizer":
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                       named_parameters=model.named_parameters())
        return model, opt
    group = gloo if "gloo" in case else None
    ddp = DDP(model, process_group=group, gradient_as_bucket_view=case.endswith("bucket-view"))
    return ddp, torch.optim.SGD(model.parameters(), lr=LR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3,
                        help="the cases take turns this many times; each keeps its fastest round")
    parser.add_argument("--json", type=Path, help="write the records here (rank 0)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error(f"--steps {args.steps} and --rounds {args.rounds} must be >= 1 and --warmup "
                     f"{args.warmup} >= 0")

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import unison.torch_backend as hvd

    torch.set_num_threads(1)
    dist.init_process_group("unison")
    hvd.init()
    gloo = dist.new_group(backend="gloo")
    world = MPI.COMM_WORLD
    batch = DEFAULT_BATCH[args.model]
    x, y = synthetic_batch(args.model, batch, world.Get_rank())
    steps = {case: make_step(*wrap(case, build_model(args.model), gloo, hvd), x, y) for case in CASES}
    times = time_in_turns(world, steps, args.rounds, args.steps, warmups=(args.warmup, 1))  # [Note: rounds]
    records = [Record(args.model, case, world.Get_size(), batch, args.steps, min(times[case]) / args.steps * 1e3)
               for case in CASES]
    if world.Get_rank() == 0:
        print(f"{'model':<7}{'case':<26}{'np':>4}{'batch':>7}{'ms/step':>10}")
        for r in records:
            print(f"{r.model:<7}{r.case:<26}{r.np:>4}{r.batch:>7}{r.ms_per_step:>10.1f}")
        if args.json:
            write_json(args.json, records)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
