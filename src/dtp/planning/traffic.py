"""Bytes per step per mesh axis and collective, from the rules :mod:`dtp.comm` records by.

Each :class:`Traffic` row is one pattern of a step (``times`` repeats of ``each`` bytes
this rank sends), computed with the comm log's own formulas and rounding, so the totals
per (axis, kind) equal :meth:`dtp.CommLog.summary` of a real step exactly, EP's
data-dependent all-to-all-v aside (predicted for balanced routing). The patterns:

=================  ==========================================================================
grad               gradients of parameters replicated over a data axis (dp without ZeRO, cp,
                   ep; tp for norms under SP only, and for routers of experts split over tp:
                   experts whole on every tp rank make their and the router's gradients whole
                   there): one all-reduce each, once per step (per
                   microbatch under ZeRO, which adds each microbatch into its buckets)
zero               ZeRO buckets over dp: reduce-scatter once per step; all-gather once (stage
                   1/2) or per microbatch, forward plus backward re-gathers (stage 3)
loss, norm         the loss (accumulation dtype) over each data axis per microbatch, and the
                   count of valid targets (int64) once per step; the
                   gradient norm over the axes gradients are split on (tp, ep, pp, dp under
                   ZeRO)
tp                 SP: all-gather entering / reduce-scatter leaving each attention and MLP,
                   twice (forward, backward), plus the embedding and head; no SP: all-reduces;
                   full recompute repeats the forward's up to the last one of each block;
                   an MoE block with experts whole on every tp rank (no shared expert): its
                   exit a slice forward and an all-gather backward, its entry's gradient
                   does not move; async
                   tp: rings (its MoE entries filled by the plain ring, the exits as SP's);
                   vocab-parallel cross-entropy: two small all-reduces per microbatch
cp                 per layer and microbatch, attention's collectives (:func:`attention`):
                   ring of n: n−1 K/V blocks forward, n−1 K/V + n dK/dV partials backward
                   (partials in the accumulation dtype); double ring, windows of w: the
                   same K/V hops, n − n/w on ``cp_inner`` and n/w − 1 on ``cp_outer``, and
                   the partials n inner + n/w outer; Ulysses of u: q, k, v and the output
                   all-to-all forward, dout, dq, dk, dv backward (k, v repeated to u kv heads
                   where fewer); hybrid: that Ulysses on ``cp_uly``, then the (double) ring
                   of cp/u on ``cp_ring`` (``cp_outer`` × ``cp_inner``) with the gathered
                   K/V; full recompute repeats the forward's
ep                 dispatch and combine all-to-all-v forward and backward, the counts exchange
pp                 one activation send per microbatch per stage boundary, and one gradient back;
                   microbatch 0's header on each channel; the loss to every pp rank (float64);
                   MoE: the aux losses and statistics in the carry, their losses' gradients
                   back, and the head's aux to every pp rank (float64)
=================  ==========================================================================
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence
from functools import partial

from ..core._rules import accum_dtype
from ..core.comm import ring_bytes
from ..schedules import global_stage, placement, stage_owner
from ..layouts.zero import bucket_groups, padded_numel
from ..layouts import attended_kv_heads
from ..models import llama
from ..ops.context import default_chunks
from ..training.strategies.pipeline_wire import HEADER
from .target import Leaf, Target, by_leaves, stage_ranges

__all__ = ["Traffic", "traffic", "activations", "attention", "summary"]


@dataclass(frozen=True)
class Traffic:
    """``times`` × ``each`` bytes this rank sends as ``kind`` on ``axis`` per step."""

    axis: str
    kind: str
    what: str
    times: int
    each: int

    @property
    def total(self) -> int:
        return self.times * self.each


# An MoE block's routed parameters (not the shared expert's, split over tp like a dense MLP).
_ROUTED = ("router", "w_gate", "w_up", "w_down")
# The parameters applied to the residual stream's features (the norms around the blocks
# and the attention output's bias).
_RESIDUAL = ("attn_norm", "mlp_norm", "final_norm", "o_bias")

# The comm log's formulas and rounding, per record (bytes of local input, ranks).
_ag, _rs, _ar, _a2a = (partial(ring_bytes, kind) for kind in ("all_gather", "reduce_scatter", "all_reduce",
                                                               "all_to_all"))


def zero_buckets(s: Target, rank_leaves: Sequence[Leaf]) -> list[tuple[int, int, int, bool]]:
    """ZeRO's buckets as :func:`dtp.strategies.zero` builds them: ``(padded numel, param
    bytes per element, grad bytes per element, released after forward)`` in bucket order.

    One open bucket per (dtype, mesh axes the parameter is split on), filled in use order
    and closed once it holds ``bucket_mb``; padded to a multiple of dp. Stage 3 frees a
    bucket in forward once a later read follows its last one: all but the last read's.
    """
    return by_leaves("zero buckets", rank_leaves, (tuple(s.axes.items()), s.run.bucket_mb, s.cfg.tie_embeddings),
                     lambda: _zero_buckets(s, rank_leaves))


def _zero_buckets(s: Target, rank_leaves: Sequence[Leaf]) -> list[tuple[int, int, int, bool]]:
    names = list(s.axes)
    groups = [members for _, members in bucket_groups(
        [(leaf.dtype, tuple(a for a in names if a in leaf.used_axes)) for leaf in rank_leaves],
        [leaf.numel for leaf in rank_leaves], [leaf.dtype.itemsize for leaf in rank_leaves], s.run.bucket_mb)]
    # Reads in forward: every leaf once, a tied embedding again at the head.
    last_read = len(rank_leaves) - 1
    tied = s.cfg.tie_embeddings and any(l.path == "final_norm" for l in rank_leaves)
    out = []
    for members in groups:
        total = sum(rank_leaves[j].numel for j in members)
        padded = padded_numel(total, s.run.dp)
        dtype = rank_leaves[members[0]].dtype
        last = max(last_read if (tied and rank_leaves[j].path == "embed") else j for j in members)
        out.append((padded, dtype.itemsize, accum_dtype(dtype).itemsize, last < last_read))
    return out


def traffic(s: Target, rank_leaves: list[Leaf], stage: int = 0) -> list[Traffic]:
    """Every collective pattern of one optimizer step on pipeline rank ``stage``.

    >>> from dtp.planning.target import leaves
    >>> s = Target.of(dtp.RunConfig(dp=2, batch=8, seq=16))
    >>> summary(traffic(s, leaves(s)))
    {'dp': {'all_reduce': 427276}}
    """
    out: list[Traffic] = []
    cfg, axes, m = s.cfg, s.axes, s.run.microbatches
    e = s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    paths = {l.path for l in rank_leaves}
    has_embed = "embed" in paths and (s.run.pp == 1 or stage == 0)
    has_head = "final_norm" in paths
    blocks = sorted({l.block for l in rank_leaves if l.block is not None})
    moe_blocks = [i for i in blocks if llama.is_moe(cfg, i)]

    def add(axis: str, kind: str, what: str, times: int, each: int) -> None:
        if axes.get(axis, 1) > 1 and times and each:
            out.append(Traffic(axis, kind, what, times, each))

    # --- gradients: one all-reduce per parameter and axis it is replicated over
    zero_dp = s.run.zero >= 1 and s.run.dp > 1
    # Without ZeRO pending sums accumulate over microbatches and reduce once; ZeRO adds each
    # microbatch's gradient into its bucket, so the other axes reduce it every microbatch.
    grad_times = m if zero_dp else 1
    # Mixed precision (without ZeRO) accumulates and reduces the gradients in fp32.
    widen = 1 if zero_dp or s.layout.precision is None else acc // e
    expert_tp = s.layout.expert is not None and s.layout.expert.tp_axis == "tp"
    # Each leaf's name and gradient bytes, read once: the loop below asks them per axis, and
    # a plan of thousands of layouts (dtp.planning.search) asks for millions.
    grad_bytes = [(leaf, leaf.path.rsplit(".", 1)[-1], leaf.nbytes * (widen if leaf.dtype == s.torch_dtype else 1))
                  for leaf in rank_leaves]
    for axis in ("cp", "ep", "tp") + (() if zero_dp else ("dp",)):
        n = axes.get(axis, 1)
        if n == 1:  # add() keeps nothing of an axis of one rank
            continue
        sizes: dict[int, int] = defaultdict(int)  # gradient bytes -> parameters of that size
        for leaf, name, nbytes in grad_bytes:
            # A weight on the residual stream's features (a block norm, the output bias)
            # under tp without SP: the whole (reduced) gradient of its output reaches every
            # rank, so its gradient is already whole there. (Not the q/k norms: they apply
            # to heads split over tp, so theirs is a pending sum.)
            # Experts whole on every tp rank route the same tokens: their and the router's
            # gradients are whole there too (split over tp, the router's is a pending sum).
            whole_on_tp = (axis == "tp" and name in _ROUTED and not (expert_tp and leaf.path.endswith("router")))
            if not leaf.splits(axis) and not whole_on_tp and not (axis == "tp" and not s.run.sp and
                                                                  name in _RESIDUAL):
                sizes[nbytes] += 1
        per: dict[int, int] = defaultdict(int)
        for nbytes, count in sizes.items():
            per[_ar(nbytes, n)] += count
        for each, times in sorted(per.items()):
            add(axis, "all_reduce", "grad", times * grad_times, each)
    if zero_dp:
        buckets = zero_buckets(s, rank_leaves)
        for index, (padded, pe, ge, released) in enumerate(buckets):
            add("dp", "reduce_scatter", "zero grad", 1, _rs(padded * ge, s.run.dp))
            shard = padded // s.run.dp * pe
            if s.run.zero < 3:
                add("dp", "all_gather", "zero param", 1, _ag(shard, s.run.dp))
            else:  # every microbatch gathers in forward and re-gathers what forward freed
                regather = released and s.run.reshard_after_forward
                # The first bucket, re-gathered last in backward, is still held when the
                # next microbatch's forward reads it (measured on the comm log).
                again = m * (1 + regather) - ((m - 1) if index == 0 and regather else 0)
                add("dp", "all_gather", "zero3 param", again, _ag(shard, s.run.dp))
    # --- the loss over the data axes (per microbatch), the norm over the split axes
    if s.run.pp == 1 or has_head:
        for axis in ("cp", "ep", "dp"):  # the loss is a scalar in the accumulation dtype (measured)
            add(axis, "all_reduce", "loss", m, _ar(acc, axes.get(axis, 1)))
            # and the valid targets of the step's batch, counted once at the first loss (int64)
            add(axis, "all_reduce", "loss", 1, _ar(8, axes.get(axis, 1)))
    norm_axes = ["tp", "pp"] + (["ep"] if any(l.splits("ep") for l in rank_leaves) else []) + \
        (["dp"] if zero_dp else [])
    for axis in norm_axes:
        add(axis, "all_reduce", "grad norm", 1, _ar(acc, axes.get(axis, 1)))

    out += activations(s, blocks, moe_blocks, has_embed, has_head)
    # the routing statistics, summed over the token axes (and tp where each tp rank holds a share)
    for axis in ("ep", "dp", "cp") + (("tp",) if expert_tp else ()):
        add(axis, "all_reduce", "moe stats", m * len(moe_blocks), _ar((2 * cfg.num_experts + 2) * acc,
                                                                      axes.get(axis, 1)))

    # --- pipeline: activations forward, their gradients back, per microbatch and chunk
    if s.run.pp > 1:
        p, v = s.run.pp, s.virtual_stages
        act = s.residual_tokens * cfg.dim * e
        pl = placement(s.run.pp_schedule)
        held = [global_stage(c, stage, p, pl) for c in range(v)]  # this rank's global stages

        def remote(a: int, b: int) -> bool:  # the V's turn (stage p-1 to p) stays on its rank
            return 0 <= b < p * v and stage_owner(a, p, pl)[0] != stage_owner(b, p, pl)[0]

        sends = sum(remote(g, g + 1) + remote(g, g - 1) for g in held)
        add("pp", "send", "activations", m * sends, act)
        # Microbatch 0 of each channel this rank sends on carries its leaf-0 header first
        # (int64 words: strategies.pipeline_wire; a tree carry's structure message beside
        # it is not counted), and the step's loss reaches every pp rank as one float64.
        add("pp", "send", "headers", sends, HEADER * 8)
        add("pp", "all_reduce", "loss", 1, _ar(8, p))
        # MoE: the carry also holds each earlier MoE block's aux losses and statistics
        # (aux, z, dropped, E counts) forward, the two losses' gradients back; the head's
        # aux reaches every pp rank as float64 (headers and the tree's structure not counted).
        if cfg.num_experts:
            ranges = stage_ranges(s)  # layer 1 + i is block i

            def moe_before(g: int) -> int:  # the MoE blocks global stage g receives the aux of
                return sum(llama.is_moe(cfg, i) for i in range(cfg.n_layers) if 1 + i < ranges[g][0])

            carried = sum(moe_before(g + 1) * (3 + cfg.num_experts) for g in held if remote(g, g + 1)) + \
                sum(moe_before(g) * 2 for g in held if remote(g, g - 1))
            add("pp", "send", "moe aux carry", m, carried * acc)
            n_moe = sum(llama.is_moe(cfg, i) for i in range(cfg.n_layers))
            add("pp", "all_reduce", "moe aux to every stage", 1, _ar(m * (3 + n_moe * (cfg.num_experts + 1)) * 8, p))
    return out


def activations(s: Target, blocks: Sequence[int], moe_blocks: Sequence[int], has_embed: bool,
                has_head: bool) -> list[Traffic]:
    """The collectives inside a rank's microbatches (tp's on the activations, cp's
    attention, ep's dispatch) for its ``blocks`` (of them ``moe_blocks``) and its ends: a
    function of those alone, so a bound over pipeline splits (:func:`dtp.planning.search`)
    costs the whole model's at once.

    >>> s = Target.of(dtp.RunConfig(tp=2, sp=True, batch=8, seq=16))
    >>> summary(activations(s, range(2), [], True, True))
    {'tp': {'all_gather': 163840, 'reduce_scatter': 163840, 'all_reduce': 1536}}
    """
    out: list[Traffic] = []
    cfg, axes, m = s.cfg, s.axes, s.run.microbatches
    e = s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    expert_tp = s.layout.expert is not None and s.layout.expert.tp_axis == "tp"

    def add(axis: str, kind: str, what: str, times: int, each: int) -> None:
        if axes.get(axis, 1) > 1 and times and each:
            out.append(Traffic(axis, kind, what, times, each))

    # --- tensor parallel activations, per microbatch
    L, full = len(blocks), s.run.recompute == "full"
    # MoE blocks with experts whole on every tp rank and no shared expert: the MoE output
    # is whole on each (its exit a slice forward, an all-gather backward) and so is its
    # input's gradient (no move). With experts split over tp, or a shared expert (a dense
    # MLP, split over tp), they move like a dense MLP's, beside the expert path's own tp
    # legs with experts split over tp (data-dependent: not predicted).
    W = 0 if expert_tp or cfg.shared_experts else len(moe_blocks)
    tp = axes.get("tp", 1)
    if tp > 1:
        whole = s.tokens * cfg.dim * e  # (b, s/cp, h): what a row-parallel output is
        ends = has_embed + has_head
        if s.run.sp and s.run.async_tp:
            # Rings of tp-1 shards per rank (dtp.ops.collective_matmul; counted in shards: from
            # tp 3 up the rings are bidirectional, two hops a step and the opposite shard in
            # halves, so more records of the same bytes in all): per block, the two
            # entries and two exits, forward and backward, and under full recompute the
            # entries again and the attention exit (the recompute stops before the MLP's);
            # the head's entry both ways. The embedding's pending sum is no matmul's: it
            # keeps its reduce-scatter and, in backward, its all-gather; so does an MoE
            # block's exit (no row-parallel linear), whose entry is filled by the ring
            # forward (collective_matmul.filled) and, with W, moves no gradient back.
            moe_exits = len(moe_blocks)
            rings = 8 * L - 2 * moe_exits - W + 2 * has_head + 3 * L * full
            add("tp", "send_recv", "async tp", m * rings * (tp - 1), whole // tp)
            add("tp", "all_gather", "sp", m * (has_embed + moe_exits), _ag(whole // tp, tp))
            add("tp", "reduce_scatter", "sp", m * (has_embed + moe_exits - W), _rs(whole, tp))
        elif s.run.sp:
            add("tp", "all_gather", "sp", m * (4 * L + ends + 2 * L * full), _ag(whole // tp, tp))
            add("tp", "reduce_scatter", "sp", m * (4 * L - 2 * W + ends + L * full), _rs(whole, tp))
        else:
            add("tp", "all_reduce", "tp", m * (4 * L - 2 * W + ends + L * full), _ar(whole, tp))
        if has_head:  # vocab-parallel cross-entropy: max and (sum-exp, target logit)
            add("tp", "all_reduce", "cross_entropy", m, _ar(s.tokens * acc, tp))
            add("tp", "all_reduce", "cross_entropy", m, _ar(2 * s.tokens * acc, tp))

    # --- context parallel attention, per layer and microbatch
    if L:
        out += [Traffic(r.axis, r.kind, r.what, m * L * r.times, r.each) for r in attention(s)]

    # --- expert parallel (expected bytes under balanced routing)
    ep = axes.get("ep", 1)
    if ep > 1 and moe_blocks:
        rows = s.tokens * cfg.top_k * (ep - 1) // ep
        add("ep", "all_to_all_v", "moe dispatch/combine", m * len(moe_blocks) * (4 + 2 * full), rows * cfg.dim * e)
        add("ep", "all_to_all", "moe counts", m * len(moe_blocks) * (1 + full), (ep - 1) * cfg.num_experts // ep * 8)
    return out


def _ring(n: int, w: int, inner: str, outer: str | None, block: int, partial: int, passes: int,
          chunks: int) -> list[Traffic]:
    """One attention's (double) ring of ``n`` ranks in windows of ``w`` (``w = n``: a plain
    ring on ``inner``), as :func:`dtp.ops.context.ring._ring_forward` / ``_ring_backward``
    send: per head chunk, each of ``n/w`` rounds moves the K/V block ``w−1`` inner hops and
    (but the last round) one outer hop; backward does the same, and sends a dK/dV partial
    after each of the ``w`` inner steps and once per round on the outer ring. ``block`` and
    ``partial`` are all chunks' bytes (each chunk sends its share); ``passes`` counts the
    forward runs (2 under full recompute)."""
    rounds = n // w
    rows = [Traffic(inner, "send_recv", "ring K/V", (passes + 1) * rounds * (w - 1) * chunks, block // chunks),
            Traffic(inner, "send_recv", "ring dK/dV", rounds * w * chunks, partial // chunks)]
    if outer is not None:
        rows += [Traffic(outer, "send_recv", "ring K/V outer", (passes + 1) * (rounds - 1) * chunks, block // chunks),
                 Traffic(outer, "send_recv", "ring dK/dV outer", rounds * chunks, partial // chunks)]
    return rows


def attention(s: Target) -> list[Traffic]:
    """The collectives of one context-parallel attention (one layer, one microbatch,
    forward and backward) on each rank, read off the layout's options and the sub-axes
    the comm log names (:mod:`dtp.ops.context`: double ring ``cp_outer`` × ``cp_inner``,
    hybrid ``cp_ring`` (or ``cp_outer`` × ``cp_inner``) × ``cp_uly``).

    Per rank, ``q`` and ``kv`` are its bytes of Q and of one of K, V: ``b·(s/cp)·heads/tp·hd·e``.
    Head chunks leave the totals alone (each chunk moves its share) but set how many
    records there are, and the all-to-all's per-record rounding.

    A double ring of 4 in windows of 2, K/V blocks of 8 KiB: 2 hops a pass inside windows
    and 1 across, dK/dV partials 4 inside and 2 across:

    >>> s = Target.of(dtp.RunConfig(batch=8, seq=16, cp=4, cp_algo="double_ring", cp_window=2))
    >>> [(r.axis, r.what, r.times, r.each) for r in attention(s)]  # doctest: +NORMALIZE_WHITESPACE
    [('cp_inner', 'ring K/V', 4, 8192), ('cp_inner', 'ring dK/dV', 4, 8192),
     ('cp_outer', 'ring K/V outer', 2, 8192), ('cp_outer', 'ring dK/dV outer', 2, 8192)]
    """
    ctx, cfg = s.context, s.cfg
    if ctx is None:
        return []
    e = s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    passes = 2 if s.run.recompute == "full" else 1  # forward runs: full recompute runs it again
    local = s.microbatch * (s.run.seq // s.run.cp) * cfg.head_dim * e  # one head's (b, s/cp, hd)
    kv_heads = cfg.n_kv_heads // s.run.tp
    q = local * cfg.n_heads // s.run.tp
    rows: list[Traffic] = []
    if ctx.algo in ("ulysses", "hybrid"):
        u = s.run.cp if ctx.algo == "ulysses" else ctx.ulysses_degree
        uly = ctx.axis if ctx.algo == "ulysses" else f"{ctx.axis}_uly"
        # GQA: fewer kv heads than u are repeated up to u before the all-to-all (and the
        # ring behind it moves the repeated copies).
        attended = attended_kv_heads(kv_heads, u)
        kv = local * attended * u
        chunks = ctx.head_chunks or default_chunks(attended, s.run.cp, 2 * kv)
        # q and the output forward, dout and dq backward; k, v forward, dk, dv backward.
        for what, size in (("ulysses q/out", q), ("ulysses k/v", kv)):
            rows.append(Traffic(uly, "all_to_all", what, 2 * (passes + 1) * chunks, _a2a(size // chunks, u)))
        if ctx.algo == "ulysses":
            return rows
        n = s.run.cp // u
        names = (f"{ctx.axis}_ring", None) if ctx.window == 1 else (f"{ctx.axis}_inner", f"{ctx.axis}_outer")
        w = n if ctx.window == 1 else ctx.window
    else:
        n, kv = s.run.cp, local * kv_heads
        chunks = ctx.head_chunks or default_chunks(kv_heads, s.run.cp, 2 * kv)
        names = (ctx.axis, None) if ctx.algo == "ring" else (f"{ctx.axis}_inner", f"{ctx.axis}_outer")
        w = n if ctx.algo == "ring" else ctx.window
    # A K/V block is K and V stacked in the compute dtype; dK/dV partials accumulate in
    # the accumulation dtype (fp32 for bf16), so they are larger there.
    rows += _ring(n, w, names[0], names[1], 2 * kv, 2 * kv // e * acc, passes, chunks)
    return [r for r in rows if r.times and r.each]


def summary(rows: list[Traffic]) -> dict[str, dict[str, int]]:
    """``{axis: {kind: bytes}}``, as :meth:`dtp.CommLog.summary` reports a step."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        per = out.setdefault(r.axis, {})
        per[r.kind] = per.get(r.kind, 0) + r.total
    return out
