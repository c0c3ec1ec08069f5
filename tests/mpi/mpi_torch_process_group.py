"""The ``torch.distributed`` backend "unison" on every rank (run by tests/test_torch_process_group_mpi.py).

Every op is checked against numpy on values every rank can compute; DDP training against one
process on the global batch.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import unison.torch_backend as hvd  # noqa: F401 - registers the backend
from unison.common.exceptions import MismatchError
from unison.torch_backend import UnsupportedError
from unison.torch_backend.process_group import UnisonProcessGroup

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _group():
    dist.init_process_group("unison")  # no MASTER_ADDR/PORT: the store comes through MPI
    yield
    dist.destroy_process_group()


def _rank_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _values(r: int, shape: tuple[int, ...] = (5,), dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * (r + 1) + r).to(dtype)


@contextlib.contextmanager
def _raises_exactly(cls: type[BaseException], match: str) -> Any:
    """``pytest.raises(cls, match=...)`` that also refuses a subclass of ``cls``."""
    with pytest.raises(cls, match=match) as info:
        yield info
    assert info.type is cls, f"{info.type.__name__} raised where {cls.__name__} was expected: {info.value}"


def _finish(work: Any, async_op: bool) -> None:
    """A call's return value: None when synchronous; a ``Work`` to wait for with ``async_op=True``."""
    if async_op:
        assert work.wait()
    else:
        assert work is None


def test_the_group_is_ours_and_knows_mpis_rank():
    from mpi4py import MPI

    assert dist.get_backend() == "unison"
    assert _rank_size() == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("op, reduce", [(dist.ReduceOp.SUM, np.sum), (dist.ReduceOp.AVG, np.mean),
                                        (dist.ReduceOp.PRODUCT, np.prod), (dist.ReduceOp.MIN, np.min),
                                        (dist.ReduceOp.MAX, np.max)], ids=["sum", "avg", "prod", "min", "max"])
def test_all_reduce(op, reduce, async_op):
    r, n = _rank_size()
    t = _values(r)
    work = dist.all_reduce(t, op=op, async_op=async_op)
    if async_op:
        assert work.wait()
    want = reduce(np.stack([_values(k).numpy() for k in range(n)]), axis=0)
    np.testing.assert_allclose(t.numpy(), want, rtol=1e-12)


def test_float16_sums_in_float16_on_the_default_group():
    """As NCCL and gloo: the default group sums float16 in float16, so an average whose sum overflows is inf
    (60000 each: the sum passes float16's 65504 from 2 ranks), and values that fit come out right."""
    r, n = _rank_size()
    t = torch.full((3,), 60000.0, dtype=torch.float16)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.isinf(t).all() if n > 1 else t.tolist() == [60000.0] * 3
    small = torch.tensor([0.5, -1.25, 3.0], dtype=torch.float16) * (r + 1)
    dist.all_reduce(small, op=dist.ReduceOp.SUM)
    assert small.dtype == torch.float16
    np.testing.assert_array_equal(small.numpy(), np.array([0.5, -1.25, 3.0], np.float16) * sum(range(1, n + 1)))


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool], ids=str)
def test_all_reduce_bitwise(dtype, async_op):
    r, n = _rank_size()
    rng = np.random.default_rng
    if dtype == torch.bool:
        mine = [rng([5, k]).integers(0, 2, 6).astype(bool) for k in range(n)]
        fns = {dist.ReduceOp.BAND: np.logical_and, dist.ReduceOp.BOR: np.logical_or,
               dist.ReduceOp.BXOR: np.logical_xor}
    else:
        info = np.iinfo(torch.empty(0, dtype=dtype).numpy().dtype)
        mine = [rng([5, k]).integers(info.min, info.max, 6, endpoint=True).astype(info.dtype) for k in range(n)]
        fns = {dist.ReduceOp.BAND: np.bitwise_and, dist.ReduceOp.BOR: np.bitwise_or,
               dist.ReduceOp.BXOR: np.bitwise_xor}
    for op, fn in fns.items():
        t = torch.from_numpy(mine[r].copy())
        _finish(dist.all_reduce(t, op=op, async_op=async_op), async_op)
        want = mine[0]
        for k in range(1, n):
            want = fn(want, mine[k])
        np.testing.assert_array_equal(t.numpy(), want)


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("factor", [0.5, torch.tensor(3.0, dtype=torch.float64)], ids=["float", "tensor"])
def test_premul_sum_all_reduce_and_reduce_scatter(factor, async_op):
    r, n = _rank_size()
    scale = float(factor)
    t = _values(r)
    _finish(dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor), async_op=async_op), async_op)
    np.testing.assert_allclose(t.numpy(), scale * sum(_values(k).numpy() for k in range(n)), rtol=1e-12)
    out = torch.empty(2, dtype=torch.float64)
    _finish(dist.reduce_scatter_single(out, _values(r, (2 * n,)), op=dist._make_nccl_premul_sum(factor),
                                       async_op=async_op), async_op)
    full = scale * sum(_values(k, (2 * n,)).numpy() for k in range(n))
    np.testing.assert_allclose(out.numpy(), full[2 * r:2 * r + 2], rtol=1e-12)


def test_all_reduce_integers_and_future():
    r, n = _rank_size()
    t = torch.full((4,), r + 1, dtype=torch.int64)
    fut = dist.all_reduce(t, async_op=True).get_future()
    got = fut.wait()
    assert t.tolist() == [n * (n + 1) // 2] * 4 and got[0] is t


@pytest.mark.parametrize("async_op", [False, True])
def test_broadcast_from_the_last_rank(async_op):
    r, n = _rank_size()
    t = _values(r, (2, 3))
    _finish(dist.broadcast(t, src=n - 1, async_op=async_op), async_op)
    np.testing.assert_array_equal(t.numpy(), _values(n - 1, (2, 3)).numpy())


@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_list_and_into_tensor(async_op):
    r, n = _rank_size()
    outs = [torch.zeros(2, 3, dtype=torch.float64) for _ in range(n)]
    _finish(dist.all_gather(outs, _values(r, (2, 3)), async_op=async_op), async_op)
    for k, out in enumerate(outs):
        np.testing.assert_array_equal(out.numpy(), _values(k, (2, 3)).numpy())
    flat = torch.zeros(n * 2, 3, dtype=torch.float64)
    _finish(dist.all_gather_into_tensor(flat, _values(r, (2, 3)), async_op=async_op), async_op)
    np.testing.assert_array_equal(flat.numpy(), np.concatenate([_values(k, (2, 3)).numpy() for k in range(n)]))


@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_scatter_list_and_tensor(async_op):
    r, n = _rank_size()
    pieces = [_values(r * 10 + k, (3,)) for k in range(n)]
    out = torch.zeros(3, dtype=torch.float64)
    _finish(dist.reduce_scatter(out, pieces, async_op=async_op), async_op)
    np.testing.assert_allclose(out.numpy(), sum(_values(q * 10 + r, (3,)).numpy() for q in range(n)))
    whole = torch.cat(pieces)
    out2 = torch.zeros(3, dtype=torch.float64)
    _finish(dist.reduce_scatter_tensor(out2, whole, op=dist.ReduceOp.MAX, async_op=async_op), async_op)
    np.testing.assert_array_equal(out2.numpy(), np.max([_values(q * 10 + r, (3,)).numpy() for q in range(n)], 0))


def _copies(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the results the group copies into PyTorch's tensors from now on (none where the
    collective wrote the output tensor's own memory: [Note: out= beyond the all-reduce])."""
    import unison.torch_backend.process_group_collectives as collectives
    import unison.torch_backend.process_group_ops as ops

    seen: list[tuple[int, ...]] = []

    def counted(target, values, what="the collective"):  # noqa: ANN001, ANN202
        seen.append(tuple(target.shape))
        return copy(target, values, what)

    copy = ops.copy_into
    monkeypatch.setattr(ops, "copy_into", counted)
    monkeypatch.setattr(collectives, "copy_into", counted)
    return seen


@pytest.mark.parametrize("async_op", [False, True])
def test_outputs_are_written_where_they_lie_and_in_place_forms_are_right(monkeypatch, async_op):
    """broadcast, all_gather_into_tensor and reduce_scatter_tensor write a contiguous output tensor's own
    memory, with no copy of the result (before 2026-12-06 each result was a new array copied in: a 64 MiB
    all-gather took 78 ms, gloo's 119). FSDP's in-place forms stay right: an all-gather whose input lies in
    its output, a reduce-scatter whose output is its input's own piece; the input of a reduce-scatter is
    left as it was, and a non-contiguous output still gets its result (copied)."""
    r, n = _rank_size()
    seen = _copies(monkeypatch)
    t = _values(r, (4, 3))
    _finish(dist.broadcast(t, src=0, async_op=async_op), async_op)
    np.testing.assert_array_equal(t.numpy(), _values(0, (4, 3)).numpy())
    flat = torch.zeros(n * 6, dtype=torch.float64)
    _finish(dist.all_gather_into_tensor(flat, _values(r, (6,)), async_op=async_op), async_op)
    expect = np.concatenate([_values(k, (6,)).numpy() for k in range(n)])
    np.testing.assert_array_equal(flat.numpy(), expect)
    stacked = torch.zeros(n, 2, 3, dtype=torch.float32)
    _finish(dist.all_gather_into_tensor(stacked, _values(r, (2, 3), torch.float32), async_op=async_op), async_op)
    np.testing.assert_array_equal(stacked.numpy().reshape(-1), expect.astype(np.float32))
    whole = torch.cat([_values(r * 10 + k, (3,)) for k in range(n)])
    before = whole.clone()
    out = torch.zeros(3, dtype=torch.float64)
    _finish(dist.reduce_scatter_tensor(out, whole, async_op=async_op), async_op)
    np.testing.assert_array_equal(out.numpy(), sum(_values(q * 10 + r, (3,)).numpy() for q in range(n)))
    assert torch.equal(whole, before), "reduce_scatter_tensor changed its input"
    # one large enough for the ring (from 4 MiB): read where it lies, left unchanged too
    big = torch.arange(n * 600_000, dtype=torch.float32) % 1000 + r
    before = big.clone()
    piece = torch.empty(600_000, dtype=torch.float32)
    _finish(dist.reduce_scatter_tensor(piece, big, async_op=async_op), async_op)
    own = (torch.arange(r * 600_000, (r + 1) * 600_000, dtype=torch.float32) % 1000) * n + sum(range(n))
    assert torch.equal(piece, own) and torch.equal(big, before)
    if n > 1:  # (one rank runs no engine: its results are copies)
        assert seen == [], f"results were copied into outputs of shapes {seen}; they should land in place"

    # FSDP2's all-gather: this rank's input is its own slot of the output
    gathered = torch.zeros(n * 4, dtype=torch.float64)
    gathered[r * 4:(r + 1) * 4] = _values(r, (4,))
    _finish(dist.all_gather_into_tensor(gathered, gathered[r * 4:(r + 1) * 4], async_op=async_op), async_op)
    np.testing.assert_array_equal(gathered.numpy(), np.concatenate([_values(k, (4,)).numpy() for k in range(n)]))
    # a reduce-scatter into its input's own piece: read before written (its result is copied)
    whole = torch.cat([_values(r * 10 + k, (3,)) for k in range(n)])
    _finish(dist.reduce_scatter_tensor(whole[r * 3:(r + 1) * 3], whole, async_op=async_op), async_op)
    np.testing.assert_array_equal(whole[r * 3:(r + 1) * 3].numpy(),
                                  sum(_values(q * 10 + r, (3,)).numpy() for q in range(n)))
    # non-contiguous outputs: the results are copied in
    wide = torch.zeros(3, n * 2, dtype=torch.float64).t()
    _finish(dist.all_gather_into_tensor(wide, _values(r, (2, 3)), async_op=async_op), async_op)
    np.testing.assert_array_equal(wide.numpy(), np.concatenate([_values(k, (2, 3)).numpy() for k in range(n)]))
    strided = torch.zeros(4, 6, dtype=torch.float64)[:, ::2]
    strided.copy_(_values(r, (4, 3)))
    _finish(dist.broadcast(strided, src=n - 1, async_op=async_op), async_op)
    np.testing.assert_array_equal(strided.numpy(), _values(n - 1, (4, 3)).numpy())
    if n > 1:  # (the all-gather's copied piece by piece; the broadcast's root keeps its own values)
        assert (2, 3) in seen and ((4, 3) in seen) == (r != n - 1), seen


@pytest.mark.parametrize("async_op", [False, True])
def test_all_to_all_even_and_with_split_sizes(async_op):
    r, n = _rank_size()
    ins = [torch.full((2,), float(r * 100 + k)) for k in range(n)]
    outs = [torch.zeros(2) for _ in range(n)]
    _finish(dist.all_to_all(outs, ins, async_op=async_op), async_op)
    assert [o.tolist() for o in outs] == [[float(k * 100 + r)] * 2 for k in range(n)]
    # rank q sends (q + k + 1) rows to rank k
    sends = [r + k + 1 for k in range(n)]
    src = torch.cat([torch.full((s, 2), float(r * 100 + k)) for k, s in enumerate(sends)])
    recv = [q + r + 1 for q in range(n)]
    dst = torch.zeros(sum(recv), 2)
    _finish(dist.all_to_all_single(dst, src, output_split_sizes=recv, input_split_sizes=sends, async_op=async_op),
            async_op)
    want = torch.cat([torch.full((recv[q], 2), float(q * 100 + r)) for q in range(n)])
    assert torch.equal(dst, want)


def test_barrier_and_many_async_ops_in_flight():
    r, n = _rank_size()
    dist.barrier()
    tensors = [torch.full((64,), float(r + i)) for i in range(20)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for w in works:
        w.wait()
    for i, t in enumerate(tensors):
        assert t[0].item() == sum(k + i for k in range(n))


def test_errors_reach_wait_on_every_rank():
    """What the backend does not support is an ``UnsupportedError`` on every rank: a NotImplementedError (so
    a RuntimeError, as gloo's "Cannot use ReduceOp.BAND with non-integral dtype") and Unison's CollectiveError
    (a TypeError). Before 2026-12-06 BAND of floats raised a plain CollectiveError, and PREMUL_SUM of integers
    a ValueError on its own rank only (another rank's float call then waited)."""
    r, n = _rank_size()
    with _raises_exactly(UnsupportedError, r"ReduceOp.BAND of float32 tensors: .*bitwise operation on integers") \
            as info:  # BAND of floats: on every rank
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, async_op=True).wait()
    assert isinstance(info.value, (NotImplementedError, RuntimeError, TypeError, hvd.CollectiveError))
    with _raises_exactly(UnsupportedError, "PREMUL_SUM of int64 tensors: PREMUL_SUM scales floating-point"):
        dist.all_reduce(torch.ones(2, dtype=torch.int64 if r == 0 else torch.float64),
                        op=dist._make_nccl_premul_sum(2.0))
    with _raises_exactly(UnsupportedError, "AVG of bool tensors"):
        dist.reduce_scatter_tensor(torch.zeros(1, dtype=torch.bool), torch.ones(n, dtype=torch.bool),
                                   op=dist.ReduceOp.AVG)
    if n > 1:
        work = dist.all_reduce(torch.ones(r + 2), async_op=True)  # shapes differ per rank
        with _raises_exactly(MismatchError, "was submitted with different arguments on different ranks"):
            work.wait()
    dist.barrier()  # the group still works afterwards


@pytest.mark.parametrize("call", ["all_reduce", "broadcast", "reduce_scatter_tensor", "all_to_all_single"])
def test_an_unsupported_refusal_is_known_by_its_kind_not_its_words(monkeypatch, call):
    """Rank 0 refuses its tensor with an ``UnsupportedError`` whose message lacks "unsupported by the unison
    backend: ": every rank raises ``UnsupportedError`` (engine [Note: refusal kinds]), also in a job of one rank,
    where broadcast, reduce-scatter and all-to-all run the direct collectives (which carry a TypeError's kind
    only: process_group_work.py's ``OwnRefusals``). Before 2026-12-06 (a second change) a ``CollectiveError``."""
    r, n = _rank_size()
    module = sys.modules[UnisonProcessGroup.allreduce.__module__]  # (where the collectives call ``host``)
    real_host, refusal = module.host, UnsupportedError(f"{call} refused by a check of rank 0's own")

    def host(tensor: torch.Tensor, what: str) -> Any:
        if r == 0:
            raise refusal
        return real_host(tensor, what)

    with monkeypatch.context() as patch, _raises_exactly(UnsupportedError, "rank 0's own") as info:
        patch.setattr(module, "host", host)
        if call == "all_reduce":
            dist.all_reduce(torch.ones(2))
        elif call == "broadcast":
            dist.broadcast(torch.ones(2), src=0)
        elif call == "reduce_scatter_tensor":
            dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2 * n))
        else:
            dist.all_to_all_single(torch.zeros(n), torch.ones(n))
    assert n == 1 or "failed on 1 of" in str(info.value)  # (every rank names rank 0's refusal)
    dist.barrier()  # the group still works afterwards


def test_ddp_training_equals_one_process_on_the_global_batch():
    r, n = _rank_size()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n * 4, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(n * 4, 2, generator=gen, dtype=torch.float64)

    def net() -> torch.nn.Module:
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).double()

    reference = net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model = net()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
        opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("async_op", [False, True])
def test_reduce_gather_scatter_to_and_from_a_root(async_op):
    r, n = _rank_size()
    root = n - 1
    t = _values(r)
    _finish(dist.reduce(t, dst=root, op=dist.ReduceOp.SUM, async_op=async_op), async_op)
    if r == root:
        np.testing.assert_allclose(t.numpy(), sum(_values(k).numpy() for k in range(n)))
    else:
        np.testing.assert_array_equal(t.numpy(), _values(r).numpy())  # untouched off the root
    gathered = [torch.zeros(5, dtype=torch.float64) for _ in range(n)] if r == root else None
    _finish(dist.gather(_values(r), gather_list=gathered, dst=root, async_op=async_op), async_op)
    if r == root:
        for k, g in enumerate(gathered):
            np.testing.assert_array_equal(g.numpy(), _values(k).numpy())
    out = torch.zeros(2, 3, dtype=torch.float64)
    pieces = [_values(k, (2, 3)) for k in range(n)] if r == root else None
    _finish(dist.scatter(out, scatter_list=pieces, src=root, async_op=async_op), async_op)
    np.testing.assert_array_equal(out.numpy(), _values(r, (2, 3)).numpy())


def test_send_recv_around_a_ring_and_from_any_source():
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    ahead, behind = (r + 1) % n, (r - 1) % n
    got = torch.zeros(4, dtype=torch.float64)
    recv = dist.irecv(got, src=behind, tag=7)
    send = dist.isend(_values(r, (4,)), dst=ahead, tag=7)
    send.wait()
    recv.wait()
    np.testing.assert_array_equal(got.numpy(), _values(behind, (4,)).numpy())
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.zeros(1, dtype=torch.int64)
            src = dist.recv(t, tag=9)  # any source
            assert t.item() == src * 10
            seen.add(src)
        assert seen == set(range(1, n))
    else:
        dist.send(torch.tensor([r * 10]), dst=0, tag=9)
    dist.barrier()


def test_fsdp2_training_equals_one_process_on_the_global_batch():
    """FSDP2 ``fully_shard`` on a 1-D DeviceMesh of the unison backend: its all-gathers and
    reduce-scatters through the engine; each rank's parameter shards match one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch_fsdp_case import train_fsdp_and_reference

    r, n = _rank_size()
    if n == 1:
        pytest.skip("sharding over one rank is the plain model (the suite's np 3 run covers FSDP2)")
    got, want = train_fsdp_and_reference(init_device_mesh("cpu", (n,)), r, n, outputs=1)
    for p, q in zip(got, want, strict=True):
        chunks = torch.chunk(q.detach(), n, dim=0)  # FSDP2's split of dim 0; a short one leaves ranks empty
        mine = chunks[r] if r < len(chunks) else q.detach()[:0]
        np.testing.assert_allclose(p.to_local().detach().numpy(), mine.numpy(), rtol=1e-12, atol=1e-14)


class _TwoHeads(torch.nn.Module):
    """A trunk and two heads; ``forward(x, head)`` uses one head (the other gets no gradient), or both (-1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.trunk = torch.nn.Linear(6, 8).double()
        self.heads = torch.nn.ModuleList([torch.nn.Linear(8, 2).double(), torch.nn.Linear(8, 2).double()])

    def forward(self, x: torch.Tensor, head: int = -1) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.heads[0](h) + self.heads[1](h) if head < 0 else self.heads[head](h)


def _ddp_case(micro: int, hook: Any = None, unused: bool = False, steps: int = 2) -> tuple[list, list]:
    """DDP at ``micro`` micro-batches per step (``no_sync`` for all but the last) against one process."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("DDP over one rank reduces nothing (the suite's np 3 run covers it)")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(steps * micro * n * 4, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(steps * micro * n * 4, 2, generator=gen, dtype=torch.float64)
    ref, model = _TwoHeads(), _TwoHeads()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=unused)
    if hook is not None:
        ddp.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(steps):
        head = s % 2 if unused else -1  # with unused=True each step trains one head only
        chunk = slice(s * micro * n * 4, (s + 1) * micro * n * 4)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x[chunk], head), y[chunk]).backward()
        ref_opt.step()
        opt.zero_grad()
        for m in range(micro):
            rows = slice(chunk.start + (m * n + r) * 4, chunk.start + (m * n + r + 1) * 4)
            ctx = ddp.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                (torch.nn.functional.mse_loss(ddp(x[rows], head), y[rows]) / micro).backward()
        opt.step()
    return list(model.parameters()), list(ref.parameters())


def test_ddp_no_sync_accumulates_like_one_process():
    got, want = _ddp_case(micro=3)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.detach().numpy(), w.detach().numpy(), rtol=0, atol=1e-12)


def test_ddp_find_unused_parameters():
    got, want = _ddp_case(micro=1, unused=True, steps=3)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.detach().numpy(), w.detach().numpy(), rtol=0, atol=1e-12)


def test_ddp_fp16_compress_hook():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    got, want = _ddp_case(micro=1, hook=default_hooks.fp16_compress_hook)
    for g, w in zip(got, want, strict=True):  # gradients crossed the wire as float16
        np.testing.assert_allclose(g.detach().numpy(), w.detach().numpy(), rtol=0, atol=2e-3)
    differs = [not np.array_equal(g.detach().numpy(), w.detach().numpy()) for g, w in zip(got, want, strict=True)]
    assert any(differs)  # the hook did run (float16 rounding shows)


def test_point_to_point_messages_over_the_count_limit(monkeypatch):
    """Before: a send or receive was one MPI message counted in bytes, and Open MPI refuses a count of 2**31
    bytes or more (dist.send of a 2 GiB + 4 KiB tensor failed with MPI_ERR_ARG; now checked by hand both
    ways). Such buffers now travel as one element of a derived datatype: the limit is lowered to 16 bytes
    here (blocks of 16) so that small tensors take that path: messages of many blocks, of an exact number
    of blocks, shorter than the tensor received into, three in flight from one sender with one tag (waited
    in reverse order: each must get its own message), from any source, bfloat16, and a message longer than
    the tensor (an error there, and the next receive is not disturbed)."""
    from unison.torch_backend import process_group_work

    monkeypatch.setattr(process_group_work, "P2P_TYPED_BYTES", 16)
    monkeypatch.setattr(process_group_work, "P2P_BLOCK_BYTES", 16)
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    ahead, behind = (r + 1) % n, (r - 1) % n
    longer = torch.full((50,), -1.0, dtype=torch.float64)
    exact = torch.zeros(4, dtype=torch.float64)
    first, second, third = (torch.zeros(40, dtype=torch.float64) for _ in range(3))
    half = torch.zeros(30, dtype=torch.bfloat16)
    recvs = [dist.irecv(longer, src=behind, tag=3), dist.irecv(exact, src=behind, tag=4),
             dist.irecv(first, src=behind, tag=5), dist.irecv(second, src=behind, tag=5),
             dist.irecv(third, src=behind, tag=5), dist.irecv(half, src=behind, tag=6)]
    sends = [dist.isend(t, dst=ahead, tag=tag) for t, tag in (
        (_values(r, (40,)), 3), (_values(r, (4,)), 4), (_values(r, (40,)), 5), (_values(r + 100, (40,)), 5),
        (_values(r + 200, (40,)), 5), (_values(r, (30,), torch.bfloat16), 6))]
    for work in reversed(recvs):
        work.wait()
    for work in sends:
        work.wait()
    np.testing.assert_array_equal(longer[:40].numpy(), _values(behind, (40,)).numpy())
    np.testing.assert_array_equal(longer[40:].numpy(), -1.0)  # a shorter message leaves the rest
    np.testing.assert_array_equal(exact.numpy(), _values(behind, (4,)).numpy())
    np.testing.assert_array_equal(first.numpy(), _values(behind, (40,)).numpy())
    np.testing.assert_array_equal(second.numpy(), _values(behind + 100, (40,)).numpy())
    np.testing.assert_array_equal(third.numpy(), _values(behind + 200, (40,)).numpy())
    assert torch.equal(half, _values(behind, (30,), torch.bfloat16))
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.zeros(9, dtype=torch.int64)
            src = dist.recv(t, tag=9)  # any source
            assert t.tolist() == [src * 10 + k for k in range(9)]
            seen.add(src)
        assert seen == set(range(1, n))
    else:
        dist.send(torch.arange(9) + r * 10, dst=0, tag=9)
    short = torch.zeros(5, dtype=torch.float64)
    after = torch.zeros(5, dtype=torch.float64)
    too_long = dist.irecv(short, src=behind, tag=8)
    then = dist.irecv(after, src=behind, tag=8)
    sent = [dist.isend(_values(r, (40,)), dst=ahead, tag=8), dist.isend(_values(r + 7, (5,)), dst=ahead, tag=8)]
    from mpi4py import MPI

    with _raises_exactly(MPI.Exception, "TRUNCATE|truncat"):
        too_long.wait()
    then.wait()
    for work in sent:
        work.wait()
    np.testing.assert_array_equal(after.numpy(), _values(behind + 7, (5,)).numpy())
    dist.barrier()


def test_complex_reductions_and_the_stack_forms():
    """Before: complex reduce-scatter and reduce raised ("dtype complex128 is not supported"), and the
    documented stack forms of all_gather_into_tensor and reduce_scatter_tensor raised on every rank."""
    r, n = _rank_size()
    z = [torch.arange(2.0 * n, dtype=torch.float64) * (k + 1) + 1j * (k - 0.5) for k in range(n)]
    total = sum(v.numpy() for v in z)
    out = torch.zeros(2, dtype=torch.complex128)
    dist.reduce_scatter_tensor(out, z[r], op=dist.ReduceOp.AVG)
    np.testing.assert_allclose(out.numpy(), total[2 * r:2 * r + 2] / n)
    red = z[r].clone()
    dist.reduce(red, dst=0)
    if r == 0:
        np.testing.assert_allclose(red.numpy(), total)
    stacked = torch.zeros(n, 3)
    dist.all_gather_into_tensor(stacked, torch.full((3,), float(r)))
    np.testing.assert_array_equal(stacked.numpy(), np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1))
    piece = torch.zeros(3)
    dist.reduce_scatter_tensor(piece, torch.arange(3.0 * n).reshape(n, 3) + r)
    np.testing.assert_array_equal(piece.numpy(), n * np.arange(3.0 * n).reshape(n, 3)[r] + sum(range(n)))


def test_float8_sends_and_receives_move_the_bytes():
    """Before: a float8 send or receive raised numpy's "Got unsupported ScalarType Float8_e4m3fn" on both ranks
    (gloo sends them; the docs said point to point moves any dtype as bytes)."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    ahead, behind = (r + 1) % n, (r - 1) % n
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got = torch.zeros(12, dtype=dtype)
        strided = torch.zeros((6, 2), dtype=dtype)[:, 0]  # a non-contiguous receive, written through
        works = [dist.irecv(got, src=behind, tag=1), dist.irecv(strided, src=behind, tag=2),
                 dist.isend(_values(r, (12,), dtype), dst=ahead, tag=1),
                 dist.isend(_values(r + 7, (6,), dtype), dst=ahead, tag=2)]
        for work in works:
            work.wait()
        assert torch.equal(got.view(torch.uint8), _values(behind, (12,), dtype).view(torch.uint8)), dtype
        assert torch.equal(strided.contiguous().view(torch.uint8),
                           _values(behind + 7, (6,), dtype).view(torch.uint8)), dtype


def test_batch_isend_irecv_around_a_ring():
    """``dist.batch_isend_irecv`` (as torch's pipelining uses it): each op issued on its own, all in flight."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    sends = [_values(r, (3,)), _values(r + 10, (2, 2))]
    recvs = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)]
    ops = [dist.P2POp(dist.isend, sends[0], (r + 1) % n), dist.P2POp(dist.isend, sends[1], (r - 1) % n),
           dist.P2POp(dist.irecv, recvs[0], (r - 1) % n), dist.P2POp(dist.irecv, recvs[1], (r + 1) % n)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    np.testing.assert_array_equal(recvs[0].numpy(), _values((r - 1) % n, (3,)).numpy())
    np.testing.assert_array_equal(recvs[1].numpy(), _values((r + 1) % n + 10, (2, 2)).numpy())


@pytest.mark.parametrize("schedule_name", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_pipelining_gradients_equal_one_process(schedule_name):
    """torch.distributed.pipelining over the backend's send/recv: GPipe and 1F1B with one stage per rank,
    interleaved 1F1B with two (stages r and r + n on rank r)."""
    from torch.distributed import pipelining

    r, n = _rank_size()
    if n == 1:
        pytest.skip("a pipeline needs two ranks")
    per_rank = 2 if schedule_name == "Interleaved1F1B" else 1
    stages = n * per_rank

    def layers() -> torch.nn.Sequential:
        torch.manual_seed(5)
        pairs = [(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(stages)]
        return torch.nn.Sequential(*[m for pair in pairs for m in pair]).double()

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean()

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    ref = layers()
    torch.stack([loss_fn(ref(xm), ym) for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True)]).mean().backward()
    full = layers()
    mine = [r + k * n for k in range(per_rank)]  # this rank's stages
    parts = [full[2 * s:2 * s + 2] for s in mine]
    built = [pipelining.PipelineStage(part, s, stages, torch.device("cpu")) for part, s in zip(parts, mine,
                                                                                                strict=True)]
    schedule_class = getattr(pipelining, f"Schedule{schedule_name}")
    schedule = schedule_class(built if per_rank > 1 else built[0], n_microbatches=4, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    if r == 0:
        schedule.step(x)
    elif r == n - 1:
        schedule.step(target=y, losses=losses)
        assert len(losses) == 4
    else:
        schedule.step()
    for part, s in zip(parts, mine, strict=True):
        for p, q in zip(part.parameters(), ref[2 * s:2 * s + 2].parameters(), strict=True):
            np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-10, atol=1e-14)


# ---------------------------------------------------------------- edge cases found by an audit against gloo

def test_zero_element_all_gather_and_the_group_goes_on():
    r, n = _rank_size()
    for shape in ((0,), (3, 0)):
        outs = [torch.ones(shape) for _ in range(n)]
        dist.all_gather(outs, torch.zeros(shape))
        assert all(o.shape == shape for o in outs)
    flat = torch.ones(0)
    dist.all_gather_into_tensor(flat, torch.zeros(0))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n


def test_gather_of_a_bigger_tensor_than_the_roots_raises_on_every_rank():
    """gloo aborts the root; the unison root raised nothing and dropped the extra elements (before 2026-12-05),
    then raised alone (before 2026-12-06: the others returned). Rows of ``numel`` elements now travel, whose
    width the engine compares: MismatchError on every rank (tests/mpi/mpi_torch_pg_checks.py has scatter)."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    t = torch.arange(2.0 + 2 * (r == n - 1))  # the last rank sends 4 elements, the others 2
    outs = [torch.zeros(2) for _ in range(n)] if r == 0 else None
    with _raises_exactly(MismatchError, r"shape=\(1, 4\)"):
        dist.gather(t, outs, dst=0)
    dist.barrier()


def test_arguments_one_rank_refuses_raise_on_every_rank_and_the_next_call_pairs():
    """Refused on one rank before it submitted anything, the others' call was left unpaired, so the
    next call paired with it: stale data on that rank and a hang on the others (before 2026-12-05).
    A reduce whose ranks named different roots kept or dropped the sum as each thought, silently."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    bad = r == 1
    with pytest.raises(ValueError, match=r"failed on 1 of \d rank\(s\): rank 1: allgather needs"):
        dist.all_gather_into_tensor(torch.zeros(2 * n + bad), torch.full((2,), float(r)))
    out = torch.zeros(2 * n)
    dist.all_gather_into_tensor(out, torch.full((2,), 10.0 * r))
    assert out.tolist() == [10.0 * k for k in range(n) for _ in range(2)]
    splits = [2 if bad and k == 0 else 1 for k in range(n)]
    with pytest.raises(ValueError, match=r"rank 1: all_to_all_single: input_split_sizes \[2, 1"):
        dist.all_to_all_single(torch.zeros(n), torch.arange(float(n)), input_split_sizes=splits)
    pieces = [torch.ones(2 + (bad and k == 0)) for k in range(n)]
    with pytest.raises(ValueError, match=r"rank 1: reduce_scatter needs"):
        dist.reduce_scatter(torch.zeros(2), pieces)
    t = torch.full((3,), float(r + 1))
    with pytest.raises(ValueError, match=r"root_rank=0.*root_rank=1|root_rank=1.*root_rank=0"):
        dist.reduce(t, dst=1 if bad else 0)
    dist.reduce(t, dst=1)
    assert t.tolist() == ([n * (n + 1) / 2] * 3 if bad else [r + 1.0] * 3)
    world = dist.new_group()  # another group of every rank: its own engine process set
    t = torch.full((3,), float(r + 1))
    with pytest.raises(ValueError, match=r"root_rank=0.*root_rank=1|root_rank=1.*root_rank=0"):
        dist.reduce(t, dst=1 if bad else 0, group=world)
    dist.reduce(t, dst=1, group=world)
    assert t.tolist() == ([n * (n + 1) / 2] * 3 if bad else [r + 1.0] * 3)


def test_coalesced_lists_of_different_lengths_and_a_non_cpu_tensor_raise_on_every_rank():
    """Before 2026-12-05: a longer list's extra tensor paired with the other ranks' next collective (rank 1
    read 120 where 30 was right, then a hang), and a meta (or CUDA) tensor on one rank raised there alone,
    the others' all_reduce pairing with its next one (wrong values on both, then a hang)."""
    import torch.distributed._functional_collectives as funcol

    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    mine = [torch.ones(3), torch.full((3,), 100.0)][:1 if r else 2]
    with pytest.warns(FutureWarning), _raises_exactly(MismatchError, "the ranks passed 1 to 2 tensors"):
        dist.all_reduce_coalesced(mine)
    with _raises_exactly(MismatchError, "the ranks passed 1 to 2 tensors"):  # (raised where the results wait)
        [funcol.wait_tensor(t) for t in funcol.all_gather_into_tensor_coalesced(mine, dist.group.WORLD)]
    with _raises_exactly(MismatchError, "the ranks passed 1 to 2 tensors"):
        [funcol.wait_tensor(t) for t in funcol.reduce_scatter_tensor_coalesced(
            [torch.ones(2 * n)] * len(mine), "sum", [0] * len(mine), dist.group.WORLD)]
    c = torch.full((3,), 10.0 * (r + 1))
    dist.all_reduce(c)
    assert c.tolist() == [10.0 * n * (n + 1) / 2] * 3
    on_cpu_only = "rank 0: unsupported by the unison backend: a tensor on meta: it takes CPU tensors only"
    with _raises_exactly(UnsupportedError, on_cpu_only):
        dist.all_reduce(torch.ones(3, device="meta") if r == 0 else torch.ones(3))
    with _raises_exactly(UnsupportedError, on_cpu_only):
        dist.broadcast(torch.ones(3, device="meta") if r == 0 else torch.ones(3), src=0)
    # before 2026-12-06 these refused the meta tensor on rank 0 alone: the others' call was left unpaired
    with _raises_exactly(UnsupportedError, on_cpu_only):
        dist.gather(torch.ones(3, device="meta") if r == 0 else torch.ones(3),
                    [torch.zeros(3) for _ in range(n)] if r == n - 1 else None, dst=n - 1)
    with _raises_exactly(UnsupportedError, on_cpu_only):
        dist.scatter(torch.zeros(3, device="meta") if r == 0 else torch.zeros(3),
                     [torch.ones(3) for _ in range(n)] if r == n - 1 else None, src=n - 1)
    with _raises_exactly(UnsupportedError, on_cpu_only):
        dist.all_to_all_single(torch.zeros(n), torch.ones(n, device="meta") if r == 0 else torch.ones(n))
    c = torch.full((3,), float(r + 1))
    dist.all_reduce(c)
    assert c.tolist() == [n * (n + 1) / 2] * 3


def test_ranks_and_tags_gloo_refuses_are_refused_and_gathers_future_is_a_flat_list():
    """Found by a differential audit against gloo (2026-12-05): gather's future held [[t0, t1]] on the root
    (gloo: [t0, t1]); on the default group a rank of -1 reached MPI as its wildcard: recv(src=-1) took any
    sender's message, irecv(tag=-1) any tag, gather(dst=-1) sent everything to the last rank and wrote
    nothing, silently."""
    r, n = _rank_size()
    outs = [torch.zeros(2) for _ in range(n)] if r == n - 1 else None
    fut = dist.gather(torch.full((2,), float(r)), outs, dst=n - 1, async_op=True).get_future()
    value = fut.wait()
    if r == n - 1:
        assert isinstance(value, list) and [v.tolist() for v in value] == [[float(k)] * 2 for k in range(n)]
    else:
        assert value == []
    for call in (lambda: dist.gather(torch.zeros(1), None, dst=-1),
                 lambda: dist.scatter(torch.zeros(1), None, src=-1)):
        with pytest.raises(ValueError, match="is not a rank of this group"):
            call()
    if n > 1:  # a root refused on one rank only travels: every rank raises, and the next call pairs
        with pytest.raises(ValueError, match="gather: dst=-1 is not a rank of this group"):
            dist.gather(torch.zeros(1), [torch.zeros(1) for _ in range(n)] if r == n - 1 else None,
                        dst=-1 if r == 0 else n - 1)
        dist.all_reduce(c := torch.ones(1))
        assert c.tolist() == [float(n)]
    with pytest.raises(ValueError, match="is not a rank of this group"):
        dist.recv(torch.zeros(1), src=-1)
    with pytest.raises(ValueError, match="is not a rank of this group"):
        dist.send(torch.zeros(1), dst=n)
    with pytest.raises(ValueError, match="Tag must be nonnegative"):
        dist.irecv(torch.zeros(1), src=0, tag=-1)
    with pytest.raises(ValueError, match="Tag must be nonnegative"):
        dist.isend(torch.zeros(1), dst=0, tag=-1)
    dist.barrier()


def test_all_to_all_output_sizes_that_do_not_match_what_arrives_raise_there():
    r, n = _rank_size()
    if n < 3:
        pytest.skip("needs three ranks (at two, the sizes below are the right ones)")
    sent = torch.arange(float(n))  # one element to each rank
    wrong = [n - 1, 1] + [0] * (n - 2)  # adds up to n, but rank 0 sent 1 row, not n - 1
    if r == 1:
        with pytest.raises(ValueError, match=r"output_split_sizes .* but the ranks sent \[1, 1"):
            dist.all_to_all_single(torch.zeros(n), sent, output_split_sizes=wrong)
    else:
        dist.all_to_all_single(torch.zeros(n), sent)
    outs = [torch.zeros(2 if (r == 1 and k == 0) else 1) for k in range(n)]
    if r == 1:
        with pytest.raises(ValueError, match=r"alltoall: this rank's output tensors hold \[2, 1"):
            dist.all_to_all(outs, [sent[k:k + 1] for k in range(n)])
    else:
        dist.all_to_all(outs, [sent[k:k + 1] for k in range(n)])
    dist.barrier()


def test_wait_with_a_timeout_raises_and_the_collective_can_still_finish():
    """gloo's contract: wait(timeout) raises when the others have not come; ours leaves the collective in
    flight, so it completes once they do. A group's own timeout (new_group(timeout=...)) applies to
    a plain synchronous call too."""
    import time
    from datetime import timedelta

    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    t = torch.ones(2)
    if r == 0:
        work = dist.all_reduce(t, async_op=True)
        with pytest.raises(dist.DistBackendError, match=r"did not complete within 0.3 s"):
            work.wait(timeout=timedelta(seconds=0.3))
        dist.barrier()  # the others join the all-reduce before this barrier
        work.wait()
    else:
        time.sleep(0.6)
        dist.all_reduce(t)
        dist.barrier()
    assert t.tolist() == [n, n]
    quick = dist.new_group(list(range(n)), timeout=timedelta(seconds=0.3))
    u = torch.ones(1)
    if r == 0:
        with pytest.raises(dist.DistBackendError, match=r"within 0.3 s"):
            dist.all_reduce(u, group=quick)
        dist.barrier()
    else:
        time.sleep(0.6)
        dist.all_reduce(u, group=quick)
        dist.barrier()
    dist.barrier()
    got = torch.zeros(3)
    if r == 1:  # a receive with no sender yet times out; the message still lands later
        recv = dist.irecv(got, src=0, tag=21)
        with pytest.raises(dist.DistBackendError, match=r"a send or receive did not complete within 0.2 s"):
            recv.wait(timeout=timedelta(seconds=0.2))
        dist.barrier()
        recv.wait()
        assert got.tolist() == [1.0, 2.0, 3.0]
    else:
        dist.barrier()
        if r == 0:
            dist.send(torch.tensor([1.0, 2.0, 3.0]), dst=1, tag=21)
    dist.barrier()


def test_point_to_point_futures_taken_before_waiting_complete():
    """gloo raises 'not implemented'; ours completes them (a large send's future used to block until
    the peer received, and both peers asked before posting their receives: a hang)."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    peer = r ^ 1
    if peer >= n:  # an odd rank count leaves the last rank out
        dist.barrier()
        return
    big = torch.full((2_000_000,), float(r))
    got = torch.zeros(2_000_000)
    fs = dist.isend(big, peer).get_future()
    fr = dist.irecv(got, peer).get_future()
    torch.futures.wait_all([fs, fr])
    assert got[0].item() == peer and got[-1].item() == peer
    assert fr.value()[0] is got
    dist.barrier()


def test_work_result_exception_and_success():
    r, n = _rank_size()
    t = torch.ones(3)
    work = dist.all_reduce(t, async_op=True)
    assert work.result()[0] is t and work.is_success() and work.exception() is None
    if n > 1:
        bad = dist.all_reduce(torch.ones(r + 2), async_op=True)  # shapes differ per rank
        with _raises_exactly(MismatchError, "was submitted with different arguments on different ranks"):
            bad.wait()
        assert not bad.is_success() and bad.exception() is not None
    dist.barrier()
