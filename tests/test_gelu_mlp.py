"""GPT's MLP as configuration (``LlamaConfig(mlp="gelu")``): two matrices, ``w_up`` (dim →
ffn) and ``w_down`` (ffn → dim), with a GELU between. Its shapes, parameter and FLOP counts
by hand; three fp64 AdamW steps under tp2 (with and without SP) and dp2 equal the one-device
run; the plan's bytes equal the comm log; the step-time model moves GELU's bytes, not
SwiGLU's; refused values and the Hugging Face export say so in one line.
"""

from __future__ import annotations

import functools

import optree
import pytest
import torch

import dtp
from dtp.models import llama
from dtp.models.config import param_shapes
from dtp.planning.hardware import hardware
from dtp.planning.time import _work
from dtp.planning.target import leaves
from dtp.testing import assert_tree_close, reference_value_and_grad, run
from measured_step import second_step_comm

GELU = llama.config("tiny", vocab_size=128, mlp="gelu", ffn_dim=256)  # GPT's 4·dim
STEPS = 3
CLIP = 0.5
# name -> (mesh, layout pieces, microbatches)
CASES = {
    "tp2+sp": (dict(tp=2), dict(sp=True), 2),
    "tp2": (dict(tp=2), dict(sp=False), 1),
    "dp2": (dict(dp=2), dict(), 2),
}


def test_shapes_have_no_gate():
    shapes = param_shapes(GELU)
    assert shapes["layers.0.w_up"] == (64, 256) and shapes["layers.0.w_down"] == (256, 64)
    assert not any("w_gate" in k for k in shapes)
    assert llama.param_axes(GELU)["layers"][1]["w_up"] == ("embed", "mlp")
    params = llama.init(GELU)
    assert {k: tuple(v.shape) for k, v in params["layers"][0].items()} == llama.block_shapes(GELU, 0)


def test_param_count_and_flops_by_hand():
    d, f, v, L = 64, 256, 128, 2
    attn = d * d + 2 * d * 32 + d * d  # wq, wk and wv (2 kv heads of 16), wo
    per_block = attn + 2 * d * f + 2 * d  # two MLP matrices, two norms
    assert llama.param_count(GELU) == v * d + L * per_block + d + d * v  # embed, blocks, final norm, lm_head
    matmul = L * (attn + 2 * d * f) + d * v
    assert llama.flops_per_token(GELU, seq_len=32) == 6 * matmul + 6 * L * d * 32


@pytest.mark.parametrize("kw, match", [
    (dict(mlp="relu"), r"mlp must be one of \('swiglu', 'gelu'\), got 'relu'"),
    (dict(mlp="gelu", num_experts=4), r"mlp='gelu' is a dense MLP; MoE experts are SwiGLU"),
])
def test_bad_values_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        llama.config("tiny", **kw)


def test_hf_export_refuses_a_gelu_mlp():
    from dtp.models.hf.config import hf_config

    with pytest.raises(ValueError, match="MLPs are SwiGLU; this model has mlp='gelu'"):
        hf_config(GELU)


def test_time_model_moves_gelus_bytes_not_swiglus():
    """Elementwise bytes per block per token, forward: SwiGLU's silu reads one ffn-wide
    tensor and writes one, its product reads two and writes one (5 widths); GELU reads one
    and writes one (2)."""
    def elementwise(cfg):
        s = dtp.planning.Target.of(dtp.RunConfig(batch=8, seq=32), cfg=cfg)
        return _work(s, leaves(s), hardware("a100-80gb")).elementwise_fwd
    swiglu = llama.config("tiny", vocab_size=128, ffn_dim=256)
    bandwidth = hardware("a100-80gb").chip.memory_bandwidth
    tokens, blocks, item = 8 * 32, 2, 4
    assert elementwise(swiglu) - elementwise(GELU) == pytest.approx(3 * tokens * blocks * 256 * item / bandwidth)


def _params(cfg: llama.LlamaConfig) -> dict:
    return llama.init(cfg, seed=0, dtype=torch.float64)


def _batch(cfg: llama.LlamaConfig, step: int) -> dict:
    t = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(step))
    return {"tokens": t[:, :-1].contiguous(), "targets": t[:, 1:].contiguous()}


def _adamw() -> dtp.optim.GradientTransformation:
    return dtp.optim.adamw(1e-2, weight_decay=0.1)


def _whole(x: torch.Tensor) -> torch.Tensor:
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach()


def _train(axes: dict, pieces: dict, microbatches: int) -> tuple[list[float], dict]:
    """On a rank: the losses and the parameters after ``STEPS`` steps, gathered whole."""
    layout = dtp.layouts.data()
    if "sp" in pieces:
        layout = layout + dtp.layouts.megatron(sequence_parallel=pieces["sp"])
    state = dtp.TrainState.create(_params(GELU), _adamw(), mesh=dtp.make_mesh(**axes), layout=layout,
                                  axes=llama.param_axes(GELU), axis_sizes=llama.axis_sizes(GELU))
    losses = []
    for step in range(STEPS):
        state, metrics = dtp.train_step(functools.partial(llama.loss, cfg=GELU), state,
                                        dtp.shard_batch(_batch(GELU, step), state), microbatches=microbatches,
                                        clip_norm=CLIP)
        losses.append(float(metrics["loss"]))
    return losses, optree.tree_map(_whole, dtp.gather_params(state))


@functools.cache
def _reference() -> tuple[list[float], dict]:
    params, opt = _params(GELU), _adamw()
    opt_state, losses = opt.init(params), []
    for step in range(STEPS):
        loss, grads = reference_value_and_grad(functools.partial(llama.loss, cfg=GELU), params, _batch(GELU, step))
        losses.append(float(loss))
        grads, _ = dtp.optim.clip_by_global_norm(grads, CLIP)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
    return losses, params


def test_a_gelu_model_trains():
    """Ten steps on one batch: the loss falls, every parameter moves."""
    params, opt, batch = _params(GELU), _adamw(), _batch(GELU, 0)
    opt_state, losses = opt.init(params), []
    for _ in range(10):
        loss, grads = reference_value_and_grad(functools.partial(llama.loss, cfg=GELU), params, batch)
        losses.append(float(loss))
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
    assert losses[-1] < 0.8 * losses[0], losses
    moved = optree.tree_map(lambda a, b: float((a - b).abs().max()), params, _params(GELU))
    assert min(optree.tree_leaves(moved)) > 0


@pytest.mark.parametrize("name", list(CASES))
def test_layout_matches_one_device_fp64(name):
    axes, pieces, microbatches = CASES[name]
    losses, expected = _reference()
    for got_losses, got in run(_train, axes, pieces, microbatches, world_size=2):
        assert got_losses == pytest.approx(losses, rel=1e-10)
        assert_tree_close(got, expected, name=name, rtol=1e-10, atol=1e-12)


BYTES_2 = {"tp2 sp": (dict(tp=2, sp=True), "tiny", 8, 16), "dp2": (dict(dp=2), "tiny", 8, 16)}


def _bytes(cases) -> list[dict]:
    return [second_step_comm(*c, mlp="gelu", ffn_dim=256) for c in cases]


def test_plan_bytes_equal_the_comm_log():
    measured = run(_bytes, list(BYTES_2.values()), world_size=2)[0]
    for name, got in zip(BYTES_2, measured):
        kw, model, batch, seq = BYTES_2[name]
        cfg = llama.config(model, mlp="gelu", ffn_dim=256)
        assert dtp.plan(cfg, batch=batch, seq=seq, **kw).bytes == got, name


# The memory model's GELU terms (2 ffn-wide tensors saved, not SwiGLU's 4) against the
# allocator, with test_plan's bounds and measuring helpers; a measurement, so slow.
MEMORY_2 = {"dp2": (dict(dp=2), "tiny", 8, 128), "tp2": (dict(tp=2), "tiny", 8, 128),
            "tp2 sp full": (dict(tp=2, sp=True, recompute="full"), "tiny", 8, 128)}


def _peaks(cases) -> list[int]:
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function

    import test_plan

    out = []
    for kw, model, batch, seq in cases:
        gc.collect()
        with test_plan._collective_buffers_freed_here(), \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            second_step_comm(kw, model, batch, seq, step_context=lambda step: record_function(f"plan step {step}"),
                             mlp="gelu", ffn_dim=256)
            gc.collect()
        out.append(test_plan._allocator_peak(prof, "plan step 1"))
    return out


@pytest.mark.slow
def test_predicted_peak_bounds_the_measured():
    import test_plan

    measured = run(_peaks, list(MEMORY_2.values()), world_size=2)
    for k, name in enumerate(MEMORY_2):
        kw, model, batch, seq = MEMORY_2[name]
        plan = dtp.plan(llama.config(model, mlp="gelu", ffn_dim=256), batch=batch, seq=seq, **kw)
        peak = max(r[k] for r in measured)
        assert peak * (1 - test_plan.MEMORY_UNDER) <= plan.peak <= peak * test_plan.MEMORY_OVER, \
            f"{name}: predicted {plan.peak}, measured {peak}"
