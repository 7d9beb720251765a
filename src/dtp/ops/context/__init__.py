"""Context-parallel attention: MindSpeed's long-sequence algorithms on DTensors.

All four take ``q``/``k``/``v`` DTensors in SDPA's ``(batch, heads, seq, head_dim)``
layout with the sequence split over a context-parallel mesh axis (``cp``), heads
possibly over tensor parallel axes (``tp``) and the batch over data parallel axes, and
return the output laid out like ``q``:

=========================  ==================================================================
:func:`ulysses_attention`  DeepSpeed-Ulysses: one all-to-all per tensor trades the sequence
                           split for a head split, attention runs on the full sequence and
                           a head subset, one all-to-all brings the output back.
:func:`ring_attention`     K/V travel round the cp ring (one send/recv per step, the next
                           posted before the current block is computed); partial outputs
                           are merged by log-sum-exp. Backward recirculates K/V and carries
                           dK/dV (fp32 for low precision) round the ring back to their owner.
:func:`double_ring_attention`  MindSpeed's double ring: an inner ring inside windows of
                           ``window`` consecutive cp ranks, an outer ring across windows whose
                           transfer is prefetched for a whole inner round.
:func:`hybrid_attention`   USP (Ulysses × ring): Ulysses over groups of ``ulysses_degree``
                           contiguous cp ranks, (double) ring over the strided rest.
=========================  ==================================================================

Sequence order (load balancing)
-------------------------------
With ``load_balance="zigzag"`` (the default) the *global* sequence of the DTensors is in
cp order (:func:`dtp.ops.blockwise.to_cp_order`): rank ``r`` of ``cp`` holds chunks ``r``
and ``2cp-1-r`` of ``2cp`` equal chunks, which balances causal work. The same data order
serves every algorithm here (the data pipeline permutes tokens once, positions for RoPE
come from :func:`dtp.ops.blockwise.zigzag_permutation`); ``load_balance=None`` is the
plain contiguous split. The output is in the same order as the input.

Collectives all go through :mod:`dtp.comm` (recorded by :func:`dtp.comm_log`); ring
sub-axes (double ring windows, the hybrid's ring × Ulysses split of ``cp``) are mesh views
made with ``DeviceMesh._unflatten`` and cached per mesh. Every constraint is checked,
with a ``ValueError`` naming it, on every rank before any collective.

Packed documents (``docs=(documents, positions)``, :mod:`dtp.ops.documents`): every
algorithm takes them; a rank computes only the tiles some document spans, each under
its document mask, and :func:`block_counts` counts the tiles computed and skipped.

:func:`trace_compute` records when each ring step's block computation started and ended,
so tests can prove the transfers overlap the compute.
"""

from ._common import CHUNK_TARGET, MIN_CHUNK_BYTES, default_chunks, trace_compute
from ._docs import block_counts
from .dispatch import ALGORITHMS, context_attention
from .hybrid import hybrid_attention
from .ring import double_ring_attention, ring_attention
from .ulysses import ulysses_attention

__all__ = [
    "ulysses_attention",
    "ring_attention",
    "double_ring_attention",
    "hybrid_attention",
    "context_attention",
    "default_chunks",
    "CHUNK_TARGET",
    "MIN_CHUNK_BYTES",
    "ALGORITHMS",
    "trace_compute",
    "block_counts",
]
