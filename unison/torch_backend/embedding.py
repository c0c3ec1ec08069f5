"""``ShardedEmbedding``: an ``nn.Module`` whose table lives sharded over the ranks (unison.ps).

The forward pulls the rows of the batch's unique ids from the table and gathers them into the
output; autograd sums the gradient of duplicate ids into those unique rows, and a hook pushes
it to the table when ``backward()`` ends (asynchronously: the dense gradients' all-reduces and the
push overlap). The table's own optimizer applies it on the server side, so the table is never a
parameter of the model: ``unison.torch_backend.DistributedOptimizer`` all-reduces the dense
parameters and its ``synchronize()``/``step()`` also waits for the pushes. See docs/embeddings.md.

[Note: one push per optimizer step]
The table's optimizer steps once per push, so a table is pushed once per optimizer step, as a
dense ``nn.Embedding``'s optimizer steps once on the gradient summed over every lookup and
backward pass. Each lookup's hook only keeps its rows' gradient; a callback queued on the
autograd engine (the first hook of a backward queues it) runs when that backward ends and pushes
everything kept as one push (the table sums duplicate keys), once every ``backward_passes_per_step``
passes ([Note: the passes of the optimizer that trains the table]); ``synchronize()`` pushes whatever is
left. The kept gradients, the pass count and the callback belong to the *table* (:class:`_Steps`), not
to a module: every module looking into one table (``table=``, e.g. a user tower and an item tower
sharing one table) adds to the same push. Before 2026-12-06 each lookup pushed on its own, and until
2026-12-07 each module kept its own gradients: two modules on one table, a module called twice in a
step, or a step of two backward passes stepped Adagrad or Adam two or more times per step and differed
from one process (SGD does not see the difference).

[Note: a failed backward pass]
A backward pass may raise after a lookup's hook kept its rows (a later hook or the loss's own graph fails,
and the loop catches it and skips the batch); torch then drops the callbacks queued on it. So the rows
are kept per backward pass (its autograd graph task, ``torch._C._current_graph_task_id()``): each pass
queues its own callback, which moves only that pass's rows into the step, and the rows of a pass whose
callback torch dropped are discarded when torch releases it (a weakref finalizer; measured on CPU: before
``backward()`` re-raises) with a warning, or at the latest in ``synchronize()``. A failed pass counts no pass
(nor does one whose count of passes raises in the callback: its rows go with it). A pass still running
when another starts keeps its rows: a reentrant checkpoint's backward runs nested in a running pass. Until
2026-12-07 one flag said a callback was queued: it stayed set after a failed pass, so no later pass queued
one, the table was never pushed again under a plain torch optimizer, and the next ``synchronize()`` pushed
every pass since, the failed one's rows included.

[Note: the passes of the optimizer that trains the table]
How many backward passes make a step is the ``backward_passes_per_step`` of the ``DistributedOptimizer``
that trains the model. Every ``DistributedOptimizer`` registers itself when made
(:func:`follow_backward_passes`; the count is read from it when a backward pass ends, so its setter
needs nothing more). When a backward pass through the table ends, the optimizers that train it are
the live ones whose parameters got a gradient since their last step (their gradient hooks counted
it; without hooks, in one process, their ``.grad`` is set): the table takes their count, or 1 when
there is none (a plain torch optimizer). If they disagree the count is ambiguous: a RuntimeError on
every rank (all run the same passes) says so. (Each optimizer's ``synchronize()`` still pushes what every
table has kept: step an optimizer that does not train a table between that table's passes and it is
pushed early.) Before 2026-12-07 the count was one process-wide value, set by the last optimizer
made: an unrelated optimizer made later (another model's, count 1) made a count-2 model's table
push twice per step.

[Note: loss scaling is refused]
torch's ``GradScaler`` scales the loss, unscales the dense gradients in ``scaler.step`` and skips
steps whose gradients overflowed. The table is pushed when ``backward()`` ends, before either, so it
would get the scaled gradient (x1024 at ``init_scale=1024``) and the skipped steps too. The module
refuses it instead: when the first ShardedEmbedding is made, ``GradScaler.scale`` is wrapped to mark
the backward passes that start from a scaled loss (a pre-hook on its ``grad_fn``, by autograd graph
task), and a row gradient arriving in such a pass raises a RuntimeError before anything is kept or
pushed; every rank scales the same losses, so every rank raises. A loss scaled by hand cannot be seen.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import numpy as np
import torch

from unison.common.ps import Handle, ShardedTable

__all__ = ["ShardedEmbedding", "synchronize_embeddings"]

logger = logging.getLogger(__name__)

_live: weakref.WeakSet[ShardedEmbedding] = weakref.WeakSet()
#: live DistributedOptimizers ([Note: the passes of the optimizer that trains the table])
_optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
#: each table's gradients between pushes, shared by its modules ([Note: one push per optimizer step])
_steps: weakref.WeakKeyDictionary[ShardedTable, _Steps] = weakref.WeakKeyDictionary()
#: autograd graph tasks started from a GradScaler-scaled loss -> the scaler ([Note: loss scaling is refused])
_scaled: dict[int, Any] = {}
_SCALER_HOOKED = False


def follow_backward_passes(optimizer: Any) -> None:
    """Register a ``DistributedOptimizer`` (it calls this when made): the tables it trains push once every
    ``optimizer.backward_passes_per_step`` passes; see [Note: the passes of the optimizer that trains the
    table]."""
    _optimizers.add(optimizer)


def _trains_now(optimizer: Any) -> bool:
    """Whether ``optimizer``'s parameters got a gradient since its last step: its gradient hooks count
    them down (``_delay``; ZeRO-2 flags ``_backward_pending``); an optimizer without hooks (one process)
    has a ``.grad`` set."""
    if getattr(optimizer, "_backward_pending", False):
        return True
    if getattr(optimizer, "_hooks", None):
        passes = optimizer.backward_passes_per_step
        return any(left < passes for left in optimizer._delay.values())
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


class _Steps:
    """One table's row gradients between its pushes, shared by every module looking into it: [Note: one
    push per optimizer step]. It holds no reference to the table (the table is passed in)."""

    def __init__(self) -> None:
        self.kept: list[tuple[np.ndarray, np.ndarray]] = []  # rows' gradients of ended passes, not pushed yet
        self.passes = 0  # backward passes whose gradients are kept
        #: autograd graph task -> its rows' gradients while that pass runs ([Note: a failed backward pass])
        self.running: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        self.pending: list[Handle] = []

    def keep(self, table: ShardedTable, keys: np.ndarray, rows: np.ndarray) -> None:
        task = torch._C._current_graph_task_id()
        if task not in self.running:  # this backward's first rows: pushed (or kept) when it ends
            self.running[task] = []
            ended = _PassEnded(self, table, task)
            # torch drops the callback of a backward pass that raises: its rows go with it (Note)
            weakref.finalize(ended, self.forget, table.name, task).atexit = False
            torch.autograd.Variable._execution_engine.queue_callback(ended)
        self.running[task].append((keys, rows))

    def _backward_ended(self, table: ShardedTable, task: int) -> None:
        rows = self.running.pop(task, [])
        count = self.passes_per_step(table.name)  # (raises: this pass fails, its rows dropped with it)
        self.kept.extend(rows)
        self.passes += 1
        if self.passes >= count:
            self.flush(table)

    def forget(self, name: str, task: int) -> None:
        """Drop the rows of backward pass ``task`` if it never ended ([Note: a failed backward pass])."""
        rows = self.running.pop(task, None)
        if rows:
            logger.warning("ShardedEmbedding table %r: a backward pass raised after %d lookup(s) of it had their "
                           "rows' gradient; those rows are dropped, not pushed", name, len(rows))

    def passes_per_step(self, name: str) -> int:
        """[Note: the passes of the optimizer that trains the table]

        Raises:
            RuntimeError: optimizers with different ``backward_passes_per_step`` train the table now.
        """
        counts = sorted({int(o.backward_passes_per_step) for o in list(_optimizers) if _trains_now(o)})
        if len(counts) > 1:
            raise RuntimeError(
                f"ShardedEmbedding table {name!r}: the DistributedOptimizers that got gradients in this backward "
                f"pass have different backward_passes_per_step ({counts}), so the table cannot tell after how "
                "many passes to push; give them the same backward_passes_per_step, or train the table's model "
                "with one optimizer")
        return counts[0] if counts else 1

    def flush(self, table: ShardedTable) -> None:
        """Push the kept gradients as one push (duplicate keys summed by the table)."""
        kept, self.kept, self.passes = self.kept, [], 0
        for handle in [h for h in self.pending if h.done()]:  # (kept short under any optimizer; errors raised)
            self.pending.remove(handle)
            handle.wait()
        if kept:
            keys = np.concatenate([k for k, _ in kept])
            rows = np.concatenate([g for _, g in kept])
            self.pending.append(table.push_async(keys, rows))

    def synchronize(self, table: ShardedTable) -> None:
        if torch._C._current_graph_task_id() < 0:  # (outside a backward pass, none of them runs any more)
            for task in list(self.running):
                self.forget(table.name, task)
        self.flush(table)
        pending, self.pending = self.pending, []
        for handle in pending:
            handle.wait()


class _PassEnded:
    """The callback queued on the autograd engine when a backward pass first keeps a table's rows: runs when
    that pass ends ([Note: one push per optimizer step]); dropped by torch when it raises ([Note: a failed
    backward pass])."""

    def __init__(self, steps: _Steps, table: ShardedTable, task: int) -> None:
        self.steps, self.table, self.task = steps, table, task

    def __call__(self) -> None:
        self.steps._backward_ended(self.table, self.task)


def _hook_grad_scaler() -> None:
    """Wrap ``torch.amp.GradScaler.scale`` (once, when the first ShardedEmbedding is made) to mark the backward
    passes of scaled losses: [Note: loss scaling is refused]. Subclasses (``unison.torch_backend.GradScaler``,
    ``torch.cuda.amp.GradScaler``) inherit it."""
    global _SCALER_HOOKED
    if _SCALER_HOOKED:
        return
    original = torch.amp.GradScaler.scale

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        scaled = original(self, outputs)
        if self.is_enabled():
            _mark_scaled(scaled, self)
        return scaled

    torch.amp.GradScaler.scale = scale
    _SCALER_HOOKED = True


def _mark_scaled(outputs: Any, scaler: Any) -> None:
    if isinstance(outputs, (list, tuple)):
        for output in outputs:
            _mark_scaled(output, scaler)
    elif isinstance(outputs, torch.Tensor) and outputs.grad_fn is not None:
        outputs.grad_fn.register_prehook(functools.partial(_scaled_backward_starts, scaler))


def _scaled_backward_starts(scaler: Any, grad_outputs: Any) -> None:
    task = torch._C._current_graph_task_id()
    _scaled[task] = scaler
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _scaled.pop(task, None))


def _refuse_scaled(name: str) -> None:
    """Raise when this backward pass started from a GradScaler-scaled loss: [Note: loss scaling is refused]."""
    scaler = _scaled.pop(torch._C._current_graph_task_id(), None) if _scaled else None
    if scaler is not None:  # (popped: the failed backward runs no callback)
        raise RuntimeError(
            f"ShardedEmbedding {name!r} cannot train under a GradScaler (loss scale {scaler.get_scale()}): its "
            "rows' gradient is pushed to the table when backward() ends, before the scaler unscales it or skips "
            "an overflowed step, so the table would take the scaled gradient. Train without loss scaling (a "
            "bfloat16 autocast needs none), or keep the GradScaler for a model without ShardedEmbedding")


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
        self._steps = _steps.setdefault(table, _Steps())  # shared: [Note: one push per optimizer step]
        _live.add(self)
        _hook_grad_scaler()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keys = ids.detach().cpu().reshape(-1)
        keys_np = (keys.float() if keys.dtype == torch.bfloat16 else keys).numpy()
        if keys_np.dtype.kind not in "iu" and keys_np.size:
            # the table's own check raises it on every rank (BSP: in the round the others are in; SSP/ASP:
            # posted to them); raised here alone (before 2026-12-05) it left the other ranks in the round
            self.table.pull(keys_np)
            raise TypeError(f"ShardedEmbedding: ids must be integers; got {ids.dtype}. Cast with ids.long()")
        # an empty batch is accepted whatever its dtype (torch.tensor([]) is float32: no samples this step)
        # uint64 ids go to the table's check uncast (cast first, 2**64-1 was refused as "key -1" until 2026-12-07)
        flat = keys_np if keys_np.dtype == np.uint64 else keys_np.astype(np.int64, copy=False)
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = torch.from_numpy(self.table.pull(unique))
        unique = unique.astype(np.int64, copy=False)  # (in range now: the pull checked them)
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            rows.register_hook(lambda grad, keys=unique: self._push(keys, grad))
        out = rows[torch.from_numpy(inverse.reshape(-1))]
        return out.reshape(*ids.shape, self.embedding_dim).to(ids.device)

    def _push(self, keys: np.ndarray, grad: torch.Tensor) -> None:
        _refuse_scaled(self.table.name)  # [Note: loss scaling is refused]
        # a copy: the push reads it later, and autograd may add into this very buffer meanwhile
        # (a second backward through the same forward accumulates into the rows' .grad in place)
        rows = grad.detach().cpu().numpy()
        self._steps.keep(self.table, keys, rows.copy() if grad.device.type == "cpu" else rows)

    def synchronize(self) -> None:
        """Push the table's gradients kept so far (from every module looking into it) and wait until its
        pushes are done (raises a push's error)."""
        self._steps.synchronize(self.table)

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
