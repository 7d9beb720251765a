"""``context_attention``: one entry point that picks a context-parallel algorithm by name."""

from __future__ import annotations

from torch.distributed.tensor import DTensor

from .hybrid import hybrid_attention
from .ring import double_ring_attention, ring_attention
from .ulysses import ulysses_attention

__all__ = ["ALGORITHMS", "context_attention"]

ALGORITHMS = {
    "ulysses": ulysses_attention,
    "ring": ring_attention,
    "double_ring": double_ring_attention,
    "hybrid": hybrid_attention,
}


def context_attention(q: DTensor, k: DTensor, v: DTensor, *, algo: str = "ring", **options) -> DTensor:
    """Dispatch to one of :data:`ALGORITHMS` (``"ulysses"``, ``"ring"``, ``"double_ring"``,
    ``"hybrid"``) with its keyword options (axis, causal, scale, load_balance, window,
    ulysses_degree).

    >>> with dtp.testing.simulate(2):
    ...     mesh = make_mesh(cp=2)
    ...     q, k, v = (dtp.shard(torch.randn(1, 4, 16, 8), mesh, P(None, None, "cp")) for _ in range(3))
    ...     out = context_attention(q, k, v, algo="ulysses")
    >>> dtp.spec_of(out)
    P(None, None, 'cp')
    """
    if algo not in ALGORITHMS:
        raise ValueError(f"context_attention: algo must be one of {tuple(ALGORITHMS)}, got {algo!r}")
    return ALGORITHMS[algo](q, k, v, **options)
