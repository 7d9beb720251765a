"""The run's shape against its layout, before any rank starts: the model's heads, kv heads,
vocabulary and experts against their splits on the mesh, the pipeline's layers and
microbatches, the sequence against the context and sequence splits, ``--multi-data``
against a rank's tokens, expert flags on a dense model. The rules are the layouts' and
the model's (:meth:`dtp.Layout.check_sizes`, the options' ``check``); this module asks them
against the mesh's shape (:class:`dtp.core.mesh.shape.MeshShape`) and refuses in the flags'
words (:class:`UsageError`), for :func:`dtp.cli.flags.preflight` and
:func:`dtp.cli.flags.check_config`. Like :mod:`.flags`, it imports nothing that imports torch.
"""

from __future__ import annotations

import argparse

from .. import schedules
from ..core.mesh.shape import MeshShape
from ..config import CONTEXT_FIELDS, MODEL_FIELDS, flag_of
from ..layouts import Layout, check_divisible
from ..layouts.pipeline import FLAG_NAMES, assign
from ..models import config as model_config
from .parser import UsageError

__all__ = ["check_shape", "format_mesh"]


def format_mesh(axes: dict[str, int]) -> str:
    """A mesh for a message: ``dp=2 × tp=2``.

    >>> format_mesh({"dp": 2, "tp": 2}), format_mesh({"dp": 1})
    ('dp=2 × tp=2', 'dp=1')
    """
    return " × ".join(f"{k}={v}" for k, v in axes.items())


def check_shape(args: argparse.Namespace, layout: Layout, cfg: model_config.LlamaConfig,
                mesh: MeshShape) -> None:
    """The run's shape, which needs no data and no files: the model against the layout on
    the mesh's shape (heads, kv heads, vocabulary, experts divisible by their splits), the
    pipeline's layers and microbatches, the sequence against the model's length and the
    context and sequence splits, ``--multi-data`` against the tokens of a rank's
    microbatch, on ``mesh`` (the flags' mesh). :func:`dtp.cli.flags.preflight` runs it for
    ``dtp train``, ``dtp plan`` for its own flags (:func:`dtp.cli.flags.check_config`): both
    refuse a shape with the same line.
    """
    model = f"--init-from {args.init_from}" if args.init_from else f"--model {args.model}"
    what = f"{model} on the mesh {format_mesh(mesh.sizes)}"
    if args.seq > cfg.max_seq_len:
        # Nothing past it was trained, and under a Mistral's window (config_from_hf caps
        # max_seq_len there) dtp's attention, which has no window, would attend otherwise.
        raise UsageError(f"--seq {args.seq}: longer than the {cfg.max_seq_len} tokens {model} takes (its "
                         f"max_seq_len: a Hugging Face model's max_position_embeddings, or a Mistral's "
                         f"sliding_window, which dtp's attention does not have)")
    split = args.dp * args.ep * args.cp  # dtp plan has no --check
    if getattr(args, "check", False) and cfg.num_experts and cfg.capacity_factor is not None and split > 1:
        # dtp.ops.moe: capacity is computed from the tokens a rank routes (Megatron's rule),
        # so a batch split over dp × ep × cp drops other tokens than one process does.
        raise UsageError(f"--check compares with one process, but with --capacity-factor each rank drops by its "
                         f"own tokens (Megatron's rule), so a batch split {split} ways (--dp × --ep × --cp) "
                         f"differs from one process by design; drop --check, or train dropless")
    _check_dense(args, cfg, model)
    layout.check_mesh(mesh, what=f"the mesh {format_mesh(mesh.sizes)}")
    try:  # the options' checks in the flags' words: the mesh axes, the options' fields, the model
        layout.check_sizes(model_config.axis_sizes(cfg), mesh, what=what, names=_SIZE_NAMES)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if layout.pipeline is not None:
        opts, layers = layout.pipeline, model_config.n_sequential_layers(cfg)
        flags = _stage_flags(args, opts.virtual_stages)
        try:  # the options' own rules, in the flags' words: the layers first (a model too small), then all
            assign(layers, opts.degree(mesh), opts.virtual_stages, opts.layer_split, what=flags,
                   layers_said=f"{model} cuts into {layers} layers (the embedding, its {cfg.n_layers} blocks, "
                               f"the head)")
            opts.check(n_layers=layers, mesh=mesh, microbatches=args.microbatches, what=flags)
        except ValueError as e:
            raise UsageError(str(e)) from None
        # The model's facts as llama.sequential(cfg) has them: the head reads the embedding when tied.
        layout.pipeline.check_composition(layout, mesh, shared=("embed",) if cfg.tie_embeddings else (),
                                          what=f"--pp {args.pp}", names=FLAG_NAMES)
    if layout.context is not None:
        # layouts.check_divisible's rule, refused in the flags' words (the CLI always balances by zigzag).
        cp = layout.context_degree(mesh)
        try:
            check_divisible(args.seq, cp, layout.context.load_balance)
        except ValueError:
            chunks = 2 * cp if layout.context.load_balance == "zigzag" else cp
            raise UsageError(f"--seq {args.seq}: --cp {cp} cuts the sequence into {chunks} equal chunks "
                             f"(2 per rank: zigzag load balancing of causal attention); use a --seq that is "
                             f"a multiple of {chunks}") from None
    _check_sequence_split(args.seq, layout, mesh)
    _check_expert_tokens(args, layout, mesh)


def _stage_flags(args: argparse.Namespace, chunks: int) -> str:
    """The flags that make a pipeline's stages: ``--pp 4 --virtual-stages 2``, or where the
    schedule holds its chunks itself (a V: two a rank) ``--pp 4 --pp-schedule zbv``.

    >>> _stage_flags(argparse.Namespace(pp=4, virtual_stages=1, pp_schedule="zbv"), 2)
    '--pp 4 --pp-schedule zbv'
    """
    if args.virtual_stages == chunks:
        return f"--pp {args.pp} --virtual-stages {args.virtual_stages}"
    return f"--pp {args.pp} --pp-schedule {args.pp_schedule}"



def _check_dense(args: argparse.Namespace, cfg: model_config.LlamaConfig, model: str) -> None:
    """Expert flags on a model without experts: refused, not ignored (``--top-k 2`` trained the
    dense model as given; ``--ep 2`` was data parallel under another name)."""
    if cfg.num_experts:
        return
    given = [f"--ep {args.ep}"] if args.ep > 1 else []
    given += [flag_of(k) for k in MODEL_FIELDS if k != "num_experts" and getattr(args, k, None) is not None]
    given += [flag_of(k) for k in ("expert_tp", "pipe_experts", "multi_stream", "ep_overlap") if getattr(args, k, False)]
    given += ["--multi-data"] if getattr(args, "multi_data", 1) > 1 else []
    if given:
        # An explicit --num-experts 0 is what made the model dense: advising "train --model
        # tiny-moe" to someone training tiny-moe sent them in a circle.
        fix = ("drop --num-experts 0 (it removes the preset's experts)" if getattr(args, "num_experts", None) == 0
               else "add --num-experts E, or train --model tiny-moe")
        raise UsageError(f"{' '.join(given)}: {model} has no experts (a dense model); {fix}"
                         + (", or use --dp for data parallel" if args.ep > 1 else ""))


def _check_sequence_split(seq: int, layout: Layout, mesh: MeshShape) -> None:
    """The residual stream's sequence splits evenly over the axes that split it (cp, and tp
    under --sp): caught here, not by the first rank to shard an activation (which names a
    tensor and a spec, not the flag)."""
    n = layout.degree("res_seq", mesh, activation=True)
    if seq % n:
        axes = layout.mesh_axes("res_seq", mesh, activation=True)
        flags = " and ".join({"tp": "--sp over --tp", "cp": "--cp"}.get(a, a) for a in axes)
        raise UsageError(f"--seq {seq}: {flags} split{'s' * (len(axes) == 1)} the sequence {n} ways "
                         f"({format_mesh({a: mesh.sizes[a] for a in axes})}); use a --seq that is a multiple of {n}")


def _check_expert_tokens(args: argparse.Namespace, layout: Layout, mesh: MeshShape) -> None:
    """``--multi-data`` against the tokens each rank routes in one microbatch: the MoE input's
    (batch, seq) block, the batch split over its data axes and ``--microbatches``, the sequence
    over cp (:meth:`~dtp.layouts.ExpertOptions.check_tokens`, which ``moe_ffn`` runs in the
    first step: there it failed on the ranks, in the API's words, a pipeline's peers hanging up)."""
    if layout.expert is None:
        return
    cp = layout.degree("seq", mesh)
    rows, seq = args.batch // layout.degree("batch", mesh) // args.microbatches, args.seq // cp
    try:
        layout.expert.check_tokens(rows * seq, what="")
    except ValueError:
        over = [f"{_AXIS_FLAGS.get(a, a)} {mesh.sizes[a]}" for a in layout.mesh_axes("batch", mesh)
                if mesh.sizes[a] > 1]
        split = over[0] if len(over) == 1 else f"({' × '.join(over)})"
        how = f"--batch {args.batch}" + (f" / {split}" if over else "")
        how += f" / --microbatches {args.microbatches}" if args.microbatches > 1 else ""
        of = f"--seq {args.seq}" if cp == 1 else f"(--seq {args.seq} / --cp {cp} = {seq})"
        raise UsageError(f"--multi-data {args.multi_data}: --pipe-experts cuts each local expert's rows into "
                         f"{args.multi_data} pieces, more than the {rows * seq} tokens a rank routes in a "
                         f"microbatch ({how} = {rows} row{'s' * (rows != 1)} × {of}); use --multi-data "
                         f"<= {rows * seq}, or a larger --batch or --seq"
                         + (", or fewer --microbatches" if _fewer_microbatches(args) else "")) from None


def _fewer_microbatches(args: argparse.Namespace) -> bool:
    """Whether "fewer --microbatches" is a way out: they were given (not the default) and
    the schedule runs fewer."""
    fewest = schedules.fewest_microbatches(args.pp_schedule, args.pp) if args.pp > 1 else 1
    return "microbatches" not in getattr(args, "derived", ()) and args.microbatches > fewest


#: The mesh axes, as the flags that size them (Layout.check_sizes' names).
_AXIS_FLAGS = {axis: f"--{axis}" for axis in ("pp", "dp", "ep", "cp", "tp")}

#: The names layouts.context's checks use, as dtp train's flags.
_CONTEXT_FLAGS = {option: flag_of(f) for option, f in CONTEXT_FIELDS.items()}

#: What Layout.check_sizes' messages name, in dtp train's words: the mesh axes and the
#: options' fields as the flags that set them; heads, kv heads and vocabulary are the
#: model's, which no flag sets (--num-experts is a flag).
_SIZE_NAMES = {**_AXIS_FLAGS, **_CONTEXT_FLAGS, "num_experts": flag_of("num_experts"), "model": "(--model, --init-from)"}
