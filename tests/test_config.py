"""Settings (unison/common/config.py): every variable's bad values are refused with the
variable, the value and the valid range; empty means unset; the cross-rank report.

Single process, no MPI job needed.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from unison.common import config as cfg
from unison.common.config import SETTINGS, Config, load_config, mismatch_report, must_match_values

ROOT = Path(__file__).resolve().parent.parent

# variable suffix -> bad values (each must be refused) and the valid range the message names
BAD_VALUES = {
    "ALLREDUCE_ALGORITHM": (["fastest", "nccl", "1"], "one of auto, ring, rhd, hierarchical, mpi"),
    "ALLGATHER_ALGORITHM": (["rhd", "tree"], "one of auto, ring, hierarchical, mpi"),
    "BROADCAST_ALGORITHM": (["ring", "x"], "one of auto, tree, hierarchical, mpi"),
    "REDUCESCATTER_ALGORITHM": (["rhd", "tree"], "one of auto, ring, mpi"),
    "ALLTOALL_ALGORITHM": (["ring"], "one of auto, pairwise, mpi"),
    "CHUNK_BYTES": (["0", "-5", "1MB", "1.5", "inf", str(2**31)], "an integer in [1, 2147483647]"),
    "LOG_LEVEL": (["loud", "5"], "one of TRACE, DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    "ABORT_ON_ERROR": (["maybe", "2", "tru"], "one of 1, true, yes, on, 0, false, no, off"),
    "FUSION_THRESHOLD": (["-1", "64MB", "1e6", "nan", str(2**63)], "an integer in [0, 9223372036854775807]"),
    "CYCLE_TIME": (["inf", "-inf", "nan", "0", "-1", "fast", "60001", "1e300"], "a finite number in (0, 60000]"),
    "CACHE_CAPACITY": (["-1", "many", "2.0"], "an integer in [0, 9223372036854775807]"),
    "STALL_CHECK_TIME_SECONDS": (["inf", "nan", "-1", "1e9", "soon"], "a finite number in [0, 2.592e+06]"),
    "STALL_SHUTDOWN_TIME_SECONDS": (["inf", "nan", "-0.5"], "a finite number in [0, 2.592e+06]"),
    "STALL_CHECK_DISABLE": (["disable", "10"], "one of 1, true, yes, on, 0, false, no, off"),
    "DEADLOCK_TIME_SECONDS": (["-1", "nan", "a minute"], "a finite number in [0, 2.592e+06]"),
    "AUTOTUNE": (["2", "auto"], "one of 1, true, yes, on, 0, false, no, off"),
    "AUTOTUNE_WARMUP_SAMPLES": (["-1", "1.5", "x"], "an integer in [0, 9223372036854775807]"),
    "AUTOTUNE_STEPS_PER_SAMPLE": (["0", "-3", "ten"], "an integer in [1, 9223372036854775807]"),
    "MALLOC_CACHE": (["enabled", "-1"], "one of 1, true, yes, on, 0, false, no, off"),
    "GC_FREEZE": (["frozen", "2"], "one of 1, true, yes, on, 0, false, no, off"),
    "COLLECTIVE_TIMEOUT_SECONDS": (["inf", "nan", "-1", "1e12", "never"], "a finite number in [0, 2.592e+06]"),
    "HIERARCHICAL_ALLREDUCE": (["maybe", "2"], "one of 1, true, yes, on, 0, false, no, off"),
    "HIERARCHICAL_ALLGATHER": (["auto"], "one of 1, true, yes, on, 0, false, no, off"),
    "DETERMINISTIC": (["strict", "-1"], "one of 1, true, yes, on, 0, false, no, off"),
    "HOST_TIMEOUT_SECONDS": (["inf", "-5", "30s"], "a finite number in [0, 2.592e+06]"),
    "CROSS_PIECE_BYTES": (["-1", "64KiB", "1.5", str(2**31)], "an integer in [0, 2147483647]"),
}
# paths accept any text (empty: off); nothing to refuse but they must still be known
NO_BAD_VALUES = {"TIMELINE", "AUTOTUNE_LOG"}


def test_every_setting_has_bad_value_cases():
    assert set(BAD_VALUES) | NO_BAD_VALUES == {s.suffix for s in SETTINGS}


@pytest.mark.parametrize("prefix", ["UNISON_", "HOROVOD_"])
@pytest.mark.parametrize("suffix", sorted(BAD_VALUES))
def test_bad_value_names_variable_value_and_range(suffix, prefix):
    values, valid = BAD_VALUES[suffix]
    for value in values:
        var = prefix + suffix
        with pytest.raises(ValueError) as info:
            load_config({var: value})
        msg = str(info.value)
        assert f"{var}={value!r} is not valid" in msg, msg
        assert valid in msg, msg


@pytest.mark.parametrize("suffix", sorted(BAD_VALUES))
def test_bad_argument_names_field_value_and_range(suffix):
    """init(**settings) arguments are checked the same way, typed values too."""
    setting = next(s for s in SETTINGS if s.suffix == suffix)
    values, valid = BAD_VALUES[suffix]
    for value in values + [True, object()]:
        if isinstance(value, bool) and isinstance(setting.spec, cfg.Flag):
            continue
        with pytest.raises(ValueError) as info:
            load_config({}, **{setting.field: value})
        assert f"{setting.field}={value!r} is not valid" in str(info.value)
        assert valid in str(info.value)


@pytest.mark.parametrize("field, value", [("cycle_time", float("inf")), ("cycle_time", float("nan")),
                                          ("fusion_threshold", -1), ("chunk_bytes", 0),
                                          ("collective_timeout_seconds", float("inf")),
                                          ("allreduce_algorithm", "nccl"), ("autotune", "maybe")])
def test_config_object_refuses_bad_values(field, value):
    """A Config built directly (not through load_config) cannot hold garbage either."""
    with pytest.raises(ValueError, match=f"Config\\({field}="):
        Config(**{field: value})
    with pytest.raises(ValueError, match=f"{field}="):
        dataclasses.replace(Config(), **{field: value})


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.suffix)
def test_empty_variable_means_unset(setting):
    """Empty or blank values are the default for every type (never 'off' by accident)."""
    default = getattr(Config(), setting.field)
    for blank in ["", "  "]:
        assert getattr(load_config({setting.variable: blank}), setting.field) == default
        assert getattr(load_config({}, **{setting.field: blank}), setting.field) == default
    # an empty UNISON_ variable leaves the HOROVOD_ alias in charge
    alias = {"ALLREDUCE_ALGORITHM": "rhd", "ABORT_ON_ERROR": "0", "CYCLE_TIME": "2.5"}.get(setting.suffix)
    if alias is not None:
        got = getattr(load_config({setting.variable: "", "HOROVOD_" + setting.suffix: alias}), setting.field)
        assert got == setting.spec.parse(alias) != default


def test_empty_boolean_is_the_default_not_off():
    assert load_config({"UNISON_ABORT_ON_ERROR": ""}).abort_on_error is True
    assert load_config({"UNISON_MALLOC_CACHE": " "}).malloc_cache is True
    assert load_config({"UNISON_AUTOTUNE": ""}).autotune is False


@pytest.mark.parametrize("var, value, field, expected", [
    ("UNISON_CYCLE_TIME", "0.5", "cycle_time", 0.5),
    ("UNISON_CYCLE_TIME", "60000", "cycle_time", 60000.0),
    ("UNISON_CHUNK_BYTES", "2147483647", "chunk_bytes", 2**31 - 1),
    ("UNISON_FUSION_THRESHOLD", "0", "fusion_threshold", 0),
    ("UNISON_STALL_SHUTDOWN_TIME_SECONDS", "0", "stall_shutdown_time_seconds", 0.0),
    ("UNISON_AUTOTUNE", "Yes", "autotune", True),
    ("UNISON_STALL_CHECK_DISABLE", "ON", "stall_check_disable", True),
    ("UNISON_LOG_LEVEL", "debug", "log_level", "DEBUG"),
    ("HOROVOD_LOG_LEVEL", "fatal", "log_level", "CRITICAL"),  # Horovod's names (init() refused them)
    ("HOROVOD_LOG_LEVEL", "warn", "log_level", "WARNING"),
    ("UNISON_TIMELINE", " /tmp/t.json ", "timeline", "/tmp/t.json"),
    ("UNISON_COLLECTIVE_TIMEOUT_SECONDS", "30", "collective_timeout_seconds", 30.0),
    ("HOROVOD_COLLECTIVE_TIMEOUT_SECONDS", "2.5", "collective_timeout_seconds", 2.5),
])
def test_valid_values_at_the_bounds(var, value, field, expected):
    assert getattr(load_config({var: value}), field) == expected


def test_collective_timeout_default_off_and_argument():
    assert Config().collective_timeout_seconds == 0.0
    assert load_config({}).collective_timeout_seconds == 0.0
    assert load_config({}, collective_timeout_seconds=12).collective_timeout_seconds == 12.0
    assert load_config({"UNISON_COLLECTIVE_TIMEOUT_SECONDS": "1", "HOROVOD_COLLECTIVE_TIMEOUT_SECONDS": "9"}
                       ).collective_timeout_seconds == 1.0


def test_sources_say_where_each_value_came_from():
    c = load_config({"HOROVOD_FUSION_THRESHOLD": "1024", "UNISON_CYCLE_TIME": ""}, chunk_bytes=4096)
    assert c.sources["fusion_threshold"] == "HOROVOD_FUSION_THRESHOLD"
    assert c.sources["chunk_bytes"] == "init(chunk_bytes=...)"
    assert c.sources["cycle_time"] == "default"
    assert c == load_config({"UNISON_FUSION_THRESHOLD": "1024"}, chunk_bytes=4096)  # sources not compared


def test_unknown_argument_is_refused():
    with pytest.raises(ValueError, match=r"unknown Unison setting\(s\) \['fusion'\]"):
        load_config({}, fusion=1)


# ------------------------------------------------------------------ cross-rank agreement

def test_mismatch_report_lists_every_rank_and_variable():
    base = load_config({})
    other = load_config({"UNISON_FUSION_THRESHOLD": "1048576"}, allreduce_algorithm="ring")
    per_rank = [must_match_values(c) for c in (base, other, base)]
    report = mismatch_report(per_rank, [c.sources for c in (base, other, base)])
    assert report is not None
    assert ("UNISON_FUSION_THRESHOLD (fusion_threshold): rank 0: 134217728 (from default), "
            "rank 1: 1048576 (from UNISON_FUSION_THRESHOLD), rank 2: 134217728 (from default)") in report
    assert "UNISON_ALLREDUCE_ALGORITHM (allreduce_algorithm): rank 0: 'auto'" in report
    assert "rank 1: 'ring' (from init(allreduce_algorithm=...))" in report
    assert "UNISON_CYCLE_TIME" not in report
    assert mismatch_report(per_rank[:1] * 3) is None


def test_elastic_variables_are_known_checked_at_load_and_compared(caplog):
    """UNISON_ELASTIC, UNISON_ELASTIC_MIN_NP and UNISON_ELASTIC_QUORUM are read by elastic recovery, not
    init() arguments, but init() knows them (no "not a Unison setting" warning), checks their values and has the
    ranks compare them."""
    with caplog.at_level("WARNING", logger="unison.common.config"):
        load_config({"UNISON_ELASTIC": "1", "UNISON_ELASTIC_MIN_NP": "2"})
        load_config({"UNISON_ELASTIC_NOTICE": "/tmp/notice"})  # (the driver's; warned of before)
    assert "not a Unison setting" not in caplog.text
    with pytest.raises(ValueError, match=r"UNISON_ELASTIC_MIN_NP='abc' is not valid: expected an integer"):
        load_config({"UNISON_ELASTIC_MIN_NP": "abc"})
    with pytest.raises(ValueError, match=r"HOROVOD_ELASTIC='maybe' is not valid"):
        load_config({"HOROVOD_ELASTIC": "maybe"})
    with pytest.raises(ValueError, match=r"UNISON_ELASTIC_QUORUM='sometimes' is not valid"):
        load_config({"UNISON_ELASTIC_QUORUM": "sometimes"})
    quorum = mismatch_report([must_match_values(load_config({}), {"UNISON_ELASTIC_QUORUM": "on"}),
                              must_match_values(load_config({}), {"UNISON_ELASTIC_QUORUM": "off"})])
    assert quorum is not None and "UNISON_ELASTIC_QUORUM" in quorum
    base = load_config({})
    on, off = must_match_values(base, {"UNISON_ELASTIC": "1"}), must_match_values(base, {})
    assert on["UNISON_ELASTIC"] is True and off["UNISON_ELASTIC"] is False and off["UNISON_ELASTIC_MIN_NP"] == 1
    report = mismatch_report([on, off])
    assert report is not None and "UNISON_ELASTIC: rank 0: True, rank 1: False" in report
    assert "UNISON_ELASTIC_MIN_NP" not in report


def test_log_level_and_paths_need_not_match():
    a = load_config({"UNISON_LOG_LEVEL": "DEBUG", "UNISON_TIMELINE": "/tmp/a.json", "UNISON_MALLOC_CACHE": "0"})
    assert mismatch_report([must_match_values(a), must_match_values(load_config({}))]) is None


def test_must_match_covers_what_changes_mpi_calls():
    must = {s.field for s in SETTINGS if s.must_match}
    assert {"fusion_threshold", "cycle_time", "chunk_bytes", "cache_capacity", "allreduce_algorithm",
            "autotune", "autotune_steps_per_sample", "stall_check_time_seconds",
            "collective_timeout_seconds"} <= must
    assert {"log_level", "timeline", "autotune_log", "malloc_cache"}.isdisjoint(must)


# ------------------------------------------------------------------ the docs table is complete

def test_settings_doc_lists_every_variable_with_default():
    doc = (ROOT / "docs" / "settings.md").read_text()
    for setting in SETTINGS:
        row = next((line for line in doc.splitlines() if line.startswith(f"| `{setting.variable}`")), None)
        assert row is not None, f"{setting.variable} missing from docs/settings.md"
        assert f"`HOROVOD_{setting.suffix}`" in row
        default = getattr(Config(), setting.field)
        shown = {True: "1", False: "0", "": '""'}.get(default, default) if not isinstance(default, float) \
            else f"{default:g}"
        cells = [c.strip() for c in row.split("|")[1:-1]]  # variable, alias, type, default, range, match
        assert re.fullmatch(rf"`?{re.escape(str(shown))}`?( .*)?", cells[3]), (setting.variable, shown, row)
        assert cells[5].startswith("yes" if setting.must_match else "no"), row
