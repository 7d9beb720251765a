"""How much of the simulated link's idle time is the model's own: ZeRO overlapped steps on
dp=2 gloo ranks under ``dtp.comm.simulated_link``, each dp collective's modelled transfer
set beside the moment both ranks had posted it.

    python benchmarks/link_delay.py --stage 1 --bandwidth 71e6

Both ranks run on this machine, so their ``CommRecord.issued`` times share one clock:
pairing the two ranks' records (same posting order), "every rank posted" is the later of
the two. For each transfer the script takes ``delay = modelled start − max(every rank
posted, the link free)`` (modelled start: completion − the modelled length): time the
modelled link sat idle although the collective was posted everywhere and nothing held the
link. Per kind (summed, rank 0's link), and the idle time all of them cover together (a
stretch two transfers wait through counted once), a step.

Until the posting board (:mod:`dtp.comm.board`), ``simulated_link`` started a transfer
once the real loopback one had finished, and this measured 36–45 ms a step of such delay
(stage 1, five runs; ``benchmarks/notes/2026-11-zero.md``). Now a transfer starts when the last rank
posted it, so what is left is where the real loopback transfer outlasts the modelled one
(completion is the later of the two): the one-element all-reduces (loss, norm: modelled
≈ 0 at latency 0), and any loopback transfer slowed by two busy cores past its model.
``--bandwidth`` 71e6 is about what ``zero_overlap.py --config small --seq 64 --batch 8
--bucket-mb 0.5`` calibrates stage 1 to on this 2-core machine (its communication ≈ its
compute).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from _common import uncovered, union


def _records(bandwidth: float, stage: int, config: str, seq: int, batch: int, bucket_mb: float,
             warmup: int, steps: int) -> list[tuple[str, float, float | None, int]]:
    """This rank's dp records ``(kind, issued, completed, bytes)`` of ``steps`` overlapped
    steps under the link, after ``warmup`` ones."""
    import dtp
    from dtp.models import llama
    from zero_overlap import make_batch

    torch.set_num_threads(1)
    cfg = llama.config(config)
    mesh = dtp.make_mesh(dp=2)
    layout = dtp.layouts.data() + dtp.layouts.zero(stage, overlap_grad_reduce=True, overlap_param_gather=True,
                                                   bucket_mb=bucket_mb)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(1e-3), mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg))
    data = dtp.shard_batch(make_batch(cfg, batch, seq), state)
    loss_fn = partial(llama.loss, cfg=cfg)
    with dtp.comm.simulated_link(bandwidth, 0.0, axes=("dp",)):
        for _ in range(warmup):
            state, _ = dtp.train_step(loss_fn, state, data)
        with dtp.comm_log() as log:
            for _ in range(steps):
                state, _ = dtp.train_step(loss_fn, state, data)
        state.strategy.wait()
    return [(r.kind, r.issued, r.completed, r.bytes) for r in log.records if r.axis == "dp"]


def delays(rank0: list, rank1: list, bandwidth: float) -> tuple[dict[str, list[float]], float, float, float]:
    """Per kind, each transfer's delay on rank 0's link (s): the part of the time from
    "every rank posted" to its modelled start during which the link carried nothing; the
    link idle time the delays cover together (a stretch two transfers wait through counted
    once); the window, from the first posting on every rank to the last modelled end; and
    how much of it the link was busy.

    >>> d, idle, window, busy = delays([("all_reduce", 0.0, 2.5, 50), ("all_gather", 0.0, 3.5, 100)],
    ...                          [("all_reduce", 1.5, 2.5, 50), ("all_gather", 1.0, 3.5, 100)], 100.0)
    >>> d, idle, window, busy   # the gather, posted by 1.0, queued behind the reduce (from 2.0)
    ({'all_reduce': [0.5], 'all_gather': [1.0]}, 1.0, 2.5, 1.5)
    """
    if [r[0] for r in rank0] != [r[0] for r in rank1]:
        raise ValueError("the two ranks' records differ in kind or order")
    transfers = [(c - n / bandwidth, c, max(a[1], b[1]), a[0])
                 for a, b in zip(rank0, rank1) if (c := a[2]) is not None and (n := a[3])]
    if not transfers:
        return {}, 0.0, 0.0, 0.0
    busy = union([(start, end) for start, end, _, _ in transfers])
    first = min(min(t[2] for t in transfers), busy[0][0])  # the window opens at the first posting
    out: dict[str, list[float]] = {}
    for start, _, posted, kind in transfers:
        out.setdefault(kind, []).append(uncovered((posted, start), busy))
    waiting = union([(posted, start) for start, _, posted, _ in transfers])
    idle = sum(uncovered(span, busy) for span in waiting)
    return out, idle, busy[-1][1] - first, sum(e - a for a, e in busy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage", type=int, default=1, choices=[1, 2, 3])
    ap.add_argument("--bandwidth", type=float, default=71e6, help="modelled dp link, bytes/s")
    ap.add_argument("--config", default="small")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--bucket-mb", type=float, default=0.5)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    from dtp.testing import run

    rank0, rank1 = run(_records, args.bandwidth, args.stage, args.config, args.seq, args.batch, args.bucket_mb,
                       args.warmup, args.steps, world_size=2)
    per_kind, idle, window, busy = delays(rank0, rank1, args.bandwidth)
    n = args.steps
    print(f"ZeRO-{args.stage} overlapped, llama {args.config}, batch {args.batch}, seq {args.seq}, dp=2, link "
          f"{args.bandwidth / 1e6:.0f} MB/s; a step: {1e3 * window / n:.1f} ms of window (first posting to last "
          f"modelled end, {n} steps), the link idle {1e3 * (window - busy) / n:.1f} ms of it")
    print(f"{'kind':<16}{'transfers':>10}{'delayed':>9}{'median ms':>11}{'ms a step':>11}")
    for kind, ds in per_kind.items():
        print(f"{kind:<16}{len(ds):>10}{sum(d > 0 for d in ds):>9}{1e3 * statistics.median(ds):>11.2f}"
              f"{1e3 * sum(ds) / n:>11.1f}")
    print(f"of the idle link, while some transfer was posted on every rank (overlapping delays once): "
          f"{1e3 * idle / n:.1f} ms a step")


if __name__ == "__main__":
    main()
