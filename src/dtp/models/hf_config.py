"""Hugging Face ``config.json`` <-> :class:`LlamaConfig`, torch-free (``dtp train
--init-from`` checks a run against the model before importing torch); the weights are
:mod:`dtp.models.hf`'s, but which files hold them and whether those are whole (their
headers against their sizes) is here, for the same preflight.

:mod:`dtp.models.hf` re-exports the config names; import them from there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .config import LlamaConfig, RopeScaling

__all__ = ["config_from_hf", "hf_config", "hf_model_type", "padded_vocab", "check_mixtral", "weight_files",
           "check_weight_files", "INIT_VOCAB_MULTIPLE", "INDEX", "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3")
# The families whose sliding_window counts only with use_sliding_window (Mistral's always does).
_OPT_IN_WINDOW = ("qwen2", "qwen3")
_DTYPES = ("float64", "float32", "float16", "bfloat16")
# dtp train --init-from pads the vocabulary to a multiple of this (Megatron's default
# --make-vocab-size-divisible-by), whatever tp is: runs under different layouts then share
# one model (checkpoints, --check's one-process reference), and any power-of-two tp up to
# 128 splits it.
INIT_VOCAB_MULTIPLE = 128


def padded_vocab(vocab: int, multiple: int) -> int:
    """``vocab`` rounded up to a multiple of ``multiple``.

    >>> padded_vocab(32000, 128 * 3)
    32256
    """
    if not (isinstance(multiple, int) and multiple >= 1):
        raise ValueError(f"padded_vocab: multiple must be an int >= 1, got {multiple!r}")
    return -(-vocab // multiple) * multiple


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's ``rope_parameters`` or transformers
    4's ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters")
    if params is not None and "rope_type" not in params and "rope_theta" not in params:
        raise ValueError(f"from_hf: per-layer-type rope_parameters are not supported, got {params}")
    if params is None:
        params = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"from_hf: partial_rotary_factor={partial} is not supported (dtp rotates the whole head)")
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"from_hf: rope type {kind!r} is not supported (only 'default' and 'llama3')")
    return theta, RopeScaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                              high_freq_factor=float(params["high_freq_factor"]),
                              original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def config_from_hf(hf: dict[str, Any] | str | os.PathLike[str], vocab_multiple: int = 1) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face ``config.json`` (a dict, the file, or
    its directory), by ``model_type``:

    - ``llama``: ``attention_bias`` biases q/k/v and the output projection (``qkv_bias``,
      ``o_bias``); ``mlp_bias`` is refused.
    - ``mistral``: a ``sliding_window`` caps ``max_seq_len`` (within it attention is plain
      causal); ``mixtral``: its experts and router.
    - ``qwen2`` (Qwen2, Qwen2.5): Llama with q/k/v biases (``qkv_bias``).
    - ``qwen3``: Llama with an RMSNorm over each head's q and k before RoPE (``qk_norm``),
      ``attention_bias`` as Llama's.

    Qwen's ``sliding_window`` caps ``max_seq_len`` only with ``use_sliding_window``.

    Raises: ``ValueError`` for what dtp's Llama does not compute (MLP biases, biases in
    Mistral/Mixtral, another activation, another rope type).

    >>> config_from_hf({"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4}, vocab_multiple=128).vocab_pad
    84
    >>> config_from_hf({"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 32}).qkv_bias
    True
    """
    if not isinstance(hf, dict):
        file = Path(hf)
        hf = json.loads((file / "config.json" if file.is_dir() else file).read_text())
    kind = hf.get("model_type")
    if kind not in _MODEL_TYPES:
        raise ValueError(f"from_hf: model_type {kind!r} is not supported; choose one of {_MODEL_TYPES}")
    if hf.get("mlp_bias"):
        raise ValueError("from_hf: mlp_bias=true is not supported (dtp's MLP has no biases)")
    attention_bias = bool(hf.get("attention_bias"))
    if attention_bias and kind not in ("llama", "qwen3"):
        raise ValueError(f"from_hf: attention_bias=true is not supported for {kind!r} (only llama and qwen3 read it)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"from_hf: hidden_act must be 'silu', got {hf['hidden_act']!r}")
    theta, scaling = _rope(hf)
    vocab = int(hf["vocab_size"])
    max_len = int(hf.get("max_position_embeddings", 2048))
    if hf.get("sliding_window") and (kind not in _OPT_IN_WINDOW or hf.get("use_sliding_window")):
        max_len = min(max_len, int(hf["sliding_window"]))
    heads = int(hf["num_attention_heads"])
    fields: dict[str, Any] = dict(
        vocab_size=padded_vocab(vocab, vocab_multiple), vocab_pad=padded_vocab(vocab, vocab_multiple) - vocab,
        dim=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads), ffn_dim=int(hf["intermediate_size"]),
        max_seq_len=max_len, rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen3Config's head_dim defaults to 128, not hidden_size // heads
        head_dim=hf.get("head_dim", 128 if kind == "qwen3" else None),
        qkv_bias=attention_bias or kind == "qwen2", o_bias=attention_bias, qk_norm=kind == "qwen3")
    if kind == "mixtral":
        fields.update(num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                      aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01)))
    return LlamaConfig(**fields)


def weight_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Each tensor name in a Hugging Face directory -> the ``.safetensors`` file holding it:
    from ``model.safetensors.index.json`` when there is one, else from the files' headers.

    Raises: ``ValueError`` when ``path`` is no directory or holds no ``.safetensors`` file.
    """
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"from_hf: {root} is not a directory (a Hugging Face model directory holds config.json "
                         f"and *.safetensors)")
    if (root / INDEX).is_file():
        weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"from_hf: no *.safetensors file in {root} (PyTorch .bin checkpoints are not read; "
                         f"save them with safe_serialization=True)")
    names: dict[str, Path] = {}
    for file in files:
        names.update((name, file) for name in _header(file) if name != "__metadata__")
    return names


def _header(file: Path) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file (8-byte length, then the JSON), checked
    against the file's size: ``ValueError`` naming a file cut short or not safetensors."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        try:
            header = json.loads(f.read(n)) if 8 + n <= size else None
        except ValueError:  # JSONDecodeError or undecodable bytes: a cut or foreign file
            header = None
    if not isinstance(header, dict):
        raise ValueError(f"from_hf: {file} is not a whole .safetensors file (its header is unreadable)")
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets") or ()) == 2]
    if 8 + n + max(ends, default=0) > size:
        raise ValueError(f"from_hf: {file} is cut short: its header describes {8 + n + max(ends)} bytes, the file "
                         f"has {size} (an interrupted download or copy?)")
    return header


def check_weight_files(path: str | os.PathLike[str]) -> None:
    """The weight files of the Hugging Face directory ``path`` are there and whole (each
    header read and its tensors within the file's size; no tensor data read), torch-free:
    ``dtp train --init-from`` checks them before any rank starts.

    Raises: ``ValueError`` naming the directory or the file (:func:`weight_files`).
    """
    where = weight_files(path)  # without an index, this read (and checked) every file's header
    if not (Path(path) / INDEX).is_file():
        return
    for file in sorted(set(where.values())):  # the files the index names, unread so far
        if not file.is_file():
            raise ValueError(f"from_hf: {file} is missing (named by {Path(path) / INDEX})")
        _header(file)


def check_mixtral(cfg: LlamaConfig) -> None:
    """Raise ``ValueError`` if ``cfg`` has MoE options ``MixtralForCausalLM`` cannot express.

    >>> from dtp.models.config import config
    >>> check_mixtral(config("tiny-moe"))
    """
    if not cfg.num_experts:
        return
    # What Mixtral's router is (softmax scores, top-k, renormalised, nothing added): any of
    # these set routes tokens otherwise, so an export would load as another model.
    odd = {name: value for name, value, mixtral in [
        ("moe_every", cfg.moe_every, 1), ("shared_experts", cfg.shared_experts, 0),
        ("pre_softmax", cfg.pre_softmax, False), ("capacity_factor", cfg.capacity_factor, None),
        ("moe_ffn_dim", cfg.moe_ffn_dim, None), ("router_score", cfg.router_score, "softmax"),
        ("n_groups", cfg.n_groups, None), ("topk_group", cfg.topk_group, None),
        ("routed_scaling_factor", cfg.routed_scaling_factor, None), ("router_bias_update", cfg.router_bias_update, 0.0)]
        if value != mixtral and not (name == "routed_scaling_factor" and value == 1.0)}
    if odd:
        raise ValueError(f"to_hf: Mixtral has MoE in every block, no shared experts, top-k-then-softmax routing "
                         f"(softmax scores, no groups, no scaling, no bias), no capacity and one FFN width; this model "
                         f"sets {odd}")


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def hf_model_type(cfg: LlamaConfig) -> str:
    """The transformers ``model_type`` that computes ``cfg``: ``mixtral`` with experts,
    ``qwen3`` with ``qk_norm``, ``qwen2`` with q/k/v biases alone, else ``llama`` (its
    ``attention_bias``: q/k/v and output biases).

    Raises: ``ValueError`` for a model none of them computes (an output bias without q/k/v
    ones; biases or q/k norms beside experts; MoE options Mixtral lacks).

    >>> from dtp.models.config import config
    >>> hf_model_type(config("tiny", qkv_bias=True)), hf_model_type(config("tiny", qkv_bias=True, o_bias=True))
    ('qwen2', 'llama')
    """
    check_mixtral(cfg)
    extras = {name: True for name in ("qkv_bias", "o_bias", "qk_norm") if getattr(cfg, name)}
    if cfg.num_experts and extras:
        raise ValueError(f"to_hf: Mixtral's attention has no biases and no q/k norms; this model sets {extras}")
    if cfg.o_bias != cfg.qkv_bias and (cfg.qk_norm or cfg.o_bias):
        raise ValueError(f"to_hf: transformers' Llama and Qwen3 bias q, k, v and the output projection together "
                         f"(attention_bias), Qwen2 q, k and v alone; this model sets qkv_bias={cfg.qkv_bias}, "
                         f"o_bias={cfg.o_bias}")
    return "mixtral" if cfg.num_experts else "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias and not cfg.o_bias \
        else "llama"


def hf_config(cfg: LlamaConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` for transformers (the architecture of
    :func:`hf_model_type`), padding stripped; the rope in both forms (transformers 5's
    ``rope_parameters``, transformers 4's ``rope_theta`` + ``rope_scaling``).

    >>> from dtp.models.config import config
    >>> hf_config(config("tiny"))["architectures"], hf_config(config("tiny", qk_norm=True))["model_type"]
    (['LlamaForCausalLM'], 'qwen3')
    """
    kind = hf_model_type(cfg)
    if dtype not in _DTYPES:
        raise ValueError(f"hf_config: dtype must be one of {_DTYPES}, got {dtype!r}")
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_position_embeddings}
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size - cfg.vocab_pad, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})},
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "dtype": dtype, "torch_dtype": dtype,
    }
    if kind == "mixtral":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                   router_aux_loss_coef=cfg.aux_loss_coeff, sliding_window=None, output_router_logits=False)
    elif kind == "llama":
        out.update(attention_bias=cfg.o_bias, mlp_bias=False)
    else:  # Qwen: full attention in every layer (dtp has no sliding window)
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
        if kind == "qwen3":
            out["attention_bias"] = cfg.o_bias
    return out


