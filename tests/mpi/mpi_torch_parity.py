"""``unison.torch_backend`` against Horovod 0.28's ``horovod.torch``, call for call (docs/horovod.md).

Every rank runs these tests in the same order; each rank rebuilds every rank's
inputs and checks results and gradients against numpy.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from mpi4py import MPI

import unison.torch_backend as hvd
from unison.collectives import adasum
from unison.common.engine.requests import AUTO_NAME_SLOTS

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
torch.set_num_threads(1)
multi = pytest.mark.skipif(N == 1, reason="needs two ranks")

#: every public name of horovod.torch 0.28 (its __init__ imports)
HOROVOD_TORCH_NAMES = """
Compression allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters allreduce
allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async grouped_allreduce_
grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async grouped_allgather
grouped_allgather_async broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async
reducescatter reducescatter_async grouped_reducescatter grouped_reducescatter_async join barrier poll
synchronize init shutdown is_initialized start_timeline stop_timeline size local_size cross_size rank
local_rank cross_rank mpi_threads_supported mpi_enabled mpi_built gloo_enabled gloo_built nccl_built
ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set add_process_set remove_process_set
Average Sum Adasum Min Max Product DistributedOptimizer SyncBatchNorm elastic
""".split()


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


def per_rank(fn):
    """[fn(0), ..., fn(N-1)]: every rank's input, rebuilt on each rank."""
    return [fn(r) for r in range(N)]


# ----------------------------------------------------------------- names and queries

def test_every_horovod_torch_name_exists():
    missing = [n for n in HOROVOD_TORCH_NAMES if not hasattr(hvd, n)]
    assert not missing, missing


def test_capability_queries_describe_this_build():
    assert hvd.mpi_built() is True and hvd.mpi_enabled() is True
    for query in (hvd.gloo_built, hvd.gloo_enabled, hvd.nccl_built, hvd.ddl_built, hvd.ccl_built,
                  hvd.cuda_built, hvd.rocm_built):
        assert query() is False, query.__name__
    assert isinstance(hvd.mpi_threads_supported(), bool)
    sizes = WORLD.allgather(hvd.local_size())
    assert hvd.is_homogeneous() is all(s == sizes[0] for s in sizes)
    assert list(inspect.signature(hvd.start_timeline).parameters) == ["file_path", "mark_cycles"]
    assert list(inspect.signature(hvd.stop_timeline).parameters) == []
    assert hvd.is_initialized() and hvd.size() == N and hvd.rank() == R


def test_timeline_start_stop(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tl") / f"timeline{R}.json")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(2), name="parity.timeline")
    hvd.stop_timeline()
    if R == 0:  # rank 0 writes it: a Chrome trace (a JSON list of events) with the tensor's own row
        import json

        with open(path) as f:
            events = json.load(f)
        assert isinstance(events, list) and all("ph" in e for e in events)
        rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert "parity.timeline" in rows.values()
        assert any(e["ph"] == "B" and rows.get(e.get("tid")) == "parity.timeline" for e in events)
        assert not any("cycle" in e["name"].lower() for e in events)  # mark_cycles accepted, not marked


# ----------------------------------------------------------------- return types

def test_return_types_match_horovod():
    t = torch.arange(N * 2, dtype=torch.float32).view(N, 2) + R
    assert isinstance(hvd.allreduce(t), torch.Tensor)
    u = t.clone()
    assert hvd.allreduce_(u) is u
    h = hvd.allreduce_async(t)
    assert isinstance(hvd.poll(h), bool) and isinstance(hvd.synchronize(h), torch.Tensor)
    assert torch.equal(hvd.synchronize(h), hvd.synchronize(h))  # synchronizing again gives the result again
    assert isinstance(hvd.grouped_allreduce([t, t]), list)
    assert isinstance(hvd.synchronize(hvd.grouped_allreduce_async([t, t])), list)
    assert isinstance(hvd.grouped_allgather([t, t]), list)
    assert isinstance(hvd.grouped_reducescatter([t, t]), list)
    v = t.clone()
    assert hvd.broadcast_(v, 0) is v
    out = hvd.alltoall(t)
    assert isinstance(out, torch.Tensor)  # without splits: the tensor alone
    out, recv = hvd.alltoall(t, splits=[1] * N)
    assert recv.dtype == torch.int32 and recv.tolist() == [1] * N
    out, recv = hvd.alltoall(t, splits=torch.ones(N, dtype=torch.int64))
    assert recv.dtype == torch.int64  # the splits' own dtype
    res = hvd.synchronize(hvd.alltoall_async(t))
    assert isinstance(res, tuple) and len(res) == 2 and res[1].dtype == torch.int32
    assert hvd.barrier() is None
    assert isinstance(hvd.reducescatter(t), torch.Tensor)


# ----------------------------------------------------------------- allreduce

@pytest.mark.parametrize("op,fn", [("Sum", np.sum), ("Average", np.mean), ("Min", np.min),
                                   ("Max", np.max), ("Product", np.prod)])
def test_allreduce_ops_against_numpy(op, fn):
    inputs = per_rank(lambda r: np.arange(6, dtype=np.float64).reshape(2, 3) * (r + 1) - r)
    out = hvd.allreduce(torch.from_numpy(inputs[R]), op=getattr(hvd, op), prescale_factor=0.5,
                        postscale_factor=3.0)
    np.testing.assert_allclose(out.numpy(), 3.0 * fn([0.5 * x for x in inputs], axis=0), rtol=1e-12)


def test_allreduce_builds_an_autograd_node_only_when_there_is_something_to_differentiate():
    """A tensor that needs no gradient (or grad mode off) skips the autograd Function: same values,
    no grad_fn; one that does gets a node whose gradient is the all-reduce of the output's."""
    x = torch.full((3,), R + 1.0, requires_grad=True)
    with torch.no_grad():
        plain = hvd.allreduce(x, op=hvd.Sum, name="parity.nograd")
    assert plain.grad_fn is None and not plain.requires_grad
    plain2 = hvd.allreduce(torch.full((3,), R + 1.0), op=hvd.Sum, name="parity.nograd2")
    total = float(sum(r + 1 for r in range(N)))
    torch.testing.assert_close(plain, torch.full((3,), total))
    torch.testing.assert_close(plain2, plain)
    out = hvd.allreduce(x, op=hvd.Sum, name="parity.grad")
    assert out.grad_fn is not None
    (out * (R + 1)).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), total))


def test_deprecated_average_flag():
    t = torch.full((2,), float(R))
    torch.testing.assert_close(hvd.allreduce(t, average=False), torch.full((2,), float(sum(range(N)))))
    torch.testing.assert_close(hvd.allreduce(t, average=True), torch.full((2,), (N - 1) / 2))
    with pytest.raises(ValueError):
        hvd.allreduce(t, average=True, op=hvd.Sum)


def test_allreduce_of_sparse_tensor_is_refused():
    s = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.tensor([1.0]), (3,))
    with pytest.raises(ValueError, match="sparse"):
        hvd.allreduce(s)


def test_sparse_allreduce_async_gathers_and_averages():
    def sparse(r):
        return torch.sparse_coo_tensor(torch.tensor([[r % 4, (r + 1) % 4]]), torch.tensor([r + 1.0, 10.0]), (4,))

    for op, scale in ((hvd.Average, 1.0 / N), (hvd.Sum, 1.0)):
        h = hvd.sparse_allreduce_async(sparse(R), name=f"parity.sparse.{op!r}", op=op)
        out = h()  # Horovod's handle is called
        assert out.is_sparse and out.shape == (4,) and out._nnz() == 2 * N
        expect = sum(sparse(r).to_dense() for r in range(N)) * scale
        torch.testing.assert_close(out.to_dense(), expect)
        torch.testing.assert_close(hvd.synchronize(h).to_dense(), expect)
    with pytest.raises(ValueError, match="sparse COO"):
        hvd.sparse_allreduce_async(torch.ones(2), "parity.dense", hvd.Average)


def test_grouped_allreduce_is_differentiable():
    xs = [torch.ones(3, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
    (outs[0] * (R + 1)).sum().backward(retain_graph=True)
    (outs[1] * 2 * (R + 1)).sum().backward()
    total = float(sum(r + 1 for r in range(N)))
    torch.testing.assert_close(xs[0].grad, torch.full((3,), total))
    torch.testing.assert_close(xs[1].grad, torch.full((2, 2), 2 * total))


# ----------------------------------------------------------------- gradients (Horovod: averaged)

def test_allgather_gradient_is_my_slice_of_the_average():
    rows = per_rank(lambda r: r + 1)
    total = sum(rows)
    weights = per_rank(lambda r: np.arange(total * 2, dtype=np.float64).reshape(total, 2) * (r + 1))
    x = torch.ones(rows[R], 2, dtype=torch.float64, requires_grad=True)
    (hvd.allgather(x) * torch.from_numpy(weights[R])).sum().backward()
    start = sum(rows[:R])
    np.testing.assert_allclose(x.grad.numpy(), np.mean(weights, axis=0)[start:start + rows[R]])


def test_grouped_allgather_gradient():
    rows = per_rank(lambda r: r + 2)
    total = sum(rows)
    xs = [torch.ones(rows[R], 3, requires_grad=True), torch.ones(rows[R], requires_grad=True)]
    outs = hvd.grouped_allgather(xs)
    assert [o.shape[0] for o in outs] == [total, total]
    w = per_rank(lambda r: np.arange(total, dtype=np.float32) * (r + 1))
    (outs[0] * torch.from_numpy(w[R])[:, None]).sum().backward(retain_graph=True)
    (outs[1] * torch.from_numpy(w[R])).sum().backward()
    start = sum(rows[:R])
    mine = np.mean(w, axis=0)[start:start + rows[R]]
    np.testing.assert_allclose(xs[0].grad.numpy(), np.repeat(mine[:, None], 3, axis=1), rtol=1e-6)
    np.testing.assert_allclose(xs[1].grad.numpy(), mine, rtol=1e-6)


@pytest.mark.parametrize("root", [0, N - 1])
def test_broadcast_gradient_is_the_average_on_the_root(root):
    x = torch.ones(3, requires_grad=True)
    (hvd.broadcast(x, root_rank=root) * (R + 1)).sum().backward()
    expect = np.mean([r + 1.0 for r in range(N)]) if R == root else 0.0
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, expect), rtol=1e-6)


@pytest.mark.parametrize("op_name", ["Sum", "Average"])
def test_reducescatter_gradient(op_name):
    op = getattr(hvd, op_name)
    x = torch.ones(2 * N, 3, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, op=op, prescale_factor=0.5, postscale_factor=4.0) * (R + 1)).sum().backward()
    factor = (N if op_name == "Sum" else 1) * 0.5 * 4.0
    expect = np.concatenate([np.full((2, 3), (r + 1) * factor) for r in range(N)])
    np.testing.assert_allclose(x.grad.numpy(), expect)


def test_grouped_reducescatter_values_and_gradient():
    inputs = per_rank(lambda r: np.arange(4 * N, dtype=np.float64).reshape(2 * N, 2) + r)
    xs = [torch.from_numpy(inputs[R]).clone().requires_grad_(True) for _ in range(2)]
    outs = hvd.grouped_reducescatter(xs, op=hvd.Sum)
    np.testing.assert_allclose(outs[0].detach().numpy(), np.sum(inputs, axis=0)[2 * R:2 * R + 2])
    (outs[0] * (R + 1)).sum().backward(retain_graph=True)
    outs[1].sum().backward()
    np.testing.assert_allclose(xs[0].grad.numpy(),
                               np.concatenate([np.full((2, 2), (r + 1.0) * N) for r in range(N)]))
    np.testing.assert_allclose(xs[1].grad.numpy(), np.full((2 * N, 2), float(N)))


def test_alltoall_gradient_goes_back():
    x = torch.ones(N, requires_grad=True)
    (hvd.alltoall(x) * (R + 1)).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [r + 1.0 for r in range(N)])


# ----------------------------------------------------------------- reducescatter rows

@pytest.mark.parametrize("op_name,fn", [("Sum", np.sum), ("Average", np.mean)])
def test_reducescatter_values_with_factors(op_name, fn):
    inputs = per_rank(lambda r: np.arange(6 * N, dtype=np.float32).reshape(3 * N, 2) * (r + 1))
    out = hvd.reducescatter(torch.from_numpy(inputs[R]), op=getattr(hvd, op_name), prescale_factor=2.0,
                            postscale_factor=0.25)
    expect = 0.25 * fn([2.0 * x for x in inputs], axis=0)[3 * R:3 * R + 3]
    np.testing.assert_allclose(out.numpy(), expect, rtol=1e-6)


def test_reducescatter_scalar_input_raises_everywhere():
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.reducescatter(torch.tensor(float(R)))


@multi
def test_reducescatter_type_mismatch_raises_everywhere():
    t = torch.ones(N, 2, dtype=torch.float32 if R == 0 else torch.float64)
    with pytest.raises(RuntimeError):  # Horovod: HorovodInternalError, a RuntimeError
        hvd.reducescatter(t, name="parity.rs.mismatch")


# ----------------------------------------------------------------- compression

def test_fp16_compression_on_torch_tensors():
    t = torch.arange(6, dtype=torch.float64).view(2, 3) + R
    c, ctx = hvd.Compression.fp16.compress(t)
    assert isinstance(c, torch.Tensor) and c.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(c, ctx)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.float64
    i, ictx = hvd.Compression.fp16.compress(torch.ones(2, dtype=torch.int32))
    assert i.dtype == torch.int32 and hvd.Compression.fp16.decompress(i, ictx).dtype == torch.int32
    x = t.clone().float().requires_grad_(True)
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.detach().numpy(), sum(np.arange(6.0).reshape(2, 3) + r for r in range(N)))
    out.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full((2, 3), float(N)))
    rs = hvd.reducescatter(torch.ones(N, 2), op=hvd.Sum, compression=hvd.Compression.fp16)
    assert rs.dtype == torch.float32 and torch.all(rs == N)


# ----------------------------------------------------------------- duplicate names

@multi
@pytest.mark.parametrize("kind", ["allreduce", "allgather", "broadcast", "reducescatter"])
def test_duplicate_pending_name_raises_value_error_at_once(kind):
    t = torch.ones(N, 2)
    submit = {
        "allreduce": lambda name: hvd.allreduce_async(t, name=name),
        "allgather": lambda name: hvd.allgather_async(t, name=name),
        "broadcast": lambda name: hvd.broadcast_async(t, 0, name=name),
        "reducescatter": lambda name: hvd.reducescatter_async(t, name=name),
    }[kind]
    name = f"parity.dup.{kind}"
    if R == 0:  # the other ranks have not submitted it yet: it is pending here
        first = submit(name)
        with pytest.raises(ValueError):
            submit(name)
    hvd.barrier()
    if R != 0:
        first = submit(name)
    hvd.synchronize(first)


# ----------------------------------------------------------------- process sets

def _sets():
    even = [r for r in range(N) if r % 2 == 0]
    odd = [r for r in range(N) if r % 2 == 1] or [0]
    return even, odd


def test_process_sets_in_every_op():
    even, odd = _sets()
    ps_even, ps_odd = hvd.add_process_set(even), hvd.add_process_set(hvd.ProcessSet(odd))
    mine = ps_even if R in even else ps_odd
    members = even if R in even else odd
    assert mine.included() and mine.size() == len(members) and mine.rank() == members.index(R)
    t = torch.full((len(members) * 2, 2), float(R))
    torch.testing.assert_close(hvd.allreduce(t, op=hvd.Sum, process_set=mine),
                               torch.full_like(t, float(sum(members))))
    gathered = hvd.allgather(torch.full((1,), float(R)), process_set=mine)
    assert gathered.tolist() == [float(m) for m in members]
    for root in members:  # root_rank is a global rank, as in Horovod
        torch.testing.assert_close(hvd.broadcast(t, root, process_set=mine), torch.full_like(t, float(root)))
    rs = hvd.reducescatter(t, op=hvd.Average, process_set=mine, postscale_factor=2.0)
    torch.testing.assert_close(rs, torch.full((2, 2), 2.0 * float(np.mean(members))))
    grs = hvd.grouped_reducescatter([t, t], op=hvd.Sum, process_set=mine)
    torch.testing.assert_close(grs[1], torch.full((2, 2), float(sum(members))))
    out = hvd.alltoall(torch.arange(len(members), dtype=torch.float32), process_set=mine)
    assert out.tolist() == [float(members.index(R))] * len(members)
    hvd.barrier(process_set=mine)
    g = torch.full((3,), float(R))
    torch.testing.assert_close(hvd.allreduce(g, op=hvd.Sum, process_set=hvd.global_process_set),
                               torch.full_like(g, float(sum(range(N)))))
    x = torch.ones(1, requires_grad=True)
    (hvd.allgather(x, process_set=mine) * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((1,), 2.0))
    with pytest.raises(ValueError, match="not a member"):
        hvd.broadcast(t, root_rank=next(r for r in range(N + 1) if r not in members), process_set=mine)
    assert hvd.remove_process_set(hvd.global_process_set) is False
    assert hvd.remove_process_set(ps_even) is True and hvd.remove_process_set(ps_odd) is True
    with pytest.raises(ValueError):
        hvd.allreduce(t, process_set=mine)


@multi
def test_non_member_gets_value_error():
    ps = hvd.add_process_set([0])
    if R != 0:
        with pytest.raises(ValueError, match="not a member"):
            hvd.allreduce(torch.ones(2), process_set=ps)
    else:
        torch.testing.assert_close(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=ps), torch.ones(2))
    hvd.barrier()  # the next test shuts down: rank 0's set-only allreduce must be done everywhere first
    hvd.remove_process_set(ps)


@multi
def test_optimizer_on_a_process_set_steps_locally_outside_it():
    """Horovod's rule: a rank outside the optimizer's process set takes plain local steps."""
    ps = hvd.add_process_set(list(range(N - 1)))
    model, ref = _linear(0), _linear(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=ps)
    x, y = _batch(R, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    if R == N - 1:
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q)
    hvd.barrier()
    hvd.remove_process_set(ps)


def test_init_with_process_sets_and_dynamic():
    hvd.barrier()  # every rank is done with the previous tests' collectives before any shuts down
    hvd.shutdown()
    first = hvd.ProcessSet(range(N))
    hvd.init(process_sets=[first])
    assert first.process_set_id is not None
    torch.testing.assert_close(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=first),
                               torch.full((2,), float(N)))
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    late = hvd.add_process_set(list(range(N)))
    torch.testing.assert_close(hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=late),
                               torch.full((2,), float(N)))


@pytest.mark.skipif(N < 3, reason="two sets of two ranks, one shared")
def test_sync_batch_norm_on_a_set_whose_id_a_new_init_gives_again():
    """Its calls were numbered per set id in a count kept across init(): the new set [1, 2] got the old
    set [0, 1]'s id, rank 1 went on from its count and rank 2 started at 0, and both waited for ever
    (before 2026-12-05)."""
    def stats(members, seed):
        x = [torch.randn(4, 3, generator=torch.Generator().manual_seed(seed + r)) for r in range(N)]
        ps = hvd.add_process_set(members)
        if ps.included():
            out = hvd.SyncBatchNorm(3, process_set=ps)(x[R])
            every = torch.cat([x[r] for r in members])
            k = members.index(R)
            want = torch.nn.functional.batch_norm(every, None, None, training=True)[4 * k:4 * k + 4]
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        return ps.process_set_id

    hvd.barrier()
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    first = stats([0, 1], 10)
    hvd.barrier()
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    assert stats([1, 2], 20) == first


# ----------------------------------------------------------------- Adasum

def test_adasum_against_the_numpy_tree():
    inputs = per_rank(lambda r: np.random.default_rng(r).standard_normal((5, 3)))
    if N & (N - 1):  # Horovod: NotImplementedError at np=3
        with pytest.raises(NotImplementedError, match="non-power of 2"):
            hvd.allreduce(torch.from_numpy(inputs[R]), op=hvd.Adasum)
        return
    x = torch.from_numpy(inputs[R]).clone().requires_grad_(True)
    out = hvd.allreduce(x, op=hvd.Adasum)
    np.testing.assert_allclose(out.detach().numpy(), adasum.reference(inputs), rtol=1e-10)
    everyone = WORLD.allgather(out.detach().numpy())
    assert all(np.array_equal(e, everyone[0]) for e in everyone)
    grouped = hvd.grouped_allreduce([x.detach(), 2 * x.detach()], op=hvd.Adasum)
    np.testing.assert_allclose(grouped[1].numpy(), adasum.reference([2 * v for v in inputs]), rtol=1e-10)
    if N > 1:
        with pytest.raises(NotImplementedError, match="process sets"):
            hvd.allreduce(x, op=hvd.Adasum, process_set=hvd.add_process_set([0, 1]))



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_adasum_of_narrow_float_tensors_keeps_their_dtype(dtype):
    """docs/horovod.md's Adasum row: float16/32 and bfloat16 tensors too (float64 above), within
    the dtype's rounding of the float64 tree."""
    if N & (N - 1):
        return  # np 3: the error is tested above
    inputs = per_rank(lambda r: np.random.default_rng(10 + r).standard_normal((4, 5)))
    out = hvd.allreduce(torch.from_numpy(inputs[R]).to(dtype), op=hvd.Adasum)
    assert out.dtype == dtype
    rounded = [torch.from_numpy(v).to(dtype).double().numpy() for v in inputs]
    tol = {torch.float16: 5e-3, torch.bfloat16: 4e-2, torch.float32: 1e-5}[dtype]
    np.testing.assert_allclose(out.double().numpy(), adasum.reference(rounded), rtol=tol, atol=tol)


# ----------------------------------------------------------------- DistributedOptimizer and functions

def _linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _batch(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + r)
    return torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)


def _train_matches_global_batch(model, opt, steps=2, lr=0.1):
    ref = _linear(0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for step in range(steps):
        x, y = _batch(R, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(torch.nn.functional.mse_loss(ref(_batch(r, step)[0]), _batch(r, step)[1]) for r in range(N)).div(
            N).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_optimizer_without_named_parameters_and_horovod_attributes():
    model = _linear(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    names = opt._parameter_names  # Horovod's map, which user code reads
    assert set(names) == set(model.parameters()) and len(set(names.values())) == 4
    assert opt.backward_passes_per_step == 1 and opt.op == hvd.Average
    assert opt.gradient_predivide_factor == 1.0 and opt.sparse_as_dense is False
    opt.set_backward_passes_per_step(1)
    _train_matches_global_batch(model, opt)


def test_optimizer_with_torch_compile():
    model = _linear(0)
    compiled = torch.compile(model, backend="aot_eager")
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    _train_matches_global_batch(compiled, opt)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_optimizer_sparse_gradients_with_sparse_adam(sparse_as_dense):
    """Gathered, or reduced dense and made sparse again (Horovod's sparse_as_dense): SparseAdam takes both."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(8, 3, sparse=True)
    ref = torch.nn.Embedding(8, 3, sparse=True)
    ref.load_state_dict(emb.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
    ref_opt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.1)
    ids = per_rank(lambda r: torch.tensor([r % 8, (r + 3) % 8]))
    for _ in range(2):
        opt.zero_grad()
        emb(ids[R]).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(ref(i).sum() for i in ids) / N).backward()
        ref_opt.step()
    torch.testing.assert_close(emb.weight, ref.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("scenario", ["skips", "unused_at_first"])
def test_a_sparse_gradient_missing_on_some_ranks_is_reduced_as_zeros(scenario, sparse_as_dense):
    """Before: a rank whose step did not touch a sparse embedding sent its zeros dense (an all-reduce) while
    the others all-gathered their rows under other names, and every rank waited for ever. "skips": rank 0
    skips the embedding in the first step (no rank knows its kind yet there, rank 0 least) and the last rank
    in the third. "unused_at_first": no rank uses it in the first step (it is settled dense), then rank 0
    only. SGD against one process's average of the ranks' gradients; the kinds are agreed once, though a
    parameter is never used (a spare head)."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 3, sparse=True)
            self.head = torch.nn.Linear(3, 1)
            self.spare = torch.nn.Linear(3, 1)  # never used: no gradient on any rank, ever

        def forward(self, ids, use_emb):
            h = self.emb(ids) if use_emb else torch.ones(len(ids), 3)
            return self.head(h).sum()

    net, ref = Net(), Net()
    ref.load_state_dict(net.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1),
                                   named_parameters=net.named_parameters(), sparse_as_dense=sparse_as_dense)
    agreements = []
    agree = opt._agree_on_kinds
    opt._agree_on_kinds = lambda: (agreements.append(1), agree())[1]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = per_rank(lambda r: torch.tensor([r % 8, (r + 3) % 8]))
    for step in range(4):
        if scenario == "skips":
            uses = [{0: 0, 2: N - 1}.get(step) != r for r in range(N)]
        else:
            uses = [step > 1 or (step == 1 and r == 0) for r in range(N)]
        opt.zero_grad()
        net(ids[R], uses[R]).backward()
        opt.step()
        assert net.emb.weight.grad is not None
        if scenario == "skips":
            assert net.emb.weight.grad.is_sparse
        ref_opt.zero_grad()
        (sum(ref(ids[r], uses[r]) for r in range(N)) / N).backward()
        ref_opt.step()
        torch.testing.assert_close(net.emb.weight, ref.emb.weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(net.head.weight, ref.head.weight, rtol=1e-5, atol=1e-6)
    assert opt._kinds_settled and len(agreements) == 1


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_a_gradient_dense_on_one_rank_and_sparse_on_another_raises_everywhere(sparse_as_dense):
    """...unless sparse_as_dense reduces both densely (it did before the kinds were agreed, and still does)."""
    emb = torch.nn.Embedding(4, 2, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
    opt.zero_grad()
    # set by hand, so no hook submits them: what a rank whose model differs would hold at synchronize()
    sparse = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2))
    emb.weight.grad = torch.ones(4, 2) if R == 0 else sparse
    if not sparse_as_dense:
        with pytest.raises(ValueError, match="dense on some ranks and sparse on others"):
            opt.synchronize()
        return
    opt.synchronize()
    want = (torch.ones(4, 2) + (N - 1) * sparse.to_dense()) / N
    torch.testing.assert_close(emb.weight.grad.to_dense(), want)


_COMBINE = {"average": (hvd.Average, lambda g: g.mean(0)), "sum": (hvd.Sum, lambda g: g.sum(0)),
            "min": (hvd.Min, lambda g: g.min(0)), "max": (hvd.Max, lambda g: g.max(0)),
            "product": (hvd.Product, lambda g: g.prod(0))}
_OPTION = {"plain": {}, "compression": {"compression": hvd.Compression.fp16},
           "passes": {"backward_passes_per_step": 2}, "groups": {"num_groups": 2},
           "predivide": {"gradient_predivide_factor": 2.0}, "process_set": {}}


@pytest.mark.parametrize("option", list(_OPTION))
@pytest.mark.parametrize("op_name", list(_COMBINE))
def test_optimizer_option_combinations_equal_one_process(op_name, option):
    """docs/horovod.md, "Options of DistributedOptimizer that combine": every "yes" cell of the dense
    columns, one SGD step against each rank's gradient (summed over its passes) combined with the op
    in numpy; on a process set, its members combine theirs and the rank outside steps alone."""
    if option == "predivide" and op_name != "average":
        return  # raises: test_torch_optimizer_options.py
    op, combine = _COMBINE[op_name]
    kwargs = dict(_OPTION[option])
    members = list(range(N))
    if option == "process_set":
        members = list(range(max(N - 1, 1)))
        kwargs["process_set"] = ps = hvd.add_process_set(members)
    passes = kwargs.get("backward_passes_per_step", 1)

    def local_grads(r: int) -> list[np.ndarray]:
        m = _linear(0)
        for k in range(passes):
            x, y = _batch(r, k)
            torch.nn.functional.mse_loss(m(x), y).backward()
        return [p.grad.numpy().copy() for p in m.parameters()]

    model = _linear(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=op,
                                   named_parameters=[(f"combo.{op_name}.{option}.{n}", p)
                                                     for n, p in model.named_parameters()], **kwargs)
    for k in range(passes):
        x, y = _batch(R, k)
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    grads = [local_grads(r) for r in (members if R in members else [R])]
    tol = 2e-3 if option == "compression" else 1e-5
    for i, (p, p0) in enumerate(zip(model.parameters(), _linear(0).parameters(), strict=True)):
        g = combine(np.stack([gr[i] for gr in grads]))
        np.testing.assert_allclose(p.detach().numpy(), p0.detach().numpy() - 0.1 * g, rtol=tol,
                                   atol=tol * 0.1 * (np.abs(g).max() + 1e-3))
    if option == "process_set":
        hvd.barrier()
        hvd.remove_process_set(ps)


@pytest.mark.parametrize("op_name", list(_COMBINE))
def test_optimizer_sparse_gradients_with_each_op(op_name):
    """Sparse gradients are all-gathered and summed where rows meet: right for Average and Sum; for
    Min/Max/Product that would be a silent sum (Horovod's behaviour), so it raises, naming the fix,
    and sparse_as_dense=True reduces them densely with the op."""
    op, combine = _COMBINE[op_name]
    ids = [torch.tensor([r % 5, (r + 2) % 5]) for r in range(N)]

    def emb() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Embedding(5, 2, sparse=True)

    def step(dense: bool) -> torch.nn.Module:
        e = emb()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(e.parameters(), lr=0.1), op=op, sparse_as_dense=dense,
                                       named_parameters=[(f"sparse.{op_name}.{dense}.weight", e.weight)])
        (e(ids[R]) * (R + 2)).sum().backward()
        opt.step()
        return e

    def local_grad(r: int) -> np.ndarray:
        e = emb()
        (e(ids[r]) * (r + 2)).sum().backward()
        return e.weight.grad.to_dense().numpy()

    expect = emb().weight.detach().numpy() - 0.1 * combine(np.stack([local_grad(r) for r in range(N)]))
    if op_name in ("average", "sum"):
        np.testing.assert_allclose(step(False).weight.detach().numpy(), expect, rtol=1e-6, atol=1e-6)
    else:
        with pytest.raises(ValueError, match=r"sparse gradient.*sparse_as_dense=True"):
            step(False)
    np.testing.assert_allclose(step(True).weight.detach().numpy(), expect, rtol=1e-6, atol=1e-6)


def test_optimizer_adasum():
    model = _linear(0)
    if N & (N - 1):  # refused when built, on every rank (step() raised after the local step: ranks apart)
        with pytest.raises(NotImplementedError, match="non-power of 2"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), op=hvd.Adasum)
        return
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    start = [p.detach().clone() for p in model.parameters()]
    x, y = _batch(R, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    deltas = []
    for r in range(N):  # every rank's local SGD change, rebuilt here
        local = _linear(0)
        xr, yr = _batch(r, 0)
        torch.nn.functional.mse_loss(local(xr), yr).backward()
        deltas.append([-0.1 * p.grad.numpy() for p in local.parameters()])
    for i, (p, s) in enumerate(zip(model.parameters(), start, strict=True)):
        expect = s.numpy() + adasum.reference([d[i] for d in deltas])
        np.testing.assert_allclose(p.detach().numpy(), expect, rtol=1e-5, atol=1e-6)


def test_broadcast_parameters_and_state_with_frozen_and_gradless_parameters():
    model = _linear(R)
    model[0].weight.requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # fresh optimizer: no state, no gradients
    assert not opt.state  # no hidden zero-gradient step (Horovod takes one: docs/horovod.md)
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    x, y = _batch(R, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    dopt.step()
    hvd.broadcast_optimizer_state(dopt, root_rank=0)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    assert all(np.array_equal(e, flat) for e in WORLD.allgather(flat))


def test_broadcast_optimizer_state_from_a_root_that_stepped_to_ranks_that_did_not():
    """Only the root has stepped (a restored or warmed-up root): every rank gets its moments and step."""
    model = _linear(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    if R == 0:
        x, y = _batch(0, 0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    else:
        assert not opt.state
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    states = [opt.state[p] for p in model.parameters()]
    assert all(s for s in states)
    flat = torch.cat([torch.cat([s["exp_avg"].flatten(), s["exp_avg_sq"].flatten(), s["step"].reshape(1)])
                      for s in states]).numpy()
    assert float(states[0]["step"]) == 1.0
    assert all(np.array_equal(e, flat) for e in WORLD.allgather(flat))


def test_broadcast_parameters_takes_bare_tensors_as_horovod():
    """``model.parameters()`` as well as pairs; a parameter of exactly two rows is not a pair."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(R))
    hvd.broadcast_parameters(list(model.parameters()), root_rank=N - 1)
    assert all(torch.equal(p, torch.full_like(p, float(N - 1))) for p in model.parameters())


@multi
def test_broadcast_parameters_of_different_models_raises_on_every_rank():
    """A parameter on one rank only was a named broadcast no other rank made: that rank waited for ever
    (before 2026-12-05). Now the ranks agree on the names first and every rank raises, naming it."""
    params = {"a": torch.zeros(3), **({"extra": torch.zeros(2)} if R == 0 else {})}
    with pytest.raises(hvd.MismatchError, match=r"broadcast_parameters: .* 1 fewer \(extra\)"):
        hvd.broadcast_parameters(params, root_rank=0)
    same = {"a": torch.full((3,), float(R))}
    hvd.broadcast_parameters(same, root_rank=N - 1)
    assert same["a"].tolist() == [float(N - 1)] * 3


def test_optimizer_keeps_the_users_defaults_and_refuses_what_it_cannot_wrap():
    """Before 2026-12-05: a group added after wrapping got torch's defaults (lr 0.001, no momentum), a
    parameter listed twice failed at the first backward blaming backward_passes_per_step, ranks with
    different sparse_as_dense hung, and a class with a required argument failed with a bare TypeError."""
    model = torch.nn.Linear(3, 2)
    extra = torch.nn.Parameter(torch.zeros(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4),
                                   named_parameters=model.named_parameters())
    assert {k: opt.defaults[k] for k in ("lr", "momentum", "weight_decay")} == {
        "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
    opt.add_param_group({"params": [extra]})
    assert (opt.param_groups[-1]["lr"], opt.param_groups[-1]["momentum"]) == (0.1, 0.9)
    w = model.weight
    with pytest.raises(ValueError, match="lists one parameter twice"):
        hvd.DistributedOptimizer(torch.optim.SGD([w, w], lr=0.1))

    class NeedsLr(torch.optim.SGD):
        def __init__(self, params, lr):
            super().__init__(params, lr=lr)

    with pytest.raises(TypeError, match="give its other arguments defaults"):
        hvd.DistributedOptimizer(NeedsLr(model.parameters(), 0.1), named_parameters=model.named_parameters())
    if N > 1:
        with pytest.raises(ValueError, match="sparse_as_dense=True.*sparse_as_dense=False|sparse_as_dense=False.*"
                                             "sparse_as_dense=True"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), sparse_as_dense=R == 0)
        with pytest.raises(ValueError, match="backward_passes_per_step=2"):  # ZeRO too: reduce-scatters on
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),  # different passes
                                     named_parameters=model.named_parameters(), zero_stage=2,
                                     backward_passes_per_step=2 if R == 0 else 1)
    zero = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(), zero_stage=1)
    assert (zero.defaults["lr"], zero.defaults["momentum"]) == (0.1, 0.9)


def test_optimizer_accumulation_is_never_lost_silently():
    """``zero_grad`` between accumulated passes raises (Horovod asserts); ``load_state_dict`` starts the
    count afresh (Horovod's override does)."""
    model = _linear(0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    x, y = _batch(R, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="backward_passes_per_step=2"):
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    for _ in range(2):  # two passes again count as one step, not three
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_a_dropped_optimizer_lets_go_of_its_parameters(zero_stage):
    """A new DistributedOptimizer over the same parameters (a restart, a new schedule): the old one's
    hooks go with it, so the next backward pass is reduced once, by the new one (ZeRO's too)."""
    import gc
    import weakref

    model = _linear(0)
    old = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), zero_stage=zero_stage)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None
    new = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), zero_stage=zero_stage)
    x, y = _batch(R, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    new.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    assert all(np.array_equal(e, flat) for e in WORLD.allgather(flat))


def test_sync_batch_norm_double_backward_gets_torchs_own_error():
    """A gradient penalty (create_graph=True): before, a bare "Can't call numpy() on Tensor that requires grad"."""
    bn = hvd.SyncBatchNorm(3)
    x = torch.randn(4, 3, requires_grad=True)
    (grad,) = torch.autograd.grad(bn(x).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="does not support double backward|once_differentiable"):
        grad.pow(2).sum().backward()


def test_sync_batch_norm_tolerates_instances_only_some_ranks_build():
    """Names follow the training calls, not construction: an extra (eval or EMA) copy on one rank
    does not shift them."""
    if R == 0:
        hvd.SyncBatchNorm(3)
    layer = hvd.SyncBatchNorm(3)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(R))
    out = layer(x)
    every = torch.cat([torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(N)])
    want = torch.nn.functional.batch_norm(every, None, None, training=True)[4 * R:4 * R + 4]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@multi
def test_sync_batch_norm_in_eval_mode_never_synchronizes():
    """torch.nn.SyncBatchNorm's rule: eval() uses this rank's batch when there are no running statistics
    (Horovod's synchronizes there: a deliberate difference, docs/horovod.md). Before 2026-12-05 it used the
    ranks' (2.6 off), and one rank evaluating alone hung."""
    layer = hvd.SyncBatchNorm(3, track_running_stats=False).eval()
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(R)) * (R + 1) + R
    want = torch.nn.functional.batch_norm(x, None, None, training=True)
    if R == 0:  # alone: the others do not call it
        torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(layer(x), want)


def test_sync_batch_norm_refuses_integer_input_on_every_rank():
    """Integer input was normalized in float32 and cast back: [[-1, -1], [-1, 0], ...] for statistics of
    -1.53, -1.50, ... (found by an audit, 2026-12-07); torch.nn.BatchNorm refuses it. One rank's integer
    batch raises on every rank, and the next call pairs."""
    layer = hvd.SyncBatchNorm(2)
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2) + R
    with pytest.raises(ValueError, match=r"floating-point input; got torch.int64" if R == 0 else "rank 0"):
        layer(x.long() if R == 0 else x)
    every = torch.cat([torch.arange(8, dtype=torch.float32).reshape(4, 2) + r for r in range(N)])
    want = torch.nn.functional.batch_norm(every, None, None, training=True)[4 * R:4 * R + 4]
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5)
    # the wrong number of channels, on one rank or on all: the same clear error on every rank
    wide = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(2\) got input of 3 channels" if R == 0 else "rank 0"):
        layer(wide if R == 0 else x)
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(2\) got input of 3 channels"):
        layer(wide)
    torch.testing.assert_close(layer(x), want, rtol=1e-4, atol=1e-5)  # and the next call pairs


# ----------------------------------------------------------------- from the ops audit of 2026-12-04

@multi
def test_a_numpy_integer_root_on_a_process_set_is_a_global_rank():
    # it reached the engine untranslated: read as a rank within the set, another rank's data
    ps = hvd.add_process_set([1, N - 1]) if N > 2 else hvd.add_process_set([0, 1])
    try:
        if ps.included():
            root = ps.ranks[0]
            x = torch.tensor([float(R)])
            assert hvd.broadcast(x, np.int64(root), process_set=ps).item() == float(root)
            y = x.clone()
            hvd.broadcast_(y, np.int32(root), process_set=ps)
            assert y.item() == float(root)
    finally:
        hvd.remove_process_set(ps)


@multi
def test_in_place_allreduce_is_an_in_place_change_to_autograd():
    # written through a numpy view, it left the version alone: backward used the reduced values
    x = torch.full((3,), 1.0 + R, requires_grad=True)
    y = x * 1.0
    z = (y * y).sum()
    hvd.allreduce_(y, op=hvd.Sum, name="parity.inplace.version")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()
    y2 = x * 1.0
    z2 = (y2 * y2).sum()
    hvd.grouped_allreduce_([y2], op=hvd.Sum, name="parity.inplace.version.grouped")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z2.backward()
    np.testing.assert_allclose(y2.detach().numpy(), np.full(3, sum(1.0 + r for r in range(N))))


@multi
@pytest.mark.parametrize("kind", ["allgather", "reducescatter", "allreduce_"])
def test_grouped_ops_with_groups_of_different_lengths_raise_on_every_rank(kind):
    # one request per member: the rank with more members waited for ever on the extra one
    tensors = [torch.ones(N * 2) for _ in range(1 if R == 0 else 2)]
    call = {"allgather": hvd.grouped_allgather, "reducescatter": hvd.grouped_reducescatter,
            "allreduce_": hvd.grouped_allreduce_}[kind]
    with pytest.raises(ValueError, match="1 to 2 tensors|1 or 2 tensors|differ"):
        call(tensors, name=f"parity.grouped.len.{kind}")
    hvd.barrier()
    ok = call([torch.full((N * 2,), float(R))], name=f"parity.grouped.ok.{kind}")
    assert len(ok) == 1

    def group(k):  # members whose values say which call, member and rank they are
        return [torch.full((N * 2,), 100.0 * k + 10 * j + R) for j in range(2)]

    def check(k, got):
        for j, out in enumerate(got):
            if kind == "allgather":  # every rank's rows, in rank order
                want = np.repeat([100.0 * k + 10 * j + r for r in range(N)], N * 2)
            elif kind == "reducescatter":  # this rank's 2 rows of the average
                want = np.full(2, 100.0 * k + 10 * j + (N - 1) / 2)
            else:
                want = np.full(N * 2, 100.0 * k + 10 * j + (N - 1) / 2)
            np.testing.assert_allclose(out.numpy(), want, err_msg=f"call {k} member {j}")

    # [Note: a longer group's extra members] the same name again: the longer group's extra member had stayed
    # pending (DuplicateNameError on those ranks alone, the others waiting for ever)
    check(0, call(group(0), name=f"parity.grouped.len.{kind}"))
    # unnamed: the names come back every AUTO_NAME_SLOTS calls, where the stale member paired with a later
    # group's (its data in the other ranks' results: a silent wrong answer)
    with pytest.raises(ValueError, match="1 to 2 tensors|1 or 2 tensors|differ"):
        call(tensors)
    for k in range(1, AUTO_NAME_SLOTS + 2):
        check(k, call(group(k)))


@multi
def test_broadcast_object_pickles_on_the_root_only_and_returns_its_own_object():
    import threading

    mine = {"v": 42}
    out = hvd.broadcast_object(mine if R == 0 else threading.Lock(), 0)  # a non-root's object is not read
    assert out == {"v": 42} and (out is mine) == (R == 0)  # Horovod returns the root's object itself
    assert hvd.broadcast_object((lambda v: v + 1) if R == 0 else None, 0)(1) == 2  # cloudpickle, as Horovod
    with pytest.raises(TypeError, match="the root, rank 0, could not pickle"):
        hvd.broadcast_object(threading.Lock() if R == 0 else 1, 0)  # (the others waited for ever)
    with pytest.raises(TypeError, match=r"ranks \[1\] could not be pickled"):
        hvd.allgather_object(threading.Lock() if R == 1 else 1)
    assert hvd.allgather_object(R) == list(range(N))


# ----------------------------------------------------------------- elastic state

@multi
def test_elastic_host_update_seen_by_one_rank_interrupts_every_rank_alike():
    # a rank that raised alone went into the reset while the others trained on; one that skipped
    # the sync while another synced left both waiting in it
    from unison.common.exceptions import HostsUpdatedInterrupt
    from unison.torch_backend import elastic

    state = elastic.ObjectState(step=0)
    state.commit()  # nothing posted anywhere: no interrupt
    if R == 0:
        state.on_hosts_updated(100.0, True)
    with pytest.raises(HostsUpdatedInterrupt) as exc:
        state.commit()
    assert exc.value.skip_sync is True
    state.on_hosts_updated(200.0, R != N - 1)  # one rank's update asks for a sync: every rank syncs
    with pytest.raises(HostsUpdatedInterrupt) as exc:
        state.commit()
    assert exc.value.skip_sync is False
    if R == 0:
        state.on_hosts_updated(150.0, False)  # older than the last one taken: ignored, as in Horovod
    state.commit()
    if R == N - 1:
        state.save()  # one more local commit (a step the others never finished), then the sync of a reset
        state.commit_id += 1
    state.sync()
    assert hvd.allgather_object(state.commit_id) == [state.commit_id] * N  # (they kept their own counts)


@multi
def test_elastic_sampler_sync_keeps_every_ranks_recorded_indices():
    from unison.torch_backend import elastic

    sampler = elastic.ElasticSampler(range(20), shuffle=True, seed=0)
    state = elastic.TorchState(sampler=sampler, epoch=0)
    state.sync()
    every = {i for r in range(N) for i in sampler._core.batch_indices(0, 3, r)}
    sampler.record_indices(sampler.get_indices(0, 3))  # this rank's own only
    state.commit()
    state.restore()
    state.on_reset()
    state.sync()  # what run() does after a failure
    assert state.sampler.processed_indices == every  # (rank 0's alone before: the rest dealt again)
    assert not set(state.sampler).intersection(every)


@multi
def test_elastic_sampler_sync_takes_rank_0s_commit_not_a_rank_that_committed_once_more():
    """The last rank committed one step more than the others before a failure (its all-reduce never finished
    elsewhere). Before, sync merged every rank's processed samples: rank 0's model had not trained on that
    last step's samples, yet they were marked done and skipped for the rest of the epoch."""
    from unison.torch_backend import elastic

    sampler = elastic.ElasticSampler(range(24), shuffle=True, seed=1)
    state = elastic.TorchState(sampler=sampler, epoch=0)
    state.sync()
    sampler.record_batch(0, 2)
    state.commit()
    first = set(sampler.processed_indices)
    if R == N - 1:  # one step further, committed on this rank only
        sampler.record_batch(1, 2)
        state.save()
        state.commit_id += 1
    state.restore()
    state.on_reset()
    state.sync()
    assert state.sampler.processed_indices == first
    assert len(state.sampler) * N >= 24 - len(first)  # the step rank 0 never trained on is dealt again


@multi
def test_elastic_sync_of_models_that_differ_across_ranks_raises_on_every_rank():
    """A model with a layer more on one rank: the sync broadcast rank 0's tensors by name and the
    rank with the extra one waited for ever on its lone broadcast (a shape that differed under one
    name raised). Now every rank raises, naming the tensors."""
    from unison.common.exceptions import MismatchError
    from unison.torch_backend import elastic

    torch.manual_seed(0)
    layers = [torch.nn.Linear(3, 3) for _ in range(3 if R == N - 1 else 2)]
    state = elastic.TorchState(torch.nn.Sequential(*layers), step=0)
    with pytest.raises(MismatchError, match=rf"rank\(s\) \[{N - 1}\].*has \['2.bias', '2.weight'\]"):
        state.sync()
    same = elastic.TorchState(torch.nn.Sequential(torch.nn.Linear(3, 3 + (R == N - 1))))
    with pytest.raises(MismatchError, match=r"0.weight: \(\(3, 3\), 'torch.float32'\) on rank 0"):
        same.sync()
    ok = elastic.TorchState(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    ok.sync()  # the engine goes on: an agreeing model syncs
    w = hvd.allgather_object(ok.model[0].weight.detach().numpy().tolist())
    assert all(x == w[0] for x in w)


@multi
@pytest.mark.parametrize("case", ["scheduler-on-one-rank", "sampler-seed", "value-on-one-rank"])
def test_elastic_sync_of_states_tracking_different_things_raises_on_every_rank(case):
    """[Note: a sync agrees on what it syncs]: a scheduler tracked on one rank only hung the first sync
    (each rank waited in another broadcast); samplers seeded differently dealt overlapping samples (6 of
    10 seen) and a value on one rank only was dropped from its commits, silently. Now every rank raises
    MismatchError naming the difference, and a state made alike right after syncs."""
    from unison.common.exceptions import MismatchError
    from unison.torch_backend import elastic

    odd = R == N - 1
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    extra: dict = {}
    if case == "scheduler-on-one-rank" and odd:
        extra["scheduler"] = torch.optim.lr_scheduler.StepLR(opt, 1)
    elif case == "sampler-seed":
        extra["sampler"] = elastic.ElasticSampler(list(range(10)), seed=int(odd))
    elif case == "value-on-one-rank" and odd:
        extra["best"] = 1.0
    state = elastic.TorchState(model, opt, epoch=0, **extra)
    shown = {"scheduler-on-one-rank": "scheduler: StepLR", "sampler-seed": r"sampler: ElasticSampler \(seed 1",
             "value-on-one-rank": "value 'best'"}[case]
    with pytest.raises(MismatchError, match=r"elastic sync of a TorchState \(its values and tracked objects\): "
                                            rf"the ranks passed different items: .*{shown}"):
        state.sync()
    good = elastic.TorchState(model, opt, epoch=0, sampler=elastic.ElasticSampler(list(range(10)), seed=0))
    good.sync()
    w = hvd.allgather_object(model.weight.detach().numpy().tolist())
    assert all(x == w[0] for x in w)


def test_elastic_state_refuses_values_named_as_its_own_attributes():
    from unison.common.elastic import ObjectState

    for name in ("store", "commit_id", "commit", "sync"):
        with pytest.raises(ValueError, match="name what the state itself uses"):
            ObjectState(**{name: 1})
    from unison.torch_backend import elastic

    sampler = elastic.ElasticSampler(range(8), shuffle=True, seed=-1)  # Horovod's generator takes it
    assert sorted(sampler) == sorted(set(sampler)) and len(sampler) > 0


# ----------------------------------------------------------------- deliberate differences; join (last)

@multi
def test_integer_average_has_no_overflow():
    big = np.iinfo(np.int32).max
    t = torch.tensor([1 + R, -1 - R, big], dtype=torch.int32)
    out = hvd.allreduce(t, op=hvd.Average)
    expect = np.trunc(np.mean([[1 + r, -1 - r, big] for r in range(N)], axis=0)).astype(np.int32)
    assert out.dtype == torch.int32 and out.tolist() == expect.tolist()  # Horovod's int32 sum would wrap


@multi
@pytest.mark.parametrize("kind", ["allgather", "broadcast"])
def test_join_then_allgather_or_broadcast_raises(kind):
    t = torch.ones(2, 2)
    if R == 0:
        last = hvd.join()  # Horovod: the joined rank's join() returns the last rank to join
    else:
        with pytest.raises(RuntimeError):  # Horovod: HorovodInternalError, a RuntimeError
            hvd.allgather(t, name=f"parity.join.{kind}") if kind == "allgather" else hvd.broadcast(
                t, 1, name=f"parity.join.{kind}")
        last = hvd.join()
    assert isinstance(last, int) and 0 <= last < N


def test_step_with_a_closure_reduces_what_the_closure_computed():
    """step(closure): the closure's backward starts the reductions; the optimizer read the gradients
    while they were still being written (the ranks drifted apart: 0.23 after three steps)."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(3, 2)
    model = torch.nn.Linear(3, 2)
    model.load_state_dict(ref.state_dict())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4 * N, 3, generator=g), torch.randn(4 * N, 2, generator=g)

        def closure(m=model, o=opt, x=x[4 * R:4 * R + 4], y=y[4 * R:4 * R + 4]):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        def ref_closure(x=x, y=y):
            ref_opt.zero_grad()
            loss = torch.nn.functional.mse_loss(ref(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        ref_opt.step(ref_closure)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(N == 1, reason="needs ranks that differ")
def test_ranks_wrapping_different_parameters_raise_on_every_rank():
    """A rank with an extra layer (or other names): each waited for gradients the other never sends."""
    layers = [torch.nn.Linear(3, 3)] + ([torch.nn.Linear(3, 3)] if R == 1 else [])
    model = torch.nn.Sequential(*layers)
    with pytest.raises(ValueError, match="ranks disagree on the DistributedOptimizer") as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters())
    assert len(set(WORLD.allgather(str(info.value)))) == 1


@pytest.mark.skipif(N == 1, reason="needs ranks that differ")
def test_broadcast_optimizer_state_that_a_rank_cannot_load_raises_on_every_rank():
    """The root returned and went on alone while the others raised (different parameter groups)."""
    model = torch.nn.Linear(3, 2)
    groups = [{"params": [model.weight]}, {"params": [model.bias]}] if R == 0 else [{"params": model.parameters()}]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="broadcast_optimizer_state: rank 1 could not load root rank 0's state"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)


def test_in_place_async_ops_land_when_they_complete():
    """Horovod's in-place ops write their output when the collective completes. Before 2026-12-05
    broadcast_async_ and grouped_allreduce_async_ copied only in synchronize(): after poll() the tensor
    held its old values, and a change made between completion and synchronize() was overwritten."""
    import time

    def finished(h):
        deadline = time.monotonic() + 60
        while not hvd.poll(h):
            assert time.monotonic() < deadline, "never completed"
            time.sleep(0.001)

    t = torch.full((3,), float(R))
    h = hvd.broadcast_async_(t, N - 1, name="parity.inplace.bcast")
    finished(h)
    assert t.tolist() == [float(N - 1)] * 3  # landed by the time poll() says done
    t.add_(100.0)
    assert hvd.synchronize(h) is t and t.tolist() == [N - 1 + 100.0] * 3  # not overwritten
    ts = [torch.full((2,), float(R)), torch.full((1, 2), 2.0 * R)]
    h = hvd.grouped_allreduce_async_(ts, op=hvd.Sum, name="parity.inplace.grouped")
    finished(h)
    total = float(sum(range(N)))
    assert ts[0].tolist() == [total] * 2 and ts[1].tolist() == [[2 * total] * 2]
    got = hvd.synchronize(h)
    assert len(got) == 2 and all(a is b for a, b in zip(got, ts, strict=True))
    # an error still reaches synchronize, on every rank
    if N > 1:
        h = hvd.grouped_allreduce_async_([torch.zeros(2 + (R == 0))], name="parity.inplace.bad")
        with pytest.raises(Exception, match="parity.inplace.bad"):
            hvd.synchronize(h)


def test_in_place_broadcast_writes_the_tensor_where_it_lies(monkeypatch):
    """``broadcast_`` of a contiguous tensor broadcasts into the tensor's own memory: no result array, no
    copy back (before 2026-12-06 the engine copied the input into a new array, broadcast that, and the
    result was copied into the tensor); the tensor's version moves as after an in-place op. A strided
    tensor still gets the result copied in, and ``broadcast`` (not in place) leaves its input alone."""
    import unison.torch_backend.gather_ops as gather_ops

    copies = []
    convert = gather_ops.result_tensor
    monkeypatch.setattr(gather_ops, "result_tensor",
                        lambda arr, src: copies.append(arr.shape) or convert(arr, src))
    t = torch.arange(6.0).reshape(2, 3) * (R + 1)
    version = t._version
    assert hvd.broadcast_(t, N - 1, name="parity.lands.bcast") is t
    np.testing.assert_array_equal(t.numpy(), np.arange(6.0).reshape(2, 3) * N)
    if N > 1:  # (one rank runs no engine: its result is a copy)
        assert copies == [] and t._version > version, (copies, t._version, version)
    strided = torch.zeros(2, 6)[:, ::2]
    strided.copy_(torch.full((2, 3), float(R)))
    hvd.broadcast_(strided, 0, name="parity.lands.strided")
    assert strided.tolist() == [[0.0] * 3] * 2
    x = torch.full((4,), float(R))
    y = hvd.broadcast(x, N - 1, name="parity.lands.copy")
    assert y.tolist() == [float(N - 1)] * 4 and x.tolist() == [float(R)] * 4


@multi
@pytest.mark.parametrize("case", ["sparse-allreduce", "sparse-allgather", "strided-allreduce_", "root-outside",
                                  "strided-grouped_allreduce_"])
def test_an_argument_refused_on_one_rank_raises_on_every_rank_and_the_next_call_pairs(case):
    """The adapter's own checks (a sparse tensor, allreduce_ on a non-contiguous tensor, a root outside the
    process set) run on one rank only here: the request still travels, so every rank raises. Before: that rank
    raised alone, and the peers' call paired with its next one (another step's data, then a hang)."""
    odd = R == N - 1  # the rank whose argument is refused
    dense = torch.full((2, 2), float(R + 1))
    pair = hvd.add_process_set([0, N - 1]) if case == "root-outside" else None
    try:
        if pair is not None and R not in (0, N - 1):
            return  # (not in the set: a rank outside it makes no call on it)
        with pytest.raises(ValueError, match=f"rank {N - 1}: "):
            if case == "sparse-allreduce":
                hvd.allreduce(dense.to_sparse() if odd else dense, name="refused.ar")
            elif case == "sparse-allgather":
                hvd.allgather(dense.to_sparse() if odd else dense, name="refused.ag")
            elif case == "strided-allreduce_":
                hvd.allreduce_(torch.ones(2, 4)[:, ::2] if odd else torch.ones(2, 2), name="refused.inplace")
            elif case == "strided-grouped_allreduce_":
                hvd.grouped_allreduce_([torch.ones(3), torch.ones(2, 4)[:, ::2] if odd else torch.ones(2, 2)],
                                       name="refused.grouped")
            else:  # root_rank=N+5 is no rank of the set; unnamed, so the names must stay paired too
                hvd.broadcast(dense, N + 5 if odd else 0, process_set=pair)
        after = hvd.broadcast(torch.full((2,), float(R + 1)), 0, process_set=pair)  # unnamed: the next call
        torch.testing.assert_close(after, torch.full((2,), 1.0))
    finally:
        if pair is not None:
            hvd.remove_process_set(pair)


@multi
@pytest.mark.parametrize("case", ["sparse_allreduce-dense", "reducescatter-op", "syncbn-1d",
                                  "broadcast_object-none", "grouped_allreduce-empty", "numpy-grouped-empty"])
def test_more_arguments_refused_on_one_rank_raise_on_every_rank_and_the_next_unnamed_call_pairs(case):
    """Found by a sweep of the pattern (2026-12-05): each raised on the odd rank alone; the others hung, or their
    unnamed call paired with the odd rank's next one (another step's data)."""
    import unison

    odd = R == N - 1
    with pytest.raises(Exception) as info:
        if case == "sparse_allreduce-dense":
            t = torch.ones(3, 2)
            hvd.sparse_allreduce_async(t if odd else t.to_sparse(), "refused.sparse", hvd.Sum)()
        elif case == "reducescatter-op":
            hvd.reducescatter(torch.ones(N * 2), op="no such op" if odd else hvd.Sum)
        elif case == "syncbn-1d":
            bn = hvd.SyncBatchNorm(3)
            bn(torch.ones(3) if odd else torch.randn(4, 3))
        elif case == "broadcast_object-none":
            hvd.broadcast_object("x", None if odd else 0)
        elif case == "grouped_allreduce-empty":
            hvd.grouped_allreduce([] if odd else [torch.ones(2)])
        else:
            unison.grouped_allreduce([] if odd else [np.ones(2)])
    text = str(info.value)  # (the odd rank's SyncBatchNorm raises its own error; the others the engine's)
    assert f"rank {N - 1}" in text or "different arguments" in text or (odd and "SyncBatchNorm" in text), text
    bn = hvd.SyncBatchNorm(1)  # the next unnamed calls pair: a batch norm of constant 20 on every rank
    torch.testing.assert_close(hvd.allreduce(torch.tensor([float(R)]), op=hvd.Sum),
                               torch.tensor([float(sum(range(N)))]))
    out = bn(torch.full((4, 1), 20.0) + torch.arange(4.0).reshape(4, 1))
    torch.testing.assert_close(out.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    assert hvd.broadcast_object(("next", R), 0) == ("next", 0)


@multi
def test_a_sparse_gradient_with_op_min_on_one_rank_raises_on_every_rank():
    """DistributedOptimizer(op=Min): a sparse gradient is refused (rows are summed). Raised in one rank's backward
    hook alone, the others waited in step() for ever; now it travels, and the ranks' dense/sparse disagreement
    raises on every rank at step()."""
    emb = torch.nn.Embedding(5, 2, sparse=R == N - 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), op=hvd.Min)
    with pytest.raises(ValueError):
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
    torch.testing.assert_close(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after.sparse.min"),
                               torch.tensor([float(N)]))


# --- arguments bad on one rank: every rank raises, and the next call pairs (audit of 2026-12-07) -----------

def _one_rank_bad(good, bad):
    return bad if R == N - 1 else good


_BAD_CALLS = {
    "unknown op": lambda: hvd.allreduce(torch.ones(1), op=_one_rank_bad(hvd.Sum, "bogus")),
    "average and op": lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum, average=_one_rank_bad(None, True)),
    "in place, op 42": lambda: hvd.allreduce_(torch.ones(1), op=_one_rank_bad(hvd.Sum, 42)),
    "grouped": lambda: hvd.grouped_allreduce([torch.ones(1)], op=_one_rank_bad(hvd.Sum, "bogus")),
    "grouped in place": lambda: hvd.grouped_allreduce_([torch.ones(1)], op=_one_rank_bad(hvd.Sum, "bogus")),
    "sparse": lambda: hvd.synchronize(hvd.sparse_allreduce_async(torch.ones(2).to_sparse(), "bad.sparse",
                                                                 op=_one_rank_bad(hvd.Sum, "bogus"))),
    "compression string": lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum,
                                                compression=_one_rank_bad(hvd.Compression.none, "fp16")),
    "a list for a tensor": lambda: hvd.allreduce(_one_rank_bad(torch.ones(1), [1.0]), op=hvd.Sum),
}


@multi
@pytest.mark.parametrize("case", list(_BAD_CALLS))
def test_a_bad_op_or_input_on_one_rank_raises_on_every_rank_and_the_next_call_pairs(case):
    """Before 2026-12-07 the bad rank raised alone: the others' call met its next one (rank 0 got 1 + the
    next call's 10 = 11, then the ranks were a call apart until a hang)."""
    with pytest.raises((ValueError, TypeError, hvd.HorovodInternalError)) as info:
        _BAD_CALLS[case]()
    assert f"rank {N - 1}" in str(info.value) or R == N - 1, str(info.value)
    after = hvd.allreduce(torch.full((1,), 10.0 if R == N - 1 else 1.0), op=hvd.Sum)
    assert after.item() == 10.0 + (N - 1)


_BAD_OPTIMIZERS = {
    "predivide with Sum": dict(op=_one_rank_bad(hvd.Average, hvd.Sum), gradient_predivide_factor=2.0),
    "unknown op": dict(op=_one_rank_bad(hvd.Average, "bogus")),
    "duplicate names": dict(named=_one_rank_bad(None, "dup")),
    "zero bucket bytes": dict(zero_stage=1, zero_bucket_bytes=_one_rank_bad(1 << 20, 0)),
}


@multi
@pytest.mark.parametrize("case", list(_BAD_OPTIMIZERS))
def test_a_distributed_optimizer_refused_on_one_rank_is_refused_on_every_rank(case):
    """Before 2026-12-07 the checks ran before the ranks' agreement: the refusing rank raised alone and the
    others waited in the agreement until the deadlock check, which named no cause (or for ever)."""
    kwargs = dict(_BAD_OPTIMIZERS[case])
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    named = list(model.named_parameters())
    if kwargs.pop("named", None) == "dup":
        named = [("w", p) for _, p in named]
    with pytest.raises(ValueError) as info:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=named, **kwargs)
    if R != N - 1:
        assert f"refused on rank {N - 1}" in str(info.value), str(info.value)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N


@multi
def test_broadcast_parameters_with_a_non_tensor_on_one_rank_raises_on_every_rank():
    params = {"a": torch.ones(1), "b": _one_rank_bad(torch.ones(1), 3.0)}
    with pytest.raises(ValueError, match="expects tensors" if R == N - 1 else "refused: broadcast_parameters"):
        hvd.broadcast_parameters(params, root_rank=0)
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == N


class _HorovodStyleFP16:
    """A compressor written for Horovod: it calls torch methods on what it is given."""
    seen: list = []

    @staticmethod
    def compress(tensor):
        _HorovodStyleFP16.seen.append(type(tensor).__name__)
        return (tensor.type(torch.float16), tensor.dtype) if tensor.dtype.is_floating_point else (tensor, None)

    @staticmethod
    def decompress(tensor, ctx):
        _HorovodStyleFP16.seen.append(type(tensor).__name__)
        return tensor if ctx is None else tensor.type(ctx)


@multi
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_optimizer_gives_a_compressor_torch_tensors_as_horovod_does(zero_stage):
    """Before 2026-12-07 the optimizer gave the compressor a numpy view: Horovod's own FP16Compressor body
    (tensor.type(torch.float16)) failed inside backward()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    _HorovodStyleFP16.seen = []
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=[(f"compressor{zero_stage}.{n}", p)
                                                     for n, p in model.named_parameters()],
                                   compression=_HorovodStyleFP16,
                                   zero_stage=zero_stage)
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + r)) for r in range(N)]
    model(xs[R]).square().sum().backward()
    opt.step()
    assert _HorovodStyleFP16.seen and set(_HorovodStyleFP16.seen) == {"Tensor"}, _HorovodStyleFP16.seen
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (sum(ref(x).square().sum() for x in xs) / N).backward()  # the average over ranks, in float32
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=0, atol=5e-3)  # (float16 wire)


@multi
def test_in_place_results_land_under_the_callers_inference_mode():
    """Before 2026-12-07 grouped_allreduce_ and a non-contiguous broadcast_ copied their results on a worker
    thread, outside the caller's torch.inference_mode(): writing the inference tensors raised there, on
    whichever rank's result landed on that thread, leaving them half written and the ranks apart."""
    with torch.inference_mode():
        metrics = [torch.tensor([float(R + 1)]), torch.tensor([10.0 * (R + 1)])]
        hvd.grouped_allreduce_(metrics, op=hvd.Sum)
        t = torch.full((2, 3), float(R)).t()  # non-contiguous
        hvd.broadcast_(t, root_rank=N - 1)
    total = N * (N + 1) / 2
    assert [m.item() for m in metrics] == [total, 10 * total]
    assert torch.equal(t, torch.full((3, 2), float(N - 1)))


def test_two_threads_synchronizing_one_handle_get_one_result_object():
    """Before 2026-12-07 both saw the conversion (from_numpy) pending and ran it: different result objects for
    one handle (24 of 300 handles on one rank, in an audit), where synchronizing twice on one thread returns the
    same one."""
    import sys
    import threading

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (thread switches between the check and the conversion, as under load)
    try:
        differ = 0
        for k in range(300):
            handle = hvd.allreduce_async(torch.full((1000,), float(R)), name=f"two.threads.{k}", op=hvd.Sum)
            got: list = [None, None]
            meet = threading.Barrier(2)

            def wait(i: int, handle=handle, got=got, meet=meet) -> None:
                meet.wait()
                got[i] = hvd.synchronize(handle)

            threads = [threading.Thread(target=wait, args=(i,)) for i in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            differ += got[0] is not got[1]
            assert torch.equal(got[0], torch.full((1000,), float(sum(range(N)))))
    finally:
        sys.setswitchinterval(switch)
    assert differ == 0, f"{differ} of 300 handles gave the two threads different tensors"


class _CollectiveInWorker(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 1:  # a worker may read its rank (to shard, to seed) ...
            return torch.tensor([float(hvd.rank())])
        return hvd.allreduce(torch.ones(1), name="in.a.worker")  # ... but not run a collective


def test_a_dataloader_worker_forked_after_init_gets_a_clear_error_and_the_training_process_goes_on():
    """A fork-context DataLoader worker calling a collective: before 2026-12-07 it paired with the other ranks'
    workers over the parents' MPI endpoints or hung, and the parents' next collective failed or hung (an audit)."""
    loader = torch.utils.data.DataLoader(_CollectiveInWorker(), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    with pytest.raises(Exception, match=r"(?s)ForkedProcessError.*forked from rank \d+ after unison.init\(\)"):
        list(loader)
    ranks = torch.utils.data.DataLoader(torch.utils.data.Subset(_CollectiveInWorker(), [1]), batch_size=None,
                                        num_workers=1, multiprocessing_context="fork")
    assert [float(t) for t in ranks] == [float(R)]
    assert float(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="after.the.workers")) == N


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex32])
def test_a_torch_dtype_numpy_cannot_hold_is_refused_naming_the_supported_ones_on_every_rank(dtype):
    """Before 2026-12-07 the message was torch's "Got unsupported ScalarType Float8_e4m3fn", naming no fix. One
    rank passes it: every rank raises, and the next call pairs."""
    t = torch.zeros(4, dtype=dtype) if R == N - 1 else torch.zeros(4)
    with pytest.raises(Exception, match=rf"torch dtype {dtype} is not supported .*supported dtypes: .*float32.*"
                                        "Cast the tensor first"):
        hvd.allreduce(t, op=hvd.Sum, name=f"uncarried.{dtype}")
    assert float(hvd.allreduce(torch.ones(1), op=hvd.Sum)) == N


@multi
@pytest.mark.parametrize("who", ["every", "one"])
def test_a_parameter_in_two_groups_is_refused_on_every_rank(who):
    """Horovod's rule. Before 2026-12-07 groups=[[a, b], [b, c]] was taken: a's group, one short for ever,
    waited for step(), so a was reduced after backward instead of during it. Given on one rank only, every rank
    raises, and the next collective pairs."""
    model = torch.nn.Linear(2, 2)
    w, b = model.weight, model.bias
    groups = [[w, b], [b]] if who == "every" or R == 1 else [[w], [b]]
    with pytest.raises(ValueError, match="only appear once in groups=: entry 0 of group 1"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=[(f"twice.{who}.{n}", p) for n, p in model.named_parameters()],
                                 groups=groups)
    assert float(hvd.allreduce(torch.ones(1), op=hvd.Sum)) == N


@multi
def test_an_extra_backward_of_a_member_waiting_for_its_group_names_backward_passes_per_step():
    """A member of a group that cannot complete yet (its partner unused) and a second backward before step():
    before 2026-12-07 it was counted twice in its group, which raised DuplicateNameError on its own name."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([a, b], lr=0.1),
                                   named_parameters=[("extra.a", a), ("extra.b", b)], groups=[[a, b]])
    (a * 2).sum().backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step=1 times"):
        (a * 2).sum().backward()
    opt.synchronize()
    np.testing.assert_allclose(a.grad.numpy(), [4.0, 4.0])  # both passes' sum, reduced once
    opt.zero_grad()


@multi
def test_groups_leave_frozen_parameters_out_so_their_group_reduces_during_backward():
    """Horovod leaves parameters without requires_grad out of groups=. Before 2026-12-07 a group listing a
    frozen one could not complete in backward (that parameter gets no gradient): all its members were
    reduced in step(), after backward, with no overlap."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    model[0].weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=[(f"frozen.{n}", p) for n, p in model.named_parameters()],
                                   groups=[[model[0].weight, model[0].bias], [model[1].weight, model[1].bias]])
    model(torch.ones(1, 2) * (R + 1)).sum().backward()
    assert model[0].bias in opt._pending and model[1].bias in opt._pending  # submitted during backward
    mine = model[0].bias.grad.clone()
    opt.synchronize()
    want = sum(torch.tensor(x) for x in WORLD.allgather(mine.numpy())) / N
    np.testing.assert_allclose(model[0].bias.grad.numpy(), want.numpy(), rtol=1e-6)
    with opt.skip_synchronize():
        opt.step()
    opt.zero_grad()
