"""A functional Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU), written once.

``init(cfg, seed)`` builds the *global* parameters from the seed alone, so every layout
starts from the same values; :func:`param_axes` names each parameter's logical axes; a
layout decides where they live. ``apply`` constrains activations at the block edges
with logical axes and never looks at the parallel configuration — tensor, sequence and
data parallelism are the layout's business, the collectives follow from the placements.

>>> cfg = config("tiny")
>>> params = init(cfg, seed=0)
>>> batch = {"tokens": torch.zeros(2, 16, dtype=torch.long), "targets": torch.zeros(2, 16, dtype=torch.long)}
>>> loss(params, batch, cfg).shape
torch.Size([])
"""

from __future__ import annotations

from .._rules import accum_dtype
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..layouts import constrain
from ..ops import attention, cross_entropy, embedding, linear, remat, rotary
from .sequential import Layer, Sequential

__all__ = ["LlamaConfig", "CONFIGS", "config", "init", "param_axes", "axis_sizes", "apply", "loss", "sequential",
           "param_count", "flops_per_token"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for rotary embeddings")


# Shapes of the published models (for planning); "tiny" and "small" run on a laptop CPU.
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "small": dict(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=768),
    "1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
               rope_theta=500000.0, tie_embeddings=True, max_seq_len=8192),
    "llama2-7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
                      max_seq_len=4096),
    "llama2-13b": dict(vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                       max_seq_len=4096),
    "llama2-70b": dict(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       max_seq_len=4096),
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      rope_theta=500000.0, max_seq_len=8192),
    "llama3-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       rope_theta=500000.0, max_seq_len=8192),
}


def config(name: str = "tiny", **overrides: Any) -> LlamaConfig:
    """A named configuration with field overrides.

    >>> config("tiny", n_layers=1).n_layers
    1
    """
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(CONFIGS)}")
    return LlamaConfig(**{**CONFIGS[name], **overrides})


def _layer_axes() -> dict[str, tuple[str, ...]]:
    return {
        "attn_norm": ("embed",),
        "wq": ("embed", "heads"),  # column parallel: output features are heads × head_dim
        "wk": ("embed", "kv_heads"),
        "wv": ("embed", "kv_heads"),
        "wo": ("heads", "embed"),  # row parallel
        "mlp_norm": ("embed",),
        "w_gate": ("embed", "mlp"),
        "w_up": ("embed", "mlp"),
        "w_down": ("mlp", "embed"),
    }


def param_axes(cfg: LlamaConfig) -> dict[str, Any]:
    """Logical axis names of every parameter (same structure as :func:`init`)."""
    axes: dict[str, Any] = {"embed": ("vocab", "embed"), "layers": [_layer_axes() for _ in range(cfg.n_layers)],
                            "final_norm": ("embed",)}
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def axis_sizes(cfg: LlamaConfig) -> dict[str, int]:
    """Sizes of the splittable logical axes, in whole units (a head is never cut)."""
    return {"heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "mlp": cfg.ffn_dim, "vocab": cfg.vocab_size}


def _shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    hd = cfg.head_dim
    return {
        "attn_norm": (cfg.dim,), "wq": (cfg.dim, cfg.n_heads * hd), "wk": (cfg.dim, cfg.n_kv_heads * hd),
        "wv": (cfg.dim, cfg.n_kv_heads * hd), "wo": (cfg.n_heads * hd, cfg.dim), "mlp_norm": (cfg.dim,),
        "w_gate": (cfg.dim, cfg.ffn_dim), "w_up": (cfg.dim, cfg.ffn_dim), "w_down": (cfg.ffn_dim, cfg.dim),
    }


def init(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None) -> dict[str, Any]:
    """Global parameters from ``seed`` alone: the same values under every layout.

    Normal(0, 0.02) weights, output projections scaled by 1/√(2·n_layers) (GPT-2 /
    Megatron), norms at one.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)

    def normal(shape: tuple[int, ...], s: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * s).to(dtype=dtype, device=device)

    def ones(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype, device=device)

    params: dict[str, Any] = {"embed": normal((cfg.vocab_size, cfg.dim), std), "layers": []}
    for _ in range(cfg.n_layers):
        layer = {}
        for name, shape in _shapes(cfg).items():
            layer[name] = ones(shape) if name.endswith("norm") else normal(shape, out_std if name in ("wo", "w_down") else std)
        params["layers"].append(layer)
    params["final_norm"] = ones((cfg.dim,))
    if not cfg.tie_embeddings:
        params["lm_head"] = normal((cfg.dim, cfg.vocab_size), std)
    return params


def param_count(cfg: LlamaConfig) -> int:
    """Number of parameters."""
    per_layer = sum(math.prod(s) for s in _shapes(cfg).values())
    head = 0 if cfg.tie_embeddings else cfg.dim * cfg.vocab_size
    return cfg.vocab_size * cfg.dim + cfg.n_layers * per_layer + cfg.dim + head


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 × matmul parameters + causal attention (PaLM's count)."""
    matmul = param_count(cfg) - cfg.vocab_size * cfg.dim * (0 if cfg.tie_embeddings else 1) - (2 * cfg.n_layers + 1) * cfg.dim
    attn = 6 * cfg.n_layers * cfg.dim * seq_len  # 12·L·d·s / 2 for the causal half
    return 6 * matmul + attn


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    acc = accum_dtype(x.dtype)
    xf = x.to(acc)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _attention(layer: dict[str, torch.Tensor], x: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    b, s, hd = x.shape[0], x.shape[1], cfg.head_dim
    q = rotary(linear(x, layer["wq"]).view(b, s, cfg.n_heads, hd), cfg.rope_theta).transpose(1, 2)
    k = rotary(linear(x, layer["wk"]).view(b, s, cfg.n_kv_heads, hd), cfg.rope_theta).transpose(1, 2)
    v = linear(x, layer["wv"]).view(b, s, cfg.n_kv_heads, hd).transpose(1, 2)
    q = constrain(q, ("batch", "heads", "seq", "head_dim"), name="q")
    k = constrain(k, ("batch", "kv_heads", "seq", "head_dim"), name="k")
    v = constrain(v, ("batch", "kv_heads", "seq", "head_dim"), name="v")
    o = attention(q, k, v, causal=True).transpose(1, 2).reshape(b, s, cfg.n_heads * hd)
    return linear(o, layer["wo"])  # row parallel: a pending sum over the heads' axes


def _mlp(layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, layer["w_gate"])) * linear(x, layer["w_up"]), layer["w_down"])


def _block(layer: dict[str, torch.Tensor], h: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    # Entering a block: the residual stream (split on sequence under SP) is gathered;
    # leaving it: the row-parallel pending sum is reduced back onto the residual layout.
    x = constrain(_rms_norm(h, layer["attn_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="attn_in")
    h = h + constrain(_attention(layer, x, cfg), ("batch", "res_seq", "embed"), name="attn_out")
    x = constrain(_rms_norm(h, layer["mlp_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="mlp_in")
    return h + constrain(_mlp(layer, x), ("batch", "res_seq", "embed"), name="mlp_out")


def _embed(params: dict[str, Any], x: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return constrain(embedding(params["embed"], batch["tokens"]), ("batch", "res_seq", "embed"), name="embed_out")


def _logits(params: dict[str, Any], h: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    x = constrain(_rms_norm(h, params["final_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="head_in")
    head = params["embed"].transpose(0, 1) if cfg.tie_embeddings else params["lm_head"]
    return constrain(linear(x, head), ("batch", "seq", "vocab"), name="logits")


def apply(params: dict[str, Any], tokens: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """Logits (batch, seq, vocab) for ``tokens`` (batch, seq)."""
    h = _embed(params, None, {"tokens": tokens})
    for layer in params["layers"]:
        h = remat(_block, layer, h, cfg, level="full")
    return _logits(params, h, cfg)


def loss(params: dict[str, Any], batch: dict[str, torch.Tensor], cfg: LlamaConfig) -> torch.Tensor:
    """Mean next-token cross-entropy; ``batch`` has ``tokens`` and ``targets`` (batch, seq)."""
    return cross_entropy(apply(params, batch["tokens"], cfg), batch["targets"])


def sequential(cfg: LlamaConfig) -> Sequential:
    """The model as a sequence of layers — embedding | each block | final norm + head +
    loss — what ``layouts.pipeline`` splits into stages (each counts as one layer). Called
    as ``loss_fn(params, batch)`` it equals :func:`loss`. With ``tie_embeddings`` the
    first and the last layer both read ``embed``.

    >>> cfg = config("tiny")
    >>> [layer.name for layer in sequential(cfg).layers]
    ['embed', 'block 0', 'block 1', 'head']
    """
    def block(i: int):
        return lambda p, h, b: remat(_block, p["layers"][i], h, cfg, level="full")

    head = ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")
    return Sequential([Layer(_embed, ("embed",), "embed"),
                       *(Layer(block(i), (f"layers.{i}",), f"block {i}") for i in range(cfg.n_layers)),
                       Layer(lambda p, h, b: cross_entropy(_logits(p, h, cfg), b["targets"]), head, "head")])
