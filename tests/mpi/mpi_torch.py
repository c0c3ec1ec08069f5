"""The PyTorch backend under mpirun: equivalence with one process, overlap, autograd, errors."""

from __future__ import annotations

import collections
import copy

import numpy as np
import pytest
import torch
from mpi4py import MPI

import unison.torch_backend as hvd
from unison.common.engine import frontend

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batches(step: int, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's local batch for ``step`` (rank order), from a fixed generator."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(N * b, 6, generator=g)
    y = torch.randn(N * b, 1, generator=g)
    return [(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]) for r in range(N)]


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_n_ranks_match_one_process_on_global_batch(opt_name):
    def make_opt(model):
        if opt_name == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=0.01)

    b, steps = 4, 5
    model = make_model(seed=R)  # ranks start different; the broadcast fixes it
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    ref = make_model(seed=0)
    ref_opt = make_opt(ref)
    for step in range(steps):
        parts = batches(step, b)
        x, y = parts[R]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        gx = torch.cat([p[0] for p in parts])
        gy = torch.cat([p[1] for p in parts])
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(gx), gy).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    everyone = WORLD.allgather(flat)
    assert all(np.array_equal(everyone[0], e) for e in everyone)  # bitwise identical ranks


def test_allreduces_start_before_backward_finishes(monkeypatch):
    events = []
    real = frontend.allreduce_async

    def spy(*args, **kwargs):
        events.append(("submit", kwargs.get("name") or args[2]))
        return real(*args, **kwargs)

    monkeypatch.setattr(frontend, "allreduce_async", spy)
    model = make_model(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.randn(4, 6, requires_grad=True)
    x.register_hook(lambda g: events.append(("input grad", None)))  # the last thing backward computes
    model(x).sum().backward()
    opt.step()
    if N > 1:
        first_input = events.index(("input grad", None))
        submitted_before = [e for e in events[:first_input] if e[0] == "submit"]
        assert len(submitted_before) >= 4, events  # the later layers' gradients were already in flight
        assert submitted_before[0][1] == "4.bias" or submitted_before[0][1] == "4.weight"


def test_backward_passes_per_step_accumulates():
    b = 3
    model = make_model(1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):
            parts = batches(10 * step + micro, b)
            x, y = parts[R]
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            gx, gy = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
            (torch.nn.functional.mse_loss(ref(gx), gy) / 2).backward()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_fp16_compression_within_bounds():
    model = make_model(2)
    exact = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(exact.parameters(), lr=0.0),
                                    named_parameters=[("exact." + n, p) for n, p in exact.named_parameters()])
    x, y = batches(99, 5)[R]
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(exact(x), y).backward()
    opt.synchronize()
    opt2.synchronize()
    for p, q in zip(model.parameters(), exact.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-3, atol=2e-3 * q.grad.abs().max().item())
    with opt.skip_synchronize():
        opt.step()
    with opt2.skip_synchronize():
        opt2.step()


def test_unused_parameter_gets_zero_gradient_everywhere():
    model = make_model(3)
    extra = torch.nn.Parameter(torch.ones(3))
    params = list(model.parameters()) + [extra]
    named = list(model.named_parameters()) + [("extra", extra)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), named_parameters=named)
    x, y = batches(5, 2)[R]
    loss = torch.nn.functional.mse_loss(model(x), y)
    if R == 0:
        loss = loss + extra.sum()  # only rank 0 uses the extra parameter
    loss.backward()
    opt.step()
    torch.testing.assert_close(extra.detach(), torch.full((3,), 1.0 - 0.1 / N))


def test_optimizer_state_broadcast_resumes_identically():
    model = make_model(4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2 + R):  # different histories per rank
        x, y = batches(step + 50 * R, 3)[R]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    states = hvd.allgather_object({k: {kk: (vv.tolist() if torch.is_tensor(vv) else vv)
                                       for kk, vv in v.items()} for k, v in dopt.state_dict()["state"].items()})
    assert all(s == states[0] for s in states)
    for step in range(3):
        x, y = batches(200 + step, 3)[R]
        dopt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        dopt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    everyone = WORLD.allgather(flat)
    assert all(np.array_equal(everyone[0], e) for e in everyone)


def test_bad_usage_errors():
    model = make_model(5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    with pytest.raises(ValueError, match="already a DistributedOptimizer"):
        hvd.DistributedOptimizer(opt)
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[("w", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="does not cover 2 of"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:-2])
    with pytest.raises(ValueError, match="only applies to op=Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    if N > 1:
        x, y = batches(7, 2)[R]
        torch.nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after loss.backward"):
            opt.zero_grad()
        with pytest.raises(RuntimeError, match="needs optimizer.synchronize\\(\\) first"):
            with opt.skip_synchronize():
                opt.step()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()


def test_different_tensors_across_ranks_raise_everywhere():
    if N == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(hvd.MismatchError, match="shape"):
        hvd.allreduce(torch.ones(R + 1), name="torch.mismatch")


def test_collectives_values_and_inplace():
    t = torch.full((3,), float(R))
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Sum), torch.full((3,), float(sum(range(N)))))
    torch.testing.assert_close(hvd.allreduce(t), torch.full((3,), (N - 1) / 2))
    u = t.clone()
    assert hvd.allreduce_(u, op=hvd.Sum) is u
    torch.testing.assert_close(u, torch.full((3,), float(sum(range(N)))))
    h = hvd.allreduce_async(torch.ones(2, dtype=torch.bfloat16), op=hvd.Sum, name="bf16")
    out = hvd.synchronize(h)
    assert out.dtype == torch.bfloat16 and out.tolist() == [float(N)] * 2
    g = hvd.allgather(torch.full((R + 1, 2), R))
    assert g.shape == (N * (N + 1) // 2, 2)
    b = torch.arange(4.0) + R
    hvd.broadcast_(b, root_rank=N - 1)
    torch.testing.assert_close(b, torch.arange(4.0) + N - 1)
    outs = hvd.grouped_allreduce([torch.ones(2), torch.ones(3) * 2], op=hvd.Sum)
    assert [o.tolist() for o in outs] == [[N] * 2, [2 * N] * 3]
    rs = hvd.reducescatter(torch.ones(2 * N, 2), op=hvd.Sum)
    assert rs.shape == (2, 2) and torch.all(rs == N)
    out = hvd.alltoall(torch.arange(N, dtype=torch.float32) + 10 * R)  # Horovod: no splits given, no splits back
    assert out.tolist() == [float(R + 10 * s) for s in range(N)]
    out, splits = hvd.alltoall(torch.arange(N, dtype=torch.float32) + 10 * R, splits=[1] * N)
    assert out.tolist() == [float(R + 10 * s) for s in range(N)] and splits.tolist() == [1] * N
    assert hvd.broadcast_object({"r": R}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(R * 2) == [2 * r for r in range(N)]
    hvd.barrier()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint16, torch.float32], ids=str)
def test_zero_dimensional_tensors_keep_their_shape(dtype):
    """A 0-d tensor comes back 0-d, also for dtypes numpy has no type of its own for (bfloat16,
    uint16 went through a copy that made them (1,))."""
    t = torch.tensor(3, dtype=dtype)
    outs = [hvd.allreduce(t, op=hvd.Sum), hvd.synchronize(hvd.allreduce_async(t, op=hvd.Sum)),
            hvd.broadcast(t, root_rank=0), hvd.grouped_allreduce([t, t], op=hvd.Sum)[1]]
    for out in outs:
        assert out.shape == () and out.dtype == dtype
    assert [int(o.item()) for o in outs] == [3 * N, 3 * N, 3, 3 * N]
    if dtype is not torch.uint16:  # Adasum: floating point only
        a = hvd.allreduce(t.float(), op=hvd.Adasum) if N & (N - 1) == 0 else t.float()
        assert a.shape == ()


def test_autograd_gradients_across_ranks():
    w = torch.arange(3.0) + 10 * R  # rank-specific upstream gradients
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Average) * w).sum().backward()
    torch.testing.assert_close(x.grad, sum(torch.arange(3.0) + 10 * r for r in range(N)) / N)

    x = torch.ones(2, 2, requires_grad=True)
    rows = N * 2
    weights = [torch.arange(rows * 2, dtype=torch.float32).view(rows, 2) * (r + 1) for r in range(N)]
    (hvd.allgather(x) * weights[R]).sum().backward()
    total = sum(weights)
    # Horovod's gradient rules: allgather and broadcast average the upstream gradients over the
    # ranks; reducescatter(Sum) all-gathers them times the set size
    torch.testing.assert_close(x.grad, total[2 * R:2 * R + 2] / N)

    x = torch.ones(3, requires_grad=True)
    (hvd.broadcast(x, root_rank=0) * (R + 1)).sum().backward()
    expect = float(sum(r + 1 for r in range(N))) / N if R == 0 else 0.0
    torch.testing.assert_close(x.grad, torch.full((3,), expect))

    x = torch.ones(N, 2, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * (R + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([torch.full((1, 2), float((r + 1) * N)) for r in range(N)]))

    x = torch.ones(N, requires_grad=True)
    out = hvd.alltoall(x)
    (out * (R + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([float(r + 1) for r in range(N)]))


def test_sync_batch_norm_matches_batch_norm_on_global_batch():
    torch.manual_seed(0)
    full = torch.randn(N * 4, 3, 5, 5)
    bn = torch.nn.BatchNorm2d(3)
    sbn = hvd.SyncBatchNorm(3)
    sbn.load_state_dict(bn.state_dict())
    mine = full[R * 4:(R + 1) * 4].clone().requires_grad_(True)
    ref_in = full.clone().requires_grad_(True)
    out = sbn(mine)
    ref = bn(ref_in)
    torch.testing.assert_close(out, ref[R * 4:(R + 1) * 4], rtol=1e-4, atol=1e-5)
    w = torch.arange(N * 4 * 75, dtype=torch.float32).view(N * 4, 3, 5, 5) / 1000
    (out * w[R * 4:(R + 1) * 4]).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(mine.grad, ref_in.grad[R * 4:(R + 1) * 4], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sbn.running_mean, bn.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sbn.running_var, bn.running_var, rtol=1e-4, atol=1e-6)


def test_default_parameter_names_never_collide_with_unnamed_calls(monkeypatch):
    """Issue 10 item 5: unnamed user calls in flight during backward and step() keep their names."""
    monkeypatch.setattr(frontend, "_counters", collections.Counter())  # unnamed calls from .noname.0
    model = make_model(11)  # the same initial weights on every rank
    ref = copy.deepcopy(model)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))  # default names
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        parts = batches(300 + step, 3)
        x, y = parts[R]
        before = [hvd.allreduce_async(torch.full((2,), float(R + k)), op=hvd.Sum) for k in range(8)]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        during = [hvd.allreduce_async(torch.full((3,), float(R * k)), op=hvd.Sum) for k in range(8)]
        opt.step()
        for k, h in enumerate(before):
            torch.testing.assert_close(hvd.synchronize(h), torch.full((2,), float(sum(r + k for r in range(N)))))
        for k, h in enumerate(during):
            torch.testing.assert_close(hvd.synchronize(h), torch.full((3,), float(sum(r * k for r in range(N)))))
        ref_opt.zero_grad()
        xs, ys = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        torch.nn.functional.mse_loss(ref(xs), ys).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def _uneven_global_batch(dtype, shift, seed):
    """Every rank's (different-sized) batch of a (sum of sizes, 2, 3) global batch, in ``dtype``."""
    sizes = [2 + 3 * r for r in range(N)]
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(sum(sizes), 2, 3, generator=g, dtype=torch.float64) * 2.0 + shift).to(dtype)
    starts = np.cumsum([0] + sizes)
    return full, int(starts[R]), int(starts[R + 1])


@pytest.mark.parametrize("dtype,shift", [(torch.float64, 0.0), (torch.float32, 1000.0),
                                         (torch.bfloat16, 100.0), (torch.float16, 100.0)],
                         ids=["float64", "float32-mean1000", "bf16-mean100", "fp16-mean100"])
def test_sync_batch_norm_low_precision_large_mean_uneven_batches(dtype, shift):
    """Issue 10 item 4: statistics, input/weight/bias gradients and running stats vs BatchNorm in float64
    on the concatenated global batch, with a different batch size on every rank."""
    full, lo, hi = _uneven_global_batch(dtype, shift, seed=42)
    sbn = hvd.SyncBatchNorm(2).to(torch.float64 if dtype == torch.float64 else torch.float32)
    bn = torch.nn.BatchNorm1d(2).double()
    with torch.no_grad():
        for m in (sbn, bn):
            m.weight.copy_(torch.tensor([1.5, -0.5]))
            m.bias.copy_(torch.tensor([0.25, 2.0]))
    tol = {torch.float64: (1e-9, 1e-9), torch.float32: (1e-4, 1e-4)}.get(dtype, (2e-2, 4e-2))
    for step in range(2):
        mine = full[lo:hi].clone().requires_grad_(True)
        ref_in = full.double().clone().requires_grad_(True)  # the same (rounded) values, in float64
        out, ref = sbn(mine), bn(ref_in)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref[lo:hi].detach(), rtol=tol[0], atol=tol[1])
        w = torch.linspace(-1.0, 1.0, full.numel(), dtype=torch.float64).view(full.shape) * (step + 1)
        (out.double() * w[lo:hi]).sum().backward()
        (ref * w).sum().backward()
        gx = mine.grad.double()
        scale = float(ref_in.grad.abs().max())
        torch.testing.assert_close(gx, ref_in.grad[lo:hi], rtol=tol[0], atol=tol[1] * scale)
        for mp, rp in ((sbn.weight, bn.weight), (sbn.bias, bn.bias)):  # local sums add up to the global
            total = torch.from_numpy(WORLD.allreduce(mp.grad.double().numpy()))
            torch.testing.assert_close(total, rp.grad, rtol=tol[0],
                                       atol=tol[1] * max(1.0, float(rp.grad.abs().max())))
            mp.grad, rp.grad = None, None
    torch.testing.assert_close(sbn.running_mean.double(), bn.running_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sbn.running_var.double(), bn.running_var, rtol=1e-4, atol=1e-5)
    assert int(sbn.num_batches_tracked) == 2
    sbn.eval()
    bn.eval()
    torch.testing.assert_close(sbn(full[lo:hi]).double(), bn(full.double())[lo:hi].detach(),
                               rtol=tol[0], atol=tol[1])
