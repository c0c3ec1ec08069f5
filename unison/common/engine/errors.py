"""The engine's own exceptions (``unison.StallError`` and friends are these classes).

They live apart from :mod:`.engine` so that the controller and the executor, which
the engine imports, can raise them too.
"""

from __future__ import annotations

from unison.common.exceptions import InvalidArgumentError, UnisonError

__all__ = ["StallError", "ShutdownError", "DuplicateNameError", "JoinError"]


class StallError(UnisonError):
    """Some ranks submitted a tensor that others never did, for too long."""


class ShutdownError(UnisonError):
    """The engine stopped (this or another rank shut down) with the request pending.

    When a rank's ``shutdown()`` (or its exit) stopped the engine, the message names that rank.
    """


class DuplicateNameError(UnisonError, ValueError):
    """A name was submitted again while the first submission is still in flight."""


class JoinError(InvalidArgumentError):
    """A collective that needs every rank's data ran while some rank had called ``join()``.

    Only allreduce and barrier work with joined ranks (a joined rank contributes the
    op's identity); broadcast, allgather, alltoall, reducescatter, ``add_process_set``
    and ``remove_process_set`` raise this on the ranks that submitted them. The joined
    ranks' ``join()`` returns normally (as in Horovod) and logs a warning naming them.
    """
