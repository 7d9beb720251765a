"""Pipeline parallel on gloo CPU ranks: the measured bubble of each schedule beside the
simulated one, peak activation memory per stage, and dtp vs ``torch.distributed.pipelining``.

    python benchmarks/pipeline.py --repeats 7

The model: ``--layers`` identical layers ``x -> tanh(x @ w)`` (``w``: ``--dim`` ×
``--dim``, fp32), the first reading ``batch["x"]``, the last also taking the mse against
``batch["y"]``: every layer costs the same, and the layers split evenly into ``pp ×
virtual_stages`` equal-cost stages. A microbatch is ``--rows`` rows whatever ``m`` is (the
global batch is ``m × rows``), so one action costs the same for every ``m``. Mesh:
``dtp.make_mesh(pp=p)`` (a stage is one device: plain tensors), ``dtp.optim.sgd(0.1)``,
one thread per rank.

No ``simulated_link`` here: loopback gloo moves an activation in well under a
millisecond, which is what this table measures the runner on. ``pipeline_link.py`` runs
the same model and schedules under the link (a send's transfer from its posting, a
receive's from when both ends had posted: :mod:`dtp.comm.board`).

First line: the transport's hop, one hand-over of a ``rows × dim`` message measured with
bare ``torch.distributed`` (receive posted ahead, sender computing after its send; from
the send's post to the end of the receiver's wait, ``_pipeline_p2p.hop_latency``). The
bubble table simulates each schedule without it (``sim ms``) and with it per hand-over
between ranks (``+hop``, ``dtp.schedules.simulate(hop=…)``). Second line: the latency of a gloo receive for a message that is already sent while its
sender computes, with the receive posted ahead vs posted when needed. In dtp's runner only
microbatch 0's message of each (kind, stage) carries a 192-byte header (shape, dtype,
placements); once it is read (``Run.meta``), every later body's receive is posted ahead
of the action that needs it (microbatch 0's body is posted after its header is in).

(a) **Bubble.** Inside each rank the runner's action methods (``Run._F/_B/_I/_W`` of
``dtp.strategies.pipeline``), ``Run._take`` (where an action waits for the activation or
gradient it needs) and ``Run.schedule`` are wrapped with timers. ``busy`` is the time inside
actions less the time inside ``_take``: an action's wait is idle, not compute. Per rank and
step, ``bubble = 1 − busy / sched``, where ``sched`` is the rank's ``Run.schedule``: the
action list, the end-of-schedule send waits and the loss all-reduce. ``step`` adds the
update, the gradient-norm all-reduce and ``train_step``'s own work. Every (m, schedule)
configuration runs one step in turn, with a barrier before each, for ``--repeats`` rounds
after ``--warmup``; the table gives medians. Beside the measured bubble:

* ``dtp.schedules.simulate`` per rank (``1 − busy_r / makespan``) with the ideal costs
  (F = 1, B = 2, W = B/2: the formulas of ``dtp.schedules``);
* the same with the measured mean action costs, and its makespan (``sim ms``);
* ``simulate``'s ``bubble_ratio`` (idle / compute) next to the measured ratio (Σ idle / Σ
  busy over the ranks).

(b) **Peak memory.** ``_common.peak_bytes`` (CPU allocator, ``torch.profiler`` memory
events) of one ``train_step`` after warm-up, per rank, at ``--mem-m`` microbatches of
``--mem-rows`` rows. The figure is the transient peak above what lives between steps
(parameters, optimizer state), in MiB and in units of one microbatch's activations on one
stage: the ``tanh`` output of each of the stage's layers. The last stage also keeps its
received input and the mse's difference, about 1.5 units. The runner waits for a
microbatch's activation send at that microbatch's backward (it has been delivered, since
its gradient came back: ``Run.act_sends``), so its buffer is freed there, not at the end of
the schedule.

(c) **dtp vs torch.** ``torch.distributed.pipelining`` runs the same weights. Each rank's
stage(s) is an ``nn.Module`` in a ``PipelineStage`` (shapes inferred on the first step),
under ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` with ``loss_fn =
mse`` (mean per microbatch, gradients scaled by 1/m: ``scale_grads=True``) and
``torch.optim.SGD(lr=0.1)``. One step on both = forward + backward + SGD update. Both post
their receives ahead (torch from shapes inferred on the first step, dtp from microbatch
0's header). Each round runs one step of each, the order alternated every round; a
round's time is the
slower rank's; the table gives medians. The table also gives compute and bubble per rank:
torch's busy time is its stages' ``forward_one_chunk`` / ``backward_one_chunk``, which its
schedules call once the input is in, plus its posting of sends and receives
(``schedules._batch_p2p``, actions of their own there), as dtp's includes the sends its
actions post. dtp's schedule time includes the loss all-reduce, so
its last rank waits there for the first to finish. torch's last rank returns from
``step()`` without that wait, so its rank-1 bubble leaves out the cool-down. Bytes sent
per rank in one steady-state step:

* dtp: its comm log's ``send`` records (bodies; its 192-byte headers, one per (kind,
  stage) channel a step, and two pp all-reduces, loss and gradient norm, are said below
  the table);
* torch: ``torch.distributed.pipelining.schedules._batch_p2p`` is wrapped (every send or
  receive its schedules post goes through it) and the ``isend`` tensors' bytes summed.

The first step's losses of both are printed; they must agree. zb-h1 has no torch
counterpart: torch's zero-bubble schedules are the interleaved/V ones, two stages per rank;
zbv and dualpipev run against torch's ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` on
the same V stage map (a torch schedule that fails on CPU is reported, not timed).

zbv and dualpipev hold two chunks per rank (stages ``r`` and ``2p-1-r``): their action costs
are per chunk, their peaks in chunk-microbatches (half a unit each). DualPipeV's ``F&B``
pairs run as an ``F`` then a ``B`` here (one thread), so ``simulate`` gets ``fb = F + B``.

``--pp 2 4`` also runs the bubble table at p = 4. Four ranks oversubscribe this 2-core
machine, so read those bubbles as a sanity check only.

Not a test: times on a shared 2-core CPU are noisy; read the medians and ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _pipeline_p2p import hop_latency, p2p_latency  # noqa: E402
from _pipeline_torch import StageTimer, rotating_times, torch_chunk  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
# Peak activations per rank as the papers count them (in microbatches of one stage; a V
# schedule's chunk is half a stage): PipeDream-flush, zero bubble, DeepSeek's DualPipe README.
PUBLISHED_PEAK = {"gpipe": "m", "1f1b": "p (rank 0)", "interleaved": "-", "zb-h1": "p",
                  "zbv": "2p chunks = p", "dualpipev": "2p+1 chunks (PP+1)"}
LR = 0.1


# ------------------------------------------------------------------ the model, both ways
def step_parser(doc: str | None, *, steps: int | None) -> argparse.ArgumentParser:
    """The flags the one-table pipeline probes (``pipeline_counts.py``, ``pipeline_cpu.py``,
    ``pipeline_link.py``) share: this benchmark's model and step, one microbatch count, the
    schedules, and ``--steps`` where the probe counts steps (``steps`` its default)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--m", type=int, default=8)
    if steps is not None:
        ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
    return ap


def make_params(layers: int, dim: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(dim, dim, generator=g) / dim ** 0.5 for i in range(layers)}


def make_batch(rows: int, dim: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, dim, generator=g), "y": torch.randn(rows, dim, generator=g).tanh()}


def make_model(layers: int):
    from dtp.models import Layer, Sequential

    def layer(i: int):
        if i == 0:
            return lambda p, x, b: torch.tanh(b["x"] @ p["w0"])
        if i == layers - 1:
            return lambda p, x, b: ((torch.tanh(x @ p[f"w{i}"]) - b["y"]) ** 2).mean()
        return lambda p, x, b: torch.tanh(x @ p[f"w{i}"])

    return Sequential([Layer(layer(i), (f"w{i}",), f"layer {i}") for i in range(layers)])


def _dtp_state(params, schedule: str, v: int, p: int):
    import dtp

    mesh = dtp.make_mesh(pp=p)
    layout = dtp.layouts.pipeline(schedule, virtual_stages=v)
    return dtp.TrainState.create(params, dtp.optim.sgd(LR), mesh=mesh, layout=layout,
                                 axes={k: ("embed", "mlp") for k in params})


# ------------------------------------------------------------------ timing the runner's actions
class _ActionTimer:
    """Wraps ``Run._F/_B/_I/_W``, ``_take`` and ``schedule`` of the pipeline runner (this
    process only; undone by :meth:`restore`, the rank pool is reused)."""

    def __init__(self):
        from dtp.strategies import pipeline as pl

        self.cls = pl.Run
        self.saved = {name: getattr(self.cls, name) for name in ("_F", "_B", "_I", "_W", "_take", "schedule")}
        self.reset()
        timer = self

        def action(kind: str, fn):
            def timed(run, chunk, i, *args, **kwargs):
                if timer.depth:  # _B calls _I: count the outer action only
                    return fn(run, chunk, i, *args, **kwargs)
                timer.depth += 1
                take0, t0 = timer.take, time.perf_counter()
                try:
                    return fn(run, chunk, i, *args, **kwargs)
                finally:
                    busy = time.perf_counter() - t0 - (timer.take - take0)
                    timer.depth -= 1
                    timer.busy += busy
                    timer.costs.setdefault((run.chunks[chunk][0], kind), []).append(busy)
            return timed

        def adding_to(total: str, fn):
            """``fn`` with its wall time added to ``timer.<total>``."""
            def timed(run, *args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return fn(run, *args, **kwargs)
                finally:
                    setattr(timer, total, getattr(timer, total) + time.perf_counter() - t0)
            return timed

        take, schedule = adding_to("take", timer.saved["_take"]), adding_to("wall", timer.saved["schedule"])

        for kind in "FBIW":
            setattr(self.cls, f"_{kind}", action(kind, self.saved[f"_{kind}"]))
        self.cls._take, self.cls.schedule = take, schedule

    def reset(self) -> None:
        self.depth, self.busy, self.take, self.wall = 0, 0.0, 0.0, 0.0
        self.costs: dict[tuple[int, str], list[float]] = {}  # (global stage, kind) -> each action's

    def restore(self) -> None:
        for name, fn in self.saved.items():
            setattr(self.cls, name, fn)


def _bubble(params, rows: int, p: int, ms: list[int], schedules: list[tuple[str, int]], warmup: int,
            repeats: int) -> list[dict]:
    """Every (m, schedule) configuration, one step of each in turn (so load drift on a
    shared machine hits all alike): per step the rank's train_step, schedule, busy and
    wait seconds; the mean cost of each action kind, and of each (stage, kind)."""
    import torch.distributed as dist

    import dtp

    torch.set_num_threads(1)
    dim = next(iter(params.values())).shape[0]
    model = make_model(len(params))
    configs = []
    for m in ms:
        batch = make_batch(m * rows, dim)
        for schedule, v in schedules:
            state = _dtp_state(params, schedule, v, p)
            configs.append(dict(schedule=schedule, v=v, m=m, state=state, batch=dtp.shard_batch(batch, state),
                                steps=[], costs={}))
    timer = _ActionTimer()
    try:
        for k in range(warmup + repeats):
            for c in configs:
                timer.reset()
                dist.barrier()
                t0 = time.perf_counter()
                c["state"], _ = dtp.train_step(model, c["state"], c["batch"], microbatches=c["m"])
                step = time.perf_counter() - t0
                if k >= warmup:
                    c["steps"].append(dict(step=step, wall=timer.wall, busy=timer.busy, take=timer.take))
                    for key, ts in timer.costs.items():
                        c["costs"].setdefault(key, []).extend(ts)
    finally:
        timer.restore()
    out = []
    for c in configs:
        by_kind: dict[str, list[float]] = {}  # every stage's actions of a kind: the mean per kind
        for (_, kind), ts in c["costs"].items():
            by_kind.setdefault(kind, []).extend(ts)
        out.append(dict(schedule=c["schedule"], v=c["v"], m=c["m"], steps=c["steps"],
                        costs={kind: statistics.mean(ts) for kind, ts in by_kind.items()},
                        stage_costs={key: statistics.mean(ts) for key, ts in c["costs"].items()}))
    return out


# ------------------------------------------------------------------ peak memory
@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints two lines per use on fd 2: keep the table readable."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _memory(params, rows: int, p: int, m: int, variants: list[tuple[str, int]]) -> list[dict]:
    import torch.distributed as dist

    import dtp
    from _common import peak_bytes

    torch.set_num_threads(1)
    dim = next(iter(params.values())).shape[0]
    model = make_model(len(params))
    batch = make_batch(m * rows, dim)
    out = []
    for schedule, v in variants:
        state = _dtp_state(params, schedule, v, p)
        placed = dtp.shard_batch(batch, state)
        for _ in range(2):
            state, _ = dtp.train_step(model, state, placed, microbatches=m)
        dist.barrier()
        box = {}

        def step():
            box["state"], _ = dtp.train_step(model, state, placed, microbatches=m)

        with _quiet_stderr():
            peak = peak_bytes(step)
        out.append(dict(schedule=schedule, v=v, peak=peak))
    return out


# ------------------------------------------------------------------ dtp vs torch.distributed.pipelining
def _vs_torch(params, rows: int, p: int, m: int, schedules: list[tuple[str, int]], warmup: int,
              repeats: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.pipelining import schedules as tsched

    import dtp
    from dtp.layouts.pipeline import assign

    torch.set_num_threads(1)
    rank = dist.get_rank()
    dim = next(iter(params.values())).shape[0]
    model = make_model(len(params))
    batch = make_batch(m * rows, dim)
    names = list(params)
    out = []
    timer, stage_timer = _ActionTimer(), StageTimer()
    try:
        for schedule, v in schedules:
            n_stages = p * v
            ranges = assign(len(names), p, v)
            # torch: this rank's stages as dtp places them (r, r+p, …, or the V's r and
            # 2p-1-r), the same weights
            where = dtp.schedules.placement(schedule)
            stages, modules = [], []
            for c in range(v):
                s = dtp.schedules.global_stage(c, rank, p, where)
                mod = torch_chunk([params[names[j]] for j in range(*ranges[s])])
                modules.append(mod)
                stages.append(pipelining.PipelineStage(mod, s, n_stages, torch.device("cpu")))
            cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
            try:
                sched = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=torch.nn.functional.mse_loss)
            except Exception as e:  # noqa: BLE001 (reported in the table: torch refuses this case)
                out.append(dict(schedule=schedule, v=v, error=f"{type(e).__name__}: {e}"[:120]))
                continue
            opt = torch.optim.SGD([w for mod in modules for w in mod.parameters()], lr=LR)
            first = rank == 0
            last = rank == dtp.schedules.stage_owner(n_stages - 1, p, where)[0]
            tbox: dict = {"losses": [], "bubble": [], "busy": []}

            def torch_step():
                opt.zero_grad(set_to_none=True)
                losses: list[torch.Tensor] = []
                args = (batch["x"],) if first else ()
                kwargs = dict(target=batch["y"], losses=losses) if last else {}
                stage_timer.busy = 0.0
                t0 = time.perf_counter()
                sched.step(*args, **kwargs)
                tbox["bubble"].append(1 - stage_timer.busy / (time.perf_counter() - t0))
                tbox["busy"].append(stage_timer.busy)
                opt.step()
                tbox["losses"].append(float(torch.stack(losses).detach().mean()) if last else float("nan"))

            state = _dtp_state(params, schedule, v, p)
            placed = dtp.shard_batch(batch, state)
            dbox = {"state": state, "losses": [], "bubble": [], "busy": []}

            def dtp_step(box=dbox):
                timer.reset()
                box["state"], metrics = dtp.train_step(model, box["state"], placed, microbatches=m)
                box["losses"].append(metrics["loss"])
                box["bubble"].append(1 - timer.busy / timer.wall)
                box["busy"].append(timer.busy)

            dtp_step()
            torch_step()
            first_losses = (dbox["losses"][0], tbox["losses"][0])
            for _ in range(warmup):
                dtp_step()
                torch_step()
            # bytes of one steady-state step of each
            with dtp.comm_log() as log:
                dtp_step()
            sent = [r for r in log.records if r.kind == "send"]
            dtp_bytes = dict(body=sum(r.bytes for r in sent if not r.tag.endswith("header")),
                             header=sum(r.bytes for r in sent if r.tag.endswith("header")), messages=len(sent),
                             other=sum(r.bytes for r in log.records if r.kind not in ("send", "recv")))
            counted = {"bytes": 0, "messages": 0}
            real = tsched._batch_p2p

            def counting(ops, desc=None):
                for op in ops:
                    if op.op is dist.isend:
                        counted["bytes"] += op.tensor.numel() * op.tensor.element_size()
                        counted["messages"] += 1
                return real(ops, desc)

            tsched._batch_p2p = counting
            try:
                torch_step()
            finally:
                tsched._batch_p2p = real
            boxes = {"dtp": dbox, "torch": tbox}
            for box in boxes.values():
                box["bubble"].clear()
                box["busy"].clear()
            times = rotating_times({"dtp": dtp_step, "torch": torch_step}, repeats)
            out.append(dict(schedule=schedule, v=v, times=times, first=first_losses,
                            dtp_bytes=dtp_bytes, torch_bytes=dict(counted),
                            bubble={side: statistics.median(box["bubble"]) for side, box in boxes.items()},
                            busy={side: statistics.median(box["busy"]) for side, box in boxes.items()}))
    finally:
        timer.restore()
        stage_timer.restore()
    return out


# ------------------------------------------------------------------ report
def _sim(schedule: str, v: int, p: int, m: int, costs: dict | None = None, hop: float = 0.0,
         stage_costs: dict | None = None):
    """Per-rank idle fractions, bubble ratio and makespan of ``dtp.schedules.simulate``:
    ideal costs (F = 1, B = 2, W = B/2) or the measured ones (``costs``: seconds, mean
    per kind; with ``stage_costs`` each stage's own, ``(stage, kind) -> seconds``), and
    ``hop`` seconds per hand-over between ranks."""
    from dtp import schedules

    kw: dict = {}
    if costs:
        b = costs["B"] if "B" in costs else costs["I"] + costs["W"]
        kw = dict(f=costs["F"], b=b)
        if "W" in costs:
            kw["w"] = min(costs["W"], b)
    if stage_costs:  # every stage's own costs (a pair: its two actions'); the means stand for the rest
        kw["stage_costs"] = stage_costs
    elif costs:
        kw["fb"] = kw["f"] + kw["b"]
    t = schedules.simulate(schedules.make(schedule, p=p, v=v, m=m), p=p, v=v, m=m, hop=hop, **kw)
    return [1 - b / t.makespan for b in t.busy], t.bubble_ratio, t.makespan


def _ranks(xs) -> str:
    return "/".join(f"{x:.2f}" for x in xs)


def report_bubble(res: list[list[dict]], p: int, layers: int, dim: int, rows: int, repeats: int,
                  hop: float = 0.0) -> None:
    w = 5 * p + 1
    print(f"(a) bubble, p={p}: {layers} layers tanh(x @ w), w {dim}x{dim}, {rows} rows per microbatch, fp32, "
          f"1 thread per rank; median of {repeats} steps (action costs: mean); per rank r0/r1/…")
    print(f"{'schedule':<16}{'m':>3}{'step ms':>9}{'sched ms':>9}{'sim ms':>8}{'+hop':>7}{'busy ms':>9}{'wait ms':>9}"
          f"{'bubble':>{w}}{'sim':>{w}}{'sim@cost':>{w}}{'ratio':>7}{'formula':>8}{'sim@c':>7}   action ms")
    for k, cfg in enumerate(res[0]):
        s, v, m = cfg["schedule"], cfg["v"], cfg["m"]
        per = [rk[k] for rk in res]
        n = len(cfg["steps"])

        def med(fn) -> float:
            return statistics.median(fn(i) for i in range(n))

        step = med(lambda i: max(rk["steps"][i]["step"] for rk in per))
        sched = med(lambda i: max(rk["steps"][i]["wall"] for rk in per))
        busy = med(lambda i: statistics.mean(rk["steps"][i]["busy"] for rk in per))
        take = med(lambda i: statistics.mean(rk["steps"][i]["take"] for rk in per))
        bubble = [statistics.median(1 - st["busy"] / st["wall"] for st in rk["steps"]) for rk in per]
        ratio = med(lambda i: sum(rk["steps"][i]["wall"] - rk["steps"][i]["busy"] for rk in per)
                    / sum(rk["steps"][i]["busy"] for rk in per))
        costs = {kind: statistics.mean(rk["costs"][kind] for rk in per) for kind in per[0]["costs"]}
        ideal, ideal_ratio, _ = _sim(s, v, p, m)
        atcost, cost_ratio, makespan = _sim(s, v, p, m, costs)
        with_hop = _sim(s, v, p, m, costs, hop)[2]
        # Each stage's own measured costs (the first stage has no input gradient, the
        # last a loss: the mean per kind puts their rank's load on both ranks alike).
        staged = {key: c for rk in per for key, c in rk["stage_costs"].items()}
        by_stage = _sim(s, v, p, m, costs, 0.0, staged)[2], _sim(s, v, p, m, costs, hop, staged)[2]
        cfg["ratios"] = (sched / makespan, sched / with_hop, step, sched / by_stage[0], sched / by_stage[1])
        name = s + (f" v={v}" if v > 1 else "")
        acts = " ".join(f"{kind} {1e3 * c:.2f}" for kind, c in sorted(costs.items()))
        print(f"{name:<16}{m:>3}{1e3 * step:>9.1f}{1e3 * sched:>9.1f}{1e3 * makespan:>8.1f}{1e3 * with_hop:>7.1f}"
              f"{1e3 * busy:>9.1f}"
              f"{1e3 * take:>9.1f}{_ranks(bubble):>{w}}{_ranks(ideal):>{w}}{_ranks(atcost):>{w}}{ratio:>7.3f}"
              f"{ideal_ratio:>8.3f}{cost_ratio:>7.3f}   {acts}")
    found = {(c["schedule"], c["m"]): k for k, c in enumerate(res[0])}
    split = []
    for m in sorted({c["m"] for c in res[0]}):
        if ("zb-h1", m) in found and ("1f1b", m) in found:
            zb, ob = found[("zb-h1", m)], found[("1f1b", m)]
            split.append(f"m={m} " + _ranks((rk[zb]["costs"]["I"] + rk[zb]["costs"]["W"]) / rk[ob]["costs"]["B"]
                                            for rk in res))
    if split:
        print("zb-h1's split backward, (I + W) / 1f1b's B per rank: " + "; ".join(split))

    def cost(s: str, m: int, kind: str) -> float:  # mean over ranks, as the table's action ms
        return statistics.mean(rk[found[(s, m)]]["costs"][kind] for rk in res)

    half = [f"m={m} " + " ".join(f"{kind} {cost('interleaved', m, kind) / cost('1f1b', m, kind):.3f}" for kind in "FB")
            for m in sorted({c["m"] for c in res[0]}) if ("interleaved", m) in found and ("1f1b", m) in found]
    if half:  # the fixed cost per action: a half-size action (interleaved's chunk) over a full one (1f1b's stage)
        print("half-size action / full-size (interleaved v=2 / 1f1b, mean over ranks): " + "; ".join(half))
    for m in sorted({c["m"] for c in res[0]}):
        cfgs = [c for c in res[0] if c["m"] == m]
        print(f"m={m} schedule / simulation at the measured costs, without | with the hop of {1e3 * hop:.2f} ms: "
              + ", ".join(f"{c['schedule']} {c['ratios'][0]:.2f} | {c['ratios'][1]:.2f}" for c in cfgs))
        print(f"m={m} schedule / simulation at each stage's measured costs, without | with the hop: "
              + ", ".join(f"{c['schedule']} {c['ratios'][3]:.2f} | {c['ratios'][4]:.2f}" for c in cfgs))
        if ("1f1b", m) in found:
            one = res[0][found[("1f1b", m)]]["ratios"][2]
            print(f"m={m} step / 1f1b's step: " + ", ".join(f"{c['schedule']} {c['ratios'][2] / one:.2f}"
                                                           for c in cfgs if c["schedule"] != "1f1b"))
    print("step = train_step, sched = its Run.schedule (slower rank); sim ms = the makespan simulated with the "
          "measured action costs, +hop = with the measured hop per hand-over between ranks; busy = compute in F/B/I/W, wait = actions waiting for their input (mean over "
          "ranks); bubble = 1 - busy/sched per rank; sim = simulate per rank with F=1 B=2 W=B/2, sim@cost = with "
          "the measured costs; ratio = measured idle/compute over all ranks beside simulate's bubble_ratio "
          "(formula: (p-1)/m, (p-1)/(v·m), zb-h1 ~1/3 of 1f1b's) and with the measured costs (sim@c)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--rows", type=int, default=256, help="rows per microbatch (bubble and torch tables)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2])
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8], help="microbatch counts for the bubble table")
    ap.add_argument("--mem-m", type=int, default=8)
    ap.add_argument("--mem-rows", type=int, default=512, help="rows per microbatch for the memory table")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULES], choices=[s for s, _ in SCHEDULES])
    ap.add_argument("--parts", nargs="+", default=["bubble", "memory", "torch"], choices=["bubble", "memory", "torch"])
    args = ap.parse_args()

    from dtp.testing import run

    params = make_params(args.layers, args.dim)
    chosen = [(s, v) for s, v in SCHEDULES if s in args.schedules]
    if "bubble" in args.parts:
        hop = run(hop_latency, args.rows, args.dim, args.repeats, world_size=2)[0]
        print(f"gloo hop of one {args.rows}x{args.dim} fp32 message, receive posted ahead, sender computing after "
              f"its send (bare torch.distributed, 2 ranks, median of {4 * args.repeats}): {1e3 * hop:.3f} ms")
        lat = run(p2p_latency, args.rows, args.dim, args.repeats, world_size=2)[1]
        print(f"gloo receive of one {args.rows}x{args.dim} fp32 message already sent while its sender computes "
              f"(2 ranks, median of {args.repeats}): {lat['ahead']:.2f} ms with the receive posted ahead, "
              f"{lat['when needed']:.2f} ms posted when needed")
        print()
        for p in args.pp:
            res = run(_bubble, params, args.rows, p, args.m, chosen, args.warmup, args.repeats, world_size=p,
                      timeout=1200)
            report_bubble(res, p, args.layers, args.dim, args.rows, args.repeats, hop)
            print()
    p = args.pp[0]
    if "memory" in args.parts:
        m, rows = args.mem_m, args.mem_rows
        variants = list(chosen)
        res = run(_memory, params, rows, p, m, variants, world_size=p, timeout=1200)
        per_stage = args.layers // p  # layers per stage (v = 1)
        unit = per_stage * rows * args.dim * 4
        pbytes = per_stage * args.dim * args.dim * 4
        print(f"(b) peak memory of one step above what lives between steps (CPU allocator), p={p}, m={m}, "
              f"{rows} rows per microbatch; unit = one microbatch's activations on one stage "
              f"({per_stage} tanh outputs) = {unit / 2 ** 20:.2f} MiB; a stage's parameters = "
              f"{pbytes / 2 ** 20:.2f} MiB")
        print(f"{'schedule':<16}" + "".join(f"{f'rank {r} MiB':>12}{'units':>7}" for r in range(p))
              + "   simulated peak in flight (microbatches) | published")
        from dtp import schedules

        for k, (s, v) in enumerate(variants):
            name = s + (f" v={v}" if v > 1 else "")
            flight = schedules.simulate(schedules.make(s, p=p, v=v, m=m), p=p, v=v, m=m).peak_in_flight
            flight_txt = "/".join(str(n) if v == 1 else f"{n}/{v}" for n in flight)
            print(f"{name:<16}" + "".join(f"{rk[k]['peak'] / 2 ** 20:>12.2f}{rk[k]['peak'] / unit:>7.1f}" for rk in res)
                  + f"   {flight_txt} | {PUBLISHED_PEAK[s]}")
        if any(v > 1 for _, v in variants):
            print("interleaved, zbv and dualpipev count chunk-microbatches in flight: 1/v of a unit each")
        print()
    if "torch" in args.parts:
        m = max(args.m)
        scheds = [(s, v) for s, v in chosen if s in TORCH_SCHEDULES]
        res = run(_vs_torch, params, args.rows, p, m, scheds, args.warmup, args.repeats, world_size=p, timeout=1200)
        print(f"(c) dtp vs torch.distributed.pipelining, p={p}, m={m}: forward + backward + SGD step, slower rank, "
              f"median of {args.repeats} rounds (dtp, torch; order alternated); bytes sent per rank in one step")
        w = 5 * p + 1
        sides = ("dtp", "torch")
        print(f"{'schedule':<16}{'dtp ms':>8}{'torch ms':>9}{'ratio':>7}{'(mins)':>7}"
              f"{'busy dtp':>9}{'torch':>7}{'bubble dtp':>{w + 5}}{'torch':>{w}}"
              f"{'dtp bytes':>{9 * p + 2}}{'torch bytes':>{9 * p + 2}}{'ratio':>7}{'msgs dtp/torch':>16}"
              f"  first loss dtp / torch")
        for k, (s, v) in enumerate(scheds):
            per = [rk[k] for rk in res]
            name = s + (f" v={v}" if v > 1 else "")
            if "error" in per[0]:
                print(f"{name:<16}torch's schedule does not run here: {per[0]['error']}")
                continue
            n = len(per[0]["times"]["dtp"])
            rounds = {side: [max(rk["times"][side][i] for rk in per) for i in range(n)] for side in sides}
            med = {side: statistics.median(rounds[side]) for side in sides}
            mins = min(rounds["dtp"]) / min(rounds["torch"])
            busy = {side: 1e3 * statistics.mean(rk["busy"][side] for rk in per) for side in sides}
            bub = {side: _ranks(rk["bubble"][side] for rk in per) for side in sides}
            db = "/".join(str(rk["dtp_bytes"]["body"]) for rk in per)
            tb = "/".join(str(rk["torch_bytes"]["bytes"]) for rk in per)
            br = sum(rk["dtp_bytes"]["body"] for rk in per) / max(1, sum(rk["torch_bytes"]["bytes"] for rk in per))
            msgs = f"{per[0]['dtp_bytes']['messages']}/{per[0]['torch_bytes']['messages']}"
            dl = next(rk["first"][0] for rk in per)
            tl = next(rk["first"][1] for rk in per if rk["first"][1] == rk["first"][1])
            print(f"{name:<16}{1e3 * med['dtp']:>8.1f}{1e3 * med['torch']:>9.1f}{med['dtp'] / med['torch']:>7.2f}"
                  f"{mins:>7.2f}{busy['dtp']:>9.1f}"
                  f"{busy['torch']:>7.1f}{bub['dtp']:>{w + 5}}{bub['torch']:>{w}}"
                  f"{db:>{9 * p + 2}}{tb:>{9 * p + 2}}{br:>7.3f}{msgs:>16}  {dl:.7f} / {tl:.7f}")
        extra = res[0][0]["dtp_bytes"]
        print("ratio = dtp / torch; (mins) = ratio of the fastest rounds; busy = compute ms per step, mean over ranks (dtp: F/B/I/W less "
              "their waits; torch: its stages' forward/backward_one_chunk and _batch_p2p posting); bubble = 1 - busy / schedule per rank "
              "(dtp: Run.schedule; torch: schedule.step), median; bytes sent per rank r0/r1/…: dtp = its send bodies "
              "(comm log), torch = isend tensors (schedules._batch_p2p wrapped); msgs = rank 0's gloo sends per step "
              f"(dtp: bodies + headers). dtp also sends a 192-byte header per (kind, stage) channel, with "
              f"microbatch 0's message ({extra['header']} bytes a step for {scheds[0][0]}) and {extra['other']} bytes of pp all-reduces (loss, grad norm)")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
