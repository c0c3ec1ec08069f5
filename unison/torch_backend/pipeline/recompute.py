"""Activation checkpointing for pipeline stages: forget in forward, recompute before backward.

Why not ``torch.utils.checkpoint``: it hides the recomputation inside autograd's backward of
one call. A pipeline stage's backward is a separate action of the schedule, sometimes many
actions after the forward, and for zero-bubble schedules the recomputed graph must survive
from ``I`` (input gradient) until ``W`` (weight gradients). So the stage keeps only its
input and the random-number state of the forward, and rebuilds the graph itself right
before its backward.

[Note: RNG replay] Dropout draws random numbers. The recomputed forward must draw the same
ones, or the gradients belong to a different network than the loss. :func:`capture` records
the generator state before the first forward; :func:`replay` restores it for the
recomputation and then puts back the state it found, so the recomputation consumes no
random numbers of the training run: later forwards see the same stream as without
checkpointing. The state includes the tensor-parallel tracker's named streams
(``get_rng_tracker()``): the parallel blocks draw attention dropout (and hidden dropout under
sequence parallelism) from them inside ``fork()``, so a replay that restored only the default
generator gave the recomputed forward other masks than the first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from unison.torch_backend.tensor_parallel_random import get_rng_tracker

__all__: list[str] = []


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state, for a CUDA stage that device's generator state, and the
    tensor-parallel tracker's streams."""

    cpu: torch.Tensor
    device: torch.device
    accelerator: torch.Tensor | None = None
    streams: dict[str, Any] | None = None


def capture(device: torch.device) -> RngState:
    """The generator state a forward on ``device`` is about to use."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return RngState(torch.get_rng_state(), device, cuda, get_rng_tracker().get_states())


def restore(state: RngState) -> None:
    """Put the generators back as ``state`` had them."""
    torch.set_rng_state(state.cpu)
    if state.accelerator is not None:
        torch.cuda.set_rng_state(state.accelerator, state.device)
    if state.streams is not None:
        get_rng_tracker().set_states(state.streams)


@contextmanager
def replay(state: RngState) -> Iterator[None]:
    """Run the block with the generators as ``state`` had them, then as they were before."""
    now = capture(state.device)
    restore(state)
    try:
        yield
    finally:
        restore(now)


def starts_in_place(module: nn.Module) -> bool:
    """Whether ``module``'s first operation writes its input in place (``ReLU(inplace=True)``,
    also first in a nested ``nn.Sequential``).

    A stage's received input is an autograd leaf (its gradient goes upstream), and autograd
    refuses an in-place write to a leaf: such a stage is fed a copy.
    """
    while isinstance(module, nn.Sequential) and len(module):
        module = module[0]
    return bool(getattr(module, "inplace", False))
