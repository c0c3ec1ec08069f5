"""The Keras pipeline: recompute and loss scaling in one process, training under mpirun at 2 and 4 ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from harness import ROOT, mpirun, run_rank_suite  # noqa: E402

from unison.tf_backend.pipeline import balance_by_params  # noqa: E402
from unison.tf_backend.pipeline.stages import KerasStage, scaled_loss  # noqa: E402


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [2, 4])  # every schedule at 2 ranks (25 s); the interleaved 8 stages at 4
def test_keras_pipeline(np_, tmp_path):
    run_rank_suite(np_, "mpi_keras_pipeline.py", tmp_path, timeout=250,
                   extra_env={"TEST_HANG_DUMP_S": "220"})


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_the_example_learns_digits_and_only_rank_0_prints():
    script = str(ROOT / "examples" / "keras_pipeline.py")
    proc = mpirun(2, [sys.executable, script, "--epochs", "3", "--schedule", "zb-h1", "--checkpoint", "always"],
                  timeout=150)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    found = re.findall(r"^final validation accuracy: (\d\.\d+)$", out, re.MULTILINE)
    assert len(found) == 1 and float(found[0]) > 0.9, out[-4000:]
    assert out.count("Epoch 1/3") == 1 and out.count("2 stages with [1, 3] layers") == 1  # rank 0 only
    usage = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "--schedule" in usage.stdout


def test_recompute_replays_dropout_and_leaves_the_state_as_it_was():
    keras.utils.set_random_seed(5)
    layers = [keras.layers.Dense(8), keras.layers.Dropout(0.5, seed=3)]
    keras.Sequential([keras.Input((8,)), *layers])
    stage = KerasStage(0, layers, None)
    x = tf.random.normal((4, 8))
    state = stage.snapshot()
    first = stage.compiled_target(x)
    after_forward = stage.snapshot()
    with stage.replayed(state):
        again = stage(x)
    np.testing.assert_array_equal(again.numpy(), first.numpy())
    for now, then in zip(stage.snapshot(), after_forward, strict=True):  # the recompute drew nothing for good
        np.testing.assert_array_equal(now.numpy(), then.numpy())
    assert not np.array_equal(stage(x).numpy(), first.numpy())  # and the next forward draws a fresh mask


def test_microbatch_losses_add_up_to_the_keras_loss_of_the_batch():
    rs = np.random.default_rng(0)
    y, p = rs.standard_normal((8, 3)).astype("float32"), rs.standard_normal((8, 3)).astype("float32")
    for loss in ["mse", keras.losses.MeanSquaredError(), keras.losses.MeanAbsoluteError(reduction="sum"),
                 lambda t, q: tf.reduce_sum((t - q) ** 2, axis=-1)]:
        fn, _ = scaled_loss(loss, 4)
        whole = keras.losses.get(loss) if isinstance(loss, str) else loss
        parts = sum(float(fn(a, b)) for a, b in zip(np.split(y, 4), np.split(p, 4), strict=True))
        assert parts == pytest.approx(float(tf.reduce_mean(whole(y, p))), rel=1e-6)
    assert not scaled_loss(keras.losses.MeanAbsoluteError(reduction="sum"), 2)[1]
    with pytest.raises(TypeError, match="loss must be a Keras loss"):
        scaled_loss(3, 2)


def test_partitioning_by_parameters():
    dense = keras.layers.Dense
    model = keras.Sequential([keras.Input((4,)), dense(64), dense(64), keras.layers.ReLU(), dense(2), dense(2)])
    assert balance_by_params(model.layers, 2) == [1, 4]  # 320 | 4160 + 130 + 6; [2, 3] would hold 4480
    assert balance_by_params(model.layers, 3) == [1, 1, 3]
    assert balance_by_params(model.layers, 5) == [1] * 5
