"""A small GPT-style byte-level language model, tensor parallel (and data parallel) with Unison's PyTorch layers.

Run with ``unisonrun -np 2 python examples/gpt_tp.py`` (tp = 2) or ``unisonrun -np 4 python
examples/gpt_tp.py --tp 2`` (dp = 2 x tp = 2). The text is the Python standard library's own
source files, which ship with every Python: nothing is downloaded. What the script shows:

* ``Grid(tp=...)`` arranges the ranks into tensor groups (neighbouring ranks) and data groups,
  and ``register()`` makes them process sets;
* the model is built from Unison's tensor-parallel layers: a vocabulary-parallel embedding, causal
  ``ParallelTransformerBlock``s (heads and MLP split over the tensor group; optionally sequence
  parallel and with dropout), and a column-parallel head whose logits stay split: the loss is
  ``vocab_parallel_cross_entropy``, so no rank ever holds all 256 logits of a position while
  training;
* the shards are initialised inside ``get_rng_tracker().fork()`` (each shard its own numbers), the
  replicated position table outside it (the same on every rank);
* ``DistributedOptimizer(..., process_set=sets.dp)`` averages gradients over the data group only:
  the ranks of a tensor group hold different shards and see the same batch;
* at the end every rank of the tensor group runs generation together (the forward pass is
  collective) and rank 0 prints a sample.

Rank 0 prints the loss as it falls; the last lines are ``validation loss: x.xxx`` and the sample.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import sysconfig
from pathlib import Path

import numpy as np

logger = logging.getLogger("examples.gpt_tp")
VOCAB = 256  # bytes


def build_parser(framework: str = "PyTorch") -> argparse.ArgumentParser:
    """The command line (the Keras example shares it)."""
    p = argparse.ArgumentParser(
        description="Train a byte-level GPT on the Python standard library's source, tensor parallel over "
                    f"Unison's {framework} layers (and data parallel across tensor groups). Run under unisonrun.")
    p.add_argument("--tp", type=int, default=None, help="ranks per tensor group (default: every rank)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data replica per step (default 16)")
    p.add_argument("--seq", type=int, default=64, help="sequence length in bytes (default 64)")
    p.add_argument("--hidden", type=int, default=128, help="model width (default 128)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout (default 0)")
    p.add_argument("--sequence-parallel", action="store_true", help="split norms and dropout along the sequence")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000, help="bytes of stdlib source (default 2 MB)")
    p.add_argument("--sample-bytes", type=int, default=200, help="bytes generated at the end (default 200)")
    p.add_argument("--log-every", type=int, default=50, help="print the loss every N steps (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed for the weights, batches and sampling (default 0)")
    return p


def load_corpus(limit: int) -> np.ndarray:
    """The standard library's ``.py`` files, in name order, as bytes (at most ``limit``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data[:limit - total])
        total += len(chunks[-1])
        if total >= limit:
            break
    if total < 10_000:
        raise SystemExit(f"found only {total} bytes of Python source under {root}; is the standard library there?")
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def batch(data: np.ndarray, rows: int, seq: int, rng: np.random.Generator) -> tuple:
    """``rows`` random windows of ``seq + 1`` bytes: inputs and the next byte of each position."""
    import torch

    starts = rng.integers(0, len(data) - seq - 1, rows)
    windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])


def build_model(args: argparse.Namespace, tp_set: object):
    """The GPT: shards drawn from each shard's own stream, replicated parts from the shared one."""
    import torch
    from torch import nn

    import unison.torch_backend as hvd
    from unison.torch_backend.tensor_parallel_comm import gather_from_group

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(args.seq, args.hidden)  # replicated: the shared stream
            self.norm = nn.LayerNorm(args.hidden)
            with hvd.get_rng_tracker().fork():  # every shard its own initial numbers
                self.embed = hvd.VocabParallelEmbedding(VOCAB, args.hidden, process_set=tp_set)
                self.blocks = nn.ModuleList(
                    hvd.ParallelTransformerBlock(args.hidden, args.heads, 4 * args.hidden, causal=True,
                                                 process_set=tp_set, hidden_dropout=args.dropout,
                                                 attention_dropout=args.dropout,
                                                 sequence_parallel=args.sequence_parallel)
                    for _ in range(args.layers))
                self.head = hvd.ColumnParallelLinear(args.hidden, VOCAB, bias=False, process_set=tp_set)
            with torch.no_grad():
                self.embed.weight.mul_(0.02)
                self.pos.weight.mul_(0.02)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            """This rank's piece of the logits, ``(batch, seq, 256 / tp)``."""
            x = self.embed(ids) + self.pos.weight[:ids.shape[1]]
            if args.sequence_parallel:
                x = hvd.scatter_to_sequence(x, tp_set)
            for block in self.blocks:
                x = block(x)
            if args.sequence_parallel:
                x = hvd.gather_from_sequence(x, tp_set, to_parallel=False)  # the norm is replicated
            return self.head(self.norm(x))

        @torch.no_grad()
        def generate(self, prompt: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
            """Sample ``count`` bytes after ``prompt``; every rank of the tensor group draws the same ones.

            The context is always the last ``--seq`` bytes (the prompt is left-padded with newlines),
            a length sequence parallelism can split.
            """
            pad = torch.full((1, max(0, args.seq - prompt.shape[1])), ord("\n"), dtype=prompt.dtype)
            out = torch.cat([pad, prompt], dim=1)
            for _ in range(count):
                logits = gather_from_group(self(out[:, -args.seq:])[:, -1], tp_set)
                probs = torch.softmax(logits / 0.8, dim=-1)
                out = torch.cat([out, torch.multinomial(probs, 1, generator=generator)], dim=1)
            return out[:, pad.shape[1]:]

    return GPT()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    import unison.torch_backend as hvd
    from unison.common.tensor_parallel import Grid

    hvd.init()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING, format="%(message)s",
                        stream=sys.stdout)
    grid = Grid(tp=args.tp or hvd.size())
    sets = grid.register()
    _, replica, _ = grid.coords(hvd.rank())
    hvd.model_parallel_manual_seed(args.seed, sets.tp)
    model = build_model(args, sets.tp)
    params = sum(p.numel() for p in model.parameters())
    logger.info("grid %r: %d data replica(s) x tensor groups of %d; %d parameters on rank 0 (one shard)",
                grid, grid.dp, grid.tp, params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if grid.dp > 1:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             process_set=sets.dp)
    data = load_corpus(args.corpus_bytes)
    split = int(len(data) * 0.9)
    train, valid = data[:split], data[split:]
    rng = np.random.default_rng([args.seed, replica])  # the tensor group's ranks draw the same batches

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm():
        for step in tqdm(range(args.steps), disable=hvd.rank() != 0, desc="train", unit="step", leave=False):
            ids, targets = batch(train, args.batch_size, args.seq, rng)
            loss = hvd.vocab_parallel_cross_entropy(model(ids), targets, process_set=sets.tp)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.log_every == 0 or step == args.steps - 1:
                mean = hvd.allreduce(loss.detach(), op=hvd.Average, process_set=sets.dp) if grid.dp > 1 else loss
                logger.info("step %4d  loss %.3f", step, mean.item())
    model.eval()
    with torch.no_grad():
        vrng = np.random.default_rng([args.seed, 1_000_003])  # every rank: the same validation windows
        ids, targets = batch(valid, 64, args.seq, vrng)
        vloss = hvd.vocab_parallel_cross_entropy(model(ids), targets, process_set=sets.tp).item()
    prompt = torch.from_numpy(np.frombuffer(b"def ", dtype=np.uint8).astype(np.int64))[None]
    sample = model.generate(prompt, args.sample_bytes, torch.Generator().manual_seed(args.seed))
    if hvd.rank() == 0:
        logger.info("validation loss: %.3f (uniform guessing: %.3f)", vloss, math.log(VOCAB))
        logger.info("sample:\n%s", bytes(sample[0].tolist()).decode("utf-8", errors="replace"))
    hvd.barrier()  # the other tensor groups may still be generating: shutting down would stop their engine
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
