"""Pipeline schedules as data: built, validated, simulated, drawn and partitioned in one process."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys

import pytest

from unison.common.pipeline import (
    SCHEDULES,
    Action,
    Schedule,
    ScheduleError,
    balance_by_cost,
    build_schedule,
    check_balance,
    compare_schedules,
    render_grid,
    render_png,
    render_text,
    simulate,
    validate,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def legal(name):
    """Every (p, m, v) the sweep builds for ``name``."""
    for p in range(1, 9):
        for m in range(1, 33):
            if name != "interleaved":
                yield p, m, 1
            elif m % p == 0:
                for v in (2, 3, 4):
                    yield p, m, v


def with_rows(schedule, rows, name=None):
    return Schedule(name or schedule.name, schedule.p, schedule.m, schedule.v, rows)


def error_of(schedule):
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return str(info.value)


# ---------------------------------------------------------------- building and the data format

@pytest.mark.parametrize("name", SCHEDULES)
def test_every_built_schedule_validates_and_has_every_action_once(name):
    for p, m, v in legal(name):
        s = build_schedule(name, p, m, v)
        validate(s)
        per_mb = 3 if name == "zb-h1" else 2
        assert [len(row) for row in s.compute] == [per_mb * m * v] * p, (p, m, v)
        assert s.split_backward == (name == "zb-h1")
        for r, row in enumerate(s.compute):
            assert {a.stage for a in row} == set(s.stages_of(r))


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_send_meets_one_receive_with_the_same_tag(name):
    for p, m, v in [(4, 8, 2), (3, 6, 3), (2, 2, 2), (1, 3, 2)]:
        s = build_schedule(name, p, m, v if name == "interleaved" else 1)
        sends, recvs = set(), set()
        for r in range(s.p):
            for a in s.actions(r):
                if a.op.startswith("SEND"):
                    sends.add((r, a.peer, s.tag(a)))
                elif a.op.startswith("RECV"):
                    recvs.add((a.peer, r, s.tag(a)))
        assert sends == recvs
        hops = s.num_stages - 1 - sum(1 for k in range(s.num_stages - 1) if s.stage_rank(k) == s.stage_rank(k + 1))
        assert len(sends) == 2 * hops * m


def test_derived_communication_of_a_middle_rank():
    s = build_schedule("1f1b", 3, 2)
    assert [str(a) for a in s.actions(1)] == [
        "recv_act m0 s1<-r0", "F0@s1", "send_act m0 s1->r2",
        "recv_act m1 s1<-r0", "F1@s1", "send_act m1 s1->r2",
        "recv_grad m0 s1<-r2", "B0@s1", "send_grad m0 s1->r0",
        "recv_grad m1 s1<-r2", "B1@s1", "send_grad m1 s1->r0",
    ]
    assert [str(a) for a in s.actions(0)][:3] == ["F0@s0", "send_act m0 s0->r1", "F1@s0"]
    assert [a.op for a in s.actions(2)][:4] == ["RECV_ACT", "F", "B", "SEND_GRAD"]


def test_split_backward_sends_after_input_grad_and_weight_grad_never_communicates():
    s = build_schedule("zb-h1", 2, 2)
    acts = [str(a) for a in s.actions(0)]
    i = acts.index("I0@s0")
    assert acts[i - 1] == "recv_grad m0 s0<-r1"
    w = acts.index("W0@s0")
    assert acts[w - 1] != "recv_grad m0 s0<-r1" and not acts[w + 1 if w + 1 < len(acts) else w].startswith("send")
    assert "send_grad m0 s1->r0" in [str(a) for a in s.actions(1)]


def test_interleaved_layout_and_same_rank_handoffs():
    s = build_schedule("interleaved", 4, 8, 2)
    assert s.num_stages == 8 and s.stages_of(1) == (1, 5) and s.stage_rank(6) == 2
    assert [str(a) for a in s.actions(3)][:3] == ["recv_act m0 s3<-r2", "F0@s3", "send_act m0 s3->r0"]
    one = build_schedule("interleaved", 1, 2, 3)
    assert all(a.is_compute for a in one.actions(0))
    assert [str(a) for a in one.compute[0][:4]] == ["F0@s0", "F0@s1", "F0@s2", "B0@s2"]


def test_zb_h1_runs_each_w_after_its_i_on_the_same_rank():
    for p, m, _ in legal("zb-h1"):
        s = build_schedule("zb-h1", p, m)
        for row in s.compute:
            step = {a: i for i, a in enumerate(row)}
            assert all(step[Action("W", a.stage, a.microbatch)] > i for i, a in enumerate(row) if a.op == "I")


@pytest.mark.parametrize("args, message", [
    (("pipedream", 2, 4), "unknown pipeline schedule 'pipedream'; choose one of gpipe, 1f1b, interleaved, zb-h1"),
    (("1f1b", 0, 4), "p is the number of pipeline ranks and must be a positive integer; received p=0"),
    (("gpipe", 2, -1), "received m=-1"),
    (("gpipe", 2, True), "received m=True"),
    (("zb-h1", 2.0, 4), "received p=2.0"),
    (("1f1b", 2, 4, 0), "received v=0"),
    (("1f1b", 2, 4, 2), "1f1b runs one stage per rank (received v=2); use v=1, or the 'interleaved'"),
    (("interleaved", 2, 4, 1), "interleaved needs v >= 2 virtual stages per rank (received v=1); use '1f1b'"),
    (("interleaved", 4, 6, 2), "interleaved needs num_microbatches (6) to be a multiple of the number of "
                               "ranks (4); use 8 or 12"),
    (("interleaved", 4, 3, 2), "use 4 or 8"),
])
def test_bad_arguments_raise_schedule_errors_naming_value_and_fix(args, message):
    with pytest.raises(ScheduleError) as info:
        build_schedule(*args)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_names_are_case_insensitive_and_small_m_is_allowed():
    assert build_schedule("1F1B", 4, 2).name == "1f1b"
    assert build_schedule("ZB-H1", 4, 1).m == 1
    validate(build_schedule("gpipe", 8, 1))


# ---------------------------------------------------------------- the validator

def test_validator_finds_a_deadlock_and_marks_the_cycle():
    s = build_schedule("1f1b", 3, 4)
    rows = [list(r) for r in s.compute]
    rows[1] = [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1)] + rows[1][3:]
    rows[2] = [Action("F", 2, 0), Action("F", 2, 1), Action("B", 2, 0)] + rows[2][3:]
    msg = error_of(with_rows(s, rows))
    first, *grid = msg.splitlines()
    assert first == ("deadlock: rank 1 waits at step 1 (B0@s1) for the gradient of microbatch 0 from rank 2, "
                     "which rank 2 computes at step 2 (B0@s2), but rank 2 waits at step 1 (F1@s2) for the "
                     "activation of microbatch 1 from rank 1; cycle: rank 1 -> rank 2 -> rank 1; "
                     "rank 0 waits behind it")
    assert grid[0].split() == ["step", "|", "rank", "0", "|", "rank", "1", "|", "rank", "2"]
    assert grid[2].split("|")[2].strip() == ">>B0@s1<<" and grid[2].split("|")[3].strip() == ">>F1@s2<<"
    assert msg.count(">>") == 2


def test_validator_shows_a_window_of_a_long_grid():
    s = build_schedule("zb-h1", 8, 32)
    rows = [list(r) for r in s.compute]
    rows[5].insert(40, rows[5].pop(rows[5].index(Action("I", 5, 10))))
    msg = error_of(with_rows(s, rows))
    assert "cycle: rank 4 -> rank 5 -> rank 4; ranks 0, 1, 2, 3, 6, 7 wait behind it" in msg
    assert ">>I10@s4<<" in msg and " ..." in msg
    assert len(msg.splitlines()) < 40


def test_validator_names_a_missing_action_and_marks_what_needs_it():
    s = build_schedule("1f1b", 3, 4)
    rows = [list(r) for r in s.compute]
    rows[1].remove(Action("F", 1, 3))
    msg = error_of(with_rows(s, rows))
    assert msg.startswith("F3@s1 is missing: rank 1 must run F of stage 1 for microbatch 3")
    assert ">>B3@s1<<" in msg
    rows = [list(r) for r in s.compute]
    rows[2].remove(Action("B", 2, 1))
    assert error_of(with_rows(s, rows)).startswith("B1@s2 is missing")


def test_validator_catches_w_before_i():
    s = build_schedule("zb-h1", 3, 4)
    rows = [list(r) for r in s.compute]
    i, w = rows[0].index(Action("I", 0, 1)), rows[0].index(Action("W", 0, 1))
    rows[0][i], rows[0][w] = rows[0][w], rows[0][i]
    msg = error_of(with_rows(s, rows))
    assert msg.splitlines()[0] == (f"rank 0 runs W1@s0 at step {i} before I1@s0 (step {w}), which it needs; "
                                   "move it after that step")
    assert f"{i:4d} | >>W1@s0<<" in msg


def test_validator_catches_placement_duplicates_and_foreign_actions():
    s = build_schedule("gpipe", 2, 2)
    rows = [list(r) for r in s.compute]
    rows[0].append(rows[1].pop())
    assert "rank 0 step 4: B1@s1 is on rank 0 but stage 1 belongs to rank 1" in error_of(with_rows(s, rows))
    rows = [list(r) for r in s.compute]
    rows[0].append(Action("F", 0, 1))
    msg = error_of(with_rows(s, rows))
    assert "F1@s0 runs twice: rank 0 step 1 and rank 0 step 4" in msg and ">>F1@s0<<" in msg
    rows = [list(r) for r in s.compute]
    rows[0][0] = Action("SEND_ACT", 0, 0, 1)
    assert "holds 'SEND_ACT'; compute lists take only F, B, I, W" in error_of(with_rows(s, rows))
    rows = [list(r) for r in s.compute]
    rows[0][0] = Action("F", 0, 7)
    assert "microbatch 7 does not exist" in error_of(with_rows(s, rows))
    assert "compute lists for 1 ranks but p=2" in error_of(with_rows(s, rows[:1]))
    z = build_schedule("zb-h1", 2, 2)
    rows = [list(r) for r in z.compute]
    rows[1][rows[1].index(Action("I", 1, 0))] = Action("B", 1, 0)
    assert "is a full backward in a schedule that splits backwards" in error_of(with_rows(z, rows))


def test_render_grid_marks_cells():
    grid = render_grid(build_schedule("gpipe", 2, 1), marks=[(1, 1)])
    assert grid.splitlines() == [
        "step | rank 0    | rank 1",
        "   0 | F0@s0     | F0@s1",
        "   1 | B0@s0     | >>B0@s1<<",
    ]


# ---------------------------------------------------------------- the simulator

@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_fill_drain_bubble_formula(name):
    for p, m in [(1, 1), (2, 1), (4, 2), (4, 4), (4, 8), (8, 32), (5, 7)]:
        res = simulate(build_schedule(name, p, m), forward=1.0, backward=2.0)
        assert res.makespan == pytest.approx(3 * (m + p - 1))
        assert res.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert res.busy == pytest.approx([3.0 * m] * p)


def test_activation_peaks_of_gpipe_and_1f1b():
    for p, m in [(4, 8), (4, 2), (8, 3), (1, 5)]:
        assert simulate(build_schedule("1f1b", p, m)).peak_activations == tuple(min(m, p - s) for s in range(p))
        assert simulate(build_schedule("gpipe", p, m)).peak_activations == (m,) * p


def test_interleaved_cuts_the_bubble_time_by_v():
    for p, m, v in [(4, 8, 2), (4, 8, 4), (2, 4, 3), (8, 16, 2), (3, 3, 2)]:
        res = simulate(build_schedule("interleaved", p, m, v))
        assert res.makespan == pytest.approx(3 * (m * v + p - 1))
        gpipe, one_f_one_b, inter, _ = compare_schedules(p, m, v)
        assert inter.bubble_time == pytest.approx(one_f_one_b.bubble_time / v)
        assert inter.busy == pytest.approx(one_f_one_b.busy)


def test_zb_h1_has_a_third_of_the_1f1b_bubble_and_no_more_memory():
    for p, m, _ in legal("zb-h1"):
        zb = simulate(build_schedule("zb-h1", p, m))
        ref = simulate(build_schedule("1f1b", p, m))
        assert zb.busy == pytest.approx(ref.busy)
        if m >= p:
            assert zb.bubble_time == pytest.approx(ref.bubble_time / 3) == pytest.approx(p - 1)
        else:
            assert zb.bubble_time < ref.bubble_time or p == 1
        assert max(zb.peak_activations) <= max(ref.peak_activations)
        assert zb.peak_full_activations == ref.peak_full_activations


def test_known_numbers_for_p4_m8():
    gpipe, one, inter, zb = compare_schedules(4, 8, v=2)
    assert [round(r.bubble, 4) for r in (gpipe, one, inter, zb)] == [0.2727, 0.2727, 0.1579, 0.1111]
    assert zb.peak_activations == (4, 4, 4, 4) and zb.peak_full_activations == (4, 3, 2, 1)
    assert inter.peak_activations == (8, 8, 7, 5, 4, 4, 3, 1)


def test_per_stage_times_and_latency():
    s = build_schedule("gpipe", 2, 1)
    assert simulate(s, forward=[1, 2], backward=[3, 4]).makespan == pytest.approx(10)
    res = simulate(s, forward=[1, 2], backward=[3, 4], send_latency=0.5)
    assert res.makespan == pytest.approx(11)
    assert [(e.rank, str(e.action), e.start, e.end) for e in res.events] == [
        (0, "F0@s0", 0, 1), (0, "B0@s0", 8.0, 11.0), (1, "F0@s1", 1.5, 3.5), (1, "B0@s1", 3.5, 7.5)]
    assert res.bubble == pytest.approx(1 - 10 / 22)


def test_weight_time_splits_the_full_backward():
    res = simulate(build_schedule("zb-h1", 1, 1), forward=1.0, backward=2.0, weight=0.5)
    assert [(str(e.action), e.end - e.start) for e in res.events] == [("F0@s0", 1), ("I0@s0", 1.5), ("W0@s0", 0.5)]
    half = simulate(build_schedule("zb-h1", 1, 1), backward=3.0)
    assert [e.end - e.start for e in half.events] == [1, 1.5, 1.5]
    assert simulate(build_schedule("1f1b", 1, 1), weight=5.0).makespan == 3


def test_events_never_overlap_on_a_rank():
    for name in SCHEDULES:
        res = compare_schedules(4, 8)[SCHEDULES.index(name)]
        for r in range(4):
            mine = [e for e in res.events if e.rank == r]
            assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(mine))
        assert res.bubble == pytest.approx(1 - sum(res.busy) / (4 * res.makespan))


@pytest.mark.parametrize("kwargs, message", [
    ({"forward": [1, 2]}, "forward has 2 per-stage times but the schedule has 4 stages"),
    ({"backward": -1.0}, "backward times must be non-negative"),
    ({"weight": 3.0}, "weight times [3.0, 3.0, 3.0, 3.0] exceed backward times"),
    ({"send_latency": -1}, "send_latency must be a non-negative finite number"),
])
def test_simulator_rejects_bad_times(kwargs, message):
    with pytest.raises(ScheduleError) as info:
        simulate(build_schedule("zb-h1", 4, 4), **kwargs)
    assert message in str(info.value)


# ---------------------------------------------------------------- pictures

def test_render_text_has_a_row_per_rank():
    text = render_text(build_schedule("zb-h1", 4, 8), width=54)
    lines = text.splitlines()
    assert lines[0] == "zb-h1 p=4 m=8 v=1: makespan 27, bubble 11.1%"
    for r in range(4):
        assert lines[1 + r].startswith(f"rank {r} |") and len(lines[1 + r]) == len("rank 0 |") + 54 + 1
    assert lines[1] == "rank 0 |F0F1F2F3......I0W0F4I1W1F5I2W2F6I3W3F7I4W4I5W5I6W6I7W7|"
    assert lines[4] == "rank 3 |......F0I0F1I1F2I2F3I3W0F4I4W1F5I5W2F6I6W3F7I7W4W5W6W7|"
    assert lines[-1] == "F- forward  I~ backward (input)  W+ backward (weights)  . idle"
    auto = render_text(simulate(build_schedule("1f1b", 2, 3)))
    assert auto.splitlines()[1:3] == ["rank 0 |F0-F1-......B0====F2-B1====...B2====|",
                                      "rank 1 |...F0-B0====F1-B1====F2-B2====......|"]
    assert "F0'" in render_text(build_schedule("interleaved", 2, 2, 2))


def test_render_png_writes_a_png_atomically(tmp_path):
    out = tmp_path / "schedules.png"
    render_png([build_schedule("gpipe", 2, 3), *compare_schedules(4, 8)], out, title="test")
    assert out.read_bytes()[:8] == PNG_MAGIC
    render_png(simulate(build_schedule("1f1b", 2, 2)), str(out))
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert [p.name for p in tmp_path.iterdir()] == ["schedules.png"]


def test_importing_the_package_loads_no_framework_and_no_matplotlib():
    code = ("import sys, unison.common.pipeline as p; p.validate(p.build_schedule('1f1b', 2, 2)); "
            "heavy = {'torch', 'tensorflow', 'keras', 'matplotlib'}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- partitioning

def brute_force(costs, p):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


def test_balance_by_cost_matches_brute_force():
    rng = random.Random(1234)
    for _ in range(300):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        costs = [rng.choice([rng.randint(0, 9), rng.random() * 5]) for _ in range(n)]
        balance = balance_by_cost(costs, p)
        assert len(balance) == p and sum(balance) == n and min(balance) >= 1
        starts = list(itertools.accumulate([0] + balance))
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(starts))
        assert worst == pytest.approx(brute_force(costs, p)), (costs, p, balance)


def test_balance_by_cost_keeps_early_stages_light_on_ties():
    assert balance_by_cost([1] * 6, 4) == [1, 1, 2, 2]
    assert balance_by_cost([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert balance_by_cost([0, 0, 0], 3) == [1, 1, 1]
    assert balance_by_cost([4, 1, 1, 1, 1, 4], 3) == [1, 4, 1]


@pytest.mark.parametrize("costs, p, message", [
    ([1, 2], 3, "cannot cut 2 layers into 3 non-empty stages; use at most 2 stages"),
    ([1, -2], 1, "layer costs must be finite and non-negative"),
    ([1, float("nan")], 1, "layer costs must be finite and non-negative"),
    ([1, 2], 0, "received p=0"),
])
def test_balance_by_cost_errors(costs, p, message):
    with pytest.raises(ScheduleError) as info:
        balance_by_cost(costs, p)
    assert message in str(info.value)


@pytest.mark.parametrize("args, message", [
    (([2, 3], 6, 2), "balance [2, 3] sums to 5 but the model has 6 layers; give p=2 stage sizes that sum to 6"),
    (([2, 2, 2], 6, 2), "balance [2, 2, 2] has 3 stages, more stages than the 2 the pipeline runs (p=2); "
                        "give p=2 stage sizes that sum to 6"),
    (([6], 6, 2), "has 1 stages, fewer stages than the 2"),
    (([3, 0, 3], 6, 3), "balance [3, 0, 3] gives stage 1 0 layers; every stage needs at least one"),
    (([1, 1], 2, 2, 2), "the model has 2 layers, too few for 4 stages"),
    (([1, 1, 1, 2], 6, 2, 2), "give p*v=2*2=4 stage sizes that sum to 6"),
    (([1.5, 1.5], 3, 2), "must hold whole numbers of layers"),
])
def test_check_balance_errors(args, message):
    with pytest.raises(ScheduleError) as info:
        check_balance(*args)
    assert message in str(info.value)


def test_check_balance_accepts_a_good_balance():
    assert check_balance((2, 4), 6, 2) == [2, 4]
    assert check_balance(balance_by_cost([1.0] * 8, 4), 8, 2, v=2) == [2, 2, 2, 2]


# ---------------------------------------------------------------- found by an audit, 2026-12-07

@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 8, 4), (8, 16, 2), (2, 3, 3), (3, 5, 1)])
def test_the_forward_only_order_fills_the_pipeline_once_with_interleaved_stages(p, m, v):
    """evaluate/predict's order: forwards only (backwards free) take m*v + p - 1 thin-stage times, as a fill and a
    drain do. Before, microbatch-major on each rank: at p=4, m=8, v=2 it took 21.5, slower than v=1's 11."""
    from unison.common.pipeline.grid import fill_drain

    schedule = fill_drain(p, m, v)
    validate(schedule)
    result = simulate(schedule, forward=1.0 / v, backward=0.0)
    assert result.makespan == pytest.approx((m * v + p - 1) / v)


@pytest.mark.parametrize("bad", [1.0, True])
def test_validate_refuses_a_stage_or_microbatch_that_is_not_an_int(bad):
    """1.0 and True equal 1, so they passed, and simulate failed later with a TypeError on a list index."""
    rows = [[Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)],
            [Action("F", 1, 0), Action("B", 1, 0), Action("F", bad, 1), Action("B", 1, 1)]]
    schedule = Schedule("hand", 2, 2, 1, tuple(tuple(row) for row in rows))
    with pytest.raises(ScheduleError, match=rf"rank 1 step 2: stage {bad!r} is a {type(bad).__name__}; .*int\(\)"):
        validate(schedule)


def test_simulator_takes_numpy_times_and_refuses_infinite_ones():
    import numpy as np

    schedule = build_schedule("1f1b", 2, 4)
    assert simulate(schedule, forward=np.float32(1), backward=np.int64(2)).makespan == \
        simulate(schedule, forward=1.0, backward=2.0).makespan
    for kwargs in ({"forward": float("inf")}, {"send_latency": float("inf")}, {"backward": [1.0, float("nan")]}):
        with pytest.raises(ScheduleError, match="non-negative finite"):
            simulate(schedule, **kwargs)


def test_check_balance_takes_numpy_integers():
    import numpy as np

    assert check_balance(np.array([2, 3]), 5, 2) == [2, 3]
    assert all(type(b) is int for b in check_balance(np.array([2, 3]), 5, 2))
    with pytest.raises(ScheduleError, match="whole numbers"):
        check_balance([2.0, 3.0], 5, 2)


def test_the_render_module_docstring_shows_what_render_text_draws():
    import unison.common.pipeline.render as render

    drawn = render_text(build_schedule("1f1b", 2, 3))
    assert "\n".join("    " + line for line in drawn.splitlines()) in render.__doc__
