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
recall@10 (a held-out item, one the user never interacted with in training, ranked among 99
random items none of the user's; ties count against it) before and after training.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where used, so that --help works without PyTorch
    import torch

    import unison.torch_backend as hvd

log = logging.getLogger("recommender")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--users", type=int, default=20000, help="users (rows of the user table)")
    p.add_argument("--items", type=int, default=500000, help="items (rows of the item table)")
    p.add_argument("--dim", type=int, default=32, help="embedding width of both tables")
    p.add_argument("--groups", type=int, default=50, help="taste groups of users")
    p.add_argument("--per-user", type=int, default=20, help="training interactions per user")
    p.add_argument("--epochs", type=int, default=3, help="passes over the interactions")
    p.add_argument("--batch", type=int, default=2048, help="global batch of (user, item) pairs")
    p.add_argument("--lr", type=float, default=0.1, help="the tables' Adagrad learning rate")
    p.add_argument("--consistency", default="bsp", choices=["bsp", "ssp", "asp"],
                   help="tables' consistency: bulk synchronous, stale synchronous (staleness 2), asynchronous")
    p.add_argument("--memory-cap-mb", type=float, default=None,
                   help="table memory per rank, MiB (unset: 75%% of the whole item table with its Adagrad state)")
    p.add_argument("--seed", type=int, default=0, help="seed for the data, the sampling and the torch RNG")
    return p.parse_args()


def generate(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(user, item) training pairs, one held-out item per user, and each user's group (same on every rank)."""
    g = np.random.default_rng(args.seed)
    group_of_user = g.integers(0, args.groups, args.users)
    # each group likes a disjoint slice of the catalogue; within it popularity is Zipf
    per_group = args.items // args.groups
    ranks = np.minimum(g.zipf(1.2, (args.users, args.per_user)) - 1, per_group - 1)
    items = group_of_user[:, None] * per_group + ranks
    users = np.repeat(np.arange(args.users), args.per_user)
    # the held-out item: the user's next draw from its group that is not among its training items (a held-out
    # item seen in training measured memory, not recommendation: 47% of them were before 2026-12-04)
    spare = group_of_user[:, None] * per_group + np.minimum(g.zipf(1.2, (args.users, 64)) - 1, per_group - 1)
    fresh = ~(spare[:, :, None] == items[:, None, :]).any(-1)
    uniform = group_of_user * per_group + g.integers(0, per_group, args.users)  # (all 64 seen: rare)
    held_out = np.where(fresh.any(1), spare[np.arange(args.users), fresh.argmax(1)], uniform)
    return np.stack([users, items.reshape(-1)], 1), held_out, group_of_user


def candidates_for(users: np.ndarray, held_out: np.ndarray, pairs: np.ndarray, args: argparse.Namespace,
                   g: np.random.Generator) -> np.ndarray:
    """Each user's held-out item, then 99 random items that are none of the user's positives."""
    positives = pairs[:, 1].reshape(args.users, args.per_user)[users]
    others = g.integers(0, args.items, (len(users), 99))
    for _ in range(100):  # redraw the few that hit a positive (the catalogue is far larger than 21 items)
        hit = (others[:, :, None] == positives[:, None, :]).any(-1) | (others == held_out[users][:, None])
        if not hit.any():
            break
        others[hit] = g.integers(0, args.items, int(hit.sum()))
    return np.concatenate([held_out[users][:, None], others], 1)


def bpr_loss(u: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    import torch

    return -torch.nn.functional.logsigmoid((u * pos).sum(-1) - (u * neg).sum(-1)).mean()


def recall_at_10(users_t: hvd.ShardedEmbedding, items_t: hvd.ShardedEmbedding, held_out: np.ndarray,
                 pairs: np.ndarray, args: argparse.Namespace) -> float:
    """Share of this job's evaluation users whose held-out item ranks in the top 10 of it plus 99 random
    items the user never interacted with; a tie counts against the held-out item.

    Raises:
        FloatingPointError: a score is not finite (a diverged model scored every user a hit before).
    """
    import torch

    import unison.torch_backend as hvd

    g = np.random.default_rng(args.seed + 1)
    users = g.choice(args.users, min(2000, args.users), replace=False)
    candidates = candidates_for(users, held_out, pairs, args, g)
    mine = np.array_split(np.arange(len(users)), hvd.size())[hvd.rank()]
    with torch.no_grad():
        u = users_t(torch.from_numpy(users[mine]))
        c = items_t(torch.from_numpy(candidates[mine]))
        scores = (u[:, None, :] * c).sum(-1)
        finite = hvd.allreduce(torch.tensor([float(torch.isfinite(scores).all())]), op=hvd.Min, name="finite")
        if not finite.item():
            raise FloatingPointError("recall@10: the model's scores are not finite (NaN or inf): training "
                                     "diverged; lower --lr")
        rank_of_held_out = (scores[:, 1:] >= scores[:, :1]).sum(1)
    hits = hvd.allreduce(torch.tensor([(rank_of_held_out < 10).sum().item(), len(mine)], dtype=torch.float64),
                         op=hvd.Sum, name="recall")
    return float(hits[0] / hits[1])


def popularity_recall_at_10(held_out: np.ndarray, pairs: np.ndarray, args: argparse.Namespace) -> float:
    """The same measure for the baseline that ranks the candidates by how often the training data holds them
    (no learning at all): what a model has to beat."""
    g = np.random.default_rng(args.seed + 1)
    users = g.choice(args.users, min(2000, args.users), replace=False)
    candidates = candidates_for(users, held_out, pairs, args, g)
    counts = np.bincount(pairs[:, 1], minlength=args.items)[candidates]
    return float(((counts[:, 1:] >= counts[:, :1]).sum(1) < 10).mean())


def _peak_rss() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    args = parse()
    import torch
    from tqdm import tqdm

    import unison.ps as ps
    import unison.torch_backend as hvd

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
    if whole <= cap:
        raise SystemExit(f"the whole item table ({whole / 2**20:.1f} MiB with its state) fits under "
                         f"--memory-cap-mb {cap / 2**20:.1f}: it could be replicated, which this example is "
                         "not about; lower the cap or raise --items")
    log.info("item table %d x %d: %.1f MiB with its Adagrad state, cap %.1f MiB per rank (%s), shard %.1f MiB",
             args.items, args.dim, whole / 2**20, cap / 2**20, "cannot replicate" if whole > cap else "fits",
             shard / 2**20)
    pairs, held_out, _ = generate(args)
    rss_before = _peak_rss()  # (the data is made: what grows from here is the tables and the training)
    init = "normal"
    users_t = hvd.ShardedEmbedding(args.users, args.dim, ps.Adagrad(args.lr), consistency, name="users",
                                   initializer=init, seed=1)
    items_t = hvd.ShardedEmbedding(args.items, args.dim, ps.Adagrad(args.lr), consistency, name="items",
                                   initializer=init, seed=2)
    before = recall_at_10(users_t, items_t, held_out, pairs, args)
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
    log.info("sampled recall@10 after training: %.3f (ranking by popularity: %.3f)",
             recall_at_10(users_t, items_t, held_out, pairs, args), popularity_recall_at_10(held_out, pairs, args))
    shard_obj = items_t.table.shard
    held = shard_obj.weights.nbytes + sum(a.nbytes for a in shard_obj.state.values())
    grown = _peak_rss() - rss_before
    log.info("memory, rank 0: the item shard holds %.1f MiB (rows and Adagrad state; the whole table %.1f MiB, "
             "cap %.1f MiB); peak RSS grew %.1f MiB from before the tables to the end of training", held / 2**20,
             whole / 2**20, cap / 2**20, grown / 2**20)
    if held > cap:
        raise SystemExit(f"the item shard holds {held / 2**20:.1f} MiB, over the cap of {cap / 2**20:.1f} MiB")
    stats = items_t.table.stats()
    log.info("item table, rank 0: %d pulls, %.1f MiB sent, %.1f MiB received, largest staleness %d",
             stats["pulls"], stats["bytes_sent"] / 2**20, stats["bytes_received"] / 2**20, stats["max_staleness"])
    users_t.table.close()
    items_t.table.close()


if __name__ == "__main__":
    main()
