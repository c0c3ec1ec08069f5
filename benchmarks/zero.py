"""ZeRO stages 0-3: bytes each rank holds, beside the formula, samples/s, and a memory cap.

Run it as a plain program (it is the driver; it launches one MPI job per configuration)::

    python benchmarks/zero.py --json out/zero.json --png docs/benchmarks/zero_bytes.png   # full: ~50M, np 2, 4
    python benchmarks/zero.py --quick                   # ~4M parameters (~13 min on a busy 2-core host)
    python benchmarks/zero.py --parts cases --np 4 --frameworks torch   # a subset; no cgroups

The memory-cap part needs root (it makes memory cgroups); without them its line reads n/a.

Why it exists: issue 14 (sharded data parallelism) promises that stage k of ZeRO holds
``unison.common.zero.formula_bytes`` per rank (16 B/param plain; 4+4+8/N stage 1; 4+12/N stage 2;
16/N stage 3, with Adam in fp32) at little cost in speed, and that it lets a model train that
plain data parallelism cannot hold. This script measures those claims.

What it does:

1. For each ``--np`` (2 and 4) and each configuration (torch ``stage0``-``stage3``, torch's own
   ``ZeroRedundancyOptimizer`` over gloo as the anchor (``torch-zero``), Keras ``stage0``-
   ``stage2``), one ``mpirun`` launch of ``benchmarks/zero_worker.py`` (each launch has clean
   RSS and a timeout). The model is an MLP of ``Linear(width, width)`` layers (weights dominate:
   activations are ``batch x width`` per layer), trained with Adam on synthetic data; the worker's
   docstring says exactly what is counted. A configuration the library cannot build yet prints
   "not available (...)" and its targets read "n/a".
2. The memory cap (``--np`` 4, torch): one memory cgroup per rank (:mod:`zero_cgroup`) of
   ``cap = CAP_BASE + CAP_PER_PARAM x P`` bytes, where P is a model stage 0 can hold. Three
   launches: stage 0 at P (the control: it must train), stage 0 at a model with 3x the hidden
   layers (it must be OOM-killed) and stage 3 at that 3x model (it must train). Fixed sizes,
   not a search.
3. Prints a table, the targets (lines ending PASS or MISS), and writes ``--json`` records and a
   PNG of bytes per rank by stage.

Targets, per np: every stage's measured state bytes (the worst rank) within 10% of
``formula_bytes`` plus the declared working buffers; stage 1 and 2 samples/s >= 0.9x stage 0 and
stage 3 >= 0.7x (each framework); torch stage 1 >= 1.25x ``ZeroRedundancyOptimizer``; and, at
np 4, the memory-cap pair. Keras holds gradients only inside a step (no variables), so its
formula is taken with 0 gradient bytes: stage 0 is 12 B/param, stages 1 and 2 both 4+8/N.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchutil import list_choices, selected, write_json
from zero_cgroup import CgroupUnavailable, RankCaps
from zero_report import print_cap, print_table, print_targets, write_png
from zero_worker import IMPLS, mlp_layers, mlp_params, stage_of

logger = logging.getLogger("benchmarks.zero")

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "zero_worker.py"
VENV_BIN = Path(sys.executable).parent
NPS = (2, 4)
FRAMEWORKS = ("torch", "keras")
PARTS = ("cases", "cap")
CAP_NP = 4
#: per-rank cap = CAP_BASE + CAP_PER_PARAM x P, P the parameters stage 0 must hold. CAP_BASE is
#: the process itself (interpreter, torch, MPI, unison: ~400 MiB measured here at np 4) and some
#: headroom. 32 B/param sits between what stage 0 at P needs (16 B + temporaries: it trains)
#: and at 3P (48 B: killed), and leaves stage 3 at 3P room for the whole model every rank builds
#: before ``shard_module`` shards it (3P x 4 B = 12 B) next to its shards (3P x 16 B / 4 = 12 B)
CAP_BASE = 512 << 20
CAP_PER_PARAM = 32
#: a capped launch only has to show that it trains: two steps (the later flags win)
CAP_STEPS = ["--warmup", "1", "--steps", "1", "--repeats", "1"]
#: the options whose defaults depend on --quick, and those defaults
SIZE_OPTIONS = ("params", "width", "batch", "steps", "warmup", "repeats", "cap_layers", "timeout_s")
SIZES = {"full": (50_000_000, 2048, 32, 3, 1, 2, 6, 420),
         "quick": (4_000_000, 1024, 16, 3, 1, 2, 16, 240)}


@dataclass
class CaseRecord:
    """One configuration at one np, as written to the JSON file (bytes per rank)."""

    framework: str
    impl: str
    stage: int
    np: int
    params: int
    batch: int
    samples_per_s: float | None = None
    loss: float | None = None
    weights_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    #: weights + grads + optimizer of the rank furthest from the formula
    state_bytes: int = 0
    working_bytes: int = 0
    formula_bytes: int = 0
    peak_rss_bytes: int = 0
    per_rank: list[dict[str, int]] = field(default_factory=list)
    error: str = ""


@dataclass
class CapRecord:
    """One launch under the per-rank memory cap."""

    impl: str
    np: int
    params: int
    cap_bytes: int
    expected: str
    outcome: str
    oom_kills: int
    #: the most any rank's cgroup was charged (RSS plus page cache it touched); also when killed
    peak_cgroup_bytes: int
    detail: str = ""


# --- launching --------------------------------------------------------------------------------


def mpi_env(master_port: int) -> dict[str, str]:
    """One thread per pool (several ranks share the cores); gloo's rendezvous for the anchor."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1",
               MKL_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3", PYTHONUNBUFFERED="1",
               OMPI_MCA_mpi_yield_when_idle="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
               PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mpirun_cmd(np_: int) -> list[str]:
    mpirun = str(VENV_BIN / "mpirun") if (VENV_BIN / "mpirun").exists() else "mpirun"
    cmd = [mpirun, "-np", str(np_), "--bind-to", "none", "--oversubscribe"]
    return cmd + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def launch(np_: int, worker_args: list[str], timeout_s: float, worker: Path = WORKER) -> tuple[int, str]:
    """Runs ``worker`` on ``np_`` ranks; ``(exit status, output tail)``; 124 on a timeout.

    mpirun runs in its own session, so a timeout ends it and its ranks (that group only).
    """
    cmd = mpirun_cmd(np_) + [sys.executable, str(worker), *worker_args]
    proc = subprocess.Popen(cmd, env=mpi_env(free_port()), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out[-3000:]
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                out, _ = proc.communicate(timeout=10)
                break
            except (subprocess.TimeoutExpired, ProcessLookupError):
                out = ""
        return 124, f"timed out after {timeout_s:.0f} s\n{(out or '')[-3000:]}"


def worker_args(fw: str, impl: str, layers: int, args: argparse.Namespace, out: Path) -> list[str]:
    return ["--framework", fw, "--impl", impl, "--layers", str(layers), "--width", str(args.width),
            "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--repeats", str(args.repeats), "--out", str(out)]


# --- one configuration ------------------------------------------------------------------------


def formula(fw: str, stage: int, params: int, n: int, working: int) -> int:
    from unison.common.zero import BytesPerParam, formula_bytes

    per = BytesPerParam(4, 0, 8) if fw == "keras" else BytesPerParam.adam()
    return formula_bytes(stage, params, n, per, working_bytes=working)


def to_record(fw: str, impl: str, n: int, layers: int, args: argparse.Namespace,
              result: dict[str, Any] | None, failure: str) -> CaseRecord:
    rec = CaseRecord(fw, impl, stage_of(impl), n, mlp_params(layers, args.width), args.batch)
    if result is None or "error" in result:
        rec.error = failure or (result or {}).get("error", "no result")
        return rec
    ranks = result["per_rank"]
    rec.samples_per_s, rec.loss, rec.per_rank = result["samples_per_s"], result["loss"], ranks
    rec.working_bytes = max(r["working"] for r in ranks)
    rec.formula_bytes = formula(fw, rec.stage, rec.params, n, rec.working_bytes)
    worst = max(ranks, key=lambda r: abs(r["weights"] + r["grads"] + r["optimizer"] - rec.formula_bytes))
    rec.weights_bytes, rec.grads_bytes, rec.optimizer_bytes = worst["weights"], worst["grads"], worst["optimizer"]
    rec.state_bytes = worst["weights"] + worst["grads"] + worst["optimizer"]
    rec.peak_rss_bytes = max(r["peak_rss"] for r in ranks)
    return rec


def run_case(fw: str, impl: str, n: int, args: argparse.Namespace, tmp: Path) -> CaseRecord:
    out = tmp / f"{fw}-{impl}-np{n}.json"
    t0 = time.perf_counter()
    rc, tail = launch(n, worker_args(fw, impl, args.layers, args, out), args.timeout_s)
    result = json.loads(out.read_text()) if out.exists() else None
    failure = "" if result is not None and rc == 0 else f"launch exit status {rc}: {tail.strip()[-1500:]}"
    rec = to_record(fw, impl, n, args.layers, args, result, failure)
    logger.info("np %d %s %s: %s (%.0f s)", n, fw, impl, rec.error.splitlines()[0][:160] if rec.error
                else f"{rec.samples_per_s:.1f} samples/s", time.perf_counter() - t0)
    return rec


# --- memory cap -------------------------------------------------------------------------------


def cap_case(impl: str, layers: int, expected: str, cap: int, args: argparse.Namespace,
             tmp: Path) -> CapRecord:
    """One launch of ``impl`` at ``layers`` hidden layers with every rank under ``cap`` bytes."""
    out = tmp / f"cap-{impl}-{layers}.json"
    params = mlp_params(layers, args.width)
    try:
        with RankCaps(CAP_NP, cap, f"{impl}-{layers}") as caps:
            rc, tail = launch(CAP_NP, worker_args("torch", impl, layers, args, out) + CAP_STEPS
                              + ["--cgroup", caps.prefix], args.timeout_s)
            kills, peak = sum(caps.oom_kills()), max(caps.peak_bytes())
    except CgroupUnavailable as exc:
        return CapRecord(impl, CAP_NP, params, cap, expected, "unavailable", 0, 0, str(exc))
    result = json.loads(out.read_text()) if out.exists() and rc == 0 else None
    if result is not None and "error" in result:
        outcome, detail = "not available", result["error"]
    elif result is not None:
        outcome, detail = "trained", f"{result['samples_per_s']:.1f} samples/s"
    else:
        outcome, detail = ("killed" if kills else "failed"), f"exit status {rc}: {telling_line(tail)}"
    logger.info("cap %s at %d parameters: %s (%d OOM kills)", impl, params, outcome, kills)
    return CapRecord(impl, CAP_NP, params, cap, expected, outcome, kills, peak, detail)


def telling_line(output: str) -> str:
    """The line of mpirun's output that says how a rank ended (signal, kill), else the last one."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip().strip("-")]
    hits = [ln for ln in lines if any(w in ln.lower() for w in ("signal", "killed", "error"))]
    return (hits or lines or [""])[0][:300]


def run_cap(args: argparse.Namespace, tmp: Path) -> list[CapRecord]:
    hold = args.cap_layers
    cap = args.cap_bytes or CAP_BASE + CAP_PER_PARAM * mlp_params(hold, args.width)
    return [cap_case("stage0", hold, "trained", cap, args, tmp),
            cap_case("stage0", 3 * hold, "killed", cap, args, tmp),
            cap_case("stage3", 3 * hold, "trained", cap, args, tmp)]


# --- command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Per-rank bytes of parameters, gradients and optimizer state under ZeRO stages 0-3 "
                    "(torch) and 0-2 (Keras) beside unison.common.zero.formula_bytes, samples/s, torch's "
                    "ZeroRedundancyOptimizer as the anchor, and a per-rank memory cap (cgroup) that stage 0 "
                    "cannot train under and stage 3 can. Launches its own MPI jobs, one per configuration.",
        epilog="Lists take commas or spaces, e.g. --np 2,4 --frameworks torch --parts cases.")
    p.add_argument("--quick", action="store_true", help="small model (~4M parameters), fewer steps")
    p.add_argument("--np", type=list_choices([str(n) for n in NPS]), nargs="+", default=[[str(n) for n in NPS]],
                   help="rank counts (default: 2 and 4)")
    p.add_argument("--frameworks", type=list_choices(FRAMEWORKS), nargs="+", default=[list(FRAMEWORKS)],
                   help="frameworks (default: torch and keras)")
    p.add_argument("--params", type=float, default=None,
                   help="approximate model parameters, e.g. 64e6 (default 50M; 4M with --quick)")
    p.add_argument("--width", type=int, default=None, help="MLP width (default 2048; 1024 with --quick)")
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step (default 32; 16 quick)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed run (default 3)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs; the fastest counts (default 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    p.add_argument("--parts", type=list_choices(PARTS), nargs="+", default=[list(PARTS)],
                   help="cases (the configurations at each np) and/or cap (the memory-cap launches; torch, np 4, "
                        "root); default both")
    p.add_argument("--cap-layers", type=int, default=None,
                   help="hidden layers of the model stage 0 holds under the cap (the big one has 3x; "
                        "default 6 at width 2048, 16 quick)")
    p.add_argument("--cap-mib", type=int, default=None,
                   help=f"per-rank cap in MiB (default {CAP_BASE >> 20} MiB + {CAP_PER_PARAM} B per "
                        "parameter of the model stage 0 holds)")
    p.add_argument("--timeout-s", type=int, default=None, help="most seconds per launch (default 420; 240 quick)")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--png", type=Path, default=None,
                   help="write the bytes-per-rank plot here (default: the --json path with .png; the docs' "
                        "plot is docs/benchmarks/zero_bytes.png)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.np = [int(n) for n in selected(args.np, [str(n) for n in NPS])]
    args.frameworks = selected(args.frameworks, FRAMEWORKS)
    args.parts = selected(args.parts, PARTS)
    defaults = dict(zip(SIZE_OPTIONS, SIZES["quick" if args.quick else "full"], strict=True))
    for name, value in defaults.items():
        if getattr(args, name) is None:  # "is None": an explicit 0 must reach the check below
            setattr(args, name, value)
    args.params = int(args.params)
    bad = {name: getattr(args, name) for name in SIZE_OPTIONS + ("cap_mib",)
           if getattr(args, name) is not None and getattr(args, name) < (0 if name == "warmup" else 1)}
    if bad:
        p.error("--warmup must be at least 0 and the other sizes at least 1; got "
                + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in bad.items()))
    args.cap_bytes = (args.cap_mib << 20) if args.cap_mib is not None else None
    args.layers = mlp_layers(args.params, args.width)
    if args.png is None and args.json is not None:
        args.png = args.json.with_suffix(".png")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[zero] %(message)s")
    load_start = os.getloadavg()[0]
    print(f"MLP: {args.layers} x Linear({args.width}, {args.width}) + Linear({args.width}, 10): "
          f"{mlp_params(args.layers, args.width):,} parameters, Adam, batch {args.batch} per rank, "
          f"{args.warmup} warm-up steps, then the fastest of {args.repeats} runs of {args.steps} steps")
    records: list[CaseRecord] = []
    caps: list[CapRecord] = []
    with tempfile.TemporaryDirectory(prefix="unison-zero-") as tmp:
        for n in args.np if "cases" in args.parts else ():
            for fw in args.frameworks:
                records += [run_case(fw, impl, n, args, Path(tmp)) for impl in IMPLS[fw]]
        if "cap" in args.parts and "torch" in args.frameworks:
            caps = run_cap(args, Path(tmp))
    print_table(records)
    print_cap(caps)
    print_targets(records, caps)
    print(f"\nhost load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end, on "
          f"{os.cpu_count()} CPUs; more than the ranks means other work shared the CPUs")
    if args.json is not None:
        write_json(args.json, [*records, *caps])
        print(f"wrote {args.json}")
    if args.png is not None and any(r.samples_per_s is not None for r in records):
        write_png(args.png, records)
        print(f"wrote {args.png}")
    broken = [f"np {r.np} {r.framework} {r.impl}: {r.error.splitlines()[0][:200]}"
              for r in records if r.error.startswith("launch")]
    broken += [f"cap {c.impl} at {c.params:,} parameters: {c.detail[:200]}" for c in caps if c.outcome == "failed"]
    for b in broken:
        print(f"FAILED: {b}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
