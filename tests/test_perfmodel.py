"""The scaling model (unison.common.perfmodel) and its CLI, in one process: no MPI."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from unison import perfmodel as cli
from unison.common import perfmodel as pm
from unison.common.perfmodel_workloads import shapes, tensor_bytes

MiB = 1 << 20
GBIT = pm.parse_rate("1gbit")


def cluster(hosts: int = 2, k: int = 2, intra: pm.Link | None = None, inter: pm.Link | None = None,
            **kw: float) -> pm.Cluster:
    return pm.Cluster(hosts, k, intra or pm.Link(1e-6, 1e-10), inter or pm.Link(1e-5, 1e-9), **kw)


# --- formulas against hand-computed cases ------------------------------------------------------


def test_ring_time_by_hand() -> None:
    # p = 4 over 2 hosts: 6 steps of m/4 = 1 MiB on the inter link, 3 reductions; across hosts
    # the ring goes in the cross pieces (1 GB/s link: 256 KiB), so 4 latencies a step.
    c = cluster(gamma_s_per_byte=2e-10)
    s = MiB
    expected = 6 * (4 * 1e-5 + s * 1e-9) + 3 * s * 2e-10
    assert pm.ring_time(4 * MiB, c) == pytest.approx(expected, rel=1e-12)


def test_ring_counts_pieces() -> None:
    # 8 MiB per step in pieces of min(chunk 1 MiB, cross piece 4 MiB): 8 latencies per step.
    c = cluster(cross_piece_bytes=4 * MiB)
    expected = 6 * (8 * 1e-5 + 8 * MiB * 1e-9)
    assert pm.ring_time(32 * MiB, c) == pytest.approx(expected, rel=1e-12)
    one_host = cluster(hosts=1, k=4, cross_piece_bytes=64 << 10)  # no host boundary: chunks
    assert pm.ring_time(32 * MiB, one_host) == pytest.approx(6 * (8 * 1e-6 + 8 * MiB * 1e-10), rel=1e-12)


def test_ring_on_one_host_uses_intra_link() -> None:
    c = cluster(hosts=1, k=4)
    assert pm.ring_time(4 * MiB, c) == pytest.approx(6 * (1e-6 + MiB * 1e-10), rel=1e-12)


def test_hierarchical_time_by_hand() -> None:
    # H = 2, k = 2, m = 8 MiB: local RS and AG of 4 MiB (4 pieces of 1 MiB) once each; cross
    # all-reduce of 4 MiB segments: 2 steps of 2 MiB, 2 flows per NIC, in pieces sized to the
    # inter link (1 GB/s: 250 KB -> 256 KiB, so 8 pieces a step).
    c = cluster(gamma_s_per_byte=3e-10)
    assert c.cross_piece == 256 << 10
    m = 8 * MiB
    t_rs = 1 * (4 * 1e-6 + 4 * MiB * 1e-10 + 4 * MiB * 3e-10)
    t_ag = 1 * (4 * 1e-6 + 4 * MiB * 1e-10)
    t_x = 2 * (8 * 1e-5 + 2 * MiB * 2 * 1e-9) + 1 * 2 * MiB * 3e-10
    assert pm.hierarchical_time(m, c) == pytest.approx(t_rs + t_x + t_ag, rel=1e-12)


def test_hierarchical_cross_pieces_follow_the_link_or_the_setting() -> None:
    # H = 8, k = 2, m = 16 MiB: 14 cross steps of 1 MiB; a 1 Gbit/s link gets 64 KiB pieces
    # (16 a step), a fixed 512 KiB gives 2.
    slow = pm.Link(1e-5, 1 / GBIT)
    m = 16 * MiB
    local = 1 * (8 * 1e-6 + (m / 2) * 1e-10)
    for piece, msgs in ((0, 16), (512 << 10, 2)):
        c = cluster(hosts=8, inter=slow, cross_piece_bytes=piece)
        assert c.cross_piece == (piece or 64 << 10)
        t_x = 14 * (msgs * 1e-5 + MiB * 2 / GBIT)
        assert pm.hierarchical_time(m, c) == pytest.approx(2 * local + t_x, rel=1e-12)
    with pytest.raises(ValueError, match="cross_piece_bytes=-1"):
        cluster(cross_piece_bytes=-1)


def test_two_way_links_serve_rings_of_two_and_the_two_host_cross_step() -> None:
    # [Note: two-way transfers]: a ring of two and the cross step at H = 2 use the two-way beta,
    # a ring of four the one-way one.
    inter = pm.Link(1e-5, 1e-9, beta_two_way_s_per_byte=3e-9)
    pair = cluster(hosts=2, k=1, inter=inter)
    # (a step of 1 MiB crosses hosts in 256 KiB pieces: 4 latencies)
    assert pm.ring_time(2 * MiB, pair) == pytest.approx(2 * (4e-5 + MiB * 3e-9), rel=1e-12)
    four = cluster(hosts=2, k=2, inter=inter)
    assert pm.ring_time(4 * MiB, four) == pytest.approx(6 * (4e-5 + MiB * 1e-9), rel=1e-12)
    local = 1 * (4 * 1e-6 + 4 * MiB * 1e-10)
    assert pm.hierarchical_time(8 * MiB, four) == pytest.approx(
        2 * local + 2 * (8 * 1e-5 + 2 * MiB * 2 * 3e-9), rel=1e-12)  # 256 KiB cross pieces
    many = cluster(hosts=4, k=2, inter=inter)  # a cross ring of four: one-way
    assert pm.hierarchical_time(16 * MiB, many) == pytest.approx(
        2 * (8 * 1e-6 + 8 * MiB * 1e-10) + 6 * (8 * 1e-5 + 2 * MiB * 2 * 1e-9), rel=1e-12)


def test_tree_time_by_hand() -> None:
    # H = 4, k = 2: depth 2 (log2 4) inter hops + 1 intra hop, each way; 3 pieces.
    c = cluster(hosts=4, gamma_s_per_byte=1e-10)
    m = 3 * MiB
    expected = 2 * (2 * 1e-5 + 1 * 1e-6) + 3 * 1e-5 + 2 * m * 1e-9 + m * 1e-10
    assert pm.tree_time(m, c) == pytest.approx(expected, rel=1e-12)


def test_rhd_time_by_hand() -> None:
    """Recursive halving and doubling (unison.collectives.rhd): added 2026-12-05 (the model had no rhd, which
    Unison runs, and offered NCCL's tree, which it does not)."""
    # one host of 8 (intra, two-way = one-way here): 3 halving steps of m/2, m/4, m/8, 3 doubling steps back
    one = cluster(hosts=1, k=8, gamma_s_per_byte=1e-10)
    m = 4 * MiB
    steps = sum(pm._msgs(m / 2 ** i, MiB) * 1e-6 + m / 2 ** i * 1e-10 for i in (1, 2, 3))
    assert pm.rhd_time(m, one) == pytest.approx(2 * steps + 7 / 8 * m * 1e-10, rel=1e-12)
    # the textbook form when every message is one piece: 2 log2(p) a + 2 (p-1)/p m b + (p-1)/p m gamma
    small = 64 << 10
    assert pm.rhd_time(small, one) == pytest.approx(6 * 1e-6 + 2 * 7 / 8 * small * 1e-10 + 7 / 8 * small * 1e-10,
                                                    rel=1e-12)
    # 2 hosts x 2: the first halving step (distance 2) crosses hosts with 2 flows per NIC, two-way
    inter = pm.Link(1e-5, 1e-9, beta_two_way_s_per_byte=3e-9)
    two = cluster(hosts=2, k=2, inter=inter, cross_piece_bytes=MiB)
    m = 2 * MiB
    expected = 2 * ((1e-5 + MiB * 2 * 3e-9) + (1e-6 + (MiB / 2) * 1e-10))
    assert pm.rhd_time(m, two) == pytest.approx(expected, rel=1e-12)
    # 3 ranks on one host: the fold (m there and back) then a pair's exchange
    three = cluster(hosts=1, k=3)
    assert pm.rhd_time(MiB, three) == pytest.approx(2 * (1e-6 + MiB * 1e-10) + 2 * (1e-6 + MiB / 2 * 1e-10),
                                                    rel=1e-12)
    assert "rhd" in pm.ALGORITHMS and pm.allreduce_time("rhd", 0, three) == 0.0


def test_rhd_crosses_hosts_as_the_kernel_pairs_ranks_when_the_count_is_not_a_power_of_two() -> None:
    """2 hosts x 3 ranks (rhd.py: ranks 0-1 and 2-3 fold, virtual ranks 0..3 are real 1, 3, 4, 5): the fold
    pair (2, 3) and both halving steps' pairs (1, 4), then (1, 3), cross hosts, one flow per NIC. Before
    2026-12-05 a step crossed when its distance was >= k, so none did here: 2.0 ms at 64 MiB on 100 Gbit/s,
    less than the 5.4 ms the NIC needs for the 64 MiB that must leave each host."""
    inter = pm.Link(1e-5, 1e-9, beta_two_way_s_per_byte=3e-9)
    c = cluster(hosts=2, k=3, inter=inter, gamma_s_per_byte=1e-11)
    m = 8 * MiB
    fold = 2 * (8 * 1e-5 + m * 1e-9) + m * 1e-11  # one-way there and back, in 1 MiB pieces
    steps = 2 * ((4 * 1e-5 + m / 2 * 3e-9) + (2 * 1e-5 + m / 4 * 3e-9))  # exchanges, halving and doubling
    assert pm.rhd_time(m, c) == pytest.approx(fold + steps + 3 / 4 * m * 1e-11, rel=1e-12)
    # at 100 Gbit/s no all-reduce over 2 hosts beats the NIC's time for m bytes each way
    fast = cluster(hosts=2, k=3, intra=pm.Link(2e-6, 1 / 150e9), inter=pm.Link(5e-6, 1 / 12.5e9))
    assert pm.rhd_time(64 * MiB, fast) > 64 * MiB / 12.5e9
    # power-of-two counts keep the distance rule: 4 hosts x 2, the first step's 2 flows per NIC
    assert pm._rhd_plan(8, 2) == (0, (2, 2, 0))
    assert pm._rhd_plan(6, 3) == (1, (1, 1))
    # 3 hosts x 8: virtual 0-7 are real 1, 3, .., 15 (hosts 0 and 1), 8-15 are 16-23 (host 2); the first step
    # pairs each of host 2's 8 ranks with one elsewhere, the second pairs host 0's 4 with host 1's
    assert pm._rhd_plan(24, 8) == (0, (8, 4, 0, 0))


def test_allreduce_time_adds_overhead_and_handles_trivial_cases() -> None:
    c = cluster(overhead_s=1e-3)
    assert pm.allreduce_time("ring", 4 * MiB, c) == pytest.approx(1e-3 + pm.ring_time(4 * MiB, c))
    assert pm.allreduce_time("tree", 0, c) == 0.0
    assert pm.allreduce_time("hierarchical", MiB, cluster(hosts=1, k=1)) == 0.0
    with pytest.raises(ValueError, match="'butterfly' is not modelled; choose from ring"):
        pm.allreduce_time("butterfly", MiB, c)


def test_busbw_matches_nccl_tests_convention() -> None:
    assert pm.busbw_gbps(1e9, 4, 1.0) == pytest.approx(1.5)


# --- limits and monotonicity ---------------------------------------------------------------------


def test_hierarchical_beats_ring_when_inter_host_is_slow() -> None:
    fast_local, slow_net = pm.Link(1e-6, 1 / 50e9), pm.Link(5e-6, 1 / 1.25e9)
    for hosts, k in ((2, 2), (4, 8), (16, 8)):
        c = cluster(hosts, k, fast_local, slow_net)
        assert pm.hierarchical_time(256 * MiB, c) < pm.ring_time(256 * MiB, c)
    # with many hosts both put about 2 m through each NIC in the same cross pieces: they tie
    # (0.434 s against 0.439 s at 64 x 8)
    c = cluster(64, 8, fast_local, slow_net)
    assert pm.hierarchical_time(256 * MiB, c) == pytest.approx(pm.ring_time(256 * MiB, c), rel=0.02)


def test_hierarchical_bandwidth_ratio_at_two_by_two() -> None:
    # Network-only limit: the flat ring puts 2 (p-1)/p m = 1.5 m through each NIC, the
    # hierarchical one 2 (H-1)/H m = m: the "1.5x at best".
    c = cluster(2, 2, pm.Link(0.0, 0.0), pm.Link(0.0, 1e-9))
    assert pm.ring_time(64 * MiB, c) / pm.hierarchical_time(64 * MiB, c) == pytest.approx(1.5)


def test_ring_busbw_tends_to_link_bandwidth() -> None:
    c = cluster(8, 8, pm.Link(0.0, 0.0), pm.Link(1e-7, 1e-9))
    m = 1 << 34
    assert pm.busbw_gbps(m, 64, pm.ring_time(m, c)) == pytest.approx(1.0, rel=1e-3)


def test_times_grow_with_size_and_ring_latency_with_ranks() -> None:
    c = cluster(4, 8)
    for algo in pm.ALGORITHMS:
        times = [pm.allreduce_time(algo, s, c) for s in (4 << 10, MiB, 64 * MiB, 256 * MiB)]
        assert times == sorted(times) and len(set(times)) == 4
    small = [pm.ring_time(4 << 10, c.with_ranks(r)) for r in (16, 64, 256)]
    assert small == sorted(small)
    # at 512 ranks a small message pays the ring's 2 (p - 1) latencies, the tree's 2 log2 H
    big = c.with_ranks(512)
    assert pm.tree_time(4 << 10, big) < pm.ring_time(4 << 10, big) / 10


def test_with_ranks_fills_hosts_or_refuses() -> None:
    c = cluster(1, 8)
    assert (c.with_ranks(64).hosts, c.with_ranks(64).ranks_per_host) == (8, 8)
    assert (c.with_ranks(4).hosts, c.with_ranks(4).ranks_per_host) == (1, 4)
    with pytest.raises(ValueError, match="12 ranks do not fill whole hosts of 8"):
        c.with_ranks(12)


def test_bad_links_and_clusters_are_refused() -> None:
    with pytest.raises(ValueError, match="alpha >= 0 and beta >= 0; got alpha=-1"):
        pm.Link(-1.0, 0.0)
    with pytest.raises(ValueError, match="finite alpha >= 0 and beta >= 0; got alpha=0.0, beta=inf"):
        pm.Link(0.0, float("inf"))
    with pytest.raises(ValueError, match="at least 1 host and 1 rank per host; got hosts=0"):
        pm.Cluster(0, 8, pm.Link(0, 0), pm.Link(0, 0))
    with pytest.raises(ValueError, match="'fast' is not a link rate"):
        pm.parse_rate("fast")
    assert pm.parse_rate("100gbit") == pytest.approx(12.5e9)
    assert pm.parse_seconds("5us") == pytest.approx(5e-6)


# --- fusion and the step ------------------------------------------------------------------------


def test_fuse_groups_ready_tensors_up_to_threshold() -> None:
    sizes, ready = [10, 10, 10, 30, 5], [0.0, 0.0, 0.0, 0.0, 5.0]
    buffers, done = pm.fuse(sizes, ready, threshold=25, cycle_s=0.0, run=lambda b: b / 10)
    # at t=0: 10+10 (a third would pass 25), then 10, then 30 alone; 5 waits for t=5
    assert buffers == [20, 10, 30, 5]
    assert done == pytest.approx(max(2 + 1 + 3, 5) + 0.5)


def test_fuse_sends_large_tensors_alone_as_the_executor_does() -> None:
    """Executor [Note: fusion buffer]: a tensor of at least min(DIRECT_BYTES, threshold) bytes goes alone,
    the smaller ones of a cycle are packed, the packed run in its first member's place. Before 2026-12-05
    the model packed everything up to the threshold (ResNet-50 as 1 buffer where the engine sends 30)."""
    KiB = 1 << 10
    sizes = [2 * MiB, 100 * KiB, 100 * KiB, 3 * MiB, 50 * KiB]
    buffers, done = pm.fuse(sizes, [0.0] * 5, threshold=128 * MiB, cycle_s=0.0, run=lambda b: 1.0)
    assert buffers == [2 * MiB, 250 * KiB, 3 * MiB] and done == 3.0
    buffers, _ = pm.fuse(sizes, [0.0] * 5, threshold=200 * KiB, cycle_s=0.0, run=lambda b: 1.0)
    assert buffers == [2 * MiB, 200 * KiB, 50 * KiB, 3 * MiB]
    assert pm.fuse(sizes, [0.0] * 5, threshold=0, cycle_s=0.0, run=lambda b: 1.0)[0] == sizes


def test_step_overlap_hides_communication_and_no_overlap_exposes_it() -> None:
    sizes = tensor_bytes("resnet50")
    c = cluster(8, 8, pm.Link(2e-6, 1 / 150e9), pm.Link(5e-6, 1 / 12.5e9))
    hidden = pm.predict_step("ring", sizes, c, compute_s=0.2)
    exposed = pm.predict_step("ring", sizes, c, compute_s=0.2, overlap=False)
    assert exposed.exposed_s == pytest.approx(exposed.comm_s, rel=0.05)
    assert hidden.exposed_s < exposed.exposed_s
    assert 0 < exposed.efficiency < hidden.efficiency <= 1
    # as the engine sends them: the 29 tensors of 1 MiB or more alone, the other 132 (6.2 MiB) packed in one
    assert exposed.buffers == 1 + sum(b >= MiB for b in sizes) == 30
    assert pm.predict_step("tree", sizes, c.with_ranks(1), 0.2).efficiency == 1.0


def test_efficiency_falls_with_ranks_for_the_flat_ring() -> None:
    sizes = tensor_bytes("gpt-1.3b")
    c = cluster(1, 8, pm.Link(2e-6, 1 / 150e9), pm.Link(5e-6, 1 / 12.5e9))
    effs = [pm.predict_step("ring", sizes, c.with_ranks(r), 1.0).efficiency for r in (16, 64, 512)]
    assert effs == sorted(effs, reverse=True) and effs[0] < 1


# --- workloads ----------------------------------------------------------------------------------


def test_resnet50_has_161_tensors_and_25_6m_parameters() -> None:
    s = shapes("resnet50")
    assert len(s) == 161
    assert sum(math.prod(x) for x in s) == 25_557_032
    assert s[0] == (64, 3, 7, 7) and s[-2:] == [(1000, 2048), (1000,)]
    assert sum(1 for x in s if len(x) == 4) == 53  # convolutions, none with a bias


def test_other_workloads_match_published_sizes() -> None:
    assert sum(math.prod(x) for x in shapes("resnet101")) == 44_549_160
    gpt = shapes("gpt-1.3b")
    assert len(gpt) == 24 * 12 + 4
    assert 1.30e9 < sum(math.prod(x) for x in gpt) < 1.32e9
    assert tensor_bytes("resnet50", 2)[0] == 64 * 3 * 7 * 7 * 2
    with pytest.raises(ValueError, match="unknown model 'vgg'; choose from resnet50"):
        shapes("vgg")


# --- calibration --------------------------------------------------------------------------------


def test_fit_recovers_alpha_beta_from_synthetic_points() -> None:
    rng = np.random.default_rng(0)
    alpha, beta = 25e-6, 1 / 118e6
    sizes = [4 << 10, 64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB]
    pts = [(b, (alpha * max(1, b // MiB) + beta * b) * (1 + rng.normal(0, 0.01)), max(1, b // MiB))
           for b in sizes]
    link = pm.fit_link(pts)
    assert link.alpha_s == pytest.approx(alpha, rel=0.1)
    assert link.beta_s_per_byte == pytest.approx(beta, rel=0.03)
    exact = pm.fit_link([(b, 3e-6 + b * 1e-9) for b in (1, 1000, 10**6)])
    assert (exact.alpha_s, exact.beta_s_per_byte) == pytest.approx((3e-6, 1e-9), rel=1e-9)


def test_fit_takes_the_sustained_rate_past_a_burst_allowance() -> None:
    # A token-bucket rate limiter (tc tbf) at 118 MB/s with a 256 KB bucket: transfers up to the
    # bucket leave at once, larger ones at the rate. The measured 1 Gbit/s calibration looked
    # like this (64 KiB at 424 MB/s); a relative fit alone put the link at 290 MB/s.
    rate, bucket, alpha, piece = 118e6, 256e3, 20e-6, 64 << 10
    sizes = [4 << 10, 64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB]
    pts = [(b, max(1, b // piece) * alpha + max(0.0, b - bucket) / rate + b / 2e9, max(1, b // piece))
           for b in sizes]
    link = pm.fit_link(pts)
    assert 1 / link.beta_s_per_byte == pytest.approx(rate, rel=0.05)
    big = 64 * MiB  # what one 64 MiB transfer in pieces sees
    assert (big // piece) * link.alpha_s + big * link.beta_s_per_byte == pytest.approx(
        (big // piece) * alpha + big / rate + big / 2e9, rel=0.05)


def test_fit_keeps_parameters_non_negative_and_refuses_one_size() -> None:
    link = pm.fit_link([(1000, 1e-6), (2000, 2.5e-6)])  # would need a negative alpha
    assert link.alpha_s == 0.0 and link.beta_s_per_byte > 0
    with pytest.raises(ValueError, match="two or more sizes"):
        pm.fit_link([(1000, 1e-6), (1000, 2e-6)])


def test_calibration_divides_shared_flows_and_keeps_two_way() -> None:
    one = [(b, 1e-4 + b * 2e-8) for b in (4096, MiB, 16 * MiB)]
    two = [(b, 1e-4 + b * 5e-8) for b in (4096, MiB, 16 * MiB)]
    cal = pm.Calibration.fit(one, one, inter_two_way=two, inter_flows=2)
    assert cal.inter.beta_s_per_byte == pytest.approx(1e-8, rel=1e-6)
    assert cal.inter.two_way == pytest.approx(2.5e-8, rel=1e-6)
    assert cal.intra.beta_s_per_byte == pytest.approx(2e-8, rel=1e-6)
    assert cal.intra.two_way == cal.intra.beta_s_per_byte
    separate = pm.Calibration.fit(one, one, inter_two_way=two, inter_flows=1, two_way_flows=2)
    assert separate.inter.beta_s_per_byte == pytest.approx(2e-8, rel=1e-6)
    assert separate.inter.two_way == pytest.approx(2.5e-8, rel=1e-6)
    with pytest.raises(ValueError, match="inter_flows and two_way_flows must be >= 1; got 0 and 0"):
        pm.Calibration.fit(one, one, inter_flows=0)
    with pytest.raises(ValueError, match="got 1 and 0"):
        pm.Calibration.fit(one, one, inter_flows=1, two_way_flows=0)


def test_calibration_round_trips_through_json(tmp_path) -> None:
    cal = pm.Calibration.fit([(4096, 1e-5), (MiB, 4e-4)], [(4096, 5e-5), (MiB, 9e-3)],
                             [(MiB, 1e-4), (4 * MiB, 4e-4)], inter_two_way=[(4096, 6e-5), (MiB, 2e-2)],
                             overhead_s=1e-4, notes="synthetic")
    path = tmp_path / "cal.json"
    cal.save(path)
    back = pm.Calibration.load(path)
    assert back == cal
    assert back.gamma_s_per_byte == pytest.approx(1e-4 / MiB, rel=1e-6)
    assert back.cluster(2, 2).inter == cal.inter
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="not a Unison calibration file of version 1"):
        pm.Calibration.load(path)


# --- the command line ---------------------------------------------------------------------------


def test_cli_prints_the_table_for_every_rank_count(capsys) -> None:
    assert cli.main(["--model", "resnet50", "--ranks-per-host", "8", "--link", "100gbit",
                     "--latency", "5us", "--compute-ms", "200"]) == 0
    out = capsys.readouterr().out
    assert "resnet50: 161 gradient tensors, 25,557,032 parameters" in out
    for algo in pm.ALGORITHMS:
        assert cli.LABELS.get(algo, algo) in out
    assert "tree (NCCL, not Unison)" in out  # (offered before 2026-12-05 as if Unison ran it)
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit() and "|" in ln]
    assert [int(r[0]) for r in rows] == [8, 16, 32, 64, 128, 256, 512]
    assert "Horovod" in out


def test_cli_json_and_png(tmp_path, capsys) -> None:
    png = tmp_path / "model.png"
    assert cli.main(["--model", "gpt-1.3b", "--ranks", "16,64", "--json", "--png", str(png),
                     "--no-overlap"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {(p["ranks"], p["algorithm"]) for p in data["predictions"]} == \
        {(r, a) for r in (16, 64) for a in pm.ALGORITHMS}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_takes_a_calibration_file(tmp_path, capsys) -> None:
    cal = pm.Calibration(pm.Link(1e-6, 1e-10), pm.Link(1e-4, 1 / 118e6), 1e-10)
    path = tmp_path / "cal.json"
    cal.save(path)
    assert cli.main(["--calibration", str(path), "--ranks-per-host", "2", "--ranks", "4"]) == 0
    assert "calibration" in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--link", "fast"], ["--link", "infgbit"], ["--intra-link", "infgbit"],
                                  ["--link", "1e-320gbit"], ["--latency", "1e400s"], ["--latency", "nans"],
                                  ["--overhead-us", "inf"], ["--overhead-us", "nan"], ["--compute-ms", "inf"],
                                  ["--compute-ms", "nan"], ["--cycle-ms", "-5"], ["--cycle-ms", "inf"],
                                  ["--fusion-threshold", "-1"], ["--backward-share", "nan"],
                                  ["--ranks-per-host", "abc"], ["--png", "/tmp"], ["--png", "out.txt"]])
def test_cli_refuses_bad_input(args, capsys) -> None:
    # each ended in a traceback, or printed nan, or was taken silently as something else
    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    assert exc.value.code == 2
    assert args[0] in capsys.readouterr().err


def test_cli_options_given_with_a_calibration_replace_its_values(tmp_path, capsys) -> None:
    """Before 2026-12-05 --chunk-bytes and --overhead-us were ignored beside --calibration (the header said
    so), and a file without a link raised a KeyError traceback."""
    path = tmp_path / "cal.json"
    pm.Calibration(pm.Link(1e-6, 1e-10), pm.Link(1e-4, 1 / 118e6), 1e-10, chunk_bytes=1 << 16).save(path)
    assert cli.main(["--calibration", str(path), "--ranks-per-host", "2", "--ranks", "4"]) == 0
    assert "pieces of 65536 bytes; per-call overhead 0 us" in capsys.readouterr().out
    assert cli.main(["--calibration", str(path), "--ranks-per-host", "2", "--ranks", "4", "--chunk-bytes", "4096",
                     "--overhead-us", "30"]) == 0
    assert "pieces of 4096 bytes; per-call overhead 30 us" in capsys.readouterr().out
    data = json.loads(path.read_text())
    del data["inter"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="malformed calibration.*'inter'"):
        pm.Calibration.load(path)
    assert cli.main(["--calibration", str(path)]) == 2
    assert "malformed calibration" in capsys.readouterr().err


def test_cli_names_the_file_and_field_of_a_bad_calibration_and_an_unwritable_png(tmp_path, capsys) -> None:
    """Before 2026-12-05: a string where a number goes was a TypeError traceback, a file that is not JSON an
    error naming no file, an unwritable --png a matplotlib traceback after the table (and --png /tmp wrote
    /tmp.png while saying 'wrote /tmp')."""
    path = tmp_path / "cal.json"
    pm.Calibration(pm.Link(1e-6, 1e-10), pm.Link(1e-4, 1 / 118e6), 1e-10).save(path)
    data = json.loads(path.read_text())
    data["intra"]["alpha_s"] = "fast"
    path.write_text(json.dumps(data))
    assert cli.main(["--calibration", str(path)]) == 2
    assert f"{path}: intra.alpha_s must be a finite number >= 0; got 'fast'" in capsys.readouterr().err
    data["intra"]["alpha_s"], data["chunk_bytes"] = 1e-6, 1.5
    path.write_text(json.dumps(data))
    assert cli.main(["--calibration", str(path)]) == 2
    assert "chunk_bytes must be an integer" in capsys.readouterr().err
    path.write_text("not json")
    assert cli.main(["--calibration", str(path)]) == 2
    assert f"{path} is not JSON" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert cli.main(["--ranks", "8", "--png", str(tmp_path / "file" / "x.png")]) == 2
    assert f"could not write {tmp_path / 'file' / 'x.png'}" in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("gamma_s_per_byte", "Infinity"), ("overhead_s", "NaN"),
                                          ("inter.beta_s_per_byte", "-1e-9")])
def test_cli_refuses_a_calibration_number_that_is_not_finite_naming_the_field(tmp_path, capsys, field,
                                                                              value) -> None:
    """Before 2026-12-07 JSON's Infinity gave an OverflowError traceback and NaN an error naming no field; the
    advice named a benchmark flag that does not exist (--calibration-out)."""
    path = tmp_path / "cal.json"
    pm.Calibration(pm.Link(1e-6, 1e-10), pm.Link(1e-4, 1 / 118e6), 1e-10).save(path)
    text = path.read_text()
    key = field.split(".")[-1]
    data = json.loads(text)
    (data["inter"] if "." in field else data)[key] = 12345.0
    path.write_text(json.dumps(data).replace("12345.0", value))
    assert cli.main(["--calibration", str(path), "--ranks-per-host", "2", "--ranks", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {field} must be a finite number >= 0; got" in err and "Traceback" not in err
    assert "--calibration-out" not in err and "benchmarks/hosts.py --json OUT.json" in err


@pytest.mark.parametrize("field, value, want", [
    ("gamma_s_per_byte", None, "a finite number >= 0"), ("overhead_s", None, "a finite number >= 0"),
    ("chunk_bytes", None, "an integer >= 1"), ("chunk_bytes", 0, "an integer >= 1"),
    ("cross_piece_bytes", None, "an integer >= 0")])
def test_cli_refuses_a_calibration_null_or_zero_chunk_naming_the_file_and_field(tmp_path, capsys, field, value,
                                                                               want) -> None:
    """Before 2026-12-07 null passed the file's check (only beta_two_way may be null) to a TypeError traceback,
    and chunk_bytes 0 to an error that named no file."""
    path = tmp_path / "cal.json"
    pm.Calibration(pm.Link(1e-6, 1e-10), pm.Link(1e-4, 1 / 118e6), 1e-10).save(path)
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    assert cli.main(["--calibration", str(path), "--ranks-per-host", "2", "--ranks", "4"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {field} must be {want}; got {value!r}" in err and "Traceback" not in err


@pytest.mark.parametrize("option, value", [("--link", "-100gbit"), ("--latency", "-5us"),
                                           ("--intra-link", "-1gbit"), ("--reduce-rate", "-3gbps")])
def test_cli_names_a_negative_value_given_apart_from_its_option(capsys, option, value) -> None:
    """argparse took "-100gbit" for an option: "expected one argument" (before 2026-12-07)."""
    with pytest.raises(SystemExit) as stop:
        cli.main([option, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: '{value}' is not a" in err and "expected one argument" not in err


def test_the_models_public_functions_refuse_nan_and_infinite_inputs() -> None:
    cluster = pm.Cluster(hosts=2, ranks_per_host=2, intra=pm.Link(1e-6, 1e-10), inter=pm.Link(5e-6, 1e-9))
    for compute_s in (math.nan, math.inf, 0.0):
        with pytest.raises(ValueError, match="compute_s must be > 0"):
            pm.predict_step("ring", [1 << 20], cluster, compute_s)
    for nbytes in (math.nan, math.inf, -1):
        with pytest.raises(ValueError, match="nbytes must be a finite number >= 0"):
            pm.allreduce_time("ring", nbytes, cluster)


def test_cli_refuses_link_options_beside_a_calibration(tmp_path, capsys) -> None:
    """The file gives the links: before 2026-12-07 --link/--latency given with it were ignored without a word (two
    commands with 1gbit and 400gbit printed the same predictions; an audit of the docs' examples)."""
    path = tmp_path / "cal.json"
    pm.Calibration(pm.Link(1e-6, 1e-10), pm.Link(1e-4, 1 / 118e6), 1e-10).save(path)
    with pytest.raises(SystemExit) as stop:
        cli.main(["--calibration", str(path), "--link", "1gbit", "--latency", "500us", "--ranks-per-host", "2",
                  "--ranks", "4"])
    assert stop.value.code == 2
    assert "--link, --latency with --calibration: the calibration file gives the links" in capsys.readouterr().err
    given = ["--calibration", str(path), "--ranks-per-host", "2", "--ranks", "4", "--chunk-bytes", "4096"]
    assert cli.main(given) == 0


def test_cli_default_ranks_follow_the_ranks_per_host(capsys) -> None:
    """Before 2026-12-07 --ranks-per-host 6 failed on its own default --ranks (8 ranks do not fill hosts of 6)."""
    assert cli.default_ranks(8) == [8, 16, 32, 64, 128, 256, 512]
    assert cli.default_ranks(6) == [6, 12, 24, 48, 96, 192, 384]
    assert cli.default_ranks(1024) == [1024]
    assert cli.main(["--ranks-per-host", "6", "--json"]) == 0
    ranks = sorted({p["ranks"] for p in json.loads(capsys.readouterr().out)["predictions"]})
    assert ranks == [6, 12, 24, 48, 96, 192, 384]
    assert cli.main(["--ranks-per-host", "6", "--ranks", "8"]) == 2
    assert "--ranks: 8 ranks do not fill whole hosts of 6" in capsys.readouterr().err


def test_cli_prints_a_free_link_from_a_calibration(tmp_path, capsys) -> None:
    path = tmp_path / "cal.json"
    pm.Calibration(pm.Link(1e-6, 0.0), pm.Link(1e-4, 1 / 118e6), 1e-10).save(path)  # a fit may give beta 0
    assert cli.main(["--calibration", str(path), "--ranks-per-host", "2", "--ranks", "4"]) == 0
    assert "intra-host inf GB/s" in capsys.readouterr().out


def test_cli_runs_as_a_module() -> None:
    proc = subprocess.run([sys.executable, "-m", "unison.perfmodel", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "--ranks-per-host" in proc.stdout
