"""Tensor-parallel checkpoints: the canonical layout in one process, then torch and Keras under mpirun.

The one-process part checks ``unison/common/tensor_parallel/checkpoint.py`` against explicit
slicing, the way the layers cut their shards (numpy only, no MPI); the mpirun part is one np 4
launch of tests/mpi/mpi_tp_checkpoint.py (tp = 2 -> one process and back, both frameworks).
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import run_rank_suite

from unison.common.checkpoints import CheckpointError
from unison.common.tensor_parallel import checkpoint as tpck
from unison.common.tensor_parallel.checkpoint import REPLICATED, ShardSpec, TPParam

CASES = [  # (full shape, spec): torch column / row weights, fused q/k/v (torch and Keras), a 3-D tensor
    ((12, 5), ShardSpec(0)),
    ((5, 12), ShardSpec(1)),
    ((24, 4), ShardSpec(0, 3)),
    ((4, 24), ShardSpec(1, 3)),
    ((24,), ShardSpec(0, 3)),
    ((3, 8, 5), ShardSpec(1, 2)),
]


def layer_shard(full: np.ndarray, spec: ShardSpec, tp: int, r: int) -> np.ndarray:
    """Shard ``r`` of ``tp`` as the layers cut it: each block's ``r``-th piece along the axis, concatenated."""
    block = full.shape[spec.axis] // spec.blocks
    piece = block // tp
    return np.concatenate([np.take(full, range(j * block + r * piece, j * block + (r + 1) * piece), axis=spec.axis)
                           for j in range(spec.blocks)], axis=spec.axis)


@pytest.mark.parametrize("shape,spec", CASES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_shard_is_one_canonical_range(shape, spec, tp):
    full = np.random.default_rng(0).standard_normal(shape)
    flat = np.ascontiguousarray(tpck.to_canonical(full, spec)).reshape(-1)
    np.testing.assert_array_equal(tpck.from_canonical(flat, shape, spec), full)
    for r in range(tp):
        start, length = tpck.canonical_range(shape, spec, tp, r)
        local = layer_shard(full, spec, tp, r)
        np.testing.assert_array_equal(tpck.shard_of_full(full, spec, tp, r), local)
        np.testing.assert_array_equal(np.ascontiguousarray(tpck.to_canonical(local, spec)).reshape(-1),
                                      flat[start:start + length])
        np.testing.assert_array_equal(tpck.from_canonical(flat[start:start + length], local.shape, spec), local)


def test_canonical_layout_examples():
    """The examples of [Note: canonical layout of a tensor-parallel entry]."""
    w = np.arange(24.0).reshape(6, 4)
    np.testing.assert_array_equal(tpck.to_canonical(w, ShardSpec(0)).reshape(6, 4), w)     # column: as it is
    np.testing.assert_array_equal(tpck.to_canonical(w, ShardSpec(1)).reshape(4, 6), w.T)   # row: transposed
    qkv = tpck.to_canonical(w, ShardSpec(0, 3))                                 # (2, 3, 4): row j of q, k, v
    np.testing.assert_array_equal(qkv[1], w[[1, 3, 5]])


def one(name, full, spec, tp, r):
    return TPParam(name, full.shape, spec, tp, r, tpck.shard_of_full(full, spec, tp, r), str(full.dtype))


def test_one_process_save_and_reload_at_other_tps(tmp_path):
    rng = np.random.default_rng(1)
    w, b, norm = rng.standard_normal((8, 6)), rng.standard_normal(8), rng.standard_normal(6)
    tpck.save(tmp_path / "ck", [one("w", w, ShardSpec(1), 1, 0), one("b", b, REPLICATED, 1, 0),
                                one("n", norm, REPLICATED, 1, 0)], metadata={"epoch": 2})
    for tp in (1, 2):
        for r in range(tp):
            params = [one("w", w, ShardSpec(1), tp, r)._replace(array=None), one("b", b, ShardSpec(0), tp, r),
                      one("n", norm, REPLICATED, 1, 0)]
            pieces, user = tpck.load(tmp_path / "ck", params)
            assert user == {"epoch": 2}
            np.testing.assert_array_equal(pieces["w"], layer_shard(w, ShardSpec(1), tp, r))
            np.testing.assert_array_equal(pieces["b"], layer_shard(b, ShardSpec(0), tp, r))  # saved whole
            np.testing.assert_array_equal(pieces["n"], norm)


def test_one_process_refusals(tmp_path):
    w = np.random.default_rng(2).standard_normal((8, 8))
    tpck.save(tmp_path / "ck", [one("w", w, ShardSpec(0), 1, 0)])
    with pytest.raises(CheckpointError, match=r"'w' .* saved split along axis 0 in 1 block\(s\), but .* split "
                                              r"along axis 1 in 1 block\(s\).*plain unsplit model"):
        tpck.load(tmp_path / "ck", [one("w", w, ShardSpec(1), 2, 0)])
    with pytest.raises(CheckpointError, match=r"no entry 'v' \(it holds 1: \['w'\]\)"):
        tpck.load(tmp_path / "ck", [one("v", w, REPLICATED, 1, 0)])
    with pytest.raises(CheckpointError, match=r"full shape \(8, 8\), this model's parameter \(4, 8\)"):
        tpck.load(tmp_path / "ck", [one("w", w[:4], REPLICATED, 1, 0)])
    with pytest.raises(CheckpointError, match="both named 'w'"):
        tpck.save(tmp_path / "dup", [one("w", w, REPLICATED, 1, 0)] * 2)
    with pytest.raises(CheckpointError, match=r"cannot hold 3 block\(s\) each split in 2"):
        tpck.save(tmp_path / "odd", [one("w", w, ShardSpec(0), 1, 0)._replace(spec=ShardSpec(0, 3), tp=2)])


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_tp_checkpoint_torch_and_keras(tmp_path):
    run_rank_suite(4, "mpi_tp_checkpoint.py", tmp_path, timeout=540, extra_env={"TEST_HANG_DUMP_S": "480"})
