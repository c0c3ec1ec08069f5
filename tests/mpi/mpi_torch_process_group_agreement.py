"""What the ranks of a call on the ``torch.distributed`` backend "unison" must agree on (run at 3 ranks by
tests/test_torch_process_group_mpi.py; the same body passed at 1 rank too, by hand on 2026-12-06).

The coalesced calls (``dist.all_gather_coalesced``; all-gathers and reduce-scatters into one tensor inside
``dist._coalescing_manager``) against numpy, synchronous and async, on the default group and on a group of
ranks 0 and 1 (at 3 ranks a sub-group on its own communicator, which rank 2 stays out of; at 2 ranks a
group of every rank). Tensor counts, shapes and dtypes that differ across ranks raise ``MismatchError`` on
every member, never hang, and the group goes on; what the backend does not support raises
``UnsupportedError`` on every member.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Callable
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
pytestmark = pytest.mark.timeout(120)  # a hang fails (every rank raises at once when it works)

#: the regex of a mismatch's message: the engine's, and a sub-group's
DIFFERENT = "submitted with different arguments on different ranks|called different collectives at the same step"


@pytest.fixture(scope="module", autouse=True)
def _init():
    dist.init_process_group("unison")
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair() -> Any:
    """Ranks 0 and 1 (every rank creates it, as PyTorch requires); None at 1 rank."""
    return dist.new_group([0, 1]) if dist.get_world_size() > 1 else None


@pytest.fixture(params=["world", "pair"])
def group(request: Any, pair: Any) -> Any:
    """The group under test, or ``"out"`` on a rank outside it (which then passes: every rank must run and
    pass the same tests)."""
    if request.param == "world":
        return None
    if pair is None:
        pytest.skip("a pair needs two ranks")
    return pair if dist.get_rank() < 2 else "out"


def _members(group: Any) -> tuple[int, int]:
    """(this rank in ``group``, its size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _values(k: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * (k + 1) - k).to(dtype)


@contextlib.contextmanager
def _raises_exactly(cls: type[BaseException], match: str) -> Any:
    """``pytest.raises(cls, match=...)`` that also refuses a subclass of ``cls``."""
    with pytest.raises(cls, match=match) as info:
        yield info
    assert info.type is cls, f"{info.type.__name__} raised where {cls.__name__} was expected: {info.value}"


def _goes_on(group: Any) -> None:
    g, m = _members(group)
    t = torch.full((3,), float(g + 1))
    dist.all_reduce(t, group=group)
    assert t.tolist() == [m * (m + 1) / 2] * 3


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (PyTorch deprecates all_gather_coalesced)
@pytest.mark.parametrize("async_op", [False, True])
def test_all_gather_coalesced(group, async_op):
    """Before 2026-12-06: "No backend type associated with device type cpu" on every rank."""
    if group == "out":
        return
    g, m = _members(group)
    shapes = [(2,), (2, 3), (0,)]
    outs = [[torch.full(s, -1.0, dtype=torch.float64) for s in shapes] for _ in range(m)]
    got = dist.all_gather_coalesced(outs, [_values(g, s) for s in shapes], group=group, async_op=async_op)
    if async_op:  # (PyTorch hands out the work's future: its value is the output lists, as gloo's)
        value = got.wait()
        assert [[t.tolist() for t in outs_k] for outs_k in value] == [[t.tolist() for t in o] for o in outs]
    else:
        assert got is None
    for k in range(m):
        for s, out in zip(shapes, outs[k], strict=True):
            np.testing.assert_array_equal(out.numpy(), _values(k, s).numpy())


@pytest.mark.parametrize("async_op", [False, True])
def test_coalesced_all_gathers_into_tensors(group, async_op):
    """Before 2026-12-06: "No backend type associated with device type cpu" on every rank. The outputs as a
    concatenation and as a stack (a new first axis), of two dtypes."""
    if group == "out":
        return
    g, m = _members(group)
    outs = [torch.zeros(2 * m, dtype=torch.float32), torch.zeros(m, 2, 3, dtype=torch.float64)]
    ins = [_values(g, (2,), torch.float32), _values(g, (2, 3))]
    with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
        for out, t in zip(outs, ins, strict=True):
            dist.all_gather_into_tensor(out, t, group=group, async_op=async_op)
    if async_op:
        cm.wait()
    np.testing.assert_array_equal(outs[0].numpy(), np.concatenate([_values(k, (2,), torch.float32).numpy()
                                                                   for k in range(m)]))
    np.testing.assert_array_equal(outs[1].numpy(), np.stack([_values(k, (2, 3)).numpy() for k in range(m)]))


@pytest.mark.parametrize("async_op", [False, True])
def test_coalesced_reduce_scatters_from_tensors(group, async_op):
    """Before 2026-12-06: "No backend type associated with device type cpu" on every rank."""
    if group == "out":
        return
    g, m = _members(group)
    outs = [torch.zeros(2, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)]
    ins = [_values(g, (2 * m,)), _values(g, (m, 2, 3))]
    with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
        for out, t in zip(outs, ins, strict=True):
            dist.reduce_scatter_tensor(out, t, op=dist.ReduceOp.AVG, group=group, async_op=async_op)
    if async_op:
        cm.wait()
    mean0 = np.mean([_values(k, (2 * m,)).numpy() for k in range(m)], axis=0)
    mean1 = np.mean([_values(k, (m, 2, 3)).numpy() for k in range(m)], axis=0)
    np.testing.assert_allclose(outs[0].numpy(), mean0[2 * g:2 * g + 2], rtol=1e-12)
    np.testing.assert_allclose(outs[1].numpy(), mean1[g], rtol=1e-12)


def _async_all_reduce_coalesced(group: Any, g: int, m: int) -> Callable[[], None]:
    ins = [torch.full((2,), float(g + 1)), torch.full((3,), 10.0 * (g + 1))]
    work = dist.all_reduce_coalesced(ins, group=group, async_op=True)

    def check() -> None:
        work.wait()
        assert [t.tolist() for t in ins] == [[m * (m + 1) / 2] * 2, [10.0 * m * (m + 1) / 2] * 3]

    return check


def _async_gathers_into_tensors(group: Any, g: int, m: int) -> Callable[[], None]:
    outs = [torch.zeros(2 * m), torch.zeros(m)]
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(g)), group=group, async_op=True)
        dist.all_gather_into_tensor(outs[1], torch.full((1,), float(g)), group=group, async_op=True)

    def check() -> None:
        cm.wait()
        assert outs[0].tolist() == [float(k) for k in range(m) for _ in range(2)]
        assert outs[1].tolist() == [float(k) for k in range(m)]

    return check


def _async_functional(group: Any, g: int, m: int) -> Callable[[], None]:
    import torch.distributed._functional_collectives as funcol

    outs = funcol.reduce_scatter_tensor_coalesced([torch.full((2 * m,), float(g + 1))] * 2, "sum", [0, 0],
                                                  group if group is not None else dist.group.WORLD)

    def check() -> None:
        assert [funcol.wait_tensor(t).tolist() for t in outs] == [[m * (m + 1) / 2] * 2] * 2

    return check


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("start", [_async_all_reduce_coalesced, _async_gathers_into_tensors, _async_functional],
                         ids=["all_reduce_coalesced", "coalescing_manager", "functional_coalesced"])
def test_an_async_coalesced_call_returns_before_the_others_have_called(group, start):
    """``async_op=True`` returns at once (the count agreement travels with the members, not before them:
    process_group_collectives.py [Note: coalesced calls do not block]): the group's last rank calls 1.5 s
    after the others, whose calls return within 0.5 s, and every rank's results are right."""
    if group == "out":
        return
    g, m = _members(group)
    if m == 1:
        pytest.skip("needs two ranks")
    start(group, g, m)()  # (warm: PyTorch's first functional call takes most of a second here)
    dist.barrier(group=group)
    if g == m - 1:
        time.sleep(1.5)
    t0 = time.perf_counter()
    check = start(group, g, m)
    returned = time.perf_counter() - t0
    check()
    assert g == m - 1 or returned < 0.5, f"the call returned after {returned:.2f} s: it waited for the last rank"
    _goes_on(group)


def _gather_coalesced(group: Any, ins: list[torch.Tensor]) -> None:
    m = dist.get_world_size(group)
    dist.all_gather_coalesced([[torch.zeros_like(t) for t in ins] for _ in range(m)], ins, group=group)


def _gather_into(group: Any, ins: list[torch.Tensor]) -> None:
    m = dist.get_world_size(group)
    with dist._coalescing_manager(group=group):
        for t in ins:
            dist.all_gather_into_tensor(t.new_zeros((m * t.shape[0],) + t.shape[1:]), t, group=group)


def _scatter_from(group: Any, ins: list[torch.Tensor]) -> None:
    m = dist.get_world_size(group)
    with dist._coalescing_manager(group=group):
        for t in ins:
            dist.reduce_scatter_tensor(t.new_zeros(t.shape), torch.cat([t] * m), group=group)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("call", [_gather_coalesced, _gather_into, _scatter_from],
                         ids=["all_gather_coalesced", "all_gather_into_tensor", "reduce_scatter_tensor"])
def test_coalesced_calls_that_differ_across_ranks_raise_on_every_rank(group, call):
    """A different tensor count (the ranks agree on it first: the longer list's extra tensor would pair with
    the others' next call), a different shape of the second tensor, a different dtype; each raises
    ``MismatchError`` on every member, and the group goes on."""
    if group == "out":
        return
    g, m = _members(group)
    if m == 1:
        pytest.skip("needs two ranks")
    first = g == 0
    dtype = torch.float32 if first else torch.float64  # (one rank's list is of one dtype: PyTorch checks that)
    cases = [([torch.ones(2)] * (2 if first else 1), "the ranks passed 1 to 2 tensors"),
             ([torch.ones(2), torch.ones(3 if first else 2)], DIFFERENT),
             ([torch.ones(2, dtype=dtype), torch.ones(2, dtype=dtype)], DIFFERENT)]
    for ins, message in cases:
        with _raises_exactly(MismatchError, message):
            call(group, ins)
    _goes_on(group)


@pytest.mark.parametrize("what", ["all_reduce", "broadcast", "reduce_scatter_tensor"])
def test_a_dtype_that_differs_across_ranks_raises_on_every_rank(group, what):
    """float32 on the group's first rank, float64 on the others: ``MismatchError`` naming both, on every
    member; none waits for ever, and the next call pairs."""
    if group == "out":
        return
    g, m = _members(group)
    if m == 1:
        pytest.skip("needs two ranks")
    dtype = torch.float32 if g == 0 else torch.float64
    t = torch.ones(2 * m, dtype=dtype)
    with _raises_exactly(MismatchError, f"(?s)({DIFFERENT}).*float32.*float64"):
        if what == "all_reduce":
            dist.all_reduce(t, group=group)
        elif what == "broadcast":
            dist.broadcast(t, src=dist.get_global_rank(group, m - 1) if group else m - 1, group=group)
        else:
            dist.reduce_scatter_tensor(torch.zeros(2, dtype=dtype), t, group=group)
    _goes_on(group)


def test_what_the_backend_does_not_support_raises_on_every_member(group):
    """A meta tensor (standing in for a GPU one) on one member, a bitwise op of floats: ``UnsupportedError``
    (a NotImplementedError) on every member. Before 2026-12-06 a sub-group's refusal took its kind from the
    class name, so a TypeError's subclass arrived as InvalidArgumentError (a ValueError)."""
    if group == "out":
        return
    g = dist.get_rank(group)
    with _raises_exactly(UnsupportedError, "unsupported by the unison backend: a tensor on meta"):
        dist.all_reduce(torch.ones(3, device="meta") if g == 0 else torch.ones(3), group=group)
    with _raises_exactly(UnsupportedError, r"ReduceOp.BOR of float64 tensors: .*bitwise operation") as info:
        dist.all_reduce(torch.ones(3, dtype=torch.float64), op=dist.ReduceOp.BOR, group=group)
    assert isinstance(info.value, NotImplementedError) and isinstance(info.value, hvd.CollectiveError)
    _goes_on(group)


#: (the first member's refusal, the second's or None, the class every member raises): [Note: refusal kinds]
REFUSALS = [
    (UnsupportedError("a refusal whose message names no backend"), None, UnsupportedError),
    (UnsupportedError("not implemented here"), ValueError("a bad size"), UnsupportedError),
    (UnsupportedError("unsupported by the unison backend: not implemented"), TypeError("a bad dtype"),
     hvd.CollectiveError),
    (TypeError("a bad dtype, quoting unsupported by the unison backend: "), None, hvd.CollectiveError),
    (ValueError("a bad size, quoting unsupported by the unison backend: "), None, hvd.InvalidArgumentError),
]


@pytest.mark.parametrize("first, second, cls", REFUSALS)
def test_a_refusal_arrives_as_its_kind_on_every_member(group, monkeypatch, first, second, cls):
    """A member's own check refuses its tensor (``host``, patched where the group's ``allreduce`` calls it):
    every member raises the class its kind says ([Note: refusal kinds]), on the engine and on a sub-group,
    never because of the message's words. Before 2026-12-06 (a second change) an ``UnsupportedError``
    travelled as a TypeError and was recognised by "unsupported by the unison backend: " in the message: one
    without the words arrived as ``CollectiveError``, and a TypeError quoting them as ``UnsupportedError``."""
    if group == "out":
        return
    g, m = _members(group)
    if m == 1:  # a job of one rank raises the refusal itself, at once
        if second is not None:
            pytest.skip("needs two refusing members")
        cls = type(first)
    mine = first if g == 0 else second if g == 1 else None
    module = sys.modules[UnisonProcessGroup.allreduce.__module__]
    real_host = module.host

    def host(tensor: torch.Tensor, what: str) -> Any:
        if mine is not None:
            raise mine
        return real_host(tensor, what)

    with monkeypatch.context() as patch, _raises_exactly(cls, re.escape(str(first))) as info:
        patch.setattr(module, "host", host)
        dist.all_reduce(torch.ones(3), group=group)
    assert m == 1 or second is None or str(second) in str(info.value)  # (every refusing member is named)
    _goes_on(group)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_output_lists_of_the_wrong_length_raise_on_every_rank(group):
    """``all_gather_coalesced`` with one output list too few on the group's first rank: its refusal
    travels (``InvalidArgumentError``, a ValueError, on every member) and the next call pairs."""
    if group == "out":
        return
    g, m = _members(group)
    if m == 1:
        pytest.skip("needs two ranks")
    lists = [[torch.zeros(2)] for _ in range(m - 1 if g == 0 else m)]
    with _raises_exactly(hvd.InvalidArgumentError, r"all_gather_coalesced needs one output list per rank"):
        dist.all_gather_coalesced(lists, [torch.ones(2)], group=group)
    _goes_on(group)


def test_the_older_method_names_pytorch_still_binds():
    """``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``, ``_allgather_base`` and
    ``_reduce_scatter_base`` on the group (the C++ group binds them: without them, PyTorch's error)."""
    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    out = torch.zeros(2 * n)
    world.allgather_into_tensor_coalesced([out], [torch.full((2,), float(r))]).wait()
    assert out.tolist() == [float(k) for k in range(n) for _ in range(2)]
    world._allgather_base(out, torch.full((2,), float(r + 1))).wait()
    assert out.tolist() == [float(k + 1) for k in range(n) for _ in range(2)]
    piece = torch.zeros(2)
    world.reduce_scatter_tensor_coalesced([piece], [torch.arange(2.0 * n)]).wait()
    assert piece.tolist() == [n * (2.0 * r), n * (2.0 * r + 1)]
    world._reduce_scatter_base(piece, torch.ones(2 * n)).wait()
    assert piece.tolist() == [float(n)] * 2


def test_a_direct_coalesced_call_with_unpaired_lists_raises_on_every_rank():
    """Outputs and inputs of different lengths on rank 0 only (a direct call: PyTorch pairs them itself):
    every rank raises, and the group goes on. Before (a review, 2026-12-06) that rank raised before the
    count agreement and the others waited in it until the group's timeout."""
    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    outputs = [torch.zeros(2 * n)] * (2 if r == 0 else 1)
    with pytest.raises(ValueError, match="takes one output tensor per input|another rank's arguments"):
        world.allgather_into_tensor_coalesced(outputs, [torch.ones(2)]).wait()
    _goes_on(None)


def test_a_lazily_conjugated_complex_output_raises_on_every_rank():
    """``reduce`` into a ``.conj()`` view on rank 0: a clear ValueError there and on every rank (before,
    ``view_as_real``'s RuntimeError on that rank alone, the others' call left unpaired)."""
    r = dist.get_rank()
    t = torch.ones(3, dtype=torch.complex128)
    target = t.conj() if r == 0 else t
    with pytest.raises(ValueError, match="lazily conjugated"):
        dist.reduce(target, dst=0)
    _goes_on(None)
