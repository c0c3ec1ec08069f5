"""A user's ``tf.function`` step averaging sparse (``IndexedSlices``) gradients across an elastic shrink;
run by tests/test_elastic_mpi.py under ULFM with 3 ranks.

    python mpi_tf_elastic_sparse.py OUT_DIR

Horovod's TensorFlow 2 elastic pattern: one ``@tf.function`` step traced once, ``hvd.elastic.run``
around the loop. Every rank's gradient is 1.0 for row 0 of an embedding (sparse) and for a dense
weight, and the step also averages an ``IndexedSlices`` of ones with ``hvd.allreduce`` and
``hvd.grouped_allreduce``, so each average is 1.0 at any number of ranks. After step ``KILL_AFTER``
the last rank SIGKILLs itself; the 2 survivors go on with the same traced function and write
``OUT_DIR/rank<r>.json``: the (size, averages) of every step. Before 2026-12-05 the sparse averages
divided by the size read when the function was traced, 2/3 = 0.667 after the shrink.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
import tensorflow as tf  # noqa: E402

import unison.tf_backend as hvd  # noqa: E402
from unison.tf_backend import elastic  # noqa: E402

STEPS, KILL_AFTER = 6, 3


def main(out: str) -> None:
    faulthandler.dump_traceback_later(150, exit=True)
    hvd.init()
    emb = tf.Variable(tf.zeros([4, 2], tf.float64))
    w = tf.Variable(tf.zeros([2], tf.float64))
    state = elastic.TensorFlowState([emb, w], step=0, seen=[])
    start = hvd.size()

    @tf.function
    def averages() -> tuple:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(emb, [0])) + tf.reduce_sum(w)
        g_emb, g_w = hvd.DistributedGradientTape(tape).gradient(loss, [emb, w])
        ones = tf.IndexedSlices(tf.ones([1, 2], tf.float64), tf.constant([1], tf.int64), tf.constant([4, 2]))
        one = hvd.allreduce(ones, op=hvd.Average, name="sparse_one")
        grouped = hvd.grouped_allreduce([ones], op=hvd.Average, name="sparse_grouped")[0]
        return (tf.convert_to_tensor(g_emb)[0, 0], g_w[0], tf.reduce_max(tf.convert_to_tensor(one)),
                tf.reduce_max(tf.convert_to_tensor(grouped)), tf.constant(isinstance(g_emb, tf.IndexedSlices)))

    @elastic.run
    def train(state: elastic.TensorFlowState) -> None:
        while state.step < STEPS:
            if state.step == KILL_AFTER and hvd.size() == start and hvd.rank() == start - 1:
                os.kill(os.getpid(), 9)
            values = averages()
            state.seen.append([hvd.size(), *[float(v) for v in values[:4]], bool(values[4])])
            state.step += 1
            state.commit()

    train(state)
    with open(os.path.join(out, f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"rank": hvd.rank(), "size": hvd.size(), "seen": state.seen}, f)
    hvd.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
