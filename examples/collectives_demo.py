"""Collectives demo: every collective on a few ranks, checked against numpy.

Run with ``unisonrun -np 2 python examples/collectives_demo.py``.
Each rank builds its own data and checks every result against numpy's, computed from all
ranks' inputs; rank 0 prints what it got and ``ok=True`` only where every rank's result matched.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import unison


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=64.0,
                        help="size of the large all-reduce in MiB (default 64)")
    args = parser.parse_args()

    unison.init()
    rank, size = unison.rank(), unison.size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"unison {unison.__version__}: {size} rank(s), {unison.local_size()} on this host")

    mine = np.arange(4, dtype=np.float32) + 10 * rank
    everyone = [np.arange(4, dtype=np.float32) + 10 * r for r in range(size)]

    def ok(match: bool) -> bool:  # every rank's check, not rank 0's alone
        return bool(unison.allreduce(np.array([int(match)]), op=unison.Min)[0])

    total = unison.allreduce(mine, op=unison.Sum)
    say(f"allreduce(Sum)      -> {total}   ok={ok(np.array_equal(total, sum(everyone)))}")
    avg = unison.allreduce(mine)  # Average is the default, as in Horovod
    say(f"allreduce(Average)  -> {avg}   ok={ok(np.allclose(avg, sum(everyone) / size))}")
    gathered = unison.allgather(np.full((rank + 1, 2), rank, dtype=np.int32))
    want = np.concatenate([np.full((r + 1, 2), r, dtype=np.int32) for r in range(size)])
    say(f"allgather (rank r sends r+1 rows) -> rows {gathered[:, 0].tolist()}   "
        f"ok={ok(np.array_equal(gathered, want))}")
    root = size - 1
    b = unison.broadcast(mine, root_rank=root)
    say(f"broadcast from rank {root} -> {b}   ok={ok(np.array_equal(b, everyone[root]))}")
    part = unison.reducescatter(np.ones((2 * size, 3), dtype=np.float64), op=unison.Sum)
    say(f"reducescatter       -> rank 0 got rows of shape {part.shape}, values {part[0].tolist()}   "
        f"ok={ok(np.array_equal(part, np.full((2, 3), float(size))))}")
    received, splits = unison.alltoall(np.arange(size, dtype=np.int64) + 100 * rank)
    want = np.array([rank + 100 * r for r in range(size)], dtype=np.int64)  # rank r's element number `rank`
    say(f"alltoall            -> rank 0 received {received.tolist()} (splits {splits.tolist()})   "
        f"ok={ok(np.array_equal(received, want) and splits.tolist() == [1] * size)}")

    big = np.ones(int(args.size_mb * (1 << 20)) // 4, dtype=np.float32)
    unison.barrier()
    start = time.perf_counter()
    out = unison.allreduce(big, op=unison.Sum)
    elapsed = unison.allreduce(np.array([time.perf_counter() - start]), op=unison.Max)[0]  # the slowest rank's
    busbw = big.nbytes / elapsed * 2 * (size - 1) / max(size, 1) / 1e9
    say(f"allreduce of {big.nbytes / 2**20:.0f} MiB: {elapsed * 1e3:.1f} ms, "
        f"busbw {busbw:.2f} GB/s, ok={ok(bool(np.all(out == size)))}")
    unison.shutdown()


if __name__ == "__main__":
    main()
