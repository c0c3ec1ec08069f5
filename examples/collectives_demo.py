"""Collectives demo: every collective on a few ranks, checked against numpy.

Run with ``unisonrun -np 2 python examples/collectives_demo.py``.
Each rank builds its own data; rank 0 prints what every collective returned and
whether it matches the numpy result computed from all ranks' inputs.
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

    total = unison.allreduce(mine, op=unison.Sum)
    say(f"allreduce(Sum)      -> {total}   ok={np.array_equal(total, sum(everyone))}")
    avg = unison.allreduce(mine)  # Average is the default, as in Horovod
    say(f"allreduce(Average)  -> {avg}   ok={np.allclose(avg, sum(everyone) / size)}")
    gathered = unison.allgather(np.full((rank + 1, 2), rank, dtype=np.int32))
    say(f"allgather (rank r sends r+1 rows) -> rows {gathered[:, 0].tolist()}")
    root = size - 1
    b = unison.broadcast(mine, root_rank=root)
    say(f"broadcast from rank {root} -> {b}   ok={np.array_equal(b, everyone[root])}")
    part = unison.reducescatter(np.ones((2 * size, 3), dtype=np.float64), op=unison.Sum)
    say(f"reducescatter       -> rank 0 got rows of shape {part.shape}, values {part[0].tolist()}")
    received, splits = unison.alltoall(np.arange(size, dtype=np.int64) + 100 * rank)
    say(f"alltoall            -> rank 0 received {received.tolist()} (splits {splits.tolist()})")

    big = np.ones(int(args.size_mb * (1 << 20)) // 4, dtype=np.float32)
    unison.barrier()
    start = time.perf_counter()
    out = unison.allreduce(big, op=unison.Sum)
    elapsed = time.perf_counter() - start
    busbw = big.nbytes / elapsed * 2 * (size - 1) / max(size, 1) / 1e9
    say(f"allreduce of {big.nbytes / 2**20:.0f} MiB: {elapsed * 1e3:.1f} ms, "
        f"busbw {busbw:.2f} GB/s, ok={bool(np.all(out == size))}")
    unison.shutdown()


if __name__ == "__main__":
    main()
