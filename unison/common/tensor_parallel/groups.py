"""Where this rank sits in a tensor group (a registered process set), and the group's agreement on how a
layer was built; both backends' layers ask."""

from __future__ import annotations

import functools
import hashlib
import pickle
import sys
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from unison.common import runtime
from unison.common.agreement import ranks_text
from unison.common.engine import frontend
from unison.common.engine.objects import agree_on_values, allgather_object
from unison.common.engine.process_sets import ProcessSet, set_rank, set_size
from unison.common.exceptions import MismatchError

__all__ = ["group_position", "agree_on_layer", "agree_on_seed", "agree_on_source", "agree_on_input", "describe",
           "INPUT_SAMPLES", "input_sample_positions", "input_sample", "start_input_agreement", "judge_inputs",
           "CHECKSUM_PRIME", "targets_checksum", "targets_mismatch", "call_site"]

#: how many evenly spaced elements of a replicated input the group compares (see :func:`agree_on_input`)
INPUT_SAMPLES = 256
#: a float sample agrees when every element is within this fraction of the sample's largest magnitude
INPUT_RTOL = 1e-3


def group_position(process_set: ProcessSet, owner: str) -> tuple[int, int]:
    """``(tp, shard index)`` of this rank in the tensor group ``process_set``.

    Raises:
        ValueError: this rank is not a member of ``process_set``.
    """
    tp, index = set_size(process_set), set_rank(process_set)
    if index < 0:
        raise ValueError(f"{owner}: this rank ({runtime.rank()}) is not in the tensor group {process_set!r}; "
                         "build tensor-parallel layers only on the ranks of their group")
    return tp, index


def describe(value: Any) -> str:
    """A text for ``value`` that is the same on every rank when the ranks passed the same thing: a function by
    its module and name (its ``repr`` holds an address), a partial by its function and arguments, a numpy
    scalar as the Python number it holds, an object with a configuration (a Keras layer or activation) by its
    class and configuration without its name (a per-process counter), other objects by their ``repr`` when it
    holds no address, else by their class."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, functools.partial):
        return f"partial({describe(value.func)}, {value.args!r}, {sorted(value.keywords.items())!r})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if callable(getattr(value, "get_config", None)):
        try:
            config = {k: v for k, v in value.get_config().items() if k != "name"}
        except Exception:  # noqa: BLE001 - no usable configuration: described as other objects are
            pass
        else:
            return f"{kind}({sorted((k, describe(v)) for k, v in config.items())})"
    text = repr(value)
    if " at 0x" in text:
        return f"a {kind}"
    return text


def agree_on_layer(owner: str, process_set: ProcessSet, **fields: Any) -> None:
    """Return when every rank of the tensor group built ``owner`` with the same ``fields`` (sizes, options,
    dtype); else raise :class:`~unison.common.exceptions.MismatchError` on every rank of the group, naming the
    fields that differ and where.

    [Note: a layer built alike on every rank] Each rank of a tensor group holds 1/tp of ONE layer, so every
    rank must build it with the same arguments. Before 2026-12-05 nothing checked it: a vocabulary, a width or
    a head count that differed on one rank ran and gave wrong values silently (each rank's shard is cut from
    its own sizes), and ``gather_output`` or ``sequence_parallel`` on one rank only left the others waiting in
    a collective it never made. The check runs when the layer is built, which is eager in both frameworks (a
    first forward may be traced or compiled); building one is thus collective over its group, as its forward
    is. One 16-byte all-gather per layer or block (a block's layers check theirs too); none for a group of one.
    """
    _group_agrees(owner, process_set, lambda: {"layer": owner, **{k: describe(v) for k, v in fields.items()}},
                  "Every rank of a tensor group must build each parallel layer with the same arguments (each "
                  "holds one shard of one layer)")


def _group_agrees(owner: str, process_set: ProcessSet, values: Callable[[], dict[str, str]], fix: str) -> None:
    """``agree_on_values`` of ``values()`` over the tensor group, its message ending with ``fix``; nothing (not
    even ``values()``) for a group of one."""
    if set_size(process_set) > 1:
        agree_on_values(owner, values(), process_set=process_set, fix=fix)


def agree_on_seed(owner: str, process_set: ProcessSet, seed: int) -> None:
    """Return when every rank of the tensor group holds the same dropout ``seed``; else raise
    :class:`~unison.common.exceptions.MismatchError` on every rank of the group (one 16-byte all-gather;
    none for a group of one). The masks on replicated activations are drawn from it, so a seed that differs
    between the ranks (``seed + rank``) lets the copies drift apart with no error."""
    _group_agrees(owner, process_set, lambda: {"seed": str(int(seed))},
                  "Every rank of a tensor group must use one seed (seeds may differ between groups, e.g. by "
                  "pipeline stage or data-parallel rank, never within one)")


def _source_digest(items: Iterable[Any]) -> str:
    """A digest (hex) of ``items``: texts and arrays, each with its shape and dtype. SHA-1 (not for security:
    to compare copies) runs at twice BLAKE2's speed here, 0.8 against 1.6 ms per MiB."""
    digest = hashlib.sha1(usedforsecurity=False)
    for item in items:
        if isinstance(item, str):
            digest.update(b"t" + item.encode() + b"\0")
            continue
        array = np.ascontiguousarray(item)
        digest.update(f"a{array.shape}{array.dtype.str}\0".encode())
        digest.update(array.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


def agree_on_source(owner: str, process_set: ProcessSet, check: Callable[[], Iterable[Any]]) -> None:
    """Return when every rank of the tensor group holds the same usable unsplit source for ``owner`` (a
    ``from_*`` constructor or ``parallelize``); else raise on every rank of the group.

    ``check()`` runs on this rank: it raises ``TypeError``/``ValueError`` for a source that cannot be split,
    and otherwise returns what the ranks must hold alike: numpy arrays (the source's weights) and texts (its
    configuration, a plan's placements).

    [Note: one unsplit source on every rank] Each rank copies its shard out of the unsplit module IT holds,
    so the shards make one layer only when every rank holds the same one (one seed, or one checkpoint). Before
    2026-12-05 nothing compared them: a model built without a common seed was split into shards of different
    matrices, and the replicated parts (a row layer's bias, the norms, every layer ``parallelize`` leaves
    whole) differed between the ranks of the group, which then trained on outputs that differ per rank, with
    no error. And a source refused on one rank only (a hook, a parametrization, another configuration)
    raised there while the others went on into the layer's collectives and waited for ever. One pass over the
    source's bytes (about 1 ms per MiB) and one 16-byte all-gather; the same refusal on every rank is raised
    as is, different refusals or different weights as a ``MismatchError`` naming the ranks.

    Raises:
        TypeError, ValueError: ``check``'s refusal, when every rank of the group gave the same one.
        MismatchError: the ranks' sources or refusals differ.
    """
    problem: TypeError | ValueError | None = None
    try:
        items = check()  # (its refusal counts in a group of one too; the digest only where there is a peer)
        digest = _source_digest(items) if set_size(process_set) > 1 else ""
    except (TypeError, ValueError) as exc:
        problem, digest = exc, "(refused)"
    refusal = "none" if problem is None else f"{type(problem).__name__}: {problem}"
    try:
        _group_agrees(owner, process_set, lambda: {"refusal": refusal, "source weights (digest)": digest[:12]},
                      "Every rank of a tensor group must split the same unsplit model: build it from one seed on "
                      "every rank (torch.manual_seed / keras.utils.set_random_seed before building it), load the "
                      "same checkpoint, or broadcast rank 0's weights over the group before splitting it")
    except MismatchError as exc:
        if problem is not None:
            raise exc from problem
        raise
    if problem is not None:
        raise problem


def input_sample_positions(count: int) -> np.ndarray:
    """The flat positions :func:`agree_on_input` compares in an input of ``count`` elements: at most
    :data:`INPUT_SAMPLES`, evenly spaced, first and last included."""
    if count <= INPUT_SAMPLES:
        return np.arange(count, dtype=np.int64)
    return np.linspace(0, count - 1, INPUT_SAMPLES).round().astype(np.int64)


def agree_on_input(owner: str, process_set: ProcessSet, shape: tuple[int, ...], dtype: str,
                   sample: np.ndarray, name: str | None = None) -> None:
    """Return when every rank of the tensor group was given the same input (by shape, dtype and the values at
    :func:`input_sample_positions`); else raise :class:`MismatchError` on every rank of the group. Nothing for
    a group of one.

    [Note: one input per tensor group] The ranks of a tensor group compute ONE layer between them: a column
    layer multiplies the same input by each rank's columns, an embedding looks up the same ids in each rank's
    rows, a cross-entropy reads the same targets. Given different inputs (a data loader sharded by the job's
    rank where it should be by the data-parallel rank, the commonest mistake in a data x tensor grid), each
    rank computes its piece of a different layer's output and the sums and gathers mix them: the model trains
    on garbage with no error. The parallel layers compare their replicated input at their first call: the
    values at up to 256 evenly spaced positions, integers exactly, floats within 1e-3 of the sample's largest
    magnitude, or four steps of a half precision's spacing (replicated activations computed on each rank may
    differ in their last bits; another batch differs everywhere). One all-gather of a few KiB per layer,
    once. A sample can miss a difference that touches none of its positions; the first call is the one
    checked (a mistake in the data differs from the first batch on).
    """
    if set_size(process_set) <= 1:
        return
    name = name or frontend._auto_name("agree_on_input", None, process_set)
    everyone = allgather_object((tuple(int(d) for d in shape), str(dtype), np.asarray(sample)), name, process_set)
    judge_inputs(owner, process_set, everyone)


def input_sample(values: np.ndarray) -> np.ndarray:
    """The values :func:`agree_on_input` compares of a whole input on the host: the elements at
    :func:`input_sample_positions`, as float64, complex128 or int64 (the same as the PyTorch backend's
    ``input_sample`` reads on the input's own device)."""
    flat = np.asarray(values).reshape(-1)
    picked = flat[input_sample_positions(flat.size)]
    kind = picked.dtype.kind
    return picked.astype(np.complex128 if kind == "c" else np.float64 if kind not in "biu" else np.int64)


def start_input_agreement(owner: str, process_set: ProcessSet, shape: tuple[int, ...], dtype: str,
                          sample: np.ndarray, name: str) -> tuple[Any, Callable[[Any], None]]:
    """:func:`agree_on_input` in two halves, for callers that must not block while submitting (a TensorFlow
    graph: ``host_ops`` [Note: collects wait for every submit they can]): the engine's handle of one
    all-gather, and the function that judges its result (raising :class:`MismatchError` as
    :func:`agree_on_input` does). Each rank sends one record, an 8-byte length then the pickled
    ``(shape, dtype, sample)``, so the records of every rank can be read back from the concatenation."""
    body = pickle.dumps((tuple(int(d) for d in shape), str(dtype), np.asarray(sample)))
    record = np.frombuffer(len(body).to_bytes(8, "little") + body, dtype=np.uint8)
    handle = frontend.allgather_async(record, name, process_set)

    def finish(data: Any) -> None:
        raw, everyone, at = np.asarray(data, dtype=np.uint8).tobytes(), [], 0
        while at < len(raw):
            size = int.from_bytes(raw[at:at + 8], "little")
            everyone.append(pickle.loads(raw[at + 8:at + 8 + size]))
            at += 8 + size
        judge_inputs(owner, process_set, everyone)

    return handle, finish


def judge_inputs(owner: str, process_set: ProcessSet, everyone: list) -> None:
    """Raise :class:`MismatchError` unless every rank's ``(shape, dtype, sample)`` matches the group's first."""
    ranks = list(range(len(everyone))) if process_set.ranks is None else list(process_set.ranks)
    ref_shape, ref_dtype, ref = everyone[0]
    problems = []
    for r, (shp, dt, smp) in zip(ranks[1:], everyone[1:], strict=True):
        if (shp, dt) != (ref_shape, ref_dtype):
            problems.append(f"rank {r}'s is {list(shp)} {dt}, rank {ranks[0]}'s {list(ref_shape)} {ref_dtype}")
            continue
        differ = _differ(ref, smp, _tolerance(ref_dtype))
        if differ:
            problems.append(f"rank {r}'s differs from rank {ranks[0]}'s {differ}")
    if problems:
        raise MismatchError(
            f"{owner}: the tensor group ({ranks_text(ranks)}) was given different inputs ("
            + "; ".join(problems) + "). Every rank of a tensor group must see the same batch: shard the data by "
            "the data-parallel rank (Grid.coords(rank).dp, over Grid.dp ranks), not by the job's rank, and keep "
            "anything random before the layer (dropout, augmentation) on one seed across the group")


def call_site(depth: int, skip: tuple[str, ...] = ()) -> tuple[str, int, str, int]:
    """Where the code ``depth`` frames above this function's caller is (its file, function and instruction),
    passing over frames of modules whose names start with one of ``skip``: TensorFlow's AutoGraph calls a
    traced function's callees from its own frames, which every traced call site shares. The same place gives
    the same key in every run of one script; a function that checks its input "once per call site" (as
    ``scatter_to_sequence``) keys its state on it."""
    frame = sys._getframe(depth + 1)  # (as warnings.warn(stacklevel=) finds its caller)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(skip):
        frame = frame.f_back
    code = frame.f_code
    return code.co_filename, code.co_firstlineno, code.co_name, frame.f_lasti


#: the spacing of 1.0 in the half precisions (the input's dtype by name: the samples travel as float64)
_EPS = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}


def _tolerance(dtype: str) -> float:
    """:data:`INPUT_RTOL`, or four steps of a half precision's spacing where that is larger: one bfloat16 step
    is 1/128 of its value, so activations rounded apart in their last bit differed by more than 1e-3 of the
    largest (found by a review, 2026-12-06)."""
    return max(INPUT_RTOL, 4 * _EPS.get(dtype, 0.0))


def _differ(ref: np.ndarray, other: np.ndarray, rtol: float = INPUT_RTOL) -> str:
    """How ``other`` differs from ``ref`` (samples at the same positions), or "" when they agree."""
    if ref.shape != other.shape:
        return f"in its sample's size ({other.size} against {ref.size})"
    if ref.dtype.kind in "fc" or other.dtype.kind in "fc":
        a, b = ref.astype(np.complex128 if ref.dtype.kind == "c" else np.float64), other.astype(
            np.complex128 if other.dtype.kind == "c" else np.float64)
        finite = np.isfinite(a) & np.isfinite(b)
        scale = max(float(np.abs(a[finite]).max(initial=0.0)), float(np.abs(b[finite]).max(initial=0.0)))
        close = np.abs(a - b) <= rtol * scale
        same_special = ~finite & ((np.isnan(a) & np.isnan(b)) | (a == b))
        bad = ~(np.where(finite, close, same_special))
        if not bad.any():
            return ""
        worst = float(np.abs(a - b)[bad & finite].max(initial=0.0))
        return (f"at {int(bad.sum())} of {a.size} sampled elements (largest difference {worst:.3g}, "
                f"largest magnitude {scale:.3g})")
    bad = ref != other
    if not bad.any():
        return ""
    i = int(np.flatnonzero(bad)[0])
    return (f"at {int(bad.sum())} of {ref.size} sampled elements (the first: {other.flat[i]!r} against "
            f"{ref.flat[i]!r})")


#: the targets' checksum is taken modulo this prime (2**31 - 1): each term ``(i + 1) * (t + 1)`` of two residues
#: is below 2**62, and a sum of fewer than 2**32 reduced terms stays below 2**63, so int64 never overflows
CHECKSUM_PRIME = 2 ** 31 - 1


def targets_checksum(targets: np.ndarray) -> int:
    """The checksum ``vocab_parallel_cross_entropy`` compares over the tensor group (both backends compute it on
    the targets' device; this is the reference): ``sum_i ((i + 1) * (t_i mod p + 1)) mod p`` over the flat
    targets, ``p`` = :data:`CHECKSUM_PRIME`.

    [Note: one set of targets per tensor group] Every rank of a tensor group computes the loss of ONE set of
    positions: the maximum, the sum of exponentials and the target's logit are summed over the group position
    by position. Given other targets on one rank (a data loader sharded by the job's rank), each rank picked
    the logit of its own target and the sums mixed them: a wrong loss and gradient, with no error (found by an
    audit, 2026-12-07). The number of targets and this checksum ride, with their negatives, in the all-reduce
    (max) that already checks the pieces' widths, so a difference costs no extra collective: the maximum and
    minus the minimum differ exactly when some rank's value differs. Position-weighted, so a permutation of
    the same targets differs too; two different target sets share a checksum with probability about 1 / p.
    """
    flat = np.asarray(targets, dtype=np.int64).reshape(-1)
    weights = np.arange(1, flat.size + 1, dtype=np.int64) % CHECKSUM_PRIME
    terms = weights * (flat % CHECKSUM_PRIME + 1) % CHECKSUM_PRIME
    return int(terms.sum() % CHECKSUM_PRIME)


def targets_mismatch(counts: tuple[int, int] | None = None, count: int = 0, checksum: int = 0) -> MismatchError:
    """The error for a tensor group whose ranks hold different targets ([Note: one set of targets per tensor
    group]): ``counts`` is the group's (fewest, most) targets, ``count`` and ``checksum`` this rank's (None:
    not known, as when a graph is traced)."""
    what = ""
    if counts is not None:
        least, most = counts
        what = (f" ({least} to {most} targets; this rank {count})" if least != most else
                f" ({count} targets each, of different values; this rank's checksum {checksum})")
    return MismatchError(
        f"vocab_parallel_cross_entropy: the ranks of the tensor group were given different targets{what}. "
        "Every rank of a tensor group must compute the loss of the same batch: shard the data by the "
        "data-parallel rank (Grid.coords(rank).dp, over Grid.dp ranks), not by the job's rank")
