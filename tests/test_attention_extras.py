"""The attention extras of Qwen2 / Qwen3 / Llama's ``attention_bias`` (``qkv_bias``,
``o_bias``, ``qk_norm``) need no layout of their own: their logical axes place them (a
q bias split over tp as ``wq``'s output features, k/v over tp as ``wk``/``wv``'s, the
output bias and the per-head q/k norms replicated), so three fp64 AdamW steps (weight
decay, clipping) under tp2 + sp, tp2 without sp, async tp, dp2 with ZeRO 1 and 3, a
pp2 pipeline and cp2 (ring, Ulysses; slow) equal the one-device run to 1e-10, biases and
norms drawn away from their zero / one init so that a bias added twice, or not at all, shows. A checkpoint saved
under tp2 + sp loads under dp2 × ZeRO 3 to the same parameters; fresh biases are zeros.
"""

from __future__ import annotations

import functools

import optree
import pytest
import torch

import dtp
from dtp.models import llama
from dtp.testing import assert_tree_close, reference_value_and_grad, run

QWEN2 = llama.config("tiny", vocab_size=128, qkv_bias=True)
# Qwen3 with attention_bias: every extra at once (q/k/v and output biases, q/k norms)
QWEN3 = llama.config("tiny", vocab_size=128, qkv_bias=True, o_bias=True, qk_norm=True)
MODELS = {"qwen2": QWEN2, "qwen3": QWEN3}
# name -> (model, mesh, layout pieces, microbatches)
CASES = {
    "qwen2 tp2+sp": ("qwen2", dict(tp=2), dict(sp=True), 2),
    "qwen3 tp2+sp": ("qwen3", dict(tp=2), dict(sp=True), 2),
    "qwen3 tp2": ("qwen3", dict(tp=2), dict(sp=False), 1),
    "qwen3 async-tp2": ("qwen3", dict(tp=2), dict(sp=True, async_tp=True), 1),
    "qwen2 dp2 zero3": ("qwen2", dict(dp=2), dict(zero=3), 2),
    "qwen3 dp2xtp2+sp zero1": ("qwen3", dict(dp=2, tp=2), dict(sp=True, zero=1), 1),
    "qwen3 pp2": ("qwen3", dict(pp=2), dict(pp="1f1b"), 2),
    "qwen2 pp2xtp2+sp": ("qwen2", dict(pp=2, tp=2), dict(sp=True, pp="1f1b"), 2),
    # the sequence split: q/k norms and biases per token, Ulysses moving heads after them
    "qwen3 cp2 ring": ("qwen3", dict(cp=2), dict(cp="ring"), 1),
    "qwen3 cp2 ulysses": ("qwen3", dict(cp=2), dict(cp="ulysses"), 1),
}
STEPS = 3


def _params(cfg: llama.LlamaConfig) -> dict:
    """``init``'s parameters (fp64) with the biases and q/k norms drawn away from 0 and 1."""
    params = llama.init(cfg, seed=0, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for layer in params["layers"]:
        for name, p in layer.items():
            if name.endswith("bias") or name in ("q_norm", "k_norm"):
                layer[name] = p + 0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
    return params


def _batch(cfg: llama.LlamaConfig, step: int) -> dict:
    t = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(step))
    return {"tokens": t[:, :-1].contiguous(), "targets": t[:, 1:].contiguous()}


def _adamw() -> dtp.optim.GradientTransformation:
    return dtp.optim.adamw(1e-2, weight_decay=0.1)


CLIP = 0.5


def _layout(pieces: dict) -> dtp.Layout:
    layout = dtp.layouts.data()
    if "sp" in pieces:
        layout = layout + dtp.layouts.megatron(sequence_parallel=pieces["sp"], async_tp=pieces.get("async_tp", False))
    if "zero" in pieces:
        layout = layout + dtp.layouts.zero(pieces["zero"], bucket_mb=0.01)  # several buckets
    if "pp" in pieces:
        layout = layout + dtp.layouts.pipeline(pieces["pp"])
    if "cp" in pieces:
        layout = layout + dtp.layouts.context(pieces["cp"])
    return layout


def _whole(x: torch.Tensor) -> torch.Tensor:
    return (x.full_tensor() if hasattr(x, "full_tensor") else x).detach()


def _train(model: str, axes: dict, pieces: dict, microbatches: int) -> dict:
    """On a rank: the parameters after ``STEPS`` steps under the layout, gathered whole."""
    cfg = MODELS[model]
    state = dtp.TrainState.create(_params(cfg), _adamw(), mesh=dtp.make_mesh(**axes), layout=_layout(pieces),
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    loss_fn = llama.sequential(cfg) if "pp" in pieces else functools.partial(llama.loss, cfg=cfg)
    for step in range(STEPS):
        state, _ = dtp.train_step(loss_fn, state, dtp.shard_batch(_batch(cfg, step), state),
                                  microbatches=microbatches, clip_norm=CLIP)
    return optree.tree_map(_whole, dtp.gather_params(state))


@functools.cache
def _reference(model: str) -> dict:
    cfg = MODELS[model]
    params, opt = _params(cfg), _adamw()
    opt_state = opt.init(params)
    for step in range(STEPS):
        _, grads = reference_value_and_grad(functools.partial(llama.loss, cfg=cfg), params, _batch(cfg, step))
        grads, _ = dtp.optim.clip_by_global_norm(grads, CLIP)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
    return params


# worlds of 4, and cp (the default run keeps one of each kind; run -m slow with ops, layouts or the model)
SLOW = {"qwen3 dp2xtp2+sp zero1", "qwen2 pp2xtp2+sp", "qwen3 cp2 ring", "qwen3 cp2 ulysses"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_layout_matches_one_device_fp64(name: str) -> None:
    model, axes, pieces, microbatches = CASES[name]
    world = 1
    for n in axes.values():
        world *= n
    expected = _reference(model)
    moved = optree.tree_map(lambda a, b: float((a - b).abs().max()), expected, _params(MODELS[model]))
    assert min(optree.tree_leaves(moved)) > 0  # every parameter trained, biases and norms included
    for got in run(_train, model, axes, pieces, microbatches, world_size=world):
        assert_tree_close(got, expected, name=name, rtol=1e-10, atol=1e-12)


def _save_then_load(path: str) -> dict:
    """Save under tp2 + sp (a world of 4 as dp2 × tp2), load under dp2 × ZeRO 3 (× tp2)."""
    cfg = QWEN3
    axes = dict(axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    mesh = dtp.make_mesh(dp=2, tp=2)
    saved = dtp.TrainState.create(_params(cfg), _adamw(), mesh=mesh, layout=_layout(dict(sp=True)), **axes)
    saved, _ = dtp.train_step(functools.partial(llama.loss, cfg=cfg), saved, dtp.shard_batch(_batch(cfg, 0), saved))
    dtp.checkpoint.save(saved, path)
    fresh = dtp.TrainState.create(llama.init(cfg, seed=5, dtype=torch.float64), _adamw(), mesh=mesh,
                                  layout=_layout(dict(sp=False, zero=3)), **axes)
    loaded, _ = dtp.checkpoint.load(path, fresh)
    return {"saved": optree.tree_map(_whole, dtp.gather_params(saved)),
            "loaded": optree.tree_map(_whole, dtp.gather_params(loaded))}


def test_checkpoint_moves_the_extras_between_layouts(tmp_path) -> None:
    for r in run(_save_then_load, str(tmp_path / "ckpt"), world_size=4):
        assert_tree_close(r["loaded"], r["saved"], name="loaded", rtol=0, atol=0)


def test_fresh_biases_are_zero_and_named_by_their_weights_axes() -> None:
    params, axes = llama.init(QWEN3), llama.param_axes(QWEN3)
    layer = params["layers"][0]
    assert all(not layer[n].any() for n in ("q_bias", "k_bias", "v_bias", "o_bias"))
    assert torch.equal(layer["q_norm"], torch.ones(QWEN3.head_dim))
    # the weights draw the same numbers with and without the extras
    assert torch.equal(layer["wo"], llama.init(llama.config("tiny", vocab_size=128))["layers"][0]["wo"])
    want = {"q_bias": ("heads",), "k_bias": ("kv_heads",), "v_bias": ("kv_heads",), "o_bias": ("embed",),
            "q_norm": ("head_dim",), "k_norm": ("head_dim",)}
    assert {n: axes["layers"][0][n] for n in want} == want
    assert llama.param_count(QWEN3) == llama.param_count(llama.config("tiny", vocab_size=128)) + 2 * (
        64 + 2 * 32 + 64 + 2 * 16)
