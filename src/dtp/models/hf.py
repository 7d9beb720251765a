"""Hugging Face Llama and Mixtral checkpoints in and out: :func:`from_hf`, :func:`to_hf`.

dtp's Llama is Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotate-half RoPE, GQA,
SwiGLU) and, with ``num_experts``, ``MixtralForCausalLM`` (Mixtral's router takes a
softmax over all experts, the top k, and renormalises: the same weights as dtp's top-k
of the logits then a softmax over the k). The weights differ only in orientation: a
``torch.nn.Linear`` stores (out, in), dtp's :func:`dtp.ops.linear` takes (in, out).

=====================================================  ==========================
Hugging Face (``model.layers.{i}.`` omitted)            dtp (``layers[i]``)
=====================================================  ==========================
``model.embed_tokens.weight`` (V, D)                    ``embed`` (V, D)
``input_layernorm`` / ``post_attention_layernorm``      ``attn_norm`` / ``mlp_norm``
``self_attn.{q,k,v,o}_proj.weight``                     ``wq``, ``wk``, ``wv``, ``wo`` transposed
``mlp.{gate,up,down}_proj.weight``                      ``w_gate``, ``w_up``, ``w_down`` transposed
``block_sparse_moe.gate.weight`` (E, D)                 ``router`` (D, E)
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``      ``w_gate[e]``, ``w_up[e]``, ``w_down[e]`` transposed
``model.norm.weight``, ``lm_head.weight`` (V, D)        ``final_norm``, ``lm_head`` (D, V)
=====================================================  ==========================

Mixtral's experts are read and written per expert, as they are stored on disk
(transformers 5 fuses them into ``gate_up_proj`` only after loading).

**Vocabulary padding.** ``vocab_multiple=m`` pads the vocabulary to a multiple of ``m``
(Megatron's ``--make-vocab-size-divisible-by``, which pads to a multiple of itself × tp)
with zero rows, recorded as ``cfg.vocab_pad``: the model pins those logits to the
dtype's lowest value (:func:`dtp.ops.mask_padded_vocab`), so they never win an argmax,
add 0 to every softmax (the loss is the unpadded model's) and get zero gradients.
:func:`to_hf` strips them again.

Needs ``safetensors`` to read (``pip install 'dtp[hf]'``); writing needs no package.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .._rules import accum_dtype
from ._safetensors_files import Entry, open_weights, write_sharded
from .config import LlamaConfig, RopeScaling, block_shapes, is_moe

__all__ = ["from_hf", "to_hf", "config_from_hf", "hf_config", "padded_vocab"]

_ATTN = (("input_layernorm.weight", "attn_norm", False), ("self_attn.q_proj.weight", "wq", True),
         ("self_attn.k_proj.weight", "wk", True), ("self_attn.v_proj.weight", "wv", True),
         ("self_attn.o_proj.weight", "wo", True), ("post_attention_layernorm.weight", "mlp_norm", False))
_MLP = (("mlp.gate_proj.weight", "w_gate"), ("mlp.up_proj.weight", "w_up"), ("mlp.down_proj.weight", "w_down"))
_EXPERT = (("w1", "w_gate"), ("w3", "w_up"), ("w2", "w_down"))
_MODEL_TYPES = ("llama", "mistral", "mixtral")
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16"}


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
    its directory): Llama, Mistral (a ``sliding_window`` caps ``max_seq_len``: within it
    attention is plain causal) or Mixtral.

    Raises: ``ValueError`` for what dtp's Llama does not compute (biases, another
    activation, another rope type).

    >>> config_from_hf({"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
    ...     "num_hidden_layers": 2, "num_attention_heads": 4}, vocab_multiple=128).vocab_pad
    84
    """
    if not isinstance(hf, dict):
        file = Path(hf)
        hf = json.loads((file / "config.json" if file.is_dir() else file).read_text())
    kind = hf.get("model_type")
    if kind not in _MODEL_TYPES:
        raise ValueError(f"from_hf: model_type {kind!r} is not supported; choose one of {_MODEL_TYPES}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"from_hf: {flag}=true is not supported (dtp's Llama has no biases)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"from_hf: hidden_act must be 'silu', got {hf['hidden_act']!r}")
    theta, scaling = _rope(hf)
    vocab = int(hf["vocab_size"])
    max_len = int(hf.get("max_position_embeddings", 2048))
    if hf.get("sliding_window"):
        max_len = min(max_len, int(hf["sliding_window"]))
    heads = int(hf["num_attention_heads"])
    fields: dict[str, Any] = dict(
        vocab_size=padded_vocab(vocab, vocab_multiple), vocab_pad=padded_vocab(vocab, vocab_multiple) - vocab,
        dim=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]), n_heads=heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or heads), ffn_dim=int(hf["intermediate_size"]),
        max_seq_len=max_len, rope_theta=theta, rope_scaling=scaling, norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), head_dim=hf.get("head_dim"))
    if kind == "mixtral":
        fields.update(num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                      aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01)))
    return LlamaConfig(**fields)


def _check_mixtral(cfg: LlamaConfig) -> None:
    if not cfg.num_experts:
        return
    odd = {name: value for name, value in [("moe_every", cfg.moe_every), ("shared_experts", cfg.shared_experts),
                                          ("pre_softmax", cfg.pre_softmax), ("capacity_factor", cfg.capacity_factor),
                                          ("moe_ffn_dim", cfg.moe_ffn_dim)]
           if value not in (None, 0, False) and not (name == "moe_every" and value == 1)}
    if odd:
        raise ValueError(f"to_hf: Mixtral has MoE in every block, no shared experts, top-k-then-softmax routing, "
                         f"no capacity and one FFN width; this model sets {odd}")


def hf_config(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` for transformers (``LlamaForCausalLM``, or
    ``MixtralForCausalLM`` with experts), padding stripped; the rope in both forms
    (transformers 5's ``rope_parameters``, transformers 4's ``rope_theta`` +
    ``rope_scaling``).

    >>> from dtp.models.config import config
    >>> hf_config(config("tiny"))["architectures"]
    ['LlamaForCausalLM']
    """
    _check_mixtral(cfg)
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                   "high_freq_factor": s.high_freq_factor,
                   "original_max_position_embeddings": s.original_max_position_embeddings}
    moe = cfg.num_experts > 0
    out: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "vocab_size": cfg.vocab_size - cfg.vocab_pad, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta, **(scaling or {})},
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
    }
    if moe:
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k,
                   router_aux_loss_coef=cfg.aux_loss_coeff, sliding_window=None, output_router_logits=False)
    else:
        out.update(attention_bias=False, mlp_bias=False)
    return out


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"from_hf: {name} has shape {tuple(t.shape)}, config.json implies {shape}")
    return t


def from_hf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
            vocab_multiple: int = 1) -> tuple[LlamaConfig, dict[str, Any]]:
    """``(cfg, params)`` of a local Hugging Face Llama / Mistral / Mixtral directory
    (``config.json``; ``*.safetensors`` with or without ``model.safetensors.index.json``):
    global tensors in ``dtype`` (an MoE router in fp32, fp64 in fp64), ready for
    ``TrainState.create``. Reads one tensor at a time, memory-mapped.

    - `dtype`: the parameters' dtype, default fp32.
    - `vocab_multiple`: pad the vocabulary to a multiple of it (module docstring), default 1.

    Raises: ``ValueError`` for an unsupported config or a tensor of the wrong shape;
    ``KeyError`` for a missing tensor; ``ImportError`` without ``safetensors``.
    """
    cfg = config_from_hf(path, vocab_multiple)
    vocab = cfg.vocab_size - cfg.vocab_pad

    def convert(t: torch.Tensor, transpose: bool, to: torch.dtype = dtype) -> torch.Tensor:
        return (t.T if transpose else t).to(to).contiguous()

    def padded(t: torch.Tensor) -> torch.Tensor:  # (V, D) rows -> (V + pad, D), zeros below
        _check_shape("the embedding", t, (vocab, cfg.dim))
        out = torch.zeros(cfg.vocab_size, cfg.dim, dtype=dtype)
        out[:vocab] = t
        return out

    with open_weights(path) as get:
        params: dict[str, Any] = {"embed": padded(get("model.embed_tokens.weight")), "layers": []}
        for i in range(cfg.n_layers):
            shapes, pre = block_shapes(cfg, i), f"model.layers.{i}."
            layer = {ours: _check_shape(pre + hf, convert(get(pre + hf), t), shapes[ours]) for hf, ours, t in _ATTN}
            if not is_moe(cfg, i):
                layer.update((ours, _check_shape(pre + hf, convert(get(pre + hf), True), shapes[ours]))
                             for hf, ours in _MLP)
            else:
                moe = pre + "block_sparse_moe."
                router = convert(get(moe + "gate.weight"), True, accum_dtype(dtype))
                layer["router"] = _check_shape(moe + "gate.weight", router, shapes["router"])
                for hf, ours in _EXPERT:
                    stacked = torch.empty(shapes[ours], dtype=dtype)
                    for e in range(cfg.num_experts):
                        key = f"{moe}experts.{e}.{hf}.weight"
                        stacked[e] = _check_shape(key, convert(get(key), True), shapes[ours][1:])
                    layer[ours] = stacked
            params["layers"].append(layer)
        params["final_norm"] = _check_shape("model.norm.weight", get("model.norm.weight").to(dtype), (cfg.dim,))
        if not cfg.tie_embeddings:
            params["lm_head"] = padded(get("lm_head.weight")).T.contiguous()
    return cfg, params


def _plain(name: str, x: Any) -> torch.Tensor:
    if isinstance(x, DTensor):
        raise TypeError(f"to_hf: {name} is a DTensor; pass whole tensors (a one-process state, or "
                        f"checkpoint.load under a one-rank mesh)")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_hf: {name} must be a tensor, got {type(x).__name__}")
    return x


def to_hf(cfg: LlamaConfig, params: dict[str, Any], path: str | os.PathLike[str], *,
          dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write ``params`` (global tensors, as :func:`from_hf` returns or ``init`` builds) as
    a Hugging Face directory: ``config.json`` (:func:`hf_config`) and sharded
    ``.safetensors`` files with their index (one ``model.safetensors`` when they fit),
    one tensor at a time, vocabulary padding stripped. Returns the weight files.

    - `dtype`: the dtype written (default: the embedding's).
    - `max_shard_bytes`: the most bytes per file (transformers' default, 5 GiB).

    Raises: ``TypeError`` for DTensor leaves; ``ValueError`` for an MoE model Mixtral
    cannot express.

    >>> import tempfile
    >>> from dtp.models import llama
    >>> cfg = llama.config("tiny", n_layers=1)
    >>> [f.name for f in to_hf(cfg, llama.init(cfg), tempfile.mkdtemp())]
    ['model.safetensors']
    """
    _check_mixtral(cfg)
    dtype = dtype or _plain("embed", params["embed"]).dtype
    vocab = cfg.vocab_size - cfg.vocab_pad

    def entry(name: str, get: Any, transpose: bool, shape: tuple[int, ...]) -> Entry:
        def make() -> torch.Tensor:
            t = get()
            return (t.T if transpose else t).to(dtype).contiguous()
        return Entry(name, shape, dtype, make)

    def leaf(*path: Any) -> Any:
        def get() -> torch.Tensor:
            x: Any = params
            for p in path:
                x = x[p]
            return _plain(".".join(map(str, path)), x)
        return get

    entries = [entry("model.embed_tokens.weight", lambda: leaf("embed")()[:vocab], False, (vocab, cfg.dim))]
    for i in range(cfg.n_layers):
        shapes, pre = block_shapes(cfg, i), f"model.layers.{i}."
        for hf, ours, t in _ATTN:
            entries.append(entry(pre + hf, leaf("layers", i, ours), t, shapes[ours][::-1] if t else shapes[ours]))
        if not is_moe(cfg, i):
            entries += [entry(pre + hf, leaf("layers", i, ours), True, shapes[ours][::-1]) for hf, ours in _MLP]
            continue
        moe = pre + "block_sparse_moe."
        entries.append(entry(moe + "gate.weight", leaf("layers", i, "router"), True, shapes["router"][::-1]))
        for e in range(cfg.num_experts):
            entries += [entry(f"{moe}experts.{e}.{hf}.weight", leaf("layers", i, ours, e), True,
                              shapes[ours][1:][::-1]) for hf, ours in _EXPERT]
    entries.append(entry("model.norm.weight", leaf("final_norm"), False, (cfg.dim,)))
    if not cfg.tie_embeddings:
        entries.append(entry("lm_head.weight", lambda: leaf("lm_head")()[:, :vocab], True, (vocab, cfg.dim)))
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(hf_config(cfg, dtype), indent=2) + "\n")
    return write_sharded(root, entries, max_shard_bytes)
