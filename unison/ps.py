"""``unison.ps``: sharded embedding tables with push/pull, BSP/SSP/ASP (see docs/embeddings.md).

The public home of ``unison.common.ps`` (framework-neutral); the layers that use it from a
model are ``unison.torch_backend.ShardedEmbedding`` and ``unison.tf_backend.ShardedEmbedding``.
"""

from unison.common.ps import *  # noqa: F403
from unison.common.ps import __all__  # noqa: F401
