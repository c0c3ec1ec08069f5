"""Sharded key-value tables with push/pull over MPI (parameter-server style), framework-neutral.

See docs/embeddings.md. ``unison.ps`` re-exports this package.
"""

from unison.common.ps.consistency import ASP, BSP, SSP, Consistency
from unison.common.ps.optimizers import SGD, Adagrad, Adam, Optimizer
from unison.common.ps.sharding import Sharding
from unison.common.ps.table import Handle, ShardedTable, TableError, TableLostError, get_table, tables

__all__ = [
    "ShardedTable",
    "Handle",
    "TableError",
    "TableLostError",
    "get_table",
    "tables",
    "BSP",
    "SSP",
    "ASP",
    "Consistency",
    "SGD",
    "Adagrad",
    "Adam",
    "Optimizer",
    "Sharding",
]
