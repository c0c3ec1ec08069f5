"""Which DistributedOptimizer options combine (docs/horovod.md): the others raise at construction."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("unison.torch_backend")


@pytest.fixture(scope="module", autouse=True)
def _init():
    hvd.init()
    yield


def _sgd():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("extra,named", [
    ({"compression": hvd.Compression.fp16}, "compression"),
    ({"backward_passes_per_step": 2}, "backward_passes_per_step=2"),
    ({"num_groups": 2}, "num_groups/groups"),
])
def test_adasum_refuses_options_it_would_ignore(extra, named):
    model, opt = _sgd()
    with pytest.raises(ValueError, match=f"op=Adasum.*{named}"):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Adasum, **extra)


def test_predivide_needs_average():
    model, opt = _sgd()
    with pytest.raises(ValueError, match="gradient_predivide_factor=2.0 only applies to op=Average"):
        hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)


@pytest.mark.parametrize("extra", [
    {"compression": hvd.Compression.fp16, "backward_passes_per_step": 2, "num_groups": 1},
    {"gradient_predivide_factor": 2.0, "sparse_as_dense": True},
    {"op": hvd.Adasum},
    {"op": hvd.Sum, "groups": 1},
])
def test_combinations_that_work_train_one_step(extra):
    model, opt = _sgd()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **extra)
    before = model.weight.detach().clone()
    passes = extra.get("backward_passes_per_step", 1)
    for _ in range(passes):
        model(torch.ones(4, 3)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight.detach())


def test_elastic_torch_state_refuses_a_zero_optimizer():
    """docs/elastic.md: a ZeRO optimizer's shards are laid out for this number of ranks."""
    from unison.torch_backend.elastic import TorchState

    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), zero_stage=1)
    with pytest.raises(NotImplementedError, match=r"ZeRO optimizer \(zero_stage=1\) is not supported"):
        TorchState(model, opt)
