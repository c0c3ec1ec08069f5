"""Which slice of which parameter each rank owns under ZeRO: the plan both backends share.

[Note: ZeRO buckets]
Parameters are laid end to end in *buckets* (one dtype and one parameter group each, filled in
reverse registration order, the order backward produces gradients, up to ``bucket_bytes``; a
parameter never straddles two buckets). Each bucket is padded to a multiple of the rank count N
and cut into N equal *segments*: rank r owns segment r of every bucket::

    bucket 0 (fp32, group 0):  | w3 ........ | w2 .... | b2 |pad|
                               |  rank 0   |  rank 1   |  rank 2   |
    bucket 1 (fp32, group 0):  | w1 ............. | b1 |pad......|
                               |  rank 0   |  rank 1   |  rank 2   |

Why per bucket and not one global cut: stage 2 reduce-scatters a bucket the moment backward has
filled it, and a reduce-scatter hands rank r the r-th equal slice *of that bucket*. Cutting every
bucket the same way makes that slice exactly what rank r owns, so no gradient byte moves twice.

A rank's *shard* for one (group, dtype) is its segments of that key's buckets, concatenated in
bucket order: one flat buffer the optimizer steps (and whose state it keeps). Elementwise
optimizers (SGD, Adam, AdamW, RMSprop, ...) give the same numbers on a flat slice as on the whole
tensors, which is what lets the shard be any cut of the parameters.

Nothing here touches a framework or MPI; :meth:`ShardPlan.signature` is what ranks compare to
prove they built the same plan.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ParamSpec", "Piece", "Bucket", "ShardPlan", "DEFAULT_BUCKET_BYTES", "check_stage"]

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024  # a quarter of the engine's default fusion threshold (128 MiB)
STAGES = (0, 1, 2, 3)


def check_stage(zero_stage: object, allowed: Sequence[int] = STAGES) -> int:
    """Return ``zero_stage`` as an int, or raise naming the value and the choices."""
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, (int, np.integer)) \
            or int(zero_stage) not in allowed:
        raise ValueError(f"zero_stage={zero_stage!r} is not one of {list(allowed)}: 0 keeps full copies "
                         "(plain data parallelism), 1 shards the optimizer state, 2 also the gradients, "
                         "3 also the weights")
    return int(zero_stage)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the plan sees it.

    Attributes:
        name: unique across the model (ranks match by it).
        shape: the parameter's shape.
        dtype: the parameter's dtype name, e.g. ``"float32"`` or ``"bfloat16"``.
        group: the optimizer parameter group it belongs to.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    group: int = 0

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Piece:
    """A run of one parameter's flattened elements.

    Attributes:
        name: the parameter.
        param_offset: where the run starts in the flattened parameter.
        offset: where it starts in its container (a bucket, or a rank's segment of one).
        length: its number of elements.
    """

    name: str
    param_offset: int
    offset: int
    length: int


@dataclass(frozen=True)
class Bucket:
    """Consecutive parameters of one group and dtype, padded to a multiple of the rank count.

    Attributes:
        index: position among all buckets (the order backward fills them).
        group: the parameter group. dtype: the parameters' dtype name.
        pieces: whole parameters, in bucket order (``param_offset`` 0).
        numel: elements before padding. padded: a multiple of ``world``.
        world: rank count. shard_offset: where this bucket's segment starts in the
            owning rank's shard of ``(group, dtype)`` (the same on every rank).
    """

    index: int
    group: int
    dtype: str
    pieces: tuple[Piece, ...]
    numel: int
    padded: int
    world: int
    shard_offset: int

    @property
    def segment_size(self) -> int:
        return self.padded // self.world

    def segment(self, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s ``[start, end)`` within the bucket."""
        s = self.segment_size
        return rank * s, (rank + 1) * s

    def owned(self, rank: int) -> list[Piece]:
        """The parts of parameters in rank ``rank``'s segment; ``offset`` is within the segment."""
        lo, hi = self.segment(rank)
        out = []
        for p in self.pieces:
            a, b = max(lo, p.offset), min(hi, p.offset + p.length)
            if a < b:
                out.append(Piece(p.name, a - p.offset, a - lo, b - a))
        return out


@dataclass
class ShardPlan:
    """Buckets, segments and shards for ``world`` ranks; build it with :meth:`build`.

    Attributes:
        params: the parameters in registration order. world: rank count.
        buckets: in the order backward fills them. bucket_bytes: the cap they were built with.
    """

    params: tuple[ParamSpec, ...]
    world: int
    buckets: tuple[Bucket, ...]
    bucket_bytes: int
    _where: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, params: Sequence[ParamSpec], world: int,
              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ShardPlan:
        """Lay ``params`` into buckets for ``world`` ranks (see [Note: ZeRO buckets]).

        Raises:
            ValueError: ``world`` < 1, ``bucket_bytes`` < 1, duplicate names, or a parameter
                with a negative dimension.
        """
        if not isinstance(world, (int, np.integer)) or world < 1:
            raise ValueError(f"world={world!r} must be a positive number of ranks")
        if not isinstance(bucket_bytes, (int, np.integer)) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive number of bytes")
        _check_params(params)
        buckets: list[Bucket] = []
        shard_used: dict[tuple[int, str], int] = {}
        open_: dict[tuple[int, str], list[ParamSpec]] = {}

        def close(key: tuple[int, str]) -> None:
            members = open_.pop(key, [])
            if not members:
                return
            pieces, off = [], 0
            for p in members:
                pieces.append(Piece(p.name, 0, off, p.numel))
                off += p.numel
            padded = max(world, -(-off // world) * world)
            used = shard_used.get(key, 0)
            buckets.append(Bucket(len(buckets), key[0], key[1], tuple(pieces), off, padded, int(world), used))
            shard_used[key] = used + padded // world

        for p in reversed(params):
            key = (p.group, p.dtype)
            members = open_.setdefault(key, [])
            size = sum(m.numel for m in members) * _itemsize(p.dtype)
            if members and size + p.numel * _itemsize(p.dtype) > bucket_bytes:
                close(key)
                members = open_.setdefault(key, [])
            members.append(p)
        for key in list(open_):
            close(key)
        plan = cls(tuple(params), int(world), tuple(buckets), int(bucket_bytes))
        for b in buckets:
            for i, piece in enumerate(b.pieces):
                plan._where[piece.name] = (b.index, i)
        return plan

    # ------------------------------------------------------------- queries
    def bucket_of(self, name: str) -> Bucket:
        """The bucket holding parameter ``name``."""
        if name not in self._where:
            raise KeyError(f"parameter {name!r} is not in this sharding plan")
        return self.buckets[self._where[name][0]]

    def keys(self) -> list[tuple[int, str]]:
        """The (group, dtype) pairs, in first-bucket order: one shard buffer each."""
        seen: dict[tuple[int, str], None] = {}
        for b in self.buckets:
            seen.setdefault((b.group, b.dtype), None)
        return list(seen)

    def shard_numel(self, key: tuple[int, str]) -> int:
        """Elements of every rank's shard buffer for ``key`` (padding included)."""
        return sum(b.segment_size for b in self.buckets if (b.group, b.dtype) == key)

    def owned(self, rank: int) -> dict[str, list[Piece]]:
        """Per parameter, the runs rank ``rank`` owns; ``offset`` is within its shard buffer."""
        self._check_rank(rank)
        out: dict[str, list[Piece]] = {}
        for b in self.buckets:
            for p in b.owned(rank):
                out.setdefault(p.name, []).append(
                    Piece(p.name, p.param_offset, b.shard_offset + p.offset, p.length))
        return out

    def owned_numel(self, rank: int) -> int:
        """Parameter elements (no padding) rank ``rank`` owns."""
        return sum(p.length for runs in self.owned(rank).values() for p in runs)

    def signature(self) -> str:
        """A digest of everything that decides the layout; equal on ranks that built the same plan."""
        desc = [self.world, self.bucket_bytes, [(p.name, list(p.shape), p.dtype, p.group) for p in self.params]]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def layout_signature(self) -> str:
        """:meth:`signature` without the parameters' names: equal on ranks whose plans differ in names only."""
        desc = [self.world, self.bucket_bytes, [(list(p.shape), p.dtype, p.group) for p in self.params]]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line per bucket: index, group, dtype, parameters, elements and padding."""
        lines = [f"ShardPlan: {len(self.params)} parameters, {len(self.buckets)} buckets, {self.world} ranks"]
        for b in self.buckets:
            names = ", ".join(p.name for p in b.pieces)
            lines.append(f"  bucket {b.index} group {b.group} {b.dtype}: {b.numel} elements "
                         f"(+{b.padded - b.numel} padding), segment {b.segment_size}: {names}")
        return "\n".join(lines)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is outside this plan's {self.world} ranks")


def _itemsize(dtype: str) -> int:
    if dtype == "bfloat16":
        return 2
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 4


def _check_params(params: Sequence[ParamSpec]) -> None:
    names = [p.name for p in params]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"parameter names must be unique for a sharding plan; {dups} appear more than once. "
                         "Name parameters as model.named_parameters() does")
    bad = [p.name for p in params if any(int(d) < 0 for d in p.shape)]
    if bad:
        raise ValueError(f"parameters {bad} have a negative dimension")
