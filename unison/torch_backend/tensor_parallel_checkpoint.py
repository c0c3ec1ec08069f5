"""``save_tensor_parallel`` / ``load_tensor_parallel``: a tensor-parallel PyTorch model, one shard per rank.

Each rank of a tensor group writes only its own shards; the checkpoint loads into the same model
at any tp, into a model split over pipeline stages differently, or into the plain unsplit model in
one process (a model trained with tp = 2 served on one machine), and back. The layout and the
checks are framework-neutral ([Note: canonical layout of a tensor-parallel entry] in
``unison/common/tensor_parallel/checkpoint.py``); this module only says, for each parameter of a
model, how its layer splits it.

Entries are named after ``model.state_dict()`` keys, so a model split by ``hvd.parallelize`` and
the plain model it came from name them alike. ``nn.MultiheadAttention``'s ``in_proj_weight`` /
``in_proj_bias`` / ``out_proj.*`` are named as :class:`ParallelSelfAttention`'s ``qkv.*`` / ``out.*``
(the same tensors: q, k and v stacked, and the output projection), so a block built by
``from_multihead_attention`` and its plain source share a checkpoint too.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from unison.common import runtime
from unison.common.checkpoints import Manifest, agree
from unison.common.engine.process_sets import ProcessSet
from unison.common.tensor_parallel import checkpoint as tpck
from unison.common.tensor_parallel.checkpoint import REPLICATED, ShardSpec, TPParam
from unison.common.tensor_parallel.groups import group_position
from unison.torch_backend.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from unison.torch_backend.tensor_parallel_blocks import ParallelSelfAttention
from unison.torch_backend.tensors import from_numpy, to_numpy

__all__ = ["save_tensor_parallel", "load_tensor_parallel"]

#: layer class -> {parameter path inside the layer: how the layer splits it}; parameters not
#: listed are replicated. A container's entries override its children's (the fused q/k/v
#: projection is a column layer of 3 blocks). ParallelMLP / ParallelTransformerBlock are only
#: made of these.
SPLITS: list[tuple[type, dict[str, ShardSpec]]] = [
    (ColumnParallelLinear, {"weight": ShardSpec(0), "bias": ShardSpec(0)}),
    (RowParallelLinear, {"weight": ShardSpec(1)}),
    (VocabParallelEmbedding, {"weight": ShardSpec(0)}),
    (ParallelSelfAttention, {"qkv.weight": ShardSpec(0, 3), "qkv.bias": ShardSpec(0, 3)}),
]

#: nn.MultiheadAttention's parameter names -> ParallelSelfAttention's (the entry names)
MHA_NAMES = {"in_proj_weight": "qkv.weight", "in_proj_bias": "qkv.bias", "out_proj.weight": "out.weight",
             "out_proj.bias": "out.bias"}


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _specs_and_names(model: nn.Module) -> tuple[dict[str, ShardSpec], dict[str, str]]:
    """state_dict key -> spec (split parameters only), and key -> entry name where they differ."""
    specs: dict[str, ShardSpec] = {}
    names: dict[str, str] = {}
    for path, module in reversed(list(model.named_modules())):  # children first: containers override
        for cls, table in SPLITS:
            if isinstance(module, cls):
                specs.update({_join(path, key): spec for key, spec in table.items()})
        if isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
            names.update({_join(path, key): _join(path, alias) for key, alias in MHA_NAMES.items()})
    return specs, names


def _position(model: nn.Module, key: str) -> tuple[int, int]:
    owner_path = key.rpartition(".")[0]
    process_set = model.get_submodule(owner_path).process_set
    return group_position(process_set, "save_tensor_parallel/load_tensor_parallel")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _describe(model: nn.Module, with_arrays: bool) -> list[tuple[TPParam, torch.Tensor]]:
    """Every ``state_dict`` tensor as a :class:`TPParam` (this rank's piece when ``with_arrays``)."""
    specs, names = _specs_and_names(model)
    out = []
    for key, tensor in model.state_dict(keep_vars=True).items():
        spec = specs.get(key, REPLICATED)
        tp, index = (1, 0) if spec.axis is None else _position(model, key)
        shape = list(tensor.shape)
        if spec.axis is not None:
            shape[spec.axis] *= tp
        array = to_numpy(tensor.detach()) if with_arrays else None
        out.append((TPParam(names.get(key, key), tuple(shape), spec, tp, index, array, _dtype(tensor)), tensor))
    return out


def _comm(local: bool) -> Any:
    if local:
        return None
    st = runtime.state("unison.torch_backend.save_tensor_parallel()")
    return st.comm if st.size > 1 else None


def save_tensor_parallel(path: str | os.PathLike[str], model: nn.Module, metadata: dict[str, Any] | None = None,
                         data_process_set: ProcessSet | None = None, consolidated: bool = False,
                         local: bool = False) -> Manifest:
    """Save a (tensor-, pipeline-, data-) parallel model collectively: each shard once, by its own rank.

    Every rank of the job calls it with the same ``path``. Each rank describes its own
    parameters (a pipeline stage its stage's, by their global paths); split parameters are
    written one run per shard, replicated ones once.

    Args:
        path: a folder (or one file with ``consolidated=True``) every rank can see.
        model: this rank's model: parallel layers, plain modules, or both; or a ``Pipeline``
            (each rank writes its own stages' layers under their indices in the whole model).
        metadata: JSON-serializable extras, returned by :func:`load_tensor_parallel`.
        data_process_set: this rank's data-parallel group (``Grid.register().dp``): only the
            ranks of data replica 0 write, the others hold copies. None: every rank writes
            (no data parallelism).
        consolidated: one file written by rank 0 instead of a folder.
        local: this process saves alone (a plain model in one process of a job); no other
            rank calls.

    Returns:
        The committed manifest, on every rank.

    Raises:
        unison.common.checkpoints.CheckpointError: on every rank, naming what failed (a rank
            outside its ``data_process_set`` included).
    """
    comm = _comm(local)
    agree.enter(comm, "save_tensor_parallel")  # [Note: a collective save is entered through the engine]
    writes = tpck.replica_writes(data_process_set, comm)
    # agreed: a tensor numpy cannot take, or a layer outside its tensor group, on one rank raised there alone
    # while the others waited in the save's first collective (before 2026-12-07)
    described = agree.agreed(comm, lambda: _describe(_as_module(model), with_arrays=writes))
    same = {p.name for p, t in described if isinstance(t, nn.Parameter)}  # trained copies must agree
    return tpck.save(path, [p for p, _ in described], comm, writes, metadata, consolidated, same)


def _as_module(model: Any) -> nn.Module:
    """``model``, or for a :class:`~unison.torch_backend.Pipeline` this rank's layers under their
    paths in the whole model (``Pipeline.local_module()``)."""
    from unison.torch_backend.pipeline import Pipeline

    return model.local_module() if isinstance(model, Pipeline) else model


def load_tensor_parallel(path: str | os.PathLike[str], model: nn.Module, local: bool = False,
                         verify: str = "read", strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_tensor_parallel` into ``model`` at any tp / pp; returns the metadata.

    Each rank reads only its own shards (one range per split parameter) when its layers split
    them as the saving layers did, at any tp; a plain (unsplit) module reads the entry whole,
    whatever it was split as, and a split layer slices an entry saved whole (from a plain model).

    Args:
        path: the checkpoint folder or file.
        model: this rank's model; its ``state_dict`` keys name the entries it reads.
        local: this process loads alone (serving on one machine); no other rank calls.
        verify: ``"read"`` or ``"all"``, as ``unison.common.checkpoints.load``.
        strict: refuse a checkpoint holding entries that no loading rank's model has (as
            ``load_state_dict`` refuses unexpected keys); False loads the entries the model has.

    Raises:
        unison.common.checkpoints.CheckpointError: on every rank: a missing entry, a different
            full shape, a parameter split differently from the saved one, an entry no rank
            loads (``strict``), or a missing, corrupt or mismatched checkpoint.
    """
    comm = _comm(local)
    agree.enter(comm, "load_tensor_parallel")  # [Note: a collective save is entered through the engine]
    described = agree.agreed(comm, lambda: _describe(_as_module(model), with_arrays=False))  # (as the save's)
    pieces, user = tpck.load(path, [p for p, _ in described], comm, verify, strict)
    with torch.no_grad():
        for param, tensor in described:
            piece = np.asarray(pieces[param.name])
            tensor.copy_(from_numpy(np.ascontiguousarray(piece).reshape(piece.shape)).to(tensor.dtype))  # (0-d)
    return user
