"""One configuration of ``benchmarks/zero.py``, run on every rank of one mpirun launch.

The driver (``benchmarks/zero.py``) starts one launch per configuration, so each one's peak RSS
starts clean; this file is what every rank runs. It is not meant to be started by hand, but it
can be (``mpirun -np 2 python benchmarks/zero_worker.py --framework torch --impl stage1 --out
r.json``).

What one launch does, on every rank:

1. With ``--cgroup PREFIX``: before anything large is imported, writes its own PID into
   ``PREFIX-r<rank>/cgroup.procs`` (the driver made those cgroups with the memory cap), so
   everything this rank allocates is charged to its cgroup.
2. Builds the MLP (``layers`` x ``Linear(width, width)`` + ReLU, then ``Linear(width, 10)``,
   weights from a fixed seed) and the configuration around it, with Adam:

   - torch ``stage0``: ``hvd.DistributedOptimizer(Adam, named_parameters=...)``;
     ``stage1``/``stage2``: the same with ``zero_stage=1|2``; ``stage3``:
     ``hvd.shard_module(model)`` then a plain ``Adam`` over the module's (sharded) parameters.
   - torch ``torch-zero``: ``DistributedDataParallel`` + ``torch.distributed.optim.
     ZeroRedundancyOptimizer(optimizer_class=Adam)`` over gloo (started from ``MASTER_ADDR`` /
     ``MASTER_PORT``, which the driver sets, with ``RANK``/``WORLD_SIZE`` from Open MPI's).
   - keras ``stage0``-``stage2``: ``UnisonStrategy(zero_stage=k)`` (no argument for 0),
     ``model.compile(Adam)`` and ``model.fit`` inside ``strategy.scope()``.

   Torch's Adam runs with ``foreach=False``: the foreach kernels allocate temporaries as large
   as all the parameters together, which would blur the peak-RSS comparison between stages.
   A configuration the library cannot build yet (ImportError, TypeError, AttributeError,
   NotImplementedError on any rank) is reported as not available; every rank agrees on it.
3. ``--warmup`` steps, then ``--repeats`` runs of ``--steps`` steps, each started by a barrier;
   a run's time is the slowest rank's, and the fastest run counts (the CPUs are shared). Keras
   runs them all as one ``fit`` (at least one warm-up batch), timed by a callback, so ``fit``'s
   own start (tracing, the iterator) is not a step.
4. Counts what the rank holds after the last step (its gradients still there):

   - torch: ``untyped_storage().nbytes()`` over the *unique* storages of the model's parameters,
     the parameters of the optimizer and of any optimizer it holds as an attribute (the shard
     optimizer of a ZeRO wrapper, ``ZeroRedundancyOptimizer.optim``), their ``.grad``, and the
     tensors in those optimizers' ``state``. A storage is counted once, in the first of
     weights, grads, optimizer that reaches it.
   - keras: the sizes of ``model.weights`` and ``model.optimizer.variables`` (each variable once).
     Keras keeps gradients only as tensors inside the step, never as variables: none to count.
   - the declared working buffers: ``zero_working_bytes`` (an int, or a method returning one)
     of the optimizer, the module or the strategy, when the implementation declares it; else 0.
   - peak RSS: ``VmHWM`` of ``/proc/self/status``.

Rank 0 writes one JSON object to ``--out``: the configuration, ``samples_per_s``, the mean loss
of the last step, and per rank ``{weights, grads, optimizer, working, peak_rss, rss}`` bytes; or
``{"error": ...}`` when the configuration is not available.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

CLASSES, SEED, LR = 10, 1234, 1e-4
FRAMEWORKS = ("torch", "keras")
IMPLS = {"torch": ("stage0", "stage1", "stage2", "stage3", "torch-zero"),
         "keras": ("stage0", "stage1", "stage2")}
#: what "the library cannot build this configuration yet" looks like
NOT_AVAILABLE = (ImportError, TypeError, AttributeError, NotImplementedError)
WORKING_ATTR = "zero_working_bytes"


def stage_of(impl: str) -> int:
    """``"stage2" -> 2``; the ZeroRedundancyOptimizer anchor shards like stage 1."""
    return 1 if impl == "torch-zero" else int(impl.removeprefix("stage"))


def mlp_layers(params: int, width: int) -> int:
    """Hidden ``Linear(width, width)`` layers that bring the MLP nearest to ``params`` parameters."""
    return max(1, round((params - width * CLASSES) / (width * width + width)))


def mlp_params(layers: int, width: int) -> int:
    """Parameters of the MLP with ``layers`` hidden layers of ``width``."""
    return layers * (width * width + width) + width * CLASSES + CLASSES


# --- cgroup and memory -----------------------------------------------------------------------


def join_cgroup(prefix: str) -> None:
    """Moves this process into ``<prefix>-r<rank>`` (the rank from Open MPI's environment)."""
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    with open(f"{prefix}-r{rank}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


def proc_status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in bytes; 0 if absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def declared_working(*objs: Any) -> int:
    """The first ``zero_working_bytes`` an object declares (attribute or method), else 0."""
    for obj in objs:
        value = getattr(obj, WORKING_ATTR, None)
        if value is not None:
            return int(value() if callable(value) else value)
    return 0


# --- torch ------------------------------------------------------------------------------------


def torch_mlp(layers: int, width: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(SEED)
    body: list[nn.Module] = []
    for _ in range(layers):
        body += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*body, nn.Linear(width, CLASSES))


def start_gloo() -> Any:
    """torch.distributed over gloo from the driver's ``MASTER_ADDR``/``MASTER_PORT``."""
    import torch.distributed as dist

    os.environ.setdefault("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    os.environ.setdefault("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
    dist.init_process_group("gloo", init_method="env://")
    return dist


def adam(params: Any) -> Any:
    import torch

    return torch.optim.Adam(params, lr=LR, foreach=False)


def build_torch(impl: str, model: Any) -> tuple[Any, Any]:
    """``(model, optimizer)`` for ``impl`` (see the module docstring); may raise NOT_AVAILABLE."""
    import torch

    if impl == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        start_gloo()
        model = DistributedDataParallel(model)
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                              lr=LR, foreach=False)
    import unison.torch_backend as hvd

    hvd.init()
    stage = stage_of(impl)
    if stage == 3:
        sharded = hvd.shard_module(model)
        model = sharded if sharded is not None else model
        return model, adam(model.parameters())
    kwargs: dict[str, Any] = {"zero_stage": stage} if stage else {}
    opt = hvd.DistributedOptimizer(adam(model.parameters()), named_parameters=model.named_parameters(),
                                   **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def optimizers_in(opt: Any) -> list[Any]:
    """``opt`` and the optimizers it holds as attributes (one level: lists and dicts included)."""
    import torch

    found = [opt]
    for value in vars(opt).values():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
            else [value]
        found += [v for v in items if isinstance(v, torch.optim.Optimizer) and v is not opt]
    return found


def tensors_in(value: Any) -> Iterator[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)


def torch_state_bytes(model: Any, opt: Any) -> dict[str, int]:
    """Bytes of unique storages: weights, grads, optimizer state (see the module docstring)."""
    seen: set[int] = set()
    out = {"weights": 0, "grads": 0, "optimizer": 0}

    def add(kind: str, t: Any) -> None:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            out[kind] += s.nbytes()

    opts = optimizers_in(opt)
    params = list(model.parameters()) + [p for o in opts for g in o.param_groups for p in g["params"]]
    for p in params:
        add("weights", p)
    for p in params:
        if p.grad is not None:
            add("grads", p.grad)
    for o in opts:
        for t in tensors_in(list(o.state.values())):
            add("optimizer", t)
    return out


def run_torch(world: Any, args: argparse.Namespace) -> tuple[Callable[..., Any], Callable[[], dict]]:
    """Builds the torch configuration; returns (one step -> loss, the measurement)."""
    import torch
    from torch.nn import functional as F

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    gen = torch.Generator().manual_seed(SEED + 1 + world.Get_rank())
    x = torch.randn(args.batch, args.width, generator=gen)
    y = torch.randint(0, CLASSES, (args.batch,), generator=gen)
    model, opt = build_torch(args.impl, torch_mlp(args.layers, args.width))

    def step() -> float:
        opt.zero_grad(set_to_none=True)  # first, so the grads are still there after the last step
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    def measure() -> dict:
        return {**torch_state_bytes(model, opt), "working": declared_working(opt, model)}
    return step, measure


# --- keras ------------------------------------------------------------------------------------


def run_keras(world: Any, args: argparse.Namespace) -> tuple[Callable[..., Any], Callable[[], dict]]:
    """Builds the Keras configuration under UnisonStrategy; one "step" is a ``fit`` of one batch."""
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import layers

    from unison.tf_backend import UnisonStrategy

    stage = stage_of(args.impl)
    strategy = UnisonStrategy(zero_stage=stage) if stage else UnisonStrategy()
    keras.utils.set_random_seed(SEED)
    with strategy.scope():
        hidden = [layers.Dense(args.width, activation="relu") for _ in range(args.layers)]
        model = keras.Sequential([keras.Input((args.width,)), *hidden, layers.Dense(CLASSES)])
        model.compile(optimizer=keras.optimizers.Adam(LR), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    FitClock = fit_clock(keras)
    n = world.Get_size()
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((n * args.batch, args.width), dtype=np.float32)
    y = rng.integers(0, CLASSES, n * args.batch).astype(np.int32)
    data = tf.data.Dataset.from_tensors((x, y)).repeat()

    def steps(warmup: int, count: int, repeats: int) -> tuple[list[float], float]:
        clock = FitClock(world, warmup, count)
        hist = model.fit(data, epochs=1, steps_per_epoch=warmup + repeats * count, shuffle=False, verbose=0,
                         callbacks=[clock])
        return clock.elapsed, float(hist.history["loss"][-1])

    def measure() -> dict:
        return {"weights": keras_bytes(model.weights), "grads": 0,
                "optimizer": keras_bytes(model.optimizer.variables),
                "working": declared_working(model.optimizer, strategy, model)}
    return steps, measure


def fit_clock(keras: Any) -> type:
    """A callback class timing each run of ``count`` batches after ``warmup`` of one ``fit``, each from
    a barrier."""

    class FitClock(keras.callbacks.Callback):
        def __init__(self, world: Any, warmup: int, count: int) -> None:
            super().__init__()
            self.world, self.warmup, self.count = world, warmup, count
            self.t0, self.elapsed = 0.0, list[float]()

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            if batch >= self.warmup and (batch - self.warmup) % self.count == 0:
                self.world.Barrier()
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch >= self.warmup and (batch - self.warmup + 1) % self.count == 0:
                self.elapsed.append(time.perf_counter() - self.t0)
    return FitClock


def keras_bytes(variables: Sequence[Any]) -> int:
    import numpy as np

    seen: dict[int, int] = {}
    for v in variables:
        seen[id(v)] = int(np.prod(v.shape, dtype=np.int64)) * np.dtype(str(v.dtype)).itemsize
    return sum(seen.values())


# --- one launch -------------------------------------------------------------------------------


def first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0][:240] if text else ""


def agreed_error(world: Any, err: str) -> str:
    errs = world.allgather(err)
    return "; ".join(dict.fromkeys(e for e in errs if e))


def timed(world: Any, args: argparse.Namespace, step: Callable[..., Any]) -> tuple[list[float], float]:
    """``(seconds of each run of --steps steps, max over ranks; last loss, mean over ranks)``."""
    if args.framework == "keras":  # one fit; each run's clock starts at a barrier
        elapsed, loss = step(max(1, args.warmup), args.steps, args.repeats)
    else:
        for _ in range(args.warmup):
            step()
        elapsed = []
        for _ in range(args.repeats):
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = step()
            elapsed.append(time.perf_counter() - t0)
    world.Barrier()
    slowest = [max(ts) for ts in zip(*world.allgather(elapsed), strict=True)]
    return slowest, world.allreduce(loss) / world.Get_size()


def run(world: Any, args: argparse.Namespace) -> dict[str, Any]:
    n = world.Get_size()
    record: dict[str, Any] = {"framework": args.framework, "impl": args.impl, "stage": stage_of(args.impl),
                              "np": n, "layers": args.layers, "width": args.width,
                              "params": mlp_params(args.layers, args.width), "batch": args.batch,
                              "steps": args.steps}
    built, err = None, ""
    try:
        built = (run_torch if args.framework == "torch" else run_keras)(world, args)
    except NOT_AVAILABLE as exc:
        err = f"{type(exc).__name__}: {first_line(exc)}"
    err = agreed_error(world, err)
    if err or built is None:
        return {**record, "error": err}
    step, measure = built
    elapsed, loss = timed(world, args, step)
    mine = {**measure(), "peak_rss": proc_status_bytes("VmHWM"), "rss": proc_status_bytes("VmRSS")}
    return {**record, "samples_per_s": n * args.batch * args.steps / min(elapsed), "run_s": elapsed,
            "loss": loss, "per_rank": world.gather(mine, root=0)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="One configuration of benchmarks/zero.py (run under mpirun).")
    p.add_argument("--framework", choices=FRAMEWORKS, required=True)
    p.add_argument("--impl", required=True, help="stage0..stage3, or torch-zero (torch only)")
    p.add_argument("--layers", type=int, default=4, help="hidden Linear(width, width) layers")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="timed runs of --steps steps; the fastest counts")
    p.add_argument("--out", type=Path, required=True, help="rank 0 writes the JSON result here")
    p.add_argument("--cgroup", default=None, help="join the cgroup <CGROUP>-r<rank> first")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cgroup:
        join_cgroup(args.cgroup)  # before the frameworks allocate anything
    if args.impl not in IMPLS[args.framework]:
        raise SystemExit(f"--impl {args.impl!r} is not one of {IMPLS[args.framework]} for {args.framework}")
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    write_result(world, run(world, args), args.out)
    return 0


def write_result(world: Any, result: dict[str, Any], out: Path) -> None:
    """Rank 0 writes ``result`` to ``out`` (atomically); every rank waits for it."""
    if world.Get_rank() == 0:
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)
    world.Barrier()


if __name__ == "__main__":
    sys.exit(main())
