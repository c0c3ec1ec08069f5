"""Gradient tensors of the workloads the scaling model knows, written out from the architectures.

Each workload is a list of parameter shapes in the order the model defines them (forward order;
the backward produces their gradients in reverse). The lists are built from the layer recipes,
not copied from a framework, so ``tests/test_perfmodel.py`` checks them against the published
totals:

* ``resnet50``: He et al.'s ResNet-50 as torchvision builds it: a 7x7 stem, bottleneck stages of
  3, 4, 6, 3 blocks (1x1, 3x3, 1x1 convolutions without bias, each followed by batch norm with a
  weight and a bias; a 1x1 projection with batch norm on each stage's first block), a 1000-way
  fully connected layer. 161 tensors, 25,557,032 parameters.
* ``resnet101``: the same with 3, 4, 23, 3 blocks: 314 tensors, 44,549,160 parameters (the model
  of Horovod's published 512-GPU figure).
* ``gpt-1.3b``: a GPT-style decoder: 24 layers, ``d_model`` 2048, 4x MLP, vocabulary 50,257,
  2,048 positions, token embedding tied to the output, per layer two layer norms (weight, bias),
  a fused QKV projection, the attention output and the two MLP matrices (each with a bias):
  292 tensors, 1,315,723,264 parameters.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["WORKLOADS", "DEFAULT_COMPUTE_S", "COMPUTE_NOTES", "shapes", "tensor_bytes"]

Shape = tuple[int, ...]
RESNET_STAGES = {"resnet50": (3, 4, 6, 3), "resnet101": (3, 4, 23, 3)}
RESNET_WIDTHS = (64, 128, 256, 512)
BOTTLENECK_EXPANSION = 4
IMAGENET_CLASSES = 1000
GPT_LAYERS, GPT_WIDTH, GPT_VOCAB, GPT_POSITIONS = 24, 2048, 50257, 2048


def _conv_bn(cin: int, cout: int, kernel: int) -> list[Shape]:
    return [(cout, cin, kernel, kernel), (cout,), (cout,)]


def resnet(blocks: tuple[int, ...]) -> list[Shape]:
    """Parameter shapes of a bottleneck ResNet with ``blocks`` per stage (ImageNet head)."""
    out = _conv_bn(3, 64, 7)
    cin = 64
    for width, count in zip(RESNET_WIDTHS, blocks, strict=True):
        cout = width * BOTTLENECK_EXPANSION
        for b in range(count):
            out += _conv_bn(cin, width, 1) + _conv_bn(width, width, 3) + _conv_bn(width, cout, 1)
            if b == 0:
                out += _conv_bn(cin, cout, 1)  # the projection shortcut
            cin = cout
    return out + [(IMAGENET_CLASSES, cin), (IMAGENET_CLASSES,)]


def gpt(layers: int = GPT_LAYERS, d: int = GPT_WIDTH, vocab: int = GPT_VOCAB,
        positions: int = GPT_POSITIONS) -> list[Shape]:
    """Parameter shapes of a GPT-style decoder (output head tied to the token embedding)."""
    out: list[Shape] = [(vocab, d), (positions, d)]
    for _ in range(layers):
        out += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),           # ln1, qkv, attn out
                (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]       # ln2, mlp fc, mlp proj
    return out + [(d,), (d,)]                                             # final layer norm


WORKLOADS: dict[str, Callable[[], list[Shape]]] = {
    "resnet50": lambda: resnet(RESNET_STAGES["resnet50"]),
    "resnet101": lambda: resnet(RESNET_STAGES["resnet101"]),
    "gpt-1.3b": gpt,
}
#: Forward + backward seconds of one rank's step, when the command line gives none.
DEFAULT_COMPUTE_S = {"resnet50": 0.200, "resnet101": 0.618, "gpt-1.3b": 1.0}
COMPUTE_NOTES = {
    "resnet50": "batch 64 fp32 on a V100-class GPU, ~320 images/s (an assumed round figure)",
    "resnet101": "batch 64 on a Pascal GPU: Horovod's published 1656.82 images/s on 16 GPUs / 16",
    "gpt-1.3b": "8 sequences x 2048 tokens: 6 x 1.3e9 x 16384 FLOPs at ~125 TFLOP/s achieved",
}


def shapes(name: str) -> list[Shape]:
    """The parameter shapes of workload ``name``.

    Raises:
        ValueError: an unknown workload.
    """
    if name not in WORKLOADS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()


def tensor_bytes(name: str, itemsize: int = 4) -> list[int]:
    """Bytes of each gradient tensor of ``name`` (float32 unless ``itemsize`` says otherwise)."""
    sizes = []
    for shape in shapes(name):
        count = 1
        for dim in shape:
            count *= dim
        sizes.append(count * itemsize)
    return sizes
