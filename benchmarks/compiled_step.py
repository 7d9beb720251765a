"""The compiled step (``train_step(compile=...)``, :mod:`dtp.compiled`) vs the eager one, on CPU.

    python benchmarks/compiled_step.py --configs tiny small --seq 128 --batch 8 --repeats 9

For each layout (world 1: ``make_mesh(dp=1)``, the blocks are the compiled regions; dp=2
and dp=2 ZeRO-3 on 2 gloo ranks: local batch mode, the blocks on plain tensors again; tp=2
+ SP on 2 gloo ranks: the ``local_map`` bodies are), two states from the same weights,
one stepped eagerly and one compiled with ``--backend`` (default inductor), steps
alternated (the order swapped every round, a barrier before each), median of
``--repeats`` each after ``--warmup`` steps (the first compiled step compiles: its time
is printed apart). ``torch.set_num_threads(1)`` in every rank. Reported: ms/step of
each, compiled / eager, the first compiled step's time, graphs and graph breaks.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch
from _common import alternating_times, llama_step_parser

LAYOUTS = {"world 1": 1, "dp2": 2, "dp2 zero3": 2, "tp2 sp": 2}


def _bench(cfg, batch: dict[str, torch.Tensor], layout_name: str, backend: str, warmup: int,
           repeats: int) -> dict:
    import dtp
    from dtp.compiled import CompileOptions
    from dtp.models import llama

    torch.set_num_threads(1)
    if layout_name == "world 1":
        mesh, layout = dtp.make_mesh(dp=1), dtp.layouts.data()
    elif layout_name == "dp2":
        mesh, layout = dtp.make_mesh(dp=2), dtp.layouts.data()
    elif layout_name == "dp2 zero3":
        mesh, layout = dtp.make_mesh(dp=2), dtp.layouts.data() + dtp.layouts.zero(3)
    else:
        mesh, layout = dtp.make_mesh(tp=2), dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=True)
    loss_fn = partial(llama.loss, cfg=cfg)
    boxes, firsts = {}, {}
    for name, compile in (("eager", False), ("compiled", CompileOptions(backend=backend))):
        state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.1), mesh=mesh, layout=layout,
                                      axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
        boxes[name] = {"state": state, "batch": dtp.shard_batch(batch, state), "compile": compile}
        t0 = time.perf_counter()
        boxes[name]["state"], firsts[name] = dtp.train_step(loss_fn, state, boxes[name]["batch"], compile=compile)
        firsts[name]["first"] = time.perf_counter() - t0

    def step(name: str):
        box = boxes[name]
        return lambda: box.__setitem__("state", dtp.train_step(loss_fn, box["state"], box["batch"],
                                                               compile=box["compile"])[0])

    steps = {name: step(name) for name in boxes}
    for _ in range(warmup):
        for s in steps.values():
            s()
    times = alternating_times(steps, repeats)
    return {"eager": statistics.median(times["eager"]), "compiled": statistics.median(times["compiled"]),
            "first": firsts["compiled"]["first"], "graphs": firsts["compiled"]["compile_graphs"],
            "breaks": firsts["compiled"]["compile_breaks"]}


def main() -> None:
    ap = llama_step_parser(__doc__, repeats=9)
    ap.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = ap.parse_args()

    from dtp.models import llama
    from dtp.testing import run

    print(f"backend {args.backend}, fp32, batch {args.batch}, seq {args.seq}, torch.set_num_threads(1), "
          f"median of {args.repeats} alternated steps after {args.warmup}")
    for name in args.configs:
        cfg = llama.config(name)
        g = torch.Generator().manual_seed(1)
        toks = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        batch = {"tokens": toks[:, :-1].contiguous(), "targets": toks[:, 1:].contiguous()}
        for layout in args.layouts:
            r = run(_bench, cfg, batch, layout, args.backend, args.warmup, args.repeats,
                    world_size=LAYOUTS[layout], timeout=1800)[0]
            print(f"{name:6s} {layout:8s} eager {r['eager'] * 1e3:8.1f} ms  compiled {r['compiled'] * 1e3:8.1f} ms  "
                  f"compiled/eager {r['compiled'] / r['eager']:.3f}  (first compiled step {r['first']:.1f} s: "
                  f"{r['graphs']} graphs, {r['breaks']} breaks)", flush=True)


if __name__ == "__main__":
    main()
