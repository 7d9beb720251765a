"""Per-rank memory of one training step: what rests between steps, and the peak.

Everything is arithmetic on the :class:`~dtp.planning.setup.Leaf` shapes and the batch.
The terms follow what dtp's code holds, not an idealised trainer; each was found in the
allocations live at the peak of real steps (torch 2.13, CPU, gloo: ``tests/test_plan.py``
measures them, and the plan may be under by at most 3 % and over by at most 1.25×; on
its cases it is 0-4 % over, bf16 included):

* **at rest** — parameters and AdamW's two moments in the parameters' dtype (dtp's
  optimizer is functional); under ZeRO 1/2 the gathered parameter buckets (padded) plus
  this rank's slice of fp32 master weights and moments; under ZeRO 3 the master slice
  (it is the parameters) and the moments, and with ``overlap_param_gather`` the next
  forward's first ``prefetch`` + 1 buckets, gathered during the update
  (:func:`held_gathers`). The step's token ids and targets (int64) sit beside them
  throughout.
* **forward and backward** — the fullest of a few moments (:func:`phases`), each the rest
  plus what exists then: the loss being computed (every saved activation, the logits
  and, in low precision, their fp32 copy); the loss's backward (the gradient of its
  exponentials); the backward below it (the whole gradient buffers — under ZeRO with one
  microbatch only the head's gradients, the others held as they come until their bucket
  is full — the logits' gradient, three residual-sized temporaries); under full
  recompute a block rebuilt, at its MLP and at its first norm; with dp > 1 the gradient
  reduction after backward. Gradients exist from the head's matmul backward on, with
  several microbatches from the first on.
  ZeRO-3's gathered buckets count where they live: at the loss those not freed after
  forward, in backward the one in use and the one prefetched.
* **update** — the rest plus the new tree the functional update builds beside the old
  one: gradients, clipped gradients, both new moments, Adam's denominator and the new
  parameters — 6 × the parameters, measured, replicated; under ZeRO 5 × the slice and a
  slice-sized temporary (one slice fewer since :func:`dtp.optim.step` writes the new
  parameters with the optimizer's last op), then at ZeRO-1/2 the new slices gathered
  into new buckets.

Saved activations per block, for ``t`` tokens a rank computes (``b·s/cp``), ``t_r`` in
its residual stream (``/tp`` with SP), element size ``e``, accumulation size ``a`` (fp32
for bf16): each of the two norms keeps its input as ``a`` (the copy it computes in),
the normalised output and the linear's (gathered) input, ``t_r·h·(a + e) + t·h·e``;
attention keeps the rotated q and k, v, SDPA's output and the copy ``wo`` reads (the
heads-last reshape of SDPA's output is no view: a copy at every tp, measured),
``t·(3·h_q + 2·h_kv)/tp·e`` plus the log-sum-exp; the MLP keeps gate, up, their SiLU and
product, ``4·t·f/tp·e``. Megatron's ``s·b·h·(34 + 5·a·s/h)`` (fp16, dropout and the
softmax kept) is the same bookkeeping for its kernels. Full recompute keeps each block's
input and rebuilds one block at a time.

The loss (:func:`dtp.ops.parallel.cross_entropy`, vocab-parallel or not) runs in fp32 and
keeps two logits-sized fp32 tensors — the shifted logits (``gather`` saves its input) and
their exponentials (``exp`` saves its output) — beside the target index and mask; while
it runs, the logits (and their fp32 copy) are alive too: at the loss, where most plans
peak, a rank holds every saved activation and three logits-sized tensors. On plain
tensors (a layout that splits only the batch) it keeps the log-softmax alone, and its
backward writes the gradient in place: two.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import schedules
from .._rules import accum_dtype
from ..models import llama
from .setup import Leaf, Setup
from .traffic import zero_buckets

__all__ = ["Memory", "memory", "block_activations", "phases", "held_gathers"]


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds (a pipeline rank: ``stage``). The terms at their most; the
    fullest moment of forward and backward (``moment``, one of :func:`phases`) holds the
    rest, ``working`` and what exists of the others then: ``backward_peak``."""

    stage: int
    params: int  # the parameters (ZeRO 3: this rank's master slice)
    grads: int  # gradients at their most (ZeRO: whole buckets in the accumulation dtype)
    optimizer: int  # moments, and fp32 master slices under ZeRO 1/2
    activations: int  # saved for backward at their most: microbatches in flight × per microbatch
    working: int  # transient at that moment: logits, gradients in flight, collectives' buffers, token ids
    update: int  # the new tree the optimizer step builds beside the old
    in_flight: int  # microbatches whose activations the rank holds at once
    moment: str  # which moment of forward/backward is the fullest
    step_peak: int  # bytes at that moment, the rest included (the held gathers taken by then)
    # ZeRO-3 with overlap_param_gather: the next forward's first prefetch + 1 buckets,
    # gathered during the update and held whole between steps (forward takes them)
    held: int = 0

    @property
    def rest(self) -> int:
        return self.params + self.optimizer + self.held

    @property
    def backward_peak(self) -> int:
        return self.step_peak

    @property
    def update_peak(self) -> int:
        return self.rest + self.update

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.update_peak)


def _norm(s: Setup) -> int:
    """What one RMSNorm and the linear after it save: its input in the accumulation dtype
    (the fp32 copy ``pow`` and the scaling keep: the input itself when it is fp32), the
    normalised tensor, the linear's (gathered) input, the rsqrt per token."""
    e, acc = s.torch_dtype.itemsize, accum_dtype(s.torch_dtype).itemsize
    tr = s.residual_tokens
    return tr * s.cfg.dim * (acc + e) + s.tokens * s.cfg.dim * e + tr * acc


def block_activations(s: Setup, moe: bool = False) -> int:
    """Bytes one transformer block saves for backward per microbatch (module docstring).

    >>> block_activations(Setup(cfg=llama.config("tiny"), batch=8, seq=256))
    9519104
    """
    return _attention_saved(s) + _mlp_saved(s, moe)


def _attention_saved(s: Setup) -> int:
    """A block's saved tensors but the MLP's: both norms, attention, the rotary tables."""
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    t = s.tokens
    # rotated q, k; v; SDPA's output and wo's copy of it; the log-sum-exp (fp32)
    attn = t * (3 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim // s.tp * e + t * cfg.n_heads // s.tp * acc
    rotary = 4 * (s.seq // s.cp) * (cfg.head_dim // 2) * acc  # cos and sin, for q and k
    return 2 * _norm(s) + attn + rotary


def _mlp_saved(s: Setup, moe: bool) -> int:
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    t = s.tokens
    if not moe:
        return 4 * t * cfg.ffn_dim // s.tp * e
    # routed rows (balanced) through each local expert's SwiGLU, the router's scores
    rows = t * cfg.top_k
    mlp = 4 * rows * cfg.expert_dim * e + 3 * rows * cfg.dim * e + t * cfg.num_experts * acc
    return mlp + 4 * t * cfg.shared_experts * cfg.expert_dim * e


@dataclass(frozen=True)
class _Head:
    """The final norm, head and loss per microbatch: what they save, and what the loss's
    forward and backward hold beside that."""

    saved: int
    forward: int  # the logits (and their fp32 copy) while the loss is computed
    backward: int  # the exponentials' gradient, beside the saved shifted logits and exponentials
    below: int  # after the loss's backward: the logits' gradient and three residual-sized temporaries
    loss_saved: int  # of ``saved``, the two logits-sized fp32 tensors the loss keeps


def _head(s: Setup) -> _Head:
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    t, tr = s.tokens, s.residual_tokens
    logits = t * cfg.vocab_size // s.tp
    # shifted logits and their exponentials, fp32; on plain tensors the log-softmax only
    loss_saved = (1 if _local_batch(s) else 2) * logits * acc
    # norm: input, normalised, the head's (gathered) input, rsqrt; the loss: target index
    # (int64) and mask (bool), the (sum of exp, target logit) pairs, per-token losses
    saved = _norm(s) + loss_saved + t * (8 + 1) + 3 * t * acc
    # Low precision: the logits' fp32 copy, and the last block's output (the norm kept its
    # fp32 copy instead) still held by the caller.
    copy = logits * acc + tr * cfg.dim * e if e != acc else 0
    # While the loss is computed: the logits (and their copy), the row max, the target logit
    # masked, the sum of exponentials, their pair (stacked): 5·t·acc beside the 3 kept.
    forward = logits * e + copy + 2 * t * acc
    return _Head(saved, forward, logits * acc, logits * e + 3 * t * cfg.dim * e, loss_saved)


def _local_batch(s: Setup) -> bool:
    """Whether the step computes on plain local tensors (:mod:`dtp.strategies.local`:
    the layout splits only the batch, over more than one rank; ``llama``'s loss may)."""
    return s.dp > 1 and s.tp == s.cp == s.ep == s.pp == 1


def _gloo(s: Setup) -> bool:
    """Whether the run's collectives are gloo's (CPU), whose all-to-all reduce-scatter and
    all-gather staging cost whole buckets. What this package measured; a ``Setup`` that
    names another backend (``backend="nccl"``) gets NCCL's in-place forms instead."""
    return getattr(s, "backend", "gloo") == "gloo"


def _data(s: Setup) -> int:
    """Token ids and targets of the whole step (int64, sharded like the batch; microbatches
    are strided rows, cut as copies of all of it), and the step's scalars (loss, norms,
    step count: 20-190 B measured beyond the other terms)."""
    ids = 2 * (s.batch // (s.dp * s.ep)) * (s.seq // s.cp) * 8
    return ids * (2 if s.microbatches > 1 else 1) + 256


def _in_flight(s: Setup, stage: int) -> int:
    """(chunk, microbatch) pairs pipeline rank ``stage`` holds activations of at once."""
    if s.pp == 1:
        return 1
    sched = schedules.make(s.pp_schedule, p=s.pp, v=s.virtual_stages, m=s.microbatches)
    return schedules.simulate(sched, p=s.pp, v=s.virtual_stages, m=s.microbatches).peak_in_flight[stage]


def phases(s: Setup, rank_leaves: list[Leaf], stage: int = 0) -> dict[str, tuple[int, int, int]]:
    """The moments of forward and backward the peak may be at, each as ``(gradients held,
    activations saved, working set)`` bytes on top of the rest (module docstring).

    >>> from dtp.planning.setup import leaves
    >>> s = Setup(cfg=llama.config("tiny"), dp=2, batch=8, seq=256)
    >>> {k: sum(v) for k, v in phases(s, leaves(s)).items()}      # doctest: +NORMALIZE_WHITESPACE
    {'loss forward': 12498176, 'loss backward': 12489984, 'below the loss': 12655104,
     'gradient reduction': 871168}
    """
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    zero = s.zero if s.dp > 1 else 0
    w = sum(l.nbytes for l in rank_leaves)
    data = _data(s)
    gathered_fwd = gathered_bwd = 0
    if zero:
        buckets = zero_buckets(s, rank_leaves)
        grads = sum(b[0] * b[2] for b in buckets)
        # Every bucket's reduce-scatter may still be in flight when backward ends (one
        # lands early only if done by the next post). On gloo it runs as an all-to-all
        # (dtp.comm): a receive buffer each, the peers' chunks ((dp-1)/dp of the bucket)
        # at the dp axis' ends, the whole bucket on a middle rank, then the slices;
        # elsewhere the slices only.
        recv = (grads * (s.dp - 1) // s.dp if s.dp == 2 else grads) if _gloo(s) else 0
        reduction = grads // s.dp + recv
        if zero == 3:  # gathered buckets: at the loss those not freed after forward (all
            # without resharding); in backward the one in use and the one prefetched
            sizes = [b[0] * b[1] for b in buckets]
            gathered_fwd = sum(z for z, b in zip(sizes, buckets) if not (b[3] and s.reshard_after_forward))
            gathered_bwd = sum(sorted(sizes)[-2:])
    else:
        grads = _grad_bytes(s, w)
        reduction = grads if s.dp > 1 else 0  # DDP's all-reduce works on a copy of each gradient
    # Which blocks, head and embedding this rank runs, per microbatch.
    blocks = sorted({int(l.path.split(".")[1]) for l in rank_leaves if l.path.startswith("layers.")})
    has_head = any(l.path == "final_norm" for l in rank_leaves)
    has_embed = any(l.path == "embed" for l in rank_leaves) and (stage == 0 or s.pp == 1)
    head = _head(s) if has_head else _Head(0, 0, 0, 0, 0)
    embed = s.tokens * (8 + e) if has_embed else 0  # the clamped ids and the vocab-range mask
    per_block = [block_activations(s, llama.is_moe(cfg, i)) for i in blocks]
    in_flight = _in_flight(s, stage)
    chunks = s.virtual_stages if s.pp > 1 else 1  # a pair holds one chunk: 1/v of the blocks
    full = s.recompute == "full"
    kept = len(blocks) * s.residual_tokens * cfg.dim * e if full else sum(per_block)  # full: each block's input
    older = (in_flight - 1) * -(-(kept + embed) // chunks)

    def saved(a: int) -> int:
        return older + -(-a // chunks)

    # Gradients before the first one of this step exists (one microbatch), or accumulated
    # over the earlier microbatches (or the pipeline's earlier backwards).
    early = grads if s.microbatches > 1 else 0
    out = {}
    if has_head:
        everything = saved(kept + embed + head.saved)
        out["loss forward"] = (early, everything, head.forward + gathered_fwd + data)
        out["loss backward"] = (early, everything, head.backward + gathered_bwd + data)
        # ZeRO keeps gradients as they come until their bucket's last is in, so below the
        # loss (one microbatch) only the head's exist, in the accumulation dtype.
        head_paths = ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")
        head_grads = sum(l.numel * acc for l in rank_leaves if l.path in head_paths)
        below = early or head_grads if zero else grads
        out["below the loss"] = (below, everything - head.loss_saved, head.below + gathered_bwd + data)
    else:  # a pipeline rank without the head: its backward starts at its last block
        out["backward"] = (grads, saved(kept + embed), 3 * s.residual_tokens * cfg.dim * e + gathered_bwd + data)
    if full and per_block:
        # One block rebuilt in backward (its input counted twice: kept, and in the rebuilt
        # block, for the gradient arriving at it) at its MLP: gate and up gradients.
        tr = s.residual_tokens
        block_work = 2 * s.tokens * cfg.ffn_dim // s.tp * e + gathered_bwd + data
        # Without ZeRO a later microbatch's gradients are new tensors until backward ends,
        # added to the sums after: near the first block, a second set (measured, tp2 m=2).
        fresh = w if not zero and s.microbatches > 1 else 0
        out["block rebuilt"] = (grads + fresh, saved(kept + embed + max(per_block)), block_work)
        # Then its first norm's backward, which runs in fp32: five residual-sized fp32
        # temporaries at once while the MLP's tensors and part of attention's are freed
        # (measured, bf16 tp2 m=2 seq256: 3.35 MB, 2 % over the MLP moment). Counted as
        # attention's whole and four temporaries: 3.41 MB.
        norm_work = 4 * tr * cfg.dim * acc + tr * cfg.dim * e + gathered_bwd + data
        out["rebuilt block's norm"] = (grads + fresh, saved(kept + embed + _attention_saved(s)), norm_work)
    if reduction:
        out["gradient reduction"] = (grads, 0, reduction + data)
    return out


def _grad_bytes(s: Setup, w: int) -> int:
    """Gradient bytes of ``w`` parameter bytes without ZeRO: the parameters' own, or under
    ``layouts.mixed_precision`` of bf16 parameters their fp32 accumulators (as big as the
    master weights and each moment).

    >>> _grad_bytes(Setup(dtype="bfloat16", precision="mixed"), 100), _grad_bytes(Setup(dtype="bfloat16"), 100)
    (200, 100)
    """
    e, acc = s.torch_dtype.itemsize, accum_dtype(s.torch_dtype).itemsize
    return w * acc // e if s.layout.precision is not None else w


def memory(s: Setup, rank_leaves: list[Leaf], stage: int = 0) -> Memory:
    """The memory of pipeline rank ``stage`` holding ``rank_leaves``.

    >>> from dtp.planning.setup import leaves
    >>> s = Setup(cfg=llama.config("tiny"), dp=2, batch=8, seq=16)
    >>> m = memory(s, leaves(s))
    >>> m.rest // 427264, m.update // 427264     # 3 × params at rest, 6 × more to update
    (3, 6)
    """
    acc = accum_dtype(s.torch_dtype).itemsize
    w = sum(l.nbytes for l in rank_leaves)
    zero = s.zero if s.dp > 1 else 0
    data = _data(s)
    held = 0
    if zero:
        buckets = zero_buckets(s, rank_leaves)
        padded = sum(b[0] for b in buckets)
        buf, grads = sum(b[0] * b[1] for b in buckets), sum(b[0] * b[2] for b in buckets)
        slice_ = padded // s.dp
        if zero < 3:  # the gathered buckets; an fp32 master slice (a copy even for fp32 params)
            params, optimizer = buf, 3 * slice_ * acc
        else:  # the master slice is the parameters (gathers cast it on the fly)
            params, optimizer = slice_ * acc, 2 * slice_ * acc
            held = held_gathers(s, buckets)
        # The new tree over the slices, and one slice-sized temporary of AdamW's (a bucket's
        # slice is one tensor: measured 6 slices at ZeRO-3's update peak since optim.step,
        # 7 before it, torch 2.13)
        update = 5 * slice_ * acc + max(b[0] for b in buckets) // s.dp * acc
        if zero < 3:  # then the new slices gathered into new buckets, on gloo over more
            # than 2 ranks through a staging buffer of a whole bucket (measured, torch 2.13:
            # dp4 ZeRO-1's peak, 3 slices + 2 buckets); at dp=2 dtp.comm gathers straight
            # into the bucket (an all-to-all)
            staging = max(b[0] * b[1] for b in buckets) if _gloo(s) and s.dp > 2 else 0
            update = max(update, 3 * slice_ * acc + buf + staging)
        update += data
    else:
        grads = _grad_bytes(s, w)  # mixed precision: fp32 gradients, master weights and moments
        params, optimizer = w, (3 if grads != w else 2) * grads
        update = 6 * grads + (w if grads != w else 0) + data  # mixed: then the master weights rounded
    moments = phases(s, rank_leaves, stage)
    moment = max(moments, key=lambda k: sum(moments[k]))
    activations = max(saved for _, saved, _ in moments.values())
    return Memory(stage, params, grads, optimizer, activations, moments[moment][2], update, _in_flight(s, stage),
                  moment, params + optimizer + sum(moments[moment]), held)


def held_gathers(s: Setup, buckets: list[tuple[int, int, int, bool]]) -> int:
    """Bytes of the whole buckets ZeRO-3 holds between steps: under
    ``overlap_param_gather`` the update gathers the next forward's first ``prefetch`` + 1
    buckets (what that forward holds at its first read) and the state keeps them until
    it takes them (:class:`dtp.strategies.zero_gathers.InflightGathers`); none otherwise.

    >>> from dtp.planning.setup import leaves
    >>> s = Setup(cfg=llama.config("tiny"), dp=2, zero=3, bucket_mb=0.05,
    ...           layout=dtp.layouts.data() + dtp.layouts.zero(3, bucket_mb=0.05, overlap_param_gather=True))
    >>> held_gathers(s, zero_buckets(s, leaves(s)))     # prefetch 1: buckets 0 and 1, whole, fp32
    147968
    """
    opts = s.layout.zero if s.layout is not None else None
    if s.zero != 3 or s.dp == 1 or opts is None or not opts.overlap_param_gather:
        return 0
    return sum(b[0] * b[1] for b in buckets[:opts.prefetch + 1])
