"""The PyTorch backend under real mpirun at 1-4 ranks, and gradcheck in one process."""

from __future__ import annotations

import pytest
import torch
from harness import run_rank_suite


@pytest.mark.mpi
@pytest.mark.timeout(660)
@pytest.mark.parametrize("np_", [1, 3, 4])  # 2 ranks: the other suites (suite budget)
def test_torch_backend(np_, tmp_path):
    # the machine running the suite may be loaded: a rank dumps its stacks only after 500 s
    run_rank_suite(np_, "mpi_torch.py", tmp_path, timeout=540, extra_env={"TEST_HANG_DUMP_S": "500"})


def test_gradcheck_each_autograd_op():
    import unison.torch_backend as hvd

    hvd.init()
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    ops = {
        "allreduce": lambda t: hvd.allreduce(t, op=hvd.Average),
        "allreduce_scaled": lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0),
        "allgather": lambda t: hvd.allgather(t),
        "broadcast": lambda t: hvd.broadcast(t, root_rank=0),
        "reducescatter": lambda t: hvd.reducescatter(t, op=hvd.Average),
        "alltoall": lambda t: hvd.alltoall(t)[0],
    }
    for name, fn in ops.items():
        assert torch.autograd.gradcheck(fn, (x,)), name


def test_sync_batch_norm_bf16_large_mean_in_one_process():
    """Issue 10 item 4, the reported case: ``(randn(256, 1) + 100).bfloat16()`` gave NaN/garbage."""
    import unison.torch_backend as hvd

    hvd.init()
    torch.manual_seed(0)
    x = (torch.randn(256, 1) + 100).bfloat16()
    out = hvd.SyncBatchNorm(1)(x)
    ref = torch.nn.BatchNorm1d(1).double()(x.double())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-2, atol=2e-2)
