"""Elastic, fault-tolerant training: the framework-neutral core (docs/elastic.md).

The backends' ``elastic`` modules (``unison.torch_backend.elastic``) wrap these pieces in
Horovod's names: :func:`run_fn` is the retry loop of the ``run`` decorator, :class:`State`
and :class:`ObjectState` hold committed state in memory, :func:`recover` rebuilds Unison
on the ranks that survived a failure, and :class:`SamplerCore` is the elastic sampler's
partition of an epoch's remaining samples.
"""

from unison.common.elastic.recovery import Recovery, enabled, last_recovery, min_np, recover
from unison.common.elastic.runner import run_fn
from unison.common.elastic.sampler import SamplerCore
from unison.common.elastic.state import ObjectState, State, agree_structure

__all__ = ["agree_structure", "Recovery", "enabled", "last_recovery", "min_np", "recover", "run_fn", "SamplerCore",
           "ObjectState", "State"]
