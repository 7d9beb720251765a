"""Qwen3-MoE (``model_type: "qwen3_moe"``) through dtp.models.hf: its MoE layers
(``decoder_sparse_step`` and ``mlp_only_layers``) are the ones transformers builds, read as
dtp's ``moe_every`` or refused in one line; an export refuses what Qwen3-MoE cannot
express; and ``dtp train --init-from`` a transformers-made Qwen3-MoE under ep 2 trains as
one process (``--check``, fp64 to 1e-10). Logits against transformers, export round trips
and a fine-tune's export: tests/test_hf.py's cases ``qwen3moe`` and ``qwen3moe_sparse2``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtp.models import hf, llama

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

V = 100
KW = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)


def _hf_config(**change) -> dict:
    return {**KW, "model_type": "qwen3_moe", **change}


# (num_hidden_layers, decoder_sparse_step, mlp_only_layers) -> dtp's moe_every (0: no MoE layer)
ACCEPTED = {(4, 1, ()): 1, (4, 2, ()): 2, (6, 3, ()): 3, (4, 1, (0, 2)): 2, (4, 2, (0,)): 2, (4, 1, (0, 1, 2, 3)): 0,
            (2, 3, ()): 0}


@pytest.mark.parametrize("layers, step, dense", sorted(ACCEPTED))
def test_moe_layers_are_the_ones_transformers_builds(layers: int, step: int, dense: tuple) -> None:
    change = dict(num_hidden_layers=layers, decoder_sparse_step=step, mlp_only_layers=list(dense))
    cfg = hf.config_from_hf(_hf_config(**change))
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**KW, **change))
    theirs = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert [llama.is_moe(cfg, i) for i in range(layers)] == theirs
    assert (cfg.moe_every if cfg.num_experts else 0) == ACCEPTED[layers, step, dense]
    if cfg.num_experts:  # the experts' own width; the dense layers' is intermediate_size
        assert (cfg.moe_ffn_dim, cfg.ffn_dim, cfg.qk_norm) == (24, 48, True)


@pytest.mark.parametrize("change, match", [
    (dict(num_hidden_layers=4, mlp_only_layers=[1]), r"make layers \[0, 2, 3\] MoE; dtp's MoE layers are every"),
    (dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]), r"make layers \[1\] MoE"),
    (dict(num_hidden_layers=2, decoder_sparse_step=0), "decoder_sparse_step must be an int >= 1, got 0"),
])
def test_moe_layers_no_moe_every_picks_are_refused(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(_hf_config(**change))


def test_router_and_aux_fields_read_as_transformers_defaults_them() -> None:
    """norm_topk_prob is false unless set (transformers' default; Qwen3-30B-A3B's
    config.json sets it true): not renormalised over the k is dtp's pre_softmax."""
    cfg = hf.config_from_hf(_hf_config(num_hidden_layers=2))
    assert (cfg.pre_softmax, cfg.aux_loss_coeff, cfg.top_k, cfg.num_experts) == (True, 0.001, 2, 4)
    assert not hf.config_from_hf(_hf_config(num_hidden_layers=2, norm_topk_prob=True)).pre_softmax
    saved = {k: v for k, v in _hf_config(num_hidden_layers=2).items() if k != "num_experts"}  # save_pretrained's
    assert hf.config_from_hf({**saved, "num_local_experts": 4}) == cfg  # spelling of num_experts


@pytest.mark.parametrize("change", [dict(shared_experts=1), dict(capacity_factor=1.5),
                                    dict(routed_scaling_factor=2.5), dict(router_score="sigmoid", router_bias_update=1e-2),
                                    dict(n_groups=2, topk_group=1)], ids=lambda c: next(iter(c)))
def test_to_hf_refuses_what_qwen3_moe_cannot_express(tmp_path: Path, change: dict) -> None:
    cfg = llama.config("tiny-moe", qk_norm=True, **change)
    with pytest.raises(ValueError, match=f"Qwen3-MoE has no shared experts.*this model sets .*{next(iter(change))}"):
        hf.to_hf(cfg, llama.init(cfg), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_to_hf_writes_what_only_qwen3_moe_expresses_as_qwen3_moe() -> None:
    """MoE every second layer, a narrower expert and weights not renormalised are Qwen3-MoE's
    (and refused for a model without q/k norms, a Mixtral)."""
    cfg = llama.config("tiny-moe", n_layers=4, qk_norm=True, moe_every=2, moe_ffn_dim=32, pre_softmax=True)
    out = hf.hf_config(cfg)
    assert (out["model_type"], out["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    assert {k: out[k] for k in ("decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size", "intermediate_size",
                                "norm_topk_prob", "num_experts")} == {
        "decoder_sparse_step": 2, "mlp_only_layers": [], "moe_intermediate_size": 32, "intermediate_size": 128,
        "norm_topk_prob": False, "num_experts": 4}
    assert hf.config_from_hf(out) == cfg
    with pytest.raises(ValueError, match="Mixtral has MoE in every block"):
        hf.hf_config(llama.config("tiny-moe", moe_every=2))


def test_init_from_qwen3_moe_under_ep2_trains_as_one_process(tmp_path: Path, monkeypatch) -> None:
    """``dtp train --init-from`` a transformers-made Qwen3-MoE (MoE in layers 1 and 3, not
    renormalised, q/k norms drawn away from 1) on dp 1 × ep 2: each rank reads its two
    experts of the per-expert files, and ``--check``'s one process (the whole model) trains
    the same losses."""
    import cli_pool

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**KW, num_hidden_layers=4,
                                                                         decoder_sparse_step=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_norm." in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "qwen3moe")
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "tokens.npy", torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(1)).numpy())
    run = tmp_path / "run"
    result = cli_pool.train(monkeypatch, "--init-from", str(tmp_path / "qwen3moe"),
                            "--data", str(tmp_path / "tokens.npy"), "--ep", "2", "--steps", "3", "--batch", "4", "--seq", "16", "--dtype", "float64",
                            "--log-every", "1", "--check", "--out", str(run))
    assert result.returncode == 0, result.stdout + result.stderr
    check = json.loads((run / "check.json").read_text())
    assert check["ok"] and check["steps"] == 3 and check["max_rel_diff"] <= 1e-10, check
