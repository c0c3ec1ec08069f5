"""``ShardedEmbedding``: an ``nn.Module`` whose table lives sharded over the ranks (unison.ps).

The forward pulls the rows of the batch's unique ids from the table and gathers them into the
output; autograd sums the gradient of duplicate ids into those unique rows, and a hook pushes
it to the table when ``backward()`` ends (asynchronously: the dense gradients' all-reduces and the
push overlap). The table's own optimizer applies it on the server side, so the table is never a
parameter of the model: ``unison.torch_backend.DistributedOptimizer`` all-reduces the dense
parameters and its ``synchronize()``/``step()`` also waits for the pushes. See docs/embeddings.md.

[Note: one push per optimizer step]
The table's optimizer steps once per push, so a module pushes once per optimizer step, as a
dense ``nn.Embedding``'s optimizer steps once on the gradient summed over every lookup and
backward pass. Each lookup's hook only keeps its rows' gradient; a callback queued on the
autograd engine (the first hook of a backward queues it) runs when that backward ends and pushes
everything kept as one push (the table sums duplicate keys), once every ``backward_passes_per_step``
passes of the last ``DistributedOptimizer`` made (:func:`follow_backward_passes`); its
``synchronize()`` pushes whatever is left. Before 2026-12-06 each lookup pushed on its own: a
module called twice in a step, or a step of two backward passes, stepped Adagrad or Adam twice
and differed from one process (SGD does not see the difference).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from unison.common.ps import Handle, ShardedTable

__all__ = ["ShardedEmbedding", "synchronize_embeddings"]

_live: weakref.WeakSet[ShardedEmbedding] = weakref.WeakSet()
#: backward passes per optimizer step: a module pushes after this many (:func:`follow_backward_passes`)
_passes_per_step = 1


def follow_backward_passes(passes: int) -> None:
    """Make every ShardedEmbedding push once every ``passes`` backward passes (a ``DistributedOptimizer``'s
    ``backward_passes_per_step``: it calls this when made or changed); see [Note: one push per optimizer step]."""
    global _passes_per_step
    _passes_per_step = int(passes)

_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


class ShardedEmbedding(torch.nn.Module):
    """An embedding lookup into a :class:`unison.ps.ShardedTable` of ``num_rows x embedding_dim``.

    Collective to create (every rank of the table, the same arguments). ``forward(ids)`` takes an
    integer tensor of any shape and returns ``ids.shape + (embedding_dim,)``. In training mode
    (and with grad enabled) the rows' gradient is pushed in ``backward()``; in ``eval()`` or under
    ``torch.no_grad()`` the forward only pulls. Under BSP (the default) every rank must run the
    same number of training forwards and backwards (the pushes are collective).

    Args:
        num_rows, embedding_dim: the table's shape.
        optimizer: the table's server-side optimizer (``unison.ps.SGD``/``Adagrad``/``Adam``).
        consistency: ``"bsp"`` (default), ``unison.ps.SSP(s)`` or ``"asp"``.
        dtype: ``torch.float32`` (default) or ``torch.float64``.
        table: an existing table to look into (then the other table arguments are ignored).
        **table_kwargs: ``sharding``, ``initializer``, ``seed``, ``name``, ``servers``,
            ``average``, ``process_set`` of :class:`unison.ps.ShardedTable`.
    """

    def __init__(self, num_rows: int, embedding_dim: int, optimizer: Any = None, consistency: Any = "bsp",
                 dtype: torch.dtype = torch.float32, table: ShardedTable | None = None,
                 **table_kwargs: Any) -> None:
        super().__init__()
        problem = None if dtype in _DTYPES else f"ShardedEmbedding(dtype={dtype}): rows are torch.float32 or " \
                                                "torch.float64"
        if table is None:  # (raised on every rank with the table's checks: refused here alone, it hung the others)
            table = ShardedTable(num_rows, embedding_dim, _DTYPES.get(dtype, "float32"), optimizer=optimizer,
                                 consistency=consistency, refuse=problem, **table_kwargs)
        elif problem is not None:
            raise TypeError(problem)
        self.table = table
        self.num_rows, self.embedding_dim = self.table.num_rows, self.table.dim
        self._pending: list[Handle] = []
        self._kept: list[tuple[np.ndarray, np.ndarray]] = []  # rows' gradients not pushed yet (see the Note)
        self._passes = 0  # backward passes whose gradients are kept
        self._queued = False  # the end-of-backward callback is queued
        _live.add(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keys = ids.detach().cpu().reshape(-1)
        keys_np = (keys.float() if keys.dtype == torch.bfloat16 else keys).numpy()
        if keys_np.dtype.kind not in "iu" and keys_np.size:
            # the table's own check raises it on every rank (BSP: in the round the others are in; SSP/ASP:
            # posted to them); raised here alone (before 2026-12-05) it left the other ranks in the round
            self.table.pull(keys_np)
            raise TypeError(f"ShardedEmbedding: ids must be integers; got {ids.dtype}. Cast with ids.long()")
        # an empty batch is accepted whatever its dtype (torch.tensor([]) is float32: no samples this step)
        flat = keys_np.astype(np.int64, copy=False)
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = torch.from_numpy(self.table.pull(unique))
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(lambda grad, keys=unique: self._push(keys, grad))
        out = rows[torch.from_numpy(inverse.reshape(-1))]
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def _push(self, keys: np.ndarray, grad: torch.Tensor) -> None:
        # a copy: the push reads it later, and autograd may add into this very buffer meanwhile
        # (a second backward through the same forward accumulates into the rows' .grad in place)
        rows = grad.detach().cpu().numpy()
        self._kept.append((keys, rows.copy() if grad.device.type == "cpu" else rows))
        if not self._queued:  # pushed when this backward ends: [Note: one push per optimizer step]
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        self._queued = False
        self._passes += 1
        if self._passes >= _passes_per_step:
            self._flush()

    def _flush(self) -> None:
        """Push the kept gradients as one push (duplicate keys summed by the table)."""
        kept, self._kept, self._passes = self._kept, [], 0
        for handle in [h for h in self._pending if h.done()]:  # (kept short under any optimizer; errors raised)
            self._pending.remove(handle)
            handle.wait()
        if kept:
            keys = np.concatenate([k for k, _ in kept])
            rows = np.concatenate([g for _, g in kept])
            self._pending.append(self.table.push_async(keys, rows))

    def synchronize(self) -> None:
        """Push the gradients kept so far and wait until this module's pushes are done (raises a push's error)."""
        self._flush()
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()

    def save(self, path: Any, metadata: dict[str, Any] | None = None) -> Any:
        """Save the table (rows and optimizer state) to the folder ``path``. Collective."""
        self.synchronize()
        return self.table.save(path, metadata)

    def load(self, path: Any) -> dict[str, Any]:
        """Load the table from ``path`` (saved on any number of ranks). Collective."""
        self.synchronize()
        return self.table.load(path)

    def __getstate__(self) -> dict[str, Any]:
        # torch.save(model) and copy.deepcopy pickle the module, and the table's communicators cannot be:
        # say what to do instead of "cannot pickle 'module' object"
        raise TypeError(f"ShardedEmbedding {self.table.name!r} cannot be pickled or copied (its rows live in a "
                        "sharded table over the ranks): save the model's state_dict() with torch.save, which "
                        "leaves the table out, and the table with emb.save(path) (emb.load(path) reads it back, "
                        "on any number of ranks)")

    def extra_repr(self) -> str:
        return f"{self.num_rows}, {self.embedding_dim}, table={self.table!r}"


def synchronize_embeddings() -> None:
    """Wait for every live ShardedEmbedding's pushes (``DistributedOptimizer.synchronize()`` calls this)."""
    for module in list(_live):
        module.synchronize()
