"""Data-parallel training of a small CNN on scikit-learn's digits with Unison's PyTorch API.

Run with ``unisonrun -np 2 python examples/torch_train.py``; a plain ``python
examples/torch_train.py`` is a job of one rank. The script is written exactly as
it would be for ``horovod.torch``, only the import differs:

* every rank builds the same model and loads the same 8x8 digit images (they
  ship with scikit-learn, nothing is downloaded), split once into training and
  validation sets with ``--seed``;
* each rank trains on its shard of the training set (``DistributedSampler``), so
  one epoch is one pass over the data by all ranks together. The learning rate
  is scaled by the number of ranks, since the averaged gradient of ``size``
  batches of ``--batch-size`` behaves like one batch ``size`` times larger;
* ``hvd.DistributedOptimizer`` averages the gradients over ranks before each
  step, and rank 0's parameters and optimizer state are broadcast at the start,
  so the replicas begin equal and stay equal;
* validation is sharded too; each rank's sums (correct answers, samples, loss)
  are averaged over ranks with ``hvd.allreduce``, and since every sum is averaged
  alike their ratios are exactly the whole validation set's accuracy and loss;
* rank 0 writes a checkpoint after every epoch (temporary file, then
  ``os.replace``, so a crash never leaves half a file). ``--resume`` loads it on
  rank 0 only and broadcasts the epoch, parameters and optimizer state, so every
  rank continues from the same point even when only rank 0 can read the file.

Only rank 0 prints: the progress bar and the log on stderr, the per-epoch results on stdout, each
line flushed as it is written (a pipe, as under mpirun, would otherwise hold stdout back until the
end, behind everything on stderr); the last line is ``final validation accuracy: 0.xxx``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("examples.torch_train")

DEFAULT_CHECKPOINT = Path("checkpoints/torch_train.pt")
VALIDATION_SHARE = 0.2


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        description="Train a small CNN on scikit-learn's digits, data parallel over Unison's "
                    "Horovod-compatible PyTorch API. Run under unisonrun/mpirun; rank 0 prints.")
    p.add_argument("--epochs", type=int, default=5, help="total epochs to train (default 5)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05,
                   help="learning rate for one rank; it is multiplied by the rank count (default 0.05)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the data split, the initial weights and the shuffling (default 0)")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT,
                   help=f"checkpoint written by rank 0 after every epoch (default {DEFAULT_CHECKPOINT})")
    p.add_argument("--resume", action="store_true",
                   help="continue from --checkpoint: its epoch, weights and optimizer state")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and checks the command line; exits with a usage message on bad values."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1 or args.lr <= 0:
        p.error(f"--epochs and --batch-size must be at least 1 and --lr positive "
                f"(got --epochs {args.epochs}, --batch-size {args.batch_size}, --lr {args.lr})")
    return args


def load_digits_split(seed: int) -> tuple[Any, Any, Any, Any]:
    """The digits as float tensors of shape (N, 1, 8, 8) scaled to [0, 1], split stratified.

    Returns:
        ``(x_train, y_train, x_val, y_val)``; identical on every rank for one ``seed``.
    """
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_val = train_test_split(range(len(y)), test_size=VALIDATION_SHARE,
                                          stratify=data.target, random_state=seed)
    return x[idx_train], y[idx_train], x[idx_val], y[idx_val]


def build_model() -> Any:
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers: 8x8 -> 10 classes."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),  # 32 x 4 x 4
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64), nn.ReLU(),
        nn.Linear(64, 10),
    )


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Writes ``state`` with ``torch.save`` to a temporary file next to ``path``, then renames it.

    The rename is atomic on POSIX, so ``path`` holds either the previous
    checkpoint or the new one, never a partial file.
    """
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def restore(hvd: Any, model: Any, optimizer: Any, args: argparse.Namespace, lr: float) -> int:
    """Loads the checkpoint on rank 0 and broadcasts it; returns the epochs already trained.

    Every rank must call this. Rank 0 reads ``args.checkpoint`` (when ``--resume``
    is given) into ``model`` and ``optimizer``; then the epoch count, the parameters
    and the optimizer state are broadcast from rank 0, so all ranks agree even
    without ``--resume`` (where this is the usual start-of-training broadcast).

    Raises:
        SystemExit: ``--resume`` was given but rank 0 could not read the checkpoint
            (raised with status 2 on every rank; rank 0 logs why).
    """
    import torch

    start: int | str = 0
    if hvd.rank() == 0 and args.resume:
        try:
            ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
            model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            start = int(ckpt["epoch"])
            if ckpt.get("size") != hvd.size():
                logger.warning("checkpoint was written by %s rank(s), resuming on %d; the learning "
                               "rate is rescaled to %g", ckpt.get("size"), hvd.size(), lr)
        except (OSError, RuntimeError, KeyError, ValueError) as exc:
            start = f"cannot resume from {args.checkpoint}: {type(exc).__name__}: {exc}"
    start = hvd.broadcast_object(start, root_rank=0)
    if isinstance(start, str):
        if hvd.rank() == 0:
            logger.error("%s", start)
        raise SystemExit(2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for group in optimizer.param_groups:  # the checkpoint's lr was scaled for its own rank count
        group["lr"] = lr
    return start


def train_epoch(hvd: Any, model: Any, optimizer: Any, loader: Any, desc: str) -> float:
    """One pass over this rank's shard; returns the mean training loss over all ranks."""
    import torch
    from torch.nn import functional as F
    from tqdm import tqdm

    model.train()
    sums = torch.zeros(2, dtype=torch.float64)  # loss * samples, samples
    bar = tqdm(loader, desc=desc, unit="batch", disable=hvd.rank() != 0, file=sys.stderr,
               leave=False, dynamic_ncols=True)
    for x, y in bar:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        sums += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)  # shown at the next update
    bar.close()
    sums = hvd.allreduce(sums, name="train_loss", op=hvd.Average)
    return float(sums[0] / sums[1])


def evaluate(hvd: Any, model: Any, x: Any, y: Any) -> tuple[float, float]:
    """Accuracy and mean loss on the whole validation set, each rank scoring every size-th sample.

    Returns:
        ``(accuracy, loss)``, the same on every rank.
    """
    import torch
    from torch.nn import functional as F

    model.eval()
    mine = slice(hvd.rank(), None, hvd.size())
    with torch.no_grad():
        logits = model(x[mine])
        correct = (logits.argmax(dim=1) == y[mine]).sum().item()
        loss_sum = F.cross_entropy(logits, y[mine], reduction="sum").item()
    sums = torch.tensor([correct, len(y[mine]), loss_sum], dtype=torch.float64)
    # Averaging divides every entry by size alike, so the ratios below are those of the sums.
    sums = hvd.allreduce(sums, name="val_metrics", op=hvd.Average)
    return float(sums[0] / sums[1]), float(sums[2] / sums[1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import unison.torch_backend as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(1)  # ranks share the host's cores
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stderr,
                        format=f"[torch_train rank {rank}] %(levelname)s %(message)s")
    say = (lambda line: print(line, flush=True)) if rank == 0 else (lambda line: None)

    torch.manual_seed(args.seed)
    x_train, y_train, x_val, y_val = load_digits_split(args.seed)
    train_set = TensorDataset(x_train, y_train)
    sampler = DistributedSampler(train_set, num_replicas=size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = build_model()
    lr = args.lr * size
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none,
                                         backward_passes_per_step=1, op=hvd.Average)
    start = restore(hvd, model, optimizer, args, lr)
    say(f"{size} rank(s): {len(x_train)} training samples ({len(sampler)} per rank, "
        f"{len(loader)} batches of {args.batch_size}), {len(x_val)} validation samples, "
        f"lr {args.lr} x {size} = {lr:g}")
    if args.resume:
        say(f"resuming from epoch {start} ({args.checkpoint})")
    if start >= args.epochs:
        logger.warning("the checkpoint already holds %d epoch(s), --epochs is %d: nothing to train",
                       start, args.epochs)

    for epoch in range(start, args.epochs):
        t0 = time.perf_counter()
        sampler.set_epoch(epoch)
        train_loss = train_epoch(hvd, model, optimizer, loader, f"epoch {epoch + 1}/{args.epochs}")
        accuracy, val_loss = evaluate(hvd, model, x_val, y_val)
        say(f"epoch {epoch + 1}/{args.epochs}: train loss {train_loss:.4f}, "
            f"validation loss {val_loss:.4f}, validation accuracy {accuracy:.4f}")
        if rank == 0:
            save_checkpoint(args.checkpoint, {"epoch": epoch + 1, "size": size,
                                              "model": model.state_dict(),
                                              "optimizer": optimizer.state_dict()})
            logger.info("epoch %d took %.2f s; checkpoint written to %s", epoch + 1,
                        time.perf_counter() - t0, args.checkpoint)

    accuracy, _ = evaluate(hvd, model, x_val, y_val)
    say(f"final validation accuracy: {accuracy:.3f}")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
