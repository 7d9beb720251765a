"""Loading a Hugging Face Llama onto a dp2 × tp2 mesh: the whole model on every rank
(``models.hf.from_hf`` then ``TrainState.create``) vs each rank reading only its blocks
(``TrainState.from_hf``).

    python benchmarks/hf_load.py --dim 512 --layers 8 --repeats 5

The directory is written once by ``models.hf.to_hf`` (a random Llama of that shape, fp32,
GQA, untied, vocab 32000). Four gloo ranks; rounds alternate the two loads (the order
swapped every round, a barrier before each). Reported per load: the median seconds, the
tensor bytes the rank asked the files for (``hf.bytes_read``), and the ratio sharded /
whole (lower is better). The files stay in the page cache after the first round, so this
times the copy and the placement, not a cold disk. Not a test.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _common import alternating_times, hf_model_config, hf_model_parser  # noqa: E402


def _rank(path: str, repeats: int) -> dict:
    import dtp
    from dtp.models import hf, llama

    mesh = dtp.make_mesh(dp=2, tp=2)
    layout = dtp.layouts.data() + dtp.layouts.megatron()
    opt = dtp.optim.adamw(1e-3)
    cfg = hf.config_from_hf(path)
    read: dict[str, int] = {}

    def whole() -> None:
        before = hf.bytes_read()
        params = hf.from_hf(path)[1]
        dtp.TrainState.create(params, opt, mesh=mesh, layout=layout, axes=llama.param_axes(cfg),
                              axis_sizes=llama.axis_sizes(cfg))
        read["whole"] = hf.bytes_read() - before

    def sharded() -> None:
        before = hf.bytes_read()
        dtp.TrainState.from_hf(path, opt, mesh=mesh, layout=layout)
        read["sharded"] = hf.bytes_read() - before

    whole(), sharded()  # warm-up: the page cache, imports
    times = alternating_times({"whole": whole, "sharded": sharded}, repeats)
    return {name: (statistics.median(t), read[name]) for name, t in times.items()}


def main() -> None:
    args = hf_model_parser(__doc__, repeats=5).parse_args()
    from dtp.models import hf, llama
    from dtp.testing import run

    cfg = hf_model_config(args.dim, args.layers)
    with tempfile.TemporaryDirectory() as path:
        hf.to_hf(cfg, llama.init(cfg), path)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        print(f"Llama dim {args.dim}, {args.layers} layers, {llama.param_count(cfg) / 1e6:.1f} M parameters, "
              f"{size / 2**20:.1f} MiB of safetensors; dp2 × tp2, median of {args.repeats}")
        results = run(_rank, path, args.repeats, world_size=4, timeout=3600)
    print(f"{'rank':>4} {'whole s':>8} {'sharded s':>9} {'ratio':>6} {'whole MiB':>9} {'sharded MiB':>11}")
    for r, res in enumerate(results):
        (tw, bw), (ts, bs) = res["whole"], res["sharded"]
        print(f"{r:>4} {tw:8.3f} {ts:9.3f} {ts / tw:6.2f} {bw / 2**20:9.1f} {bs / 2**20:11.1f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
