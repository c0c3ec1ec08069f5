"""One Unison job with one fault, run by tests/test_faults_mpi.py under ``unisonrun -np 2``.

Usage: ``fault_job.py KIND WORKDIR MARKER``

* ``KIND`` picks the job and the fault (see ``JOBS``): a rank ``kill -9``s itself at a known
  point (``allreduce``, ``optimizer``, ``pipeline``, ``checkpoint``), returns early without
  ``join`` (``early_exit``), ends with ``os._exit(0)`` (``hard_exit``), raises (``raise``), or
  nothing happens and the job runs until it is stopped
  (``loop``, for the signal tests).
* ``WORKDIR`` receives ``rank<R>.pid`` once rank ``R`` runs, ``killed.json`` (the rank, its
  pid and the time) just before the kill, and the checkpoints.
* ``MARKER`` is not read: it is a unique word on every rank's command line, so that the test
  can find leftover processes of this job in ``/proc``.

Every job stops by itself after ``LIMIT_S`` seconds, so a test whose fault does not end the
job cannot leave it running for long.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import unison
from unison.common.files import atomic_path

LIMIT_S = 120.0
#: the step at which the faulty rank acts; steps before it complete normally
FAULT_STEP = 3
#: elements of the tensors reduced by the ``allreduce`` job (32 MiB of float64)
BIG = 4 << 20
#: the checkpoint written by the ``checkpoint`` job, and its size in float64 elements (16 MiB)
CHECKPOINT, CHECKPOINT_SIZE = "state.npy", 2 << 20


def record_kill(workdir: Path, where: str) -> None:
    """Writes ``killed.json`` (durably: the process dies right after), then kills this process."""
    info = {"rank": unison.rank(), "pid": os.getpid(), "time": time.time(), "where": where}
    with open(workdir / "killed.json", "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def steps(limit_s: float = LIMIT_S):
    """Counts 0, 1, 2... until ``limit_s`` seconds have passed."""
    start, step = time.monotonic(), 0
    while time.monotonic() - start < limit_s:
        yield step
        step += 1


def job_allreduce(workdir: Path) -> None:
    """Rank 1 dies with a large all-reduce in flight; rank 0 is inside the same all-reduce."""
    data = np.ones(BIG)
    for step in steps():
        if unison.rank() == 1 and step == FAULT_STEP:
            handle = unison.allreduce_async(data, name="big")
            time.sleep(0.005)  # the engine thread takes the request into negotiation or the ring
            record_kill(workdir, f"allreduce step {step}, its handle done: {unison.poll(handle)}")
        unison.allreduce(data, name="big")


def job_optimizer(workdir: Path) -> None:
    """Rank 1 dies in backward, after the later layers' gradients went to the engine."""
    import torch
    from torch import nn

    import unison.torch_backend as hvd

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                         named_parameters=model.named_parameters())
    current = {"step": -1}

    def first_layer_grad(grad: torch.Tensor) -> torch.Tensor:
        # the first layer's gradient comes last in backward: the others are submitted already
        if unison.rank() == 1 and current["step"] == FAULT_STEP:
            record_kill(workdir, f"optimizer step {FAULT_STEP}, in backward")
        return grad

    model[0].weight.register_hook(first_layer_grad)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for step in steps():
        current["step"] = step
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def job_pipeline(workdir: Path) -> None:
    """Rank 1 (the last stage) dies in the forward pass of a pipeline step."""
    import torch
    from torch import nn

    import unison.torch_backend as hvd

    torch.set_num_threads(1)
    torch.manual_seed(0)
    calls = {"n": 0}
    chunks = 2

    class KillAt(nn.Module):
        """Identity that kills its rank on its first call in step ``FAULT_STEP``."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if calls["n"] == FAULT_STEP * chunks:
                record_kill(workdir, f"pipeline step {FAULT_STEP}, forward of the last stage")
            calls["n"] += 1
            return x

    layers = [nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), KillAt(), nn.Linear(32, 1)]
    pipe = hvd.Pipeline(layers, balance=[2, 3], chunks=chunks, schedule="1f1b",
                        loss_fn=nn.functional.mse_loss,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.01))
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    for _ in steps():
        pipe.train_step(x, y)


class _DieMidWrite:
    """A binary file that kills this process once ``limit`` bytes went to disk."""

    def __init__(self, file, limit: int, workdir: Path) -> None:
        self._file, self._left, self._workdir = file, limit, workdir

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= self._left:
            self._file.write(view[: self._left])
            self._file.flush()
            os.fsync(self._file.fileno())
            record_kill(self._workdir, "checkpoint save, mid-write")
        self._left -= len(view)
        return self._file.write(view)


def job_checkpoint(workdir: Path) -> None:
    """Rank 0 saves a checkpoint every step and dies half-way through writing the one of ``FAULT_STEP``.

    The checkpoint of step ``k`` is an array filled with ``k``; the test expects the one of
    ``FAULT_STEP - 1`` to load.
    """
    path = workdir / CHECKPOINT
    for step in steps():
        unison.allreduce(np.ones(4), name="step")
        if unison.rank() != 0:
            continue
        state = np.full(CHECKPOINT_SIZE, float(step))
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            if step == FAULT_STEP:
                f = _DieMidWrite(f, state.nbytes // 2, workdir)
            np.save(f, state)


def job_early_exit(workdir: Path) -> None:
    """Rank 1 returns after ``FAULT_STEP`` steps without ``join``; rank 0 keeps all-reducing."""
    for step in steps():
        if unison.rank() == 1 and step == FAULT_STEP:
            (workdir / "returned").write_text(str(time.time()))
            return
        unison.allreduce(np.ones(4), name="step")


def job_hard_exit(workdir: Path) -> None:
    """Rank 1 ends with ``os._exit(0)`` (no ``MPI_Finalize``) at ``FAULT_STEP``; rank 0 keeps all-reducing."""
    for step in steps():
        if unison.rank() == 1 and step == FAULT_STEP:
            (workdir / "returned").write_text(str(time.time()))
            os._exit(0)
        unison.allreduce(np.ones(4), name="step")


def job_raise(workdir: Path) -> None:
    """Rank 1 raises (uncaught) at ``FAULT_STEP``, between collectives; rank 0 keeps all-reducing."""
    for step in steps():
        if unison.rank() == 1 and step == FAULT_STEP:
            (workdir / "returned").write_text(str(time.time()))
            raise RuntimeError("fault_job: rank 1 raises on purpose")
        unison.allreduce(np.ones(4), name="step")


def job_exit3(workdir: Path) -> None:
    """Rank 1 calls ``sys.exit(3)`` at ``FAULT_STEP``; rank 0 keeps all-reducing."""
    for step in steps():
        if unison.rank() == 1 and step == FAULT_STEP:
            (workdir / "returned").write_text(str(time.time()))
            sys.exit(3)
        unison.allreduce(np.ones(4), name="step")


def job_loop(workdir: Path) -> None:
    """No fault: small all-reduces until the job is stopped from outside."""
    for _ in steps():
        unison.allreduce(np.ones(4), name="step")
        time.sleep(0.01)


JOBS = {
    "allreduce": job_allreduce,
    "optimizer": job_optimizer,
    "pipeline": job_pipeline,
    "checkpoint": job_checkpoint,
    "early_exit": job_early_exit,
    "hard_exit": job_hard_exit,
    "raise": job_raise,
    "exit3": job_exit3,
    "loop": job_loop,
}


def main() -> int:
    kind, workdir = sys.argv[1], Path(sys.argv[2])
    if kind in ("optimizer", "pipeline"):
        importlib.import_module("unison.torch_backend")  # torch is imported before the clock starts
    unison.init()
    (workdir / f"rank{unison.rank()}.pid").write_text(str(os.getpid()))
    last_resort = threading.Timer(LIMIT_S + 30, os._exit, args=(3,))  # never fires in a passing test
    last_resort.daemon = True
    last_resort.start()
    JOBS[kind](workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
