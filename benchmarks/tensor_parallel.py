"""Tensor parallelism: parameter bytes per rank, samples/s and communication per step.

Run it as a plain program (it is the driver; it launches one MPI job per configuration)::

    python benchmarks/tensor_parallel.py --json out/tp.json --png docs/benchmarks/tensor_parallel.png \\
        --grid-png docs/benchmarks/tp_grid.png          # full: ~50M parameters, np 2 and 4
    python benchmarks/tensor_parallel.py --quick        # a tiny model, to see it work
    python benchmarks/tensor_parallel.py --np 2 --configs tp2,torch-tp2

Why it exists: issue 15 (Megatron-style tensor parallelism) promises that a tensor group of
``tp`` ranks holds ``1/tp`` of a layer's weights, costs Megatron-LM's communication and no more,
and is at least as fast as torch's own ``parallelize_module`` on CPU. This script measures those.

What it does, for each ``--np`` (2 and 4) and configuration (``benchmarks/tensor_parallel_worker.py``
says exactly what each builds and counts):

* ``tp1``: plain data parallelism, the unsplit blocks and ``hvd.DistributedOptimizer``;
* ``tp2``, ``tp4`` (np 4 only): ``Grid(tp=k)``, ``hvd.ParallelTransformerBlock`` on the tensor
  group, ``DistributedOptimizer`` over the data group (dp = np / tp);
* ``torch-tp2``: torch's ``parallelize_module`` (``ColwiseParallel``/``RowwiseParallel``) over a
  gloo ``DeviceMesh`` of (dp, 2), the anchor; if it does not run, its error is recorded and
  its targets read n/a.

The model is a stack of pre-norm transformer blocks where the weights dominate (4 blocks of
hidden 1024 and MLP 4096: 12.6M parameters each, against a global batch of 8 x 16 positions),
float32, SGD; every configuration trains the same global batch per step from the same
weights, so their first losses agree (a check is printed).

The analytic Megatron volume per step (each rank of a tensor group, tp > 1)::

    bytes = layers x 4 x (batch / dp) x seq x hidden x 4 B      (4 calls per block)

one all-reduce forward where the attention leaves its row-parallel output, one where the MLP
does, and their conjugates backward (where the replicated input enters the column layers).
tp = 1 sends nothing through these operators (its traffic is the gradient all-reduce).

Targets, printed as lines ending PASS, MISS or n/a: per-rank parameter bytes <= whole / tp + 5%
(each configuration); unison tp=2 samples/s >= 1.0x torch ``parallelize_module`` (per np);
measured tensor-parallel bytes per step within 10% of the analytic volume (each tp > 1).
Scaling (tp=k samples/s over tp=1's at the same np) is printed for information.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import atomic_write, list_choices, ratio_target, selected, shown, write_json  # noqa: E402
from tensor_parallel_worker import CONFIGS, block_params, tp_of  # noqa: E402
from zero import launch  # noqa: E402

logger = logging.getLogger("benchmarks.tensor_parallel")

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "tensor_parallel_worker.py"
NPS = (2, 4)
PARAM_SLACK = 0.05
COMM_TOLERANCE = 0.10
ANCHOR_RATIO = 1.0
LOSS_RTOL = 1e-4
MIB = 1 << 20
#: the options whose defaults depend on --quick, and those defaults
SIZE_OPTIONS = ("layers", "hidden", "heads", "ffn", "seq", "batch", "steps", "warmup", "repeats", "timeout_s")
SIZES = {"full": (4, 1024, 16, 4096, 16, 8, 3, 2, 3, 420),
         "quick": (2, 128, 8, 512, 8, 8, 2, 1, 2, 240)}
LABELS = {"tp1": "tp=1 (data parallel)", "tp2": "unison tp=2", "tp4": "unison tp=4",
          "torch-tp2": "torch parallelize_module tp=2"}
SHORT = {"tp1": "tp=1\n(data par.)", "tp2": "unison\ntp=2", "tp4": "unison\ntp=4",
         "torch-tp2": "torch\nparallelize\ntp=2"}


@dataclass
class Record:
    """One configuration at one np, as written to the JSON file (bytes per rank: the largest)."""

    config: str
    np: int
    tp: int
    dp: int = 0
    params: int = 0
    whole_param_bytes: int = 0
    param_bytes: int = 0
    samples_per_s: float | None = None
    step_s: float | None = None
    comm_bytes: float = 0.0
    comm_calls: float = 0.0
    analytic_bytes: int = 0
    analytic_calls: int = 0
    first_loss: float | None = None
    last_loss: float | None = None
    torch_comm_calls: dict[str, int] = field(default_factory=dict)
    per_rank: list[dict[str, float]] = field(default_factory=list)
    error: str = ""


def analytic(args: argparse.Namespace, tp: int, dp: int) -> tuple[int, int]:
    """Megatron's tensor-parallel ``(bytes, calls)`` per step for one rank (see the module docstring)."""
    if tp == 1:
        return 0, 0
    return args.layers * 4 * (args.batch // dp) * args.seq * args.hidden * 4, 4 * args.layers


# --- launching ----------------------------------------------------------------------------------


def worker_args(config: str, args: argparse.Namespace, out: Path) -> list[str]:
    sizes = [f"--{k}={getattr(args, k)}" for k in SIZE_OPTIONS if k != "timeout_s"]
    return ["--config", config, *sizes, "--out", str(out)]


def to_record(config: str, n: int, args: argparse.Namespace, result: dict[str, Any] | None,
              failure: str) -> Record:
    rec = Record(config, n, tp_of(config), params=args.layers * block_params(args.hidden, args.ffn))
    rec.whole_param_bytes = 4 * rec.params
    if result is None or "error" in result:
        rec.error = failure or (result or {}).get("error", "no result")
        return rec
    ranks = result["per_rank"]
    rec.dp, rec.per_rank = result["dp"], ranks
    rec.samples_per_s, rec.step_s = result["samples_per_s"], min(result["run_s"]) / args.steps
    rec.first_loss, rec.last_loss = result["first_loss"], result["last_loss"]
    rec.param_bytes = max(int(r["param_bytes"]) for r in ranks)
    rec.comm_bytes, rec.comm_calls = max(r["comm_bytes"] for r in ranks), max(r["comm_calls"] for r in ranks)
    rec.analytic_bytes, rec.analytic_calls = analytic(args, rec.tp, rec.dp)
    rec.torch_comm_calls = result.get("torch_comm_calls", {})
    return rec


def run_case(config: str, n: int, args: argparse.Namespace, tmp: Path) -> Record:
    out = tmp / f"{config}-np{n}.json"
    t0 = time.perf_counter()
    rc, tail = launch(n, worker_args(config, args, out), args.timeout_s, WORKER)
    result = json.loads(out.read_text()) if out.exists() else None
    failure = "" if result is not None and rc == 0 else f"launch exit status {rc}: {tail.strip()[-1500:]}"
    rec = to_record(config, n, args, result, failure)
    logger.info("np %d %s: %s (%.0f s)", n, config, rec.error.splitlines()[0][:160] if rec.error
                else f"{rec.samples_per_s:.2f} samples/s", time.perf_counter() - t0)
    return rec


def configs_at(n: int, chosen: Sequence[str]) -> list[str]:
    """The chosen configurations that fit ``n`` ranks (tp divides n)."""
    return [c for c in chosen if n % tp_of(c) == 0]


# --- report -------------------------------------------------------------------------------------


def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def print_table(records: Sequence[Record]) -> None:
    print(f"\n{'np':>3} {'configuration':<31}{'dp x tp':>8}{'params/rank':>12}{'whole/tp':>10}{'ratio':>7}"
          f"{'samples/s':>11}{'s/step':>8}{'comm/step':>11}{'analytic':>10}{'calls':>7}{'first loss':>12}"
          f"{'last loss':>11}")
    print(f"{'':>3} {'(MiB per rank; comm = tensor-parallel collectives, MiB per step, the largest rank)'}")
    for r in records:
        if r.error:
            continue
        share = r.whole_param_bytes / r.tp
        calls = f"{r.comm_calls:g}" if not r.torch_comm_calls else str(sum(r.torch_comm_calls.values()))
        comm = mib(r.comm_bytes) if not r.config.startswith("torch") else "-"
        print(f"{r.np:>3} {LABELS[r.config]:<31}{f'{r.dp} x {r.tp}':>8}{mib(r.param_bytes):>12}{mib(share):>10}"
              f"{r.param_bytes / share:>7.3f}{r.samples_per_s:>11.2f}{r.step_s:>8.3f}{comm:>11}"
              f"{mib(r.analytic_bytes):>10}{calls:>7}{r.first_loss:>12.6f}{r.last_loss:>11.6f}")
    for r in records:
        if r.error:
            print(f"np {r.np} {LABELS[r.config]}: FAILED ({r.error.splitlines()[0][:400]})")
    for r in records:
        if r.torch_comm_calls:
            print(f"np {r.np} {LABELS[r.config]}: collective calls per step (CommDebugMode): "
                  + ", ".join(f"{k} {v}" for k, v in sorted(r.torch_comm_calls.items()))
                  + ("  (allreduce_: the data group's flat gradient all-reduce)" if r.dp > 1 else ""))
    print_loss_check(records)


def print_loss_check(records: Sequence[Record]) -> None:
    """Same weights, same global batch: every configuration's first loss should equal tp=1's."""
    for n in dict.fromkeys(r.np for r in records):
        done = [r for r in records if r.np == n and not r.error]
        base = next((r for r in done if r.config == "tp1"), None)
        if base is None or len(done) < 2:
            continue
        off = [f"{r.config} {r.first_loss:.7g}" for r in done
               if abs(r.first_loss - base.first_loss) > LOSS_RTOL * abs(base.first_loss)]
        print(f"loss check np {n}: " + (f"every configuration's first loss equals tp=1's ({base.first_loss:.7g}) "
                                         f"within {LOSS_RTOL:g}" if not off else
                                         f"DIFFERS from tp=1's {base.first_loss:.7g}: {', '.join(off)}"))


def param_line(r: Record) -> str:
    what = f"np {r.np} {LABELS[r.config]}: param bytes per rank / (whole / {r.tp})"
    if r.error:
        return f"  {what} = n/a   FAILED"
    ratio = r.param_bytes / (r.whole_param_bytes / r.tp)
    verdict = "PASS" if ratio <= 1 + PARAM_SLACK else "MISS"
    text = shown(ratio, verdict == "PASS", 1 + PARAM_SLACK, False, 3)
    return f"  {what} = {text}  (target <= {1 + PARAM_SLACK:g})  {verdict}"


def comm_line(r: Record) -> str:
    what = f"np {r.np} {LABELS[r.config]}: tensor-parallel bytes per step / analytic Megatron volume"
    if r.error:
        return f"  {what} = n/a   FAILED"
    ratio = r.comm_bytes / r.analytic_bytes
    verdict = "PASS" if abs(ratio - 1) <= COMM_TOLERANCE else "MISS"
    return (f"  {what} = {ratio:.3f}  (target 1 +- {COMM_TOLERANCE:g}; {mib(r.comm_bytes)} of "
            f"{mib(r.analytic_bytes)} MiB)  {verdict}")


def speed(records: Sequence[Record], n: int, config: str) -> float | None:
    hit = [r.samples_per_s for r in records if (r.np, r.config) == (n, config) and not r.error]
    return hit[0] if hit else None


def print_targets(records: Sequence[Record]) -> None:
    print("\ntargets")
    for r in records:
        if not r.config.startswith("torch"):
            print(param_line(r))
    for n in sorted({r.np for r in records}):
        anchor = next((r for r in records if (r.np, r.config) == (n, "torch-tp2")), None)
        if anchor is not None or speed(records, n, "tp2") is not None:
            note = "" if anchor is None or not anchor.error else "   (torch parallelize_module FAILED: see above)"
            line = ratio_target(f"np {n} samples/s unison tp=2 / torch parallelize_module tp=2",
                                speed(records, n, "tp2"), speed(records, n, "torch-tp2"), ANCHOR_RATIO)
            print(line + (note if line.endswith("not measured") else ""))
    for r in records:
        if r.tp > 1 and not r.config.startswith("torch"):
            print(comm_line(r))
    print("\nscaling (information, no target): samples/s over tp=1's at the same np")
    for n in sorted({r.np for r in records}):
        for config in ("tp2", "tp4", "torch-tp2"):
            mine, base = speed(records, n, config), speed(records, n, "tp1")
            if mine is not None and base is not None:
                print(f"  np {n} {LABELS[config]} / tp=1 = {mine / base:.2f}")


def write_png(path: Path, records: Sequence[Record]) -> None:
    """Three panels, bars grouped by np: samples/s; parameter MiB per rank with whole/tp ticks;
    tensor-parallel MiB per step, measured beside the analytic volume."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    rows = list(records)
    xs = list(range(len(rows)))
    names = [f"np {r.np}\n{SHORT[r.config]}" for r in rows]
    colors = [f"C{CONFIGS.index(r.config)}" for r in rows]
    axes[0].bar(xs, [r.samples_per_s or 0 for r in rows], color=colors)
    axes[0].set_title("samples/s (higher is better)", fontsize=10)
    axes[1].bar(xs, [r.param_bytes / MIB for r in rows], color=colors)
    for x, r in zip(xs, rows, strict=True):
        axes[1].hlines(r.whole_param_bytes / r.tp / MIB, x - 0.42, x + 0.42, color="black", linewidth=2)
        if r.error:
            for ax in axes:
                ax.text(x, 0, "failed", ha="center", va="bottom", fontsize=8, rotation=90)
    axes[1].set_title("parameter MiB per rank (tick: whole / tp)", fontsize=10)
    axes[2].bar([x - 0.2 for x in xs], [r.comm_bytes / MIB for r in rows], width=0.4, color=colors)
    axes[2].bar([0], [0], color="0.5", label="measured")  # a neutral legend entry for the coloured bars
    axes[2].bar([x + 0.2 for x in xs], [r.analytic_bytes / MIB for r in rows], width=0.4, color="none",
                edgecolor="black", hatch="//", label="analytic (Megatron)")
    axes[2].set_title("tensor-parallel MiB per step per rank", fontsize=10)
    top = max([r.comm_bytes for r in rows] + [r.analytic_bytes for r in rows] + [1]) / MIB
    axes[2].set_ylim(0, 1.3 * top)  # room for the legend above the bars
    axes[2].legend(fontsize=8, loc="upper left", ncol=2)
    for ax in axes:
        ax.set_xticks(xs, names, fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    r0 = rows[0]
    fig.suptitle(f"{r0.params / 1e6:.1f}M-parameter transformer stack, float32, SGD; torch anchor's comm not "
                 "counted (its calls are in the table)", fontsize=10)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")


def write_grid_png(path: Path, args: argparse.Namespace) -> None:
    """The data x pipeline x tensor grid of 8 ranks, the benchmark's blocks split over 2 stages."""
    from unison.common.tensor_parallel import Grid

    half = args.layers // 2
    Grid(dp=2, pp=2, tp=2, size=8).render_png(path, stage_labels=[f"blocks 0-{half - 1}",
                                                                  f"blocks {half}-{args.layers - 1}"])


# --- command line -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + " Launches its own MPI jobs, one per configuration.",
        epilog="Analytic Megatron volume per step and rank (tp > 1): layers x 4 x (batch / dp) x seq x hidden x "
               "4 bytes (2 all-reduces per block forward, 2 backward). Targets: param bytes per rank <= whole/tp "
               "+ 5%; unison tp=2 samples/s >= 1.0x torch parallelize_module; comm within 10% of the analytic "
               "volume. Lists take commas or spaces, e.g. --np 2 --configs tp1,tp2.")
    p.add_argument("--quick", action="store_true", help="a tiny model (hidden 128), fewer steps")
    p.add_argument("--np", type=list_choices([str(n) for n in NPS]), nargs="+", default=[[str(n) for n in NPS]],
                   help="rank counts (default: 2 and 4)")
    p.add_argument("--configs", type=list_choices(CONFIGS), nargs="+", default=[list(CONFIGS)],
                   help="configurations (default all; tp4 runs at np 4 only)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default 4; 2 quick)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 1024; 128 quick)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default 16; 8 quick)")
    p.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4096; 512 quick)")
    p.add_argument("--seq", type=int, default=None, help="positions per sequence (default 16; 8 quick)")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences per step, all data replicas together; a multiple of 4 (default 8)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed run (default 3; 2 quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first, at least 1 (default 2; 1 quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs; the fastest counts (default 3; 2 quick)")
    p.add_argument("--timeout-s", type=int, default=None, help="most seconds per launch (default 420; 240 quick)")
    p.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    p.add_argument("--from-json", type=Path, default=None,
                   help="launch nothing: print the table and targets of a JSON file this script wrote, and draw "
                        "its --png")
    p.add_argument("--png", type=Path, default=None,
                   help="write the plot here (default: the --json path with .png; the docs' plot is "
                        "docs/benchmarks/tensor_parallel.png)")
    p.add_argument("--grid-png", type=Path, default=None,
                   help="also draw Grid(dp=2, pp=2, tp=2) with Grid.render_png here (the docs' picture is "
                        "docs/benchmarks/tp_grid.png)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.np = [int(n) for n in selected(args.np, [str(n) for n in NPS])]
    args.configs = selected(args.configs, CONFIGS)
    defaults = dict(zip(SIZE_OPTIONS, SIZES["quick" if args.quick else "full"], strict=True))
    for name, value in defaults.items():
        if getattr(args, name) is None:  # "is None": an explicit 0 must reach the check below
            setattr(args, name, value)
    bad = {name: getattr(args, name) for name in SIZE_OPTIONS if getattr(args, name) < 1}
    if bad:
        p.error("every size must be at least 1; got " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                                  for k, v in bad.items()))
    for name, multiple in (("batch", max(args.np)), ("heads", 4), ("ffn", 4), ("hidden", args.heads)):
        if getattr(args, name) % multiple:
            p.error(f"--{name} {getattr(args, name)} must be a multiple of {multiple} (every data replica gets "
                    "an equal share of the batch; heads, MLP and hidden split over tp = 4)")
    if args.png is None and args.json is not None:
        args.png = args.json.with_suffix(".png")
    return args


def model_line(args: argparse.Namespace) -> str:
    params = args.layers * block_params(args.hidden, args.ffn)
    return (f"model: {args.layers} pre-norm transformer blocks, hidden {args.hidden}, {args.heads} heads, MLP "
            f"{args.ffn}: {params:,} parameters ({mib(4 * params)} MiB float32); global batch {args.batch} x "
            f"{args.seq} positions, SGD; {args.warmup} warm-up steps, then the fastest of {args.repeats} runs of "
            f"{args.steps} steps")


def measure(args: argparse.Namespace) -> list[Record]:
    """The records: launched now, or read back from ``--from-json``."""
    if args.from_json is not None:
        records = [Record(**r) for r in json.loads(args.from_json.read_text())]
        print(f"records of {args.from_json} ({records[0].params:,} parameters); nothing launched")
        return records
    print(model_line(args))
    records = []
    with tempfile.TemporaryDirectory(prefix="unison-tp-") as tmp:
        for n in args.np:
            records += [run_case(c, n, args, Path(tmp)) for c in configs_at(n, args.configs)]
    return records


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="[tensor_parallel] %(message)s")
    load_start, t_start = os.getloadavg()[0], time.perf_counter()
    records = measure(args)
    print_table(records)
    print_targets(records)
    if args.from_json is None:
        print(f"\nhost load average (1 min): {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end, on "
              f"{os.cpu_count()} CPUs; more than the ranks means other work shared the CPUs. "
              f"Wall time {time.perf_counter() - t_start:.0f} s")
    if args.json is not None:
        write_json(args.json, records)
        print(f"wrote {args.json}")
    if args.png is not None and any(r.samples_per_s is not None for r in records):
        write_png(args.png, records)
        print(f"wrote {args.png}")
    if args.grid_png is not None:
        write_grid_png(args.grid_png, args)
        print(f"wrote {args.grid_png}")
    broken = [f"np {r.np} {r.config}: {r.error.splitlines()[0][:200]}" for r in records
              if r.error.startswith("launch") or (r.error and not r.config.startswith("torch"))]
    for b in broken:
        print(f"FAILED: {b}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
