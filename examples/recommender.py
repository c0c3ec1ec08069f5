"""A recommender whose item table is sharded over the ranks: matrix factorisation with BPR on implicit feedback.

    unisonrun -np 2 python examples/recommender.py
    unisonrun -np 4 python examples/recommender.py --items 2000000 --consistency ssp

The data is generated: users belong to taste groups, each group likes its own items, and
item popularity is long-tailed (Zipf), so a few keys are hot and most are cold. The user and
item embeddings are ``unison.torch_backend.ShardedEmbedding`` tables (Adagrad on the server
side); each step a rank pulls only the rows its batch touches and pushes their gradients.
``--memory-cap-mb`` is the table memory each rank may hold: the script checks that the whole
item table (rows and Adagrad state) does not fit under it while this rank's shard does, i.e.
that the table could not be replicated. It logs the BPR loss per epoch and the sampled
recall@10 (the held-out item ranked among 99 random items) before and after training.
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch
from tqdm import tqdm

import unison.ps as ps
import unison.torch_backend as hvd

log = logging.getLogger("recommender")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", type=int, default=20000)
    p.add_argument("--items", type=int, default=500000, help="rows of the item table")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--groups", type=int, default=50, help="taste groups of users")
    p.add_argument("--per-user", type=int, default=20, help="interactions per user")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=2048, help="global batch of (user, item) pairs")
    p.add_argument("--lr", type=float, default=0.1, help="the tables' Adagrad learning rate")
    p.add_argument("--consistency", default="bsp", choices=["bsp", "ssp", "asp"])
    p.add_argument("--memory-cap-mb", type=float, default=None,
                   help="table memory per rank (default: 75%% of the whole item table with its state)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def generate(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(user, item) training pairs, one held-out item per user, and each user's group (same on every rank)."""
    g = np.random.default_rng(args.seed)
    group_of_user = g.integers(0, args.groups, args.users)
    # each group likes a disjoint slice of the catalogue; within it popularity is Zipf
    per_group = args.items // args.groups
    ranks = np.minimum(g.zipf(1.2, (args.users, args.per_user + 1)) - 1, per_group - 1)
    items = group_of_user[:, None] * per_group + ranks
    users = np.repeat(np.arange(args.users), args.per_user)
    return np.stack([users, items[:, :-1].reshape(-1)], 1), items[:, -1], group_of_user


def bpr_loss(u: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    return -torch.nn.functional.logsigmoid((u * pos).sum(-1) - (u * neg).sum(-1)).mean()


def recall_at_10(users_t: hvd.ShardedEmbedding, items_t: hvd.ShardedEmbedding, held_out: np.ndarray,
                 args: argparse.Namespace) -> float:
    """Share of this job's evaluation users whose held-out item ranks in the top 10 of it plus 99 random items."""
    g = np.random.default_rng(args.seed + 1)
    users = g.choice(args.users, min(2000, args.users), replace=False)
    candidates = np.concatenate([held_out[users][:, None], g.integers(0, args.items, (len(users), 99))], 1)
    mine = np.array_split(np.arange(len(users)), hvd.size())[hvd.rank()]
    with torch.no_grad():
        u = users_t(torch.from_numpy(users[mine]))
        c = items_t(torch.from_numpy(candidates[mine]))
        scores = (u[:, None, :] * c).sum(-1)
        rank_of_held_out = (scores[:, 1:] > scores[:, :1]).sum(1)
    hits = hvd.allreduce(torch.tensor([(rank_of_held_out < 10).sum().item(), len(mine)], dtype=torch.float64),
                         op=hvd.Sum, name="recall")
    return float(hits[0] / hits[1])


def main() -> None:
    args = parse()
    hvd.init()
    logging.basicConfig(level=logging.INFO if hvd.rank() == 0 else logging.WARNING, format="%(message)s")
    torch.manual_seed(args.seed)
    consistency = {"bsp": ps.BSP(), "ssp": ps.SSP(2), "asp": ps.ASP()}[args.consistency]
    whole = args.items * args.dim * 4 * 2  # rows + Adagrad's sums, float32
    cap = (args.memory_cap_mb or 0.75 * whole / 2**20) * 2**20
    shard = -(-args.items // hvd.size()) * args.dim * 4 * 2
    if shard > cap:
        raise SystemExit(f"this rank's item shard needs {shard / 2**20:.1f} MiB > --memory-cap-mb "
                         f"{cap / 2**20:.1f}: run on more ranks or raise the cap")
    log.info("item table %d x %d: %.1f MiB with its Adagrad state, cap %.1f MiB per rank (%s), shard %.1f MiB",
             args.items, args.dim, whole / 2**20, cap / 2**20, "cannot replicate" if whole > cap else "fits",
             shard / 2**20)
    init = "normal"
    users_t = hvd.ShardedEmbedding(args.users, args.dim, ps.Adagrad(args.lr), consistency, name="users",
                                   initializer=init, seed=1)
    items_t = hvd.ShardedEmbedding(args.items, args.dim, ps.Adagrad(args.lr), consistency, name="items",
                                   initializer=init, seed=2)
    pairs, held_out, _ = generate(args)
    before = recall_at_10(users_t, items_t, held_out, args)
    log.info("sampled recall@10 before training: %.3f (chance: 0.100)", before)
    local = args.batch // hvd.size()
    g = np.random.default_rng(args.seed + 2)
    for epoch in range(args.epochs):
        order = g.permutation(len(pairs))
        steps = len(order) // args.batch
        total, start = 0.0, time.perf_counter()
        bar = tqdm(range(steps), desc=f"epoch {epoch + 1}", disable=hvd.rank() != 0, leave=False)
        for step in bar:
            rows = order[step * args.batch + hvd.rank() * local:step * args.batch + (hvd.rank() + 1) * local]
            batch = torch.from_numpy(pairs[rows])
            negatives = torch.from_numpy(g.integers(0, args.items, local))  # the same draw on every rank
            loss = bpr_loss(users_t(batch[:, 0]), items_t(batch[:, 1]), items_t(negatives))
            loss.backward()
            users_t.synchronize()
            items_t.synchronize()
            total += loss.item()
        mean = hvd.allreduce(torch.tensor(total / max(steps, 1)), name="loss").item()
        log.info("epoch %d: BPR loss %.4f, %.0f steps/s", epoch + 1, mean, steps / (time.perf_counter() - start))
    log.info("sampled recall@10 after training: %.3f", recall_at_10(users_t, items_t, held_out, args))
    stats = items_t.table.stats()
    log.info("item table, rank 0: %d pulls, %.1f MiB sent, %.1f MiB received, largest staleness %d",
             stats["pulls"], stats["bytes_sent"] / 2**20, stats["bytes_received"] / 2**20, stats["max_staleness"])
    users_t.table.close()
    items_t.table.close()


if __name__ == "__main__":
    main()
