"""Checks of the ``torch.distributed`` backend found missing by an audit of issue 20 (run by
tests/test_torch_process_group_mpi.py at np 2 and 3, the same body at any size).

Comm hooks that issue collectives from future callbacks (PowerSGD), dtypes the engine does not
carry, scatter/gather sizes that differ across ranks, the functional collectives' premul_sum, a
barrier that waits and ``monitored_barrier``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import unison.torch_backend  # noqa: F401 - registers the backend
from unison.common.exceptions import MismatchError
from unison.torch_backend import UnsupportedError

torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _group():
    dist.init_process_group("unison")
    yield
    dist.destroy_process_group()


def _rank_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


@contextlib.contextmanager
def _raises_exactly(cls: type[BaseException], match: str) -> Any:
    """``pytest.raises(cls, match=...)`` that also refuses a subclass of ``cls``."""
    with pytest.raises(cls, match=match) as info:
        yield info
    assert info.type is cls, f"{info.type.__name__} raised where {cls.__name__} was expected: {info.value}"


# ---------------------------------------------------------------- comm hooks issuing collectives from callbacks

def _powersgd_run(serialize: bool, steps: int = 5) -> tuple[list[torch.Tensor], int]:
    """DDP with PowerSGD's hook (a bucket per layer; compression from step 2): the gradients of every step and
    the number of buckets. ``serialize``: each bucket's hook is waited for before the next bucket is handed
    over, so its callbacks' collectives cannot interleave with another bucket's (the reference)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    r, n = _rank_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)]).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.005)  # 8 KiB weights: ~a bucket each
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                             min_compression_rate=0.1, random_seed=7)
    buckets: set[int] = set()

    def hook(state, bucket):  # noqa: ANN001, ANN202 - (DDP checks the annotations it finds)
        buckets.add(bucket.index())
        fut = ps.powerSGD_hook(state, bucket)
        if not serialize:
            return fut
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(fut.wait())
        return done

    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(11)
    grads = []
    for _ in range(steps):
        x = torch.randn(n * 4, 32, generator=gen, dtype=torch.float64)
        opt.zero_grad()
        ddp(x[r * 4:(r + 1) * 4]).pow(2).mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        opt.step()
    return grads, len(buckets)


def test_powersgd_with_several_buckets_pairs_the_same_tensors_on_every_rank():
    """PowerSGD's hook issues an all-reduce from each of its future callbacks, which run on the completion
    threads, so before 2026-12-06 they reached the engine in a different order on each rank: with several
    buckets a MismatchError (shapes differ), a hang (the chains held every completion thread), or a bucket's
    matrices summed with another bucket's (shapes agree). Now named after their parent work ([Note: collectives
    from future callbacks]): the gradients equal the run whose buckets are reduced one at a time (which cannot
    interleave) on every rank, and equal every other rank's bit for bit; the first step (a plain all-reduce)
    equals one process's gradient of the global batch, and the last one's weight gradients are of rank 2."""
    r, n = _rank_size()
    got, buckets = _powersgd_run(serialize=False)
    want, _ = _powersgd_run(serialize=True)
    assert buckets >= 6, buckets
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        # (bit for bit at 2 ranks; from 3, sums fused with other buckets' add in another order: 1e-19 apart)
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-9, atol=1e-12, err_msg=f"step {step}")
        every = [torch.zeros_like(g) for _ in range(n)]
        dist.all_gather(every, g)
        assert all(torch.equal(e, g) for e in every), f"step {step}: the ranks' gradients differ"
    # the reference's first steps are all-reduces of the global batch's gradient (PowerSGD starts at step 2)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)]).double()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(n * 4, 32, generator=gen, dtype=torch.float64)
    loss = sum(ref(x[k * 4:(k + 1) * 4]).pow(2).mean() for k in range(n)) / n
    loss.backward()
    exact = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    np.testing.assert_allclose(got[0].numpy(), exact.numpy(), rtol=0, atol=1e-12)
    for step in (0, len(got) - 1):  # PowerSGD's gradients of the weights are of rank 2 (it did compress)
        weights = [p.reshape(32, 32) for p in got[step].split([32 * 32, 32] * 8)[::2]]
        ranks = [int(torch.linalg.matrix_rank(w)) for w in weights]
        assert all(k <= 2 for k in ranks) if step else all(k > 2 for k in ranks[1:]), (step, ranks)


def test_collectives_from_future_callbacks_pair_by_parent_not_by_thread():
    """Four all-reduces whose ``then`` callbacks each all-reduce a tensor of the same shape: the ranks run the
    callbacks in opposite orders (sleeps), so by order of arrival bucket 0's tensor met bucket 3's, silently,
    before 2026-12-06. A fifth is waited for before its callback is attached on rank 0 only, so there the
    callback runs at once on the main thread, elsewhere on a completion thread: it must be named alike.
    Callback 2 reduces to the last rank instead (a named reduce)."""
    r, n = _rank_size()
    results: dict[int, torch.Tensor] = {}

    def callback(i: int) -> Any:
        def run(fut: torch.futures.Future) -> torch.Tensor:
            time.sleep(0.03 * (i if r % 2 else 3 - i) if i < 4 else 0)
            t = torch.full((4,), float(100 * i + r))
            if i == 2:
                dist.reduce(t, dst=n - 1)
            else:
                dist.all_reduce(t)  # (synchronous, inside the callback)
            results[i] = t
            return t

        return run

    futures = [dist.all_reduce(torch.ones(4), async_op=True).get_future().then(callback(i)) for i in range(4)]
    work = dist.all_reduce(torch.ones(4), async_op=True)
    if r == 0:
        work.wait()
    futures.append(work.get_future().then(callback(4)))
    torch.futures.wait_all(futures)
    for i in range(5):
        want = float(sum(100 * i + k for k in range(n))) if i != 2 or r == n - 1 else 100.0 * i + r
        assert results[i].tolist() == [want] * 4, (i, results[i])


def test_a_reduce_from_a_callback_to_roots_that_differ_raises_on_every_rank():
    """A reduce issued inside a future's callback is named; the root is still compared across ranks, so ranks
    naming different roots raise MismatchError (until 2026-12-06 a named reduce was an all-reduce named after
    its root: such ranks stalled until the engine's stall check). The next call pairs."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs ranks that differ")

    def run(fut: torch.futures.Future) -> None:
        dist.reduce(torch.ones(2), dst=r)  # (every rank names itself)

    fut = dist.all_reduce(torch.ones(1), async_op=True).get_future().then(run)
    with pytest.raises(MismatchError, match="root"):
        fut.wait()
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(n)] * 2


def test_a_callbacks_collective_and_a_main_thread_one_in_opposite_orders():
    """The group's first member issues a callback's all-reduce (the callback runs at once: its future is done)
    before a main-thread all-reduce of the same shape, the others after it. By order of arrival each rank's
    first call met the other's first call: the callback's tensor summed with the main thread's, silently
    (before 2026-12-06). Now the engine pairs them by name; a sub-group runs its calls in the order they came,
    and there the name is compared, so both calls raise MismatchError on every member and the next call pairs."""
    for group in _groups():
        _opposite_orders(group)


def _opposite_orders(group: Any) -> None:
    me, size = dist.get_rank(group), dist.get_world_size(group)
    done = dist.all_reduce(torch.ones(1), group=group, async_op=True)
    done.wait()
    issued: list[Any] = []

    def callback(fut: torch.futures.Future) -> None:
        t = torch.full((3,), 100.0 + me)
        issued.append((t, dist.all_reduce(t, group=group, async_op=True)))

    main = torch.full((3,), float(me))
    if me == 0:
        done.get_future().then(callback)  # runs here and now: the callback's call comes first
    try:
        dist.all_reduce(main, group=group)
        main_error = None
    except MismatchError as error:
        main_error = error
    if me != 0:
        done.get_future().then(callback)
    (t, work), = issued
    if size < dist.get_world_size():  # a sub-group of its own communicator
        assert main_error is not None and "name=" in str(main_error), main_error
        with _raises_exactly(MismatchError, "name='torch"):
            work.wait()
    else:
        assert main_error is None, main_error
        work.wait()
        assert main.tolist() == [float(sum(range(size)))] * 3
        assert t.tolist() == [100.0 * size + sum(range(size))] * 3
    after = torch.ones(2)
    dist.all_reduce(after, group=group)
    assert after.tolist() == [float(size)] * 2


# ---------------------------------------------------------------- dtypes the engine does not carry

_UNCARRIED = [torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]


def _groups() -> list[Any]:
    """The default group, another group of every rank (an engine process set) and, from 3 ranks, a sub-group
    of ranks 0 and 1 (its own communicator), on its members only (every rank takes part in making each)."""
    r, n = _rank_size()
    groups = [dist.group.WORLD, dist.new_group(list(range(n)))]
    if n > 2:
        pair = dist.new_group([0, 1])
        groups += [pair] if r < 2 else []
    return groups


def _calls_of(group: Any, size: int, dtype: torch.dtype) -> dict[str, Any]:
    """Calls of ``dtype`` tensors on ``group`` (of ``size`` ranks), by the name the backend's refusal gives."""
    return {
        "allreduce": lambda: dist.all_reduce(torch.zeros(3, dtype=dtype), group=group),
        "broadcast": lambda: dist.broadcast(torch.zeros(3, dtype=dtype), group=group, group_src=0),
        "allgather": lambda: dist.all_gather_into_tensor(torch.zeros(3 * size, dtype=dtype),
                                                         torch.zeros(3, dtype=dtype), group=group),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.zeros(size, dtype=dtype),
                                                            torch.zeros(size, dtype=dtype), group=group),
    }


@pytest.mark.parametrize("dtype", _UNCARRIED, ids=str)
def test_a_dtype_the_engine_does_not_carry_raises_unsupported_error_on_every_rank(dtype):
    """Before 2026-12-06: uint32/uint64 raised the engine's CollectiveError (neither a NotImplementedError nor a
    ValueError), and float8 a CollectiveError quoting numpy ("Got unsupported ScalarType Float8_e4m3fn") that
    named no call; the same in sub-groups. Now UnsupportedError naming the call, the dtype and what is carried,
    on every rank of the default group, of another group of every rank and of a sub-group; the next call pairs."""
    name = str(dtype).replace("torch.", "")
    for group in _groups():
        size = dist.get_world_size(group)
        calls = _calls_of(group, size, dtype)
        for what, call in calls.items():
            wanted = rf"{what} of {name} tensors: its collectives carry float16, bfloat16, .*uint16, bool; cast it"
            with _raises_exactly(UnsupportedError, wanted) as info:
                call()
            assert isinstance(info.value, NotImplementedError), info.value  # (as the issue asks)
        t = torch.ones(2)
        dist.all_reduce(t, group=group)  # the next call pairs
        assert t.tolist() == [float(size)] * 2


# ---------------------------------------------------------------- sizes only one rank could tell

def test_scatter_and_gather_sizes_that_differ_raise_mismatch_on_every_rank_and_the_next_call_pairs():
    """Before 2026-12-06 a non-root scatter output of another size than the root's pieces raised ValueError on
    that rank alone (the root returned), and a gather tensor of another size raised on the root alone. Each
    now sends rows of ``numel`` elements, whose width the engine (or a sub-group's agreement) compares: the
    same MismatchError on every rank, in every kind of group, and the next call pairs."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    for group in _groups():
        me, size = dist.get_rank(group), dist.get_world_size(group)
        last = size - 1
        out = torch.zeros(2 + (me == last))  # the last rank's output holds 3 elements, the root's pieces 2
        pieces = [torch.ones(2) for _ in range(size)] if me == 0 else None
        with _raises_exactly(MismatchError, "different"):
            dist.scatter(out, pieces, group=group, group_src=0)
        mine = torch.arange(2.0 + 2 * (me == last))  # the last rank sends 4 elements, the others 2
        outs = [torch.zeros(2) for _ in range(size)] if me == 0 else None
        with _raises_exactly(MismatchError, "different"):
            dist.gather(mine, outs, group=group, group_dst=0)
        out = torch.zeros(2)  # the next calls pair, and scatter and gather work
        dist.scatter(out, [torch.full((2,), float(k)) for k in range(size)] if me == 0 else None, group=group,
                     group_src=0)
        assert out.tolist() == [float(me)] * 2
        outs = [torch.zeros(2) for _ in range(size)] if me == last else None
        dist.gather(torch.full((2,), float(me)), outs, group=group, group_dst=last)
        if me == last:
            assert [o.tolist() for o in outs] == [[float(k)] * 2 for k in range(size)]
        t = torch.ones(2)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [float(size)] * 2


# ---------------------------------------------------------------- the functional collectives' premul_sum

def test_functional_premul_sum_is_refused_clearly_on_every_rank():
    """Before 2026-12-06 ``funcol.all_reduce(x, "premul_sum", group)`` failed with a pybind TypeError
    ("incompatible function arguments ... AllreduceOptions"): the op name carries no factor."""
    import torch.distributed._functional_collectives as funcol

    r, n = _rank_size()
    for call in (lambda: funcol.all_reduce(torch.ones(2), "premul_sum", dist.group.WORLD),
                 lambda: funcol.reduce_scatter_tensor(torch.ones(2 * n), "premul_sum", 0, dist.group.WORLD)):
        with _raises_exactly(UnsupportedError, r"reduce op 'premul_sum': PREMUL_SUM needs a factor.*'sum'"):
            call()
    y = funcol.all_reduce(torch.ones(2) * (r + 1), "sum", dist.group.WORLD)
    assert funcol.wait_tensor(y).tolist() == [n * (n + 1) / 2] * 2


# ---------------------------------------------------------------- barriers

def test_barrier_waits_for_every_rank():
    """A barrier that returned at once (a no-op) passed the older test; here the last rank arrives 0.5 s late
    and every other rank's barrier must take about that long, on the default group and another group."""
    r, n = _rank_size()
    if n == 1:
        pytest.skip("needs two ranks")
    for group in (None, dist.new_group(list(range(n)))):
        dist.barrier(group=group)
        start = time.monotonic()
        if r == n - 1:
            time.sleep(0.5)
        dist.barrier(group=group)
        waited = time.monotonic() - start
        assert waited >= 0.4, f"rank {r}: barrier returned after {waited:.3f} s, before the last rank arrived"


def test_monitored_barrier_is_refused_by_pytorch_as_the_docs_say():
    """docs/torch.md and docs/torch_distributed.md: PyTorch's ``monitored_barrier`` runs on gloo only and raises
    before reaching the group; ``barrier`` is the one to use. On every rank, and the group goes on."""
    r, n = _rank_size()
    with _raises_exactly(ValueError, "monitored_barrier is only implemented for GLOO backend"):
        dist.monitored_barrier()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == n
