"""Where the time of one gradient step through an adapter goes: both threads of rank 0, by category.

Run it inside one MPI job; every rank runs the same steps::

    unisonrun -np 2 python benchmarks/profile_step.py --json out/profile_torch.json

What it does: builds a set of tensors (``resnet50``: ResNet-50's 161 gradient shapes,
or ``small1000``: 1000 tensors of 1000 floats; the shapes of ``benchmarks/fusion.py``),
then runs ``--steps`` steps of what a hand-written data-parallel loop does through the
chosen API (``--api``): ``torch`` is ``unison.torch_backend.allreduce_async(t, name=...,
op=Sum)`` for every tensor in backward order, then ``synchronize`` on every handle;
``numpy`` is the same calls on numpy arrays through ``unison.allreduce_async``, the
engine's own API, for comparison.

Rank 0 runs Python's deterministic profiler (``cProfile``) on both of its threads during
the timed steps: the caller's thread and the engine's (the script wraps
``Engine._run``; one profiler per thread, since CPython profiles each thread apart).
Each function's own time (``tottime``) is put in one category by where it lives
(:data:`CATEGORIES`); the table gives each category's milliseconds per step on each
thread. A deterministic profiler adds a fixed cost per Python call, so the per-step
total under it is larger than the unprofiled step time (printed beside it, measured in
separate steps): read the table for the shares, not the absolute sum.

The engine thread's ``waiting`` is the time it sleeps or waits on MPI (peers, the
caller's next submission); the caller's ``waiting`` is the time ``synchronize`` blocks.

Outputs: the table on rank 0's stdout; with ``--json``, ``{api, case, np, steps,
step_ms, profiled_step_ms, threads: {caller: {category: ms}, engine: {...}}}``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fusion import case_shapes  # noqa: E402  (the benchmarks' shared shapes)

APIS = ("torch", "numpy")
#: (category, test on (file, function name)); the first that matches wins
CATEGORIES: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("waiting (blocked, asleep)", lambda f, fn: fn in ("<method 'acquire' of '_thread.lock' objects>",
                                                       "<built-in method time.sleep>")),
    ("data transfer (collectives, MPI)", lambda f, fn: "/collectives/" in f or "mpi4py" in fn),
    ("torch calls (tensor <-> array)", lambda f, fn: f == "~" and "torch" in fn),
    ("adapter (unison.torch_backend)", lambda f, fn: "/torch_backend/" in f),
    ("negotiation (controller)", lambda f, fn: f.endswith(("controller.py", "requests.py"))),
    ("fusion copies, execution", lambda f, fn: f.endswith(("executor.py", "pool.py"))
     or fn in ("<built-in method numpy.concatenate>", "<built-in method numpy.copyto>")),
    ("engine loop, queue, locks", lambda f, fn: f.endswith(("engine.py", "stalls.py", "watchdog.py",
                                                            "timeline.py", "threading.py"))
     or "RLock" in fn or "notify" in fn),
    ("frontend, handles", lambda f, fn: f.endswith(("frontend.py", "handles.py", "ops.py"))),
    ("other", lambda f, fn: True),
)


def category(file: str, func: str) -> str:
    """The category of one profiled function (see :data:`CATEGORIES`)."""
    for name, test in CATEGORIES:
        if test(file, func):
            return name
    return "other"


def _label(code: Any) -> tuple[str, str]:
    """(file, function) of a profiler entry's code: ``("~", "<built-in ...>")`` for C functions."""
    if isinstance(code, str):
        return "~", code
    return code.co_filename, code.co_name


def own_times(prof: cProfile.Profile) -> dict[tuple[str, str], float]:
    """Each function's own time so far (seconds); readable while the profiled thread runs."""
    out: dict[tuple[str, str], float] = {}
    for entry in prof.getstats():
        key = _label(entry.code)
        out[key] = out.get(key, 0.0) + entry.inlinetime
    return out


def by_category(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
                steps: int) -> dict[str, float]:
    """Milliseconds per step of each category's own time between two :func:`own_times`."""
    out: dict[str, float] = {}
    for key, t in after.items():
        cat = category(*key)
        out[cat] = out.get(cat, 0.0) + (t - before.get(key, 0.0)) * 1e3 / steps
    return out


def profile_engine_thread() -> cProfile.Profile:
    """Wrap ``Engine._run`` so the engine thread runs under its own profiler from its start (a
    profiler hooks only the thread that enables it); :func:`own_times` reads it meanwhile."""
    from unison.common.engine import engine as engine_mod

    prof = cProfile.Profile()
    original = engine_mod.Engine._run

    def run(self: Any) -> None:
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()

    engine_mod.Engine._run = run  # type: ignore[method-assign]
    return prof


def build_step(api: str, arrays: Sequence[np.ndarray], names: Sequence[str]) -> Callable[[], list]:
    if api == "torch":
        import torch

        import unison.torch_backend as hvd

        ts = [torch.from_numpy(a) for a in arrays]

        def step() -> list:
            hs = [hvd.allreduce_async(t, name=nm, op=hvd.Sum) for t, nm in zip(ts, names, strict=True)]
            return [hvd.synchronize(h) for h in hs]
        return step
    import unison

    def np_step() -> list:
        hs = [unison.allreduce_async(a, op=unison.Sum, name=nm) for a, nm in zip(arrays, names, strict=True)]
        return [unison.synchronize(h) for h in hs]
    return np_step


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Profile one gradient step through an adapter (both threads "
                                            "of rank 0, by category). Run under unisonrun/mpirun.")
    p.add_argument("--api", choices=APIS, default="torch", help="which API submits (default torch)")
    p.add_argument("--case", choices=("resnet50", "small1000"), default="resnet50",
                   help="the tensor set (default resnet50)")
    p.add_argument("--steps", type=int, default=20, help="timed steps, profiled and not (default 20)")
    p.add_argument("--json", type=Path, default=None, help="write the result to this JSON file")
    p.add_argument("--top", type=int, default=0,
                   help="also list each thread's N functions of most own time (default 0: none)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1; got {args.steps}")
    engine_prof = profile_engine_thread()
    from mpi4py import MPI

    import unison

    unison.init()
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    shapes = case_shapes(args.case)
    arrays = [np.full(s, rank + 1, dtype=np.float32) for s in shapes]
    names = [f"{args.case}.{i}" for i in range(len(shapes))]
    step = build_step(args.api, arrays, names)
    for _ in range(5):
        world.Barrier()
        step()
    plain = np.empty(args.steps)
    for i in range(args.steps):
        world.Barrier()
        t0 = time.perf_counter()
        out = step()
        plain[i] = time.perf_counter() - t0
        del out
    world.Allreduce(MPI.IN_PLACE, plain, op=MPI.MAX)
    caller = cProfile.Profile()
    world.Barrier()
    engine_before = own_times(engine_prof)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        caller.enable()
        out = step()
        caller.disable()
        del out
    profiled = (time.perf_counter() - t0) / args.steps
    engine_after = own_times(engine_prof)
    expect = n * (n + 1) / 2
    ok = all(bool((np.asarray(o) == expect).all()) for o in step())
    unison.shutdown()  # the engine thread ends and its profiler stops
    if not all(world.allgather(ok)):
        if rank == 0:
            print("FAILED: a result was wrong on some rank", file=sys.stderr)
        return 1
    if rank != 0:
        return 0
    threads = {"caller": by_category({}, own_times(caller), args.steps),
               "engine": by_category(engine_before, engine_after, args.steps)}
    step_ms = float(np.median(plain)) * 1e3
    print(f"{args.api} {args.case}, np={n}: step {step_ms:.2f} ms (median of {args.steps}, unprofiled); "
          f"{profiled * 1e3:.2f} ms per step under the profiler")
    cats = [c for c, _ in CATEGORIES]
    print(f"{'category':<34}{'caller ms':>11}{'engine ms':>11}")
    for c in cats:
        a, b = threads["caller"].get(c, 0.0), threads["engine"].get(c, 0.0)
        if a >= 0.005 or b >= 0.005:
            print(f"{c:<34}{a:>11.2f}{b:>11.2f}")
    print(f"{'total':<34}{sum(threads['caller'].values()):>11.2f}{sum(threads['engine'].values()):>11.2f}")
    for label, before, after in (("caller", {}, own_times(caller)), ("engine", engine_before, engine_after)):
        rows = sorted(((t - before.get(k, 0.0), k) for k, t in after.items()), reverse=True)[:args.top]
        for t, (file, func) in rows:
            print(f"  {label} {t * 1e3 / args.steps:8.2f} ms  [{category(file, func)}] {Path(file).name} {func}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"api": args.api, "case": args.case, "np": n, "steps": args.steps,
                                         "step_ms": step_ms, "profiled_step_ms": profiled * 1e3,
                                         "threads": threads}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
