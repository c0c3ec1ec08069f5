"""Pipeline-parallel training of a small MLP on scikit-learn's digits with ``unison.torch_backend.Pipeline``.

Run with ``unisonrun -np 2 python examples/torch_pipeline.py``: the model's layers are cut
into one stage per rank (by parameter count), rank 0 holds the first stage and feeds the
images, the last rank holds the last stage and the labels, and activations and gradients
travel between them point to point, ``--chunks`` microbatches per batch, in the order of
``--schedule``. Every rank loads the same data and shuffles it with the same seed, so the
first and last stages see matching images and labels without sending them.

Only rank 0 prints: progress (bars and per-epoch lines) on stderr, where they stay in order, and
the result on stdout, one line: ``final validation accuracy: 0.xxx``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train an MLP on scikit-learn's digits as a pipeline of one stage per rank "
                    "(run under unisonrun -np 2); rank 0 prints.")
    p.add_argument("--epochs", type=int, default=5, help="passes over the training set (default 5)")
    p.add_argument("--batch-size", type=int, default=64,
                   help="samples per step; a multiple of --chunks (default 64)")
    p.add_argument("--chunks", type=int, default=4, help="microbatches per step (default 4)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    p.add_argument("--checkpoint", choices=("never", "always", "except_last"), default="never",
                   help="recompute activations in backward instead of keeping them (default never)")
    p.add_argument("--lr", type=float, default=0.1, help="SGD learning rate, momentum 0.9 (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed for the split, weights and shuffling (default 0)")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.chunks < 1 or args.batch_size % args.chunks or args.batch_size < 1:
        p.error(f"--epochs and --chunks must be positive and --batch-size a positive multiple of --chunks "
                f"(got --epochs {args.epochs}, --chunks {args.chunks}, --batch-size {args.batch_size})")
    return args


def load_digits_split(seed: int) -> tuple[Any, Any, Any, Any]:
    """Flattened 8x8 digits scaled to [0, 1] and their labels, split 80/20; the same on every rank."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.long)
    train, val = train_test_split(range(len(y)), test_size=0.2, stratify=data.target, random_state=seed)
    return x[train], y[train], x[val], y[val]


def build_model() -> Any:
    from torch import nn

    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 10))


def accuracy(hvd: Any, pipe: Any, x: Any, y: Any, chunks: int) -> float:
    """Validation accuracy, computed where the last stage is and sent to every rank."""
    import torch

    pad = -len(x) % chunks  # a batch must split into equal microbatches: pad, then drop the padding
    logits = pipe.predict(torch.cat([x, x[:pad]]))
    mine = float((logits[:len(x)].argmax(dim=1) == y).float().mean()) if pipe.holds_last else None
    return hvd.broadcast_object(mine, root_rank=hvd.size() - 1)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch import nn
    from tqdm import tqdm

    import unison.torch_backend as hvd

    hvd.init()
    torch.set_num_threads(1)  # ranks share the host's cores

    def say(line: str) -> None:  # progress, rank 0 only: on stderr, through tqdm, in order with its bars
        if hvd.rank() == 0:
            tqdm.write(line, file=sys.stderr)

    torch.manual_seed(args.seed)
    x_train, y_train, x_val, y_val = load_digits_split(args.seed)
    v = 2 if args.schedule == "interleaved" else 1
    pipe = hvd.Pipeline(build_model(), chunks=args.chunks, schedule=args.schedule, virtual_stages=v,
                        checkpoint=args.checkpoint, loss_fn=nn.functional.cross_entropy,
                        optimizer=lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9))
    say(f"{hvd.size()} rank(s), {pipe.schedule.num_stages} stages with {pipe.balance} layers, "
        f"{args.schedule}, {args.chunks} microbatches of {args.batch_size // args.chunks}")
    order = torch.Generator().manual_seed(args.seed)  # the same shuffle on every rank
    steps = len(x_train) // args.batch_size  # the last partial batch is dropped
    if steps < 1:
        pipe.close()
        raise SystemExit(f"--batch-size {args.batch_size} is larger than the {len(x_train)} training rows: "
                         "not one batch an epoch; use a smaller batch size")
    for epoch in range(args.epochs):
        perm = torch.randperm(len(x_train), generator=order)
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", disable=hvd.rank() != 0,
                   file=sys.stderr, leave=False, dynamic_ncols=True)
        total = 0.0
        for step in bar:
            idx = perm[step * args.batch_size:(step + 1) * args.batch_size]
            loss = pipe.train_step(x_train[idx], y_train[idx])
            total += loss
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)  # shown at the next update
        bar.close()
        bubble = pipe.stats.bubble  # of the last training step, on this rank
        val = accuracy(hvd, pipe, x_val, y_val, args.chunks)
        say(f"epoch {epoch + 1}/{args.epochs}: train loss {total / steps:.4f}, validation accuracy {val:.4f}, "
            f"idle share of rank 0 in the last step {bubble:.2f}")
    final = accuracy(hvd, pipe, x_val, y_val, args.chunks)
    pipe.close()
    if hvd.rank() == 0:
        print(f"final validation accuracy: {final:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
