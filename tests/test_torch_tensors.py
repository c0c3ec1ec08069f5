"""The PyTorch adapter's tensor <-> array conversion (single process, no MPI).

``to_numpy`` views a common contiguous tensor with ``Tensor.numpy(force=True)`` ([Note: the
submit path's tensor view] in unison/torch_backend/tensors.py) and copies otherwise; these
tests hold it to the same memory, values, shape and dtype as the tensor, the storage kept
alive, and a copy exactly where one is needed (a lazily negated tensor's values are its
logical ones, and an in-place all-reduce refuses it rather than writing into a copy).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import unison
import unison.torch_backend as hvd
from unison.common.dtypes import bfloat16
from unison.torch_backend.tensors import result_tensor, to_numpy

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
          torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_to_numpy_is_a_view_with_the_tensors_values(dtype):
    t = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    arr = to_numpy(t)
    np.testing.assert_array_equal(arr, t.numpy())
    assert arr.dtype == t.numpy().dtype and arr.shape == (2, 3, 4) and arr.flags.writeable
    arr[1, 2, 3] = 1
    assert t[1, 2, 3].item() == 1  # shares the tensor's memory


def test_to_numpy_of_views_offsets_and_scalars():
    base = torch.arange(10, dtype=torch.float32)
    np.testing.assert_array_equal(to_numpy(base[3:7]), [3, 4, 5, 6])  # a storage offset
    np.testing.assert_array_equal(to_numpy(base.reshape(2, 5).t()), base.reshape(2, 5).t().numpy())
    assert not np.shares_memory(to_numpy(base.reshape(2, 5).t()), base.numpy())  # non-contiguous: a copy
    scalar = torch.tensor(2.5)
    assert to_numpy(scalar).shape == () and to_numpy(scalar) == 2.5
    assert to_numpy(torch.empty(0, 3)).shape == (0, 3)


def test_to_numpy_of_grad_tensors_bfloat16_and_complex():
    p = torch.ones(3, requires_grad=True)
    np.testing.assert_array_equal(to_numpy(p * 2), [2, 2, 2])
    b = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    arr = to_numpy(b)
    assert arr.dtype == bfloat16
    np.testing.assert_array_equal(arr.astype(np.float32), [1.5, -2.0, 3.25])
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()  # a lazily conjugated view
    np.testing.assert_array_equal(to_numpy(c), [1 - 2j, 3 + 1j])


def test_to_numpy_of_a_lazily_negated_tensor_gives_its_values_and_in_place_ops_refuse_it():
    base = torch.tensor([1.0, -2.0, 3.0])
    neg = torch._neg_view(base)
    assert neg.is_neg() and neg.is_contiguous()
    np.testing.assert_array_equal(to_numpy(neg), [-1.0, 2.0, -3.0])
    unison.init()
    try:
        np.testing.assert_array_equal(hvd.allreduce(neg, op=hvd.Sum).numpy(), [-1.0, 2.0, -3.0])
        with pytest.raises(ValueError, match=r"lazy negation.*resolve_neg"):
            hvd.allreduce_(neg, op=hvd.Sum)
    finally:
        unison.shutdown()


def test_to_numpy_keeps_the_storage_alive():
    arr = to_numpy(torch.full((1 << 16,), 7.0))  # the tensor is dropped at once
    gc.collect()
    junk = [torch.full((1 << 16,), -1.0) for _ in range(8)]  # would reuse freed memory
    assert (arr == 7.0).all()
    del junk


def test_to_numpy_refuses_a_meta_tensor_naming_the_fix():
    with pytest.raises(TypeError, match=r"CPU tensors.*\.cpu\(\)"):
        to_numpy(torch.empty(2, device="meta"))


def test_result_tensor_copies_only_what_may_alias_the_input():
    src = np.arange(6, dtype=np.float32)
    fresh = np.arange(6, dtype=np.float32)
    assert np.shares_memory(result_tensor(fresh, src).numpy(), fresh)
    aliased = result_tensor(src, src)
    assert not np.shares_memory(aliased.numpy(), src)
    np.testing.assert_array_equal(aliased.numpy(), src)


def test_size_one_results_are_new_tensors():
    unison.init()
    try:
        t = torch.arange(4, dtype=torch.float32)
        for out in (hvd.allreduce(t, op=hvd.Sum), hvd.synchronize(hvd.allreduce_async(t, name="x")),
                    hvd.allgather(t), hvd.broadcast(t, 0), hvd.reducescatter(t, op=hvd.Sum)):
            np.testing.assert_array_equal(out.numpy(), t.numpy())
            out.add_(1)  # never the caller's memory
        np.testing.assert_array_equal(t.numpy(), [0, 1, 2, 3])
    finally:
        unison.shutdown()


def test_a_tensor_parallel_checkpoint_of_0_d_tensors_round_trips(tmp_path):
    """BatchNorm's num_batches_tracked and any 0-d parameter: saved as shape (1,) (a contiguous
    copy of a 0-d array is 1-d), so no model with BatchNorm could load its own checkpoint."""
    from torch import nn

    from unison.torch_backend.tensor_parallel_checkpoint import load_tensor_parallel, save_tensor_parallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_parameter("scale", nn.Parameter(torch.tensor(0.5)))
    model(torch.randn(8, 4))  # num_batches_tracked becomes 1
    save_tensor_parallel(tmp_path / "tp", model, local=True)
    other = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    other.register_parameter("scale", nn.Parameter(torch.tensor(0.0)))
    load_tensor_parallel(tmp_path / "tp", other, local=True)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items(), strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name
