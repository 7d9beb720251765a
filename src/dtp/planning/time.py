"""How long a step takes on a :class:`~.hardware.Hardware`: :meth:`dtp.planning.Plan.time`.

The model reads what the plan already knows about each rank — its parameters' local shapes
(:func:`.target.stage_leaves`), its collectives (:mod:`.traffic`: kind, mesh axis, bytes,
count) and its pipeline schedule — and costs them:

- **compute**, per pipeline rank and microbatch: every matmul by its own shape on a
  roofline, ``max(2mnk / (peak · matmul_efficiency), bytes / memory_bandwidth)`` (the
  shape dependence: small or thin GEMMs are memory-bound); causal attention by its
  kernel's FLOPs (forward ``4 · q · k̄ · head_dim`` per head, ``k̄`` the mean keys a query
  sees, half the sequence; backward 2.5 × forward, FlashAttention-2's count, which
  recomputes the scores); the elementwise work (norms, residual adds, rotary, the SwiGLU
  gate or the GELU, the loss) by the bytes it moves. Backward's matmuls are twice forward's.
- **recompute**: ``full`` runs each block's forward again in backward, ``selective`` its
  attention core (:mod:`dtp.ops.recompute`'s policies).
- **collectives**, each by α–β on the link its mesh axis's ranks use: the axes are laid
  out outer to inner (``pp, dp, ep, cp, tp``); an axis whose span (its size times the
  sizes inside it) fits in a node is on the intra-node link, else on the inter-node one.
  A collective of ``n`` ranks takes ``steps · latency + bytes sent / realised bandwidth``
  (the link's line rate times its measured efficiency, :class:`~.hardware.Link`) with the
  ring's steps (``2(n−1)`` for an all-reduce, ``n−1`` for the others, 1 for a send); the
  bytes sent are the comm log's own (:func:`dtp.comm.ring_bytes`).
- **what each strategy hides**, by the rule its code follows: ZeRO's
  ``overlap_grad_reduce`` puts the reduce-scatters under backward and
  ``overlap_param_gather`` the all-gathers under the next forward (stage 3 always
  prefetches), a bucket's worth staying exposed; async TP's rings run under the block's
  matmuls; the CP ring's hops under its attention blocks (Ulysses' all-to-alls are on the
  critical path); EP's dispatch under the other lane's compute with ``ep_overlap`` and
  under the other chunks' experts with ``pipe_experts``. What is not hidden is exposed.
  Hidden traffic is assumed not to slow the compute under it.
- **the pipeline**: :func:`dtp.schedules.simulate` of the run's own schedule, fed with
  each stage's modelled F, B and W — their exposed tp, cp and ep collectives included, a
  stage waits on them — and a hand-over's time as its ``hop``; the bubble is its makespan
  less the busiest rank's busy time. The step's own collectives (gradients, ZeRO's, the
  norm) follow the makespan.
- **the optimizer step**: AdamW is memory-bound — each updated parameter's bytes read and
  written (parameter, gradient, two moments, master weights where kept).

MFU is the model's FLOPs per token (``6N + 6·L·d·s``, PaLM's count:
:func:`dtp.models.llama.flops_per_token`; recompute not counted) times tokens per second,
over the devices' dense peak. Not modelled: document masks (attention is taken as plainly
causal), contention between hidden traffic and compute, stragglers, the allocator,
kernel launch latency, the data loader.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import schedules
from ..models import llama
from .hardware import Hardware, Link
from .target import Leaf, Target, schedule
from .traffic import Traffic

__all__ = ["StepTime", "step_time", "busy_bound", "compute_seconds", "optimizer_seconds", "matmul_seconds", "collective_seconds", "axis_link", "axis_sizes"]

# The mesh's order, outer to inner (dtp.config.mesh_axes_of): an axis's ranks sit
# "stride" apart, stride the product of the sizes inside it.
_ORDER = ("pp", "dp", "ep", "cp", "tp")
# FlashAttention-2's backward: 5 matmuls of the forward's 2 (it recomputes the scores).
ATTENTION_BACKWARD = 2.5


@dataclass(frozen=True)
class StepTime:
    """One step's predicted time on ``hardware`` and where it goes (seconds).

    - `compute`: the busiest pipeline rank's forward and backward, recompute excluded.
    - `recompute`, `optimizer`: their own terms.
    - `exposed`: ``{axis: seconds}`` of communication not hidden under compute.
    - `bubble`: pipeline idle time of that rank (0 without a pipeline), hand-overs included.
    - `total`: the step; `tokens_per_s`: per device; `mfu`: model FLOPs / peak.
    """

    hardware: str
    compute: float
    recompute: float
    optimizer: float
    exposed: dict[str, float]
    bubble: float
    total: float
    tokens_per_s: float
    mfu: float
    flops_per_token: float

    def lines(self) -> list[str]:
        """The plan's time lines (``dtp plan --hardware``)."""
        comm = ", ".join(f"{a} {_ms(t)}" for a, t in sorted(self.exposed.items(), key=lambda kv: -kv[1]) if t > 0)
        return [f"step time on {self.hardware}: {_ms(self.total)}, {self.tokens_per_s:,.0f} tokens/s per device, "
                f"MFU {100 * self.mfu:.1f} % (model FLOPs {self.flops_per_token / 1e9:.2f} G/token: 6N + attention)",
                f"  compute {_ms(self.compute)}, recompute {_ms(self.recompute)}, bubble {_ms(self.bubble)}, "
                f"optimizer {_ms(self.optimizer)}, exposed comm {comm or 'none'}"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def matmul_seconds(m: int, k: int, n: int, itemsize: int, hw: Hardware, dtype: str) -> float:
    """One ``(m, k) @ (k, n)`` GEMM on a roofline: compute-bound at the chip's dense peak
    times its efficiency at that size, or memory-bound by the three operands' bytes.

    >>> from dtp.planning.hardware import Chip, Hardware, Link
    >>> link = Link(bandwidth=1e9, latency=0.0)
    >>> hw = Hardware(name="toy", chip=Chip(name="toy", flops={"float32": 1e12}, memory=1e9,
    ...               memory_bandwidth=1e11, matmul_efficiency=0.5), devices_per_node=1,
    ...               intra=link, inter=link, host=link)
    >>> matmul_seconds(1000, 1000, 1000, 4, hw, "float32")   # 2e9 FLOPs at 5e11 FLOP/s
    0.004
    >>> matmul_seconds(1, 1000, 1000, 4, hw, "float32")      # a vector: 4 MB of weights at 1e11 B/s
    4.008e-05
    """
    flops = 2.0 * m * k * n
    compute = flops / (hw.chip.flops[dtype] * hw.chip.matmul_fraction(m, n, k))
    memory = (m * k + k * n + m * n) * itemsize / hw.chip.memory_bandwidth
    return max(compute, memory)


_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
          "all_to_all": lambda n: n - 1, "all_to_all_v": lambda n: n - 1}


def collective_seconds(kind: str, sent: int, ranks: int, link: Link) -> float:
    """One collective of ``ranks`` on ``link``: the ring's steps of latency (``2(n−1)`` for
    an all-reduce, ``n−1`` for the others, one for a point-to-point message) plus the bytes
    this rank sends (the comm log's count) over the link's realised bandwidth.

    >>> link = Link(bandwidth=1e9, latency=1e-5)
    >>> collective_seconds("all_reduce", 1_500_000, 4, link)  # 1 MB ring all-reduce: 6 α + 1.5 MB / β
    0.00156
    """
    steps = _STEPS[kind](ranks) if kind in _STEPS else 1
    return steps * link.latency + sent / link.realised


def axis_sizes(s: Target) -> dict[str, int]:
    """Every axis name the plan's traffic uses, with its size: the mesh's, ``world``, and
    the context-parallel sub-axes (Ulysses' ``cp_uly`` inside the ring's ``cp_ring``, a
    double ring's ``cp_inner`` windows inside ``cp_outer``).

    >>> from dtp import RunConfig
    >>> axis_sizes(Target.of(RunConfig(cp=4, cp_algo="hybrid", ulysses_degree=2, seq=32)))["cp_ring"]
    2
    """
    sizes = dict(s.axes)
    sizes["world"] = s.world
    cp = s.run.cp
    if cp > 1:
        u = s.run.ulysses_degree if s.run.cp_algo == "hybrid" else 1
        sizes["cp_uly"], sizes["cp_ring"] = u, cp // u
        w = s.run.cp_window if s.run.cp_algo in ("double_ring", "hybrid") and s.run.cp_window else 1
        sizes["cp_inner"], sizes["cp_outer"] = w, max(cp // u // w, 1)
    return sizes


def _span(s: Target, axis: str) -> int:
    """How many consecutive ranks ``axis``'s groups span (its size times the strides inside it)."""
    sizes = axis_sizes(s)
    if axis == "world":
        return s.world
    base = axis.split("_")[0]
    inner = 1
    for a in _ORDER[_ORDER.index(base) + 1:]:
        inner *= s.axes.get(a, 1)
    if axis in ("cp_uly", "cp_inner"):   # the inner part of cp
        return inner * sizes[axis]
    if axis in ("cp_ring", "cp_outer"):  # the outer part: strided over the inner part
        return inner * s.run.cp
    return inner * sizes.get(axis, 1)


def axis_link(s: Target, axis: str, hw: Hardware) -> Link:
    """The link ``axis``'s collectives run on: intra-node when its groups fit in a node.

    >>> from dtp import RunConfig
    >>> from dtp.planning.hardware import Chip, Hardware, Link
    >>> nv, ib = Link(bandwidth=3e11, latency=3e-6), Link(bandwidth=2.5e10, latency=5e-6)
    >>> hw = Hardware(name="toy", chip=Chip(name="toy", flops={"bfloat16": 1e15}, memory=8e10,
    ...               memory_bandwidth=2e12, matmul_efficiency=0.8), devices_per_node=8,
    ...               intra=nv, inter=ib, host=ib)
    >>> t = Target.of(RunConfig(dp=4, tp=8, sp=True, batch=8, seq=32, model="small"))
    >>> axis_link(t, "tp", hw) is nv, axis_link(t, "dp", hw) is ib
    (True, True)
    """
    return hw.intra if _span(s, axis) <= hw.devices_per_node else hw.inter


# -------------------------------------------------------------------------- compute


@dataclass(frozen=True)
class _Work:
    """One microbatch's compute on one pipeline rank (seconds)."""

    matmul_fwd: float
    attention_fwd: float
    elementwise_fwd: float
    blocks: int  # transformer blocks on the rank (recompute and hiding rules count them)
    expert_fwd: float  # the routed experts' share of matmul_fwd

    @property
    def forward(self) -> float:
        return self.matmul_fwd + self.attention_fwd + self.elementwise_fwd

    @property
    def backward(self) -> float:
        return 2 * self.matmul_fwd + ATTENTION_BACKWARD * self.attention_fwd + 2 * self.elementwise_fwd


def _is_matmul(leaf: Leaf, has_head: bool, s: Target) -> bool:
    if leaf.path == "embed":  # a lookup; the tied head's matmul where the head is
        return s.cfg.tie_embeddings and has_head
    return len(leaf.local) >= 2


def _work(s: Target, rank_leaves: list[Leaf], hw: Hardware) -> _Work:
    cfg, run, dtype = s.cfg, s.run, s.run.dtype
    item = s.torch_dtype.itemsize
    tokens = s.tokens  # per microbatch, the sequence over cp (SP gathers it for the matmuls)
    has_head = any(leaf.path == "final_norm" for leaf in rank_leaves)
    blocks = sorted({int(leaf.path.split(".")[1]) for leaf in rank_leaves if leaf.path.startswith("layers.")})
    matmul = expert = 0.0
    for leaf in rank_leaves:
        if not _is_matmul(leaf, has_head, s):
            continue
        if len(leaf.local) == 3:  # routed experts (E_local, in, out): top_k of them per token, balanced
            e_local, k_in, n_out = leaf.local
            # Each of the ep group's experts gets tokens·ep·top_k / E of its tokens:
            # tokens·top_k / e_local per local expert.
            t = matmul_seconds(max(tokens * cfg.top_k // e_local, 1), k_in, n_out, item, hw, dtype) * e_local
            matmul += t
            expert += t
            continue
        k_in, n_out = leaf.local[-2], leaf.local[-1]
        if leaf.path in ("embed", "lm_head") and leaf.local[0] > leaf.local[1]:  # (vocab, dim): logits = x @ Wᵀ
            k_in, n_out = leaf.local[1], leaf.local[0]
        matmul += matmul_seconds(tokens, k_in, n_out, item, hw, dtype)
    # Causal attention: each query sees (seq + 1) / 2 keys on average; cp's zigzag
    # balances that work across ranks, Ulysses trades the sequence for heads.
    heads = cfg.n_heads // run.tp
    head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
    attn_flops = 4.0 * tokens * (run.seq + 1) / 2 * head_dim * heads * len(blocks)
    attention = attn_flops / (hw.chip.flops[dtype] * hw.chip.matmul_efficiency)
    # Elementwise bytes a block moves per token in forward: two norms (read, write),
    # two residual adds (two reads, a write), rotary on q and k, the MLP's activation:
    # SwiGLU's gate two reads and a write, GELU's one of each; the loss reads the logits
    # and writes their gradient, in fp32.
    q_dim, kv_dim = heads * head_dim, max(cfg.n_kv_heads // run.tp, 1) * head_dim  # kv heads repeat below tp
    ffn = (cfg.moe_ffn_dim or cfg.ffn_dim) * (cfg.top_k if cfg.num_experts else 1) // run.tp
    act = 3 if cfg.mlp == "swiglu" else 2
    per_block = (2 * 2 * cfg.dim + 2 * 3 * cfg.dim + 2 * (q_dim + kv_dim) + act * ffn) * item
    elementwise = tokens * per_block * len(blocks)
    if has_head:
        elementwise += tokens * (cfg.vocab_size // run.tp) * 4 * 4
    return _Work(matmul, attention, elementwise / hw.chip.memory_bandwidth, len(blocks), expert)


def _recompute(s: Target, w: _Work) -> float:
    if s.run.recompute == "full":
        return w.forward
    if s.run.recompute == "selective":
        return w.attention_fwd
    return 0.0


def _optimizer(s: Target, rank_leaves: list[Leaf], hw: Hardware) -> float:
    n = sum(leaf.numel for leaf in rank_leaves) / (s.run.dp if s.run.zero else 1)
    return optimizer_seconds(n, s.torch_dtype.itemsize, hw)


def optimizer_seconds(n: float, itemsize: int, hw: Hardware) -> float:
    """AdamW over ``n`` parameters of ``itemsize`` bytes (a rank's ZeRO slice, or all it
    holds): memory-bound, it reads the parameter, its gradient and two fp32 moments and
    writes the parameter and the moments; master weights (fp32, kept under mixed
    precision) are read and written too.

    >>> from dtp.planning.hardware import hardware
    >>> round(optimizer_seconds(1e9, 2, hardware("h100-sxm")) * 1e3, 2)   # 1B bf16 parameters: 30 B each
    8.96
    """
    master = 2 * 4 if itemsize < 4 else 0
    return n * (2 * itemsize + itemsize + 4 * 4 + master) / hw.chip.memory_bandwidth


def compute_seconds(s: Target, rank_leaves: list[Leaf], hw: Hardware) -> float:
    """One microbatch's forward and backward on a rank holding ``rank_leaves`` (no
    communication, no recompute): what :func:`step_time` costs its compute by.

    >>> from dtp import RunConfig
    >>> from dtp.planning.target import leaves
    >>> from dtp.planning.hardware import hardware
    >>> s = Target.of(RunConfig(model="llama3-8b", batch=8, seq=4096, dtype="bfloat16"))
    >>> round(compute_seconds(s, leaves(s), hardware("h100-sxm")), 2)
    2.25
    """
    w = _work(s, rank_leaves, hw)
    return w.forward + w.backward


# ---------------------------------------------------------------------- collectives


def _exposed(s: Target, rows: list[Traffic], w: _Work, hw: Hardware) -> tuple[dict[str, float], float, float]:
    """Exposed seconds per axis; of them, those inside the microbatches' forward and
    backward (a block's tp, cp and ep collectives, which a pipeline's stages wait on, so
    the schedule is fed them); and the time of one pipeline hand-over."""
    run, m = s.run, s.run.microbatches
    sizes = axis_sizes(s)
    cost: dict[tuple[str, str], float] = {}
    hop = 0.0
    links: dict[str, Link] = {}
    for r in rows:
        if r.axis not in links:
            links[r.axis] = axis_link(s, r.axis, hw)
        link = links[r.axis]
        t = r.times * collective_seconds(r.kind, r.each, sizes.get(r.axis, 1), link)
        if r.axis == "pp" and r.kind == "send":
            if r.what == "activations":
                hop = max(hop, collective_seconds("send", r.each, 2, link))
            continue
        group = _group(r)
        cost[(r.axis, group)] = cost.get((r.axis, group), 0.0) + t
    fwd, bwd = m * w.forward, m * w.backward
    exposed: dict[str, float] = {}
    in_step = 0.0

    def add(axis: str, seconds: float) -> None:
        nonlocal in_step
        name = axis.split("_")[0] if axis.startswith("cp_") else axis
        exposed[name] = exposed.get(name, 0.0) + max(seconds, 0.0)
        if group in _IN_STEP:
            in_step += max(seconds, 0.0)

    for (axis, group), t in cost.items():
        if group == "zero grad" and run.overlap_grad_reduce:
            add(axis, max(t - bwd, t / max(w.blocks, 1)))  # the last bucket's stays exposed
        elif group in ("zero param", "zero3 param") and (run.overlap_param_gather or run.zero == 3):
            add(axis, max(t - fwd - (bwd if run.zero == 3 else 0), t / max(w.blocks, 1)))
        elif group == "tp block" and run.async_tp:
            add(axis, t - m * 3 * w.matmul_fwd)
        elif group == "cp ring":
            add(axis, t - m * (1 + ATTENTION_BACKWARD) * w.attention_fwd)
        elif group == "ep dispatch" and run.ep_overlap:
            add(axis, t - (fwd + bwd - 3 * m * w.expert_fwd))
        elif group == "ep dispatch" and run.pipe_experts:
            chunks = max(run.multi_data, 1)
            add(axis, max(t - 3 * m * w.expert_fwd, t / chunks))
        else:
            add(axis, t)
    return exposed, in_step, hop


# The groups of collectives inside a microbatch's forward and backward.
_IN_STEP = ("tp block", "cp ring", "cp ulysses", "ep dispatch", "per microbatch")


def _group(r: Traffic) -> str:
    if r.what in ("zero grad", "zero param", "zero3 param"):
        return r.what
    if r.axis == "tp" and r.what in ("sp", "tp", "async tp"):
        return "tp block"
    if r.axis.startswith("cp") and r.kind == "send_recv":
        return "cp ring"
    if r.axis.startswith("cp") and r.kind == "all_to_all":
        return "cp ulysses"
    if r.axis == "ep" and r.kind == "all_to_all_v":
        return "ep dispatch"
    if r.what in ("cross_entropy", "moe counts"):
        return "per microbatch"
    return "other"


# ----------------------------------------------------------------------------- step


def step_time(s: Target, per_stage: list[list[Leaf]], traffic: tuple[tuple[Traffic, ...], ...],
              hw: Hardware) -> StepTime:
    """The step's time (:class:`StepTime`) of target ``s`` on ``hw``, from the plan's
    per-rank leaves and traffic (:meth:`dtp.planning.Plan.time` calls it)."""
    dtype = s.run.dtype
    if dtype not in hw.chip.flops:
        raise ValueError(f"dtp.plan: {hw.name} has no {dtype} peak (it lists {', '.join(sorted(hw.chip.flops))})")
    run, m = s.run, s.run.microbatches
    works = [_work(s, lv, hw) for lv in per_stage]
    recomputes = [_recompute(s, w) for w in works]
    exposed_by_rank, in_steps, hops = zip(*(_exposed(s, list(rows), w, hw) for rows, w in zip(traffic, works)))
    if run.pp > 1:
        p, v = run.pp, s.virtual_stages
        sched = schedule(s)[0]
        where = schedules.placement(run.pp_schedule)
        costs: dict[tuple[int, str], float] = {}
        # A stage's F and B wait on their own tp / cp / ep collectives: a third of a
        # microbatch's in forward, two thirds in backward (backward moves the same
        # activations' gradients twice: dgrad and the re-gathers).
        fs = [(w.forward + c / m / 3) / v for w, c in zip(works, in_steps)]
        bs = [(w.backward + rc + 2 * c / m / 3) / v for w, rc, c in zip(works, recomputes, in_steps)]
        for rank in range(p):
            for c in range(v):
                g = schedules.global_stage(c, rank, p, where)
                costs.update({(g, "F"): fs[rank], (g, "B"): bs[rank], (g, "I"): bs[rank] / 2,
                              (g, "W"): bs[rank] / 2})
        mean_f, mean_b = sum(fs) / p, sum(bs) / p
        runs = _kinds(sched, p)
        line = schedules.simulate(sched, p=p, v=v, m=m, f=mean_f, b=mean_b, hop=max(hops),
                                  stage_costs={k: c for k, c in costs.items() if k in runs})
        busiest = max(range(p), key=lambda r: line.busy[r])
        pipeline = line.makespan
        bubble = pipeline - line.busy[busiest]
    else:
        busiest, bubble = 0, 0.0
        pipeline = m * (works[0].forward + works[0].backward + recomputes[0])
    w = works[busiest]
    optimizer = max(_optimizer(s, lv, hw) for lv in per_stage)
    exposed = exposed_by_rank[busiest]
    # The makespan holds the microbatches' own collectives; the step's (gradients,
    # ZeRO's, the norm) come after it.
    total = pipeline + sum(exposed.values()) - (in_steps[busiest] if run.pp > 1 else 0.0) + optimizer
    if run.pp == 1:
        bubble = 0.0
    tokens = run.batch * run.seq
    per_token = llama.flops_per_token(s.cfg, run.seq)
    tokens_per_s = tokens / total / s.world
    mfu = tokens_per_s * per_token / hw.chip.flops[dtype]
    return StepTime(hw.name, m * (w.forward + w.backward), m * recomputes[busiest], optimizer, exposed, bubble,
                    total, tokens_per_s, mfu, per_token)


def busy_bound(s: Target, per_stage: list[list[Leaf]], traffic: tuple[tuple[Traffic, ...], ...],
               hw: Hardware) -> float:
    """A bound :func:`step_time` never beats, without simulating the schedule: the
    pipeline's makespan replaced by the busiest rank's busy time (no schedule runs a rank's
    actions in less than their sum), the rest of the step as :func:`step_time` costs it.
    Equal to it without a pipeline. :func:`dtp.planning.search` orders layouts by it.

    >>> from dtp import RunConfig
    >>> from dtp.planning.target import leaves, stage_leaves
    >>> from dtp.planning.hardware import hardware
    >>> from dtp.planning.traffic import traffic
    >>> s = Target.of(RunConfig(pp=2, dp=2, microbatches=4, seq=32), backend="nccl")
    >>> per, hw = stage_leaves(s, leaves(s)), hardware("h100-sxm")
    >>> rows = tuple(tuple(traffic(s, lv, i)) for i, lv in enumerate(per))
    >>> busy_bound(s, per, rows, hw) <= step_time(s, per, rows, hw).total
    True
    """
    m = s.run.microbatches
    works = [_work(s, lv, hw) for lv in per_stage]
    exposed, in_steps, _ = zip(*(_exposed(s, list(rows), w, hw) for rows, w in zip(traffic, works)))
    optimizer = max(_optimizer(s, lv, hw) for lv in per_stage)
    if s.run.pp == 1:
        return m * (works[0].forward + works[0].backward + _recompute(s, works[0])) + sum(exposed[0].values()) + \
            optimizer
    # step_time feeds the schedule each rank's F and B with its in-step collectives: m·v
    # actions of each kind whose costs sum to m·(F + B + recompute) + those collectives.
    busy = [m * (w.forward + w.backward + _recompute(s, w)) + c for w, c in zip(works, in_steps)]
    after = min(sum(e.values()) - c for e, c in zip(exposed, in_steps))
    return max(busy) + after + optimizer


def _kinds(schedule: schedules.Schedule, p: int) -> set[tuple[int, str]]:
    """The (global stage, kind) pairs the schedule runs (simulate refuses costs for others)."""
    out = set()
    for rank, actions in enumerate(schedule):
        for a in actions:
            for one in ((a.forward, a.backward) if isinstance(a, schedules.Pair) else (a,)):
                out.add((one.stage(rank, p, schedule.placement), one.kind))
    return out
