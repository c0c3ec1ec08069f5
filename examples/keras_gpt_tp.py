"""The byte-level GPT of ``examples/gpt_tp.py`` in Keras 3, tensor (and data) parallel with Unison's Keras layers.

Run with ``unisonrun -np 2 python examples/keras_gpt_tp.py`` (tp = 2) or ``unisonrun -np 4 python
examples/keras_gpt_tp.py --tp 2`` (dp = 2 x tp = 2). The text is the Python standard library's own
source files. The same model as the PyTorch example, from ``unison.tf_backend``'s layers of the same
names: a ``VocabParallelEmbedding``, causal ``ParallelTransformerBlock``s (optionally sequence
parallel, with dropout), a column-parallel head and ``vocab_parallel_cross_entropy``, trained with a
``tf.function`` step under ``tf.GradientTape``; ``DistributedGradientTape(..., process_set=sets.dp)``
averages the gradients over the data group only.

The layers are built after ``keras.utils.set_random_seed(seed)``, the same on every rank: each
shard is its slice of the one model drawn under that seed (the parallel layers draw the whole
weight and keep their slice), and the replicated position table comes from an initializer with its
own seed; each block gets an explicit dropout ``seed=`` (docs/tensor_parallel.md, "Dropout and the
two random streams"). Rank 0 prints the loss as it falls, ``validation loss: x.xxx`` and a sample that the ranks
of the tensor group generate together.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt_tp import VOCAB, batch, build_parser, load_corpus  # noqa: E402  (the PyTorch example's data side)

logger = logging.getLogger("examples.keras_gpt_tp")


def build_model(args: argparse.Namespace, tp_set: object):
    """The GPT as a ``keras.Model``; its call returns this rank's ``(batch, seq, 256 / tp)`` logits."""
    import keras

    import unison.tf_backend as hvd

    class GPT(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            keras.utils.set_random_seed(args.seed)  # every rank alike: the shards are slices of one model
            self.embed = hvd.VocabParallelEmbedding(VOCAB, args.hidden, process_set=tp_set)
            self.blocks = [hvd.ParallelTransformerBlock(args.hidden, args.heads, 4 * args.hidden, causal=True,
                                                        process_set=tp_set, hidden_dropout=args.dropout,
                                                        attention_dropout=args.dropout, seed=args.seed + 10 * i,
                                                        sequence_parallel=args.sequence_parallel)
                           for i in range(args.layers)]
            self.head = hvd.ColumnParallelLinear(args.hidden, VOCAB, bias=False, process_set=tp_set)
            self.pos = self.add_weight(shape=(args.seq, args.hidden), name="positions",
                                       initializer=keras.initializers.RandomNormal(stddev=0.02, seed=args.seed))
            self.norm = keras.layers.LayerNormalization(epsilon=1e-5)
            self.norm.build((None, None, args.hidden))
            self.embed.embeddings.assign(self.embed.embeddings * 0.4)  # uniform(-0.05, 0.05) -> +-0.02

        def call(self, ids, training=None):
            x = self.embed(ids) + self.pos[:ids.shape[1]]
            if args.sequence_parallel:
                x = hvd.scatter_to_sequence(x, tp_set)
            for block in self.blocks:
                x = block(x, training=training)
            if args.sequence_parallel:
                x = hvd.gather_from_sequence(x, tp_set, to_parallel=False)  # the norm is replicated
            return self.head(self.norm(x))

    return GPT()


def main(argv: list[str] | None = None) -> int:
    args = build_parser("Keras 3").parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import tensorflow as tf

    import unison.tf_backend as hvd
    from unison.common.tensor_parallel import Grid
    from unison.tf_backend.tensor_parallel_comm import gather_from_group

    hvd.init()
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING, format="%(message)s",
                        stream=sys.stdout)
    grid = Grid(tp=args.tp or hvd.size())
    sets = grid.register()
    _, replica, _ = grid.coords(hvd.rank())
    model = build_model(args, sets.tp)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    logger.info("grid %r: %d data replica(s) x tensor groups of %d; %d parameters on rank 0 (one shard)",
                grid, grid.dp, grid.tp, params)
    optimizer = keras.optimizers.AdamW(learning_rate=args.lr, weight_decay=0.01)

    @tf.function
    def train_step(ids, targets):
        with tf.GradientTape() as tape:
            loss = hvd.vocab_parallel_cross_entropy(model(ids, training=True), targets, process_set=sets.tp)
        if grid.dp > 1:
            tape = hvd.DistributedGradientTape(tape, process_set=sets.dp)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    data = load_corpus(args.corpus_bytes)
    split = int(len(data) * 0.9)
    train, valid = data[:split], data[split:]
    rng = np.random.default_rng([args.seed, replica])  # the tensor group's ranks draw the same batches
    progress = keras.utils.Progbar(args.steps, verbose=1 if hvd.rank() == 0 and sys.stdout.isatty() else 0)
    for step in range(args.steps):
        ids, targets = (t.numpy() for t in batch(train, args.batch_size, args.seq, rng))
        loss = train_step(tf.constant(ids), tf.constant(targets))
        progress.update(step + 1, [("loss", float(loss))])
        if step % args.log_every == 0 or step == args.steps - 1:
            mean = hvd.allreduce(loss, op=hvd.Average, process_set=sets.dp) if grid.dp > 1 else loss
            logger.info("step %4d  loss %.3f", step, float(mean))
    vrng = np.random.default_rng([args.seed, 1_000_003])  # every rank: the same validation windows
    ids, targets = (t.numpy() for t in batch(valid, 64, args.seq, vrng))
    vloss = float(hvd.vocab_parallel_cross_entropy(model(tf.constant(ids)), targets, process_set=sets.tp))

    forward = tf.function(lambda x: gather_from_group(model(x)[:, -1], sets.tp))
    context = [ord("\n")] * (args.seq - 4) + list(b"def ")
    sampler = np.random.default_rng(args.seed)  # every rank of the tensor group: the same draws
    for _ in range(args.sample_bytes):
        logits = forward(tf.constant([context[-args.seq:]])).numpy()[0].astype(np.float64) / 0.8
        probs = np.exp(logits - logits.max())
        context.append(int(sampler.choice(VOCAB, p=probs / probs.sum())))
    if hvd.rank() == 0:
        logger.info("validation loss: %.3f (uniform guessing: %.3f)", vloss, math.log(VOCAB))
        logger.info("sample:\n%s", bytes(context[args.seq - 4:]).decode("utf-8", errors="replace"))
    hvd.barrier()  # the other tensor groups may still be generating: shutting down would stop their engine
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
