"""Adasum's math in one process: the pair formula, the tree, and the distributed algorithm on
simulated ranks (threads exchanging through queues), all against a direct numpy formula."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from unison.collectives import adasum
from unison.common.dtypes import bfloat16


def direct_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Maleki et al.'s formula written out, with Horovod's 1e-8 guard on the squared norms."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    dot, na, nb = np.sum(a * b), np.sum(a * a), np.sum(b * b)
    ca = 1.0 - dot / (2 * na) if na >= 1e-8 else 1.0
    cb = 1.0 - dot / (2 * nb) if nb >= 1e-8 else 1.0
    return ca * a + cb * b


def direct_tree(vectors: list[np.ndarray]) -> np.ndarray:
    while len(vectors) > 1:
        vectors = [direct_pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def test_pair_properties():
    a = np.array([3.0, 0.0])
    b = np.array([0.0, 4.0])
    np.testing.assert_allclose(adasum.combine(a, b), a + b)  # orthogonal: sum
    np.testing.assert_allclose(adasum.combine(a, a), a)  # identical: one of them
    np.testing.assert_allclose(adasum.combine(a, -a), np.zeros(2))  # opposite: cancel
    np.testing.assert_allclose(adasum.combine(a, np.zeros(2)), a)  # zero norm: coefficient stays 1
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(50), rng.standard_normal(50)
    np.testing.assert_allclose(adasum.combine(x, y), direct_pair(x, y), rtol=1e-12)
    np.testing.assert_allclose(adasum.combine(x, y), adasum.combine(y, x), rtol=1e-12)  # symmetric


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_reference_tree_matches_direct_formula(n):
    rng = np.random.default_rng(n)
    vs = [rng.standard_normal((3, 5)) for _ in range(n)]
    np.testing.assert_allclose(adasum.reference(vs), direct_tree(vs).reshape(3, 5), rtol=1e-12)


@pytest.mark.parametrize("n", [0, 3, 5, 6, 12])
def test_non_power_of_two_is_refused_with_horovods_error(n):
    with pytest.raises(NotImplementedError, match="Running Adasum with non-power of 2 ranks is not supported"):
        adasum.check_size(n)


def test_integer_dtype_refused():
    with pytest.raises(TypeError, match="floating-point"):
        adasum.check_dtype(np.int32)


class _Mpi:
    PROC_NULL = -1


class _Comm:
    """Just enough of an mpi4py communicator for p2p Sendrecv between threads."""

    def __init__(self, rank: int, size: int, boxes: dict) -> None:
        self.rank, self.size, self.boxes = rank, size, boxes

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Sendrecv(self, sbuf, dest, stag, rbuf, source, rtag):  # noqa: N802
        if dest != _Mpi.PROC_NULL:
            self.boxes[(self.rank, dest, stag)].put(np.array(sbuf, copy=True))
        if source != _Mpi.PROC_NULL:
            got = self.boxes[(source, self.rank, rtag)].get(timeout=20)
            np.asarray(rbuf).reshape(-1)[...] = got.reshape(-1).view(np.asarray(rbuf).dtype)


def simulate(inputs: list[np.ndarray], pre: float = 1.0, post: float = 1.0, chunk_bytes: int = 1 << 20):
    n = len(inputs)
    boxes = {(s, d, t): queue.Queue() for s in range(n) for d in range(n) for t in (adasum.TAG_DATA,
                                                                                     adasum.TAG_DOTS)}
    outs = [np.empty_like(x.reshape(-1)) for x in inputs]
    errors = []

    def run(r):
        try:
            adasum.allreduce(_Comm(r, n, boxes), _Mpi, inputs[r].reshape(-1), outs[r], pre, post, chunk_bytes)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return outs


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [1, 7, 64, 1001])
def test_distributed_algorithm_matches_tree_on_every_rank(n, count):
    rng = np.random.default_rng(100 * n + count)
    inputs = [rng.standard_normal(count) for _ in range(n)]
    outs = simulate(inputs, chunk_bytes=64)  # small pieces: the piecewise exchange is exercised too
    expect = direct_tree(inputs)
    for out in outs:
        np.testing.assert_allclose(out, expect, rtol=1e-10, atol=1e-12)
        assert np.array_equal(out, outs[0])  # bitwise identical on every rank


@pytest.mark.parametrize("dtype", [np.float16, np.float32, bfloat16])
def test_distributed_algorithm_narrow_dtypes_and_factors(dtype):
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(33).astype(dtype) for _ in range(4)]
    outs = simulate(inputs, pre=0.5, post=3.0)
    expect = 3.0 * direct_tree([0.5 * x.astype(np.float64) for x in inputs])
    tol = {np.dtype(np.float16): 2e-2, np.dtype(np.float32): 1e-5, bfloat16: 6e-2}[np.dtype(dtype)]
    for out in outs:
        assert out.dtype == np.dtype(dtype)
        np.testing.assert_allclose(out.astype(np.float64), expect, rtol=tol, atol=tol)
