"""The step-time model (dtp.planning.time, Plan.time): each term on a hand-computed case,
and the model's response to its inputs. Its predictions beside measured steps and published
runs live in benchmarks/, not here: these are the terms' arithmetic."""

from __future__ import annotations

import contextlib
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


def test_a_measured_collective_costs_its_fixed_time_not_the_rings_latency() -> None:
    """Where the link holds a collective's measured fixed cost, that replaces its ring's
    steps of α; a group size not measured scales the nearest one by the ring's steps; an
    all-to-all-v reads the all-to-all's; a send keeps the message's α."""
    link = Link(bandwidth=1e9, latency=1e-4, collective_latency=(("all_reduce", 2, 1e-3), ("all_reduce", 4, 6e-3),
                                                                  ("all_to_all", 4, 3e-3)))
    assert collective_seconds("all_reduce", 10**6, 4, link) == pytest.approx(6e-3 + 1e-3)
    assert collective_seconds("all_reduce", 0, 8, link) == pytest.approx(6e-3 * 7 / 3)  # from 4's, 7 steps of 3
    assert collective_seconds("all_to_all_v", 10**6, 4, link) == pytest.approx(3e-3 + 1e-3)
    assert collective_seconds("all_gather", 10**6, 4, link) == pytest.approx(3 * 1e-4 + 1e-3)  # not measured
    assert collective_seconds("send", 10**6, 2, link) == pytest.approx(1e-4 + 1e-3)


def _small(**kw: object) -> dtp.planning.Plan:
    return dtp.plan(dtp.RunConfig(**{**dict(model="small", batch=4, seq=256, dtype="float32"), **kw}), backend="gloo")


def test_attention_runs_at_the_chips_attention_figure() -> None:
    """The small model's attention on one rank: 4 blocks of 8 heads of 32, 1024 tokens of
    which each sees 128.5 keys on average — 4 · 1024 · 128.5 · 32 · 8 · 4 FLOPs forward,
    3.5 × that with backward — at the attention curve's fraction of peak at 256 × 32
    instead of the GEMM figure."""
    flops = 4 * 1024 * 128.5 * 32 * 8 * 4 * 3.5
    base = _hw(matmul_efficiency=1.0)
    slow = dataclasses.replace(base, chip=dataclasses.replace(base.chip, attention_curve=((8192.0, 0.25),)))
    t0, t1 = _small().time(base), _small().time(slow)
    assert t1.compute - t0.compute == pytest.approx(flops / 1e14 / 0.25 - flops / 1e14)
    assert base.chip.attention_fraction(256, 32) == base.chip.matmul_efficiency  # no curve: the GEMM figure


def _counted(model: str, microbatches: int) -> int:
    """The non-view ops (a TorchDispatchMode's count) of a real step of ``model`` on one
    device, after two warm-up steps."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtp.core.mesh.devices import clear_mesh_cache
    from dtp.models import llama

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            Count.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    cfg = llama.config(model)
    batch = 2 * microbatches
    tok = torch.randint(0, cfg.vocab_size, (batch, 17), generator=torch.Generator().manual_seed(0))
    data = {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}
    run = dtp.RunConfig(model=model, batch=batch, seq=16, microbatches=microbatches)
    # dtp train --nproc 1's path: a mesh of one (a group of one, plain tensors; simulate's
    # ranks would run DTensors), ended as that process would end it.
    assert not torch.distributed.is_initialized()
    try:
        state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(1e-3, weight_decay=0.1),
                                      mesh=dtp.make_mesh(dp=1), layout=run.layout(), axes=llama.param_axes(cfg))
        loss_fn = llama.sequential(cfg)
        for step in range(3):
            with Count() if step == 2 else contextlib.nullcontext():
                state, _ = dtp.train_step(loss_fn, state, dtp.shard_batch(data, state), clip_norm=1.0,
                                          microbatches=microbatches)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            clear_mesh_cache()
    return Count.ops


@pytest.mark.parametrize("microbatches", [1, 2])
def test_the_ops_counted_are_the_ops_the_step_runs(microbatches: int) -> None:
    """With each op costing 1 s and nothing else costing anything, the step's compute and
    optimizer terms are its op count: the tiny model's real step, op for op (two dense
    blocks of 39 + 59, the head's 46 and the embedding's 2 per microbatch; 13 a step, one
    per parameter for the clip and one per parameter per further microbatch)."""
    free = Link(bandwidth=1e30, latency=0.0)
    hw = Hardware(name="ops", chip=Chip(name="ops", flops={"float32": 1e30}, memory=1e12, memory_bandwidth=1e30,
                                        matmul_efficiency=1.0, op_overhead=1.0),
                  devices_per_node=1, intra=free, inter=free, host=free)
    t = dtp.plan(dtp.RunConfig(model="tiny", batch=2 * microbatches, seq=16, microbatches=microbatches)).time(hw)
    assert t.compute + t.optimizer == pytest.approx(_counted("tiny", microbatches))


def _block_counts(model: str) -> tuple[int, int, int, int]:
    """One block's (second: the rotary table is cached by then) non-view ops forward and
    backward, and the bytes its elementwise ops move (each op's tensors in and out, an
    in-place op's operand written too), of batch 2 × 16 tokens."""
    import torch
    from torch.utils._pytree import tree_leaves
    from torch.utils._python_dispatch import TorchDispatchMode

    from dtp.models import llama

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            if not func.is_view:
                self.ops += 1
                if not any(k in name for k in ("mm", "scaled_dot_product", "_unsafe_view")):  # (a view to autograd)
                    tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
                    written = [t for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor)] \
                        if func._schema.is_mutable else []
                    self.bytes += sum(t.numel() * t.element_size() for t in tensors + written)
            return out

    cfg = llama.config(model)
    params = llama.init(cfg)
    for i in range(2):
        h = torch.randn(2, 16, cfg.dim, requires_grad=True)
        layer = {k: v.requires_grad_() for k, v in params["layers"][i].items()}
        fwd, bwd = Count(), Count()
        with fwd:
            y = llama._block(layer, h, cfg)
        outs = (y[0], y[1]["aux_loss"], y[1]["z_loss"]) if isinstance(y, tuple) else (y,)
        seeds = tuple(torch.ones_like(o) for o in outs)
        with bwd:
            torch.autograd.backward(outs, seeds)
    return fwd.ops, bwd.ops, fwd.bytes, bwd.bytes


def test_a_blocks_unfused_ops_and_bytes_are_the_codes() -> None:
    """A dense block's op counts exactly, and its elementwise bytes within 3 % (the model
    counts widths per token; the rms's one column and the weights' rows are left out);
    an MoE block's op counts."""
    from dtp.planning import time as model

    ops_f, ops_b, bytes_f, bytes_b = _block_counts("tiny")
    assert (ops_f, ops_b) == model._OPS_BLOCK
    t = dtp.planning.Target.of(dtp.RunConfig(model="tiny", batch=2, seq=16))
    fwd, bwd, _, _ = model._unfused(t, 64, 32, 128, 1, 0, False, False)  # 4 q heads and 2 kv heads of 16, ffn 128
    assert fwd == pytest.approx(bytes_f, rel=0.03) and bwd == pytest.approx(bytes_b, rel=0.03)
    assert _block_counts("tiny-moe")[:2] == model._OPS_MOE


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
@pytest.mark.parametrize("m", [4, 8])
def test_busy_bound_is_a_bound_of_every_schedule(schedule, m):
    """The search prunes by busy_bound (each rank's work after the forwards it waits for
    before its first action): never above the simulated step, whatever the schedule."""
    from dtp.planning.hardware import hardware
    from dtp.planning.target import Target, leaves, stage_leaves
    from dtp.planning.time import busy_bound, step_time
    from dtp.planning.traffic import traffic

    hw = hardware("h100-sxm")
    run = dtp.RunConfig(model="small", pp=2, dp=2, microbatches=m, pp_schedule=schedule, batch=16, seq=64,
                        **({"virtual_stages": 2} if schedule == "interleaved" else {}))
    s = Target.of(run, backend="nccl")
    per = stage_leaves(s, leaves(s))
    rows = tuple(tuple(traffic(s, lv, i)) for i, lv in enumerate(per))
    assert busy_bound(s, per, rows, hw) <= step_time(s, per, rows, hw).total * (1 + 1e-12)
