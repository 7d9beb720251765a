"""A functional Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU), written once.

``init(cfg, seed)`` builds the *global* parameters from the seed alone, so every layout
starts from the same values; :func:`param_axes` names each parameter's logical axes; a
layout decides where they live. ``apply`` constrains activations at the block edges
with logical axes and never looks at the parallel configuration — tensor, sequence and
data parallelism are the layout's business, the collectives follow from the placements.

Mixture of experts is configuration (``num_experts > 0``), not a branch on the parallel
setup: block ``i`` is an MoE block when ``i % moe_every == moe_every - 1`` (every block
at ``moe_every=1``; with ``moe_every=2`` blocks 1, 3, … so the first block stays dense,
as in DeepSeek's leading dense layers — Megatron's ``--moe-layer-freq`` pattern is
``i % f == 0`` instead). Its FFN is :func:`dtp.ops.moe.moe_ffn`; the router is kept in
fp32 (fp64 stays fp64). The load-balancing and z losses join the training loss:
:func:`loss` then returns ``(lm loss + aux terms, aux)`` (``aux``: ``lm_loss``,
``aux_loss``, ``z_loss``, ``tokens_per_expert`` per MoE block, ``dropped_fraction``),
which ``train_step`` reports as ``metrics["aux"]``. In :func:`sequential` MoE blocks
carry ``(h, per-block aux)`` to the head, which adds them.

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
from torch.distributed.tensor import DTensor

from ..ops import attention, cross_entropy, embedding, linear, remat, rotary
from ..ops.moe import moe_ffn
from .sequential import Layer, Sequential

__all__ = ["LlamaConfig", "CONFIGS", "config", "init", "param_axes", "axis_sizes", "apply", "loss", "sequential",
           "param_count", "flops_per_token", "is_moe"]


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
    # Mixture of experts (module docstring); num_experts=0 is the dense model.
    num_experts: int = 0  # experts per MoE block; 0: dense
    top_k: int = 2  # experts per token, 1 <= top_k <= num_experts
    moe_every: int = 1  # block i is MoE iff num_experts and i % moe_every == moe_every - 1
    moe_ffn_dim: int | None = None  # each expert's hidden width; None: ffn_dim
    shared_experts: int = 0  # one always-on SwiGLU of width shared_experts × expert width
    capacity_factor: float | None = None  # None: dropless; else ceil(T·k/E·cf) tokens per expert
    pre_softmax: bool = False  # softmax over all experts, then top-k (no renormalisation)
    aux_loss_coeff: float = 1e-2  # switch load-balancing loss coefficient
    z_loss_coeff: float = 0.0  # router z-loss coefficient
    # Aux-loss-free balancing's bias step (DeepSeek-V3). The bias is state that no
    # gradient trains, so it belongs beside the parameters (a non-trainable collection of
    # the train state, updated after each step), not among them where the optimizer would
    # move it. Not wired into training yet: ops.moe.route(bias=...) and update_bias are.
    router_bias_update: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def expert_dim(self) -> int:
        """Each expert's hidden width (``moe_ffn_dim``, else ``ffn_dim``)."""
        return self.ffn_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for rotary embeddings")
        if self.num_experts < 0:
            raise ValueError(f"LlamaConfig: num_experts must be >= 0 (0: dense), got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"LlamaConfig: top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
            if self.moe_every < 1:
                raise ValueError(f"LlamaConfig: moe_every must be >= 1, got {self.moe_every}")
            if self.expert_dim < 1 or self.shared_experts < 0:
                raise ValueError(f"LlamaConfig: moe_ffn_dim must be >= 1 and shared_experts >= 0, got "
                                 f"{self.moe_ffn_dim} and {self.shared_experts}")
            if self.capacity_factor is not None and not self.capacity_factor > 0:
                raise ValueError(f"LlamaConfig: capacity_factor must be None (dropless) or > 0, "
                                 f"got {self.capacity_factor}")
        if self.router_bias_update:
            raise ValueError(f"LlamaConfig: router_bias_update={self.router_bias_update}: aux-loss-free balancing is "
                             f"not wired into training yet; use aux_loss_coeff (dtp.ops.moe.route(bias=...) and "
                             f"update_bias are available as functions)")


# Shapes of the published models (for planning); "tiny" and "small" run on a laptop CPU.
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128),
    "tiny-moe": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, num_experts=4,
                     top_k=2),
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


def is_moe(cfg: LlamaConfig, i: int) -> bool:
    """Whether block ``i`` is an MoE block: ``num_experts`` and ``i % moe_every == moe_every - 1``.

    >>> [is_moe(config("tiny-moe", n_layers=4, moe_every=2), i) for i in range(4)]
    [False, True, False, True]
    """
    return cfg.num_experts > 0 and i % cfg.moe_every == cfg.moe_every - 1


def _layer_axes(cfg: LlamaConfig, i: int) -> dict[str, tuple[str, ...]]:
    axes: dict[str, tuple[str, ...]] = {
        "attn_norm": ("embed",),
        "wq": ("embed", "heads"),  # column parallel: output features are heads × head_dim
        "wk": ("embed", "kv_heads"),
        "wv": ("embed", "kv_heads"),
        "wo": ("heads", "embed"),  # row parallel
        "mlp_norm": ("embed",),
    }
    if not is_moe(cfg, i):
        return {**axes, "w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
    # The router's expert dim has its own logical axis, left replicated: every rank scores
    # every expert for its tokens, wherever the experts themselves live.
    axes.update(router=("embed", "router"), w_gate=("expert", "embed", "expert_mlp"),
                w_up=("expert", "embed", "expert_mlp"), w_down=("expert", "expert_mlp", "embed"))
    if cfg.shared_experts:  # a dense MLP: split like one
        axes.update(shared_gate=("embed", "mlp"), shared_up=("embed", "mlp"), shared_down=("mlp", "embed"))
    return axes


def param_axes(cfg: LlamaConfig) -> dict[str, Any]:
    """Logical axis names of every parameter (same structure as :func:`init`)."""
    axes: dict[str, Any] = {"embed": ("vocab", "embed"), "layers": [_layer_axes(cfg, i) for i in range(cfg.n_layers)],
                            "final_norm": ("embed",)}
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def axis_sizes(cfg: LlamaConfig) -> dict[str, int]:
    """Sizes of the splittable logical axes, in whole units (a head is never cut)."""
    sizes = {"heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "mlp": cfg.ffn_dim, "vocab": cfg.vocab_size}
    if cfg.num_experts:
        sizes.update(expert=cfg.num_experts, expert_mlp=cfg.expert_dim)
    return sizes


def _shapes(cfg: LlamaConfig, i: int) -> dict[str, tuple[int, ...]]:
    hd = cfg.head_dim
    shapes = {
        "attn_norm": (cfg.dim,), "wq": (cfg.dim, cfg.n_heads * hd), "wk": (cfg.dim, cfg.n_kv_heads * hd),
        "wv": (cfg.dim, cfg.n_kv_heads * hd), "wo": (cfg.n_heads * hd, cfg.dim), "mlp_norm": (cfg.dim,),
    }
    if not is_moe(cfg, i):
        return {**shapes, "w_gate": (cfg.dim, cfg.ffn_dim), "w_up": (cfg.dim, cfg.ffn_dim),
                "w_down": (cfg.ffn_dim, cfg.dim)}
    e, f = cfg.num_experts, cfg.expert_dim
    shapes.update(router=(cfg.dim, e), w_gate=(e, cfg.dim, f), w_up=(e, cfg.dim, f), w_down=(e, f, cfg.dim))
    if cfg.shared_experts:
        fs = cfg.shared_experts * f
        shapes.update(shared_gate=(cfg.dim, fs), shared_up=(cfg.dim, fs), shared_down=(fs, cfg.dim))
    return shapes


def init(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None) -> dict[str, Any]:
    """Global parameters from ``seed`` alone: the same values under every layout.

    Normal(0, 0.02) weights, output projections scaled by 1/√(2·n_layers) (GPT-2 /
    Megatron), norms at one. An MoE router is kept in fp32 (fp64 stays fp64).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)

    def normal(shape: tuple[int, ...], s: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * s).to(dtype=dtype, device=device)

    def ones(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype, device=device)

    params: dict[str, Any] = {"embed": normal((cfg.vocab_size, cfg.dim), std), "layers": []}
    for i in range(cfg.n_layers):
        layer = {}
        for name, shape in _shapes(cfg, i).items():
            layer[name] = ones(shape) if name.endswith("norm") else normal(
                shape, out_std if name in ("wo", "w_down", "shared_down") else std)
        if "router" in layer:
            layer["router"] = layer["router"].to(accum_dtype(dtype))
        params["layers"].append(layer)
    params["final_norm"] = ones((cfg.dim,))
    if not cfg.tie_embeddings:
        params["lm_head"] = normal((cfg.dim, cfg.vocab_size), std)
    return params


def _count(cfg: LlamaConfig, active: bool) -> int:
    # active: an MoE block's experts count top_k / num_experts of theirs (what a token uses)
    per_layer = 0
    for i in range(cfg.n_layers):
        for name, shape in _shapes(cfg, i).items():
            n = math.prod(shape)
            per_layer += n * cfg.top_k // cfg.num_experts if active and len(shape) == 3 else n
    head = 0 if cfg.tie_embeddings else cfg.dim * cfg.vocab_size
    return cfg.vocab_size * cfg.dim + per_layer + cfg.dim + head


def param_count(cfg: LlamaConfig) -> int:
    """Number of parameters (every expert's)."""
    return _count(cfg, active=False)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 × matmul parameters + causal attention (PaLM's count);
    an MoE block's experts count top_k of num_experts (the router counts whole)."""
    matmul = _count(cfg, active=True) - cfg.vocab_size * cfg.dim * (0 if cfg.tie_embeddings else 1) - (2 * cfg.n_layers + 1) * cfg.dim
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


def _block(layer: dict[str, torch.Tensor], h: torch.Tensor, cfg: LlamaConfig) -> Any:
    """The new residual stream; an MoE block (its parameters have a ``router``) returns
    ``(h, aux)`` with its :func:`~dtp.ops.moe.moe_ffn` aux."""
    # Entering a block: the residual stream (split on sequence under SP) is gathered;
    # leaving it: the row-parallel pending sum is reduced back onto the residual layout.
    x = constrain(_rms_norm(h, layer["attn_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="attn_in")
    h = h + constrain(_attention(layer, x, cfg), ("batch", "res_seq", "embed"), name="attn_out")
    x = constrain(_rms_norm(h, layer["mlp_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="mlp_in")
    if "router" not in layer:
        return h + constrain(_mlp(layer, x), ("batch", "res_seq", "embed"), name="mlp_out")
    y, aux = moe_ffn(layer, x, top_k=cfg.top_k, pre_softmax=cfg.pre_softmax, capacity_factor=cfg.capacity_factor,
                     aux_loss_coeff=cfg.aux_loss_coeff, z_loss_coeff=cfg.z_loss_coeff)
    return h + constrain(y, ("batch", "res_seq", "embed"), name="mlp_out"), aux


def _run_block(layer: dict[str, torch.Tensor], x: Any, cfg: LlamaConfig) -> Any:
    """One block on the carry: ``h``, or ``(h, auxes)`` once an MoE block has run."""
    h, auxes = x if isinstance(x, tuple) else (x, ())
    out = remat(_block, layer, h, cfg, level="full")
    if isinstance(out, tuple):
        return out[0], auxes + (out[1],)
    return (out, auxes) if auxes else out


def _with_aux(lm_loss: torch.Tensor, auxes: tuple[dict[str, torch.Tensor], ...]) -> Any:
    """The dense loss as is; with MoE blocks ``(lm + Σ aux_loss + Σ z_loss, aux metrics)``."""
    if not auxes:
        return lm_loss
    aux_loss, z = auxes[0]["aux_loss"], auxes[0]["z_loss"]
    for a in auxes[1:]:
        aux_loss, z = aux_loss + a["aux_loss"], z + a["z_loss"]

    def plain(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach()

    metrics = {
        "lm_loss": plain(lm_loss), "aux_loss": plain(aux_loss), "z_loss": plain(z),
        "tokens_per_expert": torch.stack([plain(a["tokens_per_expert"]) for a in auxes]).round().to(torch.int64),
        "dropped_fraction": torch.stack([plain(a["dropped_fraction"]) for a in auxes]),
    }
    return lm_loss + aux_loss + z, metrics


def _embed(params: dict[str, Any], x: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return constrain(embedding(params["embed"], batch["tokens"]), ("batch", "res_seq", "embed"), name="embed_out")


def _logits(params: dict[str, Any], h: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    x = constrain(_rms_norm(h, params["final_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="head_in")
    head = params["embed"].transpose(0, 1) if cfg.tie_embeddings else params["lm_head"]
    return constrain(linear(x, head), ("batch", "seq", "vocab"), name="logits")


def _forward(params: dict[str, Any], tokens: torch.Tensor, cfg: LlamaConfig) -> tuple[torch.Tensor, tuple]:
    x = _embed(params, None, {"tokens": tokens})
    for layer in params["layers"]:
        x = _run_block(layer, x, cfg)
    h, auxes = x if isinstance(x, tuple) else (x, ())
    return _logits(params, h, cfg), auxes


def apply(params: dict[str, Any], tokens: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """Logits (batch, seq, vocab) for ``tokens`` (batch, seq) (MoE aux losses dropped)."""
    return _forward(params, tokens, cfg)[0]


def loss(params: dict[str, Any], batch: dict[str, torch.Tensor], cfg: LlamaConfig) -> Any:
    """Mean next-token cross-entropy; ``batch`` has ``tokens`` and ``targets`` (batch, seq).

    With MoE blocks: ``(cross-entropy + Σ aux_loss + Σ z_loss, aux)``; ``aux`` holds
    ``lm_loss``, ``aux_loss``, ``z_loss`` (detached scalars), ``tokens_per_expert``
    (int64, one row per MoE block) and ``dropped_fraction`` (one per MoE block).
    """
    logits, auxes = _forward(params, batch["tokens"], cfg)
    return _with_aux(cross_entropy(logits, batch["targets"]), auxes)


def sequential(cfg: LlamaConfig) -> Sequential:
    """The model as a sequence of layers — embedding | each block | final norm + head +
    loss — what ``layouts.pipeline`` splits into stages (each counts as one layer). Called
    as ``loss_fn(params, batch)`` it equals :func:`loss`. With ``tie_embeddings`` the
    first and the last layer both read ``embed``. With MoE blocks the carry after the
    first of them is ``(h, auxes)`` and the head returns ``(loss, aux)`` as :func:`loss`;
    ``layouts.pipeline`` sends one tensor between stages, so it refuses MoE models
    (``carry="tree"``) before any collective, until the carry can travel.

    >>> cfg = config("tiny")
    >>> [layer.name for layer in sequential(cfg).layers]
    ['embed', 'block 0', 'block 1', 'head']
    """
    def block(i: int):
        return lambda p, x, b: _run_block(p["layers"][i], x, cfg)

    def last(p: dict[str, Any], x: Any, b: dict[str, torch.Tensor]) -> Any:
        h, auxes = x if isinstance(x, tuple) else (x, ())
        return _with_aux(cross_entropy(_logits(p, h, cfg), b["targets"]), auxes)

    head = ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")
    return Sequential([Layer(_embed, ("embed",), "embed"),
                       *(Layer(block(i), (f"layers.{i}",), f"block {i}") for i in range(cfg.n_layers)),
                       Layer(last, head, "head")], carry="tree" if cfg.num_experts else "tensor")
