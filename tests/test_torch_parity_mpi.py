"""Horovod 0.28 parity of the PyTorch backend under real mpirun (docs/horovod.md)."""

from __future__ import annotations

import pytest
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(600)
@pytest.mark.parametrize("np_", [3, 4])  # Adasum: 4 (power of two) and 3 (its error); 2 ranks: the other suites
def test_torch_parity(np_, tmp_path):
    run_rank_suite(np_, "mpi_torch_parity.py", tmp_path, timeout=500)


def test_one_compression_for_numpy_and_torch():
    """[Note: one Compression for every framework]: each tensor comes back in its own framework."""
    import numpy as np
    import torch

    import unison
    import unison.torch_backend as hvd

    assert hvd.Compression is unison.Compression  # one object: the core and the backend agree on it
    arr = np.arange(4, dtype=np.float32)
    wire, ctx = hvd.Compression.fp16.compress(arr)
    assert isinstance(wire, np.ndarray) and wire.dtype == np.float16
    assert hvd.Compression.fp16.decompress(wire, ctx).dtype == np.float32
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = torch.arange(4, dtype=dtype)
        for comp, wire_dtype in ((hvd.Compression.fp16, torch.float16), (hvd.Compression.bf16, torch.bfloat16)):
            wire, ctx = comp.compress(t)
            assert isinstance(wire, torch.Tensor) and wire.dtype == wire_dtype
            back = comp.decompress(wire, ctx)
            assert back.dtype == dtype and torch.equal(back, t)
    ints = torch.arange(3)
    wire, ctx = hvd.Compression.fp16.compress(ints)
    assert wire is ints and hvd.Compression.fp16.decompress(wire, ctx) is ints
    assert hvd.Compression.none.compress(ints) == (ints, None)
