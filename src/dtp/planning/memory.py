"""Per-rank memory of one training step: what rests between steps, and the peak.

Everything is arithmetic on the :class:`~dtp.planning.target.Leaf` shapes and the batch.
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
  Under a pipeline the saved activations are those alive over the rank's own action list
  (:func:`held_over_schedule`): each chunk saves its own (the head's logits on the chunk
  holding the head), zero bubble's ``I`` keeps its whole graph and the gradients at the
  weights' nodes until ``W`` (:func:`_boundary_grads`), and a backward after a chunk's
  first makes its weight gradients as new tensors beside the sums (``later backward``).
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
product, ``4·t·f/tp·e`` (a GELU MLP its ``w_up`` output and the GELU's, ``2·t·f/tp·e``). Megatron's ``s·b·h·(34 + 5·a·s/h)`` (fp16, dropout and the
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
from ..schedules.actions import flat
from ..core._rules import accum_dtype
from ..models import llama
from ..models.config import n_sequential_layers
from .target import Leaf, Target, rank_chunks, schedule
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


def _norm(s: Target) -> int:
    """What one RMSNorm and the linear after it save: its input in the accumulation dtype
    (the fp32 copy ``pow`` and the scaling keep: the input itself when it is fp32), the
    normalised tensor, the linear's (gathered) input, the rsqrt per token."""
    e, acc = s.torch_dtype.itemsize, accum_dtype(s.torch_dtype).itemsize
    tr = s.residual_tokens
    return tr * s.cfg.dim * (acc + e) + s.tokens * s.cfg.dim * e + tr * acc


def block_activations(s: Target, moe: bool = False) -> int:
    """Bytes one transformer block saves for backward per microbatch (module docstring).

    >>> block_activations(Target.of(dtp.RunConfig(batch=8, seq=256)))
    9519104
    """
    return _attention_saved(s) + _mlp_saved(s, moe)


def _attention_saved(s: Target) -> int:
    """A block's saved tensors but the MLP's: both norms, attention, the rotary tables."""
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    t = s.tokens
    # rotated q, k; v; SDPA's output and wo's copy of it; the log-sum-exp (fp32)
    attn = t * (3 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim // s.run.tp * e + t * cfg.n_heads // s.run.tp * acc
    rotary = 4 * (s.run.seq // s.run.cp) * (cfg.head_dim // 2) * acc  # cos and sin, for q and k
    return 2 * _norm(s) + attn + rotary


# ffn-wide tensors a dense MLP saves for backward: SwiGLU gate, up, SiLU(gate) and the
# product; GELU w_up's output (GELU's input) and GELU's output (w_down's input).
_MLP_SAVED = {"swiglu": 4, "gelu": 2}
# ffn-wide gradients at the MLP's weight-reading ops' outputs: gate and up; GELU's w_up alone.
_MLP_GRADS = {"swiglu": 2, "gelu": 1}


def _mlp_saved(s: Target, moe: bool) -> int:
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    t = s.tokens
    if not moe:
        return _MLP_SAVED[cfg.mlp] * t * cfg.ffn_dim // s.run.tp * e
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


def _head(s: Target) -> _Head:
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    t, tr = s.tokens, s.residual_tokens
    logits = t * cfg.vocab_size // s.run.tp
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


def _local_batch(s: Target) -> bool:
    """Whether the step computes on plain local tensors (:mod:`dtp.strategies.local`:
    the layout splits only the batch, over more than one rank; ``llama``'s loss may)."""
    return s.run.dp > 1 and s.run.tp == s.run.cp == s.run.ep == s.run.pp == 1


def _gloo(s: Target) -> bool:
    """Whether the run's collectives are gloo's (CPU), whose all-to-all reduce-scatter and
    all-gather staging cost whole buckets. What this package measured; ``backend="nccl"``
    (or hccl) gets their in-place forms instead."""
    return s.backend == "gloo"


def _data(s: Target) -> int:
    """Token ids and targets of the whole step (int64, sharded like the batch; microbatches
    are strided rows, cut as copies of all of it), and the step's scalars (loss, norms,
    step count: 20-190 B measured beyond the other terms)."""
    ids = 2 * (s.run.batch // (s.run.dp * s.run.ep)) * (s.run.seq // s.run.cp) * 8
    return ids * (2 if s.run.microbatches > 1 else 1) + 256


def _in_flight(s: Target, stage: int) -> int:
    """(chunk, microbatch) pairs pipeline rank ``stage`` holds activations of at once."""
    if s.run.pp == 1:
        return 1
    return schedule(s)[1].peak_in_flight[stage]


def rank_actions(s: Target, stage: int) -> list[schedules.Action]:
    """Pipeline rank ``stage``'s own actions in order (:func:`dtp.schedules.make`, pairs
    flattened); without a pipeline each microbatch's ``F`` then ``B``."""
    if s.run.pp == 1:
        return [schedules.Action(k, 0, 0) for k in "FB"]
    return [a for item in schedule(s)[0][stage] for a in flat(item)]


def held_over_schedule(actions: list[schedules.Action], saved: list[int],
                       for_w: list[int]) -> dict[tuple[str, int], int]:
    """Walk a pipeline rank's own action list (:func:`rank_actions`) and return, per
    ``(kind, chunk)``, the most activation bytes alive during such an action
    (``kind + "+"``: a backward action after the chunk's first ``B`` or ``W``):
    an ``F`` of chunk ``c`` adds ``saved[c]`` (counted from its start), a ``B`` frees it
    after it ran; an ``I`` keeps the graph (``W`` differentiates it) and adds ``for_w[c]``,
    the gradients it kept at the weights' nodes, all freed after ``W``.

    >>> s = Target.of(dtp.RunConfig(pp=2, pp_schedule="zb-h1", microbatches=4, seq=32))
    >>> held_over_schedule(rank_actions(s, 1), [10], [1])  # F0 I0 F1 I1 W0: I0's graph lives until W0
    {('F', 0): 21, ('I', 0): 21, ('W', 0): 22, ('I+', 0): 21, ('W+', 0): 22}
    """
    live, out, done = 0, {}, set()
    for a in actions:
        c = a.chunk
        if a.kind == "F":
            live += saved[c]
        # A backward after the chunk's first: its weight gradients meet existing sums.
        key = (a.kind + "+" * (a.kind != "F" and c in done), c)
        out[key] = max(out.get(key, 0), live)
        if a.kind in "BW":
            done.add(c)
        if a.kind == "B":
            live -= saved[c]
        elif a.kind == "I":
            live += for_w[c]
        elif a.kind == "W":
            live -= saved[c] + for_w[c]
    return out


def phases(s: Target, rank_leaves: list[Leaf], stage: int = 0) -> dict[str, tuple[int, int, int]]:
    """The moments of forward and backward the peak may be at, each as ``(gradients held,
    activations saved, working set)`` bytes on top of the rest (module docstring).

    >>> from dtp.planning.target import leaves
    >>> s = Target.of(dtp.RunConfig(dp=2, batch=8, seq=256))
    >>> {k: sum(v) for k, v in phases(s, leaves(s)).items()}      # doctest: +NORMALIZE_WHITESPACE
    {'loss forward': 12498176, 'loss backward': 12489984, 'below the loss': 12655104,
     'gradient reduction': 871168}
    """
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    zero = s.run.zero if s.run.dp > 1 else 0
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
        recv = (grads * (s.run.dp - 1) // s.run.dp if s.run.dp == 2 else grads) if _gloo(s) else 0
        reduction = grads // s.run.dp + recv
        if zero == 3:  # gathered buckets: at the loss those not freed after forward (all
            # without resharding); in backward the one in use and the one prefetched
            sizes = [b[0] * b[1] for b in buckets]
            gathered_fwd = sum(z for z, b in zip(sizes, buckets) if not (b[3] and s.run.reshard_after_forward))
            gathered_bwd = sum(sorted(sizes)[-2:])
    else:
        grads = _grad_bytes(s, w)
        reduction = grads if s.run.dp > 1 else 0  # DDP's all-reduce works on a copy of each gradient
    # Which blocks, head and embedding each chunk of this rank runs, per microbatch.
    n_seq = n_sequential_layers(cfg)
    layers = [r for _, r in rank_chunks(s, stage)]
    head_chunk = next((c for c, r in enumerate(layers) if n_seq - 1 in r), None)
    head = _head(s) if head_chunk is not None else _Head(0, 0, 0, 0, 0)
    full = s.run.recompute == "full"
    tr = s.residual_tokens

    def block(i: int) -> int:  # full recompute keeps each block's input only
        return tr * cfg.dim * e if full else block_activations(s, llama.is_moe(cfg, i))

    per_block = [block_activations(s, llama.is_moe(cfg, i - 1)) for r in layers for i in r if 0 < i < n_seq - 1]
    # What a chunk's forward saves for its backward (the embedding: the clamped ids and
    # the vocab-range mask; the head: _Head.saved), per microbatch: each chunk its own,
    # so the head's logits count on the chunk that holds them, not spread over the rank.
    saved = [sum(block(i - 1) for i in r if 0 < i < n_seq - 1) + (s.tokens * (8 + e) if 0 in r else 0)
             + (head.saved if c == head_chunk else 0) for c, r in enumerate(layers)]
    # Zero bubble's I keeps its graph for W (every saved tensor stays) and the gradients
    # that reached the nodes leading to a weight (:mod:`dtp.strategies.pipeline_split`).
    for_w = [sum(_boundary_grads(s, i, n_seq) for i in r) for r in layers]
    actions = rank_actions(s, stage)
    split = {a.chunk for a in actions if a.kind == "I"}
    held = held_over_schedule(actions, saved, for_w)
    # Weight gradients of a later microbatch's backward are new tensors beside the sums
    # until that backward ends (without ZeRO; measured, interleaved rank 1's peak).
    by_layer: dict[int, int] = {}
    for leaf in rank_leaves:  # each leaf's layer found once: interleaved ranks hold many chunks
        layer = _layer_of(leaf, n_seq)
        by_layer[layer] = by_layer.get(layer, 0) + leaf.nbytes
    chunk_w = [sum(by_layer.get(i, 0) for i in r) for r in layers]
    # The most held per (kind, chunk), and per kind over every chunk: most() asks per chunk.
    per_kind: dict[str, int] = {}
    for (k, c), v in held.items():
        per_kind[k] = max(per_kind.get(k, 0), v)

    def most(kinds: str, chunks: object = None) -> int:
        if chunks is None:
            return max((per_kind.get(k, 0) for k in kinds.split()), default=0)
        return max((held.get((k, c), 0) for k in kinds.split() for c in chunks), default=0)

    # Gradients before the first one of this step exists (one microbatch), or accumulated
    # over the earlier microbatches (or the pipeline's earlier backwards).
    early = grads if s.run.microbatches > 1 else 0
    out = {}
    if head_chunk is not None:
        at_loss = most("B I B+ I+", (head_chunk,))
        out["loss forward"] = (early, most("F", (head_chunk,)), head.forward + gathered_fwd + data)
        out["loss backward"] = (early, at_loss, head.backward + gathered_bwd + data)
        # ZeRO keeps gradients as they come until their bucket's last is in, so below the
        # loss (one microbatch) only the head's exist, in the accumulation dtype.
        head_paths = ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")
        head_grads = sum(l.numel * acc for l in rank_leaves if l.path in head_paths)
        below = early or head_grads if zero else grads
        # An I frees nothing as it goes (W needs its graph): the loss's tensors stay.
        below_saved = at_loss + for_w[head_chunk] if head_chunk in split else at_loss - head.loss_saved
        out["below the loss"] = (below, below_saved, head.below + gathered_bwd + data)
    others = [c for c in range(len(layers)) if c != head_chunk]
    if others:  # a chunk without the head: its backward starts at its last block
        work = 3 * tr * cfg.dim * e + gathered_bwd + data
        out["backward"] = (grads, max(most("B I I+", others), most("W")), work)
        later = [(most("B+ W+", (c,)), chunk_w[c]) for c in others if not zero and s.run.microbatches > 1]
        if later:
            live, fresh = max(later, key=sum)
            out["later backward"] = (grads + fresh, live, work)
    if full and per_block:
        # One block rebuilt in backward (its input counted twice: kept, and in the rebuilt
        # block, for the gradient arriving at it) at its MLP: gate and up gradients (GELU's
        # backward holds two as well, its output's and its input's: with one, a tiny tp2 + SP
        # GELU model planned 2.2 % under the measured peak, with two 9 % over).
        block_work = 2 * s.tokens * cfg.ffn_dim // s.run.tp * e + gathered_bwd + data
        # Without ZeRO a later microbatch's gradients are new tensors until backward ends,
        # added to the sums after: near the first block, a second set (measured, tp2 m=2).
        fresh = w if not zero and s.run.microbatches > 1 else 0
        # Blocks are rebuilt below the head, whose backward has freed what it saved.
        rebuilding = max(most("B I W B+ I+ W+", (c,)) - (head.saved if c == head_chunk else 0)
                         for c in range(len(layers)))
        out["block rebuilt"] = (grads + fresh, rebuilding + max(per_block), block_work)
        # Then its first norm's backward, which runs in fp32: five residual-sized fp32
        # temporaries at once while the MLP's tensors and part of attention's are freed
        # (measured, bf16 tp2 m=2 seq256: 3.35 MB, 2 % over the MLP moment). Counted as
        # attention's whole and four temporaries: 3.41 MB.
        norm_work = 4 * tr * cfg.dim * acc + tr * cfg.dim * e + gathered_bwd + data
        out["rebuilt block's norm"] = (grads + fresh, rebuilding + _attention_saved(s), norm_work)
    if reduction:
        out["gradient reduction"] = (grads, 0, reduction + data)
    return out


def _layer_of(leaf: Leaf, n_seq: int) -> int:
    """The layer of :func:`dtp.models.llama.sequential` a parameter belongs to (a tied
    embedding counts as the embedding's)."""
    if leaf.block is not None:
        return leaf.block + 1
    return 0 if leaf.path == "embed" else n_seq - 1


def _boundary_grads(s: Target, layer: int, n_seq: int) -> int:
    """Bytes of the gradients zero bubble's ``I`` keeps for ``W`` in sequential ``layer``:
    the output gradient of each op that reads a weight (:mod:`dtp.strategies.pipeline_split`'s
    boundary nodes). A block: q, k, v, the attention output's projection, gate, up, down,
    and the two norms' scaling; the head: the logits and the final norm's scaling; the
    embedding (no input gradient: ``I`` does nothing, ``W`` the whole backward) the
    gradient it received, counted as one residual.

    >>> s = Target.of(dtp.RunConfig(pp=2, tp=2, sp=True, pp_schedule="zbv", microbatches=4, seq=32))
    >>> [_boundary_grads(s, i, 4) for i in range(4)]
    [8192, 98304, 98304, 40960]
    """
    cfg, e = s.cfg, s.torch_dtype.itemsize
    t, tr = s.tokens, s.residual_tokens
    if layer == 0:
        return tr * cfg.dim * e
    if layer == n_seq - 1:
        return t * cfg.vocab_size // s.run.tp * e + tr * cfg.dim * e
    qkv = t * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim // s.run.tp
    return (qkv + 2 * t * cfg.dim + _MLP_GRADS[cfg.mlp] * t * cfg.ffn_dim // s.run.tp + 2 * tr * cfg.dim) * e


def _grad_bytes(s: Target, w: int) -> int:
    """Gradient bytes of ``w`` parameter bytes without ZeRO: the parameters' own, or under
    ``layouts.mixed_precision`` of bf16 parameters their fp32 accumulators (as big as the
    master weights and each moment).

    >>> mixed, pure = (Target.of(dtp.RunConfig(dtype="bfloat16", precision=p)) for p in ("mixed", "pure"))
    >>> _grad_bytes(mixed, 100), _grad_bytes(pure, 100)
    (200, 100)
    """
    e, acc = s.torch_dtype.itemsize, accum_dtype(s.torch_dtype).itemsize
    return w * acc // e if s.layout.precision is not None else w


def memory(s: Target, rank_leaves: list[Leaf], stage: int = 0) -> Memory:
    """The memory of pipeline rank ``stage`` holding ``rank_leaves``.

    >>> from dtp.planning.target import leaves
    >>> s = Target.of(dtp.RunConfig(dp=2, batch=8, seq=16))
    >>> m = memory(s, leaves(s))
    >>> m.rest // 427264, m.update // 427264     # 3 × params at rest, 6 × more to update
    (3, 6)
    """
    acc = accum_dtype(s.torch_dtype).itemsize
    w = sum(l.nbytes for l in rank_leaves)
    zero = s.run.zero if s.run.dp > 1 else 0
    data = _data(s)
    held = 0
    if zero:
        buckets = zero_buckets(s, rank_leaves)
        padded = sum(b[0] for b in buckets)
        buf, grads = sum(b[0] * b[1] for b in buckets), sum(b[0] * b[2] for b in buckets)
        slice_ = padded // s.run.dp
        if zero < 3:  # the gathered buckets; an fp32 master slice (a copy even for fp32 params)
            params, optimizer = buf, 3 * slice_ * acc
        else:  # the master slice is the parameters (gathers cast it on the fly)
            params, optimizer = slice_ * acc, 2 * slice_ * acc
            held = held_gathers(s, buckets)
        # The new tree over the slices, and one slice-sized temporary of AdamW's (a bucket's
        # slice is one tensor: measured 6 slices at ZeRO-3's update peak since optim.step,
        # 7 before it, torch 2.13)
        update = 5 * slice_ * acc + max(b[0] for b in buckets) // s.run.dp * acc
        if zero < 3:  # then the new slices gathered into new buckets, on gloo over more
            # than 2 ranks through a staging buffer of a whole bucket (measured, torch 2.13:
            # dp4 ZeRO-1's peak, 3 slices + 2 buckets); at dp=2 dtp.comm gathers straight
            # into the bucket (an all-to-all)
            staging = max(b[0] * b[1] for b in buckets) if _gloo(s) and s.run.dp > 2 else 0
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


def held_gathers(s: Target, buckets: list[tuple[int, int, int, bool]]) -> int:
    """Bytes of the whole buckets ZeRO-3 holds between steps: under
    ``overlap_param_gather`` the update gathers the next forward's first ``prefetch`` + 1
    buckets (what that forward holds at its first read) and the state keeps them until
    it takes them (:class:`dtp.strategies.zero_gathers.InflightGathers`); none otherwise.

    >>> from dtp.planning.target import leaves
    >>> s = Target.of(dtp.RunConfig(dp=2, zero=3, bucket_mb=0.05, overlap_param_gather=True))
    >>> held_gathers(s, zero_buckets(s, leaves(s)))     # prefetch 1: buckets 0 and 1, whole, fp32
    147968
    """
    opts = s.layout.zero if s.layout is not None else None
    if s.run.zero != 3 or s.run.dp == 1 or opts is None or not opts.overlap_param_gather:
        return 0
    return sum(b[0] * b[1] for b in buckets[:opts.prefetch + 1])
