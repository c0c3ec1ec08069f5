"""Sparse embedding training: unison.ps tables (BSP, SSP) against dense all-reduce and torch's sparse path.

Run it as a plain Python program (not under mpirun); it starts one MPI job per ``--np`` itself::

    python benchmarks/embeddings.py --json out/embeddings.json            # 1M x 64, np 2 and 4
    python benchmarks/embeddings.py --rows 10000000 --np 2 --steps 20     # a bigger table

Why it exists: the issue that introduced ``unison.ps`` (sharded embedding tables) promised that a
table trained by push/pull moves only the rows a batch touches, so it beats both ways a data-parallel
user would otherwise train an embedding: reducing the whole table's dense gradient, or all-gathering
torch's sparse gradients. Its targets, printed as lines ending PASS or MISS, per np:

* ``unison-bsp`` steps/s >= 5x ``dense-allreduce`` steps/s with batches touching 1% of the rows;
* bytes moved per step by ``unison-bsp`` and ``unison-ssp2`` within 1.2x of the bytes of the remote
  rows actually touched (pulled plus pushed), at every touched fraction;
* ``unison-ssp2`` steps/s >= 1.2x ``unison-bsp`` when the last rank is slowed by 20% (it sleeps an
  extra 20% of the compute time every step), at every touched fraction.

What is measured (every case in the same MPI job, one after another, on every rank):

* The table is ``--rows`` x ``--dim`` float32, trained with plain SGD. Each rank draws its own
  batches (seed + rank) of Zipf-distributed keys (bounded Zipf with exponent ``--zipf`` over the
  rows, scattered over the key space by a fixed bijection), drawing until a batch holds exactly
  ``touched x rows`` distinct keys; duplicates stay in the batch (a hot key looked up several
  times). ``--batches`` such batches are drawn once and cycled, so key generation is not timed.
* A step is: fetch the rows of the batch's keys, the model, write back the gradients. The
  "model" is the same for every impl: ``loss = sum(tanh(e) * w)`` over the looked-up rows ``e``
  (a fixed ``w`` of ``dim`` weights), its gradient by torch autograd, then a sleep of
  ``--compute-ms`` standing in for the rest of the network on an accelerator (a sleep leaves the
  CPU to the communication, as a GPU would; ``--compute spin`` burns the CPU instead, which on a
  host with fewer cores than ranks also slows the communication). The slowed rank (the last)
  sleeps an extra ``--slow`` x compute time.
* Both unison cases look rows up as ``unison.torch_backend.ShardedEmbedding`` does: the batch's
  unique keys are pulled, gathered into the lookups in torch, and autograd's gather backward sums
  repeated keys' gradients into the unique rows, which are pushed.
* ``unison-bsp``: ``ShardedTable(consistency="bsp")``; ``rows = pull(keys)``, model,
  ``push(keys, grads)``, all synchronous (BSP allows nothing else: the next pull must see this
  push).
* ``unison-ssp2``: ``ShardedTable(consistency=SSP(2))`` used as SSP allows: the next batch's pull
  is issued (``pull_async``) before this step's model runs, and the push is asynchronous
  (``push_async``, waited one step later), so communication overlaps compute; the rows read are
  at most one step stale, within the bound. The timed run ends with ``table.barrier()`` (every push
  applied).
* ``dense-allreduce``: ``nn.Embedding(rows, dim)`` (dense gradient) + ``unison.torch_backend.
  DistributedOptimizer(SGD)``: the whole ``rows x dim`` gradient is all-reduced through the engine
  every step. Its bytes are the ring all-reduce estimate ``2 (n-1)/n x table bytes`` per rank.
  It is slow, so it runs ``--dense-steps`` steps (default 8: its step time varies by a third between runs).
* ``torch-sparse``: ``nn.Embedding(rows, dim, sparse=True)`` + ``DistributedOptimizer(SGD)``, which
  all-gathers each rank's coalesced sparse gradient (indices int64 + values); bytes per rank =
  ``(n-1)/n x`` the sum over ranks of ``nnz x (8 + 4 dim)`` (each rank's part reaches n-1 others).
* ``model-only`` (not a peer; measured when dense-allreduce is): the same loop with no table at all
  (lookups deduplicated, the model, the delay; the rows come free). dense-allreduce's step holds
  the same model, so ``model-only / dense-allreduce`` is the most any table can reach against it;
  it is printed under the first target line with the share of it that unison-bsp reaches.
  ``model-only+slow`` (measured when unison-ssp2 is) runs it with the last rank slowed: as SSP
  lets no worker run more than ``s`` steps ahead of the slowest, ``unison-bsp+slow`` ms/step over
  its ms/step is the most SSP can gain, printed under each SSP line.
* For unison the bytes come from ``table.stats()``: BSP rounds count every byte a rank sends as
  worker or shard (so the sum over ranks of ``bytes_sent`` is every byte moved once); under SSP a
  rank counts its requests as ``bytes_sent`` and the replies it gets as ``bytes_received`` (its
  server thread's replies are counted by the receiver), so moved = sum of both. "Touched" bytes =
  ``(remote_rows_pulled + remote_rows_pushed) x dim x 4``. Both are per rank per step (sum over
  ranks / np / steps).
* Each case runs ``--warmup`` untimed steps, a barrier, then ``--steps`` timed steps; the time is
  the maximum over ranks; steps/s = steps / time.

Outputs: a table and the target lines on stdout; ``--json`` writes a list of records
``{np, touched, impl, steps_per_s, ms_per_step, bytes_per_step, touched_bytes_per_step, ...}``;
``--png`` a bar chart of steps/s.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchutil import atomic_write, kill_group, list_choices, ratio_target, selected, shown, write_json

logger = logging.getLogger("benchmarks.embeddings")

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
NPS = ("2", "4")
IMPLS = ("unison-bsp", "unison-ssp2", "dense-allreduce", "torch-sparse")
SLOWED = ("unison-bsp", "unison-ssp2")  # the impls also run with the last rank slowed
MODEL_ONLY = "model-only"  # not a peer: the step with a table that costs nothing (the ceiling vs dense)
SPEEDUP_VS_DENSE, BYTES_SLACK, SSP_OVER_BSP = 5.0, 1.2, 1.2
TARGET_TOUCHED = 0.01
LR, SEED = 0.05, 1234
KEY_MULTIPLIER = 2654435761  # scatters Zipf ranks over the key space (coprime with the row count)


@dataclass
class Record:
    """One measured case, as written to the JSON file."""

    np: int
    touched: float
    impl: str
    slowed: bool
    rows: int
    dim: int
    steps: int
    steps_per_s: float = 0.0
    ms_per_step: float = 0.0
    bytes_per_step: float = 0.0          # per rank, every byte counted once
    touched_bytes_per_step: float = 0.0  # per rank: remote rows pulled + pushed, x dim x 4
    bytes_estimated: bool = False
    unique_keys: int = 0                 # distinct keys per batch per rank
    lookups: int = 0                     # keys per batch per rank, duplicates included
    max_staleness: int = 0
    wait_s_per_step: float = 0.0         # SSP: time a rank spent waiting for pulls, per step
    error: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.impl + ("+slow" if self.slowed else "")


# === worker: runs on every rank under mpirun ====================================================


def make_batches(rows: int, unique: int, count: int, zipf: float, seed: int) -> list[Any]:
    """``count`` int64 key arrays, each with exactly ``unique`` distinct Zipf-distributed keys."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, rows + 1, dtype=np.float64)
    cdf = np.cumsum(ranks ** -zipf)
    cdf /= cdf[-1]
    del ranks
    mult = KEY_MULTIPLIER
    while math.gcd(mult, rows) != 1:
        mult += 2
    out = []
    for _ in range(count):
        draws = np.zeros(0, np.int64)
        while True:
            more = np.searchsorted(cdf, rng.random(max(4 * unique, 1024)), side="right").astype(np.int64)
            draws = np.concatenate([draws, np.minimum(more, rows - 1)])
            _, first = np.unique(draws, return_index=True)
            if len(first) >= unique:
                cut = int(np.sort(first)[unique - 1]) + 1
                break
        out.append((draws[:cut] * mult) % rows)
    return out


class Model:
    """The stand-in model: ``loss = sum(tanh(e) * w)``, its gradient by autograd, then the compute delay."""

    def __init__(self, dim: int, compute_s: float, spin: bool) -> None:
        import torch

        self.w = torch.linspace(-1.0, 1.0, dim)
        self.compute_s, self.spin = compute_s, spin

    def loss(self, e: Any) -> Any:
        import torch

        return (torch.tanh(e) * self.w).sum()

    def delay(self, slow: float) -> None:
        seconds = self.compute_s * (1.0 + slow)
        if not self.spin:
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def grads(self, rows: Any, inverse: Any, slow: float) -> Any:
        """d loss / d rows (numpy) of the unique rows ``rows`` looked up as ``rows[inverse]``, after the delay.

        As ``unison.torch_backend.ShardedEmbedding`` does: autograd's gather backward sums the
        gradient of repeated keys into their unique row (in C++), so the push carries unique keys.
        """
        import torch

        e = torch.from_numpy(rows).requires_grad_()
        self.loss(e[inverse]).backward()
        self.delay(slow)
        assert e.grad is not None
        return e.grad.numpy()


def unique_lookup(keys: Any) -> tuple[Any, Any]:
    """The batch's unique keys (numpy) and each lookup's place among them (a torch index), as
    ``ShardedEmbedding.forward`` computes them (``np.unique``: 0.3 ms on 20k keys, torch.unique 0.9)."""
    import numpy as np
    import torch

    unique, inverse = np.unique(keys, return_inverse=True)
    return unique, torch.from_numpy(inverse.reshape(-1))


def timed(world: Any, run: Callable[[int], None], warmup: int, steps: int,
          between: Callable[[], None] = lambda: None) -> float:
    """Seconds for ``run(steps)`` after ``run(warmup)``, the maximum over ranks."""
    from mpi4py import MPI

    if warmup:
        run(warmup)
    between()
    world.Barrier()
    t0 = time.perf_counter()
    run(steps)
    elapsed = time.perf_counter() - t0
    return float(world.allreduce(elapsed, op=MPI.MAX))


def unison_case(world: Any, impl: str, batches: list[Any], model: Model, slow: float,
                args: argparse.Namespace, tag: str) -> dict[str, Any]:
    import unison.ps as ps

    consistency = "bsp" if impl == "unison-bsp" else ps.SSP(2)
    table = ps.ShardedTable(args.rows, args.dim, optimizer=ps.SGD(LR), consistency=consistency,
                            name=f"bench-{tag}", seed=0)
    cursor = [0]

    def next_batch() -> Any:
        keys = batches[cursor[0] % len(batches)]
        cursor[0] += 1
        return keys

    def run_bsp(steps: int) -> None:
        for _ in range(steps):
            keys, inverse = unique_lookup(next_batch())
            rows = table.pull(keys)
            table.push(keys, model.grads(rows, inverse, slow))

    def run_ssp(steps: int) -> None:
        keys, inverse = unique_lookup(next_batch())
        pending = table.pull_async(keys)
        pushed = None
        for t in range(steps):
            rows = pending.wait()
            if t + 1 < steps:  # prefetch the next batch's rows while this one computes
                upcoming, upcoming_inverse = unique_lookup(next_batch())
                pending = table.pull_async(upcoming)
            grads = model.grads(rows, inverse, slow)
            if pushed is not None:
                pushed.wait()  # long done: surfaces any error of the previous push
            pushed = table.push_async(keys, grads)
            if t + 1 < steps:
                keys, inverse = upcoming, upcoming_inverse
        if pushed is not None:
            pushed.wait()
        table.barrier()

    run = run_bsp if impl == "unison-bsp" else run_ssp
    try:
        seconds = timed(world, run, args.warmup, args.steps, between=table.reset_stats)
        stats = world.gather(table.stats(), root=0)
    finally:
        table.close()
    if world.Get_rank() != 0:
        return {}
    n = world.Get_size()
    sent = sum(s["bytes_sent"] for s in stats)
    received = sum(s["bytes_received"] for s in stats)
    moved = sent if impl == "unison-bsp" else sent + received
    touched_rows = sum(s["remote_rows_pulled"] + s["remote_rows_pushed"] for s in stats)
    return {"seconds": seconds, "bytes_per_step": moved / n / args.steps,
            "touched_bytes_per_step": touched_rows * args.dim * 4 / n / args.steps,
            "max_staleness": max(int(s["max_staleness"]) for s in stats),
            "wait_s_per_step": max(float(s["wait_seconds"]) for s in stats) / args.steps,
            "extra": {"bytes_sent": sent, "bytes_received": received, "touched_rows": touched_rows}}


def model_only_case(world: Any, batches: list[Any], model: Model, slow: float,
                    args: argparse.Namespace) -> dict[str, Any]:
    """The step without a table: lookups deduplicated, the model, the delay; rows come free (no gather).

    Not a peer: the fastest any table could make this loop, so the ceiling of the speed-up over
    dense-allreduce (whose step holds the same model); with the last rank slowed, that rank's pace
    is the most SSP can reach (a worker runs at most ``s`` steps ahead of the slowest).
    """
    import numpy as np

    rng = np.random.default_rng(SEED)
    rows = rng.uniform(-0.1, 0.1, (max(int(np.unique(k).size) for k in batches), args.dim)).astype(np.float32)
    cursor = [0]

    def run(steps: int) -> None:
        for _ in range(steps):
            keys, inverse = unique_lookup(batches[cursor[0] % len(batches)])
            cursor[0] += 1
            model.grads(rows[: len(keys)], inverse, slow)

    seconds = timed(world, run, args.warmup, args.steps)
    return {"seconds": seconds, "bytes_per_step": 0.0} if world.Get_rank() == 0 else {}


def torch_case(world: Any, impl: str, batches: list[Any], model: Model, args: argparse.Namespace,
               steps: int, warmup: int) -> dict[str, Any]:
    import numpy as np
    import torch
    from torch import nn

    import unison.torch_backend as hvd

    n = world.Get_size()
    torch.manual_seed(SEED)
    emb = nn.Embedding(args.rows, args.dim, sparse=impl == "torch-sparse")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=LR),
                                   named_parameters=[(f"emb-{impl}", emb.weight)])
    keys_t = [torch.from_numpy(k) for k in batches]
    nnz = [int(np.unique(k).size) for k in batches]
    cursor = [0]
    used: list[int] = []

    def run(count: int) -> None:
        for _ in range(count):
            i = cursor[0] % len(keys_t)
            cursor[0] += 1
            used.append(nnz[i])
            model.loss(emb(keys_t[i])).backward()
            model.delay(0.0)
            opt.step()
            opt.zero_grad()

    seconds = timed(world, run, warmup, steps, between=used.clear)
    counted = world.gather(sum(used), root=0)
    if world.Get_rank() != 0:
        return {}
    table_bytes = args.rows * args.dim * 4
    if impl == "dense-allreduce":
        per_rank = 2 * (n - 1) / n * table_bytes
    else:  # every rank's nnz rows (+ int64 index) reach the n - 1 others
        per_rank = (n - 1) / n * sum(counted) * (8 + 4 * args.dim) / steps
    return {"seconds": seconds, "bytes_per_step": per_rank, "bytes_estimated": True,
            "extra": {"nnz_total": int(sum(counted))}}


def worker(args: argparse.Namespace) -> int:
    import numpy as np
    import torch
    from mpi4py import MPI

    import unison.torch_backend as hvd

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch, on every sparse step
    faulthandler.dump_traceback_later(max(10, args.timeout_s - 15), exit=True)  # a hang shows its stacks
    hvd.init()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    model = Model(args.dim, args.compute_ms / 1e3, args.compute == "spin")
    slowed_by = args.slow if rank == n - 1 else 0.0  # the last rank is the slowed one
    out: list[dict[str, Any]] = []

    def record(touched: float, impl: str, slowed: bool, batches: list[Any], steps: int,
               case: Callable[..., dict[str, Any]], *case_args: Any) -> None:
        t0 = time.perf_counter()
        try:
            res = case(*case_args)
            err = ""
        except Exception as exc:  # noqa: BLE001 - reported in the table; the ranks fail alike or hang
            res, err = {}, f"{type(exc).__name__}: {exc}"
            logger.exception("case %s failed on rank %d", impl, rank)
        if rank != 0:
            return
        rec = Record(n, touched, impl, slowed, args.rows, args.dim, steps,
                     unique_keys=int(np.unique(batches[0]).size), lookups=int(batches[0].size), error=err)
        if res:
            rec.steps_per_s = steps / res["seconds"]
            rec.ms_per_step = res["seconds"] / steps * 1e3
            rec.bytes_per_step = res["bytes_per_step"]
            rec.touched_bytes_per_step = res.get("touched_bytes_per_step", 0.0)
            rec.bytes_estimated = res.get("bytes_estimated", False)
            rec.max_staleness = res.get("max_staleness", 0)
            rec.wait_s_per_step = res.get("wait_s_per_step", 0.0)
            rec.extra = res.get("extra", {})
        out.append(rec.__dict__.copy())
        print(f"[embeddings np={n}] {touched:g} {rec.name}: {rec.steps_per_s:.2f} steps/s "
              f"({time.perf_counter() - t0:.1f} s) {err}", file=sys.stderr, flush=True)

    dense_done = False
    for touched in args.touched:
        unique = max(1, int(round(touched * args.rows)))
        batches = make_batches(args.rows, unique, args.batches, args.zipf, SEED + 1 + rank)
        for impl in args.impls:
            if impl.startswith("unison"):
                record(touched, impl, False, batches, args.steps, unison_case,
                       world, impl, batches, model, 0.0, args, f"{impl}-{touched}")
            elif impl == "torch-sparse":
                record(touched, impl, False, batches, args.steps, torch_case,
                       world, impl, batches, model, args, args.steps, args.warmup)
            elif impl == "dense-allreduce" and not dense_done:  # the dense cost does not depend on the keys
                dense_done = True
                record(touched, impl, False, batches, args.dense_steps, torch_case,
                       world, impl, batches, model, args, args.dense_steps, 1)
        if "dense-allreduce" in args.impls:  # the ceiling of the speed-up over it
            record(touched, MODEL_ONLY, False, batches, args.steps, model_only_case,
                   world, batches, model, 0.0, args)
        for impl in SLOWED:
            if impl in args.impls and args.slow > 0:
                record(touched, impl, True, batches, args.steps, unison_case,
                       world, impl, batches, model, slowed_by, args, f"{impl}-{touched}-slow")
        if "unison-ssp2" in args.impls and args.slow > 0:  # the ceiling of SSP's gain
            record(touched, MODEL_ONLY, True, batches, args.steps, model_only_case,
                   world, batches, model, slowed_by, args)
    if rank == 0:
        atomic_write(args.out, lambda f: json.dump(out, f, indent=1), "w")
    world.Barrier()
    return 0


# === driver: plain python, launches one MPI job per np ==========================================


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               OMPI_MCA_mpi_yield_when_idle="1",
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def mpirun_cmd(np_: int) -> list[str]:
    mpirun = str(VENV_BIN / "mpirun") if (VENV_BIN / "mpirun").exists() else "mpirun"
    cmd = [mpirun, "-np", str(np_), "--bind-to", "none", "--oversubscribe"]
    return cmd + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def worker_args(args: argparse.Namespace, out: Path) -> list[str]:
    return ["--worker", "--out", str(out), "--rows", str(args.rows), "--dim", str(args.dim),
            "--steps", str(args.steps), "--dense-steps", str(args.dense_steps), "--warmup", str(args.warmup),
            "--batches", str(args.batches), "--zipf", str(args.zipf), "--compute-ms", str(args.compute_ms),
            "--compute", args.compute, "--slow", str(args.slow),
            "--touched", ",".join(f"{t:g}" for t in args.touched), "--impls", ",".join(args.impls),
            "--timeout-s", str(args.timeout_s)]


def launch(np_: int, args: argparse.Namespace, tmp: Path) -> tuple[list[Record], str]:
    """One MPI job at ``np_`` ranks; its records, or none and why."""
    out = tmp / f"np{np_}.json"
    cmd = mpirun_cmd(np_) + [sys.executable, str(Path(__file__).resolve()), *worker_args(args, out)]
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    tail: list[str] = []

    def pump() -> None:  # progress lines go to stderr as they come; the rest is kept for errors
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            del tail[:-40]
            if line.startswith("[embeddings"):
                print(line.rstrip(), file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        reader.join(5)
        return [], f"timed out after {args.timeout_s} s: " + " | ".join(tail[-3:])
    reader.join(10)
    if proc.returncode != 0 or not out.exists():
        return [], f"exit status {proc.returncode}: " + " | ".join(tail[-5:])
    recs = []
    for d in json.loads(out.read_text()):
        recs.append(Record(**d))
    return recs, ""


def find(records: Sequence[Record], np_: int, touched: float, impl: str, slowed: bool = False) -> Record | None:
    for r in records:
        if r.np == np_ and r.impl == impl and r.slowed == slowed and not r.error and r.steps_per_s > 0:
            if impl == "dense-allreduce" or math.isclose(r.touched, touched):
                return r
    return None


def mib(b: float) -> str:
    return f"{b / (1 << 20):.3f}" if b < (10 << 20) else f"{b / (1 << 20):.1f}"


def print_table(records: Sequence[Record]) -> None:
    head = (f"{'np':>3} {'touched':>8} {'impl':<22} {'steps/s':>9} {'ms/step':>9} {'MiB/step/rank':>14} "
            f"{'touched MiB':>12} {'bytes/touched':>13} {'vs dense':>9} {'uniq/lookups':>14} {'stale':>5}")
    print(head)
    print("-" * len(head))
    for r in records:
        if r.error:
            print(f"{r.np:>3} {r.touched:>8.2%} {r.name:<22} failed: {r.error[:90]}")
            continue
        dense = find(records, r.np, r.touched, "dense-allreduce")
        vs = f"{r.steps_per_s / dense.steps_per_s:.1f}x" if dense is not None else "n/a"
        touched = f"{mib(r.touched_bytes_per_step)}" if r.touched_bytes_per_step else "-"
        ratio = f"{r.bytes_per_step / r.touched_bytes_per_step:.3f}" if r.touched_bytes_per_step else "-"
        moved = mib(r.bytes_per_step) + ("*" if r.bytes_estimated else "")
        tch = "all" if r.impl == "dense-allreduce" else f"{r.touched:.2%}"
        stale = str(r.max_staleness) if r.impl == "unison-ssp2" else "-"
        print(f"{r.np:>3} {tch:>8} {r.name:<22} {r.steps_per_s:>9.2f} {r.ms_per_step:>9.1f} {moved:>14} "
              f"{touched:>12} {ratio:>13} {vs:>9} {f'{r.unique_keys}/{r.lookups}':>14} {stale:>5}")
    print("  * estimated from the algorithm (ring all-reduce; all-gather of nnz rows), not counted")


def print_targets(records: Sequence[Record], args: argparse.Namespace) -> None:
    print("targets:")
    for np_ in args.np:
        bsp = find(records, np_, TARGET_TOUCHED, "unison-bsp")
        dense = find(records, np_, TARGET_TOUCHED, "dense-allreduce")
        what = f"np={np_}: unison-bsp / dense-allreduce steps/s at {TARGET_TOUCHED:.0%} touched"
        if not any(math.isclose(t, TARGET_TOUCHED) for t in args.touched):
            bsp = None
        print(ratio_target(what, speed(bsp), speed(dense), SPEEDUP_VS_DENSE))
        free = find(records, np_, TARGET_TOUCHED, MODEL_ONLY)
        if bsp is not None and dense is not None and free is not None:
            share = bsp.steps_per_s / free.steps_per_s
            print(f"    (ceiling: {MODEL_ONLY} / dense-allreduce = {free.steps_per_s / dense.steps_per_s:.2f}, "
                  f"a table that costs nothing; unison-bsp reaches {share:.0%} of it)")
        for touched in args.touched:
            for impl in ("unison-bsp", "unison-ssp2"):
                r = find(records, np_, touched, impl)
                what = f"np={np_}: {impl} bytes/step / touched-row bytes at {touched:.2%} touched"
                if r is None or not r.touched_bytes_per_step:
                    print(f"  {what} = n/a   not measured")
                    continue
                ratio = r.bytes_per_step / r.touched_bytes_per_step
                text = shown(ratio, ratio <= BYTES_SLACK, BYTES_SLACK, False, 3)
                print(f"  {what} = {text}  (target <= {BYTES_SLACK:g})  "
                      f"{'PASS' if ratio <= BYTES_SLACK else 'MISS'}")
        for touched in args.touched:
            ssp = find(records, np_, touched, "unison-ssp2", slowed=True)
            bsp = find(records, np_, touched, "unison-bsp", slowed=True)
            what = (f"np={np_}: unison-ssp2 / unison-bsp steps/s, rank {np_ - 1} slowed {args.slow:.0%}, "
                    f"at {touched:.2%} touched")
            print(ratio_target(what, speed(ssp), speed(bsp), SSP_OVER_BSP))
            free = find(records, np_, touched, MODEL_ONLY, slowed=True)
            if ssp is not None and bsp is not None and free is not None:
                print(f"    (ceiling: unison-bsp+slow ms/step / {MODEL_ONLY}+slow ms/step = "
                      f"{bsp.ms_per_step / free.ms_per_step:.2f}: SSP cannot outrun its slowest worker, whose "
                      f"step without a table takes {free.ms_per_step:.1f} ms)")


def speed(record: Record | None) -> float | None:
    return None if record is None else record.steps_per_s


def write_png(path: Path, records: Sequence[Record]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if not r.error and r.steps_per_s > 0]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels = [f"np{r.np} {'all' if r.impl == 'dense-allreduce' else f'{r.touched:.1%}'}\n{r.name}" for r in ok]
    colors = {"unison-bsp": "tab:blue", "unison-ssp2": "tab:green", "dense-allreduce": "tab:red",
              "torch-sparse": "tab:orange", MODEL_ONLY: "lightgrey"}
    bars = ax.bar(range(len(ok)), [r.steps_per_s for r in ok], color=[colors[r.impl] for r in ok],
                  edgecolor="black", linewidth=0.3)
    for bar, r in zip(bars, ok, strict=True):
        if r.slowed:
            bar.set_hatch("//")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, [f"{k} (ceiling: no table)" if k == MODEL_ONLY else k for k in colors],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xticks(range(len(ok)), labels, rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("steps/s (log)")
    ax.set_title("Embedding training: unison.ps vs dense all-reduce vs torch sparse all-gather "
                 "(hatched: last rank slowed)", fontsize=9)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def driver(args: argparse.Namespace) -> int:
    start = time.monotonic()
    load = os.getloadavg()[0]
    print(f"table {args.rows:,} x {args.dim} float32 ({args.rows * args.dim * 4 / (1 << 20):.0f} MiB), SGD; "
          f"Zipf({args.zipf}) keys, {args.batches} batches per rank cycled; model compute {args.compute_ms:g} ms "
          f"({args.compute}); {args.warmup} warm-up + {args.steps} timed steps ({args.dense_steps} for dense); "
          f"slowed rank sleeps +{args.slow:.0%}; load average {load:.2f} on {os.cpu_count()} cores")
    records: list[Record] = []
    failures = []
    with tempfile.TemporaryDirectory(prefix="unison-embeddings-") as tmp:
        for np_ in args.np:
            recs, why = launch(np_, args, Path(tmp))
            if why:
                failures.append(f"np={np_}: {why}")
            records += recs
    print()
    print_table(records)
    for f in failures:
        print(f"  launch failed: {f}")
    print()
    print_targets(records, args)
    print(f"(wall time {time.monotonic() - start:.0f} s; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after)")
    if args.json is not None:
        write_json(args.json, records)
        print(f"wrote {args.json}")
    if args.png is not None and records:
        write_png(args.png, records)
        print(f"wrote {args.png}")
    return 1 if failures else 0


# === command line ===============================================================================


def touched_list(text: str) -> list[float]:
    try:
        vals = [float(s) for s in text.split(",") if s]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: give fractions like 0.001,0.01") from exc
    if not vals or any(not 0 < v <= 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: fractions must be in (0, 1]")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Steps/s and bytes moved per step when training a sparse embedding table: unison.ps "
                    "ShardedTable (BSP, and SSP(2) with prefetching), dense all-reduce of the whole table's "
                    "gradient, and torch's sparse gradients all-gathered by DistributedOptimizer. Launches "
                    "its own MPI job per --np.",
        epilog="Example: python benchmarks/embeddings.py --json out/embeddings.json --np 2,4")
    p.add_argument("--np", type=list_choices(NPS), nargs="+", default=[list(NPS)],
                   help="rank counts (default 2,4)")
    p.add_argument("--rows", type=int, default=1_000_000, help="table rows (default 1,000,000)")
    p.add_argument("--dim", type=int, default=64, help="row width (default 64)")
    p.add_argument("--touched", type=touched_list, default=[0.001, 0.01],
                   help="fractions of the rows one batch of one rank touches (default 0.001,0.01; the speed "
                        "target is read at 0.01)")
    p.add_argument("--impls", type=list_choices(IMPLS), nargs="+", default=[list(IMPLS)],
                   help=f"impls (default all: {','.join(IMPLS)})")
    p.add_argument("--steps", type=int, default=40, help="timed steps per case (default 40)")
    p.add_argument("--dense-steps", type=int, default=8, help="timed steps of dense-allreduce (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--batches", type=int, default=8, help="distinct batches per rank, cycled (default 8)")
    p.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of the keys (default 1.0)")
    p.add_argument("--compute-ms", type=float, default=30.0, help="model compute per step in ms (default 30)")
    p.add_argument("--compute", choices=("sleep", "spin"), default="sleep",
                   help="how the compute time passes: sleep (an accelerator; default) or spin (the CPU)")
    p.add_argument("--slow", type=float, default=0.2,
                   help="extra compute of the slowed (last) rank, as a fraction (default 0.2; 0 skips)")
    p.add_argument("--timeout-s", type=int, default=380, help="most seconds per MPI job (default 380)")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--png", type=Path, default=None, help="draw a bar chart of steps/s to this PNG file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.np = [int(n) for n in selected(args.np, NPS)]
    args.impls = selected(args.impls, IMPLS)
    sizes = ("rows", "dim", "steps", "dense_steps", "batches")
    bad = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k in sizes if getattr(args, k) < 1]
    if args.warmup < 0 or args.compute_ms < 0 or args.slow < 0 or args.zipf <= 0:
        bad.append("--warmup, --compute-ms and --slow must be >= 0 and --zipf > 0")
    if bad:
        p.error("bad sizes: " + ", ".join(bad))
    if args.worker and args.out is None:
        p.error("--worker needs --out")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[embeddings] %(message)s")
    return worker(args) if args.worker else driver(args)


if __name__ == "__main__":
    sys.exit(main())
