"""The benchmarks' own helpers: how a target line reads, and how passes and rounds are combined.

The benchmarks themselves run in ``make bench`` (minutes each); these check, in a second, the
parts that decide what a target line prints.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import benchutil  # noqa: E402
import collectives  # noqa: E402
import hosts  # noqa: E402
import keras_backends  # noqa: E402
import keras_training  # noqa: E402


def test_ratio_target_verdicts_and_digits():
    assert benchutil.ratio_target("a", 1.3, 1.0, 1.3).endswith("= 1.30  (target >= 1.3)  PASS")
    # a miss that two decimals would print as the threshold itself gets a third decimal
    assert benchutil.ratio_target("b", 0.998, 1.0, 1.0).endswith("= 0.998  (target >= 1.0)  MISS")
    assert benchutil.ratio_target("c", 1.2496, 1.0, 1.25).endswith("= 1.2496  (target >= 1.25)  MISS")
    # before 2026-12-07 a miss by under 0.0005 printed the threshold: "1.250 (target >= 1.25) MISS"
    assert benchutil.ratio_target("c2", 0.99996, 1.0, 1.0).endswith("= 0.99996  (target >= 1.0)  MISS")
    # a clear miss keeps two
    assert benchutil.ratio_target("d", 0.93, 1.0, 1.0).endswith("= 0.93  (target >= 1.0)  MISS")
    assert benchutil.ratio_target("e", None, 1.0, 1.0) == "  e = n/a   not measured"


def _record(model: str, impl: str, sps: float) -> keras_backends.Record:
    return keras_backends.Record("jax", model, impl, 2, 64, 128, sps, 1.0)


def test_best_of_passes_keeps_each_cases_fastest_pass():
    first = [_record("mlp", "unison", 5000.0), _record("mlp", "keras-dp", 3000.0), _record("cnn", "unison", 900.0)]
    second = [_record("mlp", "unison", 5600.0), _record("mlp", "keras-dp", 2900.0)]  # cnn failed here
    best = {(r.model, r.impl): r.samples_per_s for r in keras_backends.best_of_passes([first, second])}
    assert best == {("mlp", "unison"): 5600.0, ("mlp", "keras-dp"): 3000.0, ("cnn", "unison"): 900.0}
    assert keras_backends.best_of_passes([]) == []


@pytest.mark.parametrize("module", [keras_backends, keras_training])
def test_passes_must_be_positive(module, capsys):
    with pytest.raises(SystemExit) as info:
        module.parse_args(["--passes", "0"])
    assert info.value.code == 2
    assert "--passes 0" in capsys.readouterr().err
    assert module.parse_args([]).passes == 2


def test_hosts_training_rounds_by_mode():
    full, quick = hosts.parse_args([]), hosts.parse_args(["--quick"])
    assert (full.train_rounds, full.train_steps, full.train_warmup) == (4, 4, 2)
    assert (quick.train_rounds, quick.train_steps, quick.train_warmup) == (2, 2, 1)
    record = hosts.TrainRecord("mlp", "unison", 2, "1gbit", 265.8)  # older JSON files lack the spread
    assert math.isnan(record.min_samples_per_s) and record.rounds == 0


def test_collectives_rounds_repeat_the_small_cases_and_keep_each_ones_fastest():
    small_a, small_b, large = ("allreduce", 4096, "unison-auto"), ("allreduce", 4096, "mpi-native"), \
        ("allreduce", 4 << 20, "unison-auto")
    cases = [small_a, small_b, large]
    assert collectives.schedule(cases, 3) == [small_a, small_b, large, small_a, small_b, small_a, small_b]
    assert collectives.schedule(cases, 1) == cases
    best: dict = {}
    for t in (9e-6, 6e-6, 7e-6):
        rec = collectives.Record("allreduce", "unison-auto", 2, 4096, t, 1.0, 5.0)
        collectives.keep_fastest(best, small_a, rec)
    assert best[small_a].time_s == 6e-6 and best[small_a].rounds == 3
    with pytest.raises(SystemExit):
        collectives.parse_args(["--rounds", "0"])
    assert collectives.parse_args([]).rounds == 3


def test_pipeline_targets_say_not_measured_for_a_missing_case(capsys):
    """A measured case that failed to launch gets an "n/a   not measured" line (before 2026-12-07 its target
    lines were left out, so a failed case read as fewer targets rather than as unmeasured)."""
    import pipeline

    pipeline.print_targets([])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert lines and all(line.endswith("n/a   not measured") for line in lines), lines
    assert len(lines) == len(pipeline.SCHEDULES) + len(pipeline.MEASURED)
