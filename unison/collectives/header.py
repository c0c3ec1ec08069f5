"""Agreeing on a call before moving data: one small all-gather per collective.

Every blocking collective starts by all-gathering a fixed-size block from each
rank: a 256-byte header describing the call (collective, dtype, shape, op,
root, scale factors, algorithm) followed by 4 KiB of inline space::

    block = | must-match words 0-20 | per-rank words 21-31 | inline (4096 B) |

* If any rank's must-match words differ, every rank sees every header and
  raises the same :class:`MismatchError` listing each rank's call; nothing hangs
  and no rank computes on garbage.
* A rank whose arguments are invalid (unsupported dtype, bad root) still takes
  part: it sets an error word and puts its message inline, and every rank
  raises it.
* Small payloads ride in the inline space, so a 4 KiB all-reduce completes in
  this one exchange (each rank reduces the gathered copies in rank order, which
  keeps results bitwise identical) -- the latency-optimal algorithm for small
  messages.

The block size is fixed, never derived from the call, so the exchange itself
can never mismatch.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from unison.common.dtypes import dtype_from_code, dtype_name
from unison.common.exceptions import CollectiveError, InvalidArgumentError, MismatchError
from unison.common.ops import ReduceOp

__all__ = ["Collective", "Call", "Negotiator", "INLINE_BYTES", "HEADER_BYTES"]

MAGIC = 0x554E49534F4E0001
HEADER_BYTES = 256
INLINE_BYTES = 4096
BLOCK_BYTES = HEADER_BYTES + INLINE_BYTES
MATCH_WORDS = 21
MATCH_BYTES = MATCH_WORDS * 8
MAX_DIMS = 8

W_ERR = 20
W_MYDIM0 = 21
W_MYNBYTES = 22
W_INLINE = 23
W_ERRLEN = 24

ERR_NONE, ERR_TYPE, ERR_VALUE = 0, 1, 2

_STRUCT = struct.Struct("<6q2d24q")


class Collective(enum.IntEnum):
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6


ALGO_CODES = {"auto": 0, "ring": 1, "rhd": 2, "mpi": 3, "tree": 4, "pairwise": 5}
_ALGO_NAMES = {v: k for k, v in ALGO_CODES.items()}


@dataclass
class Call:
    """One rank's description of a collective call."""

    coll: Collective
    name: str | None = None
    dtype_code: int = -1
    shape: tuple[int, ...] = ()
    op: int = -1
    algorithm: str = "auto"
    root: int = -1
    prescale: float = 1.0
    postscale: float = 1.0
    #: whether the first dimension may differ between ranks (allgather, alltoall)
    vary_dim0: bool = False
    nbytes: int = 0
    inline: bool = False
    error: tuple[int, str] | None = None


def _tail_hash(shape: tuple[int, ...]) -> int:
    return hash(shape[1 + MAX_DIMS:]) if len(shape) > 1 + MAX_DIMS else 0


class Negotiator:
    """Owns the exchange buffers for one communicator."""

    def __init__(self, comm: Any, mpi: Any) -> None:
        self.comm = comm
        self.mpi = mpi
        self.size = comm.Get_size()
        self.rank = comm.Get_rank()
        self.block = np.zeros(BLOCK_BYTES, dtype=np.uint8)
        self.gathered = np.zeros((self.size, BLOCK_BYTES), dtype=np.uint8)
        self.words = self.gathered[:, :HEADER_BYTES].view(np.int64)
        self._match = self.gathered[:, :MATCH_BYTES]
        #: cached per-signature plans of the fast paths (see api.InlineAllreduce)
        self.plans: dict[Any, Any] = {}
        #: the plan whose header is in ``block`` (any other exchange resets it)
        self.last_plan: Any = None

    def inline_area(self) -> np.ndarray:
        """This rank's inline space, to fill before :meth:`exchange`."""
        return self.block[HEADER_BYTES:]

    def payload(self, rank: int, nbytes: int, offset: int = 0) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of ``rank``'s gathered inline space."""
        start = HEADER_BYTES + offset
        return self.gathered[rank, start:start + nbytes]

    def exchange(self, call: Call) -> None:
        """All-gather ``call``'s header; raise on every rank if the ranks disagree.

        Raises:
            MismatchError: ranks described different calls.
            CollectiveError: a rank reported an invalid dtype or op (TypeError).
            InvalidArgumentError: a rank reported an invalid argument (ValueError).
        """
        shape = call.shape
        dims = list(shape[1:1 + MAX_DIMS]) + [0] * (MAX_DIMS - len(shape[1:1 + MAX_DIMS]))
        dim0 = shape[0] if shape else 0
        err_kind, err_text = call.error if call.error else (ERR_NONE, "")
        err_bytes = err_text.encode("utf-8", "replace")[:INLINE_BYTES]
        if err_bytes:
            self.block[HEADER_BYTES:HEADER_BYTES + len(err_bytes)] = np.frombuffer(err_bytes, np.uint8)
        self.last_plan = None
        _STRUCT.pack_into(
            self.block, 0, MAGIC, int(call.coll), call.dtype_code, call.op,  # type: ignore[arg-type]
            ALGO_CODES[call.algorithm], call.root, call.prescale, call.postscale,
            len(shape), -1 if call.vary_dim0 else dim0, *dims, _tail_hash(shape),
            -1 if call.vary_dim0 else call.nbytes, 1 if err_kind else 0,
            dim0, call.nbytes, int(call.inline), len(err_bytes) if err_kind else 0,
            err_kind, 0, 0, 0, 0, 0, 0,
        )
        self.comm.Allgather([self.block, self.mpi.BYTE], [self.gathered, self.mpi.BYTE])
        match = self._match
        if match[1:].tobytes() != match[0].tobytes() * (self.size - 1) or self.words[0, W_ERR]:
            self.raise_mismatch(call)

    def all_inline(self) -> bool:
        return bool(self.words[:, W_INLINE].all())

    def dim0s(self) -> list[int]:
        return self.words[:, W_MYDIM0].tolist()

    # ----------------------------------------------------------------- errors
    def _describe(self, rank: int) -> dict[str, str]:
        w = self.words[rank]
        (_, coll, dtc, op, algo, root, pre, post, ndim, dim0m, *rest) = _STRUCT.unpack_from(
            self.gathered[rank], 0)
        dims = rest[:MAX_DIMS]
        dim0 = int(w[W_MYDIM0])
        shape = tuple([dim0] + list(dims[: max(ndim - 1, 0)]))[:ndim] if ndim else ()
        shape_s = str(shape) if ndim <= 1 + MAX_DIMS else str(shape)[:-1] + ", ...)"
        try:
            coll_s = Collective(coll).name.lower()
        except ValueError:
            coll_s = f"<unknown collective {coll}>"
        desc = {
            "collective": coll_s,
            "shape": shape_s,
            "dtype": dtype_name(dtype_from_code(dtc)) if dtc >= 0 else "<unsupported>",
            "algorithm": _ALGO_NAMES.get(algo, str(algo)),
        }
        if op >= 0:
            desc["op"] = repr(ReduceOp(op))
        if root >= 0:
            desc["root_rank"] = str(root)
        if pre != 1.0 or post != 1.0:
            desc["prescale_factor"], desc["postscale_factor"] = repr(pre), repr(post)
        return desc

    def raise_mismatch(self, call: Call) -> None:
        """Raise the error that describes why the gathered headers disagree."""
        label = f"unison.{call.coll.name.lower()}" + (f"(name={call.name!r})" if call.name else "()")
        errors = []
        for r in range(self.size):
            w = self.words[r]
            if w[W_ERR]:
                text = self.payload(r, int(w[W_ERRLEN])).tobytes().decode("utf-8", "replace")
                errors.append((int(w[25]), f"rank {r}: {text}"))
        if errors:
            kinds = {k for k, _ in errors}
            cls = CollectiveError if kinds == {ERR_TYPE} else InvalidArgumentError
            raise cls(f"{label} failed on {len(errors)} of {self.size} rank(s): "
                      + "; ".join(t for _, t in errors))
        descs = [self._describe(r) for r in range(self.size)]
        keys = [k for k in descs[0] if any(d.get(k) != descs[0].get(k) for d in descs)]
        keys += [k for d in descs for k in d if k not in keys and k not in descs[0]]
        shown = ["collective", "shape", "dtype"] + [k for k in keys if k not in
                                                     ("collective", "shape", "dtype")]
        per_rank = "; ".join(
            f"rank {r}: " + ", ".join(f"{k}={d.get(k, '-')}" for k in shown)
            for r, d in enumerate(descs))
        differing = ", ".join(keys) or "shape"
        raise MismatchError(
            f"{label}: ranks called it with different arguments (differing: {differing}): {per_rank}. "
            "Every rank must make the same collective calls in the same order with the same "
            "dtype, shape (first dimension excepted for allgather/alltoall), op, root and "
            "scale factors.")
