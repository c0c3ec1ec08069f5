"""What losing a rank costs: Unison's in-place recovery and its restart tier against torchrun's restart.

    python benchmarks/elastic.py --json elastic.json --png docs/benchmarks/elastic_timeline.png

Runs ``benchmarks/elastic_worker.py`` once per impl on 3 local ranks, the same model (the torch
benchmark MLP, ~20M parameters), batch and schedule: a commit every ``--commit-every`` steps,
rank 2 SIGKILLed before step ``--kill-at``.

* ``unison-inplace``: ``unisonrun -np 3 --elastic`` (mpirun with ULFM); ``hvd.elastic.run``
  with a ``TorchState`` committed in memory; the 2 survivors shrink and go on.
* ``torchrun`` (the anchor): ``torch.distributed.run --standalone --nproc-per-node=3
  --max-restarts=3 --monitor-interval=0.1``, gloo, DDP, a checkpoint file at every commit;
  torchrun stops the survivors and starts 3 new workers, which load the checkpoint.
* ``unison-restart``: ``unisonrun -np 3 --elastic-mode restart`` (no ULFM): every commit is also
  written to each host's disk in the background; the kill ends the MPI job; ``unisonrun``'s
  driver starts a new one on 3 ranks, which resumes from the newest commit on disk.
* ``unison-grow`` (no one dies): ``unisonrun --host-discovery-script`` on a script that prints
  ``localhost:2``; before step ``--kill-at`` rank 0 makes it print ``localhost:3``. The driver
  sees the change (polled every 0.2 s), the next commit stops the job and the driver starts it
  on 3 ranks from that commit: growth through a restart. Measured, with no target: the time from
  the new host list to the first step on 3 ranks, and the restart inside it (the old job's last
  step to the new job's first).

Measured from the workers' event logs (wall-clock times of every step on every process):
recovery = seconds from the kill to the next completed step; steps lost = the kill's step minus
the step training resumed from; samples/s before the kill and after recovery; a commit's cost
as a fraction of the step time at one commit per ``--commit-every`` steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchutil import atomic_write, shown, write_json

logger = logging.getLogger("benchmarks.elastic")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "elastic_worker.py"
RECOVERY_RATIO, COMMIT_FRACTION = 0.1, 0.05
WARMUP_STEPS = 3


@dataclass
class Record:
    impl: str
    np_start: int
    np_after: int
    kill_step: int
    resumed_from: int
    steps_lost: int
    recovery_s: float
    samples_per_s_before: float
    samples_per_s_after: float
    step_s_before: float
    commit_s: float
    commit_fraction: float
    wall_s: float
    exit_status: int
    #: unison-grow: seconds from the old job's last step to the new job's first (the restart inside the growth)
    restart_s: float = float("nan")


def _events(out: Path, mode: str) -> list[dict[str, Any]]:
    events = []
    for path in sorted(out.glob(f"{mode}-*.jsonl")):
        pid = int(path.stem.rsplit("-", 1)[1])
        for line in path.read_text().splitlines():
            if line.strip():
                events.append({**json.loads(line), "pid": pid})
    return sorted(events, key=lambda e: e["t"])


def _finish_times(steps: list[dict[str, Any]]) -> dict[int, float]:
    """Each step index's completion: the last process to finish it."""
    done: dict[int, float] = {}
    for e in steps:
        done[e["step"]] = max(done.get(e["step"], 0.0), e["t"])
    return done


def _rate(done: dict[int, float], first: int, last: int, samples_per_step: int) -> tuple[float, float]:
    """(samples/s, seconds per step) over steps ``first..last`` (completion times)."""
    if last <= first:
        return float("nan"), float("nan")
    seconds = done[last] - done[first]
    return samples_per_step * (last - first) / seconds, seconds / (last - first)


def analyse(impl: str, events: list[dict[str, Any]], args: argparse.Namespace, wall: float,
            status: int) -> Record:
    """The record of one run, from its event log.

    Raises:
        RuntimeError: the log has no kill, or no step completed after it (the job did not recover).
    """
    kills = [e for e in events if e["event"] == "kill"]
    if not kills:
        raise RuntimeError(f"{impl}: no rank logged its kill; see the run's output above")
    t_kill, kill_step = kills[0]["t"], kills[0]["step"]
    steps = [e for e in events if e["event"] == "step"]
    before = [e for e in steps if e["t"] < t_kill]
    # after the recovery: the shrunk world's steps, or those of processes started after the kill
    # (a survivor can still finish a step of the old world just after the victim died)
    restarted = {e["pid"] for e in events if e["event"] == "start" and e["t"] > t_kill}
    after = [e for e in steps if e["t"] > t_kill and (e["size"] != args.np or e["pid"] in restarted)]
    if not after:
        raise RuntimeError(f"{impl}: no step completed after the kill (exit status {status})")
    first_after = min(after, key=lambda e: e["t"])
    resumed_from = first_after["step"] - 1
    np_after = first_after["size"]
    done_before = _finish_times(before)
    rate_before, step_before = _rate(done_before, WARMUP_STEPS, max(done_before), args.np * args.batch)
    after_recovered = [e for e in after if e["step"] > first_after["step"]]
    done_after = _finish_times(after_recovered)
    rate_after, _ = (_rate(done_after, min(done_after), max(done_after), np_after * args.batch)
                     if done_after else (float("nan"), 0.0))
    commits = [e["seconds"] for e in events if e["event"] == "commit" and e["t"] < t_kill]
    commit_s = sum(commits) / len(commits) if commits else float("nan")
    return Record(impl, args.np, np_after, kill_step, resumed_from, kill_step - resumed_from,
                  first_after["t"] - t_kill, rate_before, rate_after, step_before, commit_s,
                  commit_s / (args.commit_every * step_before), wall, status)


def analyse_grow(impl: str, events: list[dict[str, Any]], args: argparse.Namespace, wall: float,
                 status: int) -> Record:
    """The record of a growth: ``recovery_s`` is the time from the new host list to the first step on
    the grown job; ``steps_lost`` the steps the grown job redid (0 when it resumes from the commit that
    stopped the old one).

    Raises:
        RuntimeError: no rank logged the change, or no step ran on the grown job.
    """
    changes = [e for e in events if e["event"] == "grow"]
    if not changes:
        raise RuntimeError(f"{impl}: rank 0 logged no host change; see the run's output above")
    t_change, change_step = changes[0]["t"], changes[0]["step"]
    steps = [e for e in events if e["event"] == "step"]
    restarted = {e["pid"] for e in events if e["event"] == "start" and e["t"] > t_change}
    old = [e for e in steps if e["pid"] not in restarted]
    new = [e for e in steps if e["pid"] in restarted]
    if not new:
        raise RuntimeError(f"{impl}: no step ran on the grown job (exit status {status})")
    last_old = max(old, key=lambda e: e["t"])
    first_new = min(new, key=lambda e: e["t"])
    resumed_from = first_new["step"] - 1
    done_before = _finish_times([e for e in old if e["t"] < t_change])
    rate_before, step_before = _rate(done_before, WARMUP_STEPS, max(done_before), (args.np - 1) * args.batch)
    done_after = _finish_times([e for e in new if e["step"] > first_new["step"]])
    rate_after, _ = (_rate(done_after, min(done_after), max(done_after), first_new["size"] * args.batch)
                     if done_after else (float("nan"), 0.0))
    commits = [e["seconds"] for e in events if e["event"] == "commit" and e["t"] < t_change]
    commit_s = sum(commits) / len(commits) if commits else float("nan")
    return Record(impl, args.np - 1, first_new["size"], change_step, resumed_from,
                  max(e["step"] for e in old) - resumed_from, first_new["t"] - t_change, rate_before, rate_after,
                  step_before, commit_s, commit_s / (args.commit_every * step_before), wall, status,
                  restart_s=first_new["t"] - last_old["t"])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=f"{HERE.parent}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def _worker_args(mode: str, out: Path, args: argparse.Namespace, grow: Path | None = None) -> list[str]:
    world = args.np - 1 if grow is not None else args.np
    extra = ["--grow-file", str(grow)] if grow is not None else []
    return [str(WORKER), mode, str(out), "--steps", str(args.steps), "--commit-every", str(args.commit_every),
            "--kill-at", str(args.kill_at), "--world", str(world), "--batch", str(args.batch), *extra]


IMPLS = ("unison-inplace", "unison-restart", "torchrun", "unison-grow")


def _mode(impl: str) -> str:
    return "torchrun" if impl == "torchrun" else "unison"


def command(impl: str, out: Path, args: argparse.Namespace) -> list[str]:
    if impl == "unison-grow":  # a discovery script whose output rank 0 changes from np - 1 slots to np
        hosts, script = out / "hosts.txt", out / "discover.sh"
        hosts.write_text(f"localhost:{args.np - 1}\n")
        script.write_text(f"#!/bin/sh\ncat {hosts}\n")
        script.chmod(0o755)
        return [sys.executable, "-m", "unison.run", "--host-discovery-script", str(script), "--discovery-interval",
                "0.2", "--min-np", str(args.np - 1), "--skip-host-check", sys.executable,
                *_worker_args("unison", out, args, grow=hosts)]
    if impl.startswith("unison"):
        tier = "--elastic-mode=inplace" if impl == "unison-inplace" else "--elastic-mode=restart"
        return [sys.executable, "-m", "unison.run", "-np", str(args.np), tier, sys.executable,
                *_worker_args("unison", out, args)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.np}",
            "--max-restarts=3", "--monitor-interval=0.1", *_worker_args("torchrun", out, args)]


def run_impl(impl: str, args: argparse.Namespace, scratch: Path) -> Record | None:
    import time

    out = scratch / impl
    out.mkdir()
    begin = time.monotonic()
    try:
        proc = subprocess.run(command(impl, out, args), env=_env(), capture_output=True, text=True,
                              timeout=args.timeout)
        status, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        status, output = 124, f"timed out after {args.timeout} s: {exc}"
    wall = time.monotonic() - begin
    try:
        return (analyse_grow if impl == "unison-grow" else analyse)(impl, _events(out, _mode(impl)), args, wall,
                                                                     status)
    except RuntimeError as error:
        print(f"{impl} FAILED: {error}\n{output[-3000:]}", flush=True)
        return None
    finally:
        if args.keep_logs:
            shutil.copytree(out, args.keep_logs / impl, dirs_exist_ok=True)


def print_table(records: list[Record]) -> None:
    print(f"{'impl':<16}{'np':>7}{'recovery s':>12}{'lost':>6}{'samples/s before':>18}{'after':>9}"
          f"{'step ms':>9}{'commit ms':>11}{'commit %':>10}{'wall s':>8}")
    for r in records:
        print(f"{r.impl:<16}{f'{r.np_start}->{r.np_after}':>7}{r.recovery_s:>12.3f}{r.steps_lost:>6}"
              f"{r.samples_per_s_before:>18.1f}{r.samples_per_s_after:>9.1f}{r.step_s_before * 1e3:>9.1f}"
              f"{r.commit_s * 1e3:>11.2f}{r.commit_fraction * 100:>9.2f}%{r.wall_s:>8.1f}")


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def target_lines(records: list[Record], args: argparse.Namespace) -> list[str]:
    by = {r.impl: r for r in records}
    mine, theirs = by.get("unison-inplace"), by.get("torchrun")
    lines = ["targets:"]
    if mine and theirs:
        ratio = mine.recovery_s / theirs.recovery_s
        text = shown(ratio, ratio <= RECOVERY_RATIO, RECOVERY_RATIO, False, 3)
        lines.append(f"  in-place recovery / torchrun recovery = {mine.recovery_s:.3f} s / "
                     f"{theirs.recovery_s:.3f} s = {text}  "
                     f"(target <= {RECOVERY_RATIO})  "
                     f"{_verdict(ratio <= RECOVERY_RATIO)}")
    else:
        lines.append("  in-place recovery / torchrun recovery = n/a (a run failed or was not asked for)  MISS")
    restart = by.get("unison-restart")
    if restart and theirs:
        ratio = restart.recovery_s / theirs.recovery_s
        lines.append(f"  restart-tier recovery / torchrun recovery = {restart.recovery_s:.3f} s / "
                     f"{theirs.recovery_s:.3f} s = {shown(ratio, ratio <= 1.0, 1.0, False, 3)}  (target <= 1.0)  "
                     f"{_verdict(ratio <= 1.0)}")
        lines.append(f"  restart-tier work lost = {restart.steps_lost} steps  (target <= one commit interval, "
                     f"{args.commit_every})  {_verdict(restart.steps_lost <= args.commit_every)}")
        lines.append(f"  restart-tier commit overhead = {restart.commit_fraction * 100:.2f}% of step time "
                     f"(commits also written to disk)  (target <= {COMMIT_FRACTION * 100:.0f}%)  "
                     f"{_verdict(restart.commit_fraction <= COMMIT_FRACTION)}")
    else:
        lines.append("  restart-tier recovery / torchrun recovery = n/a (a run failed or was not asked for)  MISS")
    if mine:
        lines.append(f"  unison work lost = {mine.steps_lost} steps  (target <= one commit interval, "
                     f"{args.commit_every})  {_verdict(mine.steps_lost <= args.commit_every)}")
        lines.append(f"  unison commit overhead = {mine.commit_fraction * 100:.2f}% of step time at one commit "
                     f"per {args.commit_every} steps  (target <= {COMMIT_FRACTION * 100:.0f}%)  "
                     f"{_verdict(mine.commit_fraction <= COMMIT_FRACTION)}")
    grow = by.get("unison-grow")
    if grow:
        lines.append(f"measured (no target): growth {grow.np_start}->{grow.np_after} ranks: new host list -> "
                     f"first step on {grow.np_after} ranks {grow.recovery_s:.3f} s, of which the old job's last "
                     f"step -> the new job's first {grow.restart_s:.3f} s; {grow.steps_lost} steps redone")
    return lines


def write_png(path: Path, scratch: Path, records: list[Record]) -> None:
    """One panel per impl: a lane per process, a dot per completed step, the kill in red and the
    recovery (kill to next completed step) shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(records), 1, figsize=(11, 2.2 + 1.1 * len(records)), squeeze=False)
    for ax, rec in zip(axes[:, 0], records, strict=True):
        events = _events(scratch / rec.impl, _mode(rec.impl))
        t0 = min(e["t"] for e in events)
        lanes: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for e in events:
            lanes[e["pid"]].append(e)
        order = sorted(lanes, key=lambda pid: lanes[pid][0]["t"])
        for lane, pid in enumerate(order):
            evs = lanes[pid]
            start = next((e for e in evs if e["event"] == "start"), evs[0])
            attempt = f", attempt {start['attempt']}" if "attempt" in start else ""
            label = f"rank {start.get('rank', '?')}{attempt}"
            xs = [e["t"] - t0 for e in evs if e["event"] == "step"]
            ax.plot(xs, [lane] * len(xs), "|", ms=9, color="tab:blue")
            ax.plot([start["t"] - t0], [lane], ">", color="gray")
            ax.text(-0.01, lane, label, transform=ax.get_yaxis_transform(), ha="right", va="center", fontsize=8)
        kill = next(e for e in events if e["event"] in ("kill", "grow"))
        ax.axvline(kill["t"] - t0, color="red" if kill["event"] == "kill" else "green", lw=1.5)
        ax.axvspan(kill["t"] - t0, kill["t"] - t0 + rec.recovery_s, color="orange", alpha=0.3)
        ax.set_yticks([])
        ax.set_ylim(-0.7, len(order) - 0.3)
        what = "kill (red)" if kill["event"] == "kill" else "new host list (green)"
        ax.set_title(f"{rec.impl}: {what} -> next step {rec.recovery_s:.2f} s (shaded), "
                     f"{rec.steps_lost} steps redone, {rec.np_start} -> {rec.np_after} ranks", fontsize=10)
    axes[-1, 0].set_xlabel("seconds since the first event (| = a completed step, > = process ready)")
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110), "wb")
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impls", default=",".join(IMPLS),
                        help=f"comma list of {', '.join(IMPLS)} (default: all)")
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--commit-every", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--png", type=Path, help="write the timeline picture here")
    parser.add_argument("--keep-logs", type=Path, help="copy the workers' event logs here")
    args = parser.parse_args(argv)
    impls = [s for s in args.impls.split(",") if s]
    bad = [s for s in impls if s not in IMPLS]
    if bad or not impls:
        parser.error(f"--impls {args.impls!r}: choose from {', '.join(IMPLS)}")
    if not 0 < args.kill_at < args.steps or args.commit_every < 1 or args.np < 2:
        parser.error(f"need 0 < --kill-at ({args.kill_at}) < --steps ({args.steps}), --commit-every >= 1 "
                     f"and --np >= 2 (got {args.commit_every}, {args.np})")
    args.impls = impls
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    scratch = Path(tempfile.mkdtemp(prefix="unison-elastic-"))
    try:
        records = []
        for impl in args.impls:
            print(f"running {impl} ...", flush=True)
            rec = run_impl(impl, args, scratch)
            if rec is not None:
                records.append(rec)
        print_table(records)
        for line in target_lines(records, args):
            print(line)
        if args.json:
            write_json(args.json, records)
        if args.png and records:
            write_png(args.png, scratch, records)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0 if len(records) == len(args.impls) else 1


if __name__ == "__main__":
    sys.exit(main())
