"""The table, target lines and plot of ``benchmarks/zero.py`` (records in, text and PNG out)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchutil import atomic_write, ratio_target

MIB = 1 << 20
FORMULA_TOLERANCE = 0.10
#: (framework, numerator stage, minimum samples/s ratio to stage 0)
SPEED_TARGETS = (("torch", 1, 0.9), ("torch", 2, 0.9), ("torch", 3, 0.7), ("keras", 1, 0.9), ("keras", 2, 0.9))
ANCHOR_RATIO = 1.25
#: relative difference of the last loss from stage 0's that the loss check accepts
LOSS_RTOL = 1e-4
LABELS = {"stage0": "stage 0", "stage1": "stage 1", "stage2": "stage 2", "stage3": "stage 3",
          "torch-zero": "ZeroRedundancyOptimizer"}


def status(rec: Any) -> str:
    """Why a configuration has no numbers: the library cannot build it yet, or its launch failed."""
    return "FAILED" if rec.error.startswith("launch") else "not available"


def label(rec: Any) -> str:
    return f"{rec.framework} {LABELS[rec.impl]}"


def mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def print_table(records: Sequence[Any]) -> None:
    """One row per measured configuration (bytes per rank, MiB); then what was not available."""
    if not records:
        return
    print(f"\n{'np':>3} {'configuration':<31}{'weights':>9}{'grads':>9}{'optim':>9}{'state':>9}"
          f"{'formula':>9}{'st/form':>8}{'work':>7}{'peak RSS':>10}{'samples/s':>11}{'loss':>9}")
    print(f"{'':>3} {'(MiB per rank; state = the rank furthest from the formula)':<60}")
    for r in records:
        if r.error:
            continue
        ratio = r.state_bytes / r.formula_bytes if r.formula_bytes else float("nan")
        print(f"{r.np:>3} {label(r):<31}{mib(r.weights_bytes):>9}{mib(r.grads_bytes):>9}"
              f"{mib(r.optimizer_bytes):>9}{mib(r.state_bytes):>9}{mib(r.formula_bytes):>9}{ratio:>8.3f}"
              f"{mib(r.working_bytes):>7}{mib(r.peak_rss_bytes):>10}{r.samples_per_s:>11.1f}{r.loss:>9.4f}")
    for r in records:
        if r.error:
            print(f"np {r.np} {label(r)}: {status(r)} ({r.error.splitlines()[0][:300]})")
    print_loss_check(records)
    if any(r.framework == "keras" for r in records):
        print("keras: gradients live only inside a step (no variables to count): its formula uses 0 gradient "
              "bytes (12 B/param at stage 0, 4+8/N at stages 1 and 2)")
    if any(r.impl == "torch-zero" and not r.error for r in records):
        print("torch ZeroRedundancyOptimizer: formula of stage 1; DDP's gradient buckets are not counted "
              "(held by its reducer, not by parameters or optimizer)")


def print_loss_check(records: Sequence[Any]) -> None:
    """Every configuration trains the same model on the same data: its last loss should equal stage 0's."""
    for n, fw in dict.fromkeys((r.np, r.framework) for r in records):
        done = [r for r in records if (r.np, r.framework) == (n, fw) and not r.error]
        base = next((r.loss for r in done if r.impl == "stage0"), None)
        if base is None or len(done) < 2:
            continue
        off = [f"{LABELS[r.impl]} {r.loss:.6g}" for r in done if abs(r.loss - base) > LOSS_RTOL * abs(base)]
        print(f"loss check np {n} {fw}: " + (f"every configuration's last loss equals stage 0's ({base:.6g}) "
                                             f"within {LOSS_RTOL:g}" if not off else
                                             f"DIFFERS from stage 0's {base:.6g}: {', '.join(off)}"))


def print_cap(caps: Sequence[Any]) -> None:
    if not caps:
        return
    print(f"\nmemory cap: {caps[0].cap_bytes / MIB:.0f} MiB per rank (a memory cgroup each), np {caps[0].np}, "
          "torch")
    for c in caps:
        print(f"  {LABELS[c.impl]:<8} {c.params:>12,} parameters: {c.outcome:<13} (expected {c.expected}; "
              f"OOM kills {c.oom_kills}, cgroup peak {mib(c.peak_cgroup_bytes)} MiB)"
              + (f"  {c.detail.splitlines()[-1][:200]}" if c.detail and c.outcome != "trained" else ""))


def formula_line(r: Any) -> str:
    what = f"np {r.np} {label(r)}: state bytes / (formula + declared working)"
    if r.error:
        return f"  {what} = n/a   {status(r)}"
    ratio = r.state_bytes / r.formula_bytes
    verdict = "PASS" if abs(ratio - 1) <= FORMULA_TOLERANCE else "MISS"
    return f"  {what} = {ratio:.3f}  (target 1 +- {FORMULA_TOLERANCE})  {verdict}"


def speed(records: Sequence[Any], n: int, fw: str, impl: str) -> float | None:
    hit = [r.samples_per_s for r in records if (r.np, r.framework, r.impl) == (n, fw, impl) and not r.error]
    return hit[0] if hit else None


def print_targets(records: Sequence[Any], caps: Sequence[Any]) -> None:
    print("\ntargets")
    for r in records:
        if r.impl != "torch-zero":
            print(formula_line(r))
    for n in sorted({r.np for r in records}):
        for fw, stage, minimum in SPEED_TARGETS:
            if any(r.framework == fw and r.np == n for r in records):
                mine, base = speed(records, n, fw, f"stage{stage}"), speed(records, n, fw, "stage0")
                print(ratio_target(f"np {n} {fw} samples/s stage {stage} / stage 0", mine, base, minimum))
        if any(r.framework == "torch" and r.np == n for r in records):
            print(ratio_target(f"np {n} torch samples/s stage 1 / ZeroRedundancyOptimizer",
                               speed(records, n, "torch", "stage1"), speed(records, n, "torch", "torch-zero"),
                               ANCHOR_RATIO))
    if caps:
        print_cap_target(caps)


def print_cap_target(caps: Sequence[Any]) -> None:
    control, big0, big3 = caps
    what = (f"np {big0.np} under {big0.cap_bytes / MIB:.0f} MiB per rank: stage 0 trains {control.params:,} "
            f"(control) and is killed at {big0.params:,}, stage 3 trains {big3.params:,}")
    got = f"{control.outcome} / {big0.outcome} / {big3.outcome}"
    if any(c.outcome in ("unavailable", "not available") for c in caps):
        print(f"  {what} = n/a   ({got})")
        return
    ok = all(c.outcome == c.expected for c in caps)
    print(f"  {what} = {got}  (target trained / killed / trained)  {'PASS' if ok else 'MISS'}")


def write_png(path: Path, records: Sequence[Any]) -> None:
    """A column per np. Top: stacked bars of weights, grads, optimizer state per configuration,
    with the formula (+ declared working buffers) as a black tick. Bottom: peak RSS per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nps = sorted({r.np for r in records})
    fig, axes = plt.subplots(2, len(nps), figsize=(6.5 * len(nps), 7.5), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [3, 1.4]})
    for col, n in enumerate(nps):
        rows = [r for r in records if r.np == n]
        _state_panel(axes[0][col], rows, legend=col == 0)
        _rss_panel(axes[1][col], rows)
        params = rows[0].params if rows else 0
        axes[0][col].set_title(f"np {n}: bytes per rank, {params / 1e6:.1f}M parameters, Adam")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def _state_panel(ax: Any, rows: Sequence[Any], legend: bool) -> None:
    xs = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part, color in (("weights", "C0"), ("grads", "C1"), ("optimizer", "C2")):
        vals = [getattr(r, f"{part}_bytes") / MIB for r in rows]
        ax.bar(xs, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    tick_label: str | None = "formula + working"
    for x, r in zip(xs, rows, strict=True):
        if r.error:
            ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=8)
            continue
        ax.hlines(r.formula_bytes / MIB, x - 0.42, x + 0.42, color="black", linewidth=2, label=tick_label)
        tick_label = None  # one legend entry
    ax.set_ylabel("state MiB per rank")
    ax.grid(axis="y", alpha=0.3)
    if legend:
        ax.legend(fontsize=8)


def _rss_panel(ax: Any, rows: Sequence[Any]) -> None:
    xs = list(range(len(rows)))
    ax.bar(xs, [r.peak_rss_bytes / MIB for r in rows], color="C7")
    ax.set_ylabel("peak RSS MiB")
    ax.grid(axis="y", alpha=0.3)
    ax.set_xticks(xs, [label(r).replace(" stage ", "\nstage ").replace("ZeroRedundancy", "ZeroRed.\n")
                       for r in rows], fontsize=7)
