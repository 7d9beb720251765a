"""``dtp export``: a run's checkpoint written in another format.

::

    dtp export --hf OUT --run runs/20250101-120000     # its newest checkpoint, as Hugging Face

``--hf`` writes what :func:`dtp.models.hf.to_hf` writes (``config.json``, sharded
``.safetensors`` with their index, vocabulary padding stripped), which transformers'
``AutoModelForCausalLM.from_pretrained(OUT)`` loads. The checkpoint is read on one
process (any layout saved it: checkpoints are logical), so this process holds the whole
model and its optimizer state once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import DTYPES
from .flags import UsageError

__all__ = ["add_parser", "cmd_export"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``export`` subcommand.

    >>> p = argparse.ArgumentParser().add_subparsers(dest="command")
    >>> add_parser(p).parse_args(["--hf", "out", "--run", "runs/r"]).dtype is None
    True
    """
    e = sub.add_parser("export", help="write a run's newest checkpoint as a Hugging Face model directory")
    e.add_argument("--hf", required=True, metavar="OUT",
                   help="the Hugging Face directory to write (config.json, *.safetensors and their index)")
    e.add_argument("--run", required=True, metavar="RUN",
                   help="a dtp train run directory (its newest checkpoint; train with --save-every N) "
                        "or one checkpoint directory (step_*)")
    e.add_argument("--dtype", choices=DTYPES, default=None, help="the dtype written (default: the run's)")
    e.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                   help="the most GiB per .safetensors file (default: transformers' 5)")
    return e


def cmd_export(args: argparse.Namespace) -> int:
    """``dtp export --hf OUT --run RUN``; returns the exit code (bad input: :class:`UsageError`)."""
    import optree
    import torch
    from torch.distributed.tensor import DTensor

    from .. import TrainState, checkpoint, layouts, optim
    from ..models import hf, llama
    from .loop import single_process_world

    run = Path(args.run)
    root = run / "checkpoints" if (run / "checkpoints").is_dir() else run
    try:
        manifest = checkpoint.read_manifest(root)
    except ValueError as e:
        raise UsageError(f"--run {run}: {e}; a run saves checkpoints with --save-every N") from None
    extra = manifest.get("extra") or {}
    if "model" not in extra or "run" not in extra:
        raise UsageError(f"--run {run}: the checkpoint does not record its model (not saved by dtp train)")
    cfg = llama.LlamaConfig(**extra["model"])
    saved = getattr(torch, extra["run"]["dtype"])
    with single_process_world() as mesh:
        # The optimizer the run used (AdamW): the checkpoint's moments must have somewhere to go.
        like = TrainState.create(llama.init(cfg, dtype=saved), optim.adamw(0.0), mesh=mesh, layout=layouts.data(),
                                 axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
        state, _ = checkpoint.load(root, like, restore_rng=False)
        # One rank: each DTensor's local block is the whole tensor (no collective).
        tree = optree.tree_map(lambda x: (x.to_local() if isinstance(x, DTensor) else x).detach(), state.params)
        files = hf.to_hf(cfg, tree, args.hf, dtype=getattr(torch, args.dtype) if args.dtype else saved,
                         max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"dtp export: step {manifest['step']} of {run} -> {args.hf} ({len(files)} file{'s' * (len(files) > 1)})",
          file=sys.stdout)
    return 0

