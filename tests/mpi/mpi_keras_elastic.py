"""Elastic Keras ``model.fit`` on 4 ranks that lose one rank twice; run by tests/test_elastic_mpi.py.

    python mpi_keras_elastic.py OUT_DIR

Phase ``strategy``: 4 ranks train a float64 MLP with ``model.fit`` under ``UnisonStrategy``
(each element of the dataset is a global batch of ``GB`` rows), the elastic callbacks
committing every ``COMMIT_EVERY`` batches; after step ``KILL_AFTER`` the last rank SIGKILLs
itself. Phase ``optimizer``: the 3 survivors train a fresh model with the Horovod-style
Keras ``DistributedOptimizer`` (each rank fits its own rows of every global batch); after
step ``KILL_AFTER`` the last rank kills itself again. Both phases resume mid-epoch the
documented way (``fit`` on ``dataset.skip(state.batch)`` for the rest of the epoch), so each
must end with the weights of one plain Keras process fitting the global batches in order.
Each survivor writes ``OUT_DIR/<phase>-rank<r>.json``; each victim ``OUT_DIR/<phase>-kill.json``.
``KERAS_ELASTIC_PHASES`` picks the phases (default ``strategy,optimizer``); under ``unisonrun``'s
elastic driver the victim dies in the first job only. With ``KERAS_GROW_FILE=PATH`` (under the driver,
with a discovery script printing PATH) nobody dies: after step ``GROW_AT`` of the first job rank 0
writes one slot more to PATH and waits, so the commit after step 4 stops the job for the driver to
start it on the grown slots.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import unison.tf_backend.keras as hvd  # noqa: E402
from unison.common import elastic as core  # noqa: E402

N, FEATURES, HIDDEN, GB, EPOCHS = 96, 8, 16, 12, 2
STEPS = N // GB
COMMIT_EVERY, KILL_AFTER, GROW_AT, LR, MOMENTUM = 2, 5, 3, 0.05, 0.9


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, FEATURES))
    return x, np.sin(x.sum(axis=1, keepdims=True))


def model() -> keras.Model:
    keras.config.set_floatx("float64")
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                            keras.layers.Dense(1)])
    return net


def sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(LR, momentum=MOMENTUM)


def reference_weights() -> list[list[float]]:
    """One plain Keras process (no Unison) fitting the global batches in order."""
    x, y = data()
    net = model()
    net.compile(optimizer=sgd(), loss="mse")
    net.fit(x, y, batch_size=GB, epochs=EPOCHS, shuffle=False, verbose=0)
    return [w.ravel().tolist() for w in net.get_weights()]


class _Steps(keras.callbacks.Callback):
    """Counts committed-state steps; the victim kills itself after ``KILL_AFTER`` of them."""

    def __init__(self, state: hvd.elastic.KerasState, out: str, phase: str, victim_size: int,
                 resets: list[dict]) -> None:
        super().__init__()
        self.state, self.out, self.phase, self.victim_size, self.resets = state, out, phase, victim_size, resets

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.state.step += 1
        if self.resets and self.resets[-1]["first_step_at"] is None:
            self.resets[-1]["first_step_at"] = time.time()
        grow = os.environ.get("KERAS_GROW_FILE")
        if grow:  # nobody dies: the discovery script's output grows by a slot after step GROW_AT
            if self.state.step == GROW_AT and hvd.rank() == 0 and os.environ.get("UNISON_ELASTIC_ATTEMPT") == "0":
                with open(grow, "w") as f:
                    f.write(f"localhost:{hvd.size() + 1}\n")
                time.sleep(2.0)  # the driver polls every 0.2 s: the commit after the next step sees its notice
            return
        if (self.state.step == KILL_AFTER and hvd.size() == self.victim_size
                and hvd.rank() == self.victim_size - 1 and os.environ.get("UNISON_ELASTIC_ATTEMPT", "0") == "0"):
            if "UNISON_ELASTIC_ATTEMPT" in os.environ:
                time.sleep(1.0)  # under unisonrun's driver: let rank 0 finish writing the last commit to disk
            with open(os.path.join(self.out, f"{self.phase}-kill.json"), "w") as f:
                json.dump({"time": time.time()}, f)
            os.kill(os.getpid(), 9)


def _global_batches() -> tf.data.Dataset:
    x, y = data()
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(GB)


def _own_rows() -> tf.data.Dataset:
    """This rank's rows of every global batch, batched (the Horovod-style data split)."""
    x, y = data()
    lo, hi = hvd.rank() * GB // hvd.size(), (hvd.rank() + 1) * GB // hvd.size()
    xs = x.reshape(STEPS, GB, FEATURES)[:, lo:hi].reshape(-1, FEATURES)
    ys = y.reshape(STEPS, GB, 1)[:, lo:hi].reshape(-1, 1)
    return tf.data.Dataset.from_tensor_slices((xs, ys)).batch(hi - lo)


def train_phase(phase: str, out: str) -> None:
    victim_size = hvd.size()
    if phase == "strategy":
        with hvd.UnisonStrategy().scope():
            net = model()
            net.compile(optimizer=sgd(), loss="mse")
    else:
        net = model()
        net.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss="mse")
    state = hvd.elastic.KerasState(net, epoch=0, batch=0, step=0)
    resets: list[dict] = []
    state.register_reset_callbacks([lambda: resets.append({"size": hvd.size(), "step": state.step,
                                                           "batch": state.batch, "epoch": state.epoch,
                                                           "first_step_at": None})])
    callbacks = [_Steps(state, out, phase, victim_size, resets), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=COMMIT_EVERY)]

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        dataset = _global_batches() if phase == "strategy" else _own_rows()
        if state.batch:
            net.fit(dataset.skip(state.batch), epochs=1, callbacks=callbacks, verbose=0)
        if state.epoch < EPOCHS:
            net.fit(dataset, epochs=EPOCHS - state.epoch, callbacks=callbacks, verbose=0)

    train(state)
    rec = core.last_recovery()
    result = {"rank": hvd.rank(), "size": hvd.size(), "step": state.step, "epoch": state.epoch,
              "attempt": int(os.environ.get("UNISON_ELASTIC_ATTEMPT", "-1")),
              "resets": resets, "recovery_seconds": rec.seconds if rec else None,
              "weights": [w.ravel().tolist() for w in net.get_weights()]}
    if hvd.rank() == 0:
        result["reference"] = reference_weights()
    with open(os.path.join(out, f"{phase}-rank{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)


def main(out: str) -> None:
    faulthandler.dump_traceback_later(400, exit=True)  # a hang shows every thread's stack, then ends
    hvd.init()
    for phase in os.environ.get("KERAS_ELASTIC_PHASES", "strategy,optimizer").split(","):
        train_phase(phase, out)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
