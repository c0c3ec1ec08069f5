"""Keras training throughput under UnisonStrategy against TensorFlow's MultiWorkerMirroredStrategy.

Run it inside one MPI job; every rank runs the same cases in the same order::

    unisonrun -np 1 python benchmarks/keras_training.py --json np1.json
    unisonrun -np 2 python benchmarks/keras_training.py --json np2.json --baseline-json np1.json

Why it exists: the issue that introduced ``unison.tf_backend.UnisonStrategy``
measured TensorFlow's own multi-process option on one host far below a single
process (see :data:`REFERENCE`) and set two targets at two ranks: a custom loop
under UnisonStrategy at least 3x the same loop under MultiWorkerMirroredStrategy
(on the mlp; the speed issue later set 1.2x for the compute-bound cnn),
and ``model.fit`` under UnisonStrategy at least 0.9x that custom loop (fit adds
Keras's per-step loss tracking, which UnisonStrategy makes global). This script
measures all three on the same model, data and global batch.

What is measured, for each (model, impl):

* ``model`` is ``mlp`` (4 ``Dense(1024, relu)`` on 1024 inputs, then ``Dense(10)``:
  ~4.2M parameters, so gradient exchange weighs as much as compute) or ``cnn``
  (three 3x3 convolutions on 32x32x3 images, ~0.1M parameters, compute bound).
  Weights start from a fixed seed (the strategies also broadcast them).
* Data is synthetic: one *global* batch of ``np * --batch`` samples drawn once from
  a fixed seed, the same on every rank, repeated as a ``tf.data`` dataset and given
  to the strategy, which hands each replica its ``--batch`` rows. Input loading is
  not measured. Each replica's batch size is checked before timing.
* ``impl``:

  - ``unison-fit``: ``model.compile(SGD, sparse cross-entropy)`` and ``model.fit``
    under ``UnisonStrategy``, ``verbose=0``. One warm-up ``fit`` of ``--warmup``
    steps (it traces the train function), then a ``fit`` of ``1 + --repeats *
    --steps`` steps; a callback times the runs of ``--steps`` steps after the
    first, so starting the epoch's iterator is not timed (the loops create theirs
    before warming up).
  - ``unison-loop``: a custom loop under ``UnisonStrategy``: a ``tf.function`` that
    takes the next element of ``experimental_distribute_dataset``, runs the step
    through ``strategy.run`` (forward, ``tf.nn.compute_average_loss(...,
    global_batch_size=np * batch)``, ``GradientTape``, ``optimizer.apply_gradients``)
    and returns ``strategy.reduce("SUM", loss)``, as TensorFlow's custom-loop
    tutorial does.
  - ``mwms-loop``: the same loop under ``tf.distribute.MultiWorkerMirroredStrategy``
    with ring collectives, one worker per rank on localhost.

  All three use the same SGD and ``jit_compile`` off, and by default the same
  glibc settings (``unison.common.runtime.keep_freed_memory``, which
  ``unison.init()`` applies), so the comparison is of the distribution only;
  ``--mwms-allocator default`` runs MWMS as a plain TensorFlow job would (glibc
  defaults: measured here that costs MWMS ~20% of its throughput on the mlp).
* Each case runs ``--warmup`` steps, then ``--repeats`` timed runs of ``--steps``
  steps, each after a barrier. A run's time is its maximum over ranks; the fastest
  run counts (the CPUs may be shared: the host load is printed), and
  ``samples_per_s = np * batch * steps / time``.
  [Note: passes] The cases run one after the other, so a slow spell of the machine
  would decide whichever ratio it falls on (unison-fit / unison-loop on the mlp read
  0.76, 0.83 and 1.08 in three one-pass runs within ten minutes). So every case
  runs ``--passes`` times (default 2), one pass over all of them after the other,
  each building its model afresh, and each case's fastest pass counts.
  After timing, the replicas' weights are compared (in every pass): data
  parallelism keeps them equal, so a difference is reported as a failure.

[Note: MWMS runs in child processes] MultiWorkerMirroredStrategy starts a TF
cluster (a gRPC server and collective executors) that cannot share a process
reliably with UnisonStrategy, and it is configured by ``TF_CONFIG`` rather than
MPI. So ``mwms-loop`` runs in children, first in each pass (in the first, before
Unison starts; in later ones the parents' Unison waits idle meanwhile): rank 0 picks one free
localhost port per rank and broadcasts them with mpi4py, and every rank runs this script
again as a plain Python child (no MPI; ``OMPI_*``/``PMIX_*`` variables removed)
with ``TF_CONFIG = {"cluster": {"worker": [...]}, "task": {"type": "worker",
"index": rank}}`` and the hidden ``--mwms-worker RESULT`` option. The children
time their loops and write times, batch sizes and weight checksums to RESULT;
the parent ranks merge them with MPI. A child that outlives ``--mwms-timeout``
seconds exits by itself, so a failed job leaves no workers behind.

Scaling against one process is ``samples_per_s(np) / samples_per_s(np=1)`` (and
that over ``np``, the efficiency), from the ``np=1`` records of ``--baseline-json``:
the same impl where present, else ``unison-loop`` (at one rank a plain
single-process loop: Unison's reductions return their inputs), marked ``*``;
without a baseline it is "n/a".

Every process uses ``--intra-op-threads`` (default 1) and ``--inter-op-threads``
(default 2) TensorFlow threads. Outputs: a table and the targets on rank 0's
stdout; with ``--json``, a list of records ``{model, impl, np, batch,
samples_per_s}`` (``batch`` is per replica), written atomically.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchutil import atomic_write, list_choices, ratio_target, selected, write_json

logger = logging.getLogger("benchmarks.keras_training")

MODELS = ("mlp", "cnn")
IMPLS = ("unison-fit", "unison-loop", "mwms-loop")
DEFAULT_BATCH = {"mlp": 64, "cnn": 32}
MLP_WIDTH, MLP_LAYERS, CLASSES = 1024, 4, 10
CNN_IMAGE = (32, 32, 3)
TARGET_NP = 2
#: (numerator impl, denominator impl, {model: minimum ratio}). The loop against MWMS: 3x on the
#: mlp (UnisonStrategy's issue, where the gradients weigh as much as the compute); 1.2x on the
#: compute-bound cnn (the speed issue's target: little to gain from communication there).
TARGETS = (("unison-loop", "mwms-loop", {"mlp": 3.0, "cnn": 1.2}),
           ("unison-fit", "unison-loop", {"mlp": 0.9, "cnn": 0.9}))
REFERENCE = ("measured here: one process 5,992 samples/s; two MWMS workers together 1,794 "
             "(4 dense layers of 1024, 3.7M parameters, 64 samples per worker)")
LR, SEED = 0.01, 1234
SYNC_RTOL = 1e-5
MPI_ENV_PREFIXES = ("OMPI_", "PMIX_", "PRTE_")


@dataclass
class Record:
    """One measured case, as written to the JSON file."""

    model: str
    impl: str
    np: int
    batch: int
    samples_per_s: float


@dataclass
class Timing:
    """What one process measured for one case: seconds per repeat, its replica's batch, weight checksums."""

    elapsed: list[float]
    local_batch: int
    checksums: list[float]


class OutOfSyncError(RuntimeError):
    """The replicas' weights differ after training; raised on every rank alike."""


# --- models and data --------------------------------------------------------------------------


def build_model(name: str) -> Any:
    """A fresh ``mlp`` or ``cnn`` with weights drawn from :data:`SEED` (same on every call)."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(SEED)
    if name == "mlp":
        hidden = [layers.Dense(MLP_WIDTH, activation="relu") for _ in range(MLP_LAYERS)]
        return keras.Sequential([keras.Input((MLP_WIDTH,)), *hidden, layers.Dense(CLASSES)])
    return keras.Sequential([
        keras.Input(CNN_IMAGE),
        layers.Conv2D(32, 3, padding="same", activation="relu"), layers.MaxPooling2D(),  # 16x16x32
        layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(),  # 8x8x64
        layers.Conv2D(128, 3, padding="same", activation="relu"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(CLASSES),
    ])


def global_dataset(name: str, global_batch: int) -> Any:
    """An endless ``tf.data`` dataset repeating one global batch drawn from :data:`SEED`."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(SEED)
    shape = (global_batch, MLP_WIDTH) if name == "mlp" else (global_batch, *CNN_IMAGE)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, CLASSES, global_batch).astype(np.int32)
    return tf.data.Dataset.from_tensors((x, y)).repeat()


def checksums(model: Any) -> list[float]:
    """A float64 sum per weight tensor: cheap, and any lost or partial gradient exchange shows."""
    import numpy as np

    return [float(np.sum(np.asarray(w, dtype=np.float64))) for w in model.get_weights()]


# --- the timed loops --------------------------------------------------------------------------


def local_batch_size(strategy: Any, iterator: Any) -> int:
    """The number of rows this process's replica receives per step (consumes one element)."""
    import tensorflow as tf

    sizes = strategy.run(lambda x, y: tf.shape(x)[0], args=next(iterator))
    return int(strategy.experimental_local_results(sizes)[0])


def make_train_step(strategy: Any, model: Any, opt: Any, global_batch: int) -> Callable[[Any], Any]:
    """The custom-loop step: ``strategy.run`` of forward/backward/apply, then the summed loss."""
    import keras
    import tensorflow as tf

    def replica_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function(jit_compile=False)
    def train_step(iterator: Any) -> Any:
        per_replica = strategy.run(replica_step, args=next(iterator))
        return strategy.reduce("SUM", per_replica, axis=None)
    return train_step


def time_loop(strategy: Any, name: str, global_batch: int, args: argparse.Namespace,
              barrier: Callable[[], None]) -> Timing:
    """Builds ``name`` under ``strategy`` and times ``args.repeats`` runs of ``args.steps`` loop steps."""
    import keras

    with strategy.scope():
        model = build_model(name)
        opt = keras.optimizers.SGD(LR)
        opt.build(model.trainable_variables)  # slots now, not inside the tf.function
    iterator = iter(strategy.experimental_distribute_dataset(global_dataset(name, global_batch)))
    local_batch = local_batch_size(strategy, iterator)
    step = make_train_step(strategy, model, opt, global_batch)
    for _ in range(args.warmup):
        step(iterator)
    elapsed = []
    for _ in range(args.repeats):
        barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step(iterator)
        float(loss)
        elapsed.append(time.perf_counter() - t0)
    barrier()
    return Timing(elapsed, local_batch, checksums(model))


def time_fit(strategy: Any, name: str, global_batch: int, args: argparse.Namespace,
             barrier: Callable[[], None]) -> Timing:
    """Compiles ``name`` under ``strategy``, warms ``fit`` up, then times steps of one more ``fit``.

    The timed ``fit`` runs ``1 + args.repeats * args.steps`` steps and the clock starts
    after its first: like the loops, this leaves out starting the epoch's input iterator.
    """
    import keras

    class Clock(keras.callbacks.Callback):
        """Seconds for each ``args.steps`` batches after batch 0, each run started by a barrier."""

        def __init__(self) -> None:
            super().__init__()
            self.elapsed: list[float] = []
            self.t0 = 0.0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch > 0 and batch % args.steps == 0:
                self.elapsed.append(time.perf_counter() - self.t0)
            if batch < args.repeats * args.steps and batch % args.steps == 0:
                barrier()
                self.t0 = time.perf_counter()

    with strategy.scope():
        model = build_model(name)
        model.compile(optimizer=keras.optimizers.SGD(LR), jit_compile=False,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = global_dataset(name, global_batch)
    local_batch = local_batch_size(strategy, iter(strategy.experimental_distribute_dataset(data)))
    model.fit(data, epochs=1, steps_per_epoch=args.warmup, shuffle=False, verbose=0)
    clock = Clock()
    model.fit(data, epochs=1, steps_per_epoch=1 + args.repeats * args.steps, shuffle=False,
              verbose=0, callbacks=[clock])
    barrier()
    return Timing(clock.elapsed, local_batch, checksums(model))


# --- MultiWorkerMirroredStrategy in child processes (see [Note: MWMS runs in child processes]) --


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def mwms_worker(args: argparse.Namespace) -> int:
    """Child-process entry: one MWMS worker (``TF_CONFIG`` set by the parent); writes Timings."""
    watchdog = threading.Timer(args.mwms_timeout, os._exit, (124,))  # never outlive the job
    watchdog.daemon = True
    watchdog.start()
    try:
        import tensorflow as tf

        if args.mwms_allocator == "unison":
            from unison.common import runtime

            runtime.keep_freed_memory()  # the allocator settings unison.init() gives the Unison ranks
        configure_tf(args)
        impl = tf.distribute.experimental.CommunicationImplementation.RING
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(implementation=impl))
        n = strategy.num_replicas_in_sync

        @tf.function
        def meet() -> Any:  # every worker's one-element all-reduce: the barrier the Unison cases get
            return strategy.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.ones([1])))

        def barrier() -> None:  # (before 2026-12-07 none: a worker that started late made MWMS look slower)
            strategy.experimental_local_results(meet())[0].numpy()

        results = {}
        for name in args.models:
            timing = time_loop(strategy, name, n * batch_of(args, name), args, barrier)
            results[name] = timing.__dict__
        atomic_write(args.mwms_worker, lambda f: json.dump(results, f), "w")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # TF's cluster threads could keep a normal exit waiting
    os._exit(0)  # skip TF's cluster teardown, which can block on the other worker


def run_mwms(world: Any, args: argparse.Namespace) -> dict[str, Timing]:
    """Runs one MWMS worker per rank as a child process; returns this rank's Timing per model."""
    import tempfile

    rank, n = world.Get_rank(), world.Get_size()
    ports = world.bcast(free_ports(n) if rank == 0 else None, root=0)
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}
    env["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                   "task": {"type": "worker", "index": rank}})
    with tempfile.TemporaryDirectory(prefix="keras_training_mwms.") as tmp:
        result = Path(tmp) / f"rank{rank}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--mwms-worker", str(result),
               "--models", ",".join(args.models), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--repeats", str(args.repeats),
               "--mwms-timeout", str(args.mwms_timeout), "--mwms-allocator", args.mwms_allocator,
               "--intra-op-threads", str(args.intra_op_threads),
               "--inter-op-threads", str(args.inter_op_threads)]
        if args.batch is not None:
            cmd += ["--batch", str(args.batch)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not result.exists():
            why = (f"timed out after --mwms-timeout {args.mwms_timeout:g} s"
                   if proc.returncode == 124 else f"exit status {proc.returncode}")
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:]) or "(no output)"
            raise RuntimeError(f"mwms-loop worker {rank} of {n} failed ({why}); its output ends:\n{tail}")
        return {name: Timing(**t) for name, t in json.loads(result.read_text()).items()}


# --- one case on every rank -------------------------------------------------------------------


def batch_of(args: argparse.Namespace, name: str) -> int:
    return args.batch or DEFAULT_BATCH[name]


def merge(world: Any, name: str, impl: str, timing: Timing, args: argparse.Namespace) -> Record:
    """Checks every rank's batch and weights; the best repeat's slowest rank gives the Record.

    Raises:
        OutOfSyncError: on every rank, when the ranks' weights differ.
        RuntimeError: on every rank, when a replica got a batch other than ``--batch``.
    """
    import numpy as np

    n, batch = world.Get_size(), batch_of(args, name)
    everyone = world.allgather(timing)
    batches = [t.local_batch for t in everyone]
    if any(b != batch for b in batches):
        raise RuntimeError(f"{name} {impl}: replicas got batches {batches} of a global batch of "
                           f"{n * batch}; each should get {batch}")
    mine = np.array(timing.checksums)
    worst = max(float(np.max(np.abs(np.array(t.checksums) - mine) / (np.abs(mine) + 1e-12)))
                for t in everyone)
    if worst > SYNC_RTOL:
        raise OutOfSyncError(f"{name} {impl}: weights differ across ranks after training "
                             f"(largest relative checksum difference {worst:.3g}, tolerance {SYNC_RTOL})")
    elapsed = min(max(run) for run in zip(*(t.elapsed for t in everyone), strict=True))
    return Record(name, impl, n, batch, n * batch * args.steps / elapsed)


def configure_tf(args: argparse.Namespace) -> None:
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)


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


def one_process(rec: Record, baseline: dict[tuple[str, str], float] | None) -> tuple[float | None, str]:
    """The np=1 samples/s ``rec`` scales against, and ``"*"`` when it is unison-loop's stand-in."""
    base = baseline or {}
    if (rec.model, rec.impl) in base:
        return base[(rec.model, rec.impl)], ""
    if (rec.model, "unison-loop") in base:
        return base[(rec.model, "unison-loop")], "*"
    return None, ""


def print_table(records: Sequence[Record], baseline: dict[tuple[str, str], float] | None) -> None:
    print(f"{'model':<7}{'impl':<13}{'np':>3}{'batch':>7}{'samples/s':>12}{'x np=1':>9}{'efficiency':>12}")
    starred = False
    for rec in records:
        one, mark = one_process(rec, baseline)
        starred |= mark == "*"
        speedup = "n/a" if one is None else f"{rec.samples_per_s / one:.2f}{mark}"
        eff = "n/a" if one is None else f"{rec.samples_per_s / (rec.np * one):.2f}{mark}"
        print(f"{rec.model:<7}{rec.impl:<13}{rec.np:>3}{rec.batch:>7}{rec.samples_per_s:>12.1f}"
              f"{speedup:>9}{eff:>12}")
    print("batch is per replica; x np=1 = samples/s against one process, efficiency = that / np")
    if baseline is None:
        print("x np=1, efficiency: n/a without --baseline-json (the JSON of an np=1 run)")
    if starred:
        print("* against unison-loop at np=1 (a plain one-process loop): the baseline has no such impl")


def print_targets(records: Sequence[Record], n: int) -> None:
    by = {(r.model, r.impl): r.samples_per_s for r in records}
    print(f"\ntargets (np={n}; set for np={TARGET_NP}):")
    for model in dict.fromkeys(r.model for r in records):
        for mine, theirs, minimums in TARGETS:
            note = "" if n == TARGET_NP else f"  (this is np={n})"
            print(ratio_target(f"{model:<5} {mine} / {theirs}", by.get((model, mine)), by.get((model, theirs)),
                               minimums[model], note))
    print(f"reference (from the issue): {REFERENCE}")


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Time Keras training under UnisonStrategy (model.fit and a custom loop) against "
                    "the same custom loop under MultiWorkerMirroredStrategy, on the same model, data "
                    "and global batch. Run under unisonrun/mpirun; rank 0 prints. mwms-loop runs in "
                    "one child process per rank (see the module docstring).",
        epilog="Lists take commas or spaces, e.g. --impls unison-loop,mwms-loop.")
    p.add_argument("--models", type=list_choices(MODELS), nargs="+", default=[list(MODELS)],
                   help=f"models to run (default: all of {', '.join(MODELS)})")
    p.add_argument("--impls", type=list_choices(IMPLS), nargs="+", default=[list(IMPLS)],
                   help=f"implementations to run (default: all of {', '.join(IMPLS)})")
    p.add_argument("--steps", type=int, default=20, help="timed steps per case (default 20)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of --steps steps per case; the fastest counts (default 3)")
    p.add_argument("--passes", type=int, default=2,
                   help="passes over all the cases, one after the other; each case's fastest pass "
                        "counts (default 2)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps before timing, at least 1: the first one traces (default 3)")
    p.add_argument("--batch", type=int, default=None,
                   help="batch per replica for every model; the global batch is np times it (default: "
                        + ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items()) + ")")
    p.add_argument("--intra-op-threads", type=int, default=1,
                   help="TensorFlow intra-op threads per process (default 1)")
    p.add_argument("--inter-op-threads", type=int, default=2,
                   help="TensorFlow inter-op threads per process (default 2)")
    p.add_argument("--mwms-allocator", choices=("unison", "default"), default="unison",
                   help="glibc malloc settings of the mwms-loop workers: 'unison' (default) gives them "
                        "what unison.init() gives the Unison ranks, so only the distribution differs; "
                        "'default' leaves glibc's, as a plain TensorFlow job runs")
    p.add_argument("--mwms-timeout", type=float, default=600.0,
                   help="seconds after which an mwms-loop worker process gives up (default 600)")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--baseline-json", type=Path, default=None,
                   help="JSON of an np=1 run of this script, for scaling against one process")
    p.add_argument("--mwms-worker", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.models = selected(args.models, MODELS)
    args.impls = selected(args.impls, IMPLS)
    if min(args.steps, args.repeats, args.warmup, args.batch or 1, args.passes) < 1:
        p.error(f"--steps, --repeats, --warmup, --batch and --passes must be at least 1 (got --steps "
                f"{args.steps}, --repeats {args.repeats}, --warmup {args.warmup}, --batch {args.batch}, "
                f"--passes {args.passes})")
    if args.intra_op_threads < 1 or args.inter_op_threads < 1:
        p.error(f"thread counts must be at least 1 (got --intra-op-threads {args.intra_op_threads}, "
                f"--inter-op-threads {args.inter_op_threads})")
    return args


def unison_strategy(world: Any) -> Any:
    """The UnisonStrategy every ``unison-*`` case runs under (it starts Unison)."""
    from unison.tf_backend import UnisonStrategy

    strategy = UnisonStrategy()
    if strategy.num_replicas_in_sync != world.Get_size():
        raise RuntimeError(f"UnisonStrategy has {strategy.num_replicas_in_sync} replicas but "
                           f"MPI_COMM_WORLD has {world.Get_size()} ranks")
    return strategy


def run_unison(world: Any, strategy: Any, args: argparse.Namespace) -> dict[tuple[str, str], Timing]:
    """Times the ``unison-*`` impls of every model under ``strategy``; this rank's Timings."""
    n = world.Get_size()
    timings = {}
    for name in args.models:
        for impl, run in (("unison-fit", time_fit), ("unison-loop", time_loop)):
            if impl in args.impls:
                logger.info("%s %s", name, impl)
                timings[(name, impl)] = run(strategy, name, n * batch_of(args, name), args, world.Barrier)
    return timings


def report(records: Sequence[Record], failures: Sequence[str], n: int, args: argparse.Namespace,
           load_start: float) -> None:
    """Rank 0's output: setup, table, targets, failures, host load; the JSON file."""
    import tensorflow as tf

    baseline = load_baseline(args.baseline_json) if args.baseline_json is not None else None
    print(f"np={n}, TensorFlow {tf.__version__}, {args.intra_op_threads} intra-op / "
          f"{args.inter_op_threads} inter-op thread(s) per process, best of {args.repeats} runs of "
          f"{args.steps} steps after {args.warmup} warm-up, in the best of {args.passes} pass(es)")
    for name in args.models:
        print(f"{name}: {build_model(name).count_params():,} parameters, batch "
              f"{batch_of(args, name)} per replica, global batch {n * batch_of(args, name)}")
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


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mwms_worker is not None:
        return mwms_worker(args)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[keras_training rank {rank}] %(levelname)s %(message)s")
    if args.baseline_json is not None:
        load_baseline(args.baseline_json)  # a bad file fails now, not after the runs
    load_start = os.getloadavg()[0]

    timings: dict[tuple[str, str], list[Timing]] = {}
    strategy = None
    for k in range(args.passes):  # [Note: passes]
        if "mwms-loop" in args.impls:  # first: [Note: MWMS runs in child processes]
            logger.info("pass %d of %d: mwms-loop: %d worker process(es), models %s", k + 1, args.passes, n,
                        ", ".join(args.models))
            for name, t in run_mwms(world, args).items():
                timings.setdefault((name, "mwms-loop"), []).append(t)
        if any(i.startswith("unison-") for i in args.impls):
            if strategy is None:
                configure_tf(args)
                strategy = unison_strategy(world)
            logger.info("pass %d of %d: unison", k + 1, args.passes)
            for key, t in run_unison(world, strategy, args).items():
                timings.setdefault(key, []).append(t)

    records: list[Record] = []
    failures: list[str] = []
    for name in args.models:
        for impl in args.impls:
            try:  # every pass is checked; the fastest counts
                passes = [merge(world, name, impl, t, args) for t in timings[(name, impl)]]
                records.append(max(passes, key=lambda r: r.samples_per_s))
            except OutOfSyncError as exc:
                failures.append(str(exc))
    if rank == 0:
        report(records, failures, n, args, load_start)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
