"""unison.common.ps in one process: sharding maps, initial rows, gradient combining, optimizers, errors."""

from __future__ import annotations

import numpy as np
import pytest

from unison.common.ps import SGD, SSP, Adagrad, Adam, consistency
from unison.common.ps.shard import initial_rows, merge
from unison.common.ps.sharding import Sharding, block_bounds


@pytest.mark.parametrize("rows", [1, 2, 3, 10, 97, 1000, 4096, 1_000_003])
@pytest.mark.parametrize("kind", ["row", "hash"])
def test_storage_is_a_bijection_and_keys_of_inverts_it(rows, kind):
    sh = Sharding(kind, rows, 4)
    keys = np.arange(min(rows, 200_000), dtype=np.int64)
    p = sh.storage(keys)
    assert p.min() >= 0 and p.max() < rows
    assert len(np.unique(p)) == len(keys)
    np.testing.assert_array_equal(sh.keys_of(p), keys)


def test_hash_spreads_hot_keys_and_blocks_are_exact():
    sh = Sharding("hash", 1_000_000, 8)
    owners = sh.owners(sh.storage(np.arange(1000)))  # the 1000 hottest keys of a Zipf distribution
    counts = np.bincount(owners, minlength=8)
    assert counts.min() >= 100 and counts.max() <= 150, counts  # row sharding would put all on shard 0
    assert (Sharding("row", 1_000_000, 8).owners(np.arange(1000)) == 0).all()
    np.testing.assert_array_equal(block_bounds(10, 4), [0, 2, 5, 7, 10])


@pytest.mark.parametrize("init", ["uniform", "normal", "zeros"])
def test_initial_table_does_not_depend_on_the_shard_count(init):
    whole = initial_rows(init, Sharding("hash", 300_000, 1), 0, 300_000, 4, np.dtype("float32"), seed=7)
    sh = Sharding("hash", 300_000, 3)
    parts = [initial_rows(init, sh, *sh.block(s), 4, np.dtype("float32"), seed=7) for s in range(3)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    if init == "uniform":
        assert np.abs(whole).max() <= 0.5 and whole.std() > 0.2


@pytest.mark.parametrize("init", ["uniform", "normal"])
def test_initial_rows_are_drawn_in_bounded_pieces_with_the_values_of_whole_blocks(init):
    """Each block of 65536 rows is one random stream; drawing it in pieces (and only up to the
    shard's last row) gives the values of drawing the whole block, in a bounded amount of
    memory (10 rows of 2048 floats took 1 GiB and 3 s when every shard drew whole blocks)."""
    import tracemalloc

    from unison.common.ps import shard as shard_module

    block = shard_module._CHUNK

    def whole_blocks(lo, hi, dim, seed):
        out, scale = np.empty((hi - lo, dim)), 1 / np.sqrt(dim)
        for chunk in range(lo // block, (hi + block - 1) // block):
            rng = np.random.Generator(np.random.Philox(key=seed, counter=[0, 0, chunk, 0]))
            draw = rng.uniform if init == "uniform" else rng.normal
            rows = draw(-scale, scale, (block, dim)) if init == "uniform" else draw(0, scale, (block, dim))
            a, b = max(lo, chunk * block), min(hi, (chunk + 1) * block)
            out[a - lo:b - lo] = rows[a - chunk * block:b - chunk * block]
        return out

    sh = Sharding("row", 3 * block, 1)
    for lo, hi, dim in [(0, 10, 3), (block - 5, block + 700, 40), (3, 2 * block + 9, 2)]:
        got = initial_rows(init, sh, lo, hi, dim, np.dtype("float64"), seed=11)
        np.testing.assert_array_equal(got, whole_blocks(lo, hi, dim, 11), err_msg=f"{lo}:{hi} x {dim}")
    tracemalloc.start()
    initial_rows(init, sh, 0, 10, 2048, np.dtype("float32"), seed=3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak  # a whole block: 65536 x 2048 x 8 bytes = 1 GiB


@pytest.mark.parametrize("init,dim", [("uniform", 4), ("normal", 16), ("uniform", 64)])
def test_initial_rows_of_different_blocks_are_independent(init, dim):
    """No two keys start with the same row, and no block repeats another's numbers shifted: each
    block's stream starting 4 numbers after the previous one's (the chunk in Philox's low counter
    word, before 2026-12-05) gave a 196608 x 4 table 65538 distinct rows."""
    from unison.common.ps import shard as shard_module

    block = shard_module._CHUNK
    n = 3 * block
    rows = initial_rows(init, Sharding("row", n, 1), 0, n, dim, np.dtype("float64"), seed=5)
    assert len(np.unique(rows, axis=0)) == n
    flat = rows.reshape(3, -1)
    for shift in range(0, 4 * 16 + 1, 4):  # chunk c's numbers were chunk 0's from 4c on
        assert not np.isin(flat[1][:1000], flat[0][shift:shift + 1000]).all(), shift
    assert abs(rows.std() * np.sqrt(dim) - (1 / np.sqrt(3) if init == "uniform" else 1.0)) < 0.02


def test_callable_initializer_gets_keys_and_must_return_rows():
    sh = Sharding("hash", 50, 2)
    lo, hi = sh.block(1)
    rows = initial_rows(lambda k: np.repeat(k[:, None], 3, 1), sh, lo, hi, 3, np.dtype("float64"), 0)
    np.testing.assert_array_equal(rows[:, 0], sh.keys_of(np.arange(lo, hi)))
    with pytest.raises(ValueError, match=r"returned shape \(25,\) for 25 keys"):
        initial_rows(lambda k: k, sh, lo, hi, 3, np.dtype("float64"), 0)


def test_merge_sums_what_sources_sent_for_the_same_row():
    # three sources, each with unique indices: [2, 5], [5, 9], [1, 2, 5]
    storage = np.array([2, 5, 5, 9, 1, 2, 5])
    grads = np.arange(14.0).reshape(7, 2)
    s, g = merge(storage, grads, np.array([2, 2, 3]))
    np.testing.assert_array_equal(s, [1, 2, 5, 9])
    np.testing.assert_array_equal(g, [[8, 9], [0 + 10, 1 + 11], [2 + 4 + 12, 3 + 5 + 13], [6, 7]])
    s, g = merge(np.array([3, 1]), np.ones((2, 2)), np.array([1, 1]))  # disjoint: passed through
    np.testing.assert_array_equal(s, [3, 1])
    s, g = merge(np.zeros(0, np.int64), np.zeros((0, 2)), np.array([0, 0]))
    assert s.shape == (0,) and g.shape == (0, 2)


@pytest.mark.parametrize("sorted_sources", [True, False])
def test_merge_matches_add_at_on_many_overlapping_sources(sorted_sources):
    rng = np.random.default_rng(7)
    parts = [rng.choice(200, size=int(n), replace=False) for n in rng.integers(0, 60, 5)]
    if sorted_sources:  # as workers send them (np.unique's order); unsorted ones are only slower
        parts = [np.sort(p) for p in parts]
    storage = np.concatenate(parts).astype(np.int64)
    grads = rng.normal(size=(len(storage), 3))
    ref = np.zeros((200, 3))
    np.add.at(ref, storage, grads)
    s, g = merge(storage, grads, np.array([len(p) for p in parts]))
    np.testing.assert_array_equal(s, np.unique(storage))
    np.testing.assert_allclose(g, ref[s], rtol=1e-12)


@pytest.mark.parametrize("opt", [SGD(lr=0.3), Adagrad(lr=0.3), Adam(lr=0.3)], ids=lambda o: type(o).__name__)
def test_optimizer_scale_equals_scaled_gradients(opt):
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(5, 4)).astype(np.float32)
    rows, g = np.array([0, 3, 4]), rng.normal(size=(3, 4)).astype(np.float32)
    a, b = w0.copy(), w0.copy()
    sa, sb = opt.init_state(5, 4, a.dtype), opt.init_state(5, 4, b.dtype)
    for _ in range(3):
        opt.apply(a, sa, rows, g, 0.25)
        opt.apply(b, sb, rows, g * np.float32(0.25))
    np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not np.allclose(a, w0)


def test_adagrad_matches_torch_dense_on_touched_rows():
    torch = pytest.importorskip("torch")
    w = np.random.default_rng(0).normal(size=(6, 3))
    ref = torch.nn.Parameter(torch.tensor(w))
    opt = torch.optim.Adagrad([ref], lr=0.3)
    mine, ada = w.copy(), Adagrad(lr=0.3)
    state = ada.init_state(6, 3, np.dtype("float64"))
    for step in range(4):
        rows = np.array([1, 4]) if step % 2 else np.array([0, 1, 5])
        g = np.random.default_rng(step).normal(size=(len(rows), 3))
        dense = np.zeros((6, 3))
        dense[rows] = g
        ref.grad = torch.tensor(dense)
        opt.step()
        ada.apply(mine, state, rows, g)
    np.testing.assert_allclose(mine, ref.detach().numpy(), rtol=1e-12)


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match=r"SSP\(staleness=-1\)"):
        SSP(-1)
    with pytest.raises(ValueError, match=r"Adam\(beta1=1.5\)"):
        Adam(beta1=1.5)
    with pytest.raises(ValueError, match="sharding='cyclic'"):
        Sharding("cyclic", 10, 2)
    with pytest.raises(ValueError, match="consistency='eventual'"):
        consistency.consistency_from_name("eventual")


def test_an_inline_operation_holds_one_ctrl_c_until_it_ends():
    """[Note: inline operations]: a SIGINT inside is raised when the block ends; a second at once."""
    import os
    import signal
    import threading
    import time

    from unison.common.ps.table import _HeldInterrupt

    # Python installs its Ctrl-C handler only when SIGINT is not ignored at start (a job started
    # in the background of a script has it ignored): install it for this test, as a terminal has it
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        finished = False
        with pytest.raises(KeyboardInterrupt):
            with _HeldInterrupt():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here, and only holds it
                finished = True
        assert finished
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        reached = False
        with pytest.raises(KeyboardInterrupt):
            with _HeldInterrupt():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                reached = True
        assert not reached  # the second Ctrl-C interrupts the block
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        seen = []
        worker = threading.Thread(target=lambda: seen.append(_HeldInterrupt().__enter__().previous))
        worker.start()
        worker.join()
        assert seen == [None]  # off the main thread it changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with _HeldInterrupt() as held:  # an ignored Ctrl-C stays ignored
            assert held.previous is None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outer)


def test_a_checkpoint_loads_only_into_a_table_with_the_same_optimizer(tmp_path):
    """An Adagrad table's checkpoint into an SGD (or Adam) table raises, naming both, instead of
    dropping the accumulators; into Adagrad with another learning rate it loads (one process)."""
    import unison
    from unison.common import ps
    from unison.common.checkpoints import CheckpointError

    unison.init()
    try:
        with ps.ShardedTable(50, 3, "float64", optimizer=Adagrad(lr=0.5), name="ckopt") as table:
            table.push(np.array([1, 7]), np.ones((2, 3)))
            table.save(tmp_path / "t")
            saved = table.to_numpy()
        for other in (SGD(0.1), Adam(0.01)):
            with ps.ShardedTable(50, 3, "float64", optimizer=other, name="ckopt2") as table, \
                    pytest.raises(CheckpointError, match=r"saved with optimizer Adagrad, this table uses "
                                  + type(other).__name__):
                table.load(tmp_path / "t")
        with ps.ShardedTable(50, 3, "float64", optimizer=Adagrad(lr=0.1), name="ckopt3") as table:
            table.load(tmp_path / "t")
            np.testing.assert_array_equal(table.to_numpy(), saved)
    finally:
        unison.shutdown()


def test_optimizer_arguments_take_any_real_number_and_refuse_what_torch_refuses():
    """numpy scalars are numbers (``SGD(np.float32(0.1))`` was refused as "not finite"); a
    negative Adagrad accumulator or eps turned rows into NaN (torch refuses them)."""
    assert SGD(np.float32(0.5)).lr == 0.5 and isinstance(SGD(np.int64(1)).lr, float)
    assert Adam(lr=np.float64(0.01), beta1=np.float32(0.5)).beta1 == 0.5
    for bad, match in [(lambda: SGD(True), r"SGD\(lr=True\): the learning rate must be a finite real number"),
                       (lambda: SGD(float("nan")), "must be a finite real number"),
                       (lambda: SGD("0.1"), "must be a finite real number"),
                       (lambda: Adagrad(initial_accumulator_value=-1.0),
                        r"Adagrad\(initial_accumulator_value=-1.0\) must not be negative"),
                       (lambda: Adagrad(eps=-1e-10), "must not be negative"),
                       (lambda: Adam(eps=-1.0), r"Adam\(eps=-1.0\) must not be negative"),
                       (lambda: Adam(beta2=1.0), r"Adam\(beta2=1.0\) must be in \[0, 1\)")]:
        with pytest.raises(ValueError, match=match):
            bad()


def test_the_base_optimizer_class_is_refused_at_creation():
    """``ps.Optimizer()`` (no update rule) was accepted, then every push raised a bare
    ``NotImplementedError`` (under SSP it ended the server thread); a subclass with apply() is taken."""
    import unison
    from unison.common import ps
    from unison.common.ps.optimizers import Optimizer

    class Halve(Optimizer):
        def apply(self, weights, state, local, grads, scale=1.0):
            weights[local] -= 0.5 * scale * grads

    unison.init()
    try:
        with pytest.raises(ps.TableError, match=r"optimizer=Optimizer\(lr=0.01.*defines apply"):
            ps.ShardedTable(10, 2, "float64", optimizer=Optimizer(), name="base-opt")
        with ps.ShardedTable(10, 2, "float64", optimizer=Halve(), initializer="zeros", name="sub-opt") as table:
            table.push(np.array([3]), np.ones((1, 2)))
            np.testing.assert_array_equal(table.pull(np.array([3])), [[-0.5, -0.5]])
    finally:
        unison.shutdown()


def test_a_table_waits_longer_for_news_of_a_failure_when_the_failure_detector_is_slower(monkeypatch):
    """An MPI_ERR_OTHER waits for news that a rank failed (unison/common/ps/failure.py): at least 3 s, and with
    ULFM's failure detector on, twice its timeout and a second (news of a lost host comes from it)."""
    from unison.common.ps import failure

    monkeypatch.delenv("OMPI_MCA_mpi_ft_detector_timeout", raising=False)
    assert failure.failure_news_s() == failure.FAILURE_NEWS_S == 3.0
    monkeypatch.setenv("OMPI_MCA_mpi_ft_detector_timeout", "3")
    assert failure.failure_news_s() == 7.0
    monkeypatch.setenv("OMPI_MCA_mpi_ft_detector_timeout", "not a number")
    assert failure.failure_news_s() == 3.0
