"""Data parallelism's framework-neutral parts: how a global batch is split, and the host-side math.

Every framework adapter of data-parallel training (``unison.keras.DataParallel`` on the
TensorFlow, JAX and torch backends of Keras 3) does the same four things; they live here
once, on numpy arrays, so each adapter only moves its tensors to and from the host:

* **Splitting** (:class:`BatchPlan`): the data is the *global* data on every rank and a
  batch size is the *global* batch. Rank r of ``size`` takes rows
  ``[r*m//size, (r+1)*m//size)`` of each global batch of m rows, so the ranks' rows
  are disjoint, cover the batch, and every rank runs the same number of steps (the
  same rule as ``UnisonStrategy``). A last global batch with fewer rows than ranks
  would leave some ranks without a row (Keras cannot train on an empty batch): with
  ``shadows`` every rank takes all its rows, and the ranks other than 0 are its *shadows*
  ([Note: shadow shares]); without, it is dropped, with a warning that names the rows
  lost and the fix.
* **Gradients** (:func:`average_gradients`): with ``rows`` (this rank's batch rows) the
  result is ``sum_r rows_r * g_r / sum_r rows_r``: the gradient of the mean loss over
  the global batch, exactly, also when the last batch splits unevenly (a plain average
  of the ranks' gradients weighs a short share too much). One fused group, with the
  ranks' row counts beside it in the same engine cycle; only a step whose rows differ
  reduces again, weighed ([Note: rows beside the gradients]).
* **Metrics** (:func:`sum_states`): Keras's metrics keep additive state (totals and
  counts, confusion-matrix cells); summing each state over the ranks gives the state
  one process would have after the global batches, so every rank reports the global
  loss and metrics.
* **Predictions** (:func:`gather_rows`): each rank predicts its rows; gathering them
  in rank order per global batch restores the global order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.compression import Compression, Compressor
from unison.common.engine import frontend
from unison.common.engine.engine import caller_waits
from unison.common.engine.handles import wait_all
from unison.common.engine.objects import agree_on_names
from unison.common.ops import Average, Max, ReduceOp, Sum, parse_op

__all__ = ["BatchPlan", "GradientStream", "average_gradients", "broadcast_arrays", "gather_rows", "sum_states"]

logger = logging.getLogger(__name__)

#: the engine name of :func:`average_gradients`'s group (one call at a time: each waits for its result)
GRADIENTS = "unison.average_gradients"
#: how long a failed :func:`average_gradients` waits for its rows check before raising
CHECK_DRAIN_S = 10.0


@dataclass(frozen=True)
class BatchPlan:
    """How ``samples`` rows, read in global batches of ``batch`` rows, split over ``size`` ranks.

    Attributes:
        samples: rows in the (global) data.
        batch: rows in a global batch.
        size: number of ranks.
        shadows: a global batch of fewer rows than ranks goes whole to every rank, rank 0's share
            counting and the others' *shadows* weighing nothing; else it is dropped.

    [Note: shadow shares] A last global batch of m < size rows cannot be split so that every
    rank gets a row, and an empty batch is no batch to Keras (an empty mean is NaN: the loss, a
    ``BatchNormalization``'s statistics). So every rank takes the m rows: rank 0 as one process
    would, the others as shadows whose every sample weight is -0.0. A shadow's loss and metrics
    are weighed by zero and its metrics' states put back, so they change nothing, and its weight
    among the ranks is 0, so the combined gradient is rank 0's alone: one process's, exactly. (Its
    ``BatchNormalization`` sees the small batch whole, as one process's does there.) The sign of the
    zero is how a step tells a shadow share from a user's weights of zero (made +0.0), in a compiled
    step as in an eager one (``unison.keras.data_parallel.shadow_share``). Before 2026-12-07 such a
    batch was dropped, with a warning; it still is where shadows do not apply (see
    ``unison.keras.data_parallel._shadows_allowed``).
    """

    samples: int
    batch: int
    size: int
    shadows: bool = False

    def __post_init__(self) -> None:
        for field, value in (("samples", self.samples), ("batch", self.batch), ("size", self.size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"BatchPlan: {field} must be a non-negative integer; got {value!r}")
        if self.size < 1:
            raise ValueError(f"BatchPlan: size must be at least 1; got {self.size}")
        if self.batch < self.size:
            raise ValueError(f"batch_size={self.batch} is the GLOBAL batch and must give each of the "
                             f"{self.size} ranks at least one row; use batch_size >= {self.size} (usually "
                             f"{self.size} x the batch one process would use)")

    @property
    def dropped(self) -> int:
        """Rows of a last global batch too small to give every rank a row, left out (0 when none, or with
        ``shadows``)."""
        tail = self.samples % self.batch
        return tail if 0 < tail < self.size and not self.shadows else 0

    @property
    def has_shadows(self) -> bool:
        """Whether a global batch goes whole to every rank ([Note: shadow shares])."""
        return self.shadows and 0 < self.samples % self.batch < self.size

    def shadow(self, step: int, rank: int) -> bool:
        """Whether ``rank``'s share of global batch ``step`` is a shadow ([Note: shadow shares])."""
        start, stop = self.global_rows(step)
        return rank != 0 and stop - start < self.size

    @property
    def steps(self) -> int:
        """Global batches: every rank runs this many steps."""
        return -(-(self.samples - self.dropped) // self.batch)

    def global_rows(self, step: int) -> tuple[int, int]:
        """Row range ``[start, stop)`` of global batch ``step`` in the (possibly shuffled) data."""
        if not 0 <= step < self.steps:
            raise IndexError(f"global batch {step} out of range: the data has {self.steps} batches")
        start = step * self.batch
        return start, min(start + self.batch, self.samples - self.dropped)

    def rank_rows(self, step: int, rank: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of the data that ``rank`` takes from global batch ``step`` (all of them from a
        batch of fewer rows than ranks: [Note: shadow shares])."""
        start, stop = self.global_rows(step)
        m = stop - start
        if m < self.size:
            return start, stop
        return start + rank * m // self.size, start + (rank + 1) * m // self.size

    def warn_if_dropping(self, rank: int, what: str = "the data") -> None:
        """Log (on rank 0) the rows a too-small last batch loses, and how to keep them."""
        if self.dropped and rank == 0:
            logger.warning(
                "%s: the last global batch has %d row(s) for %d ranks, so some ranks would get none; "
                "those %d row(s) are skipped each epoch. To keep them, choose a batch_size whose "
                "remainder (%d rows %% batch_size) is 0 or at least %d", what, self.dropped, self.size,
                self.dropped, self.samples, self.size)


def _as_list(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.require(np.asarray(a), requirements="C") for a in arrays]  # keeps 0-d arrays 0-d


def _rows_check(rows: int | None, op: ReduceOp, name: str | None = None) -> Any:
    """Start the all-reduce of ``[rows, rows**2]`` that decides the weighting; None where none applies.

    [Note: rows beside the gradients] With ``rows`` and Average the result weighs each rank by
    its rows. Whether the rows are equal (``size * sum(r**2) == sum(r)**2``, the usual case: then
    the plain average is the weighted one, and the engine's scale factors do all the work while
    copying) is known only from every rank's rows. That small all-reduce used to run, and be
    waited for, before the gradients were submitted: a second round trip every step (by hand, about
    80 us of 450 for a 94,538-parameter model's group at 2 ranks here). Now it is submitted beside
    the gradients' plain average and both travel in one engine cycle; only a step whose rows
    differ (a last batch split unevenly, once an epoch) reduces its gradients again, weighed by
    the rows' shares (:func:`_share`). The numbers are the same as deciding first: the
    average of the equal case and the weighed sum of the uneven one are each the same call as
    before."""
    if rows is None or op is not Average:
        return None
    return frontend.allreduce_async(np.array([rows, rows * rows], np.float64), Sum, name)


def _share(check: Any, rows: int | None) -> float | None:
    """This rank's weight ``rows / total`` from a finished :func:`_rows_check`; None when the plain
    average is already the weighted one (equal rows, or no rank counts a target: a masked loss's
    gradients are zeros, which any weighting keeps).

    The weighted values stay the size of the mean: multiplied by the rows and divided after the
    sum (before 2026-12-05) they overflowed fp16 compression's range where the mean fits it.
    """
    total, squares = (float(v) for v in np.asarray(check.wait()).reshape(-1))
    if total < 0:
        raise ValueError(f"average_gradients: the ranks' rows sum to {total}; a rank's rows cannot be negative")
    if total == 0 or runtime.size() * squares == total * total:
        return None
    return float(rows) / total  # type: ignore[arg-type]


def _weighed(array: np.ndarray, weight: float) -> np.ndarray:
    """``array * weight``, computed in float32 at least (a share of the rows in bfloat16 kept 8 bits)."""
    if weight == 1.0:
        return array
    if array.dtype in (np.float32, np.float64):
        return array * np.asarray(weight, dtype=array.dtype)
    return (array.astype(np.float32) * np.float32(weight)).astype(array.dtype)


def _restore(out: Sequence[object], arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(o).astype(a.dtype, copy=False).reshape(a.shape) for o, a in zip(out, arrays, strict=True)]


def max_overwritten(variables: Sequence[Any]) -> list[int]:
    """The positions of the variables a framework overwrites with their gradient (Keras's
    ``overwrite_with_gradient``: float8 layers' scales and amax histories).

    [Note: gradients that are next values] After Keras's ``model.quantize("float8")`` the scale and
    amax-history variables' "gradients" are their next values (the history rolled with the batch's
    absolute maximum), which Keras assigns in place of an update. One process over the global batch
    takes the maximum over all its rows: over the ranks that is the maximum of their values, not the
    mean (averaged before 2026-12-07, under ``unison.keras``'s DistributedOptimizer and DataParallel:
    an amax history 0.33 off one process's at 2 ranks, the kernels 3.7e-3; found by an audit).
    """
    return [i for i, v in enumerate(variables) if getattr(v, "overwrite_with_gradient", False)]


def _with_maxed(arrays: list[np.ndarray], maxed: set[int],
                rest: Any) -> list[np.ndarray]:
    """``rest(others)`` for the arrays not in ``maxed``, and the maximum over the ranks for those in it."""
    picked = [i for i in range(len(arrays)) if i in maxed]
    others = [i for i in range(len(arrays)) if i not in maxed]
    mine = [arrays[i] for i in picked]
    handle = None
    if picked and runtime.size() > 1:  # (submitted first: it travels in the same cycle as the others)
        handle = frontend.grouped_allreduce_async(mine, op=Max, name=f"{GRADIENTS}.max")
    try:
        combined = rest([arrays[i] for i in others])
    except BaseException:
        if handle is not None:  # (left in flight, the next step's call would reuse its name on this rank alone)
            with contextlib.suppress(Exception):
                handle.wait(CHECK_DRAIN_S)
        raise
    maxima = mine if handle is None else _restore(handle.wait(), mine)
    out: list[np.ndarray] = [arrays[0]] * len(arrays)
    for i, value in zip(others, combined, strict=True):
        out[i] = value
    for i, value in zip(picked, maxima, strict=True):
        out[i] = value
    return out


def average_gradients(grads: Sequence[np.ndarray], rows: int | None = None, op: object = Average,
                      compression: type[Compressor] = Compression.none,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      maxed: Collection[int] = ()) -> list[np.ndarray]:
    """Combine one step's gradients over the ranks, in one fused group.

    Args:
        grads: this rank's gradients (any float dtype), in the same order on every rank.
        rows: this rank's rows in the step's batch (or the targets its loss counts, for a loss that
            averages over those: ``unison.keras`` passes them for an ``ignore_class``). When given (and
            ``op`` is Average) the result weighs each rank by them: the global batch's mean-loss gradient.
            None: the plain mean over ranks (Horovod's ``DistributedOptimizer``).
        op: ``Average`` or ``Sum``.
        compression: the wire format (``Compression.fp16`` halves the bytes).
        prescale_factor, postscale_factor: multiply before / after the reduction
            (Horovod's ``gradient_predivide_factor`` is made of these).
        maxed: the positions of "gradients" that are their variables' next values, taken as their maximum
            over the ranks, unscaled (:func:`max_overwritten`).

    Returns:
        The combined gradients, in the input's order and dtypes (at one rank, the inputs
        themselves when no factor applies).
    """
    rop = parse_op(op)
    arrays = _as_list(grads)
    if maxed:
        return _with_maxed(arrays, set(maxed), lambda rest: average_gradients(
            rest, rows, rop, compression, prescale_factor, postscale_factor))
    if not arrays:
        return []
    if runtime.size() == 1 and rop in (Average, Sum):
        scale = prescale_factor * postscale_factor
        return arrays if scale == 1.0 else [a * np.asarray(scale, dtype=a.dtype) for a in arrays]
    # (named: an unnamed group could pair with another rank's unnamed group of another kind, such as the
    # metrics' sums of a rank whose data ended a step early, a MismatchError where the ranks' steps differ)
    with caller_waits():  # this thread runs the cycle that carries both ([Note: a waiter runs the cycle])
        check = _rows_check(rows, rop, f"{GRADIENTS}.rows")
        handle = frontend.grouped_allreduce_async(arrays, op=rop, name=GRADIENTS, prescale_factor=prescale_factor,
                                                  postscale_factor=postscale_factor, compression=compression)
    try:
        out = handle.wait()
    except BaseException:
        if check is not None:  # (left in flight, a retry of this call would reuse its name on this rank alone)
            with contextlib.suppress(Exception):
                check.wait(CHECK_DRAIN_S)
        raise
    weight = None if check is None else _share(check, rows)
    if weight is not None:  # rows differ: the weighed sum instead ([Note: rows beside the gradients])
        out = frontend.grouped_allreduce([_weighed(a, weight) for a in arrays], op=Sum,
                                         name=f"{GRADIENTS}.weighed", prescale_factor=prescale_factor,
                                         postscale_factor=postscale_factor, compression=compression)
    return _restore(out, arrays)


class GradientStream:
    """:func:`average_gradients`, one gradient at a time: each starts reducing as soon as it exists.

    For backends that produce gradients one by one during backward (torch's
    post-accumulate hooks), so the exchange overlaps the rest of backward. The
    numbers are :func:`average_gradients`'s (each gradient starts as a plain average, and a
    step whose ranks' rows differ reduces them again, weighed: [Note: rows beside the
    gradients]). Gradients are named by ``key`` (the same on every rank), so the order
    backward produces them in may differ between ranks.

    Args:
        rows, op, compression, prescale_factor, postscale_factor: as for :func:`average_gradients`.
        prefix: engine name prefix of this stream's reductions (one stream in flight per prefix).
    """

    def __init__(self, rows: int | None, op: object = Average, compression: type[Compressor] = Compression.none,
                 prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                 prefix: str = "unison.gradients") -> None:
        self.op, self.pre, self.post = parse_op(op), prescale_factor, postscale_factor
        self.compression, self.prefix, self.rows = compression, prefix, rows
        self.pending: dict[int, tuple[Any, np.ndarray]] = {}
        # the weighting, decided at the first results(): each gradient starts as a plain average
        # ([Note: rows beside the gradients])
        self.check = _rows_check(rows, self.op, f"{prefix}.rows") if runtime.size() > 1 else None
        self.weight: float | None = None

    def submit(self, key: int, grad: np.ndarray) -> None:
        """Start reducing gradient ``key``; ``grad`` must stay unchanged until :meth:`results`."""
        if key in self.pending:
            raise RuntimeError(f"GradientStream: gradient {key} submitted twice in one step")
        array = np.require(np.asarray(grad), requirements="C")
        handle = frontend.allreduce_async(array, self.op, f"{self.prefix}.{key}", prescale_factor=self.pre,
                                          postscale_factor=self.post, compression=self.compression)
        self.pending[key] = (handle, array)

    def drain(self) -> None:
        """Wait for whatever was submitted and not collected (a step that ended early), dropping it."""
        leftovers, self.pending = self.pending, {}
        for handle, _ in leftovers.values():
            handle.wait()
        check, self.check = self.check, None
        if check is not None:
            check.wait()

    def results(self, keys: Sequence[int]) -> list[np.ndarray]:
        """The combined gradients of ``keys`` (each submitted), in that order."""
        missing = [k for k in keys if k not in self.pending]
        if missing:
            raise RuntimeError(f"GradientStream: gradients {missing} were never submitted this step")
        taken = [self.pending.pop(k) for k in keys]
        out = [handle.wait() for handle, _ in taken]
        if self.check is not None:
            check, self.check = self.check, None
            self.weight = _share(check, self.rows)
        if self.weight is not None:  # rows differ: the weighed sums instead
            handles = [frontend.allreduce_async(_weighed(array, self.weight), Sum, f"{self.prefix}.{k}.weighed",
                                                prescale_factor=self.pre, postscale_factor=self.post,
                                                compression=self.compression)
                       for k, (_, array) in zip(keys, taken, strict=True)]
            out = wait_all(handles)
        return _restore(out, [array for _, array in taken])


def sum_states(states: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Sum each array over the ranks (metric totals and counts), keeping shapes and dtypes."""
    arrays = _as_list(states)
    if not arrays:
        return []
    return _restore(frontend.grouped_allreduce(arrays, op=Sum), arrays)


def broadcast_arrays(arrays: Sequence[np.ndarray], root_rank: int = 0,
                     process_set: Any = None, what: str = "broadcast_arrays") -> list[np.ndarray]:
    """Every rank (of ``process_set``) gets ``root_rank``'s arrays (all submitted at once, then waited for).

    ``root_rank`` is a rank of the job that belongs to ``process_set`` (Horovod's rule).

    Raises:
        ValueError: ``root_rank`` is not in ``process_set``.
    """
    root = root_rank
    ranks = getattr(process_set, "ranks", None)
    if ranks is not None:
        if root_rank not in ranks:
            raise ValueError(f"root_rank={root_rank} is not a member of {process_set!r}: as in Horovod, root_rank "
                             "is a rank of the job (unison.rank()) that belongs to the process set")
        root = list(ranks).index(root_rank)
    arrays = _as_list(arrays)
    base = frontend._auto_name("broadcast_arrays", None, process_set)
    # one broadcast per array: agree on them first (an array more on one rank paired with the others'
    # next broadcast, another array's value there, then a hang: before 2026-12-05)
    agree_on_names(what, [f"{i}: {np.asarray(a).dtype}{np.shape(a)}" for i, a in enumerate(arrays)],
                   f"{base}.agree", process_set)
    # a broadcast copies bytes: unsigned 32/64-bit integers (JAX's Keras seed states, which the collectives do
    # not take: broadcast_variables(model.variables) raised for any model with Dropout, before 2026-12-07)
    # travel as the signed integers of their width
    handles = [frontend.broadcast_async(_signed(a), root, f"{base}.{i}", process_set)
               for i, a in enumerate(arrays)]  # (numpy arrays already: _as_list)
    return [np.asarray(r).view(a.dtype).reshape(a.shape) for r, a in zip(wait_all(handles), arrays, strict=True)]


def _signed(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes as signed integers of its width where it holds unsigned 32/64-bit ones, else ``a``."""
    if a.dtype in (np.uint32, np.uint64):
        return np.ascontiguousarray(a).view(np.int32 if a.dtype == np.uint32 else np.int64)
    return a


def gather_rows(local: np.ndarray, plan: BatchPlan, rank: int) -> np.ndarray:
    """The global rows, in the data's order, from each rank's rows (``local``: this rank's, in step order).

    Args:
        local: this rank's outputs for its rows of every global batch, concatenated.
        plan: the split the rows were taken by.
        rank: this rank.

    Raises:
        ValueError: ``local`` does not have the rows ``plan`` gives this rank.
    """
    counts = [sum(b - a for a, b in (plan.rank_rows(s, r) for s in range(plan.steps))) for r in range(plan.size)]
    if local.shape[0] != counts[rank]:
        raise ValueError(f"gather_rows: this rank (rank {rank}) has {local.shape[0]} rows of output but the split "
                         f"gives it {counts[rank]} (samples={plan.samples}, batch={plan.batch}, size={plan.size})")
    everyone = np.asarray(frontend.allgather(np.ascontiguousarray(local)))
    cursor = np.cumsum([0] + counts[:-1])  # where each rank's rows start in the gathered array
    pieces: list[np.ndarray] = []
    for step in range(plan.steps):
        for r in range(plan.size):
            a, b = plan.rank_rows(step, r)
            pieces.append(everyone[cursor[r]:cursor[r] + (b - a)])
            cursor[r] += b - a
    return np.concatenate(pieces) if pieces else everyone[:0]
