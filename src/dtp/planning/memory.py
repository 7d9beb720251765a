"""Per-rank memory of one training step: what rests between steps, and the peak.

Everything is arithmetic on the :class:`~dtp.planning.setup.Leaf` shapes and the batch.
The terms follow what dtp's code holds, not an idealised trainer:

* **at rest** — parameters and AdamW's two moments in the parameters' dtype (dtp's
  optimizer is functional); under ZeRO 1/2 the gathered parameter buckets (padded) plus
  this rank's slice of fp32 master weights and moments; under ZeRO 3 only the slices.
* **backward** — the rest, the gradients (whole buckets in the accumulation dtype under
  ZeRO: every stage reduce-scatters after backward unless overlapped), the activations
  autograd saves for one microbatch (times the microbatches a pipeline rank holds in
  flight), and a working set: at the head the logits' gradient and three residual-sized
  temporaries; under ZeRO the reduce-scatter's receive buffer (gloo runs it as an
  all-to-all) of the largest bucket.
* **update** — the rest plus the new tree the functional update builds beside the old
  one: gradients, clipped gradients, update, both new moments and the new parameters
  (6 × the parameters; under ZeRO 6 × the slice, plus the new gathered buckets at 1/2).

Saved activations per block, for ``t`` tokens a rank computes (``b·s/cp``), ``t_r`` in
its residual stream (``/tp`` with SP), element size ``e`` (counted from autograd's saved
tensors of the reference model): each of the two norms keeps its input and normalised
output on the residual layout and the linear's (gathered) input, ``(2·t_r + t)·h·e``;
attention keeps q, k, v and its output, ``t·(2·h_q + 2·h_kv)/tp·e`` plus the log-sum-exp;
the MLP keeps gate, up, their SiLU and product, ``4·t·f/tp·e``. Megatron's
``s·b·h·(34 + 5·a·s/h)`` (fp16, dropout and the softmax kept) is the same bookkeeping for
its kernels. Full recompute keeps each block's input and rebuilds one block at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import schedules
from .._rules import accum_dtype
from ..models import llama
from .setup import Leaf, Setup
from .traffic import zero_buckets

__all__ = ["Memory", "memory", "block_activations"]


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds (a pipeline rank: ``stage``)."""

    stage: int
    params: int  # the parameters (ZeRO 3: this rank's slice)
    grads: int  # gradients at their peak (ZeRO: whole buckets during backward)
    optimizer: int  # moments, and fp32 master slices under ZeRO
    activations: int  # saved for backward at the peak: microbatches in flight × per microbatch
    working: int  # transient: the head's gradient work or ZeRO's reduce-scatter buffer
    update: int  # the new tree the optimizer step builds beside the old
    in_flight: int  # microbatches whose activations the rank holds at once

    @property
    def rest(self) -> int:
        return self.params + self.optimizer

    @property
    def backward_peak(self) -> int:
        return self.rest + self.grads + self.activations + self.working

    @property
    def update_peak(self) -> int:
        return self.rest + self.update

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.update_peak)


def block_activations(s: Setup, moe: bool = False) -> int:
    """Bytes one transformer block saves for backward per microbatch (module docstring).

    >>> block_activations(Setup(cfg=llama.config("tiny"), batch=8, seq=256))
    8994816
    """
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    tp = s.tp
    t, tr = s.tokens, s.residual_tokens
    norms = 2 * ((2 * tr + t) * cfg.dim * e + tr * acc)
    attn = t * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim // tp * e + t * cfg.n_heads // tp * acc
    if tp > 1:  # split heads: the output's (b, s, heads·hd) view is no longer free, wo keeps a copy
        attn += t * cfg.n_heads * cfg.head_dim // tp * e
    rotary = 4 * (s.seq // s.cp) * (cfg.head_dim // 2) * acc  # cos and sin, for q and k
    if not moe:
        mlp = 4 * t * cfg.ffn_dim // tp * e
    else:  # routed rows (balanced) through each local expert's SwiGLU, the router's scores
        rows = t * cfg.top_k
        mlp = 4 * rows * cfg.expert_dim * e + 3 * rows * cfg.dim * e + t * cfg.num_experts * acc
        mlp += 4 * t * cfg.shared_experts * cfg.expert_dim * e
    return norms + attn + rotary + mlp


def _head(s: Setup) -> tuple[int, int]:
    """(saved, working set) of the final norm, head and loss per microbatch."""
    cfg, e = s.cfg, s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    t, tr = s.tokens, s.residual_tokens
    logits = t * cfg.vocab_size // s.tp * e
    saved = (2 * tr + t) * cfg.dim * e + tr * acc + logits + 2 * t * 8 + e  # + token ids, targets, loss
    if s.tp > 1:  # vocab-parallel cross-entropy keeps its exponentials and the target mask
        saved += logits + t * (8 + 1)
    return saved, logits + 3 * t * cfg.dim * e


def memory(s: Setup, rank_leaves: list[Leaf], stage: int = 0) -> Memory:
    """The memory of pipeline rank ``stage`` holding ``rank_leaves``.

    >>> from dtp.planning.setup import leaves
    >>> s = Setup(cfg=llama.config("tiny"), dp=2, batch=8, seq=16)
    >>> m = memory(s, leaves(s))
    >>> m.rest // 427264, m.update // 427264     # 3 × params at rest, 6 × more to update
    (3, 6)
    """
    cfg = s.cfg
    e = s.torch_dtype.itemsize
    acc = accum_dtype(s.torch_dtype).itemsize
    w = sum(l.nbytes for l in rank_leaves)
    zero = s.zero if s.dp > 1 else 0
    if zero:
        buckets = zero_buckets(s, rank_leaves)
        padded = sum(b[0] for b in buckets)
        buf, gbuf = sum(b[0] * b[1] for b in buckets), sum(b[0] * b[2] for b in buckets)
        slice_ = padded // s.dp
        params = buf if zero < 3 else slice_ * e
        # fp32 master slice (a copy even for fp32 params) and two moments in the master dtype
        optimizer = 3 * slice_ * acc
        grads = gbuf
        working_zero = max(b[0] * b[2] for b in buckets)  # the reduce-scatter's receive buffer
        update = 6 * slice_ * acc + (buf if zero < 3 else 0)
    else:
        params, optimizer, grads, working_zero = w, 2 * w, w, 0
        update = 6 * w
    # Activations: which blocks, head and embedding this rank runs, per microbatch.
    blocks = sorted({int(l.path.split(".")[1]) for l in rank_leaves if l.path.startswith("layers.")})
    has_head = any(l.path == "final_norm" for l in rank_leaves)
    head_saved, head_work = _head(s) if has_head else (0, 0)
    per_block = [block_activations(s, llama.is_moe(cfg, i)) for i in blocks]
    in_flight = 1
    if s.pp > 1:
        sched = schedules.make(s.pp_schedule, p=s.pp, v=s.virtual_stages, m=s.microbatches)
        timeline = schedules.simulate(sched, p=s.pp, v=s.virtual_stages, m=s.microbatches)
        in_flight = timeline.peak_in_flight[stage]  # (chunk, microbatch) pairs alive at once
    chunks = s.virtual_stages if s.pp > 1 else 1  # a pair holds one chunk: 1/v of the blocks
    # Backward's two candidate peaks: at the head (everything saved, the logits' gradient
    # work) and inside the first block it reaches (the head's tensors gone by then).
    if s.recompute == "full":
        kept = len(blocks) * s.residual_tokens * cfg.dim * e  # each block's input
        block_work = 2 * s.tokens * cfg.ffn_dim // s.tp * e  # gate and up gradients
        phases = [(kept + head_saved, head_work), (kept + max(per_block, default=0), block_work)]
    else:
        phases = [(sum(per_block) + head_saved, head_work)]
    older = (in_flight - 1) * -(-(sum(per_block) if s.recompute != "full" else kept) // chunks)
    saved, working = max(((older + -(-a // chunks), w) for a, w in phases), key=sum)
    return Memory(stage, params, grads, optimizer, saved, max(working, working_zero), update, in_flight)
