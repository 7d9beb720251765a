"""How long a step takes on a :class:`~.hardware.Hardware`: :meth:`dtp.planning.Plan.time`.

The model reads what the plan already knows about each rank — its parameters' local shapes
(:func:`.target.stage_leaves`), its collectives (:mod:`.traffic`: kind, mesh axis, bytes,
count) and its pipeline schedule — and costs them:

- **compute**, per pipeline rank and microbatch: every matmul by its own shape on a
  roofline, ``max(2mnk / (peak · matmul_efficiency), bytes / memory_bandwidth)`` (the
  shape dependence: small or thin GEMMs are memory-bound); causal attention by its
  kernel's FLOPs (forward ``4 · q · k̄ · head_dim`` per head, ``k̄`` the mean keys a query
  sees, half the sequence; backward 2.5 × forward, FlashAttention-2's count, which
  recomputes the scores) at the chip's attention figure for the keys one call sees and
  its head width (:meth:`~.hardware.Chip.attention_fraction`: measured, else the GEMM
  figure); the elementwise work (norms, residual adds, rotary, the SwiGLU gate or a GELU MLP's GELU, the loss,
  the embedding) by the bytes its unfused ops move as the eager code runs them — each op
  reads its operands and writes its result, forward and backward counted op by op
  (:data:`_RES_F` and the table beside it); each op's fixed cost, the chip's
  ``op_overhead`` times the ops counted the same way (:data:`_OPS_BLOCK`); from the second
  microbatch on, each gradient added into the step's. Backward's matmuls are twice
  forward's.
- **recompute**: ``full`` runs each block's forward again in backward, ``selective`` its
  attention core (:mod:`dtp.ops.recompute`'s policies).
- **collectives**, each by α–β on the link its mesh axis's ranks use: the axes are laid
  out outer to inner (``pp, dp, ep, cp, tp``); an axis whose span (its size times the
  sizes inside it) fits in a node is on the intra-node link, else on the inter-node one.
  A collective of ``n`` ranks takes its fixed cost ``+ bytes sent / realised bandwidth``
  (the link's line rate times its measured efficiency, :class:`~.hardware.Link`); the
  fixed cost is the link's measured one for that kind among ``n`` ranks where it has one
  (``collective_latency``), else the ring's steps of latency (``2(n−1)`` for an
  all-reduce, ``n−1`` for the others, 1 for a send); the bytes sent are the comm log's
  own (:func:`dtp.comm.ring_bytes`).
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
- **the optimizer step**: the gradient clip and AdamW are memory-bound — their foreach
  ops' passes over each updated parameter (:data:`_ADAMW_PASSES`, in fp32 over master
  weights where kept), and the step's own ops' fixed costs.

MFU is the model's FLOPs per token (``6N + 6·L·d·s``, PaLM's count:
:func:`dtp.models.llama.flops_per_token`; recompute not counted) times tokens per second,
over the devices' dense peak. Not modelled: document masks (attention is taken as plainly
causal), contention between hidden traffic and compute, stragglers and the wait for the
last rank of a collective beyond its measured fixed cost, the allocator, the data loader;
ops' fixed costs above the plain tensors' (a DTensor op's sharding propagation, tp's
redistributions in Python, views), an MoE block's router and dispatch bytes (its ops are
counted), biases and qk-norm's bytes, the fp32 insides of a half-precision norm, fusion
by ``torch.compile``; a GPU preset has no ``op_overhead`` (its launches run ahead of the
kernels) and runs attention at its GEMM figure (FlashAttention-2 reaches 50–73 % of an
A100's peak, arXiv:2307.08691, by shape: no one figure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import schedules
from ..core._rules import accum_dtype
from ..models import llama
from .hardware import Hardware, Link
from .target import Leaf, Target, by_leaves, schedule
from .traffic import Traffic

__all__ = ["StepTime", "step_time", "stage_works", "busy_bound", "compute_seconds", "optimizer_seconds", "matmul_seconds", "collective_seconds", "axis_link", "axis_sizes"]

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
    """One collective of ``ranks`` on ``link``: its fixed cost plus the bytes this rank
    sends (the comm log's count) over the link's realised bandwidth. The fixed cost is the
    link's measured one for that kind and group size (:meth:`~.hardware.Link.fixed`; an
    all-to-all-v as an all-to-all), else the ring's steps of latency (``2(n−1)`` for an
    all-reduce, ``n−1`` for the others, one for a point-to-point message).

    >>> link = Link(bandwidth=1e9, latency=1e-5)
    >>> collective_seconds("all_reduce", 1_500_000, 4, link)  # 1 MB ring all-reduce: 6 α + 1.5 MB / β
    0.00156
    >>> measured = Link(bandwidth=1e9, latency=1e-5, collective_latency=(("all_reduce", 4, 2e-3),))
    >>> collective_seconds("all_reduce", 1_500_000, 4, measured)  # 2 ms measured + 1.5 MB / β
    0.0035
    """
    fixed = link.fixed("all_to_all" if kind == "all_to_all_v" else kind, ranks) if kind in _STEPS else None
    if fixed is None:
        fixed = (_STEPS[kind](ranks) if kind in _STEPS else 1) * link.latency
    return fixed + sent / link.realised


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
    elementwise_fwd: float  # the unfused ops' bytes and fixed costs
    blocks: int  # transformer blocks on the rank (recompute and hiding rules count them)
    expert_fwd: float  # the routed experts' share of matmul_fwd
    elementwise_bwd: float  # backward's, the gradients' accumulation over microbatches in

    @property
    def forward(self) -> float:
        return self.matmul_fwd + self.attention_fwd + self.elementwise_fwd

    @property
    def backward(self) -> float:
        return 2 * self.matmul_fwd + ATTENTION_BACKWARD * self.attention_fwd + self.elementwise_bwd


def _is_matmul(leaf: Leaf, has_head: bool, s: Target) -> bool:
    if leaf.path == "embed":  # a lookup; the tied head's matmul where the head is
        return s.cfg.tie_embeddings and has_head
    return len(leaf.local) >= 2


@dataclass(frozen=True)
class _Held:
    """A rank's leaves as its compute reads them (matmuls by shape: a 70B's 723 leaves hold a handful)."""

    dense: tuple[tuple[tuple[int, int], int], ...]  # ((k_in, n_out), count)
    routed: tuple[tuple[tuple[int, int, int], int], ...]  # ((E_local, in, out), count)
    blocks: tuple[int, ...]
    has_head: bool
    has_embed: bool
    grads: int
    count: int


def _held(s: Target, rank_leaves: Sequence[Leaf]) -> _Held:
    has_head = any(leaf.path == "final_norm" for leaf in rank_leaves)
    dense: dict[tuple[int, int], int] = {}
    routed: dict[tuple[int, int, int], int] = {}
    for leaf in rank_leaves:
        if not _is_matmul(leaf, has_head, s):
            continue
        if len(leaf.local) == 3:  # routed experts (E_local, in, out)
            routed[leaf.local] = routed.get(leaf.local, 0) + 1  # type: ignore[index]
            continue
        k_in, n_out = leaf.local[-2], leaf.local[-1]
        if leaf.path in ("embed", "lm_head") and leaf.local[0] > leaf.local[1]:  # (vocab, dim): logits = x @ Wᵀ
            k_in, n_out = leaf.local[1], leaf.local[0]
        dense[(k_in, n_out)] = dense.get((k_in, n_out), 0) + 1
    return _Held(tuple(dense.items()), tuple(routed.items()),
                 tuple(sorted({leaf.block for leaf in rank_leaves if leaf.block is not None})), has_head,
                 any(leaf.path == "embed" for leaf in rank_leaves), sum(leaf.numel for leaf in rank_leaves),
                 len(rank_leaves))


def _work(s: Target, rank_leaves: Sequence[Leaf], hw: Hardware) -> _Work:
    cfg, run, dtype = s.cfg, s.run, s.run.dtype
    item = s.torch_dtype.itemsize
    tokens = s.tokens  # per microbatch, the sequence over cp (SP gathers it for the matmuls)
    held = by_leaves("held", rank_leaves, (s.cfg.tie_embeddings,), lambda: _held(s, rank_leaves))
    matmul = sum(n * matmul_seconds(tokens, k_in, n_out, item, hw, dtype) for (k_in, n_out), n in held.dense)
    # Routed experts, top_k of them per token, balanced: each of the ep group's experts
    # gets tokens·ep·top_k / E of its tokens, tokens·top_k / e_local per local expert.
    expert = sum(n * e_local * matmul_seconds(max(tokens * cfg.top_k // e_local, 1), k_in, n_out, item, hw, dtype)
                 for (e_local, k_in, n_out), n in held.routed)
    matmul += expert
    # Causal attention: each query sees (seq + 1) / 2 keys on average; cp's zigzag
    # balances that work across ranks, Ulysses trades the sequence for heads. Its rate is
    # the chip's attention figure at the keys one SDPA call sees (a ring's block).
    heads = cfg.n_heads // run.tp
    head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
    attn_flops = 4.0 * tokens * (run.seq + 1) / 2 * head_dim * heads * len(held.blocks)
    ring = run.cp // (run.ulysses_degree if run.cp_algo == "hybrid" else run.cp if run.cp_algo == "ulysses" else 1)
    attention = attn_flops / (hw.chip.flops[dtype] * hw.chip.attention_fraction(run.seq // ring, head_dim))
    q_dim, kv_dim = heads * head_dim, max(cfg.n_kv_heads // run.tp, 1) * head_dim  # kv heads repeat below tp
    ffn = (cfg.moe_ffn_dim or cfg.ffn_dim) * (cfg.top_k if cfg.num_experts else 1) // run.tp
    moe = sum(llama.is_moe(cfg, i) for i in held.blocks)
    fwd, bwd, ops_f, ops_b = _unfused(s, q_dim, kv_dim, ffn, len(held.blocks), moe, held.has_head, held.has_embed)
    # From the second microbatch on, each gradient is added into the step's (read two, write one).
    extra = (run.microbatches - 1) / run.microbatches
    bwd += extra * 3 * held.grads * accum_dtype(s.torch_dtype).itemsize
    ops_b += extra * held.count
    bw, op = hw.chip.memory_bandwidth, hw.chip.op_overhead
    return _Work(matmul, attention, fwd / bw + op * ops_f, len(held.blocks), expert, bwd / bw + op * ops_b)


# What eager code moves and runs outside the matmuls and attention, counted from the code
# (a TorchDispatchMode over the tiny model's step: tests/test_plan_time.py checks these).
# Each unfused op reads its operands and writes its result, so a block's elementwise bytes
# per token are sums of its tensors' widths: d (dim) on the residual stream's tokens, the
# local q, kv and ffn widths on the gathered ones.
# - forward, a block: two RMSNorms of 7d (pow 2d, mean d, x·r 2d, ·w 2d), two residual
#   adds of 3d; rotary 9 widths on q and on k (x·cos 2, the halves' cat 2, ·sin 2, add 3);
#   SwiGLU silu 2f and the product 3f.
# - backward, a block: two norms of 24d (w's gradient 3d + 1d sum, ·w 2d, r's 3d + 1d,
#   ·r 2d, the mean's div, pow and two muls 9d, the two paths' add 3d) and the residual's
#   gradient add 3d each; on the gathered tokens the gradients x gets from q, k, v and from
#   gate, up summed (3 adds of 3d); rotary 9 widths again (two muls, cat, add); SwiGLU's
#   two products' gradients 6f and silu's 3f.
_RES_F, _RES_B, _GATHERED_B, _ROPE_F, _ROPE_B, _MLP_F, _MLP_B = 20, 54, 9, 9, 9, 5, 9
# The head: its norm (7d forward, 24d backward, on the residual tokens) and the loss in
# fp32 over the local vocabulary: log-softmax 2V and the pick V forward, their gradients
# 2V and 4V backward. The embedding: its rows read and written (2d), their gradient read
# (d) into a dense (vocab, d) gradient written once per microbatch.
_HEAD_F, _HEAD_B, _LOSS_F, _LOSS_B = 7, 24, 3, 6
# Non-view ops (TorchDispatchMode's count): a dense block's forward 39 (two norms of 6,
# 7 linears of 2 — mm and its view back, rotary's 4 twice, SDPA, two residual adds, silu
# and a product), backward 59 (two norms of 14 and their residual adds, 7 linears of 2,
# SDPA's, rotary's 4 twice, SwiGLU's 3, the 3 gradient adds); an MoE block's 80 and 92
# (its router, dispatch and grouped experts); the head 14 and 32, the embedding 1 and 1;
# a step's own 13 (AdamW's 8 foreach ops, the clip's scalars) and the clip's one per
# parameter (one more per parameter for each microbatch after the first, the adds above).
_OPS_BLOCK, _OPS_MOE, _OPS_HEAD, _OPS_EMBED, _OPS_STEP = (39, 59), (80, 92), (14, 32), (1, 1), 13


def _unfused(s: Target, q_dim: int, kv_dim: int, ffn: int, blocks: int, moe: int, head: bool,
             embed: bool) -> tuple[float, float, float, float]:
    """One microbatch's unfused elementwise bytes forward and backward on the rank, and its
    op counts (the tables above)."""
    cfg, item = s.cfg, s.torch_dtype.itemsize
    d, res, tokens = cfg.dim, s.residual_tokens, s.tokens
    # GELU (mlp="gelu"): its op reads one ffn width and writes one, its gradient reads two
    # and writes one (op counts stay SwiGLU's: the GELU MLP's were not counted)
    mlp_f, mlp_b = (_MLP_F, _MLP_B) if cfg.mlp == "swiglu" else (2, 3)
    fwd = blocks * (res * _RES_F * d + tokens * (_ROPE_F * (q_dim + kv_dim) + mlp_f * ffn)) * item
    bwd = blocks * (res * _RES_B * d + tokens * (_GATHERED_B * d + _ROPE_B * (q_dim + kv_dim) + mlp_b * ffn)) * item
    dense = blocks - moe
    ops_f, ops_b = dense * _OPS_BLOCK[0] + moe * _OPS_MOE[0], dense * _OPS_BLOCK[1] + moe * _OPS_MOE[1]
    if head:
        vocab = cfg.vocab_size // s.run.tp
        fwd += res * _HEAD_F * d * item + tokens * _LOSS_F * vocab * 4
        bwd += res * _HEAD_B * d * item + tokens * _LOSS_B * vocab * 4
        ops_f, ops_b = ops_f + _OPS_HEAD[0], ops_b + _OPS_HEAD[1]
    if embed:
        fwd += tokens * 2 * d * item
        bwd += (tokens + cfg.vocab_size // s.run.tp) * d * item
        ops_f, ops_b = ops_f + _OPS_EMBED[0], ops_b + _OPS_EMBED[1]
    return fwd, bwd, ops_f, ops_b


def _recompute(s: Target, w: _Work) -> float:
    if s.run.recompute == "full":
        return w.forward
    if s.run.recompute == "selective":
        return w.attention_fwd
    return 0.0


# AdamW's foreach ops, each a pass over every parameter it updates (dtp.optim.adamw's
# kernel): lerp m (read m, g; write m) 3, v·b2 2, addcmul v (v, g, g; v) 4, sqrt 2, its
# div and add 2 each, p·(1 − lr·wd) 2, addcdiv (p, m, denom; p) 4; the gradient clip
# reads each gradient (the norm) and scales it (read, write).
_ADAMW_PASSES, _CLIP_PASSES = 21, 3


def _optimizer(s: Target, rank_leaves: list[Leaf], hw: Hardware) -> float:
    """The gradient clip and AdamW over the parameters this rank updates (its ZeRO slice):
    :func:`optimizer_seconds`, and the step's own ops' fixed costs (the clip's one per
    parameter)."""
    n = sum(leaf.numel for leaf in rank_leaves) / (s.run.dp if s.run.zero else 1)
    return optimizer_seconds(n, s.torch_dtype.itemsize, hw) + hw.chip.op_overhead * (_OPS_STEP + len(rank_leaves))


def optimizer_seconds(n: float, itemsize: int, hw: Hardware) -> float:
    """The clip and AdamW over ``n`` parameters of ``itemsize`` bytes, memory-bound, pass by
    pass (:data:`_ADAMW_PASSES`), in fp32 where master weights are kept (mixed precision),
    which are then written back in the model's dtype; no op's fixed cost.

    >>> from dtp.planning.hardware import hardware
    >>> round(optimizer_seconds(1e9, 2, hardware("h100-sxm")) * 1e3, 2)   # 1B bf16 parameters
    30.45
    """
    opt, grad = (4, 4) if itemsize < 4 else (itemsize, itemsize)  # the accumulation dtype: fp32 below it
    moved = n * (_ADAMW_PASSES * opt + _CLIP_PASSES * grad + (opt + itemsize if itemsize < 4 else 0))
    return moved / hw.chip.memory_bandwidth


def compute_seconds(s: Target, rank_leaves: list[Leaf], hw: Hardware) -> float:
    """One microbatch's forward and backward on a rank holding ``rank_leaves`` (no
    communication, no recompute): what :func:`step_time` costs its compute by.

    >>> from dtp import RunConfig
    >>> from dtp.planning.target import leaves
    >>> from dtp.planning.hardware import hardware
    >>> s = Target.of(RunConfig(model="llama3-8b", batch=8, seq=4096, dtype="bfloat16"))
    >>> round(compute_seconds(s, leaves(s), hardware("h100-sxm")), 2)
    2.46
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


def stage_works(s: Target, per_stage: list[list[Leaf]], hw: Hardware) -> list[_Work]:
    """Each pipeline rank's compute per microbatch, as :func:`step_time` costs it: a
    function of the run's mesh, sequence and microbatches, not of its ZeRO stage,
    recompute or schedule, so a caller timing many such variants
    (:func:`dtp.planning.search`) computes it once and passes it as ``works``."""
    return [_work(s, lv, hw) for lv in per_stage]


def step_time(s: Target, per_stage: list[list[Leaf]], traffic: tuple[tuple[Traffic, ...], ...],
              hw: Hardware, works: list[_Work] | None = None) -> StepTime:
    """The step's time (:class:`StepTime`) of target ``s`` on ``hw``, from the plan's
    per-rank leaves and traffic (:meth:`dtp.planning.Plan.time` calls it); ``works``:
    :func:`stage_works`'s, where the caller has them."""
    dtype = s.run.dtype
    if dtype not in hw.chip.flops:
        raise ValueError(f"dtp.plan: {hw.name} has no {dtype} peak (it lists {', '.join(sorted(hw.chip.flops))})")
    run, m = s.run, s.run.microbatches
    works = works or stage_works(s, per_stage, hw)
    recomputes = [_recompute(s, w) for w in works]
    exposed_by_rank, in_steps, hops = zip(*(_exposed(s, list(rows), w, hw) for rows, w in zip(traffic, works)))
    if run.pp > 1:
        p, v = run.pp, s.virtual_stages
        sched = schedule(s)[0]
        where = schedules.placement(run.pp_schedule)
        costs: dict[tuple[int, str], float] = {}
        fs, bs = _fed(works, recomputes, in_steps, m, v)
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


def _fed(works: list[_Work], recomputes: list[float], in_steps: tuple[float, ...], m: int,
         v: int) -> tuple[list[float], list[float]]:
    """Each rank's F and B of one chunk as the schedule is fed them: each waits on its own
    tp / cp / ep collectives, a third of a microbatch's in forward, two thirds in backward
    (backward moves the same activations' gradients twice: dgrad and the re-gathers)."""
    return ([(w.forward + c / m / 3) / v for w, c in zip(works, in_steps)],
            [(w.backward + rc + 2 * c / m / 3) / v for w, rc, c in zip(works, recomputes, in_steps)])


def busy_bound(s: Target, per_stage: list[list[Leaf]], traffic: tuple[tuple[Traffic, ...], ...],
               hw: Hardware, works: list[_Work] | None = None) -> float:
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
    works = works or stage_works(s, per_stage, hw)
    exposed, in_steps, _ = zip(*(_exposed(s, list(rows), w, hw) for rows, w in zip(traffic, works)))
    optimizer = max(_optimizer(s, lv, hw) for lv in per_stage)
    if s.run.pp == 1:
        return m * (works[0].forward + works[0].backward + _recompute(s, works[0])) + sum(exposed[0].values()) + \
            optimizer
    # step_time feeds the schedule each rank's F and B with its in-step collectives: m·v
    # actions of each kind, m·(F + B + recompute) + those collectives in all.
    p, v, where = s.run.pp, s.virtual_stages, schedules.placement(s.run.pp_schedule)
    f, b = _fed(works, [_recompute(s, w) for w in works], in_steps, m, v)
    busy = [m * v * (fr + br) for fr, br in zip(f, b)]
    # And no rank starts before a microbatch went forward through every stage before its
    # first (its first action is a forward of its lowest stage): their F, as fed.
    owner = [schedules.stage_owner(g, p, where)[0] for g in range(p * v)]
    start = [sum(f[owner[g]] for g in range(min(schedules.global_stage(c, r, p, where) for c in range(v))))
             for r in range(p)]
    after = min(sum(e.values()) - c for e, c in zip(exposed, in_steps))
    return max(b + a for b, a in zip(busy, start)) + after + optimizer


def _kinds(schedule: schedules.Schedule, p: int) -> set[tuple[int, str]]:
    """The (global stage, kind) pairs the schedule runs (simulate refuses costs for others)."""
    out = set()
    for rank, actions in enumerate(schedule):
        for a in actions:
            for one in ((a.forward, a.backward) if isinstance(a, schedules.Pair) else (a,)):
                out.add((one.stage(rank, p, schedule.placement), one.kind))
    return out
