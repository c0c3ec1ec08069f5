"""ZeRO stages 1 and 2 for PyTorch under mpirun: the same weights as one process on the global batch.

Every test trains a model whose parameter counts do not divide by the rank count, with two
parameter groups (different learning rates and weight decay), and compares against a plain
optimizer stepping one process on the whole batch. Small buckets force several buckets per
dtype and group, so segments cut through parameters.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch
from mpi4py import MPI

import unison.torch_backend as hvd
from unison.common import checkpoints as ck

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
torch.set_num_threads(1)
B = 3  # samples per rank
STEPS = 3
TOL = 2e-6

OPTIMIZERS = {
    "sgd_momentum": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda groups: torch.optim.Adam(groups, lr=0.01, amsgrad=True),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1),
}


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


class Mixed(torch.nn.Module):
    """Two float32 layers (7x13, 13x5: counts that divide by no rank count here) and a float64 scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(7, 13)
        self.l2 = torch.nn.Linear(13, 5)
        self.scale = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.l2(torch.tanh(self.l1(x))).double() * self.scale).float()


def groups_of(model: Mixed) -> list[dict]:
    return [{"params": list(model.l1.parameters()) + [model.scale]},
            {"params": list(model.l2.parameters()), "lr": 0.03, "weight_decay": 0.01}]


def data(step: int, ranks: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(ranks * B, 7, generator=g), torch.randn(ranks * B, 5, generator=g)


def local(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data(step)
    return x[R * B:(R + 1) * B], y[R * B:(R + 1) * B]


def reference(opt_name: str, steps: int = STEPS, clip: float | None = None, passes: int = 1):
    model = Mixed()
    opt = OPTIMIZERS[opt_name](groups_of(model))
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step)
        for k in range(passes):  # the same samples split as the ranks split them
            rows = torch.cat([torch.arange(r * B, (r + 1) * B)[k::passes] for r in range(N)])
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / passes).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model, opt


def distributed(opt_name: str, stage: int, steps: int = STEPS, clip: float | None = None, passes: int = 1,
                bucket_bytes: int = 64):
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS[opt_name](groups_of(model)),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   backward_passes_per_step=passes, zero_bucket_bytes=bucket_bytes)
    for step in range(steps):
        opt.zero_grad()
        x, y = local(step)
        for k in range(passes):
            (torch.nn.functional.mse_loss(model(x[k::passes]), y[k::passes]) / passes).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        opt.step()
    return model, opt


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, tol: float = TOL) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        err = (p.detach().double() - q.detach().double()).abs().max().item()
        assert err <= tol, f"{name}: max difference {err}"


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_stage_equals_one_process_on_the_global_batch(opt_name, stage):
    ref, _ = reference(opt_name)
    model, opt = distributed(opt_name, stage)
    assert isinstance(opt, type(OPTIMIZERS[opt_name]([torch.nn.Parameter(torch.zeros(1))])))
    assert len(opt.plan.buckets) >= 3  # small buckets: segments cut through parameters
    assert_same_weights(model, ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_assigned_by_hand_are_the_steps_gradients(stage):
    """Before: at stage 2 a gradient set by hand (p.grad = g from torch.autograd.grad: meta-learning, gradient
    surgery) fired no hook and was left unread, and the step used zeros: the weights did not move (an audit)."""
    ref, _ = reference("adamw")
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adamw"](groups_of(model)),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   zero_bucket_bytes=64)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(model.parameters())), strict=True):
            p.grad = g
        opt.step()
    assert_same_weights(model, ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_weights_gather_lands_in_the_weights_themselves(monkeypatch, stage):
    """After each step every bucket's all-gather writes straight into the bucket's flat weights (its
    ``out=``; before 2026-12-06 into a new array of the bucket's size, copied back piece by piece), and the
    weights still equal one process's."""
    import unison.torch_backend.zero as zero

    gathers = []
    submit = zero.frontend.allgather_async

    def recorded(arr, name=None, process_set=None, out=None):  # noqa: ANN001, ANN202
        handle = submit(arr, name, process_set, out=out)
        if re.search(r"\.ag\d+$", str(name)):  # the buckets' gathers (not the optimizer's own agreements)
            gathers.append((handle, out))
        return handle

    monkeypatch.setattr(zero.frontend, "allgather_async", recorded)
    ref, _ = reference("adam")
    model, opt = distributed("adam", stage)
    assert_same_weights(model, ref)
    assert len(gathers) == STEPS * len(opt.plan.buckets)
    if N > 1:  # (one rank runs no engine)
        assert all(out is not None and handle.wait() is out for handle, out in gathers)


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_equals_stage_0_with_default_buckets(stage):
    zero, _ = distributed("adam", stage, bucket_bytes=32 * 1024 * 1024)
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](groups_of(model)), named_parameters=model.named_parameters())
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert_same_weights(zero, model)


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_state_is_sharded(stage):
    model, opt = distributed("adam", stage)
    total = sum(p.numel() for p in model.parameters())
    held = sum(v.numel() for s in opt._inner.state.values() for k, v in s.items() if k != "step")
    padded = sum(b.padded for b in opt.plan.buckets)
    assert held == 3 * padded // N  # exp_avg, exp_avg_sq, max_exp_avg_sq: this rank's segments only
    assert held <= 3 * (total // N + len(opt.plan.buckets))
    assert not opt.state  # the wrapper itself keeps nothing
    if stage == 2:
        # stage 2 frees every full gradient; after step() a stride-0 placeholder ([Note: unzeroed gradients])
        assert all(p.grad is not None and not any(p.grad.stride()) for p in model.parameters())
    else:
        assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("stage", [1, 2])
def test_accumulation_over_two_backward_passes(stage):
    ref, _ = reference("adam", passes=1)
    model, _ = distributed("adam", stage, passes=1)
    assert_same_weights(model, ref)
    ref2, _ = reference("adamw", passes=2)
    model2, _ = distributed("adamw", stage, passes=2)
    assert_same_weights(model2, ref2)


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_by_global_norm_equals_unsharded_clip(stage):
    ref, _ = reference("sgd_momentum", clip=0.05)
    model, _ = distributed("sgd_momentum", stage, clip=0.05)
    assert_same_weights(model, ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_state_dict_is_torch_format_and_round_trips(stage):
    ref, ref_opt = reference("adam")
    model, opt = distributed("adam", stage)
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    assert sd["param_groups"] == rsd["param_groups"]
    assert sd["state"].keys() == rsd["state"].keys()
    for i, st in rsd["state"].items():
        for key, value in st.items():
            assert torch.allclose(sd["state"][i][key].double(), value.double(), atol=TOL), (i, key)
    plain = torch.optim.Adam(groups_of(Mixed()), lr=0.01, amsgrad=True)
    plain.load_state_dict(sd)  # loads into an unsharded optimizer
    fresh = Mixed()
    fresh.load_state_dict(model.state_dict())
    opt2 = hvd.DistributedOptimizer(OPTIMIZERS["adam"](groups_of(fresh)),
                                    named_parameters=fresh.named_parameters(),
                                    zero_stage=3 - stage, zero_bucket_bytes=96)
    opt2.load_state_dict(rsd)  # from a plain optimizer, into the other stage and another layout
    for step in range(STEPS, STEPS + 2):
        for m, o in ((fresh, opt2), (ref, ref_opt)):
            o.zero_grad()
            x, y = local(step) if m is fresh else data(step)
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    assert_same_weights(fresh, ref)


def test_scheduler_changes_reach_the_shards():
    ref = Mixed()
    ref_opt = OPTIMIZERS["adam"](groups_of(ref))
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](groups_of(model)), named_parameters=model.named_parameters(),
                                   zero_stage=2, zero_bucket_bytes=64)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.3) for o in (ref_opt, opt)]
    for step in range(STEPS):
        for m, o, s in ((ref, ref_opt, scheds[0]), (model, opt, scheds[1])):
            o.zero_grad()
            x, y = data(step) if m is ref else local(step)
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            s.step()
    assert_same_weights(model, ref)


def test_bfloat16_parameters_step_fp32_masters():
    torch.manual_seed(3)
    model = torch.nn.Linear(7, 5).bfloat16()
    start = [p.detach().clone() for p in model.parameters()]
    plain = torch.nn.Linear(7, 5).bfloat16()
    plain.load_state_dict(model.state_dict())
    lr = 1e-4  # each update is far below bfloat16's resolution near these weights
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(),
                                   zero_stage=1, zero_bucket_bytes=16)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=lr)
    assert all(st.master.dtype == torch.float32 for st in opt._buckets)
    for step in range(STEPS):
        x, y = data(step)
        for m, o, (xs, ys) in ((model, opt, local(step)), (plain, plain_opt, (x, y))):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xs.bfloat16()).float(), ys).backward()
            o.step()
    flat_start = torch.cat([t.reshape(-1) for t in start]).float()
    plain_moved = (torch.cat([p.detach().reshape(-1) for p in plain.parameters()]).float() != flat_start)
    assert plain_moved.float().mean() < 0.5, "plain bfloat16 SGD was expected to round most updates away"
    master_moved = 0
    for st in opt._buckets:
        assert torch.equal(st.segment, st.master.detach().bfloat16()), "the model holds the masters, rounded"
        for piece in st.bucket.owned(opt._rank):  # padding excluded
            m = st.master.detach()[piece.offset:piece.offset + piece.length]
            master_moved += int((m != m.bfloat16().float()).sum())  # precision bfloat16 cannot hold
    owned = opt.plan.owned_numel(opt._rank)
    assert master_moved > 0.5 * owned, \
        f"the fp32 masters keep updates bfloat16 rounds away ({master_moved}/{owned})"


@pytest.mark.parametrize("stage", [1, 2])
def test_float16_gradients_average_without_overflowing_where_one_process_does_not(stage):
    """Every rank's gradient is 40000 (float16 holds it; the average is 40000): a float16 sum overflowed to inf
    before 2026-12-05 ([Note: float16 gradients reduce in float32]); the step is one process's, to float16."""
    w = torch.nn.Parameter(torch.zeros(2 * N + 1, dtype=torch.float16))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=1e-6), named_parameters=[("w", w)], zero_stage=stage)
    (w.float() * (40000.0 + 500.0 * R)).sum().backward()
    opt.step()
    mean = 40000.0 + 500.0 * (N - 1) / 2
    torch.testing.assert_close(w.detach().float(), torch.full_like(w, -1e-6 * mean, dtype=torch.float32),
                               rtol=1e-3, atol=0)


@pytest.mark.parametrize("stage", [1, 2])
def test_horovods_resume_recipe_is_refused_on_every_rank_instead_of_hanging(stage):
    """load_state_dict on the root alone, then broadcast_optimizer_state: each rank of a ZeRO optimizer keeps
    only its segment of what it loads, and the state_dict's gathers differed per rank (a hang before
    2026-12-05). Now every rank raises; loading on every rank works."""
    torch.manual_seed(0)
    source = torch.nn.Linear(5, 3)
    plain = torch.optim.Adam(source.parameters(), lr=0.01)
    source(torch.randn(4, 5)).sum().backward()
    plain.step()
    saved = plain.state_dict()
    model = torch.nn.Linear(5, 3)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), zero_stage=stage)
    if R == 0:
        opt.load_state_dict(saved)
    if N > 1:
        with pytest.raises(hvd.MismatchError, match=r"state_dict\(\): .*bucket 0 is exp_avg, exp_avg_sq, step on "
                                                    r"rank 0, \(none\) on rank.*load_state_dict\(...\) with the "
                                                    "whole state dict on every rank"):
            hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt.load_state_dict(saved)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    got = opt.state_dict()["state"]
    for i, p in saved["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[i][key], p[key])


def test_bad_stage_and_optimizer_raise_on_every_rank():
    model = Mixed()
    for stage in (5, -1, "1", True):
        with pytest.raises(ValueError, match="zero_stage"):
            hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), zero_stage=stage)
    with pytest.raises(ValueError, match="shard_module"):
        hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), zero_stage=3)
    with pytest.raises(ValueError, match="LBFGS cannot be sharded"):
        hvd.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), zero_stage=1)
    with pytest.raises(ValueError, match="Adasum"):
        hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), zero_stage=2, op=hvd.Adasum)

    class Custom(torch.optim.Optimizer):
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

    with pytest.raises(ValueError, match="_unison_elementwise"):
        hvd.DistributedOptimizer(Custom(model.parameters()), zero_stage=1)
    # docs/zero.md's other refusals
    with pytest.raises(ValueError, match="op=Average or op=Sum"):
        hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), zero_stage=1, op=hvd.Min)
    sparse = torch.nn.Parameter(torch.zeros(4, 3).to_sparse())
    with pytest.raises(ValueError, match="is sparse; ZeRO shards dense parameters only"):
        hvd.DistributedOptimizer(torch.optim.SGD([sparse], lr=0.1), named_parameters=[("sparse", sparse)],
                                 zero_stage=1)
    sharded = hvd.shard_module(Mixed())
    with pytest.raises(ValueError, match="shards made by shard_module"):
        hvd.DistributedOptimizer(torch.optim.SGD(sharded.parameters(), lr=0.1),
                                 named_parameters=sharded.named_parameters())
    _, built = distributed("adam", 1, steps=1)
    with pytest.raises(ValueError, match="does not take a closure"):
        built.step(lambda: 0.0)
    if N > 1:  # a rank outside the optimizer's process set cannot hold a shard of it
        ps = hvd.add_process_set(list(range(N - 1)))
        m = Mixed()
        if R == N - 1:
            with pytest.raises(ValueError, match=rf"this rank \({R}\) is not a member"):
                hvd.DistributedOptimizer(torch.optim.Adam(m.parameters()), named_parameters=m.named_parameters(),
                                         zero_stage=1, process_set=ps)
        else:
            hvd.DistributedOptimizer(torch.optim.Adam(m.parameters()), named_parameters=m.named_parameters(),
                                     zero_stage=1, process_set=ps)
        hvd.barrier()
        hvd.remove_process_set(ps)


@pytest.mark.skipif(N == 1, reason="a disagreement needs two ranks")
def test_ranks_asking_for_different_stages_raise_on_every_rank():
    model = Mixed()
    stage = 1 if R == 0 else 2
    with pytest.raises(ValueError, match="ranks disagree on the DistributedOptimizer's sharding"):
        hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                 zero_stage=stage)
    stage = 0 if R == 0 else 1
    with pytest.raises(ValueError, match="ranks disagree"):
        hvd.DistributedOptimizer(torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters(),
                                 zero_stage=stage)
    other = Mixed() if R else torch.nn.Linear(3, 3)
    with pytest.raises(ValueError, match="plan"):
        hvd.DistributedOptimizer(torch.optim.Adam(other.parameters()), named_parameters=other.named_parameters(),
                                 zero_stage=1)
    # and the engine still works afterwards: nothing half-built is left negotiating
    model, _ = distributed("adam", 1, steps=1)


CKPT = os.environ.get("ZERO_CKPT_DIR")


def save_state(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every rank: the consolidated model and optimizer state, written by rank 0 with torch.save."""
    state = {"model": model.state_dict(), "opt": opt.state_dict()}  # (collective under ZeRO)
    if R == 0:
        from unison.common.files import atomic_path

        with atomic_path(path) as tmp:
            torch.save(state, tmp)
    WORLD.Barrier()


def load_state(path: str) -> dict:
    assert os.path.exists(path), f"{path} missing: the np 4 launch must run first"
    return torch.load(path)


@pytest.mark.skipif(not CKPT, reason="the checkpoint test runs from tests/test_torch_zero_mpi.py")
def test_checkpoint_saved_at_4_continues_identically_at_any_size():
    path = os.path.join(CKPT, "zero.pt")
    if N == 4:  # train, save the consolidated state, and the expected continuation
        save_state(path, *distributed("adamw", 2))
    state = load_state(path)
    model = Mixed()
    model.load_state_dict(state["model"])
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adamw"](groups_of(model)),
                                   named_parameters=model.named_parameters(),
                                   zero_stage=1, zero_bucket_bytes=80)
    opt.load_state_dict(state["opt"])
    ref = Mixed()
    ref.load_state_dict(state["model"])
    ref_opt = OPTIMIZERS["adamw"](groups_of(ref))
    ref_opt.load_state_dict(state["opt"])
    for step in range(10, 12):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = data(step)
        torch.nn.functional.mse_loss(model(x[R * B:(R + 1) * B]), y[R * B:(R + 1) * B]).backward()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    assert_same_weights(model, ref)


@pytest.mark.skipif(not CKPT, reason="the checkpoint test runs from tests/test_torch_zero_mpi.py")
@pytest.mark.parametrize("consolidated", [False, True])
def test_sharded_checkpoint_saved_at_4_loads_at_any_size(consolidated):
    """save_sharded writes each rank's segments only; load_sharded reads its own under any layout."""
    path = os.path.join(CKPT, "zero.unison" if consolidated else "zero_sharded")
    ref_path = os.path.join(CKPT, f"zero_ref_{consolidated}.pt")
    if N == 4:
        model, opt = distributed("adam", 2)
        hvd.save_sharded(path, model, opt, metadata={"step": STEPS}, consolidated=consolidated)
        save_state(ref_path, model, opt)
    state = load_state(ref_path)
    ref = Mixed()
    ref.load_state_dict(state["model"])
    ref_opt = OPTIMIZERS["adam"](groups_of(ref))
    ref_opt.load_state_dict(state["opt"])
    model = Mixed()
    stage = 1 + (N % 2)
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](groups_of(model)), named_parameters=model.named_parameters(),
                                   zero_stage=stage, zero_bucket_bytes=48)
    assert hvd.load_sharded(path, model, opt) == {"step": STEPS}
    plain = Mixed()
    plain_opt = OPTIMIZERS["adam"](groups_of(plain))
    hvd.load_sharded(path, plain, plain_opt)  # into an unsharded optimizer on every rank
    for step in range(20, 22):
        x, y = data(step)
        for m, o, (xs, ys) in ((model, opt, local(step)), (ref, ref_opt, (x, y)), (plain, plain_opt, (x, y))):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
    assert_same_weights(model, ref)
    assert_same_weights(plain, ref)


@pytest.mark.parametrize("stage", [1, 2])
def test_grad_scaler_skip_decision_is_agreed_by_every_rank(stage):
    """An overflow in one element lands in one rank's shard; every rank must skip and lower the scale."""
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](groups_of(model)), named_parameters=model.named_parameters(),
                                   zero_stage=stage, zero_bucket_bytes=64)
    owners = [r for r in range(N) for st in opt._buckets for pc in st.bucket.owned(r)
              if pc.name == "l1.weight" and pc.param_offset == 0]
    assert len(owners) == 1  # element 0 of l1.weight sits in exactly one rank's shard
    scaler = hvd.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in model.parameters()]
    hook = model.l1.weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                               torch.tensor(float("inf" if R == 0 else 0.0))))
    opt.zero_grad()
    x, y = local(0)
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    hook.remove()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0, "every rank lowers its scale"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "every rank skips"
    opt.zero_grad()  # and the next, finite step is taken everywhere alike
    scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = WORLD.allgather(weights.numpy())
    assert all((w == everyone[0]).all() for w in everyone)


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_compression_reduces_in_half_and_stays_close(stage):
    """compression=Compression.fp16 sends each bucket as float16: close to, not equal to, float32."""
    ref, _ = reference("sgd_momentum")
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd_momentum"](groups_of(model)),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   compression=hvd.Compression.fp16, zero_bucket_bytes=64)
    sent = []
    original = opt._compression.compress

    def spy(arr):
        out, ctx = original(arr)
        sent.append(out.dtype)
        return out, ctx

    opt._compression = type("Spy", (), {"compress": staticmethod(spy),
                                        "decompress": staticmethod(opt._compression.decompress)})
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert sent and set(sent) == {torch.float16}  # (torch tensors, as Horovod's compressors get)
    assert_same_weights(model, ref, tol=2e-3)


class TwoHeads(torch.nn.Module):
    """A trunk and two heads; a step uses one head, so the other gets no gradient that step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.trunk, self.a, self.b = torch.nn.Linear(7, 6), torch.nn.Linear(6, 5), torch.nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(torch.tanh(self.trunk(x)))


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("zero_grad", ["optimizer", "model", "optimizer_keep"])
def test_a_parameter_without_a_gradient_this_step_contributes_nothing(stage, zero_grad):
    """Heads alternate; whatever zero_grad the user calls, a head unused this step must not be moved
    by an earlier step's gradient (stage 1 keeps gradient views that a step does not clear)."""
    heads = ["a", "b", "a", "a"]
    ref = TwoHeads()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # no momentum: a zero gradient moves nothing
    for step, head in enumerate(heads):
        ref_opt.zero_grad()
        x, y = data(step)
        torch.nn.functional.mse_loss(ref(x, head), y).backward()
        ref_opt.step()
    model = TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   zero_bucket_bytes=64)
    for step, head in enumerate(heads):
        if zero_grad == "model":
            model.zero_grad()
        else:
            opt.zero_grad(set_to_none=zero_grad == "optimizer")
        x, y = local(step)
        torch.nn.functional.mse_loss(model(x, head), y).backward()
        opt.step()
    for (name, got), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------ found by an audit (2026-12-04)
@pytest.mark.parametrize("clip", [None, 1.0])
def test_grad_scaler_with_a_plain_distributed_optimizer_trains_as_one_process(clip):
    """Stage 0: before 2026-12-05 GradScaler unscaled the gradients while their reductions were still writing
    them (weights far off, different on each rank, in some runs). Several steps, each checked, with and
    without unscale_ + clipping between."""
    ref, _ = reference("adam", clip=clip)
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](groups_of(model)), named_parameters=model.named_parameters())
    scaler = hvd.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = local(step)
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if clip is not None:
            scaler.unscale_(opt)  # the reduced gradients, unscaled: clip them as one process does
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
    assert_same_weights(model, ref, tol=1e-5)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = WORLD.allgather(weights.numpy())
    assert all((w == everyone[0]).all() for w in everyone)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_skipped_step_with_model_zero_grad_does_not_poison_the_next_ones(stage):
    """GradScaler skips a step whose gradients overflowed; the user's ``model.zero_grad()`` cannot
    clear the shards' reduced gradients, so the optimizer drops them itself (at stage 2 every later
    step used to be skipped: the next reduction was added to the infinite one)."""
    model = Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups_of(model), lr=0.01),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   **({"zero_bucket_bytes": 48} if stage else {}))
    scaler = hvd.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    skipped = []
    for step in range(4):
        (opt if stage == 0 else model).zero_grad()  # (stage 0: the optimizer's, which checks nothing is pending)
        x, y = local(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 0 and R == 0:
            loss = loss * 1e36  # overflows once scaled: step 0 only, rank 0 only
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
    assert skipped == [True, False, False, False]


@pytest.mark.parametrize("stage", [1, 2])
def test_half_precision_weights_set_after_wrapping_reach_the_masters(stage):
    """The fp32 masters of bfloat16 weights take weights loaded into the model later (they used to
    be overwritten by the masters' old values at the next step)."""
    model = torch.nn.Linear(7, 5).bfloat16()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   zero_bucket_bytes=16)
    model.load_state_dict({k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()})
    opt.zero_grad()
    x, y = local(0)
    torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
    opt.step()  # lr 0: nothing may move
    assert all(torch.all(p == 0.5) for p in model.parameters())


@pytest.mark.parametrize("stage", [1, 2])
def test_parameters_added_or_unfrozen_after_wrapping_are_refused(stage):
    model = Mixed()
    model.l2.weight.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(groups_of(model), lr=0.01),
                                   named_parameters=model.named_parameters(), zero_stage=stage)
    with pytest.raises(ValueError, match="parameters are fixed when it is built"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    model.l2.weight.requires_grad_(True)
    x, y = local(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="'l2.weight' has a gradient but was frozen"):
        opt.step()


def test_state_the_shards_cannot_hold_is_refused_on_every_rank_before_anything_changes():
    """A plain Adam creates a parameter's state at its first gradient; a state dict saved before one
    head ever had a gradient cannot be sharded where the heads share a bucket. Every rank raises
    (only the owners of that slice did, and the others went on into the next step's collectives)."""
    model, plain = Mixed(), Mixed()
    ref = torch.optim.Adam(plain.parameters(), lr=0.01)
    x, y = data(0)
    plain.l1(x).sum().backward()  # only l1 gets gradients: l2 and scale have no state
    ref.step()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), zero_stage=1,
                                   zero_bucket_bytes=1 << 20)  # one bucket: the heads share it
    with pytest.raises(ValueError, match="is missing .* of the same ZeRO bucket has it"):
        opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["lr"] == 0.01 and all(not s for s in opt._inner.state.values())


def test_eagerly_created_state_of_the_wrapped_class_is_not_kept_in_full():
    model = Mixed()
    opt = hvd.DistributedOptimizer(torch.optim.Adagrad(groups_of(model), lr=0.01),
                                   named_parameters=model.named_parameters(), zero_stage=1)
    assert len(opt.state) == 0  # Adagrad fills state['sum'] for every parameter in __init__
    held = sum(t.numel() for s in opt._inner.state.values() for t in s.values() if torch.is_tensor(t))
    assert held <= opt.plan.owned_numel(opt._rank) + 8 * len(opt._buckets)


def test_a_checkpoint_of_another_optimizer_class_is_refused_on_every_rank():
    import shutil
    import tempfile

    where = WORLD.bcast(tempfile.mkdtemp(prefix="zero_cls_") if R == 0 else None)
    try:
        model = Mixed()
        sgd = hvd.DistributedOptimizer(torch.optim.SGD(groups_of(model), lr=0.01, momentum=0.9),
                                       named_parameters=model.named_parameters(), zero_stage=1)
        x, y = local(0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        sgd.step()
        hvd.save_sharded(f"{where}/ck", model, sgd)
        for stage in (0, 1):
            other = Mixed()
            adam = hvd.DistributedOptimizer(torch.optim.Adam(groups_of(other), lr=0.01),
                                            named_parameters=other.named_parameters(), zero_stage=stage)
            with pytest.raises(ValueError, match="holds the state of a SGD optimizer; this one is a Adam"):
                hvd.load_sharded(f"{where}/ck", other, adam)
        hvd.load_sharded(f"{where}/ck", Mixed(), None)  # the weights alone still load
    finally:
        WORLD.Barrier()
        if R == 0:
            shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_half_precision_checkpoint_loads_its_float32_masters_into_a_float32_model(stage):
    """A bfloat16 model's checkpoint holds its float32 masters; a float32 model loading it got the rounded
    bfloat16 copy instead, up to an Adam step away from the masters, silently (found by an audit,
    2026-12-06). And a checkpoint with weights the model lacks is refused, as load_state_dict refuses them
    (it loaded without a word)."""
    import shutil
    import tempfile

    where = WORLD.bcast(tempfile.mkdtemp(prefix="zero_masters_") if R == 0 else None)
    try:
        torch.manual_seed(0)
        half = torch.nn.Linear(16, 16).to(torch.bfloat16)
        opt = hvd.DistributedOptimizer(torch.optim.Adam(half.parameters(), lr=1e-3),
                                       named_parameters=half.named_parameters(), zero_stage=stage)
        for step in range(3):
            opt.zero_grad()
            half(torch.full((4, 16), 0.1 * (step + 1), dtype=torch.bfloat16)).float().pow(2).mean().backward()
            opt.step()
        hvd.save_sharded(f"{where}/ck", half, opt)
        masters = ck.load(f"{where}/ck", {"master.weight": "full"}, WORLD)["master.weight"]
        assert not np.array_equal(masters, half.weight.detach().float().numpy())  # (rounding shows)
        for zero in (stage, 0):
            wide = torch.nn.Linear(16, 16)
            wopt = hvd.DistributedOptimizer(torch.optim.Adam(wide.parameters(), lr=1e-3),
                                            named_parameters=wide.named_parameters(), zero_stage=zero)
            hvd.load_sharded(f"{where}/ck", wide, wopt)
            np.testing.assert_array_equal(wide.weight.detach().numpy(), masters)
        hvd.load_sharded(f"{where}/ck", torch.nn.Linear(16, 16).to(torch.bfloat16), None)  # the half copy: fine
        with pytest.raises(ck.CheckpointError, match=r"holds weights this model does not have: \['model.bias'\]"):
            hvd.load_sharded(f"{where}/ck", torch.nn.Linear(16, 16, bias=False), None)
    finally:
        WORLD.Barrier()
        if R == 0:
            shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_checkpoints_keep_scalar_state_dtypes_and_load_into_another_precision(stage):
    """NAdam's float32 mu_product came back float64 (stored via .item()): a resumed run drifted
    from the uninterrupted one. A float32 checkpoint loaded into a float64 model gave its state
    the checkpoint's dtype, and the next step failed on every rank."""
    import shutil
    import tempfile

    where = WORLD.bcast(tempfile.mkdtemp(prefix="zero_dtype_") if R == 0 else None)
    try:
        def build(dtype=torch.float32):
            model = Mixed().to(dtype)
            opt = hvd.DistributedOptimizer(torch.optim.NAdam(groups_of(model), lr=0.01),
                                           named_parameters=model.named_parameters(), zero_stage=stage)
            return model, opt

        def train(model, opt, steps):
            for step in steps:
                opt.zero_grad()
                x, y = local(step)
                torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)),
                                             y.to(next(model.parameters()).dtype)).backward()
                opt.step()

        torch.manual_seed(0)
        model, opt = build()
        train(model, opt, range(2))
        hvd.save_sharded(f"{where}/ck", model, opt)
        train(model, opt, range(2, 4))  # the uninterrupted run
        torch.manual_seed(1)
        resumed, ropt = build()
        hvd.load_sharded(f"{where}/ck", resumed, ropt)
        dtypes = {str(v.dtype) for s in ropt.state_dict()["state"].values() for k, v in s.items()
                  if k == "mu_product" and torch.is_tensor(v)}
        assert dtypes <= {"torch.float32"}, dtypes
        train(resumed, ropt, range(2, 4))
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(a, b)
        with pytest.raises(ck.CheckpointError, match="verify='every' must be 'read'"):  # passed to the reader
            hvd.load_sharded(f"{where}/ck", resumed, ropt, verify="every")
        hvd.load_sharded(f"{where}/ck", resumed, ropt, verify="all")  # runs read in part are checked too
        wide, wopt = build(torch.float64)
        hvd.load_sharded(f"{where}/ck", wide, wopt)
        train(wide, wopt, range(2, 3))  # failed: expected dtype float for 'end' but got dtype double
        assert all(p.dtype == torch.float64 for p in wide.parameters())
    finally:
        WORLD.Barrier()
        if R == 0:
            shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_bucket_of_0_d_parameters_takes_a_plain_optimizers_state(stage):
    """A learned 0-d parameter in its own group (a temperature): its exp_avg is 0-d like step, so
    the whole bucket got one scalar state and its next step failed on every rank. Per-element
    keys are learned from the wrapped class itself."""
    def build():
        torch.manual_seed(0)
        lin, scale = torch.nn.Linear(3, 2), torch.nn.Parameter(torch.tensor(2.0))
        groups = [{"params": lin.parameters()}, {"params": [scale], "weight_decay": 0.0}]
        return lin, scale, groups

    def loss(lin, scale):
        x = torch.arange(12.0).reshape(4, 3) / 10  # the same rows on every rank: the average is the gradient
        return (lin(x) * scale.exp()).pow(2).mean()

    lin, scale, groups = build()
    plain = torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    loss(lin, scale).backward()
    plain.step()
    zlin, zscale, zgroups = build()
    zlin.load_state_dict(lin.state_dict())
    with torch.no_grad():
        zscale.copy_(scale)
    named = [("lin." + n, p) for n, p in zlin.named_parameters()] + [("scale", zscale)]
    zopt = hvd.DistributedOptimizer(torch.optim.AdamW(zgroups, lr=0.01, weight_decay=0.1),
                                    named_parameters=named, zero_stage=stage)
    zopt.load_state_dict(plain.state_dict())
    for opt, (a, b) in ((plain, (lin, scale)), (zopt, (zlin, zscale))):
        opt.zero_grad()
        loss(a, b).backward()
        opt.step()
    torch.testing.assert_close(zscale, scale, rtol=1e-6, atol=1e-7)
    for p, q in zip(zlin.parameters(), lin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ found by an audit (2026-12-05)
@pytest.mark.parametrize("stage", [1, 2])
def test_a_plain_state_dict_whose_parameters_stepped_differently_is_refused_on_every_rank(stage):
    """Adam's ``step`` is per parameter; a head trained on one step of four has 1 where the rest have
    4. A bucket's shard keeps one step: the first parameter's was given to all, silently (weights
    5e-3 off one process after 2 more steps). Every rank raises, before anything changes."""
    plain = TwoHeads()
    ref = torch.optim.Adam(plain.parameters(), lr=0.01)
    for step, head in enumerate(["b", "a", "a", "a"]):
        ref.zero_grad()
        x, y = data(step)
        torch.nn.functional.mse_loss(plain(x, head), y).backward()
        ref.step()
    assert len({float(s["step"]) for s in ref.state_dict()["state"].values()}) == 3  # trunk 4, b 1, a 3
    model = TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.02),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   zero_bucket_bytes=1 << 20)  # one bucket: the heads share it
    with pytest.raises(ValueError, match="'step' of parameter .* of the same ZeRO bucket has"):
        opt.load_state_dict(ref.state_dict())
    assert opt.param_groups[0]["lr"] == 0.02 and all(not s for s in opt._inner.state.values())
    with pytest.raises(ValueError, match="keeps one 'step' for the whole bucket"):  # wrapping it, too
        hvd.DistributedOptimizer(ref, named_parameters=plain.named_parameters(), zero_stage=stage,
                                 zero_bucket_bytes=1 << 20)


@pytest.mark.parametrize("stage", [1, 2])
def test_gradients_not_zeroed_between_steps_accumulate_as_in_one_process(stage):
    """torch adds a backward pass's gradients to those left from the last step; stage 1 added local
    gradients to its own averaged segment and stage 2 replaced the shards' gradients (weights 1.6e-2
    and 2.9e-2 off at np 3). Every way of zeroing in between still counts, step by step."""
    zeroing = ["optimizer", None, "model_keep", None, None, "model", None, "optimizer_keep", None]

    def zero(model, opt, how):
        if how is not None and how.startswith("model"):
            model.zero_grad(set_to_none=how == "model")
        elif how is not None:
            opt.zero_grad(set_to_none=how == "optimizer")

    ref = Mixed()
    ref_opt = OPTIMIZERS["sgd_momentum"](groups_of(ref))
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd_momentum"](groups_of(model)),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   zero_bucket_bytes=64)
    for step, how in enumerate(zeroing):
        for m, o, (x, y) in ((ref, ref_opt, data(step)), (model, opt, local(step))):
            zero(m, o, how)
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            # a metric through autograd.grad between step() and the next zero_grad(): nothing lands in .grad
            # (it settled stage 2's placeholders as "not zeroed", and the old gradients were added again)
            torch.autograd.grad(torch.nn.functional.mse_loss(m(x), y), list(m.parameters()))
        assert_same_weights(model, ref, tol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_zero_grad_between_backward_and_step_raises_on_every_rank(stage):
    """With a head unused on rank 0, rank 0 had no bucket in flight: its zero_grad() dropped the
    gradients and returned while the others raised (then the ranks' reductions differed)."""
    model = TwoHeads()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   **({"zero_stage": stage} if stage else {}))
    x, y = local(0)
    loss = torch.nn.functional.mse_loss(model(x, "a"), y)
    if R != 0:
        loss = loss + torch.nn.functional.mse_loss(model(x, "b"), y)
    loss.backward()
    try:
        opt.zero_grad()
        raised = False
    except RuntimeError as e:
        raised = "before optimizer.step() or optimizer.synchronize()" in str(e)
    assert all(WORLD.allgather(raised))
    opt.step()  # and the job goes on alike
    opt.zero_grad()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_nan_gradient_norm_makes_every_gradient_nan_as_torch_clips(stage):
    """torch's clip_grad_norm_ multiplies the gradients by max_norm / (NaN + eps): every one becomes NaN, which
    a GradScaler or the user's check then sees. Before 2026-12-07 the sharded clip kept them (min(1, NaN): 1)."""
    model = Mixed()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["sgd_momentum"](groups_of(model)),
                                   named_parameters=model.named_parameters(), zero_stage=stage,
                                   zero_bucket_bytes=64)
    x, y = local(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    if R == 0:  # (one element of one rank's shard of the averaged gradient)
        shard = next(g for st in opt._buckets if (g := st.master.grad) is not None and g.numel())
        shard.view(-1)[0] = float("nan")
    norm = hvd.clip_grad_norm_(opt, 1.0)
    assert torch.isnan(norm)
    grads = [g for st in opt._buckets if (g := st.master.grad) is not None]
    assert grads and all(bool(torch.isnan(g).all()) for g in grads)
    opt.zero_grad()


def _adam_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's full state (a ZeRO optimizer's gathered), by the model's parameter names."""
    sd = opt.state_dict()
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in opt.param_groups for p in g["params"]]
    return {order[i]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in sd["state"].items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_the_optimizer_state_of_a_checkpoint_does_not_depend_on_how_the_optimizer_was_named(stage):
    """A ZeRO optimizer built without named_parameters (Horovod's default) named its state after a
    per-process counter; a run that built another DistributedOptimizer first found no entries and
    restarted Adam from zero without a word, as did a plain optimizer loading it (found by an audit,
    2026-12-07). The state is named after the model's parameters now; a checkpoint whose optimizer state
    no parameter claims is refused instead of dropped."""
    import shutil
    import tempfile

    where = WORLD.bcast(tempfile.mkdtemp(prefix="zero_names_") if R == 0 else None)
    try:
        model = Mixed()
        opt = hvd.DistributedOptimizer(torch.optim.Adam(groups_of(model), lr=0.01), zero_stage=stage)
        for step in range(2):
            x, y = local(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        hvd.save_sharded(f"{where}/ck", model, opt)
        want = _adam_state(model, opt)
        assert all(float(s["exp_avg"].abs().sum()) > 0 for s in want.values())
        plain_model = Mixed()
        plain = torch.optim.Adam(groups_of(plain_model), lr=0.01)
        hvd.load_sharded(f"{where}/ck", plain_model, plain)
        got = _adam_state(plain_model, plain)
        assert sorted(got) == sorted(want)
        for name in want:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[name][key].float(), want[name][key].float()), (name, key)
        hvd.DistributedOptimizer(torch.optim.SGD(Mixed().parameters(), lr=0.1), zero_stage=stage)  # names shift
        again = Mixed()
        zero = hvd.DistributedOptimizer(torch.optim.Adam(groups_of(again), lr=0.01), zero_stage=stage)
        hvd.load_sharded(f"{where}/ck", again, zero)
        got = _adam_state(again, zero)
        for name in want:
            assert torch.equal(got[name]["exp_avg"], want[name]["exp_avg"]), name
        # a checkpoint whose state belongs to parameters this optimizer does not train: refused, not dropped
        part = Mixed()
        some = hvd.DistributedOptimizer(torch.optim.Adam([{"params": list(part.l1.parameters())},
                                                          {"params": [part.l2.weight], "lr": 0.03}], lr=0.01),
                                        zero_stage=stage)
        with pytest.raises(ck.CheckpointError, match=r"optimizer state for parameters this optimizer does not "
                                                     r"train: \['l2.bias', 'scale'\]"):
            hvd.load_sharded(f"{where}/ck", part, some)
    finally:
        WORLD.Barrier()
        if R == 0:
            shutil.rmtree(where, ignore_errors=True)


def test_a_save_with_an_optimizer_on_some_ranks_only_is_refused_on_every_rank():
    """Rank 0's optimizer=None went into the manifest and the other ranks' state into the files: a
    checkpoint that said it held no optimizer state held some, which no load would read; the save
    reported success on every rank (found by an audit, 2026-12-07)."""
    import shutil
    import tempfile

    where = WORLD.bcast(tempfile.mkdtemp(prefix="zero_some_") if R == 0 else None)
    try:
        model = Mixed()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        x, y = local(0)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        with pytest.raises(ValueError, match=r"save_sharded: the ranks passed different optimizers \(\[None, "):
            hvd.save_sharded(f"{where}/ck", model, None if R == 0 else opt)
        assert not os.path.exists(f"{where}/ck/manifest.json")
        hvd.save_sharded(f"{where}/ck", model, opt)  # the next save pairs
        again = Mixed()
        hvd.load_sharded(f"{where}/ck", again, torch.optim.Adam(again.parameters(), lr=0.01))
    finally:
        WORLD.Barrier()
        if R == 0:
            shutil.rmtree(where, ignore_errors=True)
