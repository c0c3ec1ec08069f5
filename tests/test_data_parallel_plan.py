"""unison.common.data_parallel in one process: the split of global batches, and the host math at size 1."""

from __future__ import annotations

import numpy as np
import pytest

from unison.common.data_parallel import BatchPlan


@pytest.mark.parametrize("samples,batch,size", [(77, 16, 2), (64, 16, 2), (10, 4, 3), (5, 5, 5), (0, 8, 2),
                                                (23, 8, 3), (17, 16, 4), (100, 7, 7)])
def test_every_row_once_in_global_batch_order(samples, batch, size):
    plan = BatchPlan(samples, batch, size)
    kept = samples - plan.dropped
    assert plan.steps == -(-kept // batch)
    rows = [list(range(*plan.rank_rows(step, rank))) for step in range(plan.steps) for rank in range(size)]
    assert [r for chunk in rows for r in chunk] == list(range(kept))  # disjoint, complete, in order
    for step in range(plan.steps):
        shares = [np.subtract(*plan.rank_rows(step, r)[::-1]) for r in range(size)]
        assert min(shares) >= 1 and max(shares) - min(shares) <= 1  # every rank has a row, balanced


def test_a_last_batch_smaller_than_the_ranks_is_dropped_and_named(caplog):
    plan = BatchPlan(17, 8, 3)  # 17 = 2 * 8 + 1: one row for three ranks
    assert (plan.dropped, plan.steps) == (1, 2)
    with caplog.at_level("WARNING"):
        plan.warn_if_dropping(0, "model.fit")
        plan.warn_if_dropping(1, "model.fit")  # said once, by rank 0
    assert len(caplog.records) == 1
    assert "1 row(s) for 3 ranks" in caplog.text and "remainder" in caplog.text


@pytest.mark.parametrize("samples,batch,size", [(17, 8, 3), (2, 8, 3), (33, 16, 2), (64, 16, 2), (5, 4, 4)])
def test_with_shadows_a_batch_smaller_than_the_ranks_goes_whole_to_every_rank(samples, batch, size):
    """[Note: shadow shares]: nothing is dropped; the small batch's rows go to every rank, rank 0's counting."""
    plan = BatchPlan(samples, batch, size, shadows=True)
    tail = samples % batch
    assert plan.dropped == 0 and plan.steps == -(-samples // batch)
    assert plan.has_shadows is (0 < tail < size)
    counted = []
    for step in range(plan.steps):
        start, stop = plan.global_rows(step)
        for rank in range(size):
            lo, hi = plan.rank_rows(step, rank)
            if stop - start < size:  # the small batch: all of it, to every rank; the ranks but 0 its shadows
                assert (lo, hi) == (start, stop) and plan.shadow(step, rank) is (rank != 0)
            else:
                assert hi > lo and not plan.shadow(step, rank)
            if not plan.shadow(step, rank):
                counted.extend(range(lo, hi))
    assert counted == list(range(samples))  # every row counted once, in order
    with_drop = BatchPlan(samples, batch, size)
    assert with_drop.dropped == (tail if 0 < tail < size else 0) and not with_drop.has_shadows


def test_bad_plans_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="batch_size=1 is the GLOBAL batch .* use batch_size >= 2"):
        BatchPlan(10, 1, 2)
    with pytest.raises(ValueError, match="samples must be a non-negative integer; got -1"):
        BatchPlan(-1, 4, 2)
    with pytest.raises(IndexError, match="global batch 3 out of range: the data has 3 batches"):
        BatchPlan(10, 4, 2).global_rows(3)
