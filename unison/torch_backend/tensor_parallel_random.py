"""The two random streams of tensor parallelism for PyTorch (see [Note: two random streams per rank]).

``model_parallel_manual_seed(seed, process_set)`` seeds torch's default CPU generator with
``seed`` (the same on every rank of the tensor group: dropout outside a region draws the same
mask everywhere) and the tracker's model-parallel stream with ``seed + 2718 + shard``;
``get_rng_tracker().fork()`` draws from the latter inside a region. The parallel blocks call it
themselves for attention dropout (and for hidden dropout under sequence parallelism).

[Note: recomputing a block that drew from the tracker]
``torch.utils.checkpoint`` replays torch's default generator for the recompute, but not the
tracker's streams: a block whose forward drew attention dropout inside ``fork()`` would draw
another mask when it is recomputed in backward, and its gradients would belong to a forward that
never ran (the output matches, so nothing fails). :func:`activation_checkpoint` is
``torch.utils.checkpoint`` (non-reentrant) that also puts the tracker's streams back to where
the forward found them for the recompute, and afterwards to where they were before it. The
pipeline executors' own recompute does the same (``unison/torch_backend/pipeline/recompute.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint

from unison.common.engine.process_sets import ProcessSet, global_process_set
from unison.common.tensor_parallel.groups import agree_on_seed, group_position
from unison.common.tensor_parallel.rng import MODEL_PARALLEL, RNGStatesTracker, model_parallel_seed

__all__ = ["get_rng_tracker", "model_parallel_manual_seed", "activation_checkpoint", "refuse_forked_off_cpu"]


def _new_state(seed: int) -> torch.Tensor:
    return torch.Generator().manual_seed(seed).get_state()


_TRACKER = RNGStatesTracker(_new_state, torch.get_rng_state, torch.set_rng_state)


def get_rng_tracker() -> RNGStatesTracker:
    """The process's tracker of named random states (``fork()`` enters the per-shard stream)."""
    return _TRACKER


def refuse_forked_off_cpu(tensor: torch.Tensor, owner: str) -> None:
    """Refuse dropout drawn inside ``fork()`` on a tensor that is not on the CPU.

    The tracker's streams are states of torch's CPU generator: ``fork()`` switches that one only, so dropout on a
    CUDA tensor would draw from the CUDA generator, which ``model_parallel_manual_seed`` seeds alike on every
    rank: one mask on every shard, where each needs its own (Megatron keeps per-device streams; not built yet,
    and not testable without a GPU).

    Raises:
        NotImplementedError: ``tensor`` is not on the CPU.
    """
    if tensor.device.type != "cpu":
        raise NotImplementedError(
            f"{owner}: dropout inside a tensor-parallel region on {tensor.device.type} tensors is not supported "
            f"yet: the per-shard random streams are CPU generator states, and the {tensor.device.type} generator "
            "would draw the same mask on every rank of the group. Use attention_dropout=0 (and hidden_dropout=0 "
            "with sequence_parallel) on this device for now")


def model_parallel_manual_seed(seed: int, process_set: ProcessSet = global_process_set) -> None:
    """Seed the shared stream with ``seed`` and this shard's stream from it; call on every rank of the group.

    Collective over the group: the ranks agree on ``seed`` (one 16-byte all-gather). Before 2026-12-05 a
    seed that differed between them (``seed + rank``, a common habit) was taken, and the copies that dropout
    must leave identical on every rank of the group drifted apart, with no error.

    Raises:
        ValueError: ``seed`` not a non-negative integer, or this rank not in ``process_set``.
        MismatchError: the ranks of the group passed different seeds (on every rank of it).
    """
    _, shard = group_position(process_set, "model_parallel_manual_seed")
    mine = model_parallel_seed(seed, shard)
    agree_on_seed("model_parallel_manual_seed", process_set, seed)
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL, mine)


def activation_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`` whose
    recompute also replays the tensor-parallel tracker's streams, so dropout drawn inside
    ``get_rng_tracker().fork()`` (the parallel blocks' attention dropout) draws the forward's masks
    again (see [Note: recomputing a block that drew from the tracker]).

    Raises:
        ValueError: ``use_reentrant=True`` or a ``context_fn`` of the caller's (this function needs
            the non-reentrant checkpoint's ``context_fn`` for itself).
    """
    if kwargs.pop("use_reentrant", False):
        raise ValueError("activation_checkpoint: use_reentrant=True is not supported (the tracker's streams are "
                         "replayed through the non-reentrant checkpoint's context_fn); leave it out")
    if "context_fn" in kwargs:
        raise ValueError("activation_checkpoint: context_fn is taken (it replays the tracker's streams); wrap "
                         "your own context inside the function instead")
    at_forward: dict[str, Any] = {}

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        at_forward.update(_TRACKER.get_states())
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        now = _TRACKER.get_states()
        _TRACKER.set_states(dict(at_forward))
        try:
            yield
        finally:
            _TRACKER.set_states(now)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=lambda: (forward(), recompute()), **kwargs)
