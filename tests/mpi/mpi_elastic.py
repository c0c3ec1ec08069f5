"""Elastic training on 3 ranks where one rank kills itself; run by tests/test_elastic_mpi.py.

    python mpi_elastic.py OUT_DIR

Every rank trains the same MLP with ``hvd.elastic.run``, a ``DistributedOptimizer`` (SGD
with momentum, float64) and an ``ElasticSampler``, committing every ``COMMIT_EVERY`` steps.
After step ``KILL_AFTER`` the last rank SIGKILLs itself (writing the time first to
``OUT_DIR/kill.json``). Each survivor writes ``OUT_DIR/rank<r>.json`` at the end: final
weights, the global batches of every step it kept, its resets and their timings.

With ``ELASTIC_SECOND_FAILURE=1`` (launched on 4 ranks) the last rank dies after step
``KILL_AFTER`` and then, while the 3 survivors run their reset callbacks (which all-reduce),
rank 2 dies too: the 2 left must rebuild again and finish. With ``ELASTIC_FAIL_IN_RECOVERY=1`` (on
4 ranks) rank 2 dies instead inside ``recover()``, as the runtime starts on the 3 survivors' shrunk
communicator and before the engine does: ``recover()`` itself must shrink again, to 2.

Under ``unisonrun``'s elastic driver (``UNISON_ELASTIC_ATTEMPT`` set) the kill happens in the
first job only. ``ELASTIC_KILL_RANKS=0,1`` names the ranks that kill themselves after step
``KILL_AFTER`` instead of the last; with ``ELASTIC_RAISE=1`` they raise ``HorovodInternalError``
instead of dying. Each process that completes a reset writes an empty
``OUT_DIR/reset.<hostname>.<pid>`` (a test checks which hosts went on). With ``ELASTIC_STEP_SLEEP=S``
nobody is killed: each step sleeps S seconds and rank 0 writes the step to
``OUT_DIR/progress<attempt>`` (a test takes a host down meanwhile).
With ``ELASTIC_GROW_FILE=PATH`` nobody is killed: after step ``GROW_AT`` of the first job rank 0
writes ``localhost:<ELASTIC_GROW_TO, default 3>`` to PATH (what the test's discovery script
prints) and waits, so the driver sees the change and the commit after ``GROW_AT`` stops the job
for a restart on the new slots.
With ``ELASTIC_FAIL_IN_UPDATE=1`` (with ``ELASTIC_HOST_UPDATE=1``, 3 ranks) rank 2 dies while every
rank rebuilds after the host update. With ``ELASTIC_HOST_UPDATE=1`` alone nobody is killed: rank 0 posts
``on_hosts_updated(100.0)`` before the commit after step ``UPDATE_AT``, the last rank posts the same
update before the next commit (as notices arrive at different times): the job must reset once, at the
first of them, on the same ranks. With
``ELASTIC_EXTRA_STATE=1`` the state also tracks a module with extra state (``get_extra_state``), rank-dependent
before each sync; each rank writes what it holds at the end.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import time

import numpy as np
import torch

import unison.torch_backend as hvd
from unison.common import elastic as core
from unison.torch_backend import elastic

N, FEATURES, HIDDEN, BS, EPOCHS = 96, 8, 16, 4, 2
COMMIT_EVERY, KILL_AFTER, SEED, LR, MOMENTUM = 2, 5, 3, 0.05, 0.9
GROW_AT = 3
UPDATE_AT = 2


class Calibration(torch.nn.Module):
    """No parameters, only extra state (a dict), as quantization observers keep."""

    def __init__(self, amax: float) -> None:
        super().__init__()
        self.calib = {"amax": amax}

    def get_extra_state(self) -> dict:
        return dict(self.calib)

    def set_extra_state(self, state: dict) -> None:
        self.calib = dict(state)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, FEATURES))
    y = np.sin(x.sum(axis=1, keepdims=True))
    return torch.from_numpy(x), torch.from_numpy(y)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, 1)).double()


def main(out: str) -> None:
    # a hang shows every thread's stack, then ends (sooner in the short host-update job)
    faulthandler.dump_traceback_later(60 if os.environ.get("ELASTIC_HOST_UPDATE") == "1" else 150, exit=True)
    hvd.init()
    x, y = data()
    net = model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM),
                                   named_parameters=net.named_parameters())
    sampler = elastic.ElasticSampler(range(N), shuffle=True, seed=SEED)
    update = os.environ.get("ELASTIC_HOST_UPDATE") == "1"
    extra = {"calib": Calibration(float(hvd.rank()))} if os.environ.get("ELASTIC_EXTRA_STATE") == "1" else {}
    state = elastic.TorchState(net, opt, sampler=sampler, epoch=0, step=0, log=[], **extra)
    resets: list[dict] = []
    second = os.environ.get("ELASTIC_SECOND_FAILURE") == "1"
    in_recovery = os.environ.get("ELASTIC_FAIL_IN_RECOVERY") == "1"
    world = hvd.size()

    def die_in_rebuild(st: object, sets: object) -> None:
        """Runs first among init's hooks, before the engine starts on the shrunk world: rank 2 dies there, so
        the survivors' rebuild inside recover() fails and recover() must shrink again."""
        if st.size == world - 1 and st.rank == 2:
            with open(os.path.join(out, "kill2.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), 9)

    def die_in_update(st: object, sets: object) -> None:
        """Rank 2 dies as every rank rebuilds Unison after the host update (no failure before): the survivors
        go on without it (before 2026-12-07 they ended with MPI_ERR_PROC_FAILED)."""
        if st.rank == 2:
            with open(os.path.join(out, "kill2.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), 9)

    if in_recovery or os.environ.get("ELASTIC_FAIL_IN_UPDATE") == "1":
        from unison.common import runtime

        # test only: ahead of the engine's and the others' hooks (inserted after init: a rebuild's init runs it)
        runtime._init_hooks.insert(0, die_in_rebuild if in_recovery else die_in_update)
    grow = os.environ.get("ELASTIC_GROW_FILE")
    first_job = os.environ.get("UNISON_ELASTIC_ATTEMPT", "0") == "0"
    pace = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))  # a test that cuts a host's link needs time
    start_size = hvd.size()
    kill_ranks = [int(r) for r in os.environ.get("ELASTIC_KILL_RANKS", str(start_size - 1)).split(",")]

    def die_in_reset() -> None:
        if second and hvd.size() == start_size - 1 and hvd.rank() == 2:
            with open(os.path.join(out, "kill2.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), 9)
        hvd.allreduce(torch.zeros(1), name=f"reset_check.{len(resets)}")  # a collective in a reset callback

    def mark_reset() -> None:
        open(os.path.join(out, f"reset.{socket.gethostname()}.{os.getpid()}"), "w").close()

    state.register_reset_callbacks([lambda: resets.append({"size": hvd.size(), "step": state.step,
                                                           "first_step_at": None}), die_in_reset, mark_reset])

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        while state.epoch < EPOCHS:
            for b in range(len(state.sampler) // BS):
                if grow and first_job and state.step == GROW_AT and hvd.rank() == 0:
                    with open(grow, "w") as f:
                        f.write(f"localhost:{os.environ.get('ELASTIC_GROW_TO', '3')}\n")
                    time.sleep(2.0)  # the driver polls every 0.2 s: the next commit sees its notice
                if pace:
                    time.sleep(pace)
                    if hvd.rank() == 0:
                        attempt = os.environ.get("UNISON_ELASTIC_ATTEMPT")
                        with open(os.path.join(out, f"progress{attempt}"), "w") as f:
                            f.write(str(state.step))
                if (not grow and not pace and not update and first_job and state.step == KILL_AFTER
                        and hvd.size() == start_size and hvd.rank() in kill_ranks):
                    if "UNISON_ELASTIC_ATTEMPT" in os.environ:
                        time.sleep(1.0)  # under the driver: let rank 0 finish writing the last commit to disk
                    with open(os.path.join(out, "kill.json"), "w") as f:
                        json.dump({"time": time.time()}, f)
                    if os.environ.get("ELASTIC_RAISE") == "1":  # Horovod's way to ask for a restore and reset
                        raise hvd.HorovodInternalError("raised by the training loop")
                    os.kill(os.getpid(), 9)
                idx = state.sampler.get_indices(b, BS)
                opt.zero_grad()
                loss = ((net(x[idx]) - y[idx]) ** 2).mean()
                loss.backward()
                opt.step()
                state.step += 1
                if resets and resets[-1]["first_step_at"] is None:
                    resets[-1]["first_step_at"] = time.time()
                every = [state.sampler._core.batch_indices(b, BS, r) for r in range(hvd.size())]
                state.log.append([state.epoch, state.step, hvd.size(), every])
                state.sampler.record_batch(b, BS)
                if update and state.step in (UPDATE_AT, UPDATE_AT + COMMIT_EVERY):
                    if extra and state.step == UPDATE_AT:  # the sync after the update gives every rank rank 0's
                        extra["calib"].calib = {"amax": 10.0 + hvd.rank()}
                    if hvd.rank() == (0 if state.step == UPDATE_AT else hvd.size() - 1):
                        state.on_hosts_updated(100.0, skip_sync=False)
                if state.step % COMMIT_EVERY == 0:
                    state.commit()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)
    rec = core.last_recovery()
    result = {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "resets": resets,
              "attempt": int(os.environ.get("UNISON_ELASTIC_ATTEMPT", "-1")), "commit_id": state.commit_id,
              "recovery_seconds": rec.seconds if rec else None, "log": state.log,
              "weights": [p.detach().numpy().ravel().tolist() for p in net.parameters()],
              "calib": extra["calib"].calib if extra else None}
    with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
