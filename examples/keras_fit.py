"""Keras 3 ``model.fit`` across ranks with UnisonStrategy, on scikit-learn's digits.

Run with ``unisonrun -np 2 python examples/keras_fit.py`` (this is ``make demo``).
The dataset's batch is the global batch; each rank trains on its share of every
batch, gradients are averaged across ranks, and the loss and accuracy Keras
reports are global (the same on every rank). Only rank 0 prints progress and
writes the model file.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in main, after the arguments, so that --help needs no TensorFlow
    import keras
    import tensorflow as tf

log = logging.getLogger("keras_fit")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="epochs (default 8)")
    parser.add_argument("--global-batch", type=int, default=64, help="global batch size (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed for the data split, the shuffle and the initial weights (default 0)")
    parser.add_argument("--save", type=Path, default=None,
                        help="rank 0 saves the model here (.keras; default: unison_keras_fit.keras in the "
                             "temporary folder)")
    return parser.parse_args()


def datasets(global_batch: int, seed: int) -> tuple[tf.data.Dataset, tf.data.Dataset]:
    """Digits as 8x8x1 images in [0, 1], split 80/20, batched by the global batch size."""
    import tensorflow as tf
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_val, y_train, y_val = train_test_split(x, digits.target.astype("int64"), test_size=0.2,
                                                      random_state=seed, stratify=digits.target)
    train = tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(len(x_train), seed=seed)
    val = tf.data.Dataset.from_tensor_slices((x_val, y_val))
    return train.batch(global_batch, drop_remainder=True), val.batch(global_batch)


def build_model() -> keras.Model:
    import keras

    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu", padding="same"),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def main() -> None:
    args = parse_args()
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np
    import tensorflow as tf

    import unison
    from unison.tf_backend import UnisonStrategy

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tf.config.threading.set_intra_op_parallelism_threads(1)
    keras.utils.set_random_seed(args.seed)  # the initial weights: the same accuracy from run to run

    strategy = UnisonStrategy()
    rank, size = unison.rank(), unison.size()
    train, val = datasets(args.global_batch, args.seed)
    with strategy.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(args.lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    if rank == 0:
        log.info("%d rank(s), global batch %d (%d per rank)", size, args.global_batch,
                 args.global_batch // size)
    history = model.fit(train, validation_data=val, epochs=args.epochs, verbose=2 if rank == 0 else 0,
                        shuffle=False)  # (the dataset is shuffled already: Keras warns otherwise)
    accuracy = history.history["val_accuracy"][-1]
    if rank == 0:
        target = args.save or Path(tempfile.gettempdir()) / "unison_keras_fit.keras"
        tmp = target.with_name(f".{target.stem}.tmp.keras")
        model.save(tmp)
        os.replace(tmp, target)
        log.info("saved the model to %s", target)
        print(f"final validation accuracy: {accuracy:.3f}", flush=True)
    reported = unison.allgather(np.array([accuracy]), name="keras_fit.accuracy")
    if rank == 0 and not np.all(reported == reported[0]):
        log.warning("ranks report different accuracies: %s", reported)


if __name__ == "__main__":
    main()
