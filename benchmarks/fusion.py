"""Benchmark the engine's tensor fusion against plain MPI on a training step's gradients.

Run it inside one MPI job; every rank runs the same cases in the same order::

    unisonrun -np 2 python benchmarks/fusion.py --json out.json

Why it exists: a data-parallel training step all-reduces every gradient tensor
as soon as backward produces it, one call per tensor. Many small calls cost one
collective start-up each; the engine exists to hide that by negotiating named
tensors across ranks and fusing the ready ones into one buffer (see
``[Note: fusion buffer]`` in :mod:`unison.common.engine.executor`). The issue that
asked for this script set targets for that engine against the best a user could
do by hand with MPI, and quoted C++ Horovod on the same machine for context.
This script measures all of them on the same data, in one job, and prints the
targets with PASS/MISS.

What is measured:

* Cases (``--cases``). ``resnet50``: the shapes of ResNet-50's 161 parameter
  tensors (conv weights without bias, BatchNorm weight and bias, fc weight and
  bias; 25,557,032 float32 in all), written out below from the architecture in
  Keras' layout (conv ``kh x kw x in x out``, fc ``in x out``). ``small1000``:
  1,000 tensors of 1,000 float32. Both are submitted in backward order (the last
  layer first), as gradient hooks would see them. ``latency4B``: one 4-byte
  all-reduce; ``latency4K``: one 4 KiB (1024 float32) all-reduce.
* Impls (``--impls``), for ``resnet50`` and ``small1000``:

  - ``engine-fused``: one ``unison.allreduce_async`` per tensor, each under a
    stable name (``<case>.<index>``), then ``synchronize`` on every handle; the
    engine's fusion threshold as configured at ``unison.init()`` (128 MiB unless
    ``UNISON_FUSION_THRESHOLD`` says otherwise).
  - ``engine-nofusion``: the same calls with the engine's ``fusion_threshold``
    set to 0 for the duration of the impl (it is read by the engine thread at
    every cycle, so changing it between steps is safe).
  - ``engine-grouped``: one ``unison.grouped_allreduce_async`` of the whole set
    (its members get the same names as above).
  - ``mpi-per-tensor``: one blocking mpi4py ``Allreduce(src, dst)`` per tensor on
    preallocated numpy buffers.
  - ``mpi-packed``: every tensor copied into one preallocated contiguous buffer,
    one mpi4py ``Allreduce`` of it, and the result copied back out into one
    buffer per tensor; both copies are timed, as fusion's copies are.

  - ``torch-fused``: the same per-tensor calls through the PyTorch adapter:
    ``unison.torch_backend.allreduce_async(t, name=..., op=Sum)`` on CPU torch
    tensors (sharing the numpy inputs' memory), then ``synchronize`` on every
    handle, which returns a new torch tensor per input (Horovod's contract).
  - ``tf-fused``: ``unison.tf_backend.grouped_allreduce`` of the whole set inside
    one ``tf.function`` on TensorFlow tensors (the adapter's graph ops; TensorFlow's
    pools capped at 1 intra-op and 2 inter-op threads, as two ranks share two cores); the
    step ends when the function has returned its output tensors (their values
    are read only for the check: ``.numpy()`` copies, which a train step never does).

  For ``latency4B`` and ``latency4K``: ``engine`` (``unison.allreduce`` of the array
  under the name ``"lat"``), ``engine-unnamed`` (no name: the engine makes one per
  call), ``torch`` and ``torch-unnamed`` (``unison.torch_backend.allreduce`` of a
  torch tensor, with and without a name) and ``mpi-native`` (mpi4py ``Allreduce``).
  Unnamed calls cycle through ``AUTO_NAME_SLOTS`` names (frontend [Note: unnamed calls
  reuse names]), so the first that many each negotiate in full; the unnamed impls warm
  up for that many calls more, to time the steady state of a training loop.
  The mpi4py calls run on a ``Dup`` of ``COMM_WORLD``, the communicator type the
  engine itself uses. The engine calls return new arrays, as its API does.
* The op is ``Sum`` everywhere, so every impl computes the same thing. Inputs
  are filled with ``rank + 1``; each impl's last step is checked against
  ``n (n + 1) / 2`` on every element, and a wrong answer is reported as FAILED
  (every rank agrees on it), left out of the outputs, and makes the exit status 1.
* Timing: each impl is warmed up for ``--warmup`` steps (the engine's first step
  negotiates every name in full, later ones hit its response cache), then timed
  ``--repeats`` steps (``--latency-repeats`` for the latency cases), each step alone
  between a ``COMM_WORLD`` barrier and the clock. A step's time is its maximum
  over ranks; the reported time is the median step.
* Rounds (``--rounds``, default 3): every (case, impl) is timed once per round, the rounds
  one after the other, and the fastest round's median counts: the machine's speed moves over
  minutes, and one pass would compare impls across its phases.
* The floor of a case is the faster of ``mpi-per-tensor`` and ``mpi-packed``
  (for the latency cases, ``mpi-native``): what the same job gets from MPI without
  any engine. Every time is also printed as a ratio to it.

Outputs: a table, the targets and the issue's reference numbers on rank 0's
stdout; with ``--json``, a list of records ``{case, impl, np, tensors, bytes,
time_s}`` (``bytes`` is each rank's input: the sum over the set's tensors).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchutil import human_bytes, human_time, list_choices, selected, shown, write_json

logger = logging.getLogger("benchmarks.fusion")

CASES = ("resnet50", "small1000", "latency4B", "latency4K")
SET_IMPLS = ("engine-fused", "engine-nofusion", "engine-grouped", "torch-fused", "tf-fused", "mpi-per-tensor",
             "mpi-packed")
LATENCY_IMPLS = ("engine", "engine-unnamed", "torch", "torch-unnamed", "mpi-native")
IMPLS = SET_IMPLS + LATENCY_IMPLS
#: impls that need a framework (imported only when one of them runs)
TORCH_IMPLS = ("torch-fused", "torch", "torch-unnamed")
TF_IMPLS = ("tf-fused",)
#: The impls whose faster time is a case's floor.
FLOOR_IMPLS = {"resnet50": ("mpi-per-tensor", "mpi-packed"),
               "small1000": ("mpi-per-tensor", "mpi-packed"),
               "latency4B": ("mpi-native",),
               "latency4K": ("mpi-native",)}
#: (case, impl, metric, bound): "ratio" is time / floor, "ms" the time in milliseconds,
#: "vs:<impl>" the time over that impl's on the same case.
TARGETS = (
    ("resnet50", "engine-fused", "ratio", 1.15),
    ("small1000", "engine-fused", "ratio", 5.0),
    ("latency4B", "engine", "ms", 0.5),
    ("resnet50", "torch-fused", "ratio", 1.15),
    ("resnet50", "tf-fused", "ratio", 1.15),
    ("small1000", "torch-fused", "vs:engine-fused", 1.1),
    ("small1000", "tf-fused", "vs:engine-fused", 1.1),
    ("latency4K", "engine", "ms", 0.05),
    ("latency4K", "torch", "ms", 0.05),
    ("latency4K", "engine-unnamed", "vs:engine", 1.2),
    ("latency4K", "torch-unnamed", "vs:torch", 1.2),
)
REFERENCE = ("C++ Horovod 0.28.1 (MPI, np=2) on this machine: resnet50 77 ms vs floor 33 ms; "
             "small1000 29.5 ms vs floor 0.8 ms; 4 KiB allreduce 1.07 ms")
RESNET50_TENSORS, RESNET50_PARAMS = 161, 25_557_032
#: The engine's first step negotiates every name in full; from the next it uses its cache.
MIN_WARMUP = 3
LATENCY_MIN_WARMUP = 20


class WrongResultError(RuntimeError):
    """An impl returned a wrong answer on some rank; raised on every rank alike."""


@dataclass
class Record:
    """One measured (case, impl), as written to the JSON file."""

    case: str
    impl: str
    np: int
    tensors: int
    bytes: int
    time_s: float


# --- tensor sets ------------------------------------------------------------------------------


def resnet50_shapes() -> list[tuple[int, ...]]:
    """ResNet-50's parameter shapes in forward order (Keras layout: conv kh x kw x in x out).

    The stem (7x7 conv to 64, BatchNorm), then stages of [3, 4, 6, 3] bottleneck
    blocks of widths 64/128/256/512 and expansion 4: each block is a 1x1 conv to
    the width, a 3x3 conv, a 1x1 conv to 4x the width, each followed by a
    BatchNorm (weight and bias); a stage's first block adds a 1x1 downsample conv
    with its BatchNorm. Then the 2048 x 1000 classifier and its bias. Convs have
    no bias, as in torchvision.

    Raises:
        RuntimeError: the list does not add up to ResNet-50's 161 tensors and
            25,557,032 parameters (a bug in this function).
    """
    def bn(c: int) -> list[tuple[int, ...]]:
        return [(c,), (c,)]

    shapes: list[tuple[int, ...]] = [(7, 7, 3, 64), *bn(64)]
    cin = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
        cout = 4 * width
        for b in range(blocks):
            shapes += [(1, 1, cin, width), *bn(width), (3, 3, width, width), *bn(width),
                       (1, 1, width, cout), *bn(cout)]
            if b == 0:
                shapes += [(1, 1, cin, cout), *bn(cout)]
            cin = cout
    shapes += [(2048, 1000), (1000,)]
    params = sum(math.prod(s) for s in shapes)
    if len(shapes) != RESNET50_TENSORS or params != RESNET50_PARAMS:
        raise RuntimeError(f"ResNet-50 should have {RESNET50_TENSORS} tensors and {RESNET50_PARAMS} "
                           f"parameters; the list has {len(shapes)} and {params}")
    return shapes


def case_shapes(case: str) -> list[tuple[int, ...]]:
    """The shapes of ``case``'s tensors in submission order (backward order for resnet50)."""
    if case == "resnet50":
        return resnet50_shapes()[::-1]
    if case == "small1000":
        return [(1000,)] * 1000
    if case == "latency4K":
        return [(1024,)]
    return [(1,)]


# --- one step per impl ------------------------------------------------------------------------
# Each builder returns step(), which reduces the whole set once and returns the list of
# result arrays, in the order of the inputs.


def engine_step(tensors: Sequence[np.ndarray], names: Sequence[str]) -> Callable[[], list]:
    import unison

    def step() -> list:
        handles = [unison.allreduce_async(t, op=unison.Sum, name=nm)
                   for t, nm in zip(tensors, names, strict=True)]
        return [unison.synchronize(h) for h in handles]
    return step


def grouped_step(tensors: Sequence[np.ndarray], name: str) -> Callable[[], list]:
    import unison

    return lambda: unison.synchronize(unison.grouped_allreduce_async(list(tensors), op=unison.Sum,
                                                                     name=name))


def latency_step(x: np.ndarray, named: bool = True) -> Callable[[], list]:
    import unison

    name = "lat" if named else None
    return lambda: [unison.allreduce(x, op=unison.Sum, name=name)]


def torch_step(tensors: Sequence[np.ndarray], names: Sequence[str]) -> Callable[[], list]:
    """One ``unison.torch_backend.allreduce_async`` per torch tensor (sharing the numpy inputs'
    memory), then ``synchronize`` on every handle: what a hand-written gradient loop does."""
    import torch

    import unison.torch_backend as hvd

    ts = [torch.from_numpy(t) for t in tensors]

    def step() -> list:
        handles = [hvd.allreduce_async(t, name=nm, op=hvd.Sum) for t, nm in zip(ts, names, strict=True)]
        return [hvd.synchronize(h) for h in handles]
    return step


def torch_latency_step(x: np.ndarray, named: bool) -> Callable[[], list]:
    import torch

    import unison.torch_backend as hvd

    t = torch.from_numpy(x)
    name = "lat.torch" if named else None
    return lambda: [hvd.allreduce(t, name=name, op=hvd.Sum)]


def tf_step(tensors: Sequence[np.ndarray], name: str) -> Callable[[], list]:
    """``unison.tf_backend.grouped_allreduce`` of the whole set inside one ``tf.function`` (the
    TensorFlow adapter's graph ops: how a ``tf.function`` train step reduces its gradients)."""
    import tensorflow as tf

    import unison.tf_backend as hvd

    with contextlib.suppress(RuntimeError):  # (already set by an earlier case: TF allows it once)
        # two ranks share two cores: TF's pools capped as in every multi-rank script here
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    xs = [tf.constant(t) for t in tensors]

    @tf.function
    def reduce() -> list:
        return hvd.grouped_allreduce(xs, op=hvd.Sum, name=name)

    return lambda: list(reduce())  # EagerTensors, as a train step keeps them: ``.numpy()`` would copy


def mpi_per_tensor_step(comm: Any, tensors: Sequence[np.ndarray]) -> Callable[[], list]:
    from mpi4py import MPI

    outs = [np.empty_like(t) for t in tensors]

    def step() -> list:
        for src, dst in zip(tensors, outs, strict=True):
            comm.Allreduce(src, dst, op=MPI.SUM)
        return outs
    return step


def mpi_packed_step(comm: Any, tensors: Sequence[np.ndarray]) -> Callable[[], list]:
    from mpi4py import MPI

    total = sum(t.size for t in tensors)
    packed_in = np.empty(total, dtype=np.float32)
    packed_out = np.empty(total, dtype=np.float32)
    bounds = np.cumsum([0] + [t.size for t in tensors])
    ins = [packed_in[a:b].reshape(t.shape) for t, a, b in zip(tensors, bounds[:-1], bounds[1:],
                                                                 strict=True)]
    outs_packed = [packed_out[a:b].reshape(t.shape) for t, a, b in zip(tensors, bounds[:-1],
                                                                         bounds[1:], strict=True)]
    outs = [np.empty_like(t) for t in tensors]

    def step() -> list:
        for src, view in zip(tensors, ins, strict=True):
            np.copyto(view, src)
        comm.Allreduce(packed_in, packed_out, op=MPI.SUM)
        for view, dst in zip(outs_packed, outs, strict=True):
            np.copyto(dst, view)
        return outs
    return step


def build_step(case: str, impl: str, comm: Any, tensors: list[np.ndarray]) -> Callable[[], list]:
    """The step function of ``impl`` on ``case``'s tensors."""
    if impl in ("engine-fused", "engine-nofusion"):
        return engine_step(tensors, [f"{case}.{i}" for i in range(len(tensors))])
    if impl == "engine-grouped":
        return grouped_step(tensors, case)  # members are named "<case>.<index>" too
    if impl == "torch-fused":
        return torch_step(tensors, [f"{case}.torch.{i}" for i in range(len(tensors))])
    if impl == "tf-fused":
        return tf_step(tensors, f"{case}.tf")
    if impl in ("engine", "engine-unnamed"):
        return latency_step(tensors[0], named=impl == "engine")
    if impl in ("torch", "torch-unnamed"):
        return torch_latency_step(tensors[0], named=impl == "torch")
    if impl == "mpi-per-tensor" or impl == "mpi-native":
        return mpi_per_tensor_step(comm, tensors)
    return mpi_packed_step(comm, tensors)


# --- timing and checking ----------------------------------------------------------------------


def time_steps(world: Any, step: Callable[[], list], warmup: int, repeats: int) -> tuple[np.ndarray, list]:
    """Runs ``warmup`` untimed steps, then times ``repeats`` steps, each after a barrier.

    Args:
        world: the communicator for the barriers and the max-over-ranks reduction.
        step: reduces the whole set once and returns the results.
        warmup: untimed steps first.
        repeats: timed steps.

    Returns:
        The per-step times (max over ranks), and the last step's results.
    """
    from mpi4py import MPI

    out: list = []
    for _ in range(warmup):
        world.Barrier()
        out = step()
    times = np.empty(repeats)
    for i in range(repeats):
        out = []  # let the previous results go before the next step allocates
        world.Barrier()
        t0 = time.perf_counter()
        out = step()
        times[i] = time.perf_counter() - t0
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return times, out


def check(outs: Sequence[Any], shapes: Sequence[tuple[int, ...]], expect: float) -> str:
    """An empty string if every result has its shape and every element equals ``expect``."""
    if len(outs) != len(shapes):
        return f"got {len(outs)} results for {len(shapes)} tensors"
    for i, (out, shape) in enumerate(zip(outs, shapes, strict=True)):
        arr = np.asarray(out)
        if arr.shape != shape:
            return f"tensor {i}: result shape {arr.shape}, expected {shape}"
        if not (arr == expect).all():
            return (f"tensor {i} {shape}: got values {np.unique(arr)[:8].tolist()}, "
                    f"expected {expect:g} everywhere")
    return ""


class FusionThreshold:
    """Sets the running engine's fusion threshold for a block of steps, then restores it."""

    def __init__(self, value: int | None) -> None:
        from unison.common.engine import frontend

        self.engine = frontend.engine("benchmarks/fusion.py")
        self.value = value
        self.saved: int | None = None

    def __enter__(self) -> FusionThreshold:
        if self.engine is not None and self.value is not None:
            self.saved = self.engine.fusion_threshold
            self.engine.fusion_threshold = self.value
        return self

    def __exit__(self, *exc: object) -> None:
        if self.engine is not None and self.saved is not None:
            self.engine.fusion_threshold = self.saved


def run_case(world: Any, comm: Any, case: str, impl: str, args: argparse.Namespace,
             default_threshold: int) -> Record:
    """Times ``impl`` on ``case`` and checks its answer.

    Args:
        world: ``COMM_WORLD``, for the barriers, the timing and agreeing on the check.
        comm: the communicator the mpi4py impls run on.
        case, impl: what to run.
        args: the command line (``warmup``, ``repeats``, ``latency_repeats``).
        default_threshold: the engine's fusion threshold at start-up, for ``engine-fused``.

    Returns:
        The measured record.

    Raises:
        WrongResultError: the impl returned a wrong answer on some rank (raised on every rank).
    """
    n, r = world.Get_size(), world.Get_rank()
    shapes = case_shapes(case)
    tensors = [np.full(s, r + 1, dtype=np.float32) for s in shapes]
    step = build_step(case, impl, comm, tensors)
    latency = case.startswith("latency")
    warmup = max(args.warmup, LATENCY_MIN_WARMUP) if latency else args.warmup
    if impl.endswith("-unnamed"):  # the first AUTO_NAME_SLOTS unnamed calls each negotiate in full
        from unison.common.engine.requests import AUTO_NAME_SLOTS

        warmup += AUTO_NAME_SLOTS
    repeats = args.latency_repeats if latency else args.repeats
    threshold = {"engine-fused": default_threshold, "engine-nofusion": 0}.get(impl)
    with FusionThreshold(threshold):
        times, outs = time_steps(world, step, warmup, repeats)
    err = check(outs, shapes, n * (n + 1) / 2)
    errs = [f"rank {i}: {e}" for i, e in enumerate(world.allgather(err)) if e]
    if errs:
        raise WrongResultError("; ".join(errs))
    t = float(np.median(times))
    if r == 0:
        logger.debug("%s %s: %d repeats, median %s, min %s", case, impl, times.size, human_time(t),
                     human_time(float(times.min())))
    return Record(case, impl, n, len(tensors), sum(x.nbytes for x in tensors), t)


def settle(world: Any, comm: Any, cases: Sequence[tuple[str, str]], args: argparse.Namespace,
           default_threshold: int) -> None:
    """Run every (case, impl) untimed once before timing any of them.

    The first impl to run would otherwise pay for the whole process's warm-up: glibc
    raises its mmap threshold only after large blocks have been freed, so early
    steps take fresh, page-faulting memory for every result and later ones reuse
    heap memory. Measured here, that alone made whichever impl ran first look 20-40%
    slower on ``resnet50``.
    """
    for case, impl in cases:
        if case.startswith("latency"):
            continue
        r = world.Get_rank()
        tensors = [np.full(s, r + 1, dtype=np.float32) for s in case_shapes(case)]
        step = build_step(case, impl, comm, tensors)
        threshold = {"engine-fused": default_threshold, "engine-nofusion": 0}.get(impl)
        with FusionThreshold(threshold):
            for _ in range(args.warmup):
                step()
    world.Barrier()


def plan(cases: Sequence[str], impls: Sequence[str]) -> list[tuple[str, str]]:
    """The (case, impl) pairs to run: each case's applicable impls, side by side."""
    return [(case, impl) for case in cases for impl in impls
            if impl in (LATENCY_IMPLS if case.startswith("latency") else SET_IMPLS)]


# --- reporting --------------------------------------------------------------------------------


def floors(records: Sequence[Record]) -> dict[str, float]:
    """Each case's floor time: the fastest of its :data:`FLOOR_IMPLS` that was measured."""
    out: dict[str, float] = {}
    for rec in records:
        if rec.impl in FLOOR_IMPLS[rec.case]:
            out[rec.case] = min(out.get(rec.case, math.inf), rec.time_s)
    return out


def print_table(records: Sequence[Record]) -> None:
    floor = floors(records)
    print(f"{'case':<11}{'impl':<17}{'np':>3}{'tensors':>9}{'bytes':>12}{'time':>12}{'/ floor':>9}")
    for rec in records:
        ratio = f"{rec.time_s / floor[rec.case]:.2f}" if rec.case in floor else "-"
        print(f"{rec.case:<11}{rec.impl:<17}{rec.np:>3}{rec.tensors:>9}{human_bytes(rec.bytes):>12}"
              f"{human_time(rec.time_s):>12}{ratio:>9}")
    print("floor: the faster of mpi-per-tensor and mpi-packed (latency cases: mpi-native)")


def print_targets(records: Sequence[Record], n: int) -> None:
    by = {(r.case, r.impl): r for r in records}
    floor = floors(records)
    print(f"\ntargets (np={n})")
    for case, impl, metric, bound in TARGETS:
        rec = by.get((case, impl))
        digits, unit = 2, ""
        if metric == "ratio":
            what = f"{case} {impl} time / floor"
            value = rec.time_s / floor[case] if rec is not None and case in floor else None
        elif metric.startswith("vs:"):
            other = by.get((case, metric[3:]))
            what = f"{case} {impl} time / {metric[3:]}"
            value = rec.time_s / other.time_s if rec is not None and other is not None else None
        else:
            what = f"{case} {impl} time"
            value = rec.time_s * 1e3 if rec is not None else None
            digits, unit = 3, " ms"
        if value is None:
            verdict, text = "not measured", "n/a"
        else:
            verdict = "PASS" if value <= bound else "MISS"
            text = shown(value, value <= bound, bound, False, digits) + unit
        target = f"(target <= {bound:g}{unit})"
        print(f"  {what:<40} = {text:<9} {target:<20} {verdict}")
    print(f"\nreference from the issue: {REFERENCE}")


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Time the engine's per-tensor all-reduces (fused, unfused, grouped) against "
                    "mpi4py per tensor and packed, on ResNet-50's gradient shapes, on 1000 small "
                    "tensors, and the latency of one 4-byte and one 4 KiB all-reduce, through the "
                    "engine on numpy arrays and through the torch and TensorFlow adapters. Run "
                    "under unisonrun/mpirun; rank 0 prints.",
        epilog="Lists take commas or spaces. Engine settings come from the UNISON_* environment "
               "variables (e.g. UNISON_FUSION_THRESHOLD, UNISON_CYCLE_TIME).")
    p.add_argument("--cases", type=list_choices(CASES), nargs="+", default=[list(CASES)],
                   help=f"cases to run (default: all of {', '.join(CASES)})")
    p.add_argument("--impls", type=list_choices(IMPLS), nargs="+", default=[list(IMPLS)],
                   help=f"implementations to run (default: all of {', '.join(IMPLS)}; the last "
                        f"{len(LATENCY_IMPLS)} are the latency cases'")
    p.add_argument("--rounds", type=int, default=3,
                   help="run every case this many times, in turns, and keep each one's fastest (default 3)")
    p.add_argument("--repeats", type=int, default=20,
                   help="timed steps for resnet50 and small1000 (default 20)")
    p.add_argument("--latency-repeats", type=int, default=500,
                   help="timed calls for each latency case (default 500)")
    p.add_argument("--warmup", type=int, default=MIN_WARMUP,
                   help=f"untimed steps before timing, at least {MIN_WARMUP} (default {MIN_WARMUP}; "
                        f"the latency cases use at least {LATENCY_MIN_WARMUP})")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--log-level", default="WARNING",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="diagnostics on stderr")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.cases = selected(args.cases, CASES)
    args.impls = selected(args.impls, IMPLS)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1; got {args.rounds}")
    if args.repeats < 1 or args.latency_repeats < 1:
        p.error(f"--repeats and --latency-repeats must be at least 1; got {args.repeats} and "
                f"{args.latency_repeats}")
    if args.warmup < MIN_WARMUP:
        p.error(f"--warmup must be at least {MIN_WARMUP} (the engine's first step negotiates every "
                f"name in full; the timed steps should hit its cache); got {args.warmup}")
    if not plan(args.cases, args.impls):
        p.error(f"no impl of --impls {','.join(args.impls)} applies to --cases {','.join(args.cases)}: "
                f"resnet50 and small1000 take {', '.join(SET_IMPLS)}; the latency cases take "
                f"{', '.join(LATENCY_IMPLS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from mpi4py import MPI
    from tqdm import tqdm

    import unison
    from unison.common.engine import frontend

    unison.init()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format=f"[fusion rank {rank}] %(levelname)s %(message)s")
    load_start = os.getloadavg()[0]
    eng = frontend.engine("benchmarks/fusion.py")
    threshold = eng.fusion_threshold if eng is not None else 0
    comm = world.Dup()
    cases = plan(args.cases, args.impls)
    if rank == 0:
        settings = ("no engine (a job of size 1 computes locally)" if eng is None else
                    f"engine fusion threshold {human_bytes(threshold)}, cycle time "
                    f"{eng.cycle_time * 1e3:g} ms{', autotune ON' if eng.autotuner else ''}")
        print(f"np={n}, {settings}; {args.repeats} steps per set case, {args.latency_repeats} for "
              f"each latency case, after {args.warmup} warm-up steps; the fastest of {args.rounds} rounds")
        if eng is not None and threshold == 0:
            print("note: UNISON_FUSION_THRESHOLD is 0, so engine-fused does not fuse either")
    settle(world, comm, cases, args, threshold)
    best: dict[tuple[str, str], Record] = {}
    failures: list[str] = []
    failed: set[tuple[str, str]] = set()
    # --rounds (see the module docstring): each (case, impl) keeps its fastest round
    rounds = [(k, case, impl) for k in range(args.rounds) for case, impl in cases]
    bar = tqdm(rounds, disable=rank != 0, file=sys.stderr, unit="case", dynamic_ncols=True)
    for k, case, impl in bar:
        if (case, impl) in failed:
            continue
        bar.set_description(f"round {k + 1} {case} {impl}")
        what = f"{case} {impl} np={n}"
        try:
            rec = run_case(world, comm, case, impl, args, threshold)
            if (case, impl) not in best or rec.time_s < best[case, impl].time_s:
                best[case, impl] = rec
        except (WrongResultError, unison.UnisonError) as exc:
            # Both are raised on every rank alike (the engine agrees on errors before
            # moving data), so all ranks can go on to the next case.
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
            failed.add((case, impl))
            best.pop((case, impl), None)
            if rank == 0:
                logger.error("%s", failures[-1])
        except BaseException:
            logger.critical("%s failed on rank %d; the job ends", what, rank)
            raise
    bar.close()
    records = [best[c] for c in cases if c in best]
    if rank == 0:
        print_table(records)
        print_targets(records, n)
        for f in failures:
            print(f"FAILED: {f}")
        print(f"\nhost load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} "
              f"at end, on {os.cpu_count()} CPUs with {n} ranks; more than the ranks means other "
              "work shared the CPUs")
        if args.json is not None:
            write_json(args.json, records)
            print(f"wrote {args.json}")
    comm.Free()
    unison.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
