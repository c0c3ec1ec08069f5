"""Sharded checkpoints without a framework: the one format ZeRO, tensor parallelism, elastic
training and sharded embeddings save to and load from.

See [Note: checkpoint format] in ``format.py``, [Note: sharded commit protocol] in ``sharded.py``,
[Note: what a load checks] in ``reader.py`` and docs/checkpoints.md.
"""

from unison.common.checkpoints.consolidated import save_consolidated
from unison.common.checkpoints.format import (
    FORMAT_NAME,
    MANIFEST_NAME,
    VERSION,
    CheckpointError,
    Entry,
    LocalShard,
    Manifest,
    Replicated,
    Run,
    reshard_ranges,
)
from unison.common.checkpoints.reader import load, read_manifest
from unison.common.checkpoints.sharded import save_sharded

__all__ = ["save_sharded", "save_consolidated", "load", "read_manifest", "reshard_ranges", "LocalShard",
           "Replicated", "Manifest", "Entry", "Run", "CheckpointError", "FORMAT_NAME", "VERSION", "MANIFEST_NAME"]
