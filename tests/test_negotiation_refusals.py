"""The kinds a rank's refusal of a call travels as, in one process ([Note: refusal kinds] in
unison/common/engine/errors.py): what each error is sent as, which kind wins, what the negotiation's
table makes of them and which records it refuses. tests/mpi/mpi_engine.py runs them across ranks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from unison.common.engine import controller, frontend
from unison.common.engine.errors import JoinError, refusal_class, refusal_kind, winning_kind
from unison.common.engine.handles import Handle
from unison.common.engine.requests import Kind, Request
from unison.common.exceptions import (
    CollectiveError,
    InvalidArgumentError,
    MismatchError,
    UnsupportedError,
)


@pytest.mark.parametrize("error, kind", [
    (UnsupportedError("no backend named"), "U"),
    (TypeError("bad dtype"), "T"),
    (CollectiveError("bad op"), "T"),
    (ValueError("unsupported by the unison backend: quoted"), "V"),
    (InvalidArgumentError("bad root"), "V"),
    (MismatchError("counts differ"), "V"),
    (JoinError("joined"), "V"),
])
def test_each_error_travels_as_its_kind(error, kind):
    assert refusal_kind(error) == kind


@pytest.mark.parametrize("kinds, cls", [
    ("U", UnsupportedError),
    ("UV", UnsupportedError),
    ("UUV", UnsupportedError),
    ("T", CollectiveError),
    ("TU", CollectiveError),  # a plain TypeError wins: no fallback cures it
    ("TUV", CollectiveError),
    ("TV", CollectiveError),  # as before the third kind: any TypeError gives CollectiveError
    ("V", InvalidArgumentError),
])
def test_the_winning_kind_decides_the_class(kinds, cls):
    assert refusal_class(kinds) is cls
    assert refusal_class(reversed(kinds)) is cls  # (order of ranks does not matter)


@pytest.mark.parametrize("kinds", ["", "X", "TX"])
def test_no_kind_or_an_unknown_one_is_refused(kinds):
    with pytest.raises(ValueError, match="refusal kinds must be some of"):
        winning_kind(kinds)


class _Comm:
    """What a Controller reads from its communicator when it only checks a table."""

    def __init__(self, size: int) -> None:
        self.size = size

    def Get_size(self) -> int:  # noqa: N802 - MPI's name
        return self.size

    def Get_rank(self) -> int:  # noqa: N802 - MPI's name
        return 0


def _sig(error: str = "") -> Any:
    return Request("x", Kind.ALLREDUCE, np.ones(2), Handle("x"), op=1, error=error).signature()


@pytest.mark.parametrize("errors, invalid", [
    (["U:no backend named", "", ""], "U"),
    (["U:one", "V:two", ""], "U"),
    (["U:one", "T:two", ""], "T"),
    (["", "V:unsupported by the unison backend: quoted", ""], "V"),
])
def test_the_table_fails_a_call_with_the_winning_kind(errors, invalid):
    ctl = controller.Controller(_Comm(3), None, capacity=0, job_ranks=[4, 5, 6])
    entry = {r: (_sig(e), 2) for r, e in enumerate(errors)}
    text, kind = ctl._check("x", entry, [0, 1, 2])
    assert kind == invalid
    bad = [r for r, e in enumerate(errors) if e]
    assert text.startswith(f"collective 'x' failed on {len(bad)} of 3 rank(s): ")
    for r in bad:  # each refusing rank's own text, by its job rank, without the kind
        assert f"rank {4 + r}: {errors[r][2:]}" in text


def test_the_kind_is_what_a_request_carries():
    """``frontend`` sends an ``UnsupportedError`` refused on this rank as "U", whatever its message says."""

    class _Engine:
        def submit(self, req: Request) -> Request:
            return req

    def submit(refusal: Exception) -> str:
        req: Any = frontend._submit(_Engine(), Kind.ALLREDUCE, "x", frontend.Refused(refusal), 0,
                                    lambda arr: None)
        return req.error

    assert submit(UnsupportedError("no backend named")) == "U:no backend named"
    assert submit(TypeError("bad dtype")) == "T:bad dtype"
    assert submit(ValueError("unsupported by the unison backend: quoted")) == \
        "V:unsupported by the unison backend: quoted"


@pytest.mark.parametrize("error", ["X:a kind no rank sends", "U", "Tno colon"])
def test_an_announcement_with_an_unknown_kind_is_refused(error):
    raw = controller.encode_announcement([("x", _sig()._replace(error=error, dtype=-1), 2)], joined=False)
    with pytest.raises(ValueError, match="from rank 1.*refusal kind"):
        controller.decode_announcement(raw, rank=1)
    ok = controller.encode_announcement([("x", _sig("U:fine"), 2)], joined=False)
    assert controller.decode_announcement(ok, rank=1)[0][0][1].error == "U:fine"
