"""A functional Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU), written once.
``mlp="gelu"`` gives a block GPT's two-matrix GELU MLP instead (:class:`LlamaConfig`).

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

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..layouts import constrain
from torch.distributed.tensor import DTensor

from ..ops.attention import Docs
from ..ops import add_bias, attention, cross_entropy, embedding, linear, mask_padded_vocab, remat, rms_norm, rotary
from ..ops.moe import moe_ffn, update_bias
from ..ops.local_batch import batch_local
from ..core._rules import accum_dtype
from .config import (CONFIGS, LlamaConfig, RopeScaling, block_shapes, axis_sizes, config, flops_per_token,
                     is_moe, n_sequential_layers, param_axes, param_count)
from .hf.config import config_for
from .sequential import Layer, Sequential

__all__ = ["LlamaConfig", "RopeScaling", "CONFIGS", "config", "config_for", "block_shapes", "init", "init_buffers",
           "buffer_update", "param_axes", "axis_sizes", "apply", "loss", "sequential", "param_count", "flops_per_token",
           "is_moe", "n_sequential_layers"]


def init(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
         device: torch.device | str | None = None) -> dict[str, Any]:
    """Global parameters from ``seed`` alone: the same values under every layout.

    Normal(0, 0.02) weights, output projections scaled by 1/√(2·n_layers) (GPT-2 /
    Megatron), norms at one, biases at zero (Megatron, transformers). An MoE router is kept in fp32 (fp64 stays fp64).

    >>> params = init(config("tiny"), seed=0)
    >>> params["embed"].shape, sorted(params["layers"][0])[:4], torch.equal(params["embed"], init(config("tiny"))["embed"])
    (torch.Size([256, 64]), ['attn_norm', 'mlp_norm', 'w_down', 'w_gate'], True)
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)

    def normal(shape: tuple[int, ...], s: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float32) * s).to(dtype=dtype, device=device)

    def ones(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, dtype=dtype, device=device)

    def zeros(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    params: dict[str, Any] = {"embed": normal((cfg.vocab_size, cfg.dim), std), "layers": []}
    for i in range(cfg.n_layers):
        layer = {}
        for name, shape in block_shapes(cfg, i).items():
            # (a bias draws nothing: the weights are the same with and without biases)
            layer[name] = ones(shape) if name.endswith("norm") else zeros(shape) if name.endswith("bias") else normal(
                shape, out_std if name in ("wo", "w_down", "shared_down") else std)
        if "router" in layer:
            layer["router"] = layer["router"].to(accum_dtype(dtype))
        params["layers"].append(layer)
    params["final_norm"] = ones((cfg.dim,))
    if not cfg.tie_embeddings:
        params["lm_head"] = normal((cfg.dim, cfg.vocab_size), std)
    return params


def init_buffers(cfg: LlamaConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The state no gradient trains (``TrainState.create(buffers=...)``): with
    ``router_bias_update`` each MoE block's selection bias ``router_bias`` (E,), zeros in
    the router's dtype, at the block's place in the parameter tree; else nothing (``{}``).

    >>> cfg = config("tiny-moe", router_bias_update=1e-3)
    >>> [sorted(layer) for layer in init_buffers(cfg)["layers"]]
    [['router_bias'], ['router_bias']]
    """
    if not cfg.router_bias_update:
        return {}
    acc = accum_dtype(dtype)
    return {"layers": [{"router_bias": torch.zeros(cfg.num_experts, dtype=acc)} if is_moe(cfg, i) else {}
                       for i in range(cfg.n_layers)]}


def buffer_update(cfg: LlamaConfig) -> Any:
    """Aux-loss-free balancing's rule for ``TrainState.create(buffer_update=...)``:
    ``(buffers, aux) -> buffers``, each MoE block's bias moved by
    ``router_bias_update · sign(mean load − load)`` (:func:`dtp.ops.moe.update_bias`), the
    load being the tokens routed to each expert in the whole step — summed over the
    microbatches' ``aux["tokens_per_expert"]``, each already a global count (the MoE
    statistics are reduced over every token axis), so it needs no collective of its own.

    >>> cfg = config("tiny-moe", n_layers=1, router_bias_update=0.5)
    >>> aux = {"tokens_per_expert": torch.tensor([[3, 1, 1, 3]])}
    >>> buffer_update(cfg)(init_buffers(cfg), aux)["layers"][0]["router_bias"].tolist()
    [-0.5, 0.5, 0.5, -0.5]
    """
    rate = cfg.router_bias_update

    def update(buffers: dict[str, Any], aux: Any) -> dict[str, Any]:
        auxes = aux if isinstance(aux, tuple) else (aux,)  # one per microbatch
        load = sum(a["tokens_per_expert"] for a in auxes)  # (MoE blocks, E)
        blocks = iter(range(load.shape[0]))
        layers = [{"router_bias": update_bias(layer["router_bias"], load[next(blocks)], rate)} if layer else {}
                  for layer in buffers["layers"]]
        return {**buffers, "layers": layers}

    return update


def _docs(batch: dict[str, Any]) -> Docs | None:
    """Packed documents' ``(documents, positions)`` when the batch has them (``--document-mask``)."""
    return (batch["documents"], batch["positions"]) if "documents" in batch else None


def _attention(layer: dict[str, torch.Tensor], x: torch.Tensor, cfg: LlamaConfig,
               docs: Docs | None = None) -> torch.Tensor:
    b, s, hd = x.shape[0], x.shape[1], cfg.head_dim
    scaling = cfg.rope_scaling.as_tuple() if cfg.rope_scaling else None
    pos = None if docs is None else docs[1]

    def project(name: str, heads: int) -> torch.Tensor:  # (b, s, heads, hd); Qwen3 normalizes each q and k head
        y = linear(x, layer[f"w{name}"], layer[f"{name}_bias"] if cfg.qkv_bias else None).view(b, s, heads, hd)
        return rms_norm(y, layer[f"{name}_norm"], cfg.norm_eps) if cfg.qk_norm and name != "v" else y

    q = rotary(project("q", cfg.n_heads), cfg.rope_theta, scaling, pos).transpose(1, 2)
    k = rotary(project("k", cfg.n_kv_heads), cfg.rope_theta, scaling, pos).transpose(1, 2)
    v = project("v", cfg.n_kv_heads).transpose(1, 2)
    q = constrain(q, ("batch", "heads", "seq", "head_dim"), name="q")
    k = constrain(k, ("batch", "kv_heads", "seq", "head_dim"), name="k")
    v = constrain(v, ("batch", "kv_heads", "seq", "head_dim"), name="v")
    o = attention(q, k, v, causal=True, docs=docs).transpose(1, 2).reshape(b, s, cfg.n_heads * hd)
    return linear(o, layer["wo"])  # row parallel: a pending sum over the heads' axes (o_bias: after it, _block)


def _mlp(layer: dict[str, torch.Tensor], x: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    if cfg.mlp == "gelu":  # GPT's: column-parallel w_up, GELU on each rank's features, row-parallel w_down
        return linear(F.gelu(linear(x, layer["w_up"])), layer["w_down"])
    return linear(F.silu(linear(x, layer["w_gate"])) * linear(x, layer["w_up"]), layer["w_down"])


def _block(layer: dict[str, torch.Tensor], h: torch.Tensor, cfg: LlamaConfig, docs: Docs | None = None) -> Any:
    """The new residual stream; an MoE block (its parameters have a ``router``) returns
    ``(h, aux)`` with its :func:`~dtp.ops.moe.moe_ffn` aux."""
    # Entering a block: the residual stream (split on sequence under SP) is gathered;
    # leaving it: the row-parallel pending sum is reduced back onto the residual layout.
    x = constrain(rms_norm(h, layer["attn_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="attn_in")
    a = constrain(_attention(layer, x, cfg, docs), ("batch", "res_seq", "embed"), name="attn_out")
    h = h + (add_bias(a, layer["o_bias"]) if cfg.o_bias else a)  # once, on the resolved sum
    x = constrain(rms_norm(h, layer["mlp_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="mlp_in")
    if "router" not in layer:
        return h + constrain(_mlp(layer, x, cfg), ("batch", "res_seq", "embed"), name="mlp_out")
    if cfg.router_bias_update and "router_bias" not in layer:
        raise ValueError("llama: router_bias_update needs each MoE block's router_bias among the parameters it "
                         "reads: create the state with buffers=llama.init_buffers(cfg) (dtp.with_buffers)")
    y, aux = moe_ffn(layer, x, top_k=cfg.top_k, pre_softmax=cfg.pre_softmax, capacity_factor=cfg.capacity_factor,
                     aux_loss_coeff=cfg.aux_loss_coeff, z_loss_coeff=cfg.z_loss_coeff,
                     bias=layer["router_bias"] if cfg.router_bias_update else None, score=cfg.router_score,
                     n_groups=cfg.n_groups, topk_group=cfg.topk_group, scaling_factor=cfg.routed_scaling_factor)
    return h + constrain(y, ("batch", "res_seq", "embed"), name="mlp_out"), aux


def _run_block(layer: dict[str, torch.Tensor], x: Any, cfg: LlamaConfig, docs: Docs | None = None) -> Any:
    """One block on the carry: ``h``, or ``(h, auxes)`` once an MoE block has run."""
    h, auxes = x if isinstance(x, tuple) else (x, ())
    out = remat(_block, layer, h, cfg, docs, level="full")
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


def _check_targets(batch: dict[str, torch.Tensor]) -> None:
    """One line for targets that are not one per token (else a flattened batch-size
    mismatch from inside ``F.cross_entropy``, after the forward's collectives)."""
    tokens, targets = batch["tokens"], batch.get("targets")
    if targets is not None and tuple(targets.shape) != tuple(tokens.shape):
        raise ValueError(f"llama: batch['targets'] has shape {tuple(targets.shape)}, batch['tokens'] "
                         f"{tuple(tokens.shape)}: one target (the next token) per token")


def _embed(params: dict[str, Any], x: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    _check_targets(batch)
    return constrain(embedding(params["embed"], batch["tokens"]), ("batch", "res_seq", "embed"), name="embed_out")


def _logits(params: dict[str, Any], h: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    x = constrain(rms_norm(h, params["final_norm"], cfg.norm_eps), ("batch", "seq", "embed"), name="head_in")
    head = params["embed"].transpose(0, 1) if cfg.tie_embeddings else params["lm_head"]
    logits = constrain(linear(x, head), ("batch", "seq", "vocab"), name="logits")
    return mask_padded_vocab(logits, cfg.vocab_size - cfg.vocab_pad) if cfg.vocab_pad else logits


def _forward(params: dict[str, Any], tokens: torch.Tensor, cfg: LlamaConfig,
             docs: Docs | None = None) -> tuple[torch.Tensor, tuple]:
    x = _embed(params, None, {"tokens": tokens})
    for layer in params["layers"]:
        x = _run_block(layer, x, cfg, docs)
    h, auxes = x if isinstance(x, tuple) else (x, ())
    return _logits(params, h, cfg), auxes


def apply(params: dict[str, Any], tokens: torch.Tensor, cfg: LlamaConfig) -> torch.Tensor:
    """Logits (batch, seq, vocab) for ``tokens`` (batch, seq) (MoE aux losses dropped).

    >>> cfg = config("tiny", n_layers=1)
    >>> apply(init(cfg), torch.zeros(2, 16, dtype=torch.long), cfg).shape
    torch.Size([2, 16, 256])
    """
    return _forward(params, tokens, cfg)[0]


@batch_local  # reduces over the batch only through dtp.ops (cross_entropy, MoE statistics)
def loss(params: dict[str, Any], batch: dict[str, torch.Tensor], cfg: LlamaConfig) -> Any:
    """Mean next-token cross-entropy; ``batch`` has ``tokens`` and ``targets`` (batch, seq),
    and for packed documents ``documents`` and ``positions`` (:mod:`dtp.ops.documents`:
    attention within each document, RoPE positions restarting in each).

    With MoE blocks: ``(cross-entropy + Σ aux_loss + Σ z_loss, aux)``; ``aux`` holds
    ``lm_loss``, ``aux_loss``, ``z_loss`` (detached scalars), ``tokens_per_expert``
    (int64, one row per MoE block) and ``dropped_fraction`` (one per MoE block).

    >>> cfg = config("tiny-moe", n_layers=1)
    >>> tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    >>> total, aux = loss(init(cfg), {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}, cfg)
    >>> abs(float(aux["lm_loss"]) - math.log(cfg.vocab_size)) < 0.1, aux["tokens_per_expert"].shape
    (True, torch.Size([1, 4]))
    """
    if "tokens" not in batch or "targets" not in batch:  # else a bare KeyError from inside the model
        raise KeyError(f"llama.loss: the batch needs 'tokens' and 'targets' (the next tokens), both (batch, seq); "
                       f"got {sorted(batch)}")
    _check_targets(batch)
    logits, auxes = _forward(params, batch["tokens"], cfg, _docs(batch))
    return _with_aux(cross_entropy(logits, batch["targets"]), auxes)


def sequential(cfg: LlamaConfig) -> Sequential:
    """The model as a sequence of layers — embedding | each block | final norm + head +
    loss — what ``layouts.pipeline`` splits into stages (each counts as one layer). Called
    as ``loss_fn(params, batch)`` it equals :func:`loss`. With ``tie_embeddings`` the
    first and the last layer both read ``embed``. With MoE blocks the carry after the
    first of them is ``(h, auxes)`` and the head returns ``(loss, aux)`` as :func:`loss`;
    under ``layouts.pipeline`` that whole carry travels between stages (``carry="tree"``:
    the aux losses keep their gradients, and the head's aux reaches every pp rank).

    >>> cfg = config("tiny")
    >>> [layer.name for layer in sequential(cfg).layers]
    ['embed', 'block 0', 'block 1', 'head']
    """
    def block(i: int):
        return lambda p, x, b: _run_block(p["layers"][i], x, cfg, _docs(b))

    def last(p: dict[str, Any], x: Any, b: dict[str, torch.Tensor]) -> Any:
        h, auxes = x if isinstance(x, tuple) else (x, ())
        return _with_aux(cross_entropy(_logits(p, h, cfg), b["targets"]), auxes)

    head = ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")
    return batch_local(Sequential([Layer(_embed, ("embed",), "embed"),
                       *(Layer(block(i), (f"layers.{i}",), f"block {i}") for i in range(cfg.n_layers)),
                       Layer(last, head, "head")], carry="tree" if cfg.num_experts else "tensor"))
