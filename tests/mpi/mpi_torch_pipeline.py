"""The PyTorch pipeline under mpirun: the same parameters as one process, and errors on every rank."""

from __future__ import annotations

import bisect
import copy
import itertools

import pytest
import torch
from mpi4py import MPI
from torch import nn

import unison.torch_backend as hvd
from unison.common.pipeline import SCHEDULES, simulate

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
CHUNKS, BATCH, STEPS = 4, 8, 3
torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


def make_layers(dropout=False, seed=0):
    """Eight layers (enough for 8 stages); a Dropout as layer 3 when asked."""
    torch.manual_seed(seed)
    return [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3) if dropout else nn.Tanh(),
            nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4), nn.Linear(4, 1)]


def batch(step, replica=0):
    g = torch.Generator().manual_seed(100 * replica + step)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 1, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference_losses(model, batches, chunks):
    """Train ``model`` in this process; ``chunks`` None: whole batches, else microbatch by microbatch.

    Microbatches draw dropout masks one microbatch at a time in microbatch order, as the
    pipeline's dropout stage does, so with the same seed both draw the same masks.
    """
    opt, losses = sgd(model.parameters()), []
    for x, y in batches:
        opt.zero_grad()
        if chunks is None:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        else:
            total = 0.0
            for xs, ys in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
                part = nn.functional.mse_loss(model(xs), ys) / chunks
                part.backward()
                total += part.item()
            losses.append(total)
        opt.step()
    return losses


def assert_same_as_reference(pipe, ref, losses, ref_losses):
    layers = list(ref)
    for s, span in pipe.layer_ranges.items():
        mine = dict(pipe.stages[s].named_parameters())
        theirs = dict(nn.Sequential(*layers[span.start:span.stop]).named_parameters())
        assert mine.keys() == theirs.keys()
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-5, msg=f"stage {s} {name}")
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert all(e == losses for e in WORLD.allgather(losses))  # the loss is broadcast to every rank


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_k_steps_equal_one_process_with_dropout(name, checkpoint):
    v = 2 if name == "interleaved" else 1
    layers = make_layers(dropout=True)
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, chunks=CHUNKS, schedule=name, virtual_stages=v, checkpoint=checkpoint,
                        loss_fn=nn.functional.mse_loss, optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    torch.manual_seed(123)  # the dropout stage's masks ...
    losses = [pipe.train_step(x, y) for x, y in batches]
    torch.manual_seed(123)  # ... are the reference's, microbatch by microbatch
    ref_losses = reference_losses(ref, batches, CHUNKS)
    assert_same_as_reference(pipe, ref, losses, ref_losses)
    sim = simulate(pipe.schedule)
    assert pipe.stats.peak_per_stage == {s: sim.peak_activations[s] for s in pipe.stages}
    # where the activations are actually kept: as many at once as the schedule says
    assert pipe.live_peak_per_stage == {s: sim.peak_activations[s] for s in pipe.stages}
    pipe.close()


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_k_steps_equal_one_process_on_whole_batches(name):
    layers = make_layers()
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(nn.Sequential(*layers), chunks=CHUNKS, schedule=name, loss_fn=nn.functional.mse_loss,
                        optimizer=sgd)
    assert pipe.balance == hvd.balance_by_params(ref, N)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, batches, None))
    pipe.close()


@pytest.mark.skipif(N != 4, reason="the data x pipeline grid needs 4 ranks")
@pytest.mark.parametrize("name, checkpoint", [("gpipe", "always"), ("1f1b", "never"),
                                              ("interleaved", "except_last"), ("zb-h1", "never"),
                                              ("zb-h1", "always")])
def test_dp2_x_pp2_grid_equals_one_process_on_the_global_batch(name, checkpoint):
    grid = hvd.pipeline_grid(pp=2, dp=2)
    assert (grid.pipeline, grid.position) == (R // 2, R % 2) and grid.data_set.ranks == [R % 2, R % 2 + 2]
    ref = nn.Sequential(*copy.deepcopy(make_layers()))
    layers = make_layers(seed=grid.pipeline)  # pipeline 1 starts elsewhere: the pipeline broadcasts pipeline 0's
    v = 2 if name == "interleaved" else 1
    pipe = hvd.Pipeline(layers, balance=[3, 5] if v == 1 else [2, 2, 2, 2], chunks=CHUNKS, schedule=name,
                        virtual_stages=v, checkpoint=checkpoint, grid=grid, loss_fn=nn.functional.mse_loss,
                        optimizer=sgd)
    losses, global_batches = [], []
    for k in range(STEPS):
        parts = [batch(k, replica) for replica in range(2)]
        losses.append(pipe.train_step(*parts[grid.pipeline]))
        global_batches.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, global_batches, None))
    pipe.close()


def test_numpy_batches_train_like_tensors():
    pipes = [hvd.Pipeline(make_layers(), chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
             for _ in range(2)]
    x, y = batch(0)
    assert pipes[0].train_step(x.numpy(), y.numpy()) == pipes[1].train_step(x, y)
    for a, b in zip(pipes[0].parameters(), pipes[1].parameters(), strict=True):
        assert torch.equal(a, b)
    with pipes[0], pipes[1]:  # a context manager closes them
        pass
    pipes[0].close()  # closing twice is harmless


def test_predict_and_evaluate_run_forward_only_with_dropout_off():
    layers = make_layers(dropout=True)
    ref = nn.Sequential(*copy.deepcopy(layers)).eval()
    pipe = hvd.Pipeline(layers, chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    x, y = batch(0)
    out = pipe.predict(x)
    with torch.no_grad():
        expected = ref(x)
    if pipe.holds_last:
        torch.testing.assert_close(out, expected)
    else:
        assert out is None
    assert pipe.evaluate(x, y) == pytest.approx(nn.functional.mse_loss(expected, y).item(), rel=1e-6)
    pipe.train_step(x, y)  # training still works after evaluation
    pipe.close()


class _TrimPadding(nn.Module):
    """Keeps the columns up to the batch's last non-zero one: a width that differs between microbatches."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :int((x != 0).any(0).nonzero().max()) + 1]


def test_predict_of_outputs_that_cannot_be_joined_raises_on_every_rank():
    """The microbatches' outputs were joined after the step on the last stage's ranks alone: a shape that
    differs between microbatches raised there while the others returned None (found by an audit,
    2026-12-07)."""
    pipe = hvd.Pipeline([nn.Identity()] * max(1, N - 1) + [_TrimPadding()], balance=[1] * max(2, N), chunks=2,
                        loss_fn=nn.functional.mse_loss)
    x = torch.zeros(4, 5)
    x[0, :4], x[2, :2] = 1, 1  # microbatch 0 keeps 4 columns, microbatch 1 keeps 2
    raised_everywhere(lambda: pipe.predict(x), "predict()'s joining of the last stage's microbatch outputs")
    x[2, :4] = 1
    out = pipe.predict(x)  # and the next call pairs
    if pipe.holds_last:
        torch.testing.assert_close(out, x[:, :4])
    pipe.close()


def raised_everywhere(fn, *parts):
    """``fn()`` raises PipelineError (a ValueError) with the same message on every rank, containing ``parts``."""
    with pytest.raises(hvd.PipelineError) as info:
        fn()
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert all(e == message for e in WORLD.allgather(message)), message
    for part in parts:
        assert part in message, message
    return message


def test_a_grid_that_is_no_pipeline_grid_is_refused_on_every_rank_naming_the_fix():
    """Before 2026-12-07 the tensor-parallel Grid raised AttributeError "... no attribute 'position'" (the
    Keras executor had the same defect; one check in unison.common.pipeline.grid serves both)."""
    from unison.common.tensor_parallel import Grid

    for grid, says in ((Grid(pp=N), f"received the tensor-parallel Grid(dp=1, pp={N}, tp=1). Pass "
                                    "grid=grid_pipeline(grid, sets)"),
                       (N, f"grid= takes a PipelineGrid: hvd.pipeline_grid(pp, dp), or grid_pipeline(grid, sets) "
                           f"for a tensor-parallel Grid; received int {N}")):
        with pytest.raises(TypeError) as info:
            hvd.Pipeline(make_layers(), chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd, grid=grid)
        message = str(info.value)
        assert says in message and all(e == message for e in WORLD.allgather(message)), message


def test_bad_configurations_raise_on_every_rank():
    def build(**kwargs):
        args = dict(chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
        return hvd.Pipeline(make_layers(), **{**args, **kwargs})

    bad = [1] * (N - 1) + [10 - N]  # sums to 9
    raised_everywhere(lambda: build(balance=bad), f"balance {bad} sums to 9 but the model has 8 layers",
                      "sum to 8")
    v = 8 // N + 1
    raised_everywhere(lambda: build(schedule="interleaved", virtual_stages=v),
                      f"the model has 8 layers, too few for {N * v} stages")
    raised_everywhere(lambda: build(balance=[1] * (N - 1) + [2, 7 - N]), f"has {N + 1} stages, more stages than")
    raised_everywhere(lambda: hvd.pipeline_grid(pp=N + 1),
                      f"needs pp * dp = {N + 1} ranks, more than the job's {N}")
    if N > 1:  # interleaved needs a multiple of p microbatches: fewer than p cannot run
        raised_everywhere(lambda: build(schedule="interleaved", virtual_stages=2, chunks=1),
                          f"interleaved needs num_microbatches (1) to be a multiple of the number of ranks ({N})")
    raised_everywhere(lambda: build(checkpoint="sometimes"),
                      "checkpoint must be one of never, always, except_last")
    # a summed loss trained at 1/chunks of its step, silently (found by an audit, 2026-12-05)
    raised_everywhere(lambda: build(loss_fn=nn.MSELoss(reduction="sum")), "has reduction='sum'")


@pytest.mark.skipif(N == 1, reason="needs ranks that disagree")
def test_arguments_that_differ_between_ranks_raise_on_every_rank():
    def build(**kwargs):
        args = dict(chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
        return hvd.Pipeline(make_layers(), **{**args, **kwargs})

    mine = [1] * (N - 1) + [9 - N] if R == 0 else [2] + [1] * (N - 2) + [8 - N]
    raised_everywhere(lambda: build(balance=mine), "built with different arguments on different ranks",
                      f"balance: rank 0 {[1] * (N - 1) + [9 - N]!r}, rank 1 {[2] + [1] * (N - 2) + [8 - N]!r}")
    raised_everywhere(lambda: build(chunks=CHUNKS if R else 2 * CHUNKS),
                      f"chunks: rank 0 {2 * CHUNKS}, rank 1 {CHUNKS}")


def test_balance_by_time_is_the_same_on_every_rank():
    layers = make_layers()
    if R == 1:
        layers[0] = nn.Sequential(*[nn.Linear(6, 6) for _ in range(200)], layers[0])  # slower here only
    balance = hvd.balance_by_time(layers, torch.randn(4, 6), N)
    assert WORLD.allgather(balance) == [balance] * N and sum(balance) == 8


def test_bad_batches_raise_on_every_rank_and_the_next_step_works():
    pipe = hvd.Pipeline(make_layers(), chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    x, y = batch(0)
    first, last = R == 0, R == pipe.schedule.stage_rank(pipe.schedule.num_stages - 1)
    raised_everywhere(lambda: pipe.train_step(x.tolist() if first else x, y),
                      "inputs must be a torch.Tensor or a numpy array; received list")
    if N > 1:
        raised_everywhere(lambda: pipe.train_step(x, y[:4] if last else y),
                          "microbatch 0 reaches the last stage with 2 rows but its targets have 1 rows",
                          "pass targets with as many rows as the inputs")
    raised_everywhere(lambda: pipe.train_step(x[:7], y[:7]),
                      "rank 0: inputs has a batch of 7 rows, which 4 microbatches (chunks=4) do not divide; "
                      "use a batch that is a multiple of 4 (e.g. 4 or 8)")
    raised_everywhere(lambda: pipe.train_step(None, y), "rank 0: inputs must be a batch (an array or tensor) "
                      "on the rank holding stage 0; received None")
    before = [p.detach().clone() for p in pipe.parameters()]
    pipe.train_step(x, y)
    assert all(not torch.equal(a, b) for a, b in zip(before, pipe.parameters(), strict=True))
    pipe.close()


class GrowsOnThirdCall(nn.Module):
    """An identity that returns one extra row on its third call."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.cat([x, x[:1]]) if self.calls == 3 else x


@pytest.mark.skipif(N == 1, reason="one stage sends nothing")
def test_a_stage_output_changing_shape_raises_on_every_rank():
    layers = [GrowsOnThirdCall(), *make_layers()]
    pipe = hvd.Pipeline(layers, balance=[2] + [1] * (N - 2) + [9 - N], chunks=CHUNKS,
                        loss_fn=nn.functional.mse_loss, optimizer=sgd)
    x, y = batch(0)
    raised_everywhere(lambda: pipe.train_step(x, y),
                      "pipeline step failed on rank 0 at F2@s0 (forward of stage 0, microbatch 2): the output of "
                      "stage 0 for microbatch 2 is (3, 16) float32 but microbatch 0 gave (2, 16) float32",
                      "make every microbatch the same size")
    pipe.train_step(x, y)
    pipe.close()


# ------------------------------------------------------------------ found by an audit (2026-12-04)
D64 = torch.float64


def batch64(k, rows=8, width=6):
    g = torch.Generator().manual_seed(k)
    return torch.randn(rows, width, generator=g, dtype=D64), torch.randn(rows, width, generator=g, dtype=D64)


@pytest.mark.skipif(N != 2, reason="two stages")
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_a_module_used_twice_in_one_stage_trains_as_one_process(name):
    """Tied weights inside a stage: zb-h1 splits backward per layer ([Note: splitting backward]),
    which must not count the shared weight's earlier use twice (it failed on a freed graph)."""
    torch.manual_seed(0)
    shared = nn.Linear(6, 6, dtype=D64)
    layers = [nn.Linear(6, 6, dtype=D64), nn.Tanh(), shared, nn.Tanh(), shared, nn.Linear(6, 6, dtype=D64)]
    ref = copy.deepcopy(nn.Sequential(*layers))  # deepcopy keeps the tie
    pipe = hvd.Pipeline(layers, balance=[2, 4], chunks=2, schedule=name, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for k in range(2):
        x, y = batch64(k)
        loss = pipe.train_step(x, y)
        opt.zero_grad()
        want = nn.functional.mse_loss(ref(x), y)
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-12)
    if 1 in pipe.stages:
        torch.testing.assert_close(pipe.stages[1][0].weight, ref[2].weight, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(pipe.stages[1][3].weight, ref[5].weight, rtol=1e-12, atol=1e-12)
    pipe.close()


@pytest.mark.skipif(N != 2, reason="two stages")
def test_a_stage_returning_a_tuple_raises_a_clear_error_on_every_rank():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x * 2

    pipe = hvd.Pipeline([nn.Linear(6, 6), Pair(), nn.Identity(), nn.Linear(6, 6)], balance=[2, 2], chunks=2,
                        loss_fn=nn.functional.mse_loss)
    x, y = batch(0)
    with pytest.raises(hvd.PipelineError, match="stage 0 returned a tuple; what crosses a stage boundary is one"):
        pipe.train_step(x, torch.zeros(BATCH, 6))
    pipe.close()


@pytest.mark.skipif(N == 1, reason="data parallelism needs replicas")
def test_frozen_parameters_stay_frozen_under_data_parallelism():
    """Weight decay must not move a frozen parameter, nor one no replica produced a gradient for
    (they used to get zero gradients for the gradient average)."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4, dtype=D64), nn.Tanh(), nn.Linear(4, 2, dtype=D64)]
    layers[0].weight.requires_grad_(False)
    ref = copy.deepcopy(nn.Sequential(*layers))
    frozen = layers[0].weight.detach().clone()

    def opt(ps):
        return torch.optim.SGD(ps, lr=0.1, weight_decay=0.5, momentum=0.5)

    pipe = hvd.Pipeline(layers, chunks=2, grid=hvd.pipeline_grid(pp=1, dp=N), loss_fn=nn.functional.mse_loss,
                        optimizer=opt)
    ref_opt = opt(ref.parameters())
    for k in range(3):
        x, y = batch64(k, rows=4 * N, width=4)
        mine = slice(R * 4, R * 4 + 4)
        loss = pipe.train_step(x[mine], y[mine, :2])
        ref_opt.zero_grad()
        want = nn.functional.mse_loss(ref(x), y[:, :2])
        want.backward()
        ref_opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-12)
    stage = pipe.stages[0]
    assert torch.equal(stage[0].weight, frozen) and stage[0].weight.grad is None
    for mine_p, ref_p in zip(stage.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(mine_p, ref_p, rtol=1e-12, atol=1e-12)
    pipe.close()


def _tensor_parallel_block(sets, attention_dropout=0.5):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True, dtype=D64)
    ln1, ln2 = nn.LayerNorm(8, dtype=D64), nn.LayerNorm(8, dtype=D64)
    fc1, fc2 = nn.Linear(8, 16, dtype=D64), nn.Linear(16, 8, dtype=D64)
    hvd.model_parallel_manual_seed(1234, sets.tp)
    return hvd.ParallelTransformerBlock.from_modules(ln1, mha, ln2, fc1, fc2, causal=True, process_set=sets.tp,
                                                     attention_dropout=attention_dropout, hidden_dropout=0.0)


@pytest.mark.skipif(N % 2, reason="a tensor group of 2")
def test_checkpointing_replays_the_tensor_parallel_dropout_stream():
    """The recompute restores the tracker's per-shard stream too: the parallel attention's dropout
    draws the same masks as the first forward, so checkpointing changes no number."""
    from unison.common.tensor_parallel import Grid, grid_pipeline

    grid = Grid(pp=1, tp=2)
    sets = grid.register()
    results = {}
    for checkpoint in ("never", "always"):
        block = _tensor_parallel_block(sets)
        pipe = hvd.Pipeline([block, nn.Flatten()], chunks=2, grid=grid_pipeline(grid, sets),
                            checkpoint=checkpoint, loss_fn=lambda o, t: ((o - t) ** 2).mean(),
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(4, 6, 8, generator=g, dtype=D64), torch.randn(4, 48, generator=g, dtype=D64)
        losses = [pipe.train_step(x, y) for _ in range(2)]
        results[checkpoint] = (losses, block.attn.qkv.weight.detach().clone())
        pipe.close()
    assert results["never"][0] == results["always"][0]
    assert torch.equal(results["never"][1], results["always"][1])


@pytest.mark.skipif(N % 2, reason="a tensor group of 2")
def test_a_stage_failing_on_one_rank_of_its_tensor_group_raises_everywhere_without_a_hang():
    """[Note: abandoned collectives]: the failing rank's peer waits in the tensor group's all-reduce,
    which the failing rank never submits; the engine fails it on every member at once."""
    from unison.common.tensor_parallel import Grid, grid_pipeline

    grid = Grid(pp=1, tp=2)
    sets = grid.register()
    fail = {"on": False}

    class FailOnShard0(nn.Module):
        def forward(self, x):
            if fail["on"] and sets.tp.rank() == 0:
                raise RuntimeError("shard 0 failed")
            return x

    torch.manual_seed(0)
    col = hvd.ColumnParallelLinear.from_linear(nn.Linear(8, 16, dtype=D64), process_set=sets.tp)
    row = hvd.RowParallelLinear.from_linear(nn.Linear(16, 8, dtype=D64), process_set=sets.tp)
    pipe = hvd.Pipeline([col, nn.GELU(), FailOnShard0(), row], chunks=2, grid=grid_pipeline(grid, sets),
                        loss_fn=nn.functional.mse_loss)
    x, y = batch64(0, rows=4, width=8)
    assert isinstance(pipe.train_step(x, y), float)
    fail["on"] = True
    with pytest.raises(hvd.PipelineError, match="shard 0 failed"):
        pipe.train_step(x, y)
    pipe.close()


@pytest.mark.skipif(N != 2, reason="two stages")
def test_a_pipeline_saves_its_stages_as_the_whole_model_and_stale_copies_are_refused():
    """``save_tensor_parallel(path, pipe)``: each stage writes its own layers under their paths in
    the whole model, which loads into the plain model in one process. Saving the user's full model
    from every rank instead would keep rank 0's untrained copy of stage 1: refused on every rank."""
    import shutil
    import tempfile

    from unison.common.checkpoints import CheckpointError

    where = WORLD.bcast(tempfile.mkdtemp(prefix="pipe_ck_") if R == 0 else None)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4, dtype=D64), nn.Tanh(), nn.Linear(4, 2, dtype=D64))
        pipe = hvd.Pipeline(model, balance=[2, 1], chunks=2, loss_fn=nn.functional.mse_loss,
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
        for k in range(2):
            x, y = batch64(k, rows=4, width=4)
            pipe.train_step(x, y[:, :2])
        with pytest.raises(CheckpointError, match="replicated parameter.*differ between the ranks"):
            hvd.save_tensor_parallel(f"{where}/full", model)
        hvd.save_tensor_parallel(f"{where}/ck", pipe)
        trained = {f"{span.start + i}.{k}": v for s, span in pipe.layer_ranges.items()
                   for i, layer in enumerate(pipe.stages[s]) for k, v in layer.state_dict().items()}
        everyone = {k: v for part in WORLD.allgather(trained) for k, v in part.items()}
        plain = nn.Sequential(nn.Linear(4, 4, dtype=D64), nn.Tanh(), nn.Linear(4, 2, dtype=D64))
        if R == 0:
            hvd.load_tensor_parallel(f"{where}/ck", plain, local=True)
            for key, value in plain.state_dict().items():
                assert torch.equal(value, everyone[key]), key
        hvd.load_tensor_parallel(f"{where}/ck", pipe)  # and back into the pipeline, collectively
    finally:
        WORLD.Barrier()
        if R == 0:
            shutil.rmtree(where, ignore_errors=True)
    pipe.close()


def spread(layers: int) -> list[int]:
    """``layers`` layers over the N stages, the first ones taking the extra."""
    base, extra = divmod(layers, N)
    return [base + (1 if s < extra else 0) for s in range(N)]


@pytest.mark.parametrize("name, checkpoint", [("1f1b", "always"), ("1f1b", "except_last"), ("zb-h1", "always"),
                                              ("gpipe", "never")])
def test_checkpointing_moves_batchnorm_statistics_once_per_microbatch(name, checkpoint):
    """The recomputed forward of a checkpointed microbatch sees the running statistics its first
    forward saw and leaves them as it found them: buffers and weights as one process training
    microbatch by microbatch (before: every statistic moved twice per microbatch)."""
    torch.manual_seed(5)
    layers = [nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(),
              nn.Linear(8, 4), nn.Linear(4, 1)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, balance=spread(8), chunks=CHUNKS, schedule=name, checkpoint=checkpoint,
                        loss_fn=nn.functional.mse_loss, optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, batches, CHUNKS))
    every = list(ref)
    for s, span in pipe.layer_ranges.items():
        theirs = dict(nn.Sequential(*every[span.start:span.stop]).named_buffers())
        mine = dict(pipe.stages[s].named_buffers())
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-6, msg=f"stage {s} {key}")
    pipe.close()


@pytest.mark.parametrize("name, checkpoint", [("1f1b", "never"), ("zb-h1", "never"), ("1f1b", "always"),
                                              ("zb-h1", "always")])
def test_a_stage_starting_with_an_in_place_layer_trains_as_one_process(name, checkpoint):
    """The received input is an autograd leaf; a stage whose first layer writes its input in place
    (``ReLU(inplace=True)``, also inside a Sequential) gets a copy. Before: a RuntimeError on every
    rank, with the default balance of such a model too."""
    torch.manual_seed(2)
    layers = [nn.Linear(6, 16), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(16, 16)), nn.Linear(16, 8),
              nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4), nn.Linear(4, 1)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    balance = [1, 2, 2, 3][:N] if N == 4 else [1, 7] if N == 2 else [8]
    pipe = hvd.Pipeline(layers, balance=balance, chunks=CHUNKS, schedule=name, checkpoint=checkpoint,
                        loss_fn=nn.functional.mse_loss, optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, batches, CHUNKS))
    pipe.close()


class ClipIds(nn.Module):
    """A parameterless stage that passes integer ids on (no gradient flows back through it)."""

    def forward(self, ids):
        return ids.clamp(0, 9)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_integer_stage_inputs_train_under_every_backward(name):
    """A stage whose input is integer ids (an Embedding after a stage boundary): zb-h1's split
    backward asked autograd for the ids' gradient and failed on every rank."""
    torch.manual_seed(4)

    class Mean(nn.Module):
        def forward(self, x):
            return x.mean(dim=1)

    layers = [ClipIds(), nn.Embedding(10, 6), Mean(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    balance = [1, 1, 2, 2] if N == 4 else [1, 5] if N == 2 else [6]
    pipe = hvd.Pipeline(layers, balance=balance, chunks=CHUNKS, schedule=name, loss_fn=nn.functional.mse_loss,
                        optimizer=sgd)
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randint(-2, 12, (BATCH, 3), generator=g), torch.randn(BATCH, 1, generator=g))
               for _ in range(STEPS)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, batches, CHUNKS))
    pipe.close()


def test_balance_by_time_changes_nothing_it_measures():
    """Measuring runs each layer's forward in training mode: the running statistics, the batch
    counter and the random stream are put back (before: BatchNorm's statistics moved)."""
    torch.manual_seed(1)
    layers = [nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(inplace=True), nn.Linear(8, 1)]
    before = [b.clone() for layer in layers for b in layer.buffers()]
    sample = torch.randn(4, 6)
    torch.manual_seed(77)
    expected_next = torch.rand(3)
    torch.manual_seed(77)
    balance = hvd.balance_by_time(layers, sample, min(N, 5))
    assert sum(balance) == 5
    after = [b for layer in layers for b in layer.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(torch.rand(3), expected_next)
    assert all(p.grad is None for layer in layers for p in layer.parameters())


@pytest.mark.skipif(N != 2, reason="two stages")
def test_a_last_stage_returning_a_tuple_reaches_a_loss_that_takes_it():
    class Pair(nn.Module):
        def forward(self, x):
            return x, 2 * x

    def loss(out, t):
        return nn.functional.mse_loss(out[0], t) + nn.functional.mse_loss(out[1], t)

    torch.manual_seed(3)
    layers = [nn.Linear(6, 4), nn.Linear(4, 4), Pair()]
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, balance=[1, 2], chunks=2, loss_fn=loss, optimizer=sgd)
    x, t = batch(0)[0], torch.randn(BATCH, 4)
    got = pipe.train_step(x, t)
    want = sum(loss(ref(xs), ts).item() / 2 for xs, ts in zip(x.chunk(2), t.chunk(2), strict=True))
    assert got == pytest.approx(want, rel=1e-6)
    raised_everywhere(lambda: pipe.train_step(x[:0], t[:0]), "inputs has a batch of 0 rows",
                      "skip empty batches")
    # predict returns one tensor: it raised on the last rank only, the others returned None
    raised_everywhere(lambda: pipe.predict(x), "predict returns the last stage's output as one tensor, but "
                      "stage 1 returned a tuple")
    pipe.close()


class Tripwire(nn.Module):
    """An identity that raises on a microbatch whose first value is above 50."""

    def forward(self, x):
        if float(x[0, 0]) > 50:
            raise ValueError("tripwire: an input above 50")
        return x


@pytest.mark.skipif(N % 2, reason="a grid of 2 pipelines needs an even number of ranks")
def test_a_step_failing_in_one_pipeline_of_a_grid_raises_everywhere_and_the_next_step_trains():
    """At 2 ranks each pipeline is one rank: the failing rank's engine abandons its collectives
    while the step ends, and the next step's gradient all-reduce failed with that reason on
    every rank (the engine read the abandon when a cycle began, not when its stall round ran)."""
    grid = hvd.pipeline_grid(dp=2)
    layers = [Tripwire(), *make_layers()]
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, balance=[5, 4] if grid.pp == 2 else None, chunks=2, grid=grid,
                        loss_fn=nn.functional.mse_loss, optimizer=sgd)
    x, y = batch(0, grid.pipeline)
    if grid.pipeline == 1:
        x = x.clone()
        x[BATCH // 2, 0] = 100.0  # pipeline 1's microbatch 1 trips its stage 0
    culprit = WORLD.allgather((grid.pipeline, grid.position)).index((1, 0))
    raised_everywhere(lambda: pipe.train_step(x, y), f"pipeline step failed on rank {culprit} at F1@s0",
                      "tripwire: an input above 50")
    for k in range(2):  # nothing of the failed step is left behind
        parts = [batch(k, replica) for replica in range(2)]
        loss = pipe.train_step(*parts[grid.pipeline])
        ref_loss = reference_losses(ref, [(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))],
                                    None)
        assert loss == pytest.approx(ref_loss[0], rel=1e-5)
    pipe.close()


# ------------------------------------------------------------------ found by an audit (2026-12-05)
def first_rank_layers(first):
    """``first`` then seven layers of the model (8 in all, enough for 8 stages)."""
    torch.manual_seed(6)
    return [first, nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
            nn.Linear(8, 1)]


@pytest.mark.parametrize("first", ["leaky_relu", "dropout"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_model_starting_with_an_in_place_layer_trains_as_one_process(first, checkpoint):
    """Stage 0's microbatches are views of the user's batch: an in-place first layer wrote them,
    so the recompute ran on its own output (wrong gradients) and, without checkpointing, the
    next microbatch's write broke the previous one's graph (an autograd error)."""
    layer = nn.LeakyReLU(0.1, inplace=True) if first == "leaky_relu" else nn.Dropout(0.3, inplace=True)
    layers = first_rank_layers(layer)
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, chunks=CHUNKS, checkpoint=checkpoint, loss_fn=nn.functional.mse_loss,
                        optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    torch.manual_seed(123)
    losses = [pipe.train_step(x, y) for x, y in batches]
    assert all(torch.equal(x, batch(k)[0]) for k, (x, _) in enumerate(batches))  # the user's batch is left alone
    torch.manual_seed(123)
    ref_losses = reference_losses(ref, [(x.clone(), y) for x, y in batches], CHUNKS)
    assert_same_as_reference(pipe, ref, losses, ref_losses)
    pipe.close()


def tied_layers():
    """Eight float64 layers of width 6; layers 0 and 4 are one module (tied weights)."""
    torch.manual_seed(7)
    shared = nn.Linear(6, 6, dtype=D64)
    return [shared, nn.Tanh(), nn.Linear(6, 6, dtype=D64), nn.Tanh(), shared, nn.Tanh(),
            nn.Linear(6, 6, dtype=D64), nn.Linear(6, 6, dtype=D64)]


@pytest.mark.skipif(N > 4, reason="eight layers in 2 x 4 stages at most")
def test_a_module_in_two_stages_of_one_rank_is_stepped_once():
    """Interleaved: stages 0 and p of rank 0 hold layers 0 and 4, one module. ``parameters()``
    listed its tensors twice and the optimizer stepped them twice."""
    layers = tied_layers()
    ref = copy.deepcopy(nn.Sequential(*layers))
    half = [4 // N + (1 if s < 4 % N else 0) for s in range(N)]  # layers 0-3 in stages 0..N-1, 4-7 in N..2N-1
    pipe = hvd.Pipeline(layers, balance=half * 2, chunks=2 * N, schedule="interleaved",
                        virtual_stages=2, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    params = pipe.parameters()
    assert len({id(p) for p in params}) == len(params)
    opt = sgd(ref.parameters())
    for k in range(2):
        x, y = batch64(k, rows=24)
        loss = pipe.train_step(x, y)
        opt.zero_grad()
        want = nn.functional.mse_loss(ref(x), y)
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-12)
    if R == 0:
        torch.testing.assert_close(layers[0].weight, ref[0].weight, rtol=1e-12, atol=1e-12)
    pipe.close()


@pytest.mark.skipif(N == 1 or N > 8, reason="needs stages on two ranks")
def test_a_module_in_stages_on_two_ranks_is_refused_on_every_rank():
    """Each rank trained its own copy of a tied weight with its part of the gradient."""
    stage = bisect.bisect_right(list(itertools.accumulate(spread(8))), 4)  # layer 4's
    raised_everywhere(lambda: hvd.Pipeline(tied_layers(), balance=spread(8), chunks=CHUNKS,
                                           loss_fn=nn.functional.mse_loss),
                      "layers 0 and 4 share a parameter (0.weight is 4.weight: tied weights) but sit in stages 0 "
                      f"and {stage}, on pipeline ranks 0 and {stage}", "untie the weights")


class ReadThenTrack(nn.Module):
    """Adds 0.1 x a running mean of its input, then moves the mean by assigning a new tensor."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("ema", torch.zeros(n))

    def forward(self, x):
        out = x + 0.1 * self.ema
        if self.training:
            self.ema = 0.5 * self.ema + 0.5 * x.detach().mean(0)
        return out


@pytest.mark.parametrize("name, checkpoint", [("1f1b", "always"), ("zb-h1", "except_last")])
def test_checkpointing_a_module_that_assigns_its_buffer_moves_it_once(name, checkpoint):
    """A buffer written by assignment (a new tensor) was not seen as written: the recompute moved
    it a second time and read the moved value."""
    torch.manual_seed(8)
    layers = [nn.Linear(6, 8), ReadThenTrack(8), nn.Tanh(), nn.Linear(8, 8), ReadThenTrack(8), nn.Tanh(),
              nn.Linear(8, 4), nn.Linear(4, 1)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, balance=spread(8), chunks=CHUNKS, schedule=name, checkpoint=checkpoint,
                        loss_fn=nn.functional.mse_loss, optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, batches, CHUNKS))
    for s, span in pipe.layer_ranges.items():
        for i, layer in zip(span, pipe.stages[s], strict=True):
            if isinstance(layer, ReadThenTrack):
                torch.testing.assert_close(layer.ema, ref[i].ema, rtol=1e-5, atol=1e-6)
    pipe.close()


@pytest.mark.skipif(N % 2, reason="a grid of 2 pipelines needs an even number of ranks")
def test_replicas_with_different_batch_sizes_train_on_the_mean_over_every_row():
    """Replica 0 gets 8 rows, replica 1 gets 4: each replica's mean counted alike (mean of means)."""
    grid = hvd.pipeline_grid(dp=2)
    layers = make_layers()
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, chunks=2, grid=grid, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    opt = sgd(ref.parameters())
    for k in range(2):
        x, y = batch(k)
        x, y = torch.cat([x, x[:4] * 2]), torch.cat([y, y[:4] - 1])  # 12 rows: 8 for replica 0, 4 for replica 1
        part = slice(0, 8) if grid.pipeline == 0 else slice(8, 12)
        loss = pipe.train_step(x[part], y[part])
        opt.zero_grad()
        want = nn.functional.mse_loss(ref(x), y)
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-5)
        with torch.no_grad():
            assert pipe.evaluate(x[part], y[part]) == pytest.approx(nn.functional.mse_loss(ref(x), y).item(),
                                                                   rel=1e-5)
    every = list(ref)
    for s, span in pipe.layer_ranges.items():
        theirs_all = nn.Sequential(*every[span.start:span.stop]).parameters()
        for mine, theirs in zip(pipe.stages[s].parameters(), theirs_all, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    pipe.close()


def test_training_and_evaluating_keep_each_modules_mode():
    """A BatchNorm frozen with ``eval()`` (fine-tuning) was put back in training mode by every
    step and every evaluation, and its statistics moved."""
    torch.manual_seed(9)
    bn = nn.BatchNorm1d(6)
    bn.eval()
    layers = [bn, nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.3), nn.Linear(16, 8), nn.Tanh(),
              nn.Linear(8, 1)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, balance=spread(8), chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    batches = [(3 * x + 1, y) for x, y in (batch(k) for k in range(STEPS))]
    torch.manual_seed(123)
    losses = []
    for x, y in batches:
        losses.append(pipe.train_step(x, y))
        pipe.evaluate(x, y)  # draws no random numbers
    torch.manual_seed(123)
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, batches, CHUNKS))
    held = [m for s in pipe.stages.values() for m in s.modules()]
    assert [m.training for m in held] == [not isinstance(m, nn.BatchNorm1d) for m in held]
    if 0 in pipe.stages:
        assert torch.equal(pipe.stages[0][0].running_mean, torch.zeros(6))
    pipe.close()


class LayerScale(nn.Module):
    """timm's LayerScale with ``inplace=True``: scales its input in place by a learned vector."""

    def __init__(self, n):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((n,), 0.5))
        self.inplace = True  # as timm's: a stage that starts with it is fed a copy

    def forward(self, x):
        return x.mul_(self.gamma)


class LastOutput(nn.Module):
    """The output sequence of an ``nn.LSTM`` (it returns ``(output, (h, c))``)."""

    def forward(self, out):
        return out[0]


@pytest.mark.skipif(N > 4, reason="eight layers in 2 x 4 stages at most")
@pytest.mark.parametrize("name", ["zb-h1", "1f1b"])
def test_split_backward_takes_tuple_outputs_and_in_place_layers_with_parameters(name):
    """zb-h1's per-layer W stopped at each parameterised layer's output: an ``nn.LSTM``'s tuple
    has none ('tuple' object has no attribute 'requires_grad'), and an in-place LayerScale's is
    the Linear's before it (backward through the graph a second time)."""
    torch.manual_seed(10)
    layers = [nn.Linear(6, 8), LayerScale(8), nn.LSTM(8, 8), LastOutput(), nn.Linear(8, 8), LayerScale(8),
              nn.Tanh(), nn.Linear(8, 1)]
    ref = nn.Sequential(*copy.deepcopy(layers))
    balance = {1: [8], 2: [4, 4], 3: [2, 3, 3], 4: [2, 2, 2, 2]}[N]  # the LSTM and LastOutput in one stage
    pipe = hvd.Pipeline(layers, balance=balance, chunks=CHUNKS, schedule=name, loss_fn=nn.functional.mse_loss,
                        optimizer=sgd)
    batches = [batch(k) for k in range(STEPS)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    assert_same_as_reference(pipe, ref, losses, reference_losses(ref, batches, CHUNKS))
    pipe.close()


class Unmovable(nn.Module):
    """A layer that cannot move to the device (out of memory there), on the rank that holds it."""

    def _apply(self, fn, *args, **kwargs):
        raise RuntimeError("simulated: out of memory")

    def forward(self, x):
        return x


class FailingSGD(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("simulated: no step")


def test_a_failure_on_one_rank_outside_the_schedule_raises_on_every_rank():
    """Moving a stage to its device, the optimizer's step and balance_by_time's measurement
    failing on one rank left the other ranks waiting forever."""
    raised_everywhere(lambda: hvd.Pipeline([*make_layers(), Unmovable()], balance=[1] * (N - 1) + [10 - N],
                                           chunks=CHUNKS, loss_fn=nn.functional.mse_loss),
                      f"rank {N - 1}: moving stages [{N - 1}] to cpu failed: RuntimeError: simulated: out of "
                      "memory")
    pipe = hvd.Pipeline(make_layers(), chunks=CHUNKS, loss_fn=nn.functional.mse_loss,
                        optimizer=lambda ps: FailingSGD(ps, lr=0.1) if R == 0 else sgd(ps))
    raised_everywhere(lambda: pipe.train_step(*batch(0)),
                      "rank 0: optimizer.step() for stages [0] failed: RuntimeError: simulated: no step")
    pipe.close()
    if N > 1:
        sample = torch.randn(4, 5 if R == 0 else 6)  # rank 0's does not fit the first layer
        raised_everywhere(lambda: hvd.balance_by_time(make_layers(), sample, N),
                          "rank 0: balance_by_time's measurement failed: RuntimeError: mat1 and mat2 shapes")


class StopGradient(nn.Module):
    def forward(self, x):
        return x.detach()


@pytest.mark.parametrize("name, checkpoint", [("1f1b", "never"), ("zb-h1", "always"), ("gpipe", "always")])
def test_stages_above_a_stop_gradient_keep_no_gradient(name, checkpoint):
    """The last stage starts with ``x.detach()``: the stages before it got zero gradients (and
    weight decay moved their parameters) where one process gives them none."""
    sizes = spread(8)
    start = sum(sizes[:-1])
    layers = make_layers()
    layers.insert(start, StopGradient())
    ref = nn.Sequential(*copy.deepcopy(layers))

    def decaying(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)

    pipe = hvd.Pipeline(layers, balance=[*sizes[:-1], sizes[-1] + 1], chunks=CHUNKS, schedule=name,
                        checkpoint=checkpoint, loss_fn=nn.functional.mse_loss, optimizer=decaying)
    opt = decaying(ref.parameters())
    for k in range(2):
        x, y = batch(k)
        loss = pipe.train_step(x, y)
        opt.zero_grad(set_to_none=True)
        want = sum(nn.functional.mse_loss(ref(xs), ys) / CHUNKS for xs, ys in zip(x.chunk(CHUNKS), y.chunk(CHUNKS),
                                                                                  strict=True))
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-5)
    for s, span in pipe.layer_ranges.items():
        for i, layer in zip(span, pipe.stages[s], strict=True):
            for (key, mine), theirs in zip(layer.named_parameters(), ref[i].parameters(), strict=True):
                assert (mine.grad is None) == (theirs.grad is None), f"{i}.{key}"
                torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    pipe.close()


def test_train_step_with_gradients_off_raises_on_every_rank():
    """Under ``torch.no_grad()`` one process raises at backward; the pipeline returned a loss and
    trained nothing."""
    pipe = hvd.Pipeline(make_layers(), chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    x, y = batch(0)
    with torch.no_grad():
        raised_everywhere(lambda: pipe.train_step(x, y), "train_step was called with gradients disabled",
                          "use evaluate()")
    before = [p.detach().clone() for p in pipe.parameters()]
    pipe.train_step(x, y)
    assert all(not torch.equal(a, b) for a, b in zip(before, pipe.parameters(), strict=True))
    pipe.close()


def _classifier():
    torch.manual_seed(5)
    return [nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
            nn.Linear(8, 4), nn.Linear(4, 3)]


def _labels(step, ignored):
    g = torch.Generator().manual_seed(200 + step)
    x, t = torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    t[list(ignored)] = -100
    return x, t


LOSSES = {"ignored rows": (lambda: nn.CrossEntropyLoss(), (1, 6)),
          "a microbatch of padding alone": (lambda: nn.CrossEntropyLoss(), (0, 1, 5)),
          "class weights, smoothing, ignored": (
              lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0]), label_smoothing=0.1), (3,)),
          "nll with class weights": (lambda: nn.NLLLoss(weight=torch.tensor([2.0, 0.5, 1.0])), ()),
          "class weights, uint8 targets": (lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 1.0, 3.0])), ())}


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("case", list(LOSSES))
def test_a_cross_entropy_with_ignored_or_weighted_targets_trains_like_one_process(case, name):
    """Each microbatch's mean was scaled by 1/chunks, which adds up to the batch's mean only when every target
    counts alike: with ignored or class-weighted targets the gradients were up to 45% off one process's, and a
    microbatch of padding alone made the loss NaN (an audit, 2026-12-06). Now each microbatch counts by the
    weight of its targets."""
    make, ignored = LOSSES[case]
    layers = _classifier()
    if case.startswith("nll"):
        layers.append(nn.LogSoftmax(dim=1))
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, chunks=CHUNKS, schedule=name, loss_fn=make(), optimizer=sgd)
    opt = sgd(ref.parameters())
    for k in range(2):
        x, t = _labels(k, ignored)
        if "uint8" in case:  # (indexed the class weights as a mask, on one rank, and hung the others)
            t = t.to(torch.uint8)
        loss = pipe.train_step(x, t)
        opt.zero_grad()
        want = make()(ref(x), t)
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-5), case
        with torch.no_grad():
            assert pipe.evaluate(x, t) == pytest.approx(make()(ref(x), t).item(), rel=1e-5)
    assert_same_as_reference(pipe, ref, [0.0], [0.0])
    pipe.close()


def test_replicas_with_differently_ignored_targets_train_on_the_mean_over_every_counted_target():
    """Replica 0's batch has one ignored target, replica 1's five: the replicas count by their targets' weight,
    not by their rows."""
    grid = hvd.pipeline_grid(dp=2)
    layers = _classifier()
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, chunks=2, grid=grid, loss_fn=nn.CrossEntropyLoss(), optimizer=sgd)
    opt = sgd(ref.parameters())
    for k in range(2):
        (x0, t0), (x1, t1) = _labels(k, (2,)), _labels(10 + k, (0, 1, 3, 4, 6))
        x, t = torch.cat([x0, x1]), torch.cat([t0, t1])
        loss = pipe.train_step(*((x0, t0) if grid.pipeline == 0 else (x1, t1)))
        opt.zero_grad()
        want = nn.functional.cross_entropy(ref(x), t)
        want.backward()
        opt.step()
        assert loss == pytest.approx(want.item(), rel=1e-5)
    assert_same_as_reference(pipe, ref, [0.0], [0.0])
    pipe.close()


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_layer_unfrozen_after_the_pipeline_was_built_trains(name):
    """zb-h1 read each layer's trainable parameters once, when the pipeline was built: a layer unfrozen later
    (fine-tuning) got no gradient and never trained, silently, before 2026-12-06."""
    layers = make_layers()
    for p in layers[0].parameters():
        p.requires_grad_(False)
    ref = nn.Sequential(*copy.deepcopy(layers))
    pipe = hvd.Pipeline(layers, chunks=CHUNKS, schedule=name, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    for p in [*layers[0].parameters(), *ref[0].parameters()]:
        p.requires_grad_(True)
    opt = sgd(ref.parameters())
    batches = [batch(k) for k in range(2)]
    losses = [pipe.train_step(x, y) for x, y in batches]
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    assert_same_as_reference(pipe, ref, losses, ref_losses)
    pipe.close()


def test_a_target_outside_the_class_weights_raises_on_every_rank():
    """Reading a microbatch's counted weight, the rank holding the last stage found the target there and raised
    alone; now every rank raises it before the step."""
    pipe = hvd.Pipeline(_classifier(), chunks=CHUNKS, loss_fn=nn.CrossEntropyLoss(weight=torch.ones(3)),
                        optimizer=sgd)
    x, t = _labels(0, ())
    raised_everywhere(lambda: pipe.train_step(x, torch.where(t == 2, 7, t)), "a target is outside the loss's 3 "
                      "class weights")
    pipe.train_step(x, t)  # the next step trains
    pipe.close()


def test_a_numpy_batch_torch_cannot_take_raises_on_every_rank():
    """torch.from_numpy refuses a negative stride or a big-endian array: raised on the rank holding stage 0
    alone while the others waited in the step (a hang) before 2026-12-06."""
    pipe = hvd.Pipeline(make_layers(), chunks=CHUNKS, loss_fn=nn.functional.mse_loss, optimizer=sgd)
    x, y = batch(0)
    flipped = x.numpy()[::-1]
    raised_everywhere(lambda: pipe.train_step(flipped, y), "inputs is a numpy array torch cannot take")
    swapped = x.numpy().astype(">f4")
    raised_everywhere(lambda: pipe.train_step(swapped, y), "np.ascontiguousarray(inputs, dtype=np.float32)")
    pipe.train_step(x.numpy().copy(), y)  # the next step works
    pipe.close()
