"""ZeRO stage 3 for PyTorch under mpirun: N sharded ranks against one process on the global batch.

Every rank runs the same test bodies at any rank count; the reference model is trained unsharded on
every rank with the whole global batch, so each comparison holds on every rank.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import unison.torch_backend as hvd
from unison.common import checkpoints as ck
from unison.torch_backend.zero3 import (
    clip_sharded_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    shard_module,
    zero3_memory,
)

WORLD = MPI.COMM_WORLD
N, R = WORLD.Get_size(), WORLD.Get_rank()
torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def _session():
    hvd.init()
    yield
    hvd.shutdown()


# ----------------------------------------------------------------- models and data
class Mixed(nn.Module):
    """One unit with two dtypes: a float32 matrix and a float64 scale."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(7, 5) * 0.3)
        self.s = nn.Parameter(1 + 0.1 * torch.randn(5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w) * self.s.to(x.dtype)


class Block(nn.Module):
    """Transformer-ish: embedding, layer norm, attention, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.ln = nn.LayerNorm(6)
        # no in_proj bias: its key part has a zero gradient in exact arithmetic, and Adam turns the
        # rounding noise there into steps of size lr, which no two summation orders agree on
        self.attn = nn.MultiheadAttention(6, 2, bias=False, batch_first=True)
        self.head = nn.Linear(6, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(tokens))
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(h + a).mean(dim=1)


class TiedLM(nn.Module):
    """An embedding tied to the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 13, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.emb(tokens).mean(dim=1))))


def make(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), Mixed(), nn.Tanh(), nn.Linear(5, 3))
    if kind == "block":
        return Block()
    if kind == "tied":
        return TiedLM()
    if kind == "big":
        return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 97), nn.ReLU(), nn.Linear(97, 10))
    raise ValueError(kind)


def global_batch(kind: str, step: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    if kind in ("block", "tied"):
        x = torch.randint(0, 13, (N * b, 4), generator=g)
        y = torch.randn(N * b, 5 if kind == "block" else 13, generator=g)
    else:
        x = torch.randn(N * b, 6 if kind == "mlp" else 64, generator=g)
        y = torch.randn(N * b, 3 if kind == "mlp" else 10, generator=g)
    return x, y


def mine(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[R * b:(R + 1) * b]


def make_opt(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def assert_same_as_reference(model: nn.Module, ref: nn.Module, atol: float = 2e-5) -> None:
    full, expected = full_state_dict(model), ref.state_dict()
    assert list(full) == list(expected)
    for key, value in expected.items():
        assert full[key].dtype == value.dtype, key
        np.testing.assert_allclose(full[key].double().numpy(), value.double().numpy(), rtol=1e-4, atol=atol,
                                   err_msg=key)


def train_both(kind: str, opt_name: str, steps: int = 3, b: int = 3, passes: int = 1,
               clip: float | None = None, **shard_kw) -> tuple[nn.Module, nn.Module, list]:
    """Train a sharded model (ranks start from different weights: rank 0's win) and the reference."""
    model, ref, norms, _, _ = train_pair(kind, opt_name, steps, b, passes, clip, **shard_kw)
    return model, ref, norms


def train_pair(kind: str, opt_name: str, steps: int = 3, b: int = 3, passes: int = 1,
               clip: float | None = None, **shard_kw) -> tuple[nn.Module, nn.Module, list, torch.optim.Optimizer,
                                                               torch.optim.Optimizer]:
    """:func:`train_both`, also returning the two optimizers."""
    model, ref = make(kind, seed=100 + R), make(kind, seed=100)
    shard_module(model, **shard_kw)
    opt, ref_opt = make_opt(opt_name, model.parameters()), make_opt(opt_name, ref.parameters())
    norms = []
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        for j in range(passes):
            x, y = global_batch(kind, step * passes + j, b)
            nn.functional.mse_loss(model(mine(x, b)), mine(y, b)).backward()
            nn.functional.mse_loss(ref(x), y).backward()
        if clip is not None:
            norms.append((float(clip_sharded_grad_norm_(model, clip)),
                          float(nn.utils.clip_grad_norm_(ref.parameters(), clip))))
        opt.step()
        ref_opt.step()
    return model, ref, norms, opt, ref_opt


# ----------------------------------------------------------------- equivalence
@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_n_ranks_match_one_process_on_global_batch(kind, opt_name):
    model, ref, _ = train_both(kind, opt_name)
    assert_same_as_reference(model, ref)


def test_parameter_counts_do_not_divide_by_rank_count():
    model = shard_module(make("mlp", seed=1))
    units = model._unison_zero3.units
    sizes = [b.numel for u in units for b in u.plan.buckets]
    assert N == 1 or any(s % N for s in sizes), sizes
    dtypes = {key for u in units for key in u.flats}
    assert dtypes == {"float32", "float64"}


def test_accumulation_over_two_backward_passes():
    model, ref, _ = train_both("mlp", "sgd", passes=2)
    assert_same_as_reference(model, ref)


def test_prefetch_off_and_bucket_splits_give_the_same_weights():
    model, ref, _ = train_both("block", "adam", prefetch=False, bucket_bytes=64)
    assert_same_as_reference(model, ref)
    assert any(len(u.plan.buckets) > 1 for u in model._unison_zero3.units)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_equals_unsharded_clip(norm_type):
    model, ref = make("mlp", seed=100), make("mlp", seed=100)
    shard_module(model)
    opt, ref_opt = make_opt("sgd", model.parameters()), make_opt("sgd", ref.parameters())
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = global_batch("mlp", step, 3)
        nn.functional.mse_loss(model(mine(x, 3)), mine(y, 3)).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        clip = hvd.clip_grad_norm_ if norm_type == 2.0 else clip_sharded_grad_norm_  # the public name dispatches
        got = float(clip(model, 0.05, norm_type))
        want = float(nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type))
        assert want > 0.05  # the clip really scales
        assert got == pytest.approx(want, rel=1e-5)
        opt.step()
        ref_opt.step()
    assert_same_as_reference(model, ref)


def test_tied_weights_inside_one_unit_train_like_the_reference():
    model, ref, _ = train_both("tied", "adam", unit_classes=(TiedLM,))
    assert_same_as_reference(model, ref)
    full = full_state_dict(model)
    assert torch.equal(full["emb.weight"], full["out.weight"])


def test_frozen_parameters_stay_frozen_under_weight_decay():
    model, ref = make("mlp", seed=100 + R), make("mlp", seed=100)
    for m in (model, ref):
        m[2].s.requires_grad_(False)  # the float64 scale, in a unit with a trainable matrix
        m[0].bias.requires_grad_(False)
    shard_module(model)
    assert sorted(n for n, _ in model[2].named_parameters()) == ["zero3_flat_float32", "zero3_flat_float64_frozen"]
    opt, ref_opt = make_opt("adamw", model.parameters()), make_opt("adamw", ref.parameters())
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = global_batch("mlp", step, 3)
        nn.functional.mse_loss(model(mine(x, 3)), mine(y, 3)).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    assert_same_as_reference(model, ref)
    assert torch.equal(full_state_dict(model)["2.s"], make("mlp", seed=100)[2].s.detach())


def test_prefetch_gathers_the_next_unit_during_the_current_forward():
    model = shard_module(make("mlp", seed=1))
    state = model._unison_zero3
    seen = []

    def probe(module, args):  # runs after shard_module's pre-hook on the first Linear
        nxt = state.order[1] if len(state.order) > 1 else None
        seen.append(nxt is not None and (bool(nxt.gathers) or nxt.is_gathered()))

    model[0].register_forward_pre_hook(probe)
    for _ in range(2):
        model(torch.randn(2, 6)).sum().backward()
    assert seen == [False, True]  # the first forward records the order; the second prefetches


def test_backward_regathers_only_units_whose_weights_it_needs():
    model = shard_module(make("block", seed=1))
    state = model._unison_zero3
    x, y = global_batch("block", 0, 2)
    nn.functional.mse_loss(model(mine(x, 2)), mine(y, 2)).backward()
    needed = {u.name for u in state.units if id(u) in state.needed_in_backward}
    assert needed == {"ln", "attn", "head"}  # embedding backward does not read its weight
    assert zero3_memory(model)["gathered_bytes"] == 0


def test_eval_under_no_grad_then_train():
    model, ref = make("mlp", seed=100), make("mlp", seed=100)
    shard_module(model)
    x, y = global_batch("mlp", 0, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
    assert zero3_memory(model)["gathered_bytes"] == 0
    opt, ref_opt = make_opt("adam", model.parameters()), make_opt("adam", ref.parameters())
    nn.functional.mse_loss(model(mine(x, 3)), mine(y, 3)).backward()
    nn.functional.mse_loss(ref(x), y).backward()
    opt.step()
    ref_opt.step()
    assert_same_as_reference(model, ref)


# ----------------------------------------------------------------- state dicts
def test_full_state_dict_loads_in_a_plain_module_and_predicts_the_same():
    model, ref, _ = train_both("block", "adamw", steps=2)
    plain = make("block", seed=3)
    plain.load_state_dict(full_state_dict(model))
    x, _ = global_batch("block", 9, 3)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), ref(x), rtol=1e-4, atol=2e-5)
        torch.testing.assert_close(model(x), plain(x))


def test_load_full_state_dict_into_a_sharded_model():
    ref = make("block", seed=42)
    model = shard_module(make("block", seed=7))
    load_full_state_dict(model, ref.state_dict())
    assert_same_as_reference(model, ref, atol=0)
    with pytest.raises(KeyError, match="missing keys \\['emb.weight'\\]"):
        load_full_state_dict(model, {k: v for k, v in ref.state_dict().items() if k != "emb.weight"})


def test_bfloat16_unit_round_trips_exactly():
    torch.manual_seed(5)
    ref = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 3)).to(torch.bfloat16)
    model = shard_module(nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 3)).to(torch.bfloat16))
    load_full_state_dict(model, ref.state_dict())
    assert_same_as_reference(model, ref, atol=0)
    x = torch.randn(4, 5).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def half_mlp() -> nn.Module:
    """Two bfloat16 layers (7x5 + 5 and 5x3 + 3 parameters)."""
    return nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).to(torch.bfloat16)


def half_data(step: int, b: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(N * b, 7, generator=g), torch.randn(N * b, 3, generator=g)


def owned_values(model: nn.Module, values: dict[str, torch.Tensor]):
    """(this rank's master run, the same run cut from the full tensor ``values[name]``) per owned run."""
    for unit in model._unison_zero3.units:
        for name in unit.names:
            flat = unit.flats[unit.flat_of[unit.index[name]]]
            for pc in unit.owned.get(name, []):
                full = values[name].detach().reshape(-1)
                yield (flat.shard.detach()[pc.offset:pc.offset + pc.length],
                       full[pc.param_offset:pc.param_offset + pc.length])


def test_bfloat16_parameters_step_fp32_masters():
    """The optimizer steps float32 masters; forward and backward see them rounded to bfloat16."""
    torch.manual_seed(3)
    model = half_mlp()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plain, compute = half_mlp(), half_mlp()  # plain: bfloat16 SGD; compute + masters: the reference
    plain.load_state_dict(start)
    masters = {k: v.float().requires_grad_(True) for k, v in start.items()}
    shard_module(model)
    assert all(p.dtype == torch.float32 for p in model.parameters()), "model.parameters() are the fp32 masters"
    lr = 1e-4  # each update is far below bfloat16's resolution near these weights
    opt, plain_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(plain.parameters(), lr=lr)
    master_opt = torch.optim.SGD(masters.values(), lr=lr)
    for step in range(3):
        x, y = half_data(step)
        with torch.no_grad():
            for k, p in compute.named_parameters():
                p.copy_(masters[k].bfloat16())
        for m, o, (xs, ys) in ((model, opt, (mine(x, 3), mine(y, 3))), (plain, plain_opt, (x, y)),
                               (compute, None, (x, y))):
            m.zero_grad()
            nn.functional.mse_loss(m(xs.bfloat16()).float(), ys).backward()
            if o is not None:
                o.step()
        for k, p in compute.named_parameters():
            masters[k].grad = p.grad.float()
        master_opt.step()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert full_state_dict(model)["0.weight"].dtype == torch.bfloat16
    moved = torch.cat([(p.detach() != start[k]).reshape(-1) for k, p in plain.state_dict().items()])
    assert moved.float().mean() < 0.5, "plain bfloat16 SGD was expected to round most updates away"
    full, starts = full_state_dict(model), {k: v.float() for k, v in start.items()}
    held = owned = 0
    got, want = [], []
    for (master, ref_master), (_, gathered), (_, first) in zip(
            owned_values(model, masters), owned_values(model, full), owned_values(model, starts), strict=True):
        assert torch.equal(gathered, master.bfloat16()), "the gathered weights are the masters, rounded"
        held += int((master != master.bfloat16().float()).sum())  # precision bfloat16 cannot hold
        owned += master.numel()
        got.append(master - first)
        want.append(ref_master - first)
    assert held > 0.5 * owned, f"the fp32 masters keep updates bfloat16 rounds away ({held}/{owned})"
    got_t, want_t = torch.cat(got), torch.cat(want)
    scale = float(want_t.abs().max())
    assert scale > 0
    np.testing.assert_allclose(got_t.numpy(), want_t.numpy(), rtol=0.05, atol=0.03 * scale,
                               err_msg="master updates differ from one process stepping fp32 masters")
    mem = zero3_memory(model)
    shard_numel = sum(p.numel() for p in model.parameters())
    assert mem["master_bytes"] == mem["shard_bytes"] == 4 * shard_numel
    assert mem["grad_bytes"] == mem["shard_bytes"]
    assert mem["full_param_bytes"] == 2 * sum(v.numel() for v in start.values())
    in_own_dtype = shard_module(half_mlp(), master_weights=False)
    assert all(p.dtype == torch.bfloat16 for p in in_own_dtype.parameters())
    assert zero3_memory(in_own_dtype)["master_bytes"] == 0


# ----------------------------------------------------------------- sharded checkpoints (hvd.save_sharded)
CKPT = os.environ.get("ZERO_CKPT_DIR")


def continue_steps(pairs, first: int, b: int = 3) -> None:
    """Two more steps of each (model, optimizer, sharded?) on the global batch (a sharded one on its part)."""
    for step in range(first, first + 2):
        x, y = global_batch("mlp", step, b)
        for m, o, sharded in pairs:
            o.zero_grad()
            xs, ys = (mine(x, b), mine(y, b)) if sharded else (x, y)
            nn.functional.mse_loss(m(xs), ys).backward()
            o.step()


def assert_plain_matches(plain: nn.Module, ref: nn.Module, atol: float = 2e-5) -> None:
    for key, value in ref.state_dict().items():
        np.testing.assert_allclose(plain.state_dict()[key].double().numpy(), value.double().numpy(), rtol=1e-4,
                                   atol=atol, err_msg=key)


def assert_runs_equal(model: nn.Module, opt: torch.optim.Optimizer, key: str,
                      full: dict[str, torch.Tensor]) -> None:
    """This rank's runs of optimizer state ``key`` equal the same elements of the full tensors, bit for bit."""
    state = {id(p): opt.state[p][key] for p in model.parameters() if p in opt.state}
    for unit in model._unison_zero3.units:
        for name in unit.names:
            flat = unit.flats[unit.flat_of[unit.index[name]]]
            for pc in unit.owned.get(name, []):
                got = state[id(flat.shard)][pc.offset:pc.offset + pc.length]
                want = full[name].reshape(-1)[pc.param_offset:pc.param_offset + pc.length]
                assert torch.equal(got, want), (key, name, pc)


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.ha, self.hb = nn.Linear(5, 5), nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # hb is not used: its unit never steps
        return self.ha(torch.tanh(self.body(x)))


@pytest.mark.skipif(not CKPT, reason="the checkpoint test runs from tests/test_torch_zero3_mpi.py")
def test_a_bfloat16_checkpoint_loads_its_float32_masters_into_a_float32_model():
    """The float32 shards took the bfloat16 copy of the weights, not the saved masters (found by an audit,
    2026-12-06); weights the model lacks are refused (they loaded without a word)."""
    path = os.path.join(CKPT, f"zero3_masters_{N}")
    torch.manual_seed(4)
    model = shard_module(half_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(3):
        x, y = half_data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(mine(x, 3).to(torch.bfloat16)).float(), mine(y, 3)).backward()
        opt.step()
    hvd.save_sharded(path, model, opt)
    masters = ck.load(path, {"master.0.weight": "full", "master.2.weight": "full"}, WORLD)
    wide = shard_module(nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)))
    hvd.load_sharded(path, wide, None)
    got = full_state_dict(wide)
    for key in ("0.weight", "2.weight"):
        np.testing.assert_array_equal(got[key].numpy(), masters[f"master.{key}"])
    smaller = shard_module(nn.Sequential(nn.Linear(7, 5)))
    with pytest.raises(ck.CheckpointError, match="holds weights this model does not have"):
        hvd.load_sharded(path, smaller, None)


def test_a_checkpoint_whose_parameters_stepped_differently_is_refused_where_they_share_a_segment():
    """hb's unit never stepped: no state for it. Loaded into one merged unit, or into a ZeRO 2 bucket, hb got
    its neighbours' step count and zero moments (5.8e-3 off after two steps, silently) before 2026-12-05.
    Ranks passing an optimizer on some ranks only each loaded what they had (states out of step)."""
    path = os.path.join(CKPT, f"zero3_mixed_{N}")
    torch.manual_seed(1)
    model = shard_module(Heads())
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(torch.randn(4, 5, generator=g)), torch.randn(4, 3, generator=g)).backward()
        opt.step()
    hvd.save_sharded(path, model, opt)
    merged = shard_module(Heads(), unit_classes=(Heads,))
    with pytest.raises(ValueError, match="saved different optimizer state for parameters that share one"):
        hvd.load_sharded(path, merged, torch.optim.Adam(merged.parameters(), lr=0.01))
    plain = Heads()
    staged = hvd.DistributedOptimizer(torch.optim.Adam(plain.parameters(), lr=0.01),
                                      named_parameters=plain.named_parameters(), zero_stage=2)
    with pytest.raises(ValueError, match="saved different optimizer state for parameters that share one"):
        hvd.load_sharded(path, plain, staged)
    if N > 1:  # (a ZeRO 1/2 rank waited in a collective the others skipped: a hang)
        with pytest.raises(ValueError, match="ranks passed different optimizers"):
            hvd.load_sharded(path, plain, staged if R == 0 else None)
    same = shard_module(Heads())
    same_opt = torch.optim.Adam(same.parameters(), lr=0.01)
    hvd.load_sharded(path, same, same_opt)  # the layout it was saved with
    assert all(torch.equal(v, full_state_dict(model)[k]) for k, v in full_state_dict(same).items())
    if N > 1:
        with pytest.raises(ValueError, match="ranks passed different optimizers"):
            hvd.load_sharded(path, same, same_opt if R == 0 else None)
        # a checkpoint one rank cannot read: raised there alone, the others waited in the load (a hang)
        for target, target_opt in ((same, same_opt), (plain, staged)):
            with pytest.raises(ValueError, match="rank 1: no checkpoint"):
                hvd.load_sharded(path + ".missing" if R == 1 else path, target, target_opt)


@pytest.mark.skipif(not CKPT, reason="the checkpoint test runs from tests/test_torch_zero3_mpi.py")
def test_sharded_checkpoint_saved_at_4_loads_at_any_size():
    """Stage 3 + Adam saved at 4 ranks (each rank its runs) resumes at N ranks into stage 3, a plain model +
    plain Adam and stage 1, all continuing like one process; bfloat16 masters come back bit for bit; a stage 1
    checkpoint loads back into stage 3."""
    path, ref_path, half_path = (os.path.join(CKPT, n) for n in ("zero3_sharded", "zero3_ref.pt", "zero3_bf16"))
    if N == 4:
        model, ref, _, opt, ref_opt = train_pair("mlp", "adam", steps=2)
        with pytest.raises(ValueError, match="not shards of this model"):
            hvd.save_sharded(path, model, make_opt("adam", make("mlp", seed=1).parameters()))
        hvd.save_sharded(path, model, opt, metadata={"step": 2})
        half = shard_module(half_mlp())
        half_opt = torch.optim.SGD(half.parameters(), lr=1e-4, momentum=0.9)
        for step in range(2):
            x, y = half_data(step)
            half_opt.zero_grad()
            nn.functional.mse_loss(half(mine(x, 3).bfloat16()).float(), mine(y, 3)).backward()
            half_opt.step()
        hvd.save_sharded(half_path, half, half_opt)
        if R == 0:
            from unison.common.files import atomic_path

            with atomic_path(ref_path) as tmp:
                torch.save({"model": ref.state_dict(), "opt": ref_opt.state_dict()}, tmp)
        WORLD.Barrier()
    assert os.path.exists(ref_path), f"{ref_path} missing: the np 4 launch must run first"
    saved = torch.load(ref_path)
    ref = make("mlp", seed=0)
    ref.load_state_dict(saved["model"])
    ref_opt = make_opt("adam", ref.parameters())
    ref_opt.load_state_dict(saved["opt"])
    model = shard_module(make("mlp", seed=7))
    opt = make_opt("adam", model.parameters())
    assert hvd.load_sharded(path, model, opt) == {"step": 2}
    # another number of parameter groups is refused on every rank, before anything loads (before 2026-12-05
    # the groups were zipped: a one-group checkpoint's lr went to the first group, silently)
    grouped = shard_module(make("mlp", seed=13))
    gp = list(grouped.parameters())
    with pytest.raises(ValueError, match="holds 1 parameter group.*this optimizer has 2"):
        hvd.load_sharded(path, grouped, torch.optim.Adam([{"params": gp[:1]}, {"params": gp[1:], "lr": 0.5}]))
    two = make("mlp", seed=14)
    tp = list(two.parameters())
    with pytest.raises(ValueError, match="holds 1 parameter group.*this optimizer has 2"):
        hvd.load_sharded(path, two, torch.optim.Adam([{"params": tp[:1]}, {"params": tp[1:], "lr": 0.5}]))
    plain = make("mlp", seed=8)
    plain_opt = make_opt("adam", plain.parameters())
    hvd.load_sharded(path, plain, plain_opt)  # a plain model and optimizer, on every rank
    staged = make("mlp", seed=9)
    staged_opt = hvd.DistributedOptimizer(make_opt("adam", staged.parameters()),
                                          named_parameters=staged.named_parameters(), zero_stage=1)
    hvd.load_sharded(path, staged, staged_opt)
    # the runs this rank read equal the same elements read whole by the plain path, bit for bit
    for key in ("exp_avg", "exp_avg_sq"):
        assert_runs_equal(model, opt, key, {n: plain_opt.state[p][key] for n, p in plain.named_parameters()})
    assert all(torch.equal(v, full_state_dict(model)[k]) for k, v in plain.state_dict().items())
    # a plain optimizer's checkpoint numbers its state: the weights load into stage 3, the state is refused
    plain_path = os.path.join(CKPT, f"plain_at_{N}")
    hvd.save_sharded(plain_path, plain, plain_opt)
    weights_only = shard_module(make("mlp", seed=12))
    with pytest.raises(ValueError, match="saved from a plain optimizer"):
        hvd.load_sharded(plain_path, weights_only, make_opt("adam", weights_only.parameters()))
    hvd.load_sharded(plain_path, weights_only)
    assert all(torch.equal(v, full_state_dict(weights_only)[k]) for k, v in plain.state_dict().items())
    continue_steps([(model, opt, True), (ref, ref_opt, False), (plain, plain_opt, False),
                    (staged, staged_opt, True)], first=20)
    assert_same_as_reference(model, ref)
    assert_plain_matches(plain, ref)
    assert_plain_matches(staged, ref)

    # and back: a stage 1 checkpoint (another layout, saved at this rank count) loads into stage 3
    back = os.path.join(CKPT, f"zero1_at_{N}")
    hvd.save_sharded(back, staged, staged_opt)
    again = shard_module(make("mlp", seed=11))
    again_opt = make_opt("adam", again.parameters())
    hvd.load_sharded(back, again, again_opt)
    assert all(torch.equal(v, full_state_dict(again)[k]) for k, v in staged.state_dict().items())
    whole = staged_opt.state_dict()["state"]  # torch's format, full shapes (a collective)
    names = [n for n, _ in staged.named_parameters()]
    for key in ("exp_avg", "exp_avg_sq"):
        assert_runs_equal(again, again_opt, key, {n: whole[i][key] for i, n in enumerate(names)})

    half = shard_module(half_mlp())
    half_opt = torch.optim.SGD(half.parameters(), lr=1e-4, momentum=0.9)
    hvd.load_sharded(half_path, half, half_opt)
    names = [n for u in half._unison_zero3.units for n in u.names]
    whole = ck.load(half_path, {e: "full" for n in names for e in (f"master.{n}", f"optim.{n}.momentum_buffer")})
    masters = {n: torch.from_numpy(np.array(whole[f"master.{n}"])) for n in names}
    buffers = {n: torch.from_numpy(np.array(whole[f"optim.{n}.momentum_buffer"])) for n in names}
    held = 0
    for (master, want), (_, weight) in zip(owned_values(half, masters), owned_values(half, full_state_dict(half)),
                                           strict=True):
        assert torch.equal(master, want), "the fp32 masters are restored bit for bit"
        assert torch.equal(weight, master.bfloat16())
        held += int((master != master.bfloat16().float()).sum())
    assert held > 0, "the saved masters hold precision bfloat16 cannot"
    assert_runs_equal(half, half_opt, "momentum_buffer", buffers)

def test_a_save_that_one_rank_cannot_describe_raises_on_every_rank_instead_of_hanging():
    """Before 2026-12-07 a save's entries were made outside any agreement: an optimizer over another
    model's parameters, or state numpy cannot take, raised on that rank alone while the others waited in
    the save's first collective for ever."""
    if N == 1:
        pytest.skip("needs two ranks")
    path = os.path.join(WORLD.bcast(tempfile.mkdtemp(prefix="zero3-refused-") if R == 0 else None), "ck")
    model = shard_module(make("mlp", seed=1))
    foreign = make_opt("adam", (model if R != 1 else make("mlp", seed=2)).parameters())
    with pytest.raises(ck.CheckpointError, match="rank 1: the optimizer's parameters at positions .* are not "
                                                 "shards of this model; build the optimizer over the sharded"):
        hvd.save_sharded(path, model, foreign)
    opt = make_opt("adam", model.parameters())
    x, y = global_batch("mlp", 0, 3)
    nn.functional.mse_loss(model(mine(x, 3)), mine(y, 3)).backward()
    opt.step()
    if R == 1:  # state numpy cannot take (a tensor without data)
        p = next(iter(opt.state))
        opt.state[p]["stray"] = torch.zeros(p.shape, device="meta")
    with pytest.raises(ck.CheckpointError, match="rank 1: unison.torch_backend handles CPU tensors; got a "
                                                 "tensor on meta"):
        hvd.save_sharded(path, model, opt)
    assert not os.path.exists(path)
    if R == 1:
        del opt.state[p]["stray"]
    hvd.save_sharded(path, model, opt)  # the ranks go on together
    got = ck.load(path, {"model.0.weight": "full"}, WORLD)
    np.testing.assert_array_equal(got["model.0.weight"], full_state_dict(model)["0.weight"].numpy())


# ----------------------------------------------------------------- memory
def reachable_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor storage reachable from the model's modules (parameters, their
    gradients, buffers and plain tensor attributes), counted as allocated now."""
    seen: dict[int, int] = {}
    for mod in model.modules():
        values = list(mod._parameters.values()) + list(mod._buffers.values()) + list(vars(mod).values())
        values += [p.grad for p in mod._parameters.values() if p is not None]
        for t in values:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def test_memory_is_one_nth_and_full_weights_are_freed_between_forwards():
    model = make("big", seed=100)
    full = reachable_bytes(model)
    shard_module(model)
    state = model._unison_zero3
    mem = zero3_memory(model)
    assert mem["full_param_bytes"] == full
    pad_bound = sum(len(u.plan.buckets) for u in state.units) * (N - 1) * 4
    assert full / N <= mem["shard_bytes"] <= (full + pad_bound) / N
    assert reachable_bytes(model) == mem["shard_bytes"]
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == mem["shard_bytes"]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sizes = sorted(sum(f.full_bytes for f in u.flats.values()) for u in state.units)
    for step in range(2):
        state.peak_gathered_bytes = 0
        x, y = global_batch("big", step, 2)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(mine(x, 2)), mine(y, 2))
        assert zero3_memory(model)["gathered_bytes"] == 0  # freed between forward and backward
        assert model[0].weight.numel() == 0  # the attribute is a placeholder while freed
        loss.backward()
        opt.step()
        mem = zero3_memory(model)
        assert mem["gathered_bytes"] == 0
        assert 0 < mem["peak_gathered_bytes"] <= sizes[-1] + sizes[-2]
        assert all(v.grad is None for u in state.units for v in u.views)
        assert mem["grad_bytes"] == mem["shard_bytes"]
    moments = sum(t.untyped_storage().nbytes() for s in opt.state.values() for k, t in s.items() if k != "step")
    assert moments == 2 * mem["shard_bytes"]
    assert reachable_bytes(model) == 2 * mem["shard_bytes"]  # shards and their grads, nothing full


# ----------------------------------------------------------------- bad input (every rank raises)
def test_not_a_module_raises_type_error():
    with pytest.raises(TypeError, match="torch.nn.Module; got list"):
        shard_module([torch.zeros(3)])


def test_one_rank_passing_a_non_module_raises_on_every_rank():
    if N == 1:
        pytest.skip("needs two ranks")
    arg = [torch.zeros(3)] if R == 0 else make("mlp", seed=1)
    with pytest.raises(TypeError, match="nn.Module"):
        shard_module(arg)


def test_sharding_twice_raises():
    model = shard_module(make("mlp", seed=1))
    with pytest.raises(RuntimeError, match="already applied"):
        shard_module(model)
    with pytest.raises(RuntimeError, match="already belong"):
        shard_module(nn.Sequential(model[0]))


def test_tied_weights_across_units_raise():
    with pytest.raises(ValueError, match="tied weights.*unit_classes"):
        shard_module(make("tied", seed=1))


def test_pre_hooks_registered_before_sharding_see_the_gathered_weights():
    """Before: the gathering pre-hook ran after the module's existing ones, which read empty placeholders
    (weight_norm's divided by zero and killed the process; spectral_norm's raised)."""
    def build(seed):
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        net[0] = torch.nn.utils.weight_norm(net[0])
        seen = []
        net[2].register_forward_pre_hook(lambda m, a: seen.append(tuple(m.weight.shape)))
        return net, seen

    ref, _ = build(3)
    model, seen = build(3)
    shard_module(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        x, y = global_batch("mlp", step, 3)
        opt.zero_grad()
        nn.functional.mse_loss(model(mine(x, 3)), mine(y, 3)).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert seen == [(3, 5), (3, 5)], seen
    assert_same_as_reference(model, ref)


def test_refused_at_sharding_and_at_the_first_step():
    """Before: a sparse embedding failed in backward ('reshape is not implemented for sparse tensors'), a
    max_norm embedding lost its in-place renormalisation silently, a module shared by two units read the
    other unit's placeholders, a deep copy served the original's shards (all cryptic errors or wrong numbers),
    and a non-elementwise optimizer (Adafactor) over flat shards gave rank-count-dependent numbers."""
    import copy

    with pytest.raises(ValueError, match="sparse=True"):
        shard_module(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match="max_norm=1.0"):
        shard_module(nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2)))
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="same module.*different ZeRO-3 units"):
        shard_module(nn.Sequential(nn.Sequential(shared, nn.Linear(4, 4)), nn.Sequential(shared, nn.Linear(4, 2))),
                     unit_classes=(nn.Sequential,))
    model = shard_module(make("mlp", seed=1))
    with pytest.raises(TypeError, match="cannot be deep-copied"):
        copy.deepcopy(model)
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    model(torch.randn(3, 6)).sum().backward()
    with pytest.raises(ValueError, match="Adafactor"):
        opt.step()
    plain = nn.Linear(2, 2)  # an optimizer of an unsharded model is not checked
    torch.optim.Adafactor(plain.parameters(), lr=0.01).step()


def test_float16_gradients_average_without_overflow():
    """Before: the average was summed in float16 first: two ranks' gradients of 40000 gave inf."""
    torch.manual_seed(0)
    model = shard_module(nn.Sequential(nn.Linear(1, 1, bias=False).half()))
    x = torch.full((1, 1), 40000.0, dtype=torch.float16)
    model(x).sum().backward()  # the weight's gradient is x on every rank
    (shard,) = [p for p in model.parameters() if p.grad is not None]
    assert shard.dtype == torch.float32 and torch.isfinite(shard.grad).all(), shard.grad
    if R == 0:  # the weight's single element lives in the first rank's segment
        assert shard.grad[0].item() == 40000.0
    shard.grad = None  # and the smallest float16 gradient keeps its value (dividing first rounded it to 0)
    model(torch.full((1, 1), 2.0 ** -24, dtype=torch.float16)).sum().backward()
    if R == 0:
        assert shard.grad[0].item() == 2.0 ** -24


def test_float16_gradients_average_without_overflow_without_masters():
    """master_weights=False: the float16 average was still summed in float16 (inf) before 2026-12-05."""
    torch.manual_seed(0)
    model = shard_module(nn.Sequential(nn.Linear(1, 1, bias=False).half()), master_weights=False)
    model(torch.full((1, 1), 40000.0, dtype=torch.float16)).sum().backward()
    (shard,) = [p for p in model.parameters() if p.grad is not None]
    assert shard.dtype == torch.float16 and torch.isfinite(shard.grad).all(), shard.grad
    if R == 0:
        assert shard.grad[0].item() == 40000.0


def test_broadcast_optimizer_state_refuses_the_shards_optimizer():
    """Every rank's state is its own part's: rank 0's moments landed on the others' parts (2.7e-2 off after
    two steps, silently) before 2026-12-05. One rank alone has nothing to overwrite: it goes through."""
    model = shard_module(make("mlp", seed=1))
    opt = make_opt("adam", model.parameters())
    if N == 1:
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        return
    with pytest.raises(ValueError, match="steps shards made by shard_module"):
        hvd.broadcast_optimizer_state(opt, root_rank=0)


def test_ranks_with_different_sync_module_states_raise_on_every_rank():
    """Only the ranks with it broadcast: the others hung before 2026-12-05."""
    if N == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(ValueError, match="sync_module_states"):
        shard_module(make("mlp", seed=1), sync_module_states=R == 0)


def test_bad_unit_classes_raise():
    with pytest.raises(TypeError, match="unit_classes"):
        shard_module(make("mlp", seed=1), unit_classes=(int,))


def test_ranks_with_different_models_raise_on_every_rank():
    if N == 1:
        pytest.skip("needs two ranks")
    model = make("mlp", seed=1)
    if R == N - 1:
        model[4] = nn.Linear(5, 4)
    with pytest.raises(ValueError, match="different models"):
        shard_module(model)


def test_a_double_backward_is_refused_on_every_rank_and_training_goes_on():
    # its graph kept views of gathered weights that the end of the backward frees: the second backward
    # read freed storage (an out-of-bounds error, or garbage)
    model = shard_module(make("mlp", seed=1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 6, requires_grad=True)
    out = model(x)
    with pytest.raises(NotImplementedError, match="create_graph=True"):
        torch.autograd.grad(out.sum(), x, create_graph=True)
    opt.zero_grad()
    model(x.detach()).square().mean().backward()  # an ordinary step afterwards still works
    opt.step()


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises when ``armed`` (a NaN check, a failing custom Function)."""

    armed = False

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        if _FailOnce.armed:
            raise FloatingPointError("a NaN in the gradient")
        return grad


def test_training_goes_on_after_a_backward_pass_that_raised():
    """Before: the raised pass left its end-of-backward flag set, no later pass landed a gradient in any shard,
    and the optimizer stepped nothing from then on, silently."""
    model, ref = make("mlp", seed=120 + R), make("mlp", seed=120)
    shard_module(model)
    opt, ref_opt = make_opt("sgd", model.parameters()), make_opt("sgd", ref.parameters())
    for step in range(4):
        opt.zero_grad()
        x, y = global_batch("mlp", step, 3)
        _FailOnce.armed = step == 1
        try:  # the later units' gradients reduce before the failure, between units 2 and 0, stops the pass
            hidden = _FailOnce.apply(model[1](model[0](mine(x, 3))))
            nn.functional.mse_loss(model[4](model[3](model[2](hidden))), mine(y, 3)).backward()
        except FloatingPointError:
            assert step == 1
            continue  # the step is skipped, as a training loop does after a bad batch
        finally:
            _FailOnce.armed = False
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert_same_as_reference(model, ref)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_ranks_running_different_units_raise_instead_of_hanging():
    """Rank 0 runs one head, the others the other: each rank waits in its unit's gather for ranks that
    never submit it. Before 2026-12-06 that hung (stall warnings every 60 s); now the engine's deadlock
    check fails both gathers on every rank, naming what each rank waits for (the limit is lowered to 2 s
    here; UNISON_DEADLOCK_TIME_SECONDS, default 60)."""
    import dataclasses

    from unison.common.engine import frontend

    if N < 2:
        pytest.skip("needs two ranks")
    torch.manual_seed(0)
    model = shard_module(_TwoHeads(), unit_classes=(nn.Linear,))
    eng = frontend.running_engine()
    kept = eng.config
    eng.config = dataclasses.replace(kept, deadlock_time_seconds=2.0)
    try:
        with pytest.raises(hvd.StallError) as info:
            (model.a if R == 0 else model.b)(torch.ones(2, 4)).sum().backward()
    finally:
        eng.config = kept
    message = str(info.value)
    assert message.startswith("deadlock: every rank of the job has waited at least 2 s"), message
    for r in range(N):
        unit = "u0" if r == 0 else "u1"
        missing = list(range(1, N)) if r == 0 else [0]
        assert f"rank {r} waits for 'zero3.m" in message and f".{unit}.float32.b0.gather'" in message, message
        assert f"which rank(s) {missing} never submitted" in message, message
    WORLD.Barrier()


def test_a_rank_that_skips_a_backward_pass_raises_with_the_others_instead_of_hanging():
    """Rank 1 skips one backward pass (a guard against a bad loss) and steps: the others wait in that pass's
    gathers, rank 1 in the next forward's. Before 2026-12-06 a hang; now a StallError on every rank."""
    import dataclasses

    from unison.common.engine import frontend

    if N < 2:
        pytest.skip("needs two ranks")
    torch.manual_seed(0)
    model = shard_module(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng = frontend.running_engine()
    kept = eng.config
    eng.config = dataclasses.replace(kept, deadlock_time_seconds=2.0)
    try:
        with pytest.raises(hvd.StallError, match="deadlock: every rank of the job"):
            for step in range(3):
                opt.zero_grad()
                loss = model(torch.ones(2, 4)).sum()
                if not (R == 1 and step == 1):
                    loss.backward()
                opt.step()
    finally:
        eng.config = kept
    WORLD.Barrier()


def test_unfreezing_a_sharded_parameter_raises_on_every_rank():
    """Before: the frozen shard said requires_grad=True and never got a gradient (nothing trained, no error)."""
    model = make("mlp", seed=121)
    model[0].bias.requires_grad_(False)
    shard_module(model)
    model[0].requires_grad_(True)
    with pytest.raises(ValueError, match="cannot be frozen or unfrozen after shard_module"):
        model(torch.randn(2, 6))


def test_helpers_refuse_an_unsharded_model():
    with pytest.raises(TypeError, match="shard_module"):
        full_state_dict(make("mlp", seed=1))
    with pytest.raises(TypeError, match="shard_module"):
        clip_sharded_grad_norm_(make("mlp", seed=1), 1.0)


# ----------------------------------------------------------------- from an audit of 2026-12-07
def _worst_diff(model: nn.Module, ref: nn.Module) -> float:
    full = full_state_dict(model)
    return max(float((full[k].double() - v.double()).abs().max()) for k, v in ref.state_dict().items())


def test_sync_module_states_broadcasts_non_contiguous_weights():
    """to_numpy of a non-contiguous tensor (a channels_last conv, a transposed weight) is a copy: the broadcast
    wrote the copy, and every rank sharded its own weights (a mix of the ranks' segments, before 2026-12-07)."""
    torch.manual_seed(100 + R)  # different weights on every rank
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()).to(memory_format=torch.channels_last)
    model.register_parameter("t", nn.Parameter(torch.randn(5, 3).t()))
    assert not model[0].weight.is_contiguous() and not model.t.is_contiguous()
    first = WORLD.bcast({k: v.detach().clone() for k, v in model.state_dict().items()}, root=0)
    shard_module(model)
    full = full_state_dict(model)
    for key, value in first.items():
        assert torch.equal(full[key], value), key


def test_a_model_sharded_on_a_subset_leaves_the_next_global_models_names_in_step():
    """The models' collective names counted every model a process sharded: ranks that sat out a subset's model
    named the next global model's collectives another number (a hang, before 2026-12-07)."""
    if N < 3:
        pytest.skip("needs a set of some ranks and one outside it")
    ps = hvd.add_process_set(list(range(N - 1)))
    try:
        if ps.included():
            shard_module(nn.Linear(3, 2), process_set=ps)
        model = shard_module(nn.Linear(3, 2))
        model(torch.ones(2, 3)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    finally:
        hvd.remove_process_set(ps)


def test_a_prefetch_left_in_flight_before_a_step_is_not_used_after_it():
    """A forward entered through a submodule between backward and step() prefetched the next unit from the old
    shards, and the next full forward used those weights (0.10 off after 3 steps, before 2026-12-07)."""
    def make() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    model, ref = shard_module(make()), make()
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    gen, b = torch.Generator().manual_seed(0), 2
    for _ in range(3):
        x, y = torch.randn(N * b, 4, generator=gen), torch.randn(N * b, 3, generator=gen)
        mine = slice(R * b, (R + 1) * b)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        with torch.no_grad():
            model[0](x[mine])  # (logging the first layer's features: unit 2's prefetch starts)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert _worst_diff(model, ref) < 1e-6


def test_parameters_with_gradient_hooks_are_refused_on_every_rank():
    """The hooks stayed on the replaced parameters and never ran (a clamp dropped silently: weights 0.23 off)."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model[0].weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
    with pytest.raises(ValueError, match="gradient hooks"):
        shard_module(model)


def test_a_state_dict_of_another_layout_is_refused():
    """Shards of one shape from another layout (another bucket_bytes) loaded silently, elements moved between
    parameters (a = [12, 13, 2, 3] for [0, 1, 2, 3], before 2026-12-07)."""
    def make(bucket_bytes: int) -> nn.Module:
        m = nn.Module()
        m.a = nn.Parameter(torch.arange(4.0))
        m.b = nn.Parameter(torch.arange(10.0, 14.0))
        return shard_module(m, bucket_bytes=bucket_bytes)
    saved = make(1 << 20).state_dict()
    assert "zero3_layout" in saved
    again = make(1 << 20)
    again.load_state_dict(saved)  # the same layout: loads
    assert full_state_dict(again)["a"].tolist() == [0.0, 1.0, 2.0, 3.0]
    if N > 1:  # (one rank: every bucket size gives one shard of everything, the same layout)
        other = make(16)
        with pytest.raises(RuntimeError, match="another layout"):
            other.load_state_dict(saved)


def test_saved_tensor_hooks_around_a_unit_get_its_activations_and_checkpointing_trains_alike():
    """A unit's own saved-tensor hooks replaced the ones around it (checkpointing's, save_on_cpu's): numbers
    right, but the activations inside units were kept (105 MB of forward growth with and without
    checkpointing, the unsharded model 106 and 56 MB; before 2026-12-07). Now only the unit weights stay
    with the unit's hooks; every activation reaches the outer ones."""
    from torch.utils.checkpoint import checkpoint

    def make() -> nn.Module:
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))

    def shapes_seen(model: nn.Module) -> tuple[list, int]:
        packed, unpacked = [], [0]

        def pack(t):
            packed.append(tuple(t.shape))
            return t

        def unpack(t):
            unpacked[0] += 1
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = model(torch.ones(5, 6))
        out.sum().backward()
        return sorted(packed), unpacked[0]
    plain, _ = shapes_seen(make())
    sharded, unpacked = shapes_seen(shard_module(make()))
    weight = (8, 3)  # the second layer's weight, saved (transposed) for the input's gradient: the unit's own
    assert sharded == sorted(x for x in plain if x != weight) and unpacked == len(sharded) > 0, (plain, sharded)
    for reentrant in (False, True):  # numbers as the unsharded model's, with checkpointing around each unit
        model, ref = shard_module(make()), make()
        x = torch.randn(4 * N, 6, generator=torch.Generator().manual_seed(2))
        mine = x[R * 4:(R + 1) * 4].clone().requires_grad_()  # (reentrant checkpointing needs one)
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.3), torch.optim.SGD(ref.parameters(), lr=0.3)
        tail = nn.Sequential(model[1], model[2])
        for _ in range(2):
            h = checkpoint(model[0], mine, use_reentrant=reentrant)
            checkpoint(tail, h, use_reentrant=reentrant).square().mean().backward()
            ref(x).square().mean().backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
        assert _worst_diff(model, ref) < 1e-6, reentrant


def test_a_nan_gradient_norm_makes_every_shard_gradient_nan_as_torch_clips():
    """As torch's clip_grad_norm_ (every gradient times max_norm / (NaN + eps)); before 2026-12-07 kept."""
    model = shard_module(nn.Linear(4, 3))
    model(torch.ones(2, 4)).sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if R == 0:
        next(g for g in grads if g.numel()).view(-1)[0] = float("nan")
    assert torch.isnan(clip_sharded_grad_norm_(model, 1.0))
    assert all(bool(torch.isnan(g).all()) for g in grads if g.numel())
