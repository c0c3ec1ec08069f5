"""Cutting a sequence of PyTorch layers into pipeline stages, by parameter count or measured time.

Both measure one cost per layer and hand it to the framework-neutral
:func:`unison.common.pipeline.balance_by_cost`, which minimises the largest stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from time import perf_counter

import torch
from torch import nn

from unison.common import runtime
from unison.common.pipeline import ScheduleError, balance_by_cost
from unison.common.pipeline.grid import rank0_decides
from unison.common.pipeline.runner import agreed
from unison.torch_backend.pipeline.recompute import capture, restore, starts_in_place

__all__ = ["balance_by_params", "balance_by_time", "as_layers"]


def as_layers(module: nn.Sequential | Sequence[nn.Module]) -> list[nn.Module]:
    """The layers of an ``nn.Sequential`` or a list of modules, in order.

    Raises:
        TypeError: anything else, or an element that is not an ``nn.Module``.
    """
    if isinstance(module, nn.Sequential):
        return list(module)
    if isinstance(module, nn.Module) or not isinstance(module, Sequence):
        raise TypeError(f"a pipeline needs an nn.Sequential or a list of nn.Module layers; received "
                        f"{type(module).__name__}. Wrap the layers in nn.Sequential(...)")
    bad = [i for i, layer in enumerate(module) if not isinstance(layer, nn.Module)]
    if bad:
        raise TypeError(f"layer {bad[0]} is {type(module[bad[0]]).__name__}, not an nn.Module; a pipeline "
                        "needs a list of nn.Module layers")
    return list(module)


def balance_by_params(module: nn.Sequential | Sequence[nn.Module], p: int) -> list[int]:
    """Layers per stage for ``p`` stages with the largest stage's parameter count as small as possible.

    Args:
        module: the layers, in order.
        p: the number of stages (``p * v`` for the interleaved schedule).

    Raises:
        ScheduleError: fewer layers than stages, or ``p`` not a positive integer.
    """
    layers = as_layers(module)
    return balance_by_cost([sum(t.numel() for t in layer.parameters()) for layer in layers], p)


def balance_by_time(module: nn.Sequential | Sequence[nn.Module], sample: torch.Tensor, p: int,
                    device: torch.device | str | None = None, repeats: int = 3) -> list[int]:
    """Layers per stage for ``p`` stages with the slowest stage as fast as possible.

    Each layer's forward and backward time is measured on ``sample`` (one microbatch), the
    fastest of ``repeats`` runs; layers and sample are moved to ``device`` first. The layers'
    ``.grad`` are cleared afterwards. When Unison runs on several ranks this is collective:
    every rank measures, rank 0's times decide, and every rank returns the same balance
    (timings differ between ranks, and ranks with different balances cannot form a pipeline).

    Raises:
        ScheduleError: fewer layers than stages, or ``repeats`` below 1.
        PipelineError: on every rank, when the measurement fails on any rank (a sample that
            does not fit the first layer, a device out of memory); before 2026-12-05 the other
            ranks waited for the failed one forever, or went on with rank 0's balance.
    """
    layers = as_layers(module)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ScheduleError(f"repeats must be a positive integer; received {repeats!r}")
    if runtime.is_initialized() and runtime.size() > 1:
        times = agreed(lambda: _measure(layers, sample, device, repeats), failed="balance_by_time's measurement")
    else:
        times = _measure(layers, sample, device, repeats)
    return balance_by_cost(rank0_decides(times), p)


def _measure(layers: list[nn.Module], sample: torch.Tensor, device: torch.device | str | None,
             repeats: int) -> list[float]:
    """Each layer's fastest forward and backward of ``repeats``, changing nothing it measures."""
    dev = torch.device(device) if device is not None else sample.device
    for layer in layers:
        layer.to(dev)
    # the measurement trains each layer's forward: put the buffers (BatchNorm's running
    # statistics) and the random generators back afterwards, so measuring changes nothing
    buffers = [b for layer in layers for b in layer.buffers()]
    with torch.no_grad():
        saved = [b.clone() for b in buffers]
    rng = capture(dev)
    try:
        times = [math.inf] * len(layers)
        for _ in range(repeats):
            x = sample.to(dev)
            for i, layer in enumerate(layers):
                times[i] = min(times[i], _time_layer(layer, x))
                with torch.no_grad():
                    x = layer(x)
    finally:
        with torch.no_grad():
            for b, value in zip(buffers, saved, strict=True):
                b.copy_(value)
        restore(rng)
        for layer in layers:
            for param in layer.parameters():
                param.grad = None
    return times


def _time_layer(layer: nn.Module, x: torch.Tensor) -> float:
    """Seconds for one forward and backward of ``layer`` on ``x``."""
    x = x.detach().requires_grad_(x.is_floating_point())
    _sync(x.device)
    start = perf_counter()
    y = layer(x.clone() if starts_in_place(layer) and x.requires_grad else x)
    if y.requires_grad:
        torch.autograd.backward(y, torch.ones_like(y))
    _sync(x.device)
    return perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
