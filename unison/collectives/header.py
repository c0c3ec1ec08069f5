"""Agreeing on a call before moving data: one small all-gather per collective.

Every blocking collective starts by all-gathering a fixed-size block from each
rank: a 256-byte header describing the call (collective, dtype, shape, op,
root, scale factors, algorithm) followed by 256 bytes of inline space::

    block = | must-match words 0-20 | per-rank words 21-31 | inline (256 B) |

(the word offsets are the ``W_*`` constants below; :class:`Header` decodes a block).

* If any rank's must-match words differ, every rank sees every header and
  raises the same :class:`MismatchError` listing each rank's call; nothing hangs
  and no rank computes on garbage.
* A rank whose arguments are invalid (unsupported dtype, bad root) still takes
  part: it sets an error word, and since every rank then sees that word, all of
  them make one more all-gather of the ranks' messages (:data:`ERROR_BYTES`
  each) and raise them.
* Payloads of at most 256 bytes ride in the inline space, so a small
  all-reduce (a loss, a metric) completes in this one exchange (each rank
  reduces the gathered copies in rank order, which keeps results bitwise
  identical).

[Note: agreement cost] The block is small on purpose. Over shared memory an
all-gather of 512 bytes per rank costs about one MPI latency (2.5-3 us at
np=2 here); the former 4 KiB inline space made each block cross Open MPI's
4 KiB eager limit, and every call paid about 8 us for its agreement, as much as
a whole 4 KiB ``MPI_Allreduce``. Payloads above 256 bytes now travel in MPI's
own call (or Unison's algorithms) right after the agreement, so a call costs
one small exchange plus the data movement. Cached plans (:mod:`.plans`) replay
a signature's header without rebuilding it.

The block size is fixed, never derived from the call, so the exchange itself
can never mismatch; every later step (the data movement, the error all-gather)
depends only on what every rank has seen in the gathered headers.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from unison.common.dtypes import dtype_from_code, dtype_name
from unison.common.exceptions import (
    MismatchError,
    refusal_class,
    refusal_kind,
)
from unison.common.ops import ReduceOp

__all__ = ["Collective", "Call", "Header", "Negotiator", "INLINE_BYTES", "HEADER_BYTES", "ERROR_BYTES"]

MAGIC = 0x554E49534F4E0001
HEADER_BYTES = 256
INLINE_BYTES = 256
#: Room for each rank's error message in the all-gather that follows a failed agreement.
ERROR_BYTES = 4096
BLOCK_BYTES = HEADER_BYTES + INLINE_BYTES
MAX_DIMS = 8

# Word offsets of the header (int64 words; W_PRESCALE and W_POSTSCALE hold float64 bits)::
#
#   0 magic | 1 collective | 2 dtype | 3 op | 4 algorithm | 5 root | 6 prescale | 7 postscale
#   8 ndim | 9 dim0 (-1: may vary) | 10-17 dims 1..8 | 18 hash of dims 9.. | 19 nbytes (-1: may vary)
#   20 error flag                                                       <- must match up to here
#   21 my dim0 | 22 my nbytes | 23 inline | 24 error length | 25 error kind | 26-31 unused
W_MAGIC = 0
W_COLLECTIVE = 1
W_DTYPE = 2
W_OP = 3
W_ALGORITHM = 4
W_ROOT = 5
W_PRESCALE = 6
W_POSTSCALE = 7
W_NDIM = 8
W_DIM0 = 9
W_DIMS = 10
W_TAIL_HASH = W_DIMS + MAX_DIMS
W_NBYTES = W_TAIL_HASH + 1
W_ERR = W_NBYTES + 1
#: Words 0 .. W_ERR must be equal on every rank (an error flag set anywhere is a mismatch).
MATCH_WORDS = W_ERR + 1
MATCH_BYTES = MATCH_WORDS * 8
W_MYDIM0 = MATCH_WORDS
W_MYNBYTES = W_MYDIM0 + 1
W_INLINE = W_MYNBYTES + 1
W_ERRLEN = W_INLINE + 1
W_ERRKIND = W_ERRLEN + 1
HEADER_WORDS = HEADER_BYTES // 8

ERR_NONE, ERR_TYPE, ERR_VALUE, ERR_UNSUPPORTED = 0, 1, 2, 3
#: the error-kind word -> the refusal kind it stands for ([Note: refusal kinds] in common/engine/errors.py)
ERR_KINDS = {ERR_TYPE: "T", ERR_VALUE: "V", ERR_UNSUPPORTED: "U"}


_ERR_CODES = {letter: code for code, letter in ERR_KINDS.items()}


def error_code(exc: BaseException) -> int:
    """The error-kind word of a rank's refusal ``exc``."""
    return _ERR_CODES[refusal_kind(exc)]

_STRUCT = struct.Struct(f"<{W_PRESCALE}q2d{HEADER_WORDS - W_PRESCALE - 2}q")
_UNUSED = (0,) * (HEADER_WORDS - W_ERRKIND - 1)


class Header(NamedTuple):
    """One rank's header words, decoded (the layout above)."""

    magic: int
    collective: int
    dtype_code: int
    op: int
    algorithm: int
    root: int
    prescale: float
    postscale: float
    ndim: int
    dim0: int
    dims: tuple[int, ...]
    tail_hash: int
    nbytes: int
    error: int
    my_dim0: int
    my_nbytes: int
    inline: int
    error_len: int
    error_kind: int

    @classmethod
    def unpack(cls, block: np.ndarray) -> Header:
        w = _STRUCT.unpack_from(block, 0)  # type: ignore[arg-type]
        return cls._make([*w[:W_DIMS], tuple(w[W_DIMS:W_TAIL_HASH]), *w[W_TAIL_HASH:W_ERRKIND + 1]])

    def pack_into(self, block: np.ndarray) -> None:
        _STRUCT.pack_into(block, 0, *self[:W_DIMS], *self.dims,  # type: ignore[arg-type]
                          *self[W_DIMS + 1:], *_UNUSED)


class Collective(enum.IntEnum):
    ALLREDUCE = 1
    ALLGATHER = 2
    BROADCAST = 3
    ALLTOALL = 4
    REDUCESCATTER = 5
    BARRIER = 6


ALGO_CODES = {"auto": 0, "ring": 1, "rhd": 2, "mpi": 3, "tree": 4, "pairwise": 5, "hierarchical": 6}
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
        self._send = [self.block, mpi.BYTE]
        self._recv = [self.gathered, mpi.BYTE]
        #: this rank's error message of the current call (sent only when some rank failed)
        self._my_error = b""
        #: cached per-signature plans of the fast paths (see :mod:`.plans`)
        self.plans: dict[Any, Any] = {}
        #: the plan whose bytes are in ``block`` (any other exchange resets it)
        self.last_plan: Any = None

    def inline_area(self) -> np.ndarray:
        """This rank's inline space, to fill before :meth:`exchange` (no plan's bytes stay valid)."""
        self.last_plan = None
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
        self._my_error = err_text.encode("utf-8", "replace")[:ERROR_BYTES] if err_kind else b""
        self.last_plan = None
        # the words in Header's field order, packed flat (this runs on every uncached call)
        _STRUCT.pack_into(
            self.block, 0, MAGIC, int(call.coll), call.dtype_code, call.op,  # type: ignore[arg-type]
            ALGO_CODES[call.algorithm], call.root, call.prescale, call.postscale,
            len(shape), -1 if call.vary_dim0 else dim0, *dims, _tail_hash(shape),
            -1 if call.vary_dim0 else call.nbytes, 1 if err_kind else 0,
            dim0, call.nbytes, int(call.inline), len(self._my_error), err_kind, *_UNUSED,
        )
        self.comm.Allgather(self._send, self._recv)
        match = self._match
        if match[1:].tobytes() != match[0].tobytes() * (self.size - 1) or self.words[0, W_ERR]:
            self.raise_mismatch(call)

    def replay(self, owner: Any, prefix: np.ndarray, seen: np.ndarray, expected: bytes, match: bytes,
               call: Call, name: str | None) -> bool:
        """The exchange of a cached plan: ``prefix`` (its header and inline bytes) sent as is.

        Args:
            owner: the plan; its bytes stay in the block until another exchange.
            prefix: the first ``len(prefix)`` bytes of this rank's block.
            seen: ``gathered[:, :len(prefix)]``, the view the plan compares.
            expected: every rank's gathered prefix, concatenated, as the plan last saw them.
            match: every rank's must-match words as they must be (this rank's, ``size`` times).
            call: the plan's call, for the error message.
            name: this call's name, for the error message.

        Returns:
            True when every rank sent exactly the bytes of ``expected`` (the plan's
            precomputed counts hold); False when only per-rank words differ (the
            first dimension of an all-gather, say) and the caller must recompute.

        Raises:
            MismatchError, CollectiveError, InvalidArgumentError: as :meth:`exchange`.
        """
        if self.last_plan is not owner:
            self.block[:prefix.size] = prefix
            self.last_plan = owner
        self._my_error = b""
        self.comm.Allgather(self._send, self._recv)
        if seen.tobytes() == expected:
            return True
        if self._match.tobytes() != match:
            call.name = name
            self.raise_mismatch(call)
        return False

    def all_inline(self) -> bool:
        return bool(self.words[:, W_INLINE].all())

    def dim0s(self) -> list[int]:
        return self.words[:, W_MYDIM0].tolist()

    def inline_rows(self, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of every rank's inline space: a (size, nbytes) uint8 view."""
        return self.gathered[:, HEADER_BYTES:HEADER_BYTES + nbytes]

    def header(self, rank: int) -> Header:
        """``rank``'s gathered header, decoded."""
        return Header.unpack(self.gathered[rank])

    # ----------------------------------------------------------------- errors
    def _describe(self, rank: int) -> dict[str, str]:
        h = self.header(rank)
        shape = tuple([h.my_dim0] + list(h.dims[: max(h.ndim - 1, 0)]))[:h.ndim] if h.ndim else ()
        shape_s = str(shape) if h.ndim <= 1 + MAX_DIMS else str(shape)[:-1] + ", ...)"
        try:
            coll_s = Collective(h.collective).name.lower()
        except ValueError:
            coll_s = f"<unknown collective {h.collective}>"
        desc = {
            "collective": coll_s,
            "shape": shape_s,
            "dtype": dtype_name(dtype_from_code(h.dtype_code)) if h.dtype_code >= 0 else "<unsupported>",
            "algorithm": _ALGO_NAMES.get(h.algorithm, str(h.algorithm)),
        }
        if h.op >= 0:
            desc["op"] = repr(ReduceOp(h.op))
        if h.root >= 0:
            desc["root_rank"] = str(h.root)
        if h.prescale != 1.0 or h.postscale != 1.0:
            desc["prescale_factor"], desc["postscale_factor"] = repr(h.prescale), repr(h.postscale)
        return desc

    def _gather_errors(self) -> np.ndarray:
        """Every rank's error message (``ERROR_BYTES`` each, fixed), as a (size, ERROR_BYTES) array."""
        mine = np.zeros(ERROR_BYTES, dtype=np.uint8)
        mine[:len(self._my_error)] = np.frombuffer(self._my_error, np.uint8)
        texts = np.empty((self.size, ERROR_BYTES), dtype=np.uint8)
        self.comm.Allgather([mine, self.mpi.BYTE], [texts, self.mpi.BYTE])
        return texts

    def raise_mismatch(self, call: Call) -> None:
        """Raise the error that describes why the gathered headers disagree."""
        label = f"unison.{call.coll.name.lower()}" + (f"(name={call.name!r})" if call.name else "()")
        errors = []
        if self.words[:, W_ERR].any():  # every rank sees it, so every rank takes this all-gather
            texts = self._gather_errors()
            for r in range(self.size):
                w = self.words[r]
                if w[W_ERR]:
                    text = texts[r, :int(w[W_ERRLEN])].tobytes().decode("utf-8", "replace")
                    errors.append((int(w[W_ERRKIND]), f"rank {r}: {text}"))
        if errors:
            # the engine's rule: any TypeError gives CollectiveError, else any UnsupportedError, else
            # InvalidArgumentError (before 2026-12-06 a TypeError beside a ValueError gave InvalidArgumentError)
            cls = refusal_class(ERR_KINDS.get(k, "V") for k, _ in errors)
            raise cls(f"{label} failed on {len(errors)} of {self.size} rank(s): "
                      + "; ".join(t for _, t in errors))
        descs = [self._describe(r) for r in range(self.size)]
        keys = [k for k in descs[0] if any(d.get(k) != descs[0].get(k) for d in descs)]
        keys += list(dict.fromkeys(k for d in descs for k in d if k not in keys and k not in descs[0]))
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
