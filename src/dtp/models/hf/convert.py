"""Hugging Face Llama, Mistral, Mixtral, Qwen2, Qwen3 and Qwen3-MoE checkpoints in and out:
:func:`from_hf`, :func:`to_hf`.

dtp's Llama is Hugging Face's ``LlamaForCausalLM`` (RMSNorm, rotate-half RoPE, GQA,
SwiGLU) and, with ``num_experts``, ``MixtralForCausalLM`` (Mixtral's router takes a
softmax over all experts, the top k, and renormalises: the same weights as dtp's top-k
of the logits then a softmax over the k). With ``qkv_bias`` it is ``Qwen2ForCausalLM``,
with ``qk_norm`` ``Qwen3ForCausalLM``, with both experts and ``qk_norm``
``Qwen3MoeForCausalLM`` (Mixtral's router, or without renormalisation ``pre_softmax``;
MoE every ``moe_every``-th layer, experts ``moe_ffn_dim`` wide)
(:func:`~dtp.models.hf_config.hf_model_type`). The
weights differ only in orientation: a ``torch.nn.Linear`` stores (out, in), dtp's
:func:`dtp.ops.linear` takes (in, out).

=====================================================  ==========================
Hugging Face (``model.layers.{i}.`` omitted)            dtp (``layers[i]``)
=====================================================  ==========================
``model.embed_tokens.weight`` (V, D)                    ``embed`` (V, D)
``input_layernorm`` / ``post_attention_layernorm``      ``attn_norm`` / ``mlp_norm``
``self_attn.{q,k,v,o}_proj.weight``                     ``wq``, ``wk``, ``wv``, ``wo`` transposed
``self_attn.{q,k,v,o}_proj.bias``                       ``q_bias``, ``k_bias``, ``v_bias``, ``o_bias``
``self_attn.{q,k}_norm.weight`` (head_dim,)             ``q_norm``, ``k_norm``
``mlp.{gate,up,down}_proj.weight``                      ``w_gate``, ``w_up``, ``w_down`` transposed
``block_sparse_moe.gate.weight`` (E, D)                 ``router`` (D, E)
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``      ``w_gate[e]``, ``w_up[e]``, ``w_down[e]`` transposed
Qwen3-MoE: ``mlp.gate.weight`` (E, D)                   ``router`` (D, E)
``mlp.experts.{e}.{gate,up,down}_proj.weight``          ``w_gate[e]``, ``w_up[e]``, ``w_down[e]`` transposed
``model.norm.weight``, ``lm_head.weight`` (V, D)        ``final_norm``, ``lm_head`` (D, V)
=====================================================  ==========================

Mixtral's and Qwen3-MoE's experts are read and written per expert, as they are stored on
disk (transformers 5 fuses them into ``gate_up_proj`` only after loading, and splits them
again in ``save_pretrained``).

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
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from ...core._rules import accum_dtype
from .files import Entry, bytes_read, open_weights, write_sharded
from ..config import LlamaConfig, block_shapes, is_moe
from .config import INIT_VOCAB_MULTIPLE, config_from_hf, hf_config, hf_model_type, moe_model_type, padded_vocab, staged

__all__ = ["from_hf", "to_hf", "read_blocks", "bytes_read", "config_from_hf", "hf_config", "padded_vocab",
           "INIT_VOCAB_MULTIPLE", "Box"]

# (file key, dtp's name, transposed); a block holds the rows whose name block_shapes lists
# (the biases and q/k norms only where the config has them).
_ATTN = (("input_layernorm.weight", "attn_norm", False), ("self_attn.q_proj.weight", "wq", True),
         ("self_attn.k_proj.weight", "wk", True), ("self_attn.v_proj.weight", "wv", True),
         ("self_attn.q_proj.bias", "q_bias", False), ("self_attn.k_proj.bias", "k_bias", False),
         ("self_attn.v_proj.bias", "v_bias", False), ("self_attn.q_norm.weight", "q_norm", False),
         ("self_attn.k_norm.weight", "k_norm", False), ("self_attn.o_proj.weight", "wo", True),
         ("self_attn.o_proj.bias", "o_bias", False), ("post_attention_layernorm.weight", "mlp_norm", False))
_MLP = (("mlp.gate_proj.weight", "w_gate"), ("mlp.up_proj.weight", "w_up"), ("mlp.down_proj.weight", "w_down"))
# An MoE block's keys by family (hf_config.moe_model_type): the block's prefix (its router is
# "gate.weight" in it) and (file name, dtp's name) of each expert's matrices.
_MOE_KEYS = {"mixtral": ("block_sparse_moe.", (("w1", "w_gate"), ("w3", "w_up"), ("w2", "w_down"))),
             "qwen3_moe": ("mlp.", (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")))}
_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
                torch.bfloat16: "bfloat16"}


Box = tuple[tuple[int, int], ...]  # [start, stop) per dim, in dtp's orientation
# A parameter's path ("layers.0.wq") and global shape -> the block of it to read (None: whole;
# a list of boxes: their elements, flattened and joined).
BlockFn = Callable[[str, tuple[int, ...]], "Box | list[Box] | None"]


def from_hf(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
            vocab_multiple: int = 1) -> tuple[LlamaConfig, dict[str, Any]]:
    """``(cfg, params)`` of a local Hugging Face Llama / Mistral / Mixtral / Qwen2 / Qwen3 /
    Qwen3-MoE directory (``config.json``; ``*.safetensors`` with or without ``model.safetensors.index.json``):
    global tensors in ``dtype`` (an MoE router in fp32, fp64 in fp64), ready for
    ``TrainState.create``. Reads one tensor at a time, memory-mapped
    (``TrainState.from_hf`` reads only each rank's blocks).

    - `dtype`: the parameters' dtype, default fp32.
    - `vocab_multiple`: pad the vocabulary to a multiple of it (module docstring), default 1.

    Raises: ``ValueError`` for an unsupported config, a missing tensor, one of the wrong
    shape or a weight file that cannot be read; ``ImportError`` without ``safetensors``.

    >>> import tempfile
    >>> from dtp.models import llama
    >>> cfg = llama.config("tiny", n_layers=1, vocab_size=300)
    >>> path = tempfile.mkdtemp(); _ = to_hf(cfg, llama.init(cfg), path)
    >>> padded, params = from_hf(path, vocab_multiple=128)
    >>> padded.vocab_size, padded.vocab_pad, tuple(params["lm_head"].shape)
    (384, 84, (64, 384))
    """
    cfg = config_from_hf(path, vocab_multiple)
    return cfg, read_blocks(path, cfg, dtype, lambda name, shape: None)


def read_blocks(path: str | os.PathLike[str], cfg: LlamaConfig, dtype: torch.dtype,
                block: BlockFn) -> dict[str, Any]:
    """The parameter tree of ``cfg`` from the directory at ``path``, each leaf only its
    ``block(leaf path, global shape)``: ``None`` the whole tensor, a :data:`Box` that
    block, a list of boxes their elements flattened and joined in order (a 1-D leaf: a
    ZeRO rank's runs of a parameter). Read with safetensors' ``get_slice``: no byte
    outside the blocks is asked for (vocabulary padding is zeros, not read).
    :func:`bytes_read` counts them.

    Raises: as :func:`from_hf`.
    """
    vocab = cfg.vocab_size - cfg.vocab_pad
    moe_prefix, expert_keys = _MOE_KEYS[moe_model_type(cfg)]

    with open_weights(path) as get:
        def leaf(name: str, shape: tuple[int, ...], read_box: Callable[[Box], torch.Tensor]) -> torch.Tensor:
            want = block(name, shape)
            if want is None:
                return read_box(tuple((0, n) for n in shape))
            if isinstance(want, list):
                return torch.cat([read_box(b).reshape(-1) for b in want]) if want else read_box(
                    tuple((0, 0) for _ in shape)).reshape(-1)
            return read_box(want)

        def read(key: str, hf_shape: tuple[int, ...], transpose: bool, to: torch.dtype = dtype
                 ) -> Callable[[Box], torch.Tensor]:
            def read_box(box: Box) -> torch.Tensor:
                t = get(key, hf_shape, box[::-1] if transpose else box)
                return (t.T if transpose else t).to(to).contiguous()
            return read_box

        def vocab_rows(key: str, transpose: bool) -> Callable[[Box], torch.Tensor]:
            def read_box(box: Box) -> torch.Tensor:
                # rows of the padded (V + pad, D) table; in dtp's (D, V + pad) orientation for the head
                (r0, r1), cols = (box[1], box[0]) if transpose else (box[0], box[1])
                out = torch.zeros(r1 - r0, cols[1] - cols[0], dtype=dtype)
                if min(r1, vocab) > r0:
                    out[:min(r1, vocab) - r0] = get(key, (vocab, cfg.dim), ((r0, min(r1, vocab)), cols)).to(dtype)
                return (out.T if transpose else out).contiguous()
            return read_box

        def experts(keys: list[str], shape: tuple[int, ...]) -> Callable[[Box], torch.Tensor]:
            def read_box(box: Box) -> torch.Tensor:  # (E, in, out): one file tensor per expert
                (e0, e1), *inner = box
                blocks = [read(keys[e], shape[1:][::-1], True)(tuple(inner)) for e in range(e0, e1)]
                return torch.stack(blocks) if blocks else torch.zeros(0, *(b - a for a, b in inner), dtype=dtype)
            return read_box

        params: dict[str, Any] = {
            "embed": leaf("embed", (cfg.vocab_size, cfg.dim), vocab_rows("model.embed_tokens.weight", False)),
            "layers": []}
        for i in range(cfg.n_layers):
            shapes, pre = block_shapes(cfg, i), f"model.layers.{i}."
            layer = {}
            dense_mlp = () if is_moe(cfg, i) else tuple((key, ours, True) for key, ours in _MLP)
            for key, ours, t in _ATTN + dense_mlp:
                if ours not in shapes:
                    continue
                shape = shapes[ours]
                layer[ours] = leaf(f"layers.{i}.{ours}", shape, read(pre + key, shape[::-1] if t else shape, t))
            if is_moe(cfg, i):
                moe = pre + moe_prefix
                layer["router"] = leaf(f"layers.{i}.router", shapes["router"],
                                       read(moe + "gate.weight", shapes["router"][::-1], True, accum_dtype(dtype)))
                for key, ours in expert_keys:
                    keys = [f"{moe}experts.{e}.{key}.weight" for e in range(cfg.num_experts)]
                    layer[ours] = leaf(f"layers.{i}.{ours}", shapes[ours], experts(keys, shapes[ours]))
            params["layers"].append(layer)
        params["final_norm"] = leaf("final_norm", (cfg.dim,), read("model.norm.weight", (cfg.dim,), False))
        if not cfg.tie_embeddings:
            params["lm_head"] = leaf("lm_head", (cfg.dim, cfg.vocab_size), vocab_rows("lm_head.weight", True))
    return params


def _plain(name: str, x: Any) -> torch.Tensor:
    if isinstance(x, DTensor):
        raise TypeError(f"to_hf: {name} is a DTensor; pass whole tensors (a one-process state, or "
                        f"checkpoint.load under a one-rank mesh)")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"to_hf: {name} must be a tensor, got {type(x).__name__}")
    return x


def to_hf(cfg: LlamaConfig, params: dict[str, Any] | Callable[[tuple], torch.Tensor],
          path: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
          max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write ``params`` (global tensors, as :func:`from_hf` returns or ``init`` builds) as
    a Hugging Face directory: ``config.json`` (:func:`hf_config`) and sharded
    ``.safetensors`` files with their index (one ``model.safetensors`` when they fit),
    one tensor at a time, vocabulary padding stripped. Returns the weight files. Where
    another model is, its files are replaced once the new ones are whole (an error leaves
    it as it was; its shards the new index does not name are deleted).
    ``params`` may instead be a function of a leaf's path (``("layers", 0, "wq")``; an
    expert's ``("layers", 1, "w_gate", e)``) called when that tensor is written, so only
    the tensor being written is ever held (``dtp export --hf``); ``dtype`` is then needed.

    - `dtype`: the dtype written (default: the embedding's).
    - `max_shard_bytes`: the most bytes per file (transformers' default, 5 GiB).

    Raises: ``TypeError`` for DTensor leaves (or a function without ``dtype``); ``ValueError``
    for a model no transformers architecture computes (:func:`hf_model_type`).

    >>> import tempfile
    >>> from dtp.models import llama
    >>> cfg = llama.config("tiny", n_layers=1)
    >>> [f.name for f in to_hf(cfg, llama.init(cfg), tempfile.mkdtemp())]
    ['model.safetensors']
    """
    hf_model_type(cfg)  # before anything is written
    if dtype is None and callable(params):
        raise TypeError("to_hf: with params given as a function, pass dtype")
    dtype = dtype or _plain("embed", params["embed"]).dtype
    vocab = cfg.vocab_size - cfg.vocab_pad
    moe_prefix, expert_keys = _MOE_KEYS[moe_model_type(cfg)]

    def entry(name: str, get: Any, transpose: bool, shape: tuple[int, ...]) -> Entry:
        def make() -> torch.Tensor:
            t = get()
            return (t.T if transpose else t).to(dtype).contiguous()
        return Entry(name, shape, dtype, make)

    def leaf(*path: Any) -> Any:
        def get() -> torch.Tensor:
            if callable(params):  # read when its turn comes (dtp export: from a checkpoint)
                return _plain(".".join(map(str, path)), params(path))
            x: Any = params
            for p in path:
                x = x[p]
            return _plain(".".join(map(str, path)), x)
        return get

    entries = [entry("model.embed_tokens.weight", lambda: leaf("embed")()[:vocab], False, (vocab, cfg.dim))]
    for i in range(cfg.n_layers):
        shapes, pre = block_shapes(cfg, i), f"model.layers.{i}."
        entries += [entry(pre + hf, leaf("layers", i, ours), t, shapes[ours][::-1] if t else shapes[ours])
                    for hf, ours, t in _ATTN if ours in shapes]
        if not is_moe(cfg, i):
            entries += [entry(pre + hf, leaf("layers", i, ours), True, shapes[ours][::-1]) for hf, ours in _MLP]
            continue
        moe = pre + moe_prefix
        entries.append(entry(moe + "gate.weight", leaf("layers", i, "router"), True, shapes["router"][::-1]))
        for hf, ours in expert_keys:  # one stacked parameter's experts after another (a reader caches one)
            entries += [entry(f"{moe}experts.{e}.{hf}.weight", leaf("layers", i, ours, e), True,
                              shapes[ours][1:][::-1]) for e in range(cfg.num_experts)]
    entries.append(entry("model.norm.weight", leaf("final_norm"), False, (cfg.dim,)))
    if not cfg.tie_embeddings:
        entries.append(entry("lm_head.weight", lambda: leaf("lm_head")()[:, :vocab], True, (vocab, cfg.dim)))
    with staged(path) as tmp:  # an existing model's files are replaced only once the new ones are whole
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, _DTYPE_NAMES[dtype]), indent=2) + "\n")
        names = [f.name for f in write_sharded(tmp, entries, max_shard_bytes)]
    return [Path(path) / name for name in names]
