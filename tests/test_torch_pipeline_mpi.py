"""PyTorch pipeline: checkpoint replay and partitioning in one process, training under mpirun at 2 and 4 ranks."""

from __future__ import annotations

import copy
import re
import sys

import pytest
import torch
from harness import ATTEMPT, ROOT, mpi_env, mpirun, run_rank_suite
from torch import nn

from unison.common.pipeline import validate
from unison.common.pipeline.grid import fill_drain
from unison.torch_backend.pipeline import balance_by_params, balance_by_time
from unison.torch_backend.pipeline.recompute import capture, replay


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("np_", [2, 4])
def test_torch_pipeline(np_, tmp_path):
    run_rank_suite(np_, "mpi_torch_pipeline.py", tmp_path, timeout=250,
                   extra_env={"TEST_HANG_DUMP_S": "220"})


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_the_example_learns_digits_on_a_two_stage_pipeline(tmp_path):
    proc = mpirun(2, [sys.executable, str(ROOT / "examples" / "torch_pipeline.py"), "--epochs", "3"], timeout=90,
                  cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.findall(r"^final validation accuracy: (\d\.\d+)$", proc.stdout, re.MULTILINE)
    assert len(found) == 1 and float(found[0]) > 0.85, proc.stdout


def test_a_one_process_pipeline_trains_like_the_model_and_checks_its_batch():
    import unison.torch_backend as hvd

    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    pipe = hvd.Pipeline(model, chunks=2, schedule="zb-h1", checkpoint="always", loss_fn=nn.functional.mse_loss,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for _ in range(2):
        loss = pipe.train_step(x, y)
        opt.zero_grad()
        expected = nn.functional.mse_loss(ref(x), y)
        expected.backward()
        opt.step()
        assert loss == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(hvd.PipelineError, match="rank 0: inputs has 8 rows but targets has 4; give one target"):
        pipe.train_step(x, y[:4])
    pipe.close()


def test_recompute_replays_dropout_and_leaves_the_generator_as_it_was():
    torch.manual_seed(5)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    state = capture(torch.device("cpu"))
    with torch.no_grad():
        first = layer(x)
    after_forward = torch.get_rng_state()
    with replay(state):
        again = layer(x)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), after_forward)  # the recomputation drew nothing for good
    assert not torch.equal(layer(x), first)  # and the next forward draws fresh masks


def test_partitioning_by_parameters_and_by_time():
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    assert balance_by_params(model, 2) == [1, 4]  # 320 | 4160 + 130: the ReLU goes to the later stage
    assert balance_by_params(list(model), 5) == [1] * 5
    by_time = balance_by_time(model, torch.randn(16, 4), 3)
    assert len(by_time) == 3 and sum(by_time) == 5 and min(by_time) >= 1
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="nn.Sequential or a list of nn.Module"):
        balance_by_params(nn.Linear(2, 2), 1)


@pytest.mark.parametrize("p, m, v", [(1, 1, 1), (2, 3, 1), (3, 4, 2), (4, 8, 3)])
def test_the_forward_only_schedule_is_valid(p, m, v):
    validate(fill_drain(p, m, v))


STEP_ON_SOME_RANKS = ATTEMPT + """
import torch
from torch import nn
import unison.torch_backend as hvd
hvd.init()
r = hvd.rank()
torch.manual_seed(0)
pipe = hvd.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), chunks=2,
                    loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
x, y = torch.ones(4, 4), torch.zeros(4, 1)
print(f"rank {r} loss {pipe.train_step(x, y):.6f}", flush=True)  # every rank: the usual path
# rank 0 evaluates alone while rank 1 trains: two kinds of step, never paired
attempt("kinds", lambda: pipe.evaluate(x, y) if r == 0 else pipe.train_step(x, y))
# rank 0 evaluates while rank 1 predicts: both forward-only, paired as one step, and evaluate then waited for
# ever in its loss all-reduce (before 2026-12-07; found by an audit)
attempt("forward", lambda: pipe.evaluate(x, y) if r == 0 else pipe.predict(x))
# rank 1 broke out of the loop a step early and all-reduces its metrics while rank 0 trains on (a new
# executor: rank 0's late call of a step name the verdict failed on rank 1 would fail at once)
pipe = hvd.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), chunks=2,
                    loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
attempt("skipped", lambda: pipe.train_step(x, y) if r == 0 else hvd.allreduce(torch.ones(1), name="metric"))
print(f"rank {r} after {hvd.allreduce(torch.ones(1), op=hvd.Sum, name='after').tolist()}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_a_step_that_some_ranks_skip_or_run_as_another_kind_fails_on_every_rank(tmp_path):
    """A step's messages are MPI's own receives, which the engine does not see: rank 0 evaluating while rank 1
    trained, or training while rank 1 had left the loop, blocked both for ever (before 2026-12-06). Each step
    now enters through an engine all-reduce named after the executor and the kind of step, so the engine's
    deadlock check fails both sides on every rank, naming the steps."""
    script = tmp_path / "steps.py"
    script.write_text(STEP_ON_SOME_RANKS)
    proc = mpirun(2, [sys.executable, str(script)], timeout=150, env=mpi_env(UNISON_DEADLOCK_TIME_SECONDS="2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for r in range(2):
        kinds = next((x for x in proc.stdout.splitlines() if x.startswith(f"rank {r} kinds StallError")), None)
        assert kinds is not None, out[-4000:]
        assert re.search(r"rank 0 waits for 'pipeline\.\d+\.evaluate\.2'", kinds), kinds
        assert re.search(r"rank 1 waits for 'pipeline\.\d+\.train'", kinds), kinds
        forward = next((x for x in proc.stdout.splitlines() if x.startswith(f"rank {r} forward StallError")), None)
        assert forward is not None, out[-4000:]
        assert re.search(r"rank 0 waits for 'pipeline\.\d+\.evaluate\.2'.*rank 1 waits for "
                         r"'pipeline\.\d+\.predict\.2'", forward), forward
        skipped = next((x for x in proc.stdout.splitlines() if x.startswith(f"rank {r} skipped StallError")), None)
        assert skipped is not None and "rank 1 waits for 'metric'" in skipped, out[-4000:]
        assert re.search(r"rank 0 waits for 'pipeline\.\d+\.train'", skipped), skipped
        for line in (kinds, forward, skipped):
            assert float(line.split("after ")[1].split("s:")[0]) < 15, line
        assert f"rank {r} after [2.0]" in proc.stdout, out[-4000:]
    assert "NO ERROR" not in proc.stdout, out[-4000:]
