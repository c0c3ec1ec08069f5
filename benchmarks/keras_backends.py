"""Keras ``model.fit`` across two ranks on every Keras backend: ``unison.keras`` against each backend's best peer.

Run it as a plain Python program (not under mpirun); it starts every case itself::

    python benchmarks/keras_backends.py --json keras_backends.json --png keras_backends.png

Why it exists: the issue that introduced ``unison.keras`` (one ``DataParallel().scope()`` for
``model.fit`` with ``KERAS_BACKEND`` = tensorflow, jax or torch) set a target at two ranks: on every
backend, ``unison.keras`` reaches at least 1.2x the samples/s of the best multi-process option that
backend already has, and the scaling efficiency against one process is printed beside it. This
script measures, per backend and model, three cases on the same model, data and global batch:

* ``unison``: ``unison.keras.DataParallel()``; inside ``dp.scope()`` build, compile
  (``SGD(0.01)``, sparse cross-entropy on logits) and ``model.fit`` the numpy arrays of the global
  data with ``batch_size`` = the global batch; each rank trains on its rows of every global batch.
  Started as ``python -m unison.run -np 2 --oversubscribe python keras_backends.py --worker ...``
  (``unisonrun``: ``mpirun`` with ``--bind-to none`` and ``mpi_yield_when_idle``).
* the peer, the best option each backend offers without Unison:

  - tensorflow, ``mwms-loop``: ``tf.distribute.MultiWorkerMirroredStrategy`` (ring) running the
    custom training loop of ``benchmarks/keras_training.py`` (the existing anchor: that script's
    ``--mwms-worker`` mode, run unchanged as two processes with ``TF_CONFIG``).
  - jax, ``keras-dp``: ``keras.distribution.DataParallel`` over two host devices in ONE process
    (``XLA_FLAGS=--xla_force_host_platform_device_count=2``) and ``model.fit``; JAX splits each
    global batch over the devices inside one jitted step.
  - torch, ``ddp-gloo``: a hand-written loop, two processes, around the same Keras model (a Keras
    model on the torch backend is a ``torch.nn.Module``): ``DistributedDataParallel`` over gloo
    (rendezvous on 127.0.0.1 and a free port), ``torch.optim.SGD(model.parameters(), 0.01)``,
    ``torch.nn.functional.cross_entropy`` on the rank's rows of the global batch.

* ``one-process``: plain ``model.fit`` (no distribution) in one process on ONE rank's share of
  the data, i.e. a batch of ``--batch`` (half the global batch).
* ``independent``: two such ``one-process`` fits started together, each in its own process, with
  no communication at all: what this machine's cores give two processes of that work, so the
  most any two-process data parallelism (Unison, MWMS, DDP) could reach here. Their runs are not
  aligned by a barrier (they share nothing), so the bound is approximate. It has no target; the
  ``bound`` lines print every two-process impl against it, which tells the cost of distribution
  from the cost of sharing two cores (keras-dp, one process, is not bound by it).

[Note: scaling efficiency is weak scaling] The per-rank batch is held constant, as data-parallel
training is used: ``efficiency = samples/s at np=2 / (2 x samples/s of one process at the per-rank
batch)``. 1.0 means the second rank doubles the throughput; on this 2-core host a rank also
competes with the other rank's threads for the cores, so it measures the machine as much as the
library. It is printed for ``unison`` (the issue's number) and for the peer, with no target.

Models are those of ``benchmarks/keras_training.py`` (``build_model``: ``mlp``, 4 ``Dense(1024)``,
~4.2M parameters, gradient exchange weighs as much as compute; ``cnn``, three 3x3 convolutions on
32x32x3, ~0.1M parameters, compute bound), with its per-rank batches (mlp 64, cnn 32) and seed.
Data is one global batch drawn once from that seed, tiled to as many batches as a ``fit`` needs,
so input loading costs the same everywhere and is small. ``jit_compile`` is off on TensorFlow (as
in keras_training.py; its MWMS loop is not XLA-compiled either) and Keras's default elsewhere
(jitted on JAX, eager on torch).

Timing (as keras_training.py): each case runs one ``fit`` (or loop) of ``--warmup`` steps (it
traces/compiles), then ``--repeats`` timed runs of ``--steps`` steps, each run started after a
barrier across the case's processes; for ``fit`` a callback times the runs inside one ``fit`` of
``1 + repeats x steps`` steps, after its first step, so starting the epoch is not timed. A run's
time is its maximum over processes, the fastest run counts (the CPUs may be shared: the host
load is printed), and ``samples_per_s = global batch x steps / time`` (for ``one-process`` the
global batch is its own batch). The whole list of cases runs ``--passes`` times (default 2), one
pass after the other, and each case's fastest pass counts: the cases cannot run at the same time
on two cores, and the machine has slow spells of a minute or more that would otherwise sink
whichever case they fall on (a JAX mlp ratio of 1.16 in one run, 1.57-1.68 in the runs around it).
After timing, the processes' weights are compared (float64 sum
per tensor); data parallelism keeps them equal, so a difference is reported as a failure. The
MWMS workers measure the rows each replica receives, and they are checked; the ``fit`` cases
record the per-rank batch the split defines (``unison.keras`` and Keras give each rank
``global / 2`` rows; their own tests check that), and the DDP loop slices its rows itself.

Each backend runs in its own processes (``KERAS_BACKEND`` is fixed per process), every one with
``--threads`` intra-op threads (``OMP_NUM_THREADS``, TensorFlow's intra-op pool,
``torch.set_num_threads``; on JAX, for 1, ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1``) and TensorFlow's 2 inter-op threads, as in keras_training.py.

[Note: keras-dp threads] The JAX peer is one process driving both devices, so it keeps XLA's
default threading (the one-process analogue of two single-threaded ranks; XLA has no per-device
thread count). Measured here under load, forcing eigen off slowed its mlp case, so the default
is the peer's better setting.

By default (``--allocator unison``) the cases other than ``unison`` get the glibc malloc settings
``unison.init()`` gives the unison ranks (``runtime.keep_freed_memory``), as keras_training.py's
MWMS workers do, so only the distribution differs. Every launch has a timeout (``--timeout``); a
failed case is reported and the others still run.

Outputs: a table, the target lines and the efficiency lines on stdout; with ``--json`` a list of
records ``{backend, model, impl, np, batch, global_batch, samples_per_s}`` (``np`` = processes, or
devices for keras-dp; ``batch`` = rows per rank); with ``--png`` a bar chart.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchutil import atomic_write, kill_group, list_choices, ratio_target, selected, write_json
from keras_training import (
    CLASSES,
    CNN_IMAGE,
    DEFAULT_BATCH,
    LR,
    MLP_WIDTH,
    MPI_ENV_PREFIXES,
    SEED,
    SYNC_RTOL,
    Timing,
    build_model,
    checksums,
    free_ports,
)

logger = logging.getLogger("benchmarks.keras_backends")

BACKENDS = ("tensorflow", "jax", "torch")
MODELS = ("mlp", "cnn")
IMPLS = ("one-process", "independent", "peer", "unison")
NP = 2
TARGET_RATIO = 1.2
#: backend -> (peer impl name as recorded, what it is, as printed in the target lines)
PEERS = {"tensorflow": ("mwms-loop", "MultiWorkerMirroredStrategy"),
         "jax": ("keras-dp", "keras.distribution.DataParallel"),
         "torch": ("ddp-gloo", "torch DDP gloo")}
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER_MODES = ("fit-one", "fit-unison", "fit-keras-dp", "ddp")
#: one process to start: (command, environment)
Launch = tuple[list[str], dict[str, str]]


@dataclass
class Record:
    """One measured case, as written to the JSON file."""

    backend: str
    model: str
    impl: str
    np: int
    batch: int
    global_batch: int
    samples_per_s: float
    #: the host's 1-minute load average when the case ended, the case's own threads included
    host_load: float


@dataclass
class Outcome:
    """What the driver collected for one (backend, impl): Timings per model, one per process."""

    timings: dict[str, list[Timing]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    host_load: float = 0.0


# === worker side: one case, in processes whose KERAS_BACKEND is set ===========================


def training_data(name: str, global_batch: int, batches: int) -> tuple[Any, Any]:
    """``batches`` copies of one global batch drawn from :data:`SEED`, as numpy arrays."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    shape = (global_batch, MLP_WIDTH) if name == "mlp" else (global_batch, *CNN_IMAGE)
    x = rng.standard_normal(shape, dtype=np.float32)
    y = rng.integers(0, CLASSES, global_batch).astype(np.int32)
    return np.tile(x, (batches,) + (1,) * (x.ndim - 1)), np.tile(y, batches)


def make_clock(steps: int, repeats: int, barrier: Callable[[], None]) -> Any:
    """A Keras callback timing each run of ``steps`` batches after batch 0, each started by a barrier."""
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.elapsed: list[float] = []
            self.t0 = 0.0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            # not async_safe: Keras has turned ``logs`` into Python floats, so the step has finished
            if batch > 0 and batch % steps == 0:
                self.elapsed.append(time.perf_counter() - self.t0)
            if batch < repeats * steps and batch % steps == 0:
                barrier()
                self.t0 = time.perf_counter()

    return Clock()


def time_fit(name: str, batch: int, global_batch: int, args: argparse.Namespace, scope: Any,
             barrier: Callable[[], None]) -> Timing:
    """Builds and compiles ``name`` inside ``scope``; a warm-up ``fit``, then a timed one."""
    import keras

    with scope:
        model = build_model(name)
        jit = False if keras.backend.backend() == "tensorflow" else "auto"
        model.compile(optimizer=keras.optimizers.SGD(LR), jit_compile=jit,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x, y = training_data(name, global_batch, args.warmup)
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)
        clock = make_clock(args.steps, args.repeats, barrier)
        x, y = training_data(name, global_batch, 1 + args.repeats * args.steps)
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[clock])
    barrier()
    return Timing(clock.elapsed, batch, checksums(model))


def set_threads(threads: int) -> None:
    """This process's intra-op threads (and TensorFlow's 2 inter-op) on the active backend."""
    import keras

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    elif backend == "torch":
        import torch

        torch.set_num_threads(threads)


def versions() -> dict[str, str]:
    import keras

    backend = keras.backend.backend()
    module = __import__(backend)
    return {"keras": keras.__version__, backend: module.__version__}


def fit_cases(args: argparse.Namespace) -> tuple[dict[str, Timing], int]:
    """Runs ``args.worker``'s fit case for every model; this process's Timings and its rank."""
    import keras

    set_threads(args.threads)
    timings = {}
    if args.worker == "fit-unison":
        from mpi4py import MPI

        import unison.keras as uk

        dp = uk.DataParallel()
        if uk.size() != NP:
            raise RuntimeError(f"unison.keras has {uk.size()} ranks; this case needs {NP} "
                               f"(start it with -np {NP})")
        for name in args.models:
            b = batch_of(args, name)
            timings[name] = time_fit(name, b, NP * b, args, dp.scope(), MPI.COMM_WORLD.Barrier)
        return timings, uk.rank()
    if args.worker == "fit-keras-dp":
        devices = keras.distribution.list_devices()
        if len(devices) != NP:
            raise RuntimeError(f"keras.distribution sees devices {devices}; this case needs {NP} "
                               f"(XLA_FLAGS=--xla_force_host_platform_device_count={NP})")
        keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    n = NP if args.worker == "fit-keras-dp" else 1
    for name in args.models:
        b = batch_of(args, name)
        timings[name] = time_fit(name, b, n * b, args, contextlib.nullcontext(), lambda: None)
    return timings, int(os.environ.get("BENCH_INDEX", "0"))


def time_ddp(name: str, rank: int, args: argparse.Namespace) -> Timing:
    """DDP over gloo around the Keras model ``name``, on this rank's rows of each global batch."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    b = batch_of(args, name)
    x, y = training_data(name, NP * b, 1)
    x, y = torch.from_numpy(x[rank * b:(rank + 1) * b]), torch.from_numpy(y[rank * b:(rank + 1) * b]).long()
    model = build_model(name)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(args.warmup):
        step()
    elapsed = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        float(loss)
        elapsed.append(time.perf_counter() - t0)
    dist.barrier()
    return Timing(elapsed, b, checksums(model))


def ddp_cases(args: argparse.Namespace) -> tuple[dict[str, Timing], int]:
    """The torch peer on every model; rank and rendezvous come from the environment the driver set."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=NP)
    return {name: time_ddp(name, rank, args) for name in args.models}, rank


def worker(args: argparse.Namespace) -> int:
    """Child-process entry (``--worker``): runs one case for every model, writes ``OUT.RANK.json``."""
    watchdog = threading.Timer(args.timeout, os._exit, (124,))  # never outlive the driver's launch
    watchdog.daemon = True
    watchdog.start()
    try:
        if args.worker != "fit-unison" and args.allocator == "unison":
            from unison.common import runtime

            runtime.keep_freed_memory()  # what unison.init() gives the unison ranks
        run = ddp_cases if args.worker == "ddp" else fit_cases
        timings, rank = run(args)
        import keras

        result = {"timings": {k: t.__dict__ for k, t in timings.items()}, "versions": versions(),
                  "params": {m: build_model(m).count_params() for m in args.models},
                  "backend": keras.backend.backend()}
        path = Path(f"{args.out}.{rank}.json")
        atomic_write(path, lambda f: json.dump(result, f), "w")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a rank that raised must not wait in a collective or a barrier
    sys.stdout.flush()
    return 0


# === driver side: launches, merges, reports ====================================================


def batch_of(args: argparse.Namespace, name: str) -> int:
    return args.batch or DEFAULT_BATCH[name]


def child_env(backend: str, args: argparse.Namespace, **extra: str) -> dict[str, str]:
    """The environment of every worker: the backend, ``--threads`` everywhere, no inherited MPI job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV_PREFIXES)}
    threads = str(args.threads)
    # XLA has no thread-count flag of its own; one thread is eigen off (the recipe JAX users share)
    xla = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" if args.threads == 1 else ""
    env.update(KERAS_BACKEND=backend, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               TF_NUM_INTRAOP_THREADS=threads, TF_NUM_INTEROP_THREADS="2", TF_CPP_MIN_LOG_LEVEL="3",
               PYTHONUNBUFFERED="1", XLA_FLAGS=xla,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def worker_args(mode: str, out: Path, args: argparse.Namespace) -> list[str]:
    cmd = [str(Path(__file__).resolve()), "--worker", mode, "--out", str(out),
           "--models", ",".join(args.models), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--repeats", str(args.repeats), "--threads", str(args.threads), "--timeout", str(args.timeout),
           "--allocator", args.allocator]
    return cmd + (["--batch", str(args.batch)] if args.batch else [])


def run_group(cmds: Sequence[Launch], timeout: float) -> tuple[int, str]:
    """Starts every ``(command, env)`` at once, each in its own session; ``(worst status, output tail)``.

    All of them are killed (their whole process groups) when the first fails or at ``timeout``,
    so a hung peer never blocks the run; the status is then 124 for a timeout.
    """
    procs = [subprocess.Popen(c, env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for c, e in cmds]
    outputs = [""] * len(procs)
    readers = [threading.Thread(target=lambda i=i: outputs.__setitem__(i, procs[i].stdout.read()), daemon=True)
               for i in range(len(procs))]
    for r in readers:
        r.start()
    deadline, status = time.monotonic() + timeout, 0
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    if any(p.poll() is None for p in procs):
        status = 124 if time.monotonic() >= deadline else 0
        for p in procs:
            kill_group(p)
    for r in readers:
        r.join(timeout=10)
    status = status or max((abs(p.returncode or 0) for p in procs), default=0)
    tail = "\n".join("\n".join(o.splitlines()[-25:]) for o in outputs if o.strip())
    return status, tail


def launches(backend: str, impl: str, tmp: Path, args: argparse.Namespace) -> list[Launch]:
    """The processes of one case: ``(command, env)`` each; each writes ``tmp/case.RANK.json``."""
    out, py = tmp / "case", sys.executable
    if impl == "one-process":
        return [([py, *worker_args("fit-one", out, args)], child_env(backend, args))]
    if impl == "independent":  # NP one-process fits at once: what the cores give NP processes
        return [([py, *worker_args("fit-one", out, args)], child_env(backend, args, BENCH_INDEX=str(r)))
                for r in range(NP)]
    if impl == "unison":
        run = [py, "-m", "unison.run", "-np", str(NP), "--oversubscribe", py]
        return [(run + worker_args("fit-unison", out, args), child_env(backend, args))]
    if backend == "jax":
        # one process drives both devices: XLA's own threading, not --threads ([Note: keras-dp threads])
        env = child_env(backend, args, XLA_FLAGS=f"--xla_force_host_platform_device_count={NP}")
        return [([py, *worker_args("fit-keras-dp", out, args)], env)]
    ports = free_ports(NP)
    if backend == "torch":
        return [([py, *worker_args("ddp", out, args)],
                 child_env(backend, args, RANK=str(r), WORLD_SIZE=str(NP), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(ports[0]))) for r in range(NP)]
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    cmd = [py, str(HERE / "keras_training.py"), "--models", ",".join(args.models), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--mwms-timeout", str(args.timeout),
           "--intra-op-threads", str(args.threads), "--inter-op-threads", "2",
           "--mwms-allocator", args.allocator]
    cmd += ["--batch", str(args.batch)] if args.batch else []
    return [([*cmd, "--mwms-worker", f"{out}.{r}.json"],
             child_env(backend, args, TF_CONFIG=json.dumps({"cluster": cluster,
                                                            "task": {"type": "worker", "index": r}})))
            for r in range(NP)]


def measure(backend: str, impl: str, args: argparse.Namespace) -> Outcome:
    """Runs one case's processes and reads their results; an Outcome with ``error`` on failure."""
    with tempfile.TemporaryDirectory(prefix="keras_backends.", dir=args.tmp_dir) as tmp:
        cmds = launches(backend, impl, Path(tmp), args)
        t0 = time.monotonic()
        status, tail = run_group(cmds, args.timeout)
        load = os.getloadavg()[0]
        logger.info("%s %s: exit status %d after %.0f s, host load %.2f", backend, impl, status,
                    time.monotonic() - t0, load)
        files = sorted(Path(tmp).glob("case.*.json"))
        expected = 1 if impl == "one-process" or (impl == "peer" and backend == "jax") else NP
        if status != 0 or len(files) != expected:
            why = f"timed out after --timeout {args.timeout:g} s" if status == 124 else f"exit status {status}"
            return Outcome(error=f"{backend} {impl} failed ({why}, {len(files)} of {expected} result "
                                 f"files); its output ends:\n{tail or '(no output)'}")
        results = [json.loads(f.read_text()) for f in files]
    outcome = Outcome(host_load=load)
    for res in results:
        per_model = res.get("timings", res)  # keras_training's MWMS workers write {model: timing}
        for name, t in per_model.items():
            outcome.timings.setdefault(name, []).append(Timing(**t))
        if "timings" in res:
            outcome.info.update({k: v for k, v in res.items() if k != "timings"})
    return outcome


def merge(backend: str, model: str, impl: str, outcome: Outcome, args: argparse.Namespace) -> Record:
    """The best run's slowest process gives the Record; checks batches and weights across processes.

    Raises:
        RuntimeError: a process trained on a batch other than the per-rank batch, or the processes'
            weights differ after training.
    """
    import numpy as np

    name = PEERS[backend][0] if impl == "peer" else impl
    timings = outcome.timings.get(model, [])
    batch = batch_of(args, model)
    procs = NP if impl in ("unison", "independent") or (impl == "peer" and backend != "jax") else 1
    devices = NP if impl != "one-process" else 1
    if any(t.local_batch != batch for t in timings):
        raise RuntimeError(f"{backend} {model} {name}: processes trained on batches "
                           f"{[t.local_batch for t in timings]}; each should get {batch}")
    if len(timings) != procs:
        raise RuntimeError(f"{backend} {model} {name}: {len(timings)} result(s), expected {procs}")
    first = np.array(timings[0].checksums)
    worst = max(float(np.max(np.abs(np.array(t.checksums) - first) / (np.abs(first) + 1e-12)))
                for t in timings)
    if worst > SYNC_RTOL:
        raise RuntimeError(f"{backend} {model} {name}: weights differ across processes after training "
                           f"(largest relative checksum difference {worst:.3g}, tolerance {SYNC_RTOL})")
    elapsed = min(max(run) for run in zip(*(t.elapsed for t in timings), strict=True))
    return Record(backend, model, name, devices, batch, devices * batch, devices * batch * args.steps / elapsed,
                  outcome.host_load)


def find(records: Sequence[Record], backend: str, model: str, impl: str) -> float | None:
    for r in records:
        if (r.backend, r.model, r.impl) == (backend, model, impl):
            return r.samples_per_s
    return None


def efficiency(records: Sequence[Record], rec: Record) -> float | None:
    """[Note: scaling efficiency is weak scaling]: samples/s / (np x one process at the per-rank batch)."""
    one = find(records, rec.backend, rec.model, "one-process")
    return None if one is None or rec.impl == "one-process" else rec.samples_per_s / (rec.np * one)


def ordered(records: Sequence[Record]) -> list[Record]:
    """Backend, then model, then one-process, peer, unison."""
    def key(r: Record) -> tuple[int, int, int]:
        impl = IMPLS.index(r.impl) if r.impl in IMPLS else IMPLS.index("peer")
        return BACKENDS.index(r.backend), MODELS.index(r.model), impl
    return sorted(records, key=key)


def print_table(records: Sequence[Record]) -> None:
    print(f"{'backend':<11}{'model':<6}{'impl':<13}{'np':>3}{'batch':>7}{'global':>8}{'samples/s':>11}"
          f"{'efficiency':>12}{'load':>7}")
    for rec in ordered(records):
        eff = efficiency(records, rec)
        print(f"{rec.backend:<11}{rec.model:<6}{rec.impl:<13}{rec.np:>3}{rec.batch:>7}{rec.global_batch:>8}"
              f"{rec.samples_per_s:>11.1f}{'-' if eff is None else f'{eff:.2f}':>12}{rec.host_load:>7.2f}")
    print("np = processes (devices for keras-dp), batch = rows per rank, global = rows per step; "
          "efficiency = samples/s / (np x one-process), weak scaling; load = host 1-min load average "
          f"after the case, its own threads included (well above {NP}: other work shared the CPUs)")


def print_targets(records: Sequence[Record], args: argparse.Namespace) -> None:
    print(f"\ntargets (np={NP}): unison >= {TARGET_RATIO}x the backend's peer")
    for backend in args.backends:
        peer, title = PEERS[backend]
        for model in args.models:
            mine, theirs = find(records, backend, model, "unison"), find(records, backend, model, peer)
            print(ratio_target(f"np {NP} {backend} {model} unison / {title}", mine, theirs, TARGET_RATIO))
    print(f"\nbound (no target): {NP} independent one-process fits at once, no communication: what the "
          f"cores give {NP} processes, the most any {NP}-process data parallelism could reach here")
    for backend in args.backends:
        peer, title = PEERS[backend]
        for model in args.models:
            bound = find(records, backend, model, "independent")
            for impl, what in (("unison", "unison"), (peer, title)):
                mine = find(records, backend, model, impl)
                shown = "n/a  (not measured)" if mine is None or bound is None else f"{mine / bound:.2f}"
                print(f"  np {NP} {backend} {model} {what} / {NP} independent processes = {shown}")
    print("\nscaling efficiency (np=2 samples/s / (2 x one process at the per-rank batch); no target):")
    for backend in args.backends:
        for model in args.models:
            for impl in ("unison", PEERS[backend][0]):
                rec = next((r for r in records if (r.backend, r.model, r.impl) == (backend, model, impl)), None)
                eff = None if rec is None else efficiency(records, rec)
                shown = "n/a   not measured" if eff is None else f"{eff:.2f}  (no target)"
                print(f"  np {NP} {backend} {model} {impl} scaling efficiency = {shown}")


def plot(records: Sequence[Record], path: Path) -> None:
    """Grouped bars: samples/s of one-process, peer and unison per (backend, model)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = [b for b in BACKENDS if any(r.backend == b for r in records)]
    models = [m for m in MODELS if any(r.model == m for r in records)]
    fig, axes = plt.subplots(len(models), len(backends), figsize=(3 * len(backends) + 0.5, 3 * len(models) + 0.8),
                             squeeze=False)
    colors = {"one-process": "#999999", "peer": "#4c72b0", "unison": "#dd8452"}
    for (row, model), (col, backend) in itertools.product(enumerate(models), enumerate(backends)):
        ax = axes[row][col]
        names = ["one-process", PEERS[backend][0], "unison"]
        values = [find(records, backend, model, n) for n in names]
        bars = ax.bar(range(3), [v or 0.0 for v in values],
                      color=[colors["one-process"], colors["peer"], colors["unison"]])
        ax.bar_label(bars, labels=["not run" if v is None else f"{v:.0f}" for v in values], fontsize=7)
        ax.set_xticks(range(3), names, rotation=30, fontsize=8)
        ax.set_title(f"{backend} {model}", fontsize=9)
    for row in axes:
        row[0].set_ylabel("samples/s (global)")
    fig.suptitle(f"Keras model.fit at np={NP}: unison.keras against each backend's peer\n"
                 "(one-process: one rank's batch; samples/s of the whole job)", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def report(records: Sequence[Record], failures: Sequence[str], info: dict[str, Any],
           args: argparse.Namespace, load_start: float) -> None:
    ver = ", ".join(f"{k} {v}" for k, v in sorted(info.get("versions", {}).items())) or "versions n/a"
    print(f"np={NP}, {ver}; {args.threads} intra-op thread(s) per process; best of {args.repeats} runs of "
          f"{args.steps} steps after {args.warmup} warm-up, in the best of {args.passes} pass(es) over all cases")
    for name in args.models:
        params = info.get("params", {}).get(name)
        print(f"{name}: {'?' if params is None else f'{params:,}'} parameters, batch {batch_of(args, name)} "
              f"per rank, global batch {NP * batch_of(args, name)}")
    print_table(records)
    print_targets(records, args)
    for f in failures:
        print(f"FAILED: {f}")
    print(f"\nhost load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end, on "
          f"{os.cpu_count()} CPUs running {NP} processes at a time; more than that means other work "
          "shared the CPUs")
    if args.json is not None:
        write_json(args.json, records)
        print(f"wrote {args.json}")
    if args.png is not None and records:
        plot(records, args.png)
        print(f"wrote {args.png}")


def best_of_passes(passes: Sequence[Sequence[Record]]) -> list[Record]:
    """Per (backend, model, impl), the record of the pass that measured the most samples/s."""
    best: dict[tuple[str, str, str], Record] = {}
    for records in passes:
        for r in records:
            key = (r.backend, r.model, r.impl)
            if key not in best or r.samples_per_s > best[key].samples_per_s:
                best[key] = r
    return list(best.values())


def driver(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[keras_backends] %(message)s")
    load_start = os.getloadavg()[0]
    passes: list[list[Record]] = []
    failures: list[str] = []
    info: dict[str, Any] = {"versions": {}, "params": {}}
    for k in range(args.passes):
        logger.info("pass %d of %d", k + 1, args.passes)
        records: list[Record] = []
        for backend in args.backends:
            for impl in args.impls:
                outcome = measure(backend, impl, args)
                if outcome.error:
                    failures.append(f"pass {k + 1}: {outcome.error}" if args.passes > 1 else outcome.error)
                    continue
                info["versions"].update(outcome.info.get("versions", {}))
                info["params"].update(outcome.info.get("params", {}))
                for model in args.models:
                    try:
                        records.append(merge(backend, model, impl, outcome, args))
                    except (RuntimeError, ValueError) as exc:
                        failures.append(str(exc))
        passes.append(records)
    report(best_of_passes(passes), failures, info, args, load_start)
    return 1 if failures else 0


# === command line ==============================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=f"Time Keras model.fit at np={NP} under unison.keras.DataParallel on the tensorflow, "
                    "jax and torch backends, beside one process and each backend's best peer "
                    "(MultiWorkerMirroredStrategy, keras.distribution.DataParallel, torch DDP over gloo). "
                    "Run as a plain program: it launches every case itself (see the module docstring).",
        epilog="Lists take commas or spaces, e.g. --backends jax,torch --impls peer,unison.")
    p.add_argument("--backends", type=list_choices(BACKENDS), nargs="+", default=[list(BACKENDS)],
                   help=f"Keras backends to run (default: all of {', '.join(BACKENDS)})")
    p.add_argument("--models", type=list_choices(MODELS), nargs="+", default=[list(MODELS)],
                   help=f"models to run (default: all of {', '.join(MODELS)})")
    p.add_argument("--impls", type=list_choices(IMPLS), nargs="+", default=[list(IMPLS)],
                   help=f"cases to run per backend (default: all of {', '.join(IMPLS)})")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per case; the fastest counts (default 3)")
    p.add_argument("--passes", type=int, default=2,
                   help="times the whole list of cases runs, one pass after the other; each case's "
                        "fastest pass counts, so a slow spell of the machine must hit a case in every "
                        "pass to lower it (default 2)")
    p.add_argument("--warmup", type=int, default=10,
                   help="untimed steps before timing, at least 1: the first traces/compiles (default 10)")
    p.add_argument("--batch", type=int, default=None,
                   help=f"rows per rank for every model; the global batch is {NP} times it (default: "
                        + ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items()) + ")")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (default 1)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds each case's launch may take before it is killed (default 300)")
    p.add_argument("--allocator", choices=("unison", "default"), default="unison",
                   help="glibc malloc settings of the cases other than unison: 'unison' (default) gives them "
                        "what unison.init() gives the unison ranks (runtime.keep_freed_memory), so only the "
                        "distribution differs; 'default' leaves glibc's, as a plain job runs")
    p.add_argument("--tmp-dir", type=Path, default=None,
                   help="where the cases' result files go (default: $TMPDIR)")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--png", type=Path, default=None, help="draw a bar chart to this PNG file")
    p.add_argument("--worker", choices=WORKER_MODES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.backends = selected(args.backends, BACKENDS)
    args.models = selected(args.models, MODELS)
    args.impls = selected(args.impls, IMPLS)
    if min(args.steps, args.repeats, args.warmup, args.batch or 1, args.threads, args.passes) < 1:
        p.error(f"--steps, --repeats, --warmup, --batch, --threads and --passes must be at least 1 (got "
                f"--steps {args.steps}, --repeats {args.repeats}, --warmup {args.warmup}, --batch "
                f"{args.batch}, --threads {args.threads}, --passes {args.passes})")
    if args.timeout <= 0:
        p.error(f"--timeout must be positive seconds (got {args.timeout:g})")
    if (args.worker is None) != (args.out is None):
        p.error("--worker and --out are internal and go together")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker is not None else driver(args)


if __name__ == "__main__":
    sys.exit(main())
