"""Record an engine timeline and draw it: what docs/engine.md shows.

Run with ``unisonrun -np 2 python examples/timeline_demo.py --out timeline.json``.
Each rank submits a few gradient-like tensors per step in its own order (rank 1
lags, as a slower rank would); rank 0 writes the Chrome-trace JSON (open it in
https://ui.perfetto.dev or chrome://tracing) and draws it to a PNG with matplotlib.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np

import unison

COLORS = {"NEGOTIATE_ALLREDUCE": "#9ecae1", "QUEUE": "#fdd0a2", "MEMCPY_IN_FUSION_BUFFER": "#a1d99b",
          "ALLREDUCE": "#fb6a4a", "MEMCPY_OUT_FUSION_BUFFER": "#bcbddc"}


def draw(trace: Path, png: Path) -> None:
    """Render a Unison Chrome trace: one row per tensor, one colour per phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = json.loads(trace.read_text())
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    opened: dict[tuple[int, str], float] = {}
    bars = []
    marks = []
    for e in events:
        if e["ph"] == "B":
            opened[(e["tid"], e["name"])] = e["ts"]
        elif e["ph"] == "E":
            start = opened.pop((e["tid"], e["name"]))
            bars.append((e["tid"], e["name"], start, e["ts"]))
        elif e["ph"] == "i":
            marks.append((e["tid"], e["ts"], e["name"]))
    t0 = min(b[2] for b in bars)
    order = sorted(rows, key=lambda tid: rows[tid])
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(order) + 1.5))
    for tid, phase, start, end in bars:
        ax.barh(order.index(tid), (end - start) / 1e3, left=(start - t0) / 1e3, height=0.6,
                color=COLORS.get(phase, "grey"), edgecolor="none")
    for tid, ts, _label in marks:
        ax.plot((ts - t0) / 1e3, order.index(tid), marker="|", color="black", markersize=9)
    ax.set_yticks(range(len(order)), [rows[t] for t in order])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("Unison engine timeline (rank 0): | marks a rank becoming ready")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, COLORS.keys(), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(png)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("timeline.json"),
                        help="trace path, written by rank 0 (default: timeline.json in the current folder)")
    parser.add_argument("--png", type=Path, default=None, help="picture path (default: OUT with .png)")
    parser.add_argument("--steps", type=int, default=3, help="training-like steps to record (default 3)")
    args = parser.parse_args()
    unison.init()
    rank = unison.rank()
    out = str(args.out.resolve())
    unison.start_timeline(out)
    sizes = [64, 100_000, 2_000, 500_000, 10]
    for step in range(args.steps):
        names = [f"grad/{i}" for i in range(len(sizes))]
        random.Random(step * 10 + rank).shuffle(names)
        handles = []
        for name in names:
            if rank == 1:
                time.sleep(0.002)  # a slower rank: the others' NEGOTIATE phase waits for it
            handles.append(unison.allreduce_async(np.ones(sizes[int(name.split("/")[1])], np.float32),
                                                  name=name))
        for h in handles:
            unison.synchronize(h)
    unison.stop_timeline()
    unison.barrier()
    if rank == 0:
        png = args.png or args.out.with_suffix(".png")
        draw(args.out, png)
        print(f"wrote {args.out} and {png}")
    unison.shutdown()


if __name__ == "__main__":
    main()
