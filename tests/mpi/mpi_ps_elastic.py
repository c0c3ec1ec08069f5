"""A sharded table through a rank's death in elastic mode; run by tests/test_ps_mpi.py.

    python mpi_ps_elastic.py OUT_DIR MODE    (bsp, ssp, bsp-async, ssp-async, bsp-dedicated or ssp-dedicated)

Three ranks (every rank a worker and a server) train a table with the elastic ``run`` wrapper
(framework-neutral: ``unison.common.elastic``), saving the table and committing every
``COMMIT_EVERY`` steps. At step ``KILL_AT`` the last rank SIGKILLs itself at the top of the step;
in the ``-async`` modes, where each step's push is a ``push_async`` waited after the next step's
pull (as ``ShardedEmbedding`` does), it dies at step ``KILL_AT - 1``, right after a commit, between
its pull and its push: the survivors' queued push meets the failure, and their next pull must raise
it too. The survivors' next table operation (or
handle, or the engine's operation) meets the failure; the wrapper rolls back to the last commit,
shrinks to two ranks and calls the reset callback, which creates the table again and loads the
checkpoint of that commit ([Note: a table that loses a rank] in unison/common/ps/failure.py).
In ``bsp-dedicated`` and ``ssp-dedicated`` rank 0 is a dedicated server: it spends the training in
``serve()``, commits in its ``on_save`` (taking the workers' step from the save's metadata) and answers
their ``load()`` in the reset callback with its own ``load()`` ([Note: dedicated servers in elastic mode] in
unison/common/ps/table.py); the last rank, a worker, dies at the top of step ``KILL_AT``.
Each survivor writes ``OUT_DIR/rank<r>.json``: the final table, its world size, its resets, and
the time its first operation after the kill raised.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time

import numpy as np

from unison.common import elastic, runtime
from unison.common.ps import SGD, SSP, ShardedTable

ROWS, DIM, STEPS, COMMIT_EVERY, KILL_AT = 24, 2, 8, 2, 5


def batch(step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s keys (duplicates included) and gradient rows at ``step``: small integers, exact sums."""
    keys = np.array([(step * 7 + rank * 5 + j * 3) % ROWS for j in range(5)] + [rank % ROWS], np.int64)
    grads = np.full((len(keys), DIM), float(rank + 1)) + np.arange(DIM)
    return keys, grads


def main(out: str, mode: str) -> None:
    consistency, asynchronous, dedicated = mode.split("-")[0], mode.endswith("-async"), mode.endswith("-dedicated")
    faulthandler.dump_traceback_later(100, exit=True)
    runtime.init()
    world = runtime.size()
    holder: dict[str, ShardedTable] = {}
    raised: list[dict] = []

    def make_table() -> None:
        rule = SSP(1) if consistency == "ssp" else "bsp"
        holder["t"] = ShardedTable(ROWS, DIM, "float64", "row", SGD(lr=-1.0), rule, name="elastic-table",
                                   initializer="zeros", average=False, servers=[0] if dedicated else None)

    state = elastic.ObjectState(step=0)

    def reload() -> None:  # a reset callback: the old table was lost with the dead rank
        assert holder["t"].closed, "the table of the old world is still open"
        make_table()
        holder["t"].load(os.path.join(out, f"ckpt{state.step}"))

    make_table()
    state.register_reset_callbacks([reload])

    def die_at(step: int) -> None:
        last = runtime.size() == world and runtime.rank() == world - 1
        if last and step == (KILL_AT - 1 if asynchronous else KILL_AT):
            with open(os.path.join(out, "kill.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)

    def commit_on_server(meta: dict) -> None:  # (the dedicated server's on_save)
        state.step = meta["step"]
        state.commit()

    def train(state: elastic.ObjectState) -> None:
        if not holder["t"].is_worker:
            try:
                holder["t"].serve(on_save=commit_on_server)
            except Exception as exc:  # noqa: BLE001 - recorded, then raised to the elastic wrapper
                raised.append({"time": time.time(), "step": state.step, "type": type(exc).__name__,
                               "error": str(exc)[:300]})
                raise
            return
        pushed = None  # the last step's push_async (-async modes)
        while state.step < STEPS:
            table = holder["t"]
            if not asynchronous:
                die_at(state.step)
            keys, grads = batch(state.step, runtime.rank())
            try:
                table.pull(keys)
                if pushed is not None:
                    pushed, _ = None, pushed.wait()
                if asynchronous:
                    die_at(state.step)
                    pushed = table.push_async(keys, grads)
                    time.sleep(0.1)  # the rest of the step's compute: the queued push runs (and meets a failure)
                else:
                    table.push(keys, grads)
                state.step += 1
                if state.step % COMMIT_EVERY == 0:
                    if pushed is not None:
                        pushed, _ = None, pushed.wait()
                    table.save(os.path.join(out, f"ckpt{state.step}"), {"step": state.step})
                    state.commit()
                if dedicated and state.step == STEPS:  # the server serves until the workers close the table
                    holder["final"] = table.pull(np.arange(ROWS))
                    table.close()
            except Exception as exc:  # noqa: BLE001 - recorded, then raised to the elastic wrapper
                raised.append({"time": time.time(), "step": state.step, "type": type(exc).__name__,
                               "error": str(exc)[:300]})
                raise

    elastic.run_fn(train, elastic.recover)(state)  # (what the backends' elastic.run decorators do)
    table = holder["t"]
    if dedicated:
        final = holder.get("final")  # (None on the server)
    else:
        table.barrier()
        final = table.pull(np.arange(ROWS))
        table.close()
    result = {"rank": runtime.rank(), "size": runtime.size(), "step": state.step, "raised": raised,
              "table": None if final is None else final.tolist(), "worker": table.is_worker}
    with open(os.path.join(out, f"rank{runtime.rank()}.json"), "w") as f:
        json.dump(result, f)
    runtime.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
