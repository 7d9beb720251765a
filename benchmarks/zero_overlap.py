"""ZeRO 1/2/3 on 2 gloo ranks (dp=2): step time with the communication overlaps
(``overlap_grad_reduce`` + ``overlap_param_gather``) vs without, on a simulated slow link.

    python benchmarks/zero_overlap.py --config small --seq 64 --batch 8 --bucket-mb 0.5 --repeats 7

One training step = forward + backward + AdamW update of ``llama.config(--config)``, fp32,
``layouts.data() + layouts.zero(stage, bucket_mb=..., overlap_*=...)`` on ``make_mesh(dp=2)``.

Loopback gloo on one machine is nearly free, so nothing would be left to hide. The script
therefore puts ``dtp.comm.simulated_link(bandwidth=B, latency=L, axes=("dp",))`` under
the step (each dp collective takes at least ``L + bytes_sent/B``, transfers queued one
after another per rank, see ``dtp.comm``), with ``B`` *measured* per stage so that the
modelled communication of one step equals its compute:

1. ``compute`` = median step time without the link (overlapped variant; the loopback
   collectives are in it, they cost a few ms) — a first estimate sets ``B``;
2. ``bytes`` = ``sum(metrics["comm_bytes"]["dp"].values())`` of one step (per rank, ring
   conventions: stage 1/2 ≈ 2Ψ·(n−1)/n…, stage 3 ≈ 3Ψ), ``ncoll`` = its dp collectives;
3. ``B = bytes / (compute − ncoll·L)``, so ``comm = ncoll·L + bytes/B = compute``.

Then three variants run in short interleaved blocks of ``--block`` + 1 steps (so load
drift on the shared machine hits all alike): no link (the ``compute`` of the table, the
same code as the overlapped one), and under the link without / with the overlaps. Inside a
block the steps run back to back (no barrier between steps: with ``overlap_param_gather``
the forward of step k+1 waits on the all-gathers step k left in flight, so a barrier
would serialise exactly what is meant to overlap; the no-overlap variant runs the same
loop); the block's first step (behind the block's barrier, nothing in flight) is dropped.
``comm`` keeps the first estimate's value. A step's time is the slower rank's; the table
shows medians of ``--repeats`` steps. The ideal overlapped step is ``max(compute, comm)``
(= compute here), the serial one ``compute + comm``. Columns:

* ``ratio`` = overlapped / max(compute, comm) — the goal is ≤ 1.10 for stages 1 and 2,
  ≤ 1.15 for stage 3 at ``prefetch=2``;
* ``exposed`` = (overlapped − compute) / comm — the fraction of communication not hidden
  (1 = nothing hidden, 0 = all hidden);
* ``floor`` = ``max(F, Lf) + max(B, Lb)``: what any schedule of these collectives can
  reach when the parameter gathers start only after the last reduce-scatter has landed
  (dtp's, Megatron's ``--overlap-param-gather``: the update waits for the global norm,
  which needs every gradient bucket), so the gathers' link time ``Lf`` overlaps only the
  forward's compute ``F`` and the reduce-scatters' (+ stage 3's re-gathers) ``Lb`` only
  the backward's ``B``; the update's compute is left out, so it is a lower bound. ``F``
  and ``B`` are ``compute`` split as one no-link step's ``forward`` / ``backward`` spans
  split it; a collective counts in ``Lb`` when it was posted in a backward span.
  ``vs floor`` = overlapped / floor. Were the update's compute nil, forward ⅓ and
  backward ⅔ of the rest and comm = compute, the floor would be ½ + ⅔ = 1.17 ×
  max(compute, comm); the update (AdamW over the slices, whose compute can run under the
  link) brings it down: the stage lines print the split.

Afterwards one overlapped stage-``--timeline-stage`` pair of steps is recorded with
``dtp.comm_log()`` on rank 0 and printed as ``log.timeline()``: a row per compute span
(``step k`` wraps a whole ``train_step``; ``forward`` / ``backward`` / ``update`` are
``train_step``'s own spans) and per collective (posted → completed, modelled link
included). Two steps, because the parameter all-gathers of one step run under the
forward of the next. Last, how long the modelled link sat idle in each span: with comm =
compute a step can only reach max(compute, comm) if the link never idles, so a step's
idle link time is (up to rank skew) what it has above that.

Not a test: times on a shared 2-core CPU are noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from functools import partial

import torch
from _common import uncovered, union


def make_batch(cfg, batch: int, seq: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    return {"tokens": toks[:, :-1].contiguous(), "targets": toks[:, 1:].contiguous()}


def link_idle(log, bandwidth: float, latency: float) -> list[tuple[str, float, float]]:
    """Per span of ``log``: its length and how long the modelled dp link was idle in it
    (ms). A dp collective's modelled transfer ends at its ``completed`` and takes
    ``latency + bytes / bandwidth`` (``dtp.comm.link``), which gives when the link was busy."""
    busy = union([(r.completed - latency - r.bytes / bandwidth, r.completed) for r in log.records
                  if r.axis == "dp" and r.completed is not None and r.bytes])
    return [(sp.name, 1e3 * (sp.end - sp.start), 1e3 * uncovered((sp.start, sp.end), busy)) for sp in log.spans]


def phases(log) -> dict:
    """One step's compute per ``train_step`` span (s) and its dp collectives split by
    whether they were posted in a backward span (``Lb``'s) or not (``Lf``'s: the forward's
    gathers and, stage 1/2, the next forward's, posted in the update) as [bytes, count]."""
    compute = {name: sum(sp.end - sp.start for sp in log.spans if sp.name == name)
               for name in ("forward", "backward", "update")}
    backward = [(sp.start, sp.end) for sp in log.spans if sp.name == "backward"]
    link = {"forward": [0, 0], "backward": [0, 0]}
    for r in log.filter(axis="dp"):
        phase = "backward" if any(a <= r.issued <= b for a, b in backward) else "forward"
        link[phase][0] += r.bytes
        link[phase][1] += 1
    return {"compute": compute, "link": link}


def floor_of(ph: dict, compute: float, bandwidth: float, latency: float) -> float:
    """``max(F, Lf) + max(B, Lb)`` (s) of a step whose compute is ``compute``, split as
    the phases ``ph`` (:func:`phases`) split theirs (the module docstring's ``floor``)."""
    total = sum(ph["compute"].values())
    out = 0.0
    for phase in ("forward", "backward"):
        nbytes, count = ph["link"][phase]
        out += max(compute * ph["compute"][phase] / total, count * latency + nbytes / bandwidth)
    return out


def _bench(cfg, batch: dict, stages: list[str], bucket_mb: float, warmup: int, repeats: int,
           latency: float, timeline_stage: str, width: int, blocks_of: int, prefetch: int = 1) -> dict:
    import torch.distributed as dist

    import dtp
    from dtp.models import llama

    torch.set_num_threads(1)
    mesh = dtp.make_mesh(dp=2)
    loss_fn = partial(llama.loss, cfg=cfg)
    rank = dist.get_rank()

    def new_state(stage: str, overlap: bool):
        # "3k": stage 3 with reshard_after_forward=False (buckets kept from forward to backward)
        extra = {"reshard_after_forward": False} if stage == "3k" else {}
        if stage.startswith("3"):
            extra["prefetch"] = prefetch
        layout = dtp.layouts.data() + dtp.layouts.zero(int(stage[0]), overlap_grad_reduce=overlap, **extra,
                                                       overlap_param_gather=overlap, bucket_mb=bucket_mb)
        return dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(1e-3), mesh=mesh, layout=layout,
                                     axes=llama.param_axes(cfg))

    def block(box: dict, n: int, bandwidth: float | None) -> list[float]:
        """n steps back to back (no barrier between them); the block starts behind a barrier
        and ends by waiting for the parameter all-gathers still in flight (not timed)."""
        link = (dtp.comm.simulated_link(bandwidth, latency, axes=("dp",)) if bandwidth
                else contextlib.nullcontext())
        times = []
        with link:
            dist.barrier()
            for _ in range(n):
                t0 = time.perf_counter()
                box["state"], box["m"] = dtp.train_step(loss_fn, box["state"], box["batch"])
                times.append(time.perf_counter() - t0)
            box["state"].strategy.wait()
        return times

    out: dict = {"stages": {}}
    for stage in stages:
        boxes = {}
        for overlap in (False, True):
            st = new_state(stage, overlap)
            boxes[overlap] = {"state": st, "batch": dtp.shard_batch(batch, st)}
        # Without the link: warm up (the first step fixes the buckets), then a first
        # compute time, which sets the link's bandwidth.
        for overlap in (False, True):
            block(boxes[overlap], warmup, None)
        first = block(boxes[True], 5, None)
        with dtp.comm_log() as log:
            block(boxes[True], 1, None)
        recs = log.filter(axis="dp")
        nbytes, ncoll = sum(r.bytes for r in recs), len(recs)
        ph = phases(log)
        kinds: dict[str, list[int]] = {}
        for r in recs:
            kinds.setdefault(r.kind, [0, 0])
            kinds[r.kind][0] += 1
            kinds[r.kind][1] += r.bytes
        # Both ranks must model the same link: agree on the (slower rank's) compute time.
        c = torch.tensor([statistics.median(first)], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.MAX)
        if float(c) <= ncoll * latency:
            raise ValueError(f"--latency {latency} × {ncoll} collectives exceeds the compute time {float(c):.3f}s")
        bandwidth = nbytes / (float(c) - ncoll * latency)
        # Then the three variants in short interleaved blocks (so load drift on a shared
        # machine hits all alike): compute (overlap, no link), no-overlap and overlap under
        # the link. Each block's first step (behind the block's barrier, nothing in flight)
        # is dropped; the rest are steady-state back-to-back steps.
        free, linked = {True: []}, {False: [], True: []}
        per_block = blocks_of + 1
        for _ in range(-(-repeats // blocks_of)):
            free[True] += block(boxes[True], per_block, None)[1:]
            for overlap in (False, True):
                linked[overlap] += block(boxes[overlap], per_block, bandwidth)[1:]
        free = {k: v[:repeats] for k, v in free.items()}
        linked = {k: v[:repeats] for k, v in linked.items()}
        compute = statistics.median(free[True])
        res = dict(free=free, linked=linked, compute=compute, bytes=nbytes, ncoll=ncoll, kinds=kinds,
                   bandwidth=bandwidth, comm=ncoll * latency + nbytes / bandwidth,
                   buckets=len(boxes[True]["state"].strategy.plan.buckets),
                   floor=floor_of(ph, compute, bandwidth, latency), phases=ph["compute"],
                   loss=[boxes[False]["m"]["loss"], boxes[True]["m"]["loss"]])
        if stage == timeline_stage:
            box = boxes[True]
            with dtp.comm.simulated_link(bandwidth, latency, axes=("dp",)):
                dist.barrier()
                for _ in range(2):  # back into the steady state after the barrier
                    box["state"], _ = dtp.train_step(loss_fn, box["state"], box["batch"])
                with dtp.comm_log() as tl:
                    for k in range(2):
                        with dtp.comm.span(f"step {k}"):
                            box["state"], _ = dtp.train_step(loss_fn, box["state"], box["batch"])
                box["state"].strategy.wait()
            if rank == 0:
                res["timeline"] = tl.timeline(width)
                summary = []
                for sp in tl.spans:
                    hits = [r for r in tl.overlapping(sp) if r.axis == "dp"]
                    by: dict[str, int] = {}
                    for r in hits:
                        key = f"{r.kind} ({r.tag.split(' bucket')[0]})" if r.tag else r.kind
                        by[key] = by.get(key, 0) + 1
                    summary.append((sp.name, 1e3 * (sp.end - sp.start), by))
                res["overlap_summary"] = summary
                res["link_idle"] = link_idle(tl, bandwidth, latency)
        out["stages"][stage] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="small", help="llama.config name")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (split over dp=2)")
    ap.add_argument("--stages", nargs="+", default=["1", "2", "3", "3k"], choices=["1", "2", "3", "3k"],
                    help="3k: stage 3 with reshard_after_forward=False")
    ap.add_argument("--bucket-mb", type=float, default=0.5)
    ap.add_argument("--latency", type=float, default=0.0, help="modelled seconds per collective")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--block", type=int, default=3, help="measured steps per interleaved block")
    ap.add_argument("--timeline-stage", default="2", help="print the overlapped timeline of this stage")
    ap.add_argument("--prefetch", type=int, default=1, help="stage 3: buckets gathered ahead (layouts.zero prefetch)")
    ap.add_argument("--width", type=int, default=80)
    args = ap.parse_args()

    from dtp.models import llama
    from dtp.testing import run

    cfg = llama.config(args.config)
    batch = make_batch(cfg, args.batch, args.seq)
    res = run(_bench, cfg, batch, args.stages, args.bucket_mb, args.warmup, args.repeats, args.latency,
              args.timeline_stage, args.width, args.block, args.prefetch, world_size=2, timeout=1800)

    def med(key: str, stage: int, overlap: bool) -> float:
        per_iter = [max(rk["stages"][stage][key][overlap][i] for rk in res) for i in range(args.repeats)]
        return statistics.median(per_iter)

    r0 = res[0]["stages"]
    for stage in args.stages:
        s = r0[stage]
        kinds = ", ".join(f"{k} {c}× {b}" for k, (c, b) in sorted(s["kinds"].items()))
        split = " / ".join(f"{v / sum(s['phases'].values()):.2f}" for v in s["phases"].values())
        print(f"[stage {stage}] {s['buckets']} buckets; dp collectives per step: {kinds} bytes; "
              f"link B = {s['bandwidth'] / 1e6:.1f} MB/s; last losses no-overlap {s['loss'][0]:.6f}, "
              f"overlap {s['loss'][1]:.6f}; compute split forward / backward / update {split}")
    print()
    print(f"llama {args.config} ({llama.param_count(cfg)} params), fp32, AdamW, dp=2 gloo ranks (1 thread each), "
          f"batch {args.batch}, seq {args.seq}, bucket_mb {args.bucket_mb}, link latency {args.latency}s; "
          f"median of {args.repeats} back-to-back steps after {args.warmup} warm-up, slower rank")
    print(f"{'stage':<6}{'buckets':>8}{'bytes/step':>12}{'compute ms':>11}{'comm ms':>9}{'no-overlap':>11}"
          f"{'overlap':>9}{'ratio':>7}{'exposed':>9}{'serial':>8}{'floor ms':>9}{'floor/max':>10}{'vs floor':>9}")
    for stage in args.stages:
        s = r0[stage]
        c, comm = 1e3 * med("free", stage, True), 1e3 * s["comm"]
        no, ov = 1e3 * med("linked", stage, False), 1e3 * med("linked", stage, True)
        fl = 1e3 * max(rk["stages"][stage]["floor"] for rk in res)  # the slower rank's, as the steps
        print(f"{stage:<6}{s['buckets']:>8}{s['bytes']:>12}{c:>11.1f}{comm:>9.1f}{no:>11.1f}{ov:>9.1f}"
              f"{ov / max(c, comm):>7.2f}{(ov - c) / comm:>9.2f}{no / (c + comm):>8.2f}{fl:>9.1f}"
              f"{fl / max(c, comm):>10.2f}{ov / fl:>9.2f}")
    print("ratio = overlap / max(compute, comm) (goal <= 1.10 for stages 1, 2; <= 1.15 for 3 at --prefetch 2); "
          "exposed = (overlap - compute) / comm; "
          "serial = no-overlap / (compute + comm); floor = max(F, Lf) + max(B, Lb), gathers after the last "
          "reduce-scatter (docstring); vs floor = overlap / floor")
    ts = args.timeline_stage
    if ts in r0 and "timeline" in r0[ts]:
        print()
        print(f"stage {ts}, overlapped, two consecutive steps under the link (rank 0):")
        print(r0[ts]["timeline"])
        print()
        print("dp collectives in flight during each span (CommLog.overlapping):")
        for name, ms, by in r0[ts]["overlap_summary"]:
            what = ", ".join(f"{v}× {k}" for k, v in by.items()) or "-"
            print(f"  {name:<9}{ms:>8.1f} ms  {what}")
        print()
        print("modelled dp link idle during each span (a step's idle link time is what overlap cannot hide):")
        for name, ms, idle in r0[ts]["link_idle"]:
            print(f"  {name:<9}{ms:>8.1f} ms  idle {idle:6.1f} ms ({idle / ms:.0%})")


if __name__ == "__main__":
    main()
