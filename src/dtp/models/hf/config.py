"""Hugging Face ``config.json`` <-> :class:`LlamaConfig`, torch-free (``dtp train
--init-from`` checks a run against the model before importing torch); the weights are
:mod:`dtp.models.hf`'s, but which files hold them and whether those are whole (their
headers against their sizes) is here, for the same preflight.

:mod:`dtp.models.hf` re-exports the config names; import them from there.
"""

from __future__ import annotations

import json
import os
import shutil
import dataclasses
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..config import LlamaConfig, RopeScaling, config

__all__ = ["config_for", "config_from_hf", "hf_config", "hf_model_type", "moe_model_type", "padded_vocab", "check_moe",
           "weight_files", "check_weight_files", "weight_file_names", "staged", "INIT_VOCAB_MULTIPLE", "INDEX",
           "SINGLE"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")
# The families whose sliding_window counts only with use_sliding_window (Mistral's always does).
_OPT_IN_WINDOW = ("qwen2", "qwen3", "qwen3_moe")
# The families with an RMSNorm over each head's q and k, and those whose attention_bias
# biases q, k, v and the output projection.
_QK_NORM = ("qwen3", "qwen3_moe")
_ATTENTION_BIAS = ("llama", "qwen3", "qwen3_moe")
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
    - ``qwen3_moe``: Qwen3 with experts (:func:`_qwen3_moe`: ``moe_intermediate_size``,
      ``decoder_sparse_step`` as ``moe_every``, ``norm_topk_prob: false`` as ``pre_softmax``).

    Qwen's ``sliding_window`` caps ``max_seq_len`` only with ``use_sliding_window``.

    Raises: ``ValueError`` for what dtp's Llama does not compute (MLP biases, biases in
    Mistral/Mixtral, another activation, another rope type, Qwen3-MoE's MoE blocks at
    layers no ``moe_every`` picks).

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
    if attention_bias and kind not in _ATTENTION_BIAS:
        raise ValueError(f"from_hf: attention_bias=true is not supported for {kind!r} (only "
                         f"{', '.join(_ATTENTION_BIAS)} read it)")
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
        # Qwen3Config's head_dim defaults to 128, not hidden_size // heads (Qwen3MoeConfig's does not)
        head_dim=hf.get("head_dim", 128 if kind == "qwen3" else None),
        qkv_bias=attention_bias or kind == "qwen2", o_bias=attention_bias, qk_norm=kind in _QK_NORM)
    if kind == "mixtral":
        fields.update(num_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                      aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.01)))
    elif kind == "qwen3_moe":
        fields.update(_qwen3_moe(hf, fields["n_layers"]))
    return LlamaConfig(**fields)


def _qwen3_moe(hf: dict[str, Any], n_layers: int) -> dict[str, Any]:
    """:class:`LlamaConfig`'s MoE fields of a Qwen3-MoE ``config.json`` (transformers'
    defaults for a missing key). Its router (softmax over all experts, top k, renormalised
    over the k with ``norm_topk_prob``) is dtp's top-k-then-softmax, and without
    renormalisation dtp's ``pre_softmax``. Layer ``i`` is MoE iff ``(i + 1) %
    decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``: dtp's ``moe_every``
    picks ``i % moe_every == moe_every - 1``, the same layers, so any MoE layers every
    ``m``-th from layer ``m - 1`` are read (none: the dense model); another set is refused.

    >>> _qwen3_moe({"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    ...             "mlp_only_layers": [0, 2]}, 4)["moe_every"]
    2
    """
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 128)))  # transformers saves the latter
    step = hf.get("decoder_sparse_step", 1)
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"from_hf: decoder_sparse_step must be an int >= 1, got {step!r}")
    dense = set(hf.get("mlp_only_layers") or ())
    moe = [i for i in range(n_layers) if experts > 0 and (i + 1) % step == 0 and i not in dense]
    if not moe:  # no MoE block: transformers builds every layer as a dense MLP
        return {}
    every = moe[0] + 1
    if moe != list(range(every - 1, n_layers, every)):
        raise ValueError(f"from_hf: decoder_sparse_step={step} and mlp_only_layers={sorted(dense)} make layers {moe} "
                         f"MoE; dtp's MoE layers are every moe_every-th (i % moe_every == moe_every - 1)")
    return dict(num_experts=experts, top_k=int(hf.get("num_experts_per_tok", 8)), moe_every=every,
                moe_ffn_dim=int(hf.get("moe_intermediate_size", 768)), pre_softmax=not hf.get("norm_topk_prob", False),
                aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.001)))


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


def moe_model_type(cfg: LlamaConfig) -> str:
    """The family whose MoE blocks a model with experts is read and written as:
    ``qwen3_moe`` with q/k norms (Mixtral's attention has none), else ``mixtral``. Names
    only (``--init-from`` with MoE flags on top still reads); :func:`check_moe` checks.

    >>> from dtp.models.config import config
    >>> moe_model_type(config("tiny-moe")), moe_model_type(config("tiny-moe", qk_norm=True))
    ('mixtral', 'qwen3_moe')
    """
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


# What each family's router and blocks are (softmax scores, top-k, nothing added, dropless,
# no shared experts); any other value routes tokens otherwise, so an export would load as
# another model. Qwen3-MoE also writes MoE every n-th layer (decoder_sparse_step), an
# expert width of its own (moe_intermediate_size) and weights not renormalised over the k
# (norm_topk_prob: false, dtp's pre_softmax); Mixtral none of these.
_MOE_PLAIN = (("shared_experts", 0), ("capacity_factor", None), ("router_score", "softmax"), ("n_groups", None),
              ("topk_group", None), ("routed_scaling_factor", None), ("router_bias_update", 0.0))
_MIXTRAL_ONLY = (("moe_every", 1), ("pre_softmax", False), ("moe_ffn_dim", None))


def check_moe(cfg: LlamaConfig) -> str | None:
    """``cfg``'s MoE family (:func:`moe_model_type`; ``None`` for a dense model), checked.

    Raises: ``ValueError`` naming the MoE options that family cannot express.

    >>> from dtp.models.config import config
    >>> check_moe(config("tiny-moe")), check_moe(config("tiny-moe", qk_norm=True, moe_every=2, pre_softmax=True))
    ('mixtral', 'qwen3_moe')
    """
    if not cfg.num_experts:
        return None
    kind = moe_model_type(cfg)
    odd = {name: getattr(cfg, name) for name, plain in _MOE_PLAIN + (_MIXTRAL_ONLY if kind == "mixtral" else ())
           if getattr(cfg, name) != plain and not (name == "routed_scaling_factor" and getattr(cfg, name) == 1.0)}
    if odd and kind == "mixtral":
        raise ValueError(f"to_hf: Mixtral has MoE in every block, no shared experts, top-k-then-softmax routing "
                         f"(softmax scores, no groups, no scaling, no bias), no capacity and one FFN width; this model "
                         f"sets {odd}")
    if odd:
        raise ValueError(f"to_hf: Qwen3-MoE has no shared experts, softmax routing (top k, renormalised or not), no "
                         f"groups, no scaling, no bias and no capacity; this model sets {odd}")
    return kind


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_model_type(cfg: LlamaConfig) -> str:
    """The transformers ``model_type`` that computes ``cfg``: with experts ``qwen3_moe``
    (with ``qk_norm``) or ``mixtral``; ``qwen3`` with ``qk_norm``, ``qwen2`` with q/k/v
    biases alone, else ``llama`` (its ``attention_bias``: q/k/v and output biases).

    Raises: ``ValueError`` for a model none of them computes (an output bias without q/k/v
    ones; biases beside experts without q/k norms; MoE options the family lacks; a GELU MLP).

    >>> from dtp.models.config import config
    >>> hf_model_type(config("tiny", qkv_bias=True)), hf_model_type(config("tiny", qkv_bias=True, o_bias=True))
    ('qwen2', 'llama')
    """
    if cfg.mlp != "swiglu":  # these families' MLP is SwiGLU (gate_proj, up_proj, down_proj)
        raise ValueError(f"to_hf: transformers' Llama, Qwen and Mixtral MLPs are SwiGLU; this model has mlp={cfg.mlp!r}")
    moe = check_moe(cfg)
    biases = {name: True for name in ("qkv_bias", "o_bias") if getattr(cfg, name)}
    if moe == "mixtral" and biases:
        raise ValueError(f"to_hf: Mixtral's attention has no biases (Qwen3-MoE's has, beside q/k norms); this model "
                         f"sets {biases}")
    if cfg.o_bias != cfg.qkv_bias and (cfg.qk_norm or cfg.o_bias):
        raise ValueError(f"to_hf: transformers' Llama and Qwen3 bias q, k, v and the output projection together "
                         f"(attention_bias), Qwen2 q, k and v alone; this model sets qkv_bias={cfg.qkv_bias}, "
                         f"o_bias={cfg.o_bias}")
    return moe or ("qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias and not cfg.o_bias else "llama")


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
        out.update(use_sliding_window=False, sliding_window=None)
        if kind != "qwen3_moe":
            out["max_window_layers"] = cfg.n_layers
        if kind != "qwen2":
            out["attention_bias"] = cfg.o_bias
    if kind == "qwen3_moe":  # num_experts as Qwen's own config.json files spell it (transformers reads both)
        out.update(num_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.expert_dim,
                   decoder_sparse_step=cfg.moe_every, mlp_only_layers=[], norm_topk_prob=not cfg.pre_softmax,
                   router_aux_loss_coef=cfg.aux_loss_coeff, output_router_logits=False)
    return out


def weight_file_names(root: Path) -> list[str]:
    """The weight files of a Hugging Face directory that a new model's would replace or
    be shadowed by (its index, its single file, its shards)."""
    return [p.name for p in (root / SINGLE, root / INDEX, *sorted(root.glob("model-*-of-*.safetensors")))
            if p.is_file()]


_STAGING = ".dtp-staging-"


@contextmanager
def staged(path: str | os.PathLike[str], *, replaces: Sequence[str] = ()) -> Iterator[Path]:
    """A model directory written whole or not at all: inside, write into the yielded
    (empty, hidden) directory under ``path``; on success its files take the place of the
    model in ``path``; on an error while writing, ``path`` is left as it was. Before, the
    old weights were deleted first and the new ones streamed in for minutes: a failure
    there lost both.

    The old model's files the new one does not write are deleted first — its weight files
    (:func:`weight_file_names`: an index left beside a new single file would be read
    instead of it) and the names in ``replaces`` — then the new weights are renamed in,
    ``config.json`` last: a crash in between leaves a directory that fails to load, never
    one that loads the old weights under the new config. A name that is a directory in
    ``path`` is refused before anything moves. Staging directories a killed writer left
    are removed first (one writer per directory: ``dtp export`` runs on one process).

    >>> import tempfile
    >>> root = Path(tempfile.mkdtemp()); _ = (root / "model-00001-of-00002.safetensors").write_text("old")
    >>> with staged(root) as tmp:
    ...     _ = (tmp / "model.safetensors").write_text("new")
    >>> sorted(p.name for p in root.iterdir())
    ['model.safetensors']
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for left in root.glob(_STAGING + "*"):
        shutil.rmtree(left, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=_STAGING, dir=root))  # same file system: renames are atomic
    try:
        yield tmp
        new = sorted(p.name for p in tmp.iterdir())
        if taken := [name for name in new if (root / name).is_dir()]:
            raise IsADirectoryError(f"{root}: {', '.join(taken)} is a directory there; the model's file of that "
                                    f"name cannot take its place")
        for name in [*weight_file_names(root), *replaces]:
            if name not in new and (root / name).is_file():
                (root / name).unlink()
        for name in sorted(new, key=lambda n: n == "config.json"):  # the config last
            os.replace(tmp / name, root / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def config_for(model: str, *, init_from: str | None = None, vocab_size: int | None = None,
               **overrides: Any) -> LlamaConfig:
    """A run's model: the preset ``model`` (its vocabulary ``vocab_size`` when given), or,
    with ``init_from``, the Hugging Face directory's (its vocabulary padded to a multiple
    of :data:`dtp.models.hf.INIT_VOCAB_MULTIPLE`; ``vocab_size`` then unused), with the
    field ``overrides`` on top.

    >>> config_for("tiny", vocab_size=384).vocab_size
    384
    """
    if init_from is None:
        return config(model, **({} if vocab_size is None else {"vocab_size": vocab_size}), **overrides)
    cfg = config_from_hf(init_from, vocab_multiple=INIT_VOCAB_MULTIPLE)
    return dataclasses.replace(cfg, **overrides) if overrides else cfg
