"""One Keras 3 script, data-parallel on any backend: ``unison.keras.DataParallel`` on scikit-learn's digits.

Run it with the backend of your choice; nothing in the script changes::

    KERAS_BACKEND=jax        unisonrun -np 2 python examples/keras_any_backend.py
    KERAS_BACKEND=torch      unisonrun -np 2 python examples/keras_any_backend.py
    KERAS_BACKEND=tensorflow unisonrun -np 2 python examples/keras_any_backend.py

Every rank holds the whole (small) dataset and passes it to ``fit`` with the *global*
batch size; each rank trains on its rows of every global batch, and the loss and
accuracy shown (by rank 0 only) are over the global batch. Rank 0 saves the model.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported in main, after the arguments, so that --help needs no Keras
    import keras

log = logging.getLogger("keras_any_backend")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8, help="epochs (default 8)")
    parser.add_argument("--global-batch", type=int, default=64, help="global batch size (default 64)")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    parser.add_argument("--seed", type=int, default=0, help="data split and initial weights seed (default 0)")
    parser.add_argument("--save", type=Path, default=None,
                        help="rank 0 saves the model here (.keras; default: unison_keras_any_backend.keras in "
                             "the temporary folder)")
    return parser.parse_args()


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
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    import unison.keras as uk

    logging.basicConfig(level=logging.INFO, format="%(message)s")

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    x_train, x_val, y_train, y_val = train_test_split(x, digits.target.astype("int64"), test_size=0.2,
                                                      random_state=args.seed, stratify=digits.target)
    keras.utils.set_random_seed(args.seed)
    dp = uk.DataParallel()
    with dp.scope():
        model = build_model()
        model.compile(optimizer=keras.optimizers.Adam(args.lr),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    if uk.rank() == 0:
        log.info("backend %s, %d rank(s), global batch %d", keras.backend.backend(), uk.size(), args.global_batch)
    model.fit(x_train, y_train, batch_size=args.global_batch, epochs=args.epochs, verbose=2,
              validation_data=(x_val, y_val))
    loss, accuracy = model.evaluate(x_val, y_val, batch_size=args.global_batch, verbose=0)
    target = args.save or Path(tempfile.gettempdir()) / "unison_keras_any_backend.keras"
    model.save(target)  # rank 0 writes (atomically); the other ranks return
    if uk.rank() == 0:
        log.info("saved the model to %s", target)
        print(f"final validation accuracy: {accuracy:.3f} ({keras.backend.backend()})", flush=True)


if __name__ == "__main__":
    main()
