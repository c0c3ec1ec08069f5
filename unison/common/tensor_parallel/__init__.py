"""Tensor (intra-layer) parallelism without a framework: the data x pipeline x tensor grid and
the sharding math both backends' parallel layers share. See docs/tensor_parallel.md.
"""

from unison.common.tensor_parallel.grid import Coords, Grid, GridSets
from unison.common.tensor_parallel.groups import group_position
from unison.common.tensor_parallel.pipeline import grid_pipeline
from unison.common.tensor_parallel.plan import Placement, resolve_plan
from unison.common.tensor_parallel.sharding import check_divisible, divisible_shard, padded_size, shard_range

__all__ = ["Grid", "Coords", "GridSets", "shard_range", "padded_size", "check_divisible", "divisible_shard",
           "group_position", "Placement", "resolve_plan", "grid_pipeline"]
