"""``python -m unison.perfmodel``: predicted all-reduce cost and scaling efficiency, 8 to 512 ranks.

Prints, for one workload's gradients on a cluster of hosts x ranks per host, the predicted
communication time per step, the part of it the backward pass does not hide, and the scaling
efficiency of the flat ring, hierarchical, halving-doubling and (NCCL's, for comparison) tree
all-reduce; optionally a PNG and JSON. The model and its assumptions are in
:mod:`unison.common.perfmodel` and docs/perfmodel.md. Example::

    python -m unison.perfmodel --model resnet50 --ranks-per-host 8 --link 100gbit --latency 5us
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from unison.common import perfmodel as pm
from unison.common.perfmodel_workloads import COMPUTE_NOTES, DEFAULT_COMPUTE_S, WORKLOADS, tensor_bytes
from unison.common.plotting import require_matplotlib

__all__ = ["main", "HOROVOD_REFERENCE", "Reference"]

#: How tables and plots name the algorithms: the tree is NCCL's, not one Unison runs.
LABELS = {"rhd": "halving-doubling", "tree": "tree (NCCL, not Unison)"}

DEFAULT_RANKS = (8, 16, 32, 64, 128, 256, 512)


def default_ranks(ranks_per_host: int) -> list[int]:
    """The rank counts predicted without ``--ranks``: one host, then doubling up to 512 (8, 16, ..., 512 at 8
    ranks per host; 6, 12, ..., 384 at 6: before 2026-12-07 the fixed 8..512 refused 6 ranks per host)."""
    out, ranks = [], ranks_per_host
    while ranks <= max(DEFAULT_RANKS[-1], ranks_per_host):
        out.append(ranks)
        ranks *= 2
    return out


@dataclass(frozen=True)
class Reference:
    """A published scaling result to show next to the predictions."""

    ranks: int
    efficiency: float
    model: str
    ranks_per_host: int
    link: str
    label: str


#: Horovod's published figure (docs/benchmarks, README): 512 Pascal GPUs, 128 servers x 4,
#: RoCE 25 Gbit/s, ~90% scaling efficiency for Inception V3 and ResNet-101 (68% for VGG-16).
HOROVOD_REFERENCE = Reference(512, 0.90, "resnet101", 4, "25gbit",
                              "Horovod published: ~90% at 512 GPUs\n(ResNet-101/Inception V3, 4/host, 25 Gbit/s)")


def _gbytes_per_s(beta_s_per_byte: float) -> str:
    """A link's rate in GB/s for the header, ``inf`` for a free one (a calibration may fit beta = 0)."""
    return f"{1 / beta_s_per_byte / 1e9:.3g}" if beta_s_per_byte > 0 else "inf"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value


def _png(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() != ".png" or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: give a file name ending in .png (matplotlib would add "
                                         "'.png' to a name without it, and refuses other suffixes)")
    return path


def _rate(text: str) -> float:
    try:
        return pm.parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(text: str) -> float:
    try:
        return pm.parse_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ranks(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give rank counts such as 8,16,32")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m unison.perfmodel",
        description="Predict all-reduce time per training step and scaling efficiency of flat ring, "
                    "hierarchical, halving-doubling and (NCCL's) tree all-reduce with an alpha-beta model "
                    "(docs/perfmodel.md).",
        epilog="Rates: 100gbit, 25gbit, 12.5gbps (bytes). Times: 5us, 1.5ms. A --calibration file "
               "(from benchmarks/hosts.py) replaces the link, latency and reduction options; "
               "--chunk-bytes and --overhead-us given with it replace the file's. 'tree' is NCCL's "
               "algorithm, not one Unison runs: shown for comparison.")
    p.add_argument("--model", choices=sorted(WORKLOADS), default="resnet50",
                   help="gradient sizes of this workload (default resnet50)")
    p.add_argument("--ranks-per-host", type=_positive_int, default=8, help="ranks per host (default 8)")
    p.add_argument("--ranks", type=_ranks, default=None,
                   help="rank counts to predict, each a multiple of --ranks-per-host or below it (default: "
                        "--ranks-per-host doubled up to 512: 8,16,...,512 at 8 ranks per host)")
    p.add_argument("--link", type=_rate, default=None,
                   help="inter-host bandwidth per host (default 100gbit)")
    p.add_argument("--latency", type=_seconds, default=None, help="inter-host latency (default 5us)")
    p.add_argument("--intra-link", type=_rate, default=None,
                   help="bandwidth between ranks of one host (default 1200gbit = 150 GB/s, NVLink-class)")
    p.add_argument("--intra-latency", type=_seconds, default=None,
                   help="latency between ranks of one host (default 2us)")
    p.add_argument("--reduce-rate", type=_rate, default=None,
                   help="local reduction speed in buffer bytes/s (default: free, as on a GPU)")
    p.add_argument("--overhead-us", type=float, default=None,
                   help="fixed cost per fused all-reduce in us: agreement, call path (default 0, or the "
                        "calibration's)")
    p.add_argument("--chunk-bytes", type=_positive_int, default=None,
                   help="piece size; each piece is one message (default 1 MiB, Unison's chunk_bytes, or the "
                        "calibration's)")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="forward + backward ms per step of one rank (default per model: "
                        + "; ".join(f"{m} {DEFAULT_COMPUTE_S[m] * 1e3:g} ({COMPUTE_NOTES[m]})"
                                    for m in WORKLOADS) + ")")
    p.add_argument("--backward-share", type=float, default=pm.DEFAULT_BACKWARD_SHARE,
                   help="share of the compute time that is the backward pass (default 2/3)")
    p.add_argument("--no-overlap", action="store_true",
                   help="communication starts only after the backward (default: overlaps it)")
    p.add_argument("--fusion-threshold", type=int, default=pm.DEFAULT_FUSION_THRESHOLD,
                   help="fusion buffer bytes (default 128 MiB, Unison's fusion_threshold)")
    p.add_argument("--cycle-ms", type=float, default=pm.DEFAULT_CYCLE_S * 1e3,
                   help="engine cycle in ms (default 1)")
    p.add_argument("--dtype-bytes", type=_positive_int, default=4, help="bytes per gradient element (default 4)")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a calibration JSON (unison.common.perfmodel.Calibration) to take links from")
    p.add_argument("--png", type=_png, default=None, help="write the plot to this .png file")
    p.add_argument("--json", action="store_true", help="print the predictions as JSON instead of a table")
    return p


#: the link options' defaults (None in the parser, so that one given with --calibration is seen)
_LINK_DEFAULTS = {"link": pm.parse_rate("100gbit"), "latency": 5e-6, "intra_link": pm.parse_rate("1200gbit"),
                  "intra_latency": 2e-6}


def _cluster(args: argparse.Namespace) -> pm.Cluster:
    if args.calibration is not None:
        cluster = pm.Calibration.load(args.calibration).cluster(1, args.ranks_per_host)
        if args.chunk_bytes is not None:  # (given ones were ignored before 2026-12-05)
            cluster = dataclasses.replace(cluster, chunk_bytes=args.chunk_bytes)
        if args.overhead_us is not None:
            cluster = dataclasses.replace(cluster, overhead_s=args.overhead_us * 1e-6)
        return cluster
    gamma = 0.0 if args.reduce_rate is None else 1.0 / args.reduce_rate
    given = {k: _LINK_DEFAULTS[k] if getattr(args, k) is None else getattr(args, k) for k in _LINK_DEFAULTS}
    return pm.Cluster(1, args.ranks_per_host, pm.Link.from_rate(given["intra_link"], given["intra_latency"]),
                      pm.Link.from_rate(given["link"], given["latency"]), gamma,
                      pm.DEFAULT_CHUNK_BYTES if args.chunk_bytes is None else args.chunk_bytes,
                      (args.overhead_us or 0.0) * 1e-6)


def predict(args: argparse.Namespace) -> list[pm.StepPrediction]:
    """Every (rank count, algorithm) prediction the command line asks for."""
    base = _cluster(args)
    sizes = tensor_bytes(args.model, args.dtype_bytes)
    compute = (args.compute_ms / 1e3) if args.compute_ms is not None else DEFAULT_COMPUTE_S[args.model]
    out = []
    for ranks in default_ranks(args.ranks_per_host) if args.ranks is None else args.ranks:
        try:
            cluster = base.with_ranks(ranks)
        except ValueError as exc:
            raise ValueError(f"--ranks: {exc}") from None
        for algo in pm.ALGORITHMS:
            out.append(pm.predict_step(algo, sizes, cluster, compute, args.fusion_threshold,
                                       args.cycle_ms / 1e3, args.backward_share, not args.no_overlap))
    return out


def _describe(args: argparse.Namespace, cluster: pm.Cluster) -> list[str]:
    sizes = tensor_bytes(args.model, args.dtype_bytes)
    compute = args.compute_ms if args.compute_ms is not None else DEFAULT_COMPUTE_S[args.model] * 1e3
    source = f"calibration {args.calibration}" if args.calibration else "command line"
    gamma = (f"{1 / cluster.gamma_s_per_byte / 1e9:.2f} GB/s" if cluster.gamma_s_per_byte else "free")
    return [
        f"{args.model}: {len(sizes)} gradient tensors, {sum(sizes) // args.dtype_bytes:,} parameters "
        f"({sum(sizes) / 2**20:.1f} MiB at {args.dtype_bytes} bytes); compute {compute:g} ms per step",
        f"links ({source}): inter-host {_gbytes_per_s(cluster.inter.beta_s_per_byte)} GB/s, "
        f"{cluster.inter.alpha_s * 1e6:.3g} us; intra-host {_gbytes_per_s(cluster.intra.beta_s_per_byte)} "
        f"GB/s, {cluster.intra.alpha_s * 1e6:.3g} us; reduction {gamma}; pieces of "
        f"{cluster.chunk_bytes} bytes; per-call overhead {cluster.overhead_s * 1e6:.3g} us",
        f"engine: fusion {args.fusion_threshold / 2**20:g} MiB, cycle {args.cycle_ms:g} ms, "
        + ("no overlap" if args.no_overlap else
           f"overlapping the backward ({args.backward_share:.2f} of compute)")
        + f"; {args.ranks_per_host} ranks per host",
    ]


def format_table(preds: Sequence[pm.StepPrediction]) -> list[str]:
    """Rows of ranks x algorithms: comm ms per step, exposed ms, efficiency."""
    head = f"{'ranks':>6}{'hosts':>6}"
    sub = " " * 12
    for algo in pm.ALGORITHMS:
        head += f" | {LABELS.get(algo, algo):^26}"
        sub += f" | {'comm ms':>9}{'exposed':>9}{'eff':>8}"
    lines = [head, sub]
    by = {(p.ranks, p.algorithm): p for p in preds}
    for ranks in sorted({p.ranks for p in preds}):
        first = by[(ranks, pm.ALGORITHMS[0])]
        row = f"{ranks:>6}{first.hosts:>6}"
        for algo in pm.ALGORITHMS:
            p = by[(ranks, algo)]
            row += f" | {p.comm_s * 1e3:>9.2f}{p.exposed_s * 1e3:>9.2f}{p.efficiency:>8.1%}"
        lines.append(row)
    return lines


def write_png(path: Path, preds: Sequence[pm.StepPrediction], title: str,
              bounds: Sequence[pm.StepPrediction] = ()) -> None:
    """Comm time and scaling efficiency against ranks, with Horovod's published point.

    ``bounds`` (predictions without overlap) are drawn dashed on the efficiency panel.
    """
    require_matplotlib("perfmodel --png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, algo in enumerate(pm.ALGORITHMS):
        pts = sorted((p.ranks, p.comm_s * 1e3, p.efficiency) for p in preds if p.algorithm == algo)
        ranks = [r for r, _, _ in pts]
        label = LABELS.get(algo, algo)
        left.plot(ranks, [c for _, c, _ in pts], marker="o", color=f"C{i}", label=label)
        right.plot(ranks, [e * 100 for _, _, e in pts], marker="o", color=f"C{i}", label=label)
        low = sorted((p.ranks, p.efficiency) for p in bounds if p.algorithm == algo)
        if low:
            right.plot([r for r, _ in low], [e * 100 for _, e in low], linestyle="--", color=f"C{i}",
                       alpha=0.7, label=f"{label}, no overlap")
    ref = HOROVOD_REFERENCE
    right.plot([ref.ranks], [ref.efficiency * 100], marker="*", markersize=16, color="black",
               linestyle="none", label=ref.label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.set_xlabel("ranks")
    left.set(ylabel="all-reduce time per step (ms)", title="predicted communication per step")
    left.set_yscale("log")
    right.set(ylabel="scaling efficiency (%)", title="predicted scaling efficiency", ylim=(0, 105))
    left.legend(fontsize=8)
    right.legend(fontsize=7, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: options whose value may be given negative by mistake: argparse took "-100gbit" for an option and said only
#: "expected one argument" (before 2026-12-07); joined to their option, the value reaches its own check
_SIGNED = ("--link", "--latency", "--intra-link", "--intra-latency", "--reduce-rate")


def _join_negative(argv: Sequence[str]) -> list[str]:
    """``--link -100gbit`` as ``--link=-100gbit``, so the value's own error (naming it and the fix) is given."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        if args[i] in _SIGNED and i + 1 < len(args) and args[i + 1].startswith("-") and len(args[i + 1]) > 1 \
                and not args[i + 1].startswith("--"):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(_join_negative(sys.argv[1:] if argv is None else argv))
    if not 0 < args.backward_share <= 1:
        parser.error(f"--backward-share {args.backward_share}: must be in (0, 1] (the backward's share)")
    if args.compute_ms is not None and not 0 < args.compute_ms < math.inf:
        parser.error(f"--compute-ms {args.compute_ms}: must be finite and > 0")
    if not 0 <= (args.overhead_us or 0.0) < math.inf:
        parser.error(f"--overhead-us {args.overhead_us}: must be finite and >= 0")
    if not 0 <= args.cycle_ms < math.inf:
        parser.error(f"--cycle-ms {args.cycle_ms}: must be finite and >= 0")
    if args.fusion_threshold < 0:
        parser.error(f"--fusion-threshold {args.fusion_threshold}: must be >= 0 (0: no fusion)")
    ignored = [f"--{k.replace('_', '-')}" for k in (*_LINK_DEFAULTS, "reduce_rate")
               if getattr(args, k) is not None]
    if args.calibration is not None and ignored:  # (before 2026-12-07 they were ignored without a word)
        parser.error(f"{', '.join(ignored)} with --calibration: the calibration file gives the links and the "
                     "reduction rate; drop these options, or drop --calibration")
    try:
        if args.png is not None:
            require_matplotlib("--png")  # before the table, not after it
        preds = predict(args)
        cluster = _cluster(args)
    except (ValueError, OSError, ImportError, OverflowError) as exc:
        print(f"perfmodel: error: {exc}", file=sys.stderr)
        return 2
    header = _describe(args, cluster)
    if args.json:
        print(json.dumps({"model": args.model, "notes": header,
                          "predictions": [asdict(p) for p in preds]}, indent=1))
    else:
        print("\n".join(header + [""] + format_table(preds)))
        ref = HOROVOD_REFERENCE
        print(f"\nreference: Horovod's published {ref.efficiency:.0%} at {ref.ranks} GPUs is for "
              f"ResNet-101/Inception V3 on {ref.ranks_per_host} GPUs per host and {ref.link} RoCE; "
              f"compare with --model {ref.model} --ranks-per-host {ref.ranks_per_host} --link {ref.link}")
    if args.png is not None:
        bounds = [] if args.no_overlap else predict(argparse.Namespace(**{**vars(args), "no_overlap": True}))
        title = (f"{args.model}, {args.ranks_per_host} ranks/host, inter-host "
                 f"{_gbytes_per_s(cluster.inter.beta_s_per_byte)} GB/s + {cluster.inter.alpha_s * 1e6:.3g} us, "
                 f"intra {_gbytes_per_s(cluster.intra.beta_s_per_byte)} GB/s; compute "
                 f"{(args.compute_ms or DEFAULT_COMPUTE_S[args.model] * 1e3):g} ms/step")
        try:
            write_png(args.png, preds, title, bounds)
        except OSError as exc:
            print(f"perfmodel: error: could not write {args.png}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        if not args.json:
            print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
