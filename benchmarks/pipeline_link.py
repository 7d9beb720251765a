"""The pipeline's hand-overs on a slow link: each schedule's step with and without
``dtp.comm.simulated_link`` on ``pp``, beside what ``dtp.schedules.simulate`` says a hop of
that length costs it.

    python benchmarks/pipeline_link.py --repeats 7
    python benchmarks/pipeline_link.py --hop-ratio 0.5 --schedules 1f1b zbv

The model and step are ``pipeline.py``'s (``--layers`` equal layers ``tanh(x @ w)``,
``--rows`` rows a microbatch, ``--m`` microbatches, sgd), on 2 gloo ranks (pp = 2). The
link's bandwidth is set so that one activation or gradient message (``rows × dim`` fp32)
takes ``--hop-ratio`` × one F action on it: F measured first as the median time of one
stage's layers forward on a microbatch, alone on rank 0.

Since the posting board (:mod:`dtp.comm.board`) a receive's modelled transfer starts when
both its ends have posted, so a receive the runner posted ahead moves while its rank
computes; one posted when needed pays the transfer in full. Each repeat runs every
schedule once without and once with the link (a barrier before each step); medians of
the slower rank's step:

* ``free`` / ``link``: the step without and with the link; ``link / free`` its cost;
* ``sim``: ``simulate(hop=h) / simulate(hop=0)`` at the ideal costs scaled to the measured
  F (F, B = 2F, W = F; I = F where split) and ``h`` the modelled hop: what the link *should*
  cost the schedule if every transfer ran exactly when both ends had posted;
* ``link ms``: the modelled time of the messages a rank received (rank 0 / rank 1), and
  ``exposed``: what the link added to the rank's waits for its inputs (Σ
  ``CommRecord.waited`` of its ``pp`` receives with the link − without) over that time.

The simulation's hop is a latency: every hand-over takes ``h`` and any number move at
once. The link model queues a rank's outgoing messages one after another (one
full-duplex link a rank), so a schedule whose ranks send more messages than its compute
can cover is bandwidth-bound there and falls behind ``sim``: at p = 2 interleaved sends
three messages a microbatch and direction, zbv and dualpipev two, 1f1b one.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pipeline as bench  # noqa: E402

SPLIT = {"zb-h1", "zbv"}  # schedules that run I and W apart


def _f_time(params, rows: int, p: int, repeats: int) -> float:
    """One F action's compute: one stage's layers forward on a microbatch (median)."""
    ws = list(params.values())[: len(params) // p]
    x = torch.randn(rows, ws[0].shape[0])
    times = []
    for _ in range(max(5, repeats)):
        t0 = time.perf_counter()
        y = x
        for w in ws:
            y = torch.tanh(y @ w)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _steps(params, rows: int, m: int, schedules: list[tuple[str, int]], bandwidth: float, warmup: int,
           repeats: int) -> list[dict]:
    """Per schedule: this rank's step seconds without and with the link, Σ waited of its
    pp receives in each, and under the link their Σ modelled seconds, per repeat."""
    import torch.distributed as dist

    import dtp

    torch.set_num_threads(1)
    dim = next(iter(params.values())).shape[0]
    model = bench.make_model(len(params))
    batch = bench.make_batch(m * rows, dim)
    configs = []
    for schedule, v in schedules:
        state = bench._dtp_state(params, schedule, v, 2)
        configs.append(dict(schedule=schedule, v=v, state=state, batch=dtp.shard_batch(batch, state),
                            free=[], link=[], waited=[], waited_free=[], modelled=[]))
    for k in range(warmup + repeats):
        for c in configs:
            for linked in (False, True):
                dist.barrier()
                link = dtp.comm.simulated_link(bandwidth, axes=("pp",)) if linked else contextlib.nullcontext()
                with dtp.comm.comm_log() as log:
                    t0 = time.perf_counter()
                    with link:
                        c["state"], _ = dtp.train_step(model, c["state"], c["batch"], microbatches=m)
                    step = time.perf_counter() - t0
                if k < warmup:
                    continue
                c["link" if linked else "free"].append(step)
                recvs = [r for r in log.records if r.axis == "pp" and r.kind == "recv"]
                c["waited" if linked else "waited_free"].append(sum(r.waited or 0.0 for r in recvs))
                if linked:  # a receive records no bytes (the sender counts them): its size is its shape's
                    c["modelled"].append(sum(math.prod(r.shape) * r.dtype.itemsize for r in recvs) / bandwidth)
    return [{key: c[key] for key in ("schedule", "v", "free", "link", "waited", "waited_free", "modelled")}
            for c in configs]


def main() -> None:
    ap = bench.step_parser(__doc__, steps=None)
    ap.add_argument("--hop-ratio", type=float, default=1.0, help="a message's modelled transfer / one F action")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    from dtp.testing import run

    params = bench.make_params(args.layers, args.dim)
    chosen = [(s, v) for s, v in bench.SCHEDULES if s in args.schedules]
    f = run(_f_time, params, args.rows, 2, args.repeats, world_size=2)[0]
    msg = args.rows * args.dim * 4
    hop = args.hop_ratio * f
    bandwidth = msg / hop
    res = run(_steps, params, args.rows, args.m, chosen, bandwidth, args.warmup, args.repeats, world_size=2,
              timeout=1800)
    print(f"pp=2, {args.layers} layers dim {args.dim}, {args.rows} rows a microbatch, m={args.m}; F (one stage's "
          f"forward on a microbatch) {1e3 * f:.2f} ms; link {bandwidth / 1e6:.1f} MB/s: one {msg / 2 ** 10:.0f} KiB "
          f"message {1e3 * hop:.2f} ms ({args.hop_ratio:g} F); medians of {args.repeats} alternated repeats, "
          f"slower rank")
    print(f"{'schedule':<14}{'free ms':>9}{'link ms':>9}{'link/free':>11}{'sim':>7}"
          f"{'link ms r0/r1':>16}{'exposed r0/r1':>16}")
    for i, (schedule, v) in enumerate(chosen):
        ranks = [r[i] for r in res]

        def slower(key: str) -> float:
            return statistics.median(max(vals) for vals in zip(*(r[key] for r in ranks)))

        free, link = slower("free"), slower("link")
        costs = {"F": f, "B": 2 * f, **({"I": f, "W": f} if schedule in SPLIT else {})}
        sim = bench._sim(schedule, v, 2, args.m, costs, hop=hop)[2] / bench._sim(schedule, v, 2, args.m, costs)[2]
        modelled = [statistics.median(r["modelled"]) for r in ranks]
        exposed = [(statistics.median(r["waited"]) - statistics.median(r["waited_free"])) / t
                   for r, t in zip(ranks, modelled)]
        print(f"{schedule:<14}{1e3 * free:>9.1f}{1e3 * link:>9.1f}{link / free:>11.2f}{sim:>7.2f}"
              f"{'/'.join(f'{1e3 * t:.1f}' for t in modelled):>16}{'/'.join(f'{e:.2f}' for e in exposed):>16}")


if __name__ == "__main__":
    main()
