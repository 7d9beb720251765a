"""The Llama configuration: the :class:`LlamaConfig` dataclass, the named presets, and
what follows from a configuration alone (logical axes and their sizes, parameter and FLOP
counts) — no torch, so ``dtp train`` checks a model against a layout before importing it.

:mod:`dtp.models.llama` re-exports every name here; import them from there.

>>> config("tiny").head_dim, param_count(config("tiny"))
(16, 106816)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..core._rules import SCORE_FUNCTIONS, check_groups, said, setting

__all__ = ["LlamaConfig", "RopeScaling", "MLPS", "CONFIGS", "config", "block_shapes", "param_shapes",
           "param_axes", "axis_sizes", "param_count", "flops_per_token", "is_moe", "n_sequential_layers",
           "named"]

#: The dense MLPs a block may have (LlamaConfig.mlp).
MLPS = ("swiglu", "gelu")

# How LlamaConfig's checks name its fields: as themselves, or in a caller's words (named()).
_NAMES: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("dtp_model_names", default=None)


@contextlib.contextmanager
def named(names: Mapping[str, str]) -> Iterator[None]:
    """Within, :class:`LlamaConfig`'s checks name the fields of ``names`` in its words
    (``dtp train``'s flags for the ones it sets: ``--top-k``, not ``top_k``).

    >>> with named({"top_k": "--top-k", "num_experts": "--num-experts"}):
    ...     config("tiny-moe", top_k=5)
    Traceback (most recent call last):
    ...
    ValueError: LlamaConfig: --top-k must be in [1, --num-experts 4], got 5
    """
    token = _NAMES.set(names)
    try:
        yield
    finally:
        _NAMES.reset(token)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face's ``rope_type: "llama3"``):
    wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, shorter than ``.../ high_freq_factor`` kept, and the band
    between interpolated smoothly.

    >>> RopeScaling(factor=8.0).as_tuple()
    (8.0, 1.0, 4.0, 8192)
    """

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not (self.factor > 0 and self.high_freq_factor > self.low_freq_factor > 0
                and self.original_max_position_embeddings > 0):
            raise ValueError(f"RopeScaling: needs factor > 0, high_freq_factor > low_freq_factor > 0 and "
                             f"original_max_position_embeddings > 0, got {self}")

    def as_tuple(self) -> tuple[float, float, float, int]:
        """(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
        what :func:`dtp.ops.rotary` takes as ``scaling``."""
        return (self.factor, self.low_freq_factor, self.high_freq_factor, self.original_max_position_embeddings)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256  # rows of the embedding, vocab_pad included
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    # None: dim // n_heads, filled in when built (so dataclasses.replace keeps it: give
    # head_dim=None again when changing dim or n_heads).
    head_dim: int | None = None
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    # Rows at the end of the vocabulary no token uses, so that it splits over tp
    # (Megatron's --make-vocab-size-divisible-by). Their logits are the dtype's lowest
    # value: never the argmax, exp() of them is 0, so the loss is the unpadded model's.
    vocab_pad: int = 0
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
    # DeepSeek-V3's router (dtp.ops.moe_router): "sigmoid" scores, the k chosen normalised;
    # group-limited routing (n_groups groups of experts, topk_group picked per token);
    # the k weights times routed_scaling_factor (None: 1).
    router_score: str = "softmax"
    n_groups: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    # Aux-loss-free balancing (DeepSeek-V3): after each step every MoE block's selection
    # bias moves by rate·sign(mean load − load). The bias is state no gradient trains: it
    # lives in TrainState.buffers (init_buffers), not among the parameters. 0: no bias.
    router_bias_update: float = 0.0
    # Attention extras of the Hugging Face families (dtp.models.hf): biases on the q/k/v
    # projections (Qwen2), on the output projection too (Llama's attention_bias), and an
    # RMSNorm over each head's q and k before RoPE (Qwen3). Biases start at zero.
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # The dense MLP: "swiglu" (Llama's three matrices w_gate, w_up, w_down) or "gelu"
    # (GPT's two: w_up dim -> ffn_dim, GELU, w_down ffn_dim -> dim; GPT's ffn_dim is 4·dim).
    mlp: str = "swiglu"

    @property
    def expert_dim(self) -> int:
        """Each expert's hidden width (``moe_ffn_dim``, else ``ffn_dim``)."""
        return self.ffn_dim if self.moe_ffn_dim is None else self.moe_ffn_dim

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # as read back from TOML / JSON
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"LlamaConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                                 f"give head_dim")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim < 1:
            raise ValueError(f"LlamaConfig: head_dim must be >= 1, got {self.head_dim}")
        if not 0 <= self.vocab_pad < self.vocab_size:
            raise ValueError(f"LlamaConfig: vocab_pad must be in [0, vocab_size={self.vocab_size}), "
                             f"got {self.vocab_pad}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even for rotary embeddings")
        n = _NAMES.get()
        if self.mlp not in MLPS:
            raise ValueError(f"LlamaConfig: {said(n, 'mlp')} must be one of {MLPS}, got {self.mlp!r}")
        if self.mlp != "swiglu" and self.num_experts:  # the experts' kernels (dtp.ops.moe) are SwiGLU's
            raise ValueError(f"LlamaConfig: {setting(n, 'mlp', self.mlp)} is a dense MLP; MoE experts are SwiGLU "
                             f"({setting(n, 'num_experts', self.num_experts)})")
        if self.num_experts < 0:
            raise ValueError(f"LlamaConfig: {said(n, 'num_experts')} must be >= 0 (0: dense), got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.top_k <= self.num_experts:
                raise ValueError(f"LlamaConfig: {said(n, 'top_k')} must be in [1, "
                                 f"{setting(n, 'num_experts', self.num_experts)}], got {self.top_k}")
            if self.moe_every < 1:
                raise ValueError(f"LlamaConfig: moe_every must be >= 1, got {self.moe_every}")
            if self.expert_dim < 1 or self.shared_experts < 0:
                raise ValueError(f"LlamaConfig: moe_ffn_dim must be >= 1 and shared_experts >= 0, got "
                                 f"{self.moe_ffn_dim} and {self.shared_experts}")
            if self.capacity_factor is not None and not self.capacity_factor > 0:
                raise ValueError(f"LlamaConfig: {said(n, 'capacity_factor')} must be None (dropless) or > 0, "
                                 f"got {self.capacity_factor}")
            if self.router_score not in SCORE_FUNCTIONS:
                raise ValueError(f"LlamaConfig: {said(n, 'router_score')} must be one of {SCORE_FUNCTIONS}, got "
                                 f"{self.router_score!r}")
            if self.pre_softmax and self.router_score != "softmax":
                raise ValueError(f"LlamaConfig: pre_softmax is a softmax option; "
                                 f"{setting(n, 'router_score', self.router_score)}")
            check_groups(self.num_experts, self.top_k, self.n_groups, self.topk_group, what="LlamaConfig", names=n)
            if self.routed_scaling_factor is not None and not self.routed_scaling_factor > 0:
                raise ValueError(f"LlamaConfig: {said(n, 'routed_scaling_factor')} must be None or > 0, "
                                 f"got {self.routed_scaling_factor}")
        if not self.router_bias_update >= 0:
            raise ValueError(f"LlamaConfig: {said(n, 'router_bias_update')} must be >= 0 (0: no bias), got "
                             f"{self.router_bias_update}")
        if self.router_bias_update and not self.num_experts:
            raise ValueError(f"LlamaConfig: {setting(n, 'router_bias_update', self.router_bias_update)} balances MoE "
                             f"experts; the model has {setting(n, 'num_experts', 0)}")


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


def _attention_axes(cfg: LlamaConfig) -> dict[str, tuple[str, ...]]:
    """A block's attention parameters (and its norms), in the order the block reads them."""
    axes: dict[str, tuple[str, ...]] = {
        "attn_norm": ("embed",),
        "wq": ("embed", "heads"),  # column parallel: output features are heads × head_dim
        "wk": ("embed", "kv_heads"),
        "wv": ("embed", "kv_heads"),
    }
    if cfg.qkv_bias:  # a bias is split as its weight's output features: each rank adds its heads'
        axes.update(q_bias=("heads",), k_bias=("kv_heads",), v_bias=("kv_heads",))
    if cfg.qk_norm:  # over head_dim, which no layout splits
        axes.update(q_norm=("head_dim",), k_norm=("head_dim",))
    axes["wo"] = ("heads", "embed")  # row parallel
    if cfg.o_bias:  # added to the reduced output: laid out as the residual stream's features
        axes["o_bias"] = ("embed",)
    axes["mlp_norm"] = ("embed",)
    return axes


def _layer_axes(cfg: LlamaConfig, i: int) -> dict[str, tuple[str, ...]]:
    axes = _attention_axes(cfg)
    if not is_moe(cfg, i):
        gate = {"w_gate": ("embed", "mlp")} if cfg.mlp == "swiglu" else {}  # GELU has no gate
        return {**axes, **gate, "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
    # The router's expert dim has its own logical axis, left replicated: every rank scores
    # every expert for its tokens, wherever the experts themselves live.
    axes.update(router=("embed", "router"), w_gate=("expert", "embed", "expert_mlp"),
                w_up=("expert", "embed", "expert_mlp"), w_down=("expert", "expert_mlp", "embed"))
    if cfg.shared_experts:  # a dense MLP: split like one
        axes.update(shared_gate=("embed", "mlp"), shared_up=("embed", "mlp"), shared_down=("mlp", "embed"))
    return axes


def param_axes(cfg: LlamaConfig) -> dict[str, Any]:
    """Logical axis names of every parameter (same structure as :func:`init`).

    >>> axes = param_axes(config("tiny"))
    >>> axes["embed"], axes["layers"][0]["wq"], axes["layers"][0]["w_down"]
    (('vocab', 'embed'), ('embed', 'heads'), ('mlp', 'embed'))
    """
    axes: dict[str, Any] = {"embed": ("vocab", "embed"), "layers": [_layer_axes(cfg, i) for i in range(cfg.n_layers)],
                            "final_norm": ("embed",)}
    if not cfg.tie_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def axis_sizes(cfg: LlamaConfig) -> dict[str, int]:
    """Sizes of the splittable logical axes, in whole units (a head is never cut).

    >>> axis_sizes(config("tiny"))
    {'heads': 4, 'kv_heads': 2, 'mlp': 128, 'vocab': 256}
    """
    sizes = {"heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "mlp": cfg.ffn_dim, "vocab": cfg.vocab_size}
    if cfg.num_experts:
        sizes.update(expert=cfg.num_experts, expert_mlp=cfg.expert_dim)
    return sizes


def block_shapes(cfg: LlamaConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Block ``i``'s parameter shapes, by name (what ``init`` allocates and the plan counts).

    >>> block_shapes(config("tiny"), 0)["wq"]
    (64, 64)
    >>> {k: v for k, v in block_shapes(config("tiny", mlp="gelu", ffn_dim=256), 0).items() if k.startswith("w_")}
    {'w_up': (64, 256), 'w_down': (256, 64)}
    """
    hd = cfg.head_dim
    # Each size of a logical axis; a matrix is (in, out). The names and their order are
    # _attention_axes' (so the plan, init and the checkpoints list the same leaves).
    size = {"embed": cfg.dim, "heads": cfg.n_heads * hd, "kv_heads": cfg.n_kv_heads * hd, "head_dim": hd}
    shapes = {name: tuple(size[a] for a in axes) for name, axes in _attention_axes(cfg).items()}
    if not is_moe(cfg, i):
        gate = {"w_gate": (cfg.dim, cfg.ffn_dim)} if cfg.mlp == "swiglu" else {}
        return {**shapes, **gate, "w_up": (cfg.dim, cfg.ffn_dim), "w_down": (cfg.ffn_dim, cfg.dim)}
    e, f = cfg.num_experts, cfg.expert_dim
    shapes.update(router=(cfg.dim, e), w_gate=(e, cfg.dim, f), w_up=(e, cfg.dim, f), w_down=(e, f, cfg.dim))
    if cfg.shared_experts:
        fs = cfg.shared_experts * f
        shapes.update(shared_gate=(cfg.dim, fs), shared_up=(cfg.dim, fs), shared_down=(fs, cfg.dim))
    return shapes


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape by its dotted path (``layers.0.wq``): what ``init``
    allocates and a checkpoint's manifest lists as ``param/<path>``, known without torch.

    >>> shapes = param_shapes(config("tiny"))
    >>> shapes["embed"], shapes["layers.1.w_down"], shapes["lm_head"]
    ((256, 64), (128, 64), (64, 256))
    """
    shapes = {"embed": (cfg.vocab_size, cfg.dim)}
    for i in range(cfg.n_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in block_shapes(cfg, i).items()})
    shapes["final_norm"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["lm_head"] = (cfg.dim, cfg.vocab_size)
    return shapes


def _count(cfg: LlamaConfig, active: bool, matmul: bool = False) -> int:
    # active: an MoE block's experts count top_k / num_experts of theirs (what a token uses);
    # matmul: only the matrices a token's activations multiply (the head, tied or not), not
    # the embedding lookup, the norms or the biases
    per_layer = 0
    for i in range(cfg.n_layers):
        for name, shape in block_shapes(cfg, i).items():
            if matmul and len(shape) < 2:
                continue
            n = math.prod(shape)
            per_layer += n * cfg.top_k // cfg.num_experts if active and len(shape) == 3 else n
    head = 0 if cfg.tie_embeddings and not matmul else cfg.dim * cfg.vocab_size
    return per_layer + head if matmul else cfg.vocab_size * cfg.dim + per_layer + cfg.dim + head


def param_count(cfg: LlamaConfig) -> int:
    """Number of parameters (every expert's).

    >>> param_count(config("tiny")), param_count(config("small"))
    (106816, 3279104)
    >>> param_count(config("tiny")) - param_count(config("tiny", mlp="gelu"))   # GELU: no w_gate (64 × 128, 2 blocks)
    16384
    """
    return _count(cfg, active=False)


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 × matmul parameters + causal attention (PaLM's count);
    an MoE block's experts count top_k of num_experts (the router counts whole).

    >>> flops_per_token(config("tiny"), seq_len=128)  # 6 × 90,112 matmul parameters + 6·L·d·s
    638976
    >>> flops_per_token(config("tiny", mlp="gelu"), seq_len=128)  # w_gate's 2 × 8,192 fewer
    540672
    """
    matmul = _count(cfg, active=True, matmul=True)
    attn = 6 * cfg.n_layers * cfg.dim * seq_len  # 12·L·d·s / 2 for the causal half
    return 6 * matmul + attn


def n_sequential_layers(cfg: LlamaConfig) -> int:
    """How many layers :func:`dtp.models.llama.sequential` cuts the model into (what a
    pipeline assigns to stages): the embedding, each block, and the head.

    >>> n_sequential_layers(config("tiny"))
    4
    """
    return cfg.n_layers + 2
