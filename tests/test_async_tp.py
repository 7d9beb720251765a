"""Async tensor parallel (``layouts.megatron(sequence_parallel=True, async_tp=True)``):
three steps equal one device in fp64 and non-async SP in fp32, with the same bytes per
rank per mesh axis; the block entries are one ring each (the kinds change to send_recv).
MoE models too (tiny-moe with a shared expert; ep2 × tp2 with experts whole or split over
tp), and dtp.plan predicts their records."""
import contextlib
import functools
import math

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp.models import llama
from dtp.ops.collective_matmul import split_backward
from dtp.ops.tp_rings import one_way
from dtp.testing import assert_tree_close, reference_value_and_grad, run
from measured_step import second_step_comm

CFG = llama.config("tiny", n_heads=8, n_kv_heads=4)
# dense attention + MoE FFN in every block; the shared expert is a dense MLP beside it
MOE_CFG = llama.config("tiny-moe", aux_loss_coeff=1e-2, z_loss_coeff=1e-3, shared_experts=1)
LOSS = functools.partial(llama.loss, cfg=CFG)


def _batch(seed, b=4, s=16):
    tok = torch.randint(0, CFG.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _full(x):
    return (x.full_tensor() if isinstance(x, DTensor) else x).detach()


def _layout(mesh_axes, async_tp, zero=None, expert_tp=False, pipe_experts=False):
    layout = dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=True, async_tp=async_tp)
    if "cp" in mesh_axes:
        layout = layout + dtp.layouts.context("ring")
    if "ep" in mesh_axes:
        layout = layout + dtp.layouts.expert(tp_axis="tp" if expert_tp else None, pipe_experts=pipe_experts)
    return layout + (dtp.layouts.zero(stage=zero, bucket_mb=0.02) if zero else dtp.Layout())


def _three_steps(mesh_axes, async_tp, dtype, recompute=None, zero=None, microbatches=1, split=False, moe=False,
                 one_way_rings=False, **expert):
    cfg = MOE_CFG if moe else CFG
    mesh = dtp.make_mesh(**mesh_axes)
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(3e-3, 1, 3), weight_decay=0.1)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=dtype), opt, mesh=mesh,
                                  layout=_layout(mesh_axes, async_tp, zero, **expert), axes=llama.param_axes(cfg),
                                  axis_sizes=llama.axis_sizes(cfg))
    losses = []
    # split: every consumer's input gradient to the entry's ring, as under zero bubble's I / W
    with dtp.comm.comm_log() as log, split_backward() if split else contextlib.nullcontext(), \
            one_way() if one_way_rings else contextlib.nullcontext():
        for step in range(3):
            state, metrics = dtp.train_step(functools.partial(llama.loss, cfg=cfg), state,
                                            dtp.shard_batch(_batch(step), state),
                                            recompute=recompute, microbatches=microbatches)
            losses.append(float(metrics["loss"]))
    params = optree.tree_map(_full, dtp.gather_params(state))
    per_axis = {axis: sum(kinds.values()) for axis, kinds in log.summary().items()}
    return losses, params, per_axis, log.summary()


def _pair(mesh_axes, dtype, **kw):
    """Async and non-async SP on one pool (rank 0's results)."""
    out = (_three_steps(mesh_axes, True, dtype, **kw), _three_steps(mesh_axes, False, dtype, **kw))
    return out if torch.distributed.get_rank() == 0 else None


@functools.lru_cache(maxsize=2)
def _reference(moe=False):
    cfg = MOE_CFG if moe else CFG
    params = llama.init(cfg, seed=0, dtype=torch.float64)
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(3e-3, 1, 3), weight_decay=0.1)
    opt_state, losses = opt.init(params), []
    for step in range(3):
        loss, grads = reference_value_and_grad(functools.partial(llama.loss, cfg=cfg), params, _batch(step))
        losses.append(float(loss))
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
    return losses, optree.tree_map(torch.Tensor.detach, params)


def _check_fp64(result, what, moe=False):
    (losses, params, per_axis, kinds), (_, base_params, base_axis, base_kinds) = result
    ref_losses, ref_params = _reference(moe)
    assert losses == pytest.approx(ref_losses, rel=1e-10, abs=1e-10), what
    assert base_params.keys() == params.keys()
    assert_tree_close(params, ref_params, name=f"{what} async tp vs one device")
    assert per_axis == base_axis, f"{what}: bytes per axis {per_axis} vs non-async {base_axis}"
    assert "send_recv" in kinds["tp"] and "all_gather" not in kinds["tp"].keys() - base_kinds["tp"].keys()
    assert kinds["tp"].get("reduce_scatter", 0) < base_kinds["tp"]["reduce_scatter"], what


def test_async_tp_tp2_matches_single_device_fp64_and_non_async_fp32():
    _check_fp64(run(_pair, {"tp": 2}, torch.float64, world_size=2)[0], "tp2")
    (losses, params, per_axis, _), (base_losses, base_params, base_axis, _) = run(
        _pair, {"tp": 2}, torch.float32, world_size=2)[0]
    assert per_axis == base_axis
    assert losses == pytest.approx(base_losses, rel=1e-6)
    assert_tree_close(params, base_params, name="fp32 async vs non-async", rtol=1e-5, atol=1e-6)


# Composition, each with its own pool size: recompute (the exit's saving node lets the
# recompute stop before the dual ring), ZeRO-3, context parallel's ring, tp4 ± dp (the
# rings bidirectional there; one-way forced too).
SLOW_CASES = {
    "dp2 tp2 recompute full": ({"dp": 2, "tp": 2}, {"recompute": "full"}),
    "dp2 tp2 zero3 m2 recompute selective": ({"dp": 2, "tp": 2}, {"zero": 3, "microbatches": 2,
                                                                  "recompute": "selective"}),
    "cp2 tp2 ring recompute full": ({"cp": 2, "tp": 2}, {"recompute": "full"}),
    "tp4": ({"tp": 4}, {}),
    "tp4 one-way": ({"tp": 4}, {"one_way_rings": True}),
    "dp2 tp4 recompute full": ({"dp": 2, "tp": 4}, {"recompute": "full"}),
    "dp2 cp2 tp2 zero3": ({"dp": 2, "cp": 2, "tp": 2}, {"zero": 3}),
    "tp2 split backward recompute full": ({"tp": 2}, {"split": True, "recompute": "full"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_async_tp_composes_fp64(name):
    mesh_axes, kw = SLOW_CASES[name]
    _check_fp64(run(_pair, mesh_axes, torch.float64, world_size=math.prod(mesh_axes.values()), **kw)[0], name)


def _hops(one_way_rings, baseline=True):
    """send_recv records and tp bytes of one async step at tp4, and (``baseline``) non-async
    SP's."""
    out = []
    for async_tp in (True, False) if baseline else (True,):
        mesh = dtp.make_mesh(tp=4)
        state = dtp.TrainState.create(llama.init(CFG, seed=0), dtp.optim.adamw(1e-3), mesh=mesh,
                                      layout=_layout({"tp": 4}, async_tp), axes=llama.param_axes(CFG),
                                      axis_sizes=llama.axis_sizes(CFG))
        with dtp.comm_log() as log, one_way() if one_way_rings else contextlib.nullcontext():
            dtp.train_step(LOSS, state, dtp.shard_batch(_batch(0), state))
        out.append((len(log.filter(kind="send_recv")), sum(log.summary()["tp"].values())))
    return out


def test_async_tp_tp4_rings_are_bidirectional_with_the_same_bytes():
    # tp4, seq 16: shards of 4 rows; every ring two hops a step over 2 steps (4 hops)
    # where one-way takes 3, the bytes per rank those of non-async SP either way.
    (bidi, bidi_bytes), (_, sp_bytes) = run(_hops, False, world_size=4)[0]
    # Non-async SP's step once, not again beside the one-way rings (measured on torch 2.13,
    # 2 cores, alone with the 4-rank pool's start: 14.6 s -> 12.4 s).
    ((one, one_bytes),) = run(_hops, True, False, world_size=4)[0]
    assert one > 0 and bidi * 3 == one * 4, (bidi, one)
    assert bidi_bytes == one_bytes == sp_bytes


def test_async_tp_moe_tp2_matches_single_device_fp64_and_non_async_fp32():
    # The MoE block's entry is read by the router and the dispatch, not by a linear: the
    # op fills it by the plain ring first; the attention entries keep their matmul rings.
    _check_fp64(run(_pair, {"tp": 2}, torch.float64, moe=True, world_size=2)[0], "moe tp2", moe=True)
    (losses, params, per_axis, _), (base_losses, base_params, base_axis, _) = run(
        _pair, {"tp": 2}, torch.float32, moe=True, world_size=2)[0]
    assert per_axis == base_axis
    assert losses == pytest.approx(base_losses, rel=1e-6)
    assert_tree_close(params, base_params, name="moe fp32 async vs non-async", rtol=1e-5, atol=1e-6)


# MoE with experts over ep beside tp: whole experts on every tp rank (the MoE block's
# output replicated over tp), or split over tp (--expert-tp: a pending sum over tp, its
# own all-gathers / reduce-scatters in dtp.ops.moe_pipe), with pipe-experts and recompute.
MOE_CASES = {
    "moe ep2 tp2": ({"ep": 2, "tp": 2}, {}),
    "moe ep2 tp2 expert-tp": ({"ep": 2, "tp": 2}, {"expert_tp": True}),
    # (no microbatches: the balance loss of each microbatch's tokens is not one device's)
    "moe ep2 tp2 expert-tp pipe-experts recompute full": ({"ep": 2, "tp": 2}, {
        "expert_tp": True, "pipe_experts": True, "recompute": "full"}),
    "moe tp2 recompute full": ({"tp": 2}, {"recompute": "full"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MOE_CASES))
def test_async_tp_moe_composes_fp64(name):
    mesh_axes, kw = MOE_CASES[name]
    result = run(_pair, mesh_axes, torch.float64, moe=True, world_size=math.prod(mesh_axes.values()), **kw)[0]
    _check_fp64(result, name, moe=True)


@pytest.mark.slow
def test_async_tp_moe_expert_tp_fp32_equals_non_async():
    (losses, params, per_axis, _), (base_losses, base_params, base_axis, _) = run(
        _pair, {"ep": 2, "tp": 2}, torch.float32, moe=True, expert_tp=True, world_size=4)[0]
    assert per_axis == base_axis
    assert losses == pytest.approx(base_losses, rel=1e-6)
    assert_tree_close(params, base_params, name="moe expert-tp fp32 async vs non-async", rtol=1e-5, atol=1e-6)


def test_plan_predicts_the_async_tp_records():
    kw = dict(tp=2, sp=True, async_tp=True, microbatches=2, recompute="full")
    assert dtp.plan("tiny", batch=8, seq=16, **kw).bytes == run(second_step_comm, kw, world_size=2)[0]


# MoE blocks under tp (experts whole on every tp rank): the entry filled by the plain ring,
# the exit a slice forward and an all-gather backward; router and expert gradients whole.
# With a shared expert (a dense MLP beside them) the exit and the entry's gradient move.
PLAN_MOE = {"tp2 sp async-tp m2 recompute full": dict(tp=2, sp=True, async_tp=True, microbatches=2, recompute="full"),
            "tp2 sp async-tp": dict(tp=2, sp=True, async_tp=True), "tp2 sp": dict(tp=2, sp=True),
            "tp2 m2 recompute full": dict(tp=2, microbatches=2, recompute="full")}


def _moe_bytes(cases):
    return [second_step_comm(kw, "tiny-moe", shared_experts=shared) for shared, kw in cases]


def test_plan_predicts_the_moe_async_tp_records():
    cases = [(shared, kw) for shared in (0, 1) for kw in PLAN_MOE.values()]
    for (shared, kw), got in zip(cases, run(_moe_bytes, cases, world_size=2)[0]):
        cfg = llama.config("tiny-moe", shared_experts=shared)
        assert dtp.plan(cfg, batch=8, seq=16, **kw).bytes == got, (shared, kw)


@pytest.mark.slow
def test_plan_predicts_the_moe_async_tp_records_with_ep_and_dp():
    cases = {"ep2 tp2 sp async-tp": dict(ep=2, tp=2, sp=True, async_tp=True),
             "dp2 tp2 sp async-tp recompute full": dict(dp=2, tp=2, sp=True, async_tp=True, recompute="full")}
    measured = run(_moe_bytes, [(0, kw) for kw in cases.values()], world_size=4)[0]
    for (name, kw), got in zip(cases.items(), measured):
        want = dtp.plan("tiny-moe", batch=8, seq=16, **kw).bytes
        # EP's all-to-all-v follows the routing; the plan's is balanced (tests/test_plan.py)
        for summary in (want, got):
            summary.get("ep", {}).pop("all_to_all_v", None)
        assert want == got, name


def _saved_bytes(recompute):
    """Bytes of the distinct storages autograd saves in one forward, async and not."""
    out = {}
    for async_tp in (True, False):
        mesh = dtp.make_mesh(tp=2)
        state = dtp.TrainState.create(llama.init(CFG, seed=0), dtp.optim.adamw(1e-3), mesh=mesh,
                                      layout=_layout({"tp": 2}, async_tp), axes=llama.param_axes(CFG),
                                      axis_sizes=llama.axis_sizes(CFG))
        params, batch = state.params, dtp.shard_batch(_batch(0), state)
        storages: dict[int, int] = {}

        def pack(t):
            local = t.to_local() if isinstance(t, DTensor) else t
            if local.untyped_storage().data_ptr() not in {p.to_local().untyped_storage().data_ptr()
                                                          for p in optree.tree_leaves(params)}:
                storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            return t

        with dtp.use_layout(state.layout, mesh), dtp.ops.recompute(recompute), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = LOSS(params, batch)
        out[async_tp] = sum(storages.values())
        del loss
    return out


def test_async_tp_saves_no_more_activations_than_sp():
    saved = run(_saved_bytes, None, world_size=2)[0]
    assert 0 < saved[True] <= saved[False], saved  # measured equal (tiny, tp2: 432640 bytes each)
