"""The step-time model (dtp.planning.time, Plan.time): each term on a hand-computed case,
and the model's response to its inputs. Its predictions beside measured steps and published
runs live in benchmarks/, not here: these are the terms' arithmetic."""

from __future__ import annotations

import dataclasses

import pytest

import dtp
from dtp import schedules
from dtp.planning.hardware import Chip, Hardware, Link
from dtp.planning.time import axis_link, collective_seconds, matmul_seconds


def _hw(**chip: float) -> Hardware:
    """A round-number system: 1 PFLOP/s bf16 at 0.5 efficiency, 1 TB/s memory, 8 a node."""
    c = {"name": "toy", "flops": {"bfloat16": 1e15, "float32": 1e14, "float64": 1e13}, "memory": 8e10,
         "memory_bandwidth": 1e12, "matmul_efficiency": 0.5, **chip}
    return Hardware(name="toy", chip=Chip(**c), devices_per_node=8, intra=Link(bandwidth=2e11, latency=2e-6),
                    inter=Link(bandwidth=2e10, latency=1e-5), host=Link(bandwidth=3e10, latency=1e-6))


def test_a_matmul_is_compute_bound_when_large_and_memory_bound_when_thin() -> None:
    hw = _hw()
    # 4096³ in bf16: 2·4096³ FLOPs at 0.5 PFLOP/s; its operands' 100 MB at 1 TB/s would take less.
    assert matmul_seconds(4096, 4096, 4096, 2, hw, "bfloat16") == pytest.approx(2 * 4096**3 / 5e14)
    # One token through a 4096 × 4096 weight: the weight's 32 MiB read is the cost.
    assert matmul_seconds(1, 4096, 4096, 2, hw, "bfloat16") == pytest.approx((4096 + 4096**2 + 4096) * 2 / 1e12)


def test_a_ring_all_reduce_costs_its_steps_of_latency_and_its_bytes_over_bandwidth() -> None:
    link = Link(bandwidth=1e10, latency=1e-5)
    sent = 2 * 7 * 10**8 // 8  # the comm log's bytes sent per rank: 2(n-1)/n of 100 MB over 8 ranks
    assert collective_seconds("all_reduce", sent, 8, link) == pytest.approx(14 * 1e-5 + sent / 1e10)
    assert collective_seconds("all_gather", 7 * 10**6, 8, link) == pytest.approx(7 * 1e-5 + 7e6 / 1e10)
    assert collective_seconds("send", 10**6, 2, link) == pytest.approx(1e-5 + 1e6 / 1e10)


def test_an_axis_inside_a_node_takes_the_intra_node_link() -> None:
    hw = _hw()
    t = dtp.planning.Target.of(dtp.RunConfig(model="small", dp=4, tp=4, batch=8, seq=32))
    assert axis_link(t, "tp", hw) is hw.intra  # tp's 4 neighbours
    assert axis_link(t, "dp", hw) is hw.inter  # dp strides 4 over 16 ranks, two nodes
    t = dtp.planning.Target.of(dtp.RunConfig(model="small", dp=2, tp=4, batch=8, seq=32))
    assert axis_link(t, "dp", hw) is hw.intra  # 8 ranks: one node


def _plan(**kw: object) -> dtp.planning.Plan:
    base = dict(model="llama3-8b", batch=16, seq=4096, dtype="bfloat16")
    return dtp.plan(dtp.RunConfig(**{**base, **kw}), backend="nccl")


def test_the_terms_add_up_to_the_step() -> None:
    t = _plan(dp=2, tp=8, sp=True, zero=1, recompute="selective").time(_hw())
    assert t.total == pytest.approx(t.compute + t.recompute + t.bubble + sum(t.exposed.values()) + t.optimizer)
    assert set(t.exposed) == {"dp", "tp"} and t.bubble == 0
    assert t.tokens_per_s == pytest.approx(16 * 4096 / t.total / 16)
    assert t.mfu == pytest.approx(t.tokens_per_s * t.flops_per_token / 1e15)


def test_recompute_costs_a_forward_or_the_attention_core() -> None:
    hw = _hw()
    none, full, sel = (_plan(tp=8, sp=True, recompute=r).time(hw) for r in ("none", "full", "selective"))
    assert none.recompute == 0 and full.compute == none.compute == sel.compute
    assert 0 < sel.recompute < full.recompute < full.compute / 2  # a forward is a third of fwd + bwd


def test_the_overlaps_hide_what_their_code_hides() -> None:
    hw = _hw()
    plain = _plan(dp=8, zero=1).time(hw)
    over = _plan(dp=8, zero=1, overlap_grad_reduce=True, overlap_param_gather=True).time(hw)
    assert over.exposed["dp"] < plain.exposed["dp"]
    sp = _plan(tp=8, sp=True).time(hw)
    async_tp = _plan(tp=8, sp=True, async_tp=True).time(hw)
    assert async_tp.exposed.get("tp", 0.0) < sp.exposed["tp"]
    # The same bytes across nodes: dp 16 spans two nodes, so its link is the slower one.
    assert _plan(dp=16, zero=1, batch=32).time(hw).exposed["dp"] > plain.exposed["dp"]


def test_the_bubble_of_1f1b_is_the_schedules_own() -> None:
    """1F1B's idle time on a rank is (p − 1)(F + B) with uniform stages, the schedule
    simulator's, F and B holding the block's own collectives (a stage waits on them); 70B's 80 blocks, embedding and head over 4 stages differ by a block
    (21 against 20, the embedding's and the head's), hence the 10 %."""
    hw = _hw()
    p, m = 4, 8
    plan = _plan(pp=p, microbatches=m, batch=8, seq=2048, model="llama3-70b", tp=8, sp=True)
    t = plan.time(hw)
    f_plus_b = (t.compute + t.exposed["tp"]) / m  # the busiest rank's F + B per microbatch, its tp collectives in
    line = schedules.simulate(schedules.make("1f1b", p=p, m=m), p=p, v=1, m=m, f=1.0, b=2.0)
    assert line.makespan == (m + p - 1) * 3.0
    assert t.bubble == pytest.approx((p - 1) * f_plus_b, rel=0.1)


def test_a_one_percent_change_of_an_input_moves_the_step_by_at_most_about_one_percent() -> None:
    hw = _hw()
    base = _plan(dp=2, tp=8, sp=True, zero=1).time(hw).total
    for field, scale in (("memory_bandwidth", 1.01), ("matmul_efficiency", 0.99)):
        chip = dataclasses.replace(hw.chip, **{field: getattr(hw.chip, field) * scale})
        moved = _plan(dp=2, tp=8, sp=True, zero=1).time(dataclasses.replace(hw, chip=chip)).total
        assert abs(moved / base - 1) <= 0.011, (field, moved / base)
    slower = dataclasses.replace(hw, intra=Link(bandwidth=hw.intra.bandwidth * 0.99, latency=hw.intra.latency))
    assert abs(_plan(dp=2, tp=8, sp=True, zero=1).time(slower).total / base - 1) <= 0.011


def test_a_dtype_the_chip_has_no_peak_for_is_refused() -> None:
    hw = dataclasses.replace(_hw(), chip=dataclasses.replace(_hw().chip, flops={"bfloat16": 1e15}))
    with pytest.raises(ValueError, match="toy has no float32 peak"):
        _plan(dtype="float32").time(hw)
