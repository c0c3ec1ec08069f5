"""Pipeline-parallel training of a small Keras MLP on scikit-learn's digits with ``unison.tf_backend.Pipeline``.

Run with ``unisonrun -np 2 python examples/keras_pipeline.py``: the model's layers are cut
into one stage per rank (by parameter count), rank 0 holds the first stage and feeds the
images, the last rank holds the last stage and the labels, and activations and gradients
travel between them point to point, ``--chunks`` microbatches per batch, in the order of
``--schedule``. Every rank loads the same data, builds the model with the same seed and
shuffles with the same seed, so the stages start from one model and the first and last
stages see matching images and labels without sending them.

Only rank 0 prints (Keras's progress bar); the last line is ``final validation accuracy: 0.xxx``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a Keras MLP on scikit-learn's digits as a pipeline of one stage per rank "
                    "(run under unisonrun -np 2); rank 0 prints.")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set (default 5)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="samples per step; a multiple of --chunks (default 64)")
    p.add_argument("--chunks", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    p.add_argument("--checkpoint", choices=("never", "always", "except_last"), default="never",
                   help="recompute activations in backward instead of keeping them (default never)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate, momentum 0.9 (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed for the split, weights and shuffling (default 0)")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.chunks < 1 or args.batch_size < 1 or args.batch_size % args.chunks:
        p.error(f"--epochs and --chunks must be positive and --batch-size a positive multiple of --chunks "
                f"(got --epochs {args.epochs}, --chunks {args.chunks}, --batch-size {args.batch_size})")
    return args


def load_digits_split(seed: int) -> tuple[Any, Any, Any, Any]:
    """Flattened 8x8 digits scaled to [0, 1] and their labels, split 80/20; the same on every rank."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    return tuple(train_test_split(x, data.target.astype("int64"), test_size=0.2, stratify=data.target,
                                  random_state=seed))


def build_model(seed: int) -> Any:
    import keras

    keras.utils.set_random_seed(seed)  # the same initial weights on every rank
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                             keras.layers.Dropout(0.1), keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(10)])


def accuracy(hvd: Any, pipe: Any, x: Any, y: Any, chunks: int) -> float:
    """Validation accuracy, computed where the last stage is and sent to every rank."""
    import numpy as np

    pad = -len(x) % chunks  # a batch must split into equal microbatches: pad, then drop the padding
    logits = pipe.predict(np.concatenate([x, x[:pad]]))
    mine = float(np.mean(logits[:len(x)].argmax(axis=1) == y)) if pipe.holds_last else None
    return hvd.broadcast_object(mine, root_rank=hvd.size() - 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import tensorflow as tf

    import unison.tf_backend as hvd

    hvd.init()
    tf.config.threading.set_intra_op_parallelism_threads(1)  # ranks share the host's cores
    say = print if hvd.rank() == 0 else (lambda *a, **k: None)
    x_train, x_val, y_train, y_val = load_digits_split(args.seed)
    v = 2 if args.schedule == "interleaved" else 1
    pipe = hvd.Pipeline(build_model(args.seed), chunks=args.chunks, schedule=args.schedule, virtual_stages=v,
                        checkpoint=args.checkpoint,
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        optimizer=lambda: keras.optimizers.SGD(args.lr, momentum=0.9))
    say(f"{hvd.size()} rank(s), {pipe.schedule.num_stages} stages with {pipe.balance} layers, "
        f"{args.schedule}, {args.chunks} microbatches of {args.batch_size // args.chunks}")
    losses = pipe.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)
    final = accuracy(hvd, pipe, x_val, y_val, args.chunks)
    say(f"train loss by epoch: {', '.join(f'{loss:.4f}' for loss in losses)}; idle share of rank 0 in the "
        f"last step {pipe.stats.bubble:.2f}")
    pipe.close()
    say(f"final validation accuracy: {final:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
