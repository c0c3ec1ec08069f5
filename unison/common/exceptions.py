"""Exceptions raised by Unison.

Every class subclasses the built-in exception a user would naturally catch
(``RuntimeError``, ``ValueError``, ``TypeError``) so existing ``except`` clauses
keep working.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "UnisonError", "NotInitializedError", "MismatchError", "CollectiveError", "InvalidArgumentError",
    "UnsupportedError", "UnisonInternalError", "HorovodInternalError", "HostsUpdatedInterrupt",
    "REFUSALS", "refusal_kind", "winning_kind", "refusal_class", "ForkedProcessError",
]


class UnisonError(RuntimeError):
    """Base class of Unison's own errors."""


class NotInitializedError(UnisonError, ValueError):
    """A collective or query was called before :func:`unison.init`."""

    def __init__(self, what: str = "this call") -> None:
        super().__init__(
            f"Unison has not been initialized: {what} needs it. Call unison.init() first "
            "(once per process, after importing unison)."
        )


class ForkedProcessError(UnisonError):
    """A collective, or the job's communicator, used in a process forked after :func:`unison.init`."""


class MismatchError(UnisonError, ValueError):
    """Ranks submitted the same collective with incompatible arguments.

    Raised on every rank, with every rank's view of the call in the message.
    """


class CollectiveError(UnisonError, TypeError):
    """A rank submitted a collective that cannot run (bad dtype, op or argument).

    Raised on every rank so that no rank is left waiting for the others.
    """


class InvalidArgumentError(UnisonError, ValueError):
    """A rank passed an argument that no rank can accept (bad root, splits, shape).

    Raised on every rank so that no rank is left waiting for the others.
    """


class UnsupportedError(CollectiveError, NotImplementedError):
    """A call Unison does not implement (a device, an op for a dtype), raised on every rank of the call.

    A ``NotImplementedError`` and so a ``RuntimeError`` (what gloo raises for the same calls of the
    ``torch.distributed`` backend), and a :class:`CollectiveError` (a ``TypeError``).
    """


class UnisonInternalError(UnisonError):
    """A rank of the job failed (or the communicator was revoked) while this rank used it.

    In elastic mode (``UNISON_ELASTIC=1``, set by ``unisonrun --elastic``) the elastic
    ``run`` wrapper catches it, rolls back to the last commit, rebuilds Unison on the
    surviving ranks and calls the training function again (docs/elastic.md). Horovod's
    name for it, ``HorovodInternalError``, is the same class.
    """


#: Horovod's name, so ``except hvd.HorovodInternalError`` keeps working.
HorovodInternalError = UnisonInternalError


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: the elastic ``run`` wrapper resets without rolling back.

    Args:
        skip_sync: True when no rank was added, so the state need not be broadcast again.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of the job changed; resetting at this commit")
        self.skip_sync = skip_sync


# ---------------------------------------------- refusal kinds ([Note: refusal kinds] in common/engine/errors.py)

#: a refusal's kind -> the class every rank raises for it alone (see [Note: refusal kinds] in engine/errors.py)
REFUSALS: dict[str, type[UnisonError]] = {"T": CollectiveError, "U": UnsupportedError, "V": InvalidArgumentError}


def refusal_kind(error: BaseException) -> str:
    """The kind ``error``, a rank's refusal of a call, travels as: ``"U"`` for an ``UnsupportedError``,
    ``"T"`` for any other ``TypeError``, ``"V"`` for anything else (see [Note: refusal kinds])."""
    if isinstance(error, UnsupportedError):
        return "U"
    return "T" if isinstance(error, TypeError) else "V"


def winning_kind(kinds: Iterable[str]) -> str:
    """The kind that decides what every rank raises when ranks refused a call with errors of ``kinds``
    (at least one): any ``"T"``, then any ``"U"``, then ``"V"`` (see [Note: refusal kinds]).

    Raises:
        ValueError: ``kinds`` is empty or holds a letter that is not a kind.
    """
    seen = set(kinds)
    if not seen or not seen <= REFUSALS.keys():
        raise ValueError(f"refusal kinds must be some of {sorted(REFUSALS)}; got {sorted(seen)}: every rank must "
                         "run the same Unison version")
    return next(kind for kind in "TUV" if kind in seen)


def refusal_class(kinds: Iterable[str]) -> type[UnisonError]:
    """What every rank raises when ranks refused a call with errors of ``kinds``: the class of their
    :func:`winning_kind` (see [Note: refusal kinds])."""
    return REFUSALS[winning_kind(kinds)]
