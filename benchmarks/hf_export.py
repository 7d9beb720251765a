"""``dtp export --hf``'s peak resident memory: streamed (one parameter at a time from the
checkpoint, no optimizer state) vs the whole state loaded first (what the export did
before: ``TrainState.create`` + ``checkpoint.load`` with its AdamW moments, then
``to_hf``).

    python benchmarks/hf_export.py --dim 512 --layers 8 --repeats 3

A random fp32 Llama of that shape (GQA, untied, vocab 32000) is saved once as a
``dtp train``-style checkpoint (parameters + AdamW moments). Each export runs in a fresh
process, the two kinds alternating; each reports its peak RSS (``VmHWM``) less the
RSS of a process that only imported them (torch, DCP, dtp) (measured the same way, alternated
too). Reported: the median over repeats, in MiB, as a multiple of the model's parameter
bytes and of its largest tensor (the embedding). Not a test.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import hf_model_config, hf_model_parser  # noqa: E402

# Every process imports what both exports use first (DCP's modules alone are ~80 MiB).
_IMPORTS = ("import sys, torch; torch.set_num_threads(1); import torch.distributed.checkpoint, dtp, dtp.checkpoint, "
            "dtp.models.hf; from dtp import cli\n")
# VmHWM: this process's own peak (ru_maxrss would carry the parent's peak across fork + exec)
_PEAK = "print([int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
# --overwrite: every repeat writes over the last one's model (without it the export is refused, rc 2)
_STREAMED = "assert cli.main(['export', '--hf', sys.argv[1] + '/out-s', '--run', sys.argv[1] + '/run', '--overwrite']) == 0\n"
_WHOLE = """
from dtp import TrainState, checkpoint, layouts, optim
from dtp.cli.loop import single_process_world
from dtp.models import hf, llama
import optree
root = sys.argv[1] + '/run/checkpoints'
cfg = llama.LlamaConfig(**checkpoint.read_manifest(root)['extra']['model'])
with single_process_world() as mesh:
    like = TrainState.create(llama.init(cfg), optim.adamw(0.0), mesh=mesh, layout=layouts.data(),
                             axes=llama.param_axes(cfg))
    state, _ = checkpoint.load(root, like, restore_rng=False)
    tree = optree.tree_map(lambda x: x.to_local().detach() if hasattr(x, 'to_local') else x.detach(), state.params)
    hf.to_hf(cfg, tree, sys.argv[1] + '/out-w')
"""


def _peak(body: str, path: str) -> int:
    out = subprocess.run([sys.executable, "-c", _IMPORTS + body + _PEAK, path], check=True, capture_output=True,
                         text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args = hf_model_parser(__doc__, repeats=3).parse_args()
    import dtp
    from dtp.cli.loop import single_process_world
    from dtp.models import llama

    cfg = hf_model_config(args.dim, args.layers)
    model_bytes = llama.param_count(cfg) * 4
    with tempfile.TemporaryDirectory() as path:
        with single_process_world() as mesh:
            state = dtp.TrainState.create(llama.init(cfg), dtp.optim.adamw(1e-3), mesh=mesh,
                                          layout=dtp.layouts.data(), axes=llama.param_axes(cfg))
            state = state.replace(opt_state=dtp.optim.adamw(1e-3).init(state.params))
            dtp.checkpoint.save(state, os.path.join(path, "run", "checkpoints"),
                                extra={"model": dataclasses.asdict(cfg), "run": {"dtype": "float32"}})
            del state
        peaks: dict[str, list[int]] = {"imports": [], "streamed": [], "whole": []}
        bodies = {"imports": "", "streamed": _STREAMED, "whole": _WHOLE}
        for r in range(args.repeats):
            for name in list(bodies)[r % 3:] + list(bodies)[:r % 3]:  # each takes each place equally often
                peaks[name].append(_peak(bodies[name], path))
    base = statistics.median(peaks["imports"])
    print(f"Llama dim {args.dim}, {args.layers} layers, {llama.param_count(cfg) / 1e6:.1f} M parameters, "
          f"{model_bytes / 2**20:.1f} MiB fp32 (+ 2x that in AdamW moments); peak RSS above imports "
          f"({base / 2**20:.0f} MiB), median of {args.repeats}")
    largest = cfg.vocab_size * cfg.dim * 4
    print(f"{'export':>9} {'MiB':>8} {'x model':>8} {'x largest tensor':>17}")
    for name in ("streamed", "whole"):
        extra = statistics.median(peaks[name]) - base
        print(f"{name:>9} {extra / 2**20:8.1f} {extra / model_bytes:8.2f} {extra / largest:17.2f}")


if __name__ == "__main__":
    main()
