"""``torch.distributed`` on Unison against gloo: collective latency and bandwidth, and DDP training.

    unisonrun -np 2 python benchmarks/torch_distributed.py --json out.json

One MPI job holds both backends: the default group is ``init_process_group("unison")`` and a
second group of the same ranks is ``dist.new_group(backend="gloo")`` (it uses the store Unison
made through MPI). Every rank runs the same cases in the same order.

* **Collectives**: ``all_reduce`` (SUM), ``all_gather_into_tensor``, ``reduce_scatter_tensor`` and
  ``broadcast`` of float32 tensors from 4 KiB to 64 MiB (``--sizes``) on each group; the time per
  call is the median of ``--reps`` timed calls after a warm-up, max over ranks; bus bandwidth as
  in nccl-tests (all-reduce moves 2(n-1)/n of the bytes per rank, all-gather and reduce-scatter
  (n-1)/n, broadcast 1).
* **Training**: the torch benchmark's ``mlp`` (~20M parameters) and ``cnn`` (benchmarks/
  torch_training.py: same weights, synthetic batch, SGD) for ``DistributedDataParallel`` on the
  unison group, DDP on the gloo group, and Unison's own ``hvd.DistributedOptimizer``; all of them
  built first, then timed in turns, ``--rounds`` rounds of ``--steps`` steps each, every impl
  keeping its fastest round (samples/s from it), and the ranks' weights compared afterwards.
* ``ddp-nocomm``, a ceiling rather than a peer: DDP over the unison group with a communication hook
  that returns every bucket untouched, so its step is the model's compute plus DDP's own work
  (copying the gradients into its buckets and back) and no all-reduce. ``ddp-nocomm / ddp-gloo``
  is the most any backend's DDP can reach against gloo here; it is printed under the target lines.
* ``ddp-unison-view``, beside the peers rather than one: DDP on the unison group with
  ``gradient_as_bucket_view=True``, PyTorch's option that makes the gradients views of DDP's buckets, so
  DDP skips its copies of every gradient into the buckets and back; printed under the
  DDP-against-``DistributedOptimizer`` line (the same reductions, without DDP's own copies).
* FSDP2: ``fully_shard`` on each child module with parameters and on the root, over a
  ``DeviceMesh`` made from the unison group and from the gloo group (``DeviceMesh.from_group``);
  its parameters are shards, so the in-sync check is DDP's and the optimizer's only.

Targets, printed as lines: DDP on unison >= 1.3x DDP on gloo (mlp), >= 1.0x (cnn); DDP on unison
>= 0.9x Unison's ``DistributedOptimizer``; FSDP2 on unison >= 1.3x FSDP2 on gloo (mlp).

[Note: the two ceilings] Under each DDP-against-gloo line: ``ddp-nocomm / ddp-gloo``, DDP with
an all-reduce that costs nothing, which no backend can pass; and an estimate of what DDP on unison
can reach here: ddp-nocomm's step plus one all-reduce of the model's whole gradient on the unison
group timed alone (an ``ExchangeRecord``, in the JSON too). Each rank computes on one thread and
the ranks fill the machine's cores, so no core is idle for the reduction to hide in: its copies and
sums take the cores from backward and lengthen the step by about their own time (on a machine with
cores to spare they would overlap and cost nothing). It is an estimate, not a bound: the reduction
timed alone also spends some of its time waiting for the peer, which a busy core would not lose.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import human_bytes, human_time, ratio_target, write_json  # noqa: E402
from torch_training import (  # noqa: E402
    DEFAULT_BATCH,
    LR,
    build_model,
    check_in_sync,
    make_step,
    make_unison,
    synthetic_batch,
    time_in_turns,
    time_steps,
)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


@dataclass
class OpRecord:
    op: str
    backend: str
    np: int
    bytes: int
    seconds: float
    busbw_gbs: float


@dataclass
class TrainRecord:
    model: str
    impl: str
    np: int
    batch: int
    samples_per_s: float


@dataclass
class ExchangeRecord:
    """One all-reduce of a model's whole gradient (all its parameters as one float32 tensor) on the unison
    group, timed alone: the reduction's own cost, which a step adds when no core is free to hide it."""

    model: str
    np: int
    bytes: int
    seconds: float


def _sizes(text: str) -> list[int]:
    units = {"k": 1 << 10, "m": 1 << 20}
    out = []
    for item in text.split(","):
        item = item.strip().lower().removesuffix("ib").removesuffix("b")
        scale = units.get(item[-1:], 1)
        out.append(int(float(item[:-1] if scale > 1 else item) * scale))
    return out


def _op_call(op: str, t: Any, group: Any, n: int) -> Any:
    import torch
    import torch.distributed as dist

    if op == "all_reduce":
        return lambda: dist.all_reduce(t, group=group)
    if op == "broadcast":
        return lambda: dist.broadcast(t, src=0, group=group)
    if op == "all_gather":
        out = torch.empty(t.numel() * n, dtype=t.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (torch < 2.13)
        return lambda: gather(out, t, group=group)
    out = torch.empty(t.numel() // n, dtype=t.dtype)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(out, t, group=group)


def time_op(world: Any, call: Any, reps: int) -> float:
    """Median seconds per call over ``reps`` calls (after 3 untimed), max over ranks."""
    from mpi4py import MPI

    for _ in range(3):
        call()
    times = []
    for _ in range(reps):
        world.Barrier()
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return float(world.allreduce(statistics.median(times), op=MPI.MAX))


def run_ops(world: Any, groups: dict[str, Any], sizes: list[int], reps: int) -> list[OpRecord]:
    import torch

    n = world.Get_size()
    records = []
    for op in OPS:
        for size in sizes:
            numel = max(n, size // 4 // n * n)
            for backend, group in groups.items():
                t = torch.ones(numel)
                seconds = time_op(world, _op_call(op, t, group, n), reps)
                nbytes = numel * 4  # each rank's input; an all-gather moves n of them (nccl-tests' S)
                moved = nbytes * n if op == "all_gather" else nbytes
                busbw = BUS_FACTOR[op](n) * moved / seconds / 1e9
                records.append(OpRecord(op, backend, n, nbytes, seconds, busbw))
    return records


def time_exchange(world: Any, name: str, group: Any) -> ExchangeRecord:
    """The all-reduce of ``name``'s gradient bytes as one tensor on ``group``, alone: the median of 5 calls
    after 2, max over ranks (:func:`time_op`)."""
    import torch
    import torch.distributed as dist

    flat = torch.ones(sum(p.numel() for p in build_model(name).parameters()), dtype=torch.float32)
    seconds = time_op(world, lambda: dist.all_reduce(flat, group=group), 5)
    return ExchangeRecord(name, world.Get_size(), flat.numel() * 4, seconds)


def run_training(world: Any, hvd: Any, groups: dict[str, Any], models: list[str], args: argparse.Namespace
                 ) -> list[TrainRecord | ExchangeRecord]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    n = world.Get_size()
    records: list[TrainRecord | ExchangeRecord] = []
    impls = ("ddp-unison", "ddp-gloo", "unison-optimizer", "fsdp2-unison", "fsdp2-gloo", "ddp-nocomm",
             "ddp-unison-view")
    for name in models:
        batch = DEFAULT_BATCH[name]
        x, y = synthetic_batch(name, batch, world.Get_rank())
        cases = []
        for impl in impls:
            if impl == "unison-optimizer":
                model, opt = make_unison(name, hvd)
                checked = model
            elif impl.startswith("fsdp2-"):
                model, checked = fsdp2_model(name, groups[impl.removeprefix("fsdp2-")]), None
                opt = torch.optim.SGD(model.parameters(), lr=LR)
            elif impl == "ddp-unison-view":  # DDP without its copies into the buckets and back
                checked = build_model(name)
                model = DistributedDataParallel(checked, process_group=groups["unison"],
                                                gradient_as_bucket_view=True)
                opt = torch.optim.SGD(model.parameters(), lr=LR)
            elif impl == "ddp-nocomm":  # a ceiling, not a peer: DDP whose all-reduce costs nothing
                model = DistributedDataParallel(build_model(name), process_group=groups["unison"])
                model.register_comm_hook(None, _no_communication)
                opt, checked = torch.optim.SGD(model.parameters(), lr=LR), None  # ranks drift apart
            else:
                checked = build_model(name)
                model = DistributedDataParallel(checked, process_group=groups[impl.removeprefix("ddp-")])
                opt = torch.optim.SGD(model.parameters(), lr=LR)
            step = make_step(model, opt, x, y)
            time_steps(world, step, args.warmup, 1)  # warm-up (and one step) before any timing
            cases.append((impl, step, checked))
        # [Note: rounds] (torch_training.time_in_turns): each impl keeps its fastest round
        times = time_in_turns(world, {impl: step for impl, step, _ in cases}, args.rounds, args.steps)
        for impl, _, checked in cases:
            if checked is not None:
                check_in_sync(world, checked, f"{name} {impl}")
            records.append(TrainRecord(name, impl, n, batch, n * batch * args.steps / min(times[impl])))
        records.append(time_exchange(world, name, groups["unison"]))
    return records


def _no_communication(state, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN201
    """A DDP communication hook that hands each bucket back as it is: DDP's own work (copying the
    gradients into its buckets and back, the hooks, the bookkeeping) with no all-reduce at all.
    (No annotations: DDP checks them against its own types, which this module's postponed
    annotations would turn into strings.)"""
    import torch

    fut: Any = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def fsdp2_model(name: str, group: Any) -> Any:
    """The benchmark model sharded with FSDP2 over ``group``: each child with parameters, then the root."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(name)
    mesh = DeviceMesh.from_group(group, "cpu")
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def print_tables(ops: list[OpRecord], train: list[TrainRecord | ExchangeRecord]) -> None:
    print(f"{'op':<16}{'size':>10}{'unison':>12}{'gloo':>12}{'busbw unison':>14}{'busbw gloo':>12}{'ratio':>8}")
    by = {(r.op, r.bytes, r.backend): r for r in ops}
    for op, size in sorted({(r.op, r.bytes) for r in ops}, key=lambda k: (OPS.index(k[0]), k[1])):
        u, g = by[(op, size, "unison")], by[(op, size, "gloo")]
        print(f"{op:<16}{human_bytes(size):>10}{human_time(u.seconds):>12}{human_time(g.seconds):>12}"
              f"{u.busbw_gbs:>11.2f} GB/s{g.busbw_gbs:>7.2f} GB/s{g.seconds / u.seconds:>7.2f}x")
    print()
    print(f"{'model':<8}{'impl':<20}{'np':>4}{'batch':>7}{'samples/s':>12}")
    for r in train:
        if isinstance(r, TrainRecord):
            print(f"{r.model:<8}{r.impl:<20}{r.np:>4}{r.batch:>7}{r.samples_per_s:>12.1f}")
    for r in train:
        if isinstance(r, ExchangeRecord):
            print(f"{r.model}: one all-reduce of its {human_bytes(r.bytes)} of gradients on unison, alone: "
                  f"{human_time(r.seconds)}")


def target_lines(train: list[TrainRecord | ExchangeRecord]) -> list[str]:
    """The target lines; under each DDP-against-gloo line its ceilings ([Note: the two ceilings])."""
    rate = {(r.model, r.impl): r.samples_per_s for r in train if isinstance(r, TrainRecord)}
    batch = {r.model: r.np * r.batch for r in train if isinstance(r, TrainRecord)}
    exchange = {r.model: r.seconds for r in train if isinstance(r, ExchangeRecord)}
    lines = ["targets:"]
    for model, minimum in (("mlp", 1.3), ("cnn", 1.0)):
        lines.append(ratio_target(f"{model} DDP on unison / DDP on gloo samples/s",
                                  rate.get((model, "ddp-unison")), rate.get((model, "ddp-gloo")), minimum))
        ceiling, gloo = rate.get((model, "ddp-nocomm")), rate.get((model, "ddp-gloo"))
        if ceiling and gloo:
            lines.append(f"    (ceiling: ddp-nocomm / DDP on gloo = {ceiling / gloo:.2f}: DDP whose all-reduce "
                         "costs nothing, the most any backend can reach against gloo on this machine)")
            if model in exchange:
                added = batch[model] / (batch[model] / ceiling + exchange[model])
                lines.append(f"    (estimate: ddp-nocomm's step plus its gradients' all-reduce timed alone "
                             f"({human_time(exchange[model])}) / DDP on gloo = {added / gloo:.2f}: what DDP on "
                             "unison reaches when the ranks' computing fills every core, so the reduction adds "
                             "its time instead of hiding behind backward)")
    for model in ("mlp", "cnn"):
        lines.append(ratio_target(f"{model} DDP on unison / Unison DistributedOptimizer samples/s",
                                  rate.get((model, "ddp-unison")), rate.get((model, "unison-optimizer")), 0.9))
        view, ours = rate.get((model, "ddp-unison-view")), rate.get((model, "unison-optimizer"))
        if view and ours:
            lines.append(f"    (DDP on unison with gradient_as_bucket_view=True / Unison DistributedOptimizer = "
                         f"{view / ours:.2f}: the same reductions without DDP's copies of every gradient into its "
                         "buckets and back)")
    lines.append(ratio_target("mlp FSDP2 on unison / FSDP2 on gloo samples/s", rate.get(("mlp", "fsdp2-unison")),
                              rate.get(("mlp", "fsdp2-gloo")), 1.3))
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=_sizes, default=_sizes("4k,64k,1m,16m,64m"),
                        help="tensor sizes in bytes, with k/m suffixes (default 4k,64k,1m,16m,64m)")
    parser.add_argument("--reps", type=int, default=10, help="timed calls per op and size")
    parser.add_argument("--models", default="mlp,cnn", help="comma list of mlp, cnn")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3,
                        help="the training impls take turns this many times; each keeps its fastest round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-ops", action="store_true", help="only the training cases")
    parser.add_argument("--json", type=Path, help="write the records here (rank 0)")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    bad = [m for m in args.models if m not in DEFAULT_BATCH]
    if bad:
        parser.error(f"--models: unknown {bad}; choose from {sorted(DEFAULT_BATCH)}")
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error(f"--steps {args.steps} and --rounds {args.rounds} must be >= 1, --warmup {args.warmup} >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import unison.torch_backend as hvd

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    world = MPI.COMM_WORLD
    hvd.init()
    dist.init_process_group("unison")
    groups = {"unison": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    ops = [] if args.skip_ops else run_ops(world, groups, args.sizes, args.reps)
    train = run_training(world, hvd, groups, args.models, args)
    if world.Get_rank() == 0:
        print_tables(ops, train)
        for line in target_lines(train):
            print(line)
        if args.json:
            write_json(args.json, [*ops, *train])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
