"""One ZeRO stage-3 *unit*: a module's parameters kept as this rank's flat shard, gathered on demand.

See :mod:`unison.torch_backend.zero3` for the whole design; this file holds the buffers and the
collectives of one unit, nothing about hooks.

[Note: ZeRO-3 unit buffers]
A unit's parameters are laid out by a :class:`~unison.common.zero.ShardPlan` of their own (one or
more buckets per dtype, each padded to a multiple of N). For each dtype the unit keeps::

    shard  nn.Parameter, plan.shard_numel elements   always allocated: the optimizer steps it
    full   plain tensor, sum of the padded buckets    storage resized to 0 bytes while not in use
    views  full[base + piece.offset : ...].view(shape) one per parameter, set as the module's attribute

[Note: ZeRO-3 master weights]
For trainable float16/bfloat16 parameters (``masters=True``, the default) the shard is float32:
the fp32 master copy of this rank's segment, which the optimizer steps and keeps state for,
while ``full`` and the views stay in the parameter's dtype. A gather rounds the segment to the
half dtype before the all-gather (half the bytes on the wire, and every rank rounds its own
segment the same way); a reduce-scatter runs in bfloat16 for bfloat16 weights and in float32 for
float16 ones (a float16 sum overflows: two gradients of 40000 gave inf before 2026-12-05; dividing
each by N first would lose a small gradient's bits instead), and its result is added into the
float32 ``shard.grad``. So an update
smaller than the half dtype's resolution is kept in the master and reaches the gathered weights
once the sum of such updates is large enough.

The views are leaf tensors that require grad and share ``full``'s storage, so gathering is
"resize the storage back and copy the all-gathered buckets in" and freeing is
``full.untyped_storage().resize_(0)``: the views never change identity, and autograd's saved
references to them become valid again when the storage is refilled. While the unit is freed the
module's attributes (``fc.weight``) hold empty placeholders instead of the views: an op on a view
whose storage is gone can crash the process (CPU kernels do not all check), one on an empty tensor
raises a shape error. Writes go
through ``full.data``, whose version counter is not the views' (a refill is not an in-place change
autograd should complain about: the values are the same ones that were saved). ``full`` never gets
a numpy view: torch marks a storage shared with numpy as not resizable.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from unison.common.engine import frontend
from unison.common.engine.process_sets import ProcessSet
from unison.common.ops import Average
from unison.common.zero.plan import Bucket, ParamSpec, ShardPlan
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__: list[str] = []

log = logging.getLogger(__name__)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the plan's dtype names)."""
    return str(dtype).replace("torch.", "")


def param_specs(names: list[str], params: list[torch.nn.Parameter]) -> list[ParamSpec]:
    """The plan's view of a unit's parameters: trainable ones in group 0, frozen ones in group 1
    (a separate shard that does not require grad, so weight decay never touches it)."""
    return [ParamSpec(n, tuple(p.shape), dtype_name(p.dtype), 0 if p.requires_grad else 1)
            for n, p in zip(names, params, strict=True)]


def flat_key(key: tuple[int, str]) -> str:
    """A plan key ``(group, dtype)`` as the shard's name suffix: ``float32`` or ``float32_frozen``."""
    return key[1] if key[0] == 0 else f"{key[1]}_frozen"


@dataclass
class ParamRef:
    """Where a unit's parameter lives in the model: ``owner.<attr>`` is parameter ``index``."""

    owner: torch.nn.Module
    attr: str
    index: int


@dataclass
class Flat:
    """One dtype of one unit: shard, full buffer and its buckets (see [Note: ZeRO-3 unit buffers])."""

    dtype: torch.dtype  # the parameters' (and ``full``'s) dtype; ``shard.dtype`` differs for masters
    buckets: list[tuple[Bucket, int]]  # (bucket, its base offset in ``full``)
    shard: torch.nn.Parameter
    full: torch.Tensor
    full_bytes: int
    master: bool = False  # ``shard`` is the float32 master of half-precision parameters

    def segment(self, b: Bucket) -> torch.Tensor:
        """This rank's segment of bucket ``b`` in the parameters' dtype (rounded from the master)."""
        seg = self.shard.detach()[b.shard_offset:b.shard_offset + b.segment_size]
        return seg.to(self.dtype) if self.master else seg

    def is_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        if not self.is_allocated():
            self.full.untyped_storage().resize_(self.full_bytes)

    def release(self) -> None:
        self.full.untyped_storage().resize_(0)


@dataclass
class Unit:
    """A module whose parameters are sharded together, and its per-step state.

    Attributes:
        name: the module's path in the model (``""`` for the model itself).
        module: the module whose forward gathers and frees the unit.
        names: the parameters' qualified names (index = parameter index).
        refs: every ``owner.attr`` referring to one of them (tied references inside a unit).
        plan: the unit's own sharding plan. flats: one per dtype (and frozen-ness), in plan order.
        flat_of: the ``flats`` key of each parameter.
        views: the full-size parameter views, by parameter index.
        tag: the prefix of this unit's collective names (equal on every rank).
    """

    name: str
    module: torch.nn.Module
    names: list[str]
    refs: list[ParamRef]
    plan: ShardPlan
    flats: dict[str, Flat]
    flat_of: list[str]
    views: list[torch.Tensor]
    tag: str
    process_set: ProcessSet | None
    rank: int
    gathers: list[tuple[Flat, Bucket, int, Any]] = field(default_factory=list)
    reduces: list[tuple[Flat, Bucket, Any]] = field(default_factory=list)
    active: int = 0  # forward calls of the module now running
    grads_seen: int = 0  # views whose gradient this backward pass has produced
    needs_reduce: bool = False  # ran forward with grad enabled since its last reduce-scatter
    index: dict[str, int] = field(default_factory=dict)  # parameter name -> index
    owned: dict[str, list[Any]] = field(default_factory=dict)  # plan.owned(rank), cached
    trainable: int = 0  # views that require grad
    placeholders: list[torch.Tensor] = field(default_factory=list)  # what the attributes hold while freed

    def __post_init__(self) -> None:
        self.placeholders = [torch.empty(0, dtype=v.dtype) for v in self.views]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.owned = self.plan.owned(self.rank)
        self.trainable = sum(1 for v in self.views if v.requires_grad)

    def is_gathered(self) -> bool:
        return all(f.is_allocated() for f in self.flats.values()) and not self.gathers

    def full_bytes(self) -> int:
        """Bytes the gathered weights take now (0 when freed)."""
        return sum(f.full.untyped_storage().nbytes() for f in self.flats.values())

    # ------------------------------------------------------------- gather
    def start_gather(self) -> None:
        """Submit the all-gathers of every bucket (no-op when gathered or in flight)."""
        if self.gathers or self.is_gathered():
            return
        for key, flat in self.flats.items():
            for b, base in flat.buckets:
                seg = flat.segment(b)  # kept referenced (in ``gathers``) until the gather lands
                h = frontend.allgather_async(to_numpy(seg), f"{self.tag}.{key}.b{b.index}.gather",
                                             self.process_set)
                self.gathers.append((flat, b, base, (h, seg)))

    def finish_gather(self) -> None:
        """Wait for the gathers and write them into the (re-allocated) full buffers."""
        self.start_gather()
        pending, self.gathers = self.gathers, []
        for flat, b, base, (h, _) in pending:
            arr = frontend.synchronize(h)
            flat.allocate()
            # .data: a refill must not bump the version counter autograd checks (see the Note);
            # no numpy view of ``full``: torch would then refuse to resize its storage
            flat.full.data[base:base + b.padded].copy_(from_numpy(arr).reshape(-1))
        self._point_attributes(self.views)

    def free(self) -> None:
        """Drop the full weights (waiting for a gather still in flight first)."""
        if self.gathers:
            self.finish_gather()
        self._point_attributes(self.placeholders)
        for flat in self.flats.values():
            flat.release()

    def _point_attributes(self, tensors: list[torch.Tensor]) -> None:
        for ref in self.refs:
            ref.owner.__dict__[ref.attr] = tensors[ref.index]

    # ------------------------------------------------------------- gradients
    def start_reduce(self) -> None:
        """Reduce-scatter (average) every bucket's flattened gradient; drop the full gradients.

        A parameter without a gradient this pass contributes zeros, so every rank submits the same
        collectives whichever parameters it used.
        """
        for key, flat in self.flats.items():
            if not flat.shard.requires_grad:
                continue
            # float16: reduced in float32, with or without a float32 master (a float16 sum overflowed: two
            # gradients of 40000 gave inf; dividing first lost a small gradient's bits); the result is added
            # into the shard's own .grad, rounded once. Before 2026-12-05 only the master path did so
            wire = torch.float32 if flat.dtype == torch.float16 else flat.dtype
            for b, _ in flat.buckets:
                buf = torch.zeros(b.padded, dtype=wire)
                for piece in b.pieces:
                    g = self.views[self.index[piece.name]].grad
                    if g is not None:
                        buf[piece.offset:piece.offset + piece.length].copy_(g.reshape(-1))
                h = frontend.reducescatter_async(to_numpy(buf), Average, f"{self.tag}.{key}.b{b.index}.rs",
                                                 process_set=self.process_set)
                self.reduces.append((flat, b, h))
        for v in self.views:
            v.grad = None
        self.grads_seen = 0
        self.needs_reduce = False

    def discard_reduce(self) -> None:
        """Forget a backward pass that raised: wait for its reduce-scatters (every rank submitted them, so
        none is left in flight to pair with the next pass's) and drop their results and the full gradients."""
        pending, self.reduces = self.reduces, []
        for _, _, h in pending:
            frontend.synchronize(h)
        for v in self.views:
            v.grad = None
        self.grads_seen = 0
        self.needs_reduce = False

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatters; add each result into the shard's ``.grad`` (float32 for masters)."""
        pending, self.reduces = self.reduces, []
        for flat, b, h in pending:
            seg = from_numpy(frontend.synchronize(h)).reshape(-1)
            shard = flat.shard
            if shard.grad is None:
                shard.grad = torch.zeros_like(shard)
            shard.grad[b.shard_offset:b.shard_offset + b.segment_size].add_(seg)

    # ------------------------------------------------------------- shard <-> full tensors
    def write_owned(self, index: int, value: torch.Tensor) -> None:
        """Copy this rank's runs of parameter ``index`` from the full tensor ``value`` into the shard."""
        name = self.names[index]
        flat = self.flats[self.flat_of[index]]
        src = value.detach().reshape(-1).to(flat.shard.dtype)
        for piece in self.owned.get(name, []):
            with torch.no_grad():
                flat.shard[piece.offset:piece.offset + piece.length].copy_(
                    src[piece.param_offset:piece.param_offset + piece.length])


HALF = (torch.float16, torch.bfloat16)


def build_unit(name: str, module: torch.nn.Module, params: list[torch.nn.Parameter], names: list[str],
               refs: list[ParamRef], tag: str, rank: int, world: int, bucket_bytes: int,
               process_set: ProcessSet | None, masters: bool = True) -> Unit:
    """Make ``module``'s unit from its (full, identical on every rank) parameters.

    With ``masters``, trainable half-precision parameters get a float32 shard ([Note: ZeRO-3 master
    weights]). The full buffers are left freed; nothing is installed on the module yet (see
    :func:`install`).
    """
    plan = ShardPlan.build(param_specs(names, params), world, bucket_bytes)
    index = {n: i for i, n in enumerate(names)}
    views: list[torch.Tensor | None] = [None] * len(params)
    flats: dict[str, Flat] = {}
    flat_of = [""] * len(params)
    for key in plan.keys():
        mine = [b for b in plan.buckets if (b.group, b.dtype) == key]
        dtype = params[index[mine[0].pieces[0].name]].dtype
        buckets, base = [], 0
        for b in mine:
            buckets.append((b, base))
            base += b.padded
        full = torch.empty(base, dtype=dtype)
        for b, off in buckets:
            for piece in b.pieces:
                p = params[index[piece.name]]
                v = full[off + piece.offset:off + piece.offset + piece.length].view(p.shape)
                views[index[piece.name]] = v.requires_grad_(p.requires_grad)
                flat_of[index[piece.name]] = flat_key(key)
        master = masters and key[0] == 0 and dtype in HALF
        shard = torch.nn.Parameter(torch.zeros(plan.shard_numel(key), dtype=torch.float32 if master else dtype),
                                   requires_grad=key[0] == 0)
        shard._unison_zero3_shard = True  # type: ignore[attr-defined]  # lets other wrappers refuse it
        flats[flat_key(key)] = Flat(dtype, buckets, shard, full, full.untyped_storage().nbytes(), master)
    unit = Unit(name, module, list(names), refs, plan, flats, flat_of, views,  # type: ignore[arg-type]
                tag, process_set, rank)
    for i, p in enumerate(params):
        unit.write_owned(i, p)
    for flat in flats.values():
        flat.release()
    return unit


#: the ``state_dict`` entry of a unit's layout ([Note: a state_dict knows its layout])
LAYOUT_KEY = "zero3_layout"


def layout_digest(unit: Unit) -> torch.Tensor:
    """16 bytes naming ``unit``'s layout and this rank's place in it: the plan (parameters, rank count,
    bucket size) and the rank."""
    text = f"{unit.plan.signature()}|rank {unit.rank}"
    return torch.tensor(list(hashlib.sha256(text.encode()).digest()[:16]), dtype=torch.uint8)


def install(unit: Unit) -> None:
    """Replace the unit's parameters by their views and register the shards as the parameters.

    [Note: a state_dict knows its layout] ``model.state_dict()`` holds each rank's shards, flat slices
    whose meaning depends on the plan. Shards of one shape can come from another layout (another
    ``bucket_bytes``, or another rank's file): before 2026-12-07 they loaded silently, the parameters'
    elements moved between parameters. Each unit now adds ``<module>.zero3_layout`` (a digest of its plan
    and the rank) and ``load_state_dict`` refuses a different one (an entry without it loads, as before).
    """
    for ref in unit.refs:
        del ref.owner._parameters[ref.attr]
        setattr(ref.owner, ref.attr, unit.placeholders[ref.index])
    for key, flat in unit.flats.items():
        unit.module.register_parameter(f"zero3_flat_{key}", flat.shard)
    digest = layout_digest(unit)

    def save(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        state_dict[prefix + LAYOUT_KEY] = digest.clone()

    def load(module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
             missing: list, unexpected: list, errors: list) -> None:
        saved = state_dict.pop(prefix + LAYOUT_KEY, None)
        if saved is not None and not torch.equal(torch.as_tensor(saved).to(torch.uint8), digest):
            errors.append(f"{prefix or 'the model'}: these ZeRO-3 shards were saved with another layout (another "
                          "rank count, bucket_bytes, set of parameters, or by another rank): they would land in "
                          "the wrong parameters. Load the state_dict each rank saved, into the model sharded as "
                          "it was, or use save_sharded/load_sharded, which reshard")

    unit.module.register_state_dict_post_hook(save)
    unit.module.register_load_state_dict_pre_hook(load)
