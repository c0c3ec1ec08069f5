"""The framework-neutral ZeRO plan and memory formula, in one process (unison/common/zero)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from unison.common.zero import BytesPerParam, ParamSpec, ShardPlan, check_stage, formula_bytes

SPECS = [ParamSpec("w1", (7, 13), "float32"), ParamSpec("b1", (13,), "float32"),
         ParamSpec("w2", (13, 5), "float32", 1), ParamSpec("b2", (5,), "float32", 1),
         ParamSpec("s", (5,), "float64"), ParamSpec("e", (0, 4), "float32")]


@pytest.mark.parametrize(("world", "cap"), list(itertools.product([1, 2, 3, 4, 7], [8, 64, 400, 1 << 20])))
def test_every_element_is_owned_exactly_once_and_segments_are_equal(world, cap):
    plan = ShardPlan.build(SPECS, world, cap)
    seen = {s.name: np.zeros(s.numel, int) for s in SPECS}
    for rank in range(world):
        for name, runs in plan.owned(rank).items():
            for piece in runs:
                seen[name][piece.param_offset:piece.param_offset + piece.length] += 1
    assert all((counts == 1).all() for counts in seen.values())
    for b in plan.buckets:
        assert b.padded % world == 0 and b.padded - b.numel < world or b.numel == 0
        same_key = {s.name for s in SPECS if (s.group, s.dtype) == (b.group, b.dtype)}
        assert all(p.name in same_key for p in b.pieces)
    for key in plan.keys():  # a rank's shard for a key: its segments of that key's buckets, back to back
        offsets = sorted((b.shard_offset, b.segment_size) for b in plan.buckets if (b.group, b.dtype) == key)
        assert offsets[0][0] == 0 and all(a + n == c for (a, n), (c, _) in zip(offsets, offsets[1:], strict=False))
        assert plan.shard_numel(key) == sum(n for _, n in offsets)


def test_buckets_follow_backward_order_and_respect_the_cap():
    plan = ShardPlan.build(SPECS[:2], 2, bucket_bytes=13 * 4)
    assert [p.name for b in plan.buckets for p in b.pieces] == ["b1", "w1"]  # reverse registration order
    assert len(plan.buckets) == 2  # w1 alone exceeds the cap: a bucket of its own, never split


def test_signature_changes_with_anything_that_moves_bytes():
    base = ShardPlan.build(SPECS, 4).signature()
    assert base == ShardPlan.build(list(SPECS), 4).signature()
    assert base != ShardPlan.build(SPECS, 3).signature()
    assert base != ShardPlan.build(SPECS, 4, bucket_bytes=1024).signature()
    assert base != ShardPlan.build(SPECS[:-1] + [ParamSpec("e", (4, 0), "float32")], 4).signature()


def test_bad_input_names_the_value():
    with pytest.raises(ValueError, match="world=0"):
        ShardPlan.build(SPECS, 0)
    with pytest.raises(ValueError, match=r"\['w1'\] appear more than once"):
        ShardPlan.build(SPECS + [ParamSpec("w1", (2,), "float32")], 2)
    with pytest.raises(ValueError, match="bucket_bytes"):
        ShardPlan.build(SPECS, 2, bucket_bytes=0)
    for bad in (4, -1, "1", True, 1.0):
        with pytest.raises(ValueError, match="zero_stage"):
            check_stage(bad)
    with pytest.raises(ValueError, match="rank=5"):
        ShardPlan.build(SPECS, 2).owned(5)


def test_formula_matches_the_zero_paper_per_parameter_bytes():
    p = 1_000_000
    assert formula_bytes(0, p, 4) == 16 * p
    assert formula_bytes(1, p, 4) == (4 + 4 + 8 / 4) * p
    assert formula_bytes(2, p, 4) == (4 + 12 / 4) * p
    assert formula_bytes(3, p, 4) == 16 * p / 4
    half = BytesPerParam.adam(param_bytes=2, master_weights=True)
    assert formula_bytes(1, p, 8, half) == (2 + 2 + 12 / 8) * p
    assert formula_bytes(2, p, 2, working_bytes=123) == 10 * p + 123


@pytest.mark.parametrize("args", [(1, 1000, 2.5), (0, 10.5, 2), (1, 1000, True)])
def test_formula_bytes_refuses_fractional_ranks_and_parameters(args):
    """Before 2026-12-07 2.5 ranks or 10.5 parameters gave a number of bytes."""
    with pytest.raises(ValueError, match="integers world >= 1 and params >= 0"):
        formula_bytes(*args)
    with pytest.raises(ValueError, match="bytes per parameter must be >= 0"):
        formula_bytes(1, 1000, 2, BytesPerParam(-4, -4, -8))
    assert formula_bytes(1, np.int64(1000), np.int64(4)) == formula_bytes(1, 1000, 4)
