"""ZeRO without a framework: the sharding plan and the memory formula both backends share.

See [Note: ZeRO buckets] in ``plan.py`` and docs/zero.md.
"""

from unison.common.zero.memory import BytesPerParam, formula_bytes
from unison.common.zero.plan import DEFAULT_BUCKET_BYTES, Bucket, ParamSpec, Piece, ShardPlan, check_stage

__all__ = ["ParamSpec", "Piece", "Bucket", "ShardPlan", "DEFAULT_BUCKET_BYTES", "check_stage",
           "BytesPerParam", "formula_bytes"]
