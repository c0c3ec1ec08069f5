"""The data x pipeline x tensor grid and the sharding math, in one process (no MPI, no framework)."""

from __future__ import annotations

import itertools

import pytest

from unison.common.tensor_parallel import (
    Grid,
    Placement,
    check_divisible,
    divisible_shard,
    padded_size,
    resolve_plan,
    shard_range,
)
from unison.common.tensor_parallel import grid as grid_module


@pytest.fixture(autouse=True)
def _no_job(monkeypatch):
    """As if Unison were not initialized (another test of this process may have started it)."""
    monkeypatch.setattr(grid_module, "_job_size", lambda: None)


def test_rank_order_is_tp_fastest_then_dp_then_pp():
    grid = Grid(dp=2, pp=2, tp=2)
    assert [tuple(grid.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert grid.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (3, 1, 1), (1, 4, 1), (1, 1, 5), (2, 3, 2), (3, 2, 4)])
def test_groups_partition_the_ranks_and_agree_with_coords(dp, pp, tp):
    grid = Grid(dp=dp, pp=pp, tp=tp)
    assert grid.size == dp * pp * tp
    for kind, length in (("tp", tp), ("dp", dp), ("pp", pp)):
        groups = getattr(grid, f"{kind}_groups")()
        assert sorted(itertools.chain(*groups)) == list(range(grid.size)), kind
        assert all(len(g) == length for g in groups) and len(groups) == grid.size // length
        for g in groups:
            for r in g:
                assert getattr(grid, f"{kind}_group_ranks")(r) == g
                # members differ only in this kind's coordinate, which runs 0.. in group order
                assert [getattr(grid.coords(m), kind) for m in g] == list(range(length))
    for r in range(grid.size):
        assert grid.rank_of(*grid.coords(r)) == r


def test_dp_none_fills_the_job(monkeypatch):
    assert Grid(pp=2, tp=3, size=12) == Grid(dp=2, pp=2, tp=3)
    assert Grid(tp=4).size == 4  # no job, no size: the product
    monkeypatch.setattr(grid_module, "_job_size", lambda: 8)  # a running job of 8 ranks
    assert Grid(tp=2) == Grid(dp=4, tp=2, size=8)
    with pytest.raises(ValueError, match=r"needs dp \* pp \* tp = 4 ranks, but the job has 8"):
        Grid(dp=2, tp=2)


def test_describe_draws_every_rank():
    text = Grid(dp=2, pp=2, tp=2).describe()
    assert "stage 0: [0 1]  [2 3]" in text and "stage 1: [4 5]  [6 7]" in text
    assert "tensor groups: {0,1} {2,3} {4,5} {6,7}" in text
    assert "data groups: {0,2} {1,3} {4,6} {5,7}" in text
    assert "pipeline groups: {0,4} {1,5} {2,6} {3,7}" in text


def test_sizes_that_do_not_multiply_to_the_job_size_raise():
    with pytest.raises(ValueError, match=r"dp \* pp \* tp = 6 ranks, but the job has 4.*product is 4"):
        Grid(dp=2, pp=1, tp=3, size=4)
    with pytest.raises(ValueError, match=r"6 ranks do not split into groups of pp \* tp = 4"):
        Grid(pp=2, tp=2, size=6)


@pytest.mark.parametrize("kwargs,name", [({"tp": 0}, "tp"), ({"pp": -1}, "pp"), ({"dp": 0}, "dp"),
                                         ({"tp": 2.0}, "tp"), ({"dp": True}, "dp"), ({"size": 0}, "size")])
def test_non_positive_sizes_raise(kwargs, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer; received {name}="):
        Grid(**kwargs)


def test_bad_ranks_and_coordinates_raise():
    grid = Grid(dp=2, tp=2)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 4\); received rank=4"):
        grid.coords(4)
    with pytest.raises(ValueError, match=r"tp coordinate must be in \[0, 2\); received tp=2"):
        grid.rank_of(0, 0, 2)


@pytest.mark.parametrize("total,parts", [(12, 3), (10, 3), (0, 2), (5, 5), (3, 5), (7, 1)])
def test_shard_range_covers_total_in_order(total, parts):
    ranges = [shard_range(total, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_shard_range_examples_and_errors():
    assert shard_range(12, 3, 1) == (4, 8)
    assert [shard_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match=r"index must be in \[0, parts=3\); received index=3"):
        shard_range(12, 3, 3)
    with pytest.raises(ValueError, match="parts must be a positive integer; received"):
        shard_range(12, 0, 0)
    with pytest.raises(ValueError, match="total must be a non-negative integer; received total=-1"):
        shard_range(-1, 2, 0)


def test_divisibility_checks_name_the_size_the_group_and_the_fix():
    assert check_divisible("out_features", 12, 4) == 3
    assert divisible_shard("num_heads", 8, 4, 3) == (6, 8)
    assert padded_size(10, 4) == 12 and padded_size(12, 4) == 12
    with pytest.raises(ValueError, match=r"^ParallelSelfAttention num_heads \(6\) is not divisible by the tensor "
                                         r"group size \(4\).*Pad ParallelSelfAttention num_heads to a multiple "
                                         r"of 4 \(8\)"):
        check_divisible("ParallelSelfAttention num_heads", 6, 4)
    with pytest.raises(ValueError, match=r"vocabulary \(50257\) is not divisible .* \(2\).* of 2 \(50258\)"):
        divisible_shard("vocabulary", 50257, 2, 0)
    with pytest.raises(ValueError, match="the tensor group size must be a positive integer; received"):
        check_divisible("out_features", 12, 0)


def test_register_needs_a_running_job_of_the_grids_size():
    with pytest.raises(ValueError, match=r"needs an initialized Unison job of 2 ranks; Unison is not initialized"):
        Grid(tp=2).register()


# ------------------------------------------------------------------ plans (parallelize's core)

LAYERS = [("embed", "embedding"), ("blocks.0.fc1", "linear"), ("blocks.0.act", "GELU"), ("blocks.0.fc2", "linear"),
          ("blocks.1.fc1", "linear"), ("blocks.1.act", "GELU"), ("blocks.1.fc2", "linear"), ("head", "linear")]
NAMES = {"linear": "torch.nn.Linear", "embedding": "torch.nn.Embedding"}


def test_resolve_plan_matches_whole_paths_in_model_order_with_defaults():
    plan = {"head": {"style": "colwise", "gather_output": True}, r"blocks\.\d+\.fc2": "rowwise",
            r"blocks\.\d+\.fc1": "colwise", "embed": {"style": "vocab"}}
    assert resolve_plan(LAYERS, plan) == {
        "embed": Placement("vocab", {}),
        "blocks.0.fc1": Placement("colwise", {"gather_output": False}),
        "blocks.0.fc2": Placement("rowwise", {"input_is_parallel": True}),
        "blocks.1.fc1": Placement("colwise", {"gather_output": False}),
        "blocks.1.fc2": Placement("rowwise", {"input_is_parallel": True}),
        "head": Placement("colwise", {"gather_output": True}),
    }
    assert list(resolve_plan(LAYERS, {"blocks.0.fc.": "colwise"})) == ["blocks.0.fc1", "blocks.0.fc2"]


@pytest.mark.parametrize("plan,message", [
    ({"fc1": "colwise"}, r"^plan entry 'fc1' matches no layer path \(the whole path must match\); the model's "
                         r"paths are \['embed', 'blocks.0.fc1', .*, 'head'\]$"),
    ({r"blocks\.0\..*": "colwise"},
     r"style 'colwise' splits a torch.nn.Linear layer, but 'blocks.0.act' is a GELU"),
    ({"head": "vocab"}, r"style 'vocab' splits a torch.nn.Embedding layer, but 'head' is a torch.nn.Linear; .*"
                        r"use \['colwise', 'rowwise'\]"),
    ({"embed": "rowwise"}, r"but 'embed' is a torch.nn.Embedding; .* use \['vocab'\]"),
    ({"head": "colwise", "he.d": "rowwise"}, r"layer 'head' is matched by two plan entries, 'head' and 'he.d'"),
    ({"head": "diagonal"}, r"plan entry 'head': the style must be one of \['colwise', 'rowwise', 'vocab'\]; "
                           r"received 'diagonal'"),
    ({"head": {"gather_output": True}}, r"the style must be one of .*; received \{'gather_output': True\}"),
    ({"head": {"style": "rowwise", "gather_output": True}},
     r"style 'rowwise' takes the options \['input_is_parallel'\]; received \['gather_output'\]"),
    ({"head": {"style": "colwise", "gather_output": 1}}, r"options are True or False; received"),
    ({"head[": "colwise"}, r"plan entry 'head\[' is not a valid regular expression"),
    ({}, r"the plan must be a non-empty dict"),
])
def test_bad_plans_raise_naming_the_entry_and_the_fix(plan, message):
    with pytest.raises(ValueError, match=message):
        resolve_plan(LAYERS, plan, NAMES)


def test_a_regex_that_matches_nothing_lists_some_paths():
    layers = [(f"layers.{i}", "linear") for i in range(10)]
    listed = r"'fc' matches no layer path .* \['layers.0', .*'layers.7' and 2 more\]$"
    with pytest.raises(ValueError, match=listed):
        resolve_plan(layers, {"fc": "colwise"})


def test_the_input_agreement_takes_last_bit_differences_of_each_dtype_and_refuses_another_batch():
    """Replicated activations may differ in their last bits across a group; a bfloat16 step is 1/128 of the
    value, which a dtype-blind 1e-3 refused (found by a review, 2026-12-06)."""
    import numpy as np

    from unison.common.tensor_parallel.groups import _differ, _tolerance

    a = np.linspace(-3.0, 3.0, 256)
    bf16_step = a.copy()
    bf16_step[-1] += 2 * 3.0 * 2.0 ** -8  # two bfloat16 steps at the largest value
    assert _differ(a, bf16_step, _tolerance("bfloat16")) == ""
    assert "at 1 of 256 sampled elements" in _differ(a, bf16_step, _tolerance("float32"))
    other = np.random.default_rng(0).standard_normal(256)
    assert "sampled elements" in _differ(a, other, _tolerance("bfloat16"))  # another batch: refused in any dtype
    ids = np.arange(6)
    assert _differ(ids, ids, _tolerance("int64")) == ""
    assert "the first: " in _differ(ids, ids + (ids == 5), _tolerance("int64"))
