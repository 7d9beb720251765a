"""``attention`` and ``rotary``: SDPA's (batch, heads, seq, head_dim) layout on DTensors.

With heads split over tensor parallel ranks and batch over data parallel ranks,
attention is local: each rank runs SDPA on its own heads. A sequence split over a
context-parallel axis selects the layout's context-parallel algorithm.
"""

from __future__ import annotations

from ..core._rules import accum_dtype
from ..core._torch import is_local_tensor
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..core.mesh.devices import axis_sizes, block_index
from ..core.redistribute import local_map
from ..core.spec import P, spec_of
from ..layouts import context_options
from .blockwise import cp_permutation
from .context import context_attention
from .documents import document_keep
from .recompute import remat

__all__ = ["attention", "rotary", "rope_frequencies"]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
          ids: torch.Tensor | None = None, pos: torch.Tensor | None = None) -> torch.Tensor:
    # A branch, not enable_gqa=(k heads != q heads): in a compiled region with dynamic
    # shapes that comparison is a SymBool, which SDPA refuses (a graph break); a branch
    # specialises it (a guard).
    gqa = True if k.shape[1] != q.shape[1] else False
    if ids is None or pos is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    keep = document_keep(ids, pos, ids, pos, causal)[:, None]  # every query sees itself: no empty row
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)


Docs = tuple[torch.Tensor, torch.Tensor]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              scale: float | None = None, docs: Docs | None = None) -> torch.Tensor:
    """Scaled dot-product attention of (batch, heads, seq, head_dim) tensors; k/v may
    have fewer heads (grouped-query attention).

    ``docs``: packed documents, the batch's ``(documents, positions)`` entries
    ``(batch, seq)`` laid out like the tokens (:mod:`dtp.ops.documents`): each query
    attends only to its own document's keys.

    >>> q = torch.randn(1, 4, 8, 16); kv = torch.randn(1, 2, 8, 16)
    >>> attention(q, kv, kv).shape
    torch.Size([1, 4, 8, 16])
    >>> ids, pos = torch.tensor([[0] * 5 + [1] * 3]), torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    >>> alone = attention(q[:, :, 5:], kv[:, :, 5:], kv[:, :, 5:])  # the second document on its own
    >>> torch.allclose(attention(q, kv, kv, docs=(ids, pos))[:, :, 5:], alone)
    True
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads do not group evenly over {k.shape[1]} kv heads")
    if docs is not None and (len(docs) != 2 or any(d.shape != (q.shape[0], q.shape[2]) for d in docs)):
        raise ValueError(f"attention: docs must be (documents, positions) of shape {(q.shape[0], q.shape[2])}")
    if not isinstance(q, DTensor):
        return remat(_sdpa, q, k, v, causal, scale, *(docs or ()), level="selective")
    qs, ks = spec_of(q), spec_of(k)
    if qs.axes_of(2) or ks.axes_of(2):
        return _context(q, k, v, causal, scale, docs)
    if qs.axes_of(0) != ks.axes_of(0) or qs.axes_of(1) != ks.axes_of(1) or spec_of(v) != ks:
        raise ValueError(f"attention: q {qs}, k {ks} and v {spec_of(v)} must split batch and heads alike")

    def local(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, *doc: torch.Tensor) -> torch.Tensor:
        if ql.shape[1] % kl.shape[1]:  # the same on every rank: the specs split heads alike
            raise ValueError(f"attention: local heads {ql.shape[1]} (q) vs {kl.shape[1]} (kv) do not group evenly")
        return remat(_sdpa, ql, kl, vl, causal, scale, *doc, level="selective")

    if docs is None:
        return local_map(local, (None, None, None), qs, check_shapes=False)(q, k, v)
    rows = P(*qs.dims[:1], *qs.dims[2:3])  # (batch, seq) as q's
    return local_map(local, (None, None, None, rows, rows), qs, check_shapes=False)(q, k, v, *docs)


def _context(q: DTensor, k: DTensor, v: DTensor, causal: bool, scale: float | None,
             docs: Docs | None = None) -> DTensor:
    """Sequence split over a context-parallel axis: run the active layout's algorithm."""
    opts = context_options()
    seq_axes = spec_of(q).axes_of(2)
    if len(seq_axes) != 1:
        raise ValueError(f"attention: the sequence must be split over one context-parallel axis, got {seq_axes}")
    kwargs = dict(axis=seq_axes[0], causal=causal, scale=scale, load_balance=opts.load_balance,
                  head_chunks=opts.head_chunks)
    if opts.algo in ("double_ring", "hybrid"):
        kwargs["window"] = opts.window
    if opts.algo == "hybrid":
        kwargs["ulysses_degree"] = opts.ulysses_degree
    if docs is not None:
        kwargs["docs"] = docs
    return context_attention(q, k, v, algo=opts.algo, **kwargs)


def _positions(x: DTensor, seq_dim: int) -> torch.Tensor:
    """Global positions of the sequence rows this rank holds (cp order under zigzag)."""
    mesh, axes = x.device_mesh, spec_of(x).axes_of(seq_dim)
    sizes = axis_sizes(mesh)
    n, idx = math.prod(sizes[a] for a in axes), block_index(mesh, axes)
    order = cp_permutation(x.shape[seq_dim], n, context_options().load_balance if n > 1 else None)
    local = x.shape[seq_dim] // n
    return order[idx * local:(idx + 1) * local]


def rope_frequencies(half: int, theta: float, scaling: tuple[float, float, float, int] | None,
                     dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """RoPE's ``half`` inverse frequencies ``theta^(-i/half)``, with Llama 3.1's scaling
    when ``scaling`` is ``(factor, low_freq_factor, high_freq_factor, original_len)``.

    >>> rope_frequencies(4, 10000.0, None, torch.float64)
    tensor([1.0000, 0.1000, 0.0100, 0.0010], dtype=torch.float64)
    """
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=dtype, device=device) / half)
    if scaling is None:
        return inv
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv
    # Long wavelengths are stretched by factor, short ones kept, the band between blended.
    stretched = torch.where(wavelen > original / low, inv / factor, inv)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * stretched / factor + smooth * stretched
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, blended, stretched)


# RoPE's rotation as ``x·C + swap(x)·S``: C = [cos, cos], S = [-sin, sin] and swap(x) =
# [x2, x1] give [x1·cos - x2·sin, x2·cos + x1·sin] bit for bit (negation is exact; so is
# a + (-b) = a - b), in 4 kernels instead of 7: fwd+bwd 0.59 × the halves' form at
# (8, 128, 4, 16), 0.80 × at (8, 512, 8, 64), fp32, one thread (medians of 15, load 6-8).
# The tables for positions 0..n-1 are made once per
# (head_dim, theta, scaling, dtype, device) and grown when a longer sequence comes: the
# model asks for them twice per block (q, k) and again under recompute.
_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def _rope_tables(n: int, half: int, theta: float, scaling: tuple[float, float, float, int] | None,
                 dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """C and S (``(≥ n, 2·half)``) for the positions ``0 … n-1``, cached."""
    key = (half, theta, scaling, dtype, device)
    got = _TABLES.get(key)
    if got is None or got[0].shape[0] < n:
        length = max(n, 2 * got[0].shape[0]) if got is not None else n
        inv = rope_frequencies(half, theta, scaling, dtype, device)
        got = _tables(torch.arange(length, device=device).to(dtype)[:, None] * inv)
        if not is_local_tensor(got[0]):
            # Under dtp.testing.simulate (LocalTensorMode) arange makes per-rank tensors:
            # cached, they reached a later plain run of the same process (the CLI's
            # loss became a LocalTensor after a simulated doctest).
            _TABLES[key] = got
    return got


def _rope(x: torch.Tensor, positions: torch.Tensor | None, theta: float,
          scaling: tuple[float, float, float, int] | None = None, length: int | None = None) -> torch.Tensor:
    """``x`` rotated at ``positions`` (``None``: its rows are positions 0 … seq-1);
    ``length`` (every position is below it) lets the cached tables serve (``None``:
    positions given by the caller, tables made here)."""
    acc = accum_dtype(x.dtype)
    half = x.shape[-1] // 2
    if positions is None:
        n = x.shape[1]
        if not torch.compiler.is_compiling():  # the tables' first rows: a view, no gather
            table_cos, table_sin = _rope_tables(n, half, theta, scaling, acc, x.device)
            return _rotate(x.to(acc), table_cos[:n].unsqueeze(-2), table_sin[:n].unsqueeze(-2)).to(x.dtype)
        positions = torch.arange(n, device=x.device)  # a traced region makes its own tables below
    if length is None or torch.compiler.is_compiling():  # a traced region makes its own
        inv = rope_frequencies(half, theta, scaling, acc, x.device)
        cos, sin = _tables(positions.to(acc)[..., None] * inv)  # (seq, 2·half), or (batch, seq, 2·half)
    else:
        table_cos, table_sin = _rope_tables(length, half, theta, scaling, acc, x.device)
        cos, sin = table_cos.index_select(0, positions), table_sin.index_select(0, positions)
    # broadcast over heads
    return _rotate(x.to(acc), cos.unsqueeze(-2), sin.unsqueeze(-2)).to(x.dtype)


def _swap(t: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    return torch.cat([t[..., half:], t[..., :half]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x·C + swap(x)·S``: :class:`_Rotate` in eager; plain ops in a traced region,
    whose graph lays out its gradients itself. torch 2.11 (the lent GPU machine's) traces
    the Function's backward wrong: ``torch.compile(backend="aot_eager")`` of it gave
    gradients off by O(1) in fp64 on the CPU, and every compiled dtp step wrong q/k
    gradients (``tests/test_compiled.py``: 8 failures); torch 2.13 traces it
    exactly. The plain ops' gradient is the same sum of the same two terms.

    >>> x, c, s = torch.randn(2, 3, 1, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    >>> torch.equal(_rotate(x, c, s), x * c + _swap(x) * s)
    True
    """
    if torch.compiler.is_compiling():
        return (x * cos + _swap(x) * sin).contiguous()
    return _Rotate.apply(x, cos, sin)


class _Rotate(torch.autograd.Function):
    """``x·C + swap(x)·S``; backward ``g·C + swap(g·S)`` (swap is its own transpose).
    Both contiguous, as the halves' slices and cat made them: elementwise ops keep a
    strided operand's layout (SDPA's transposed gradient), and the model views the
    result and autograd views the gradient (the dp2 plan test caught the latter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return (x * cos + _swap(x) * sin).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return (grad * cos + _swap(grad * sin)).contiguous(), None, None


def rotary(x: torch.Tensor, theta: float = 10000.0,
           scaling: tuple[float, float, float, int] | None = None,
           positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding of ``x`` laid out (batch, seq, heads, head_dim); with
    ``scaling``, Llama 3.1's frequency scaling (:func:`rope_frequencies`).

    Positions are the global sequence positions of the rows this rank holds — under
    context parallel with zigzag load balance, the original positions of its chunks.
    ``positions`` ``(batch, seq)``, laid out like the tokens, gives them instead (packed
    documents: positions restart in each document).

    >>> rotary(torch.randn(1, 8, 2, 16)).shape
    torch.Size([1, 8, 2, 16])
    >>> x = torch.randn(1, 8, 2, 16)
    >>> torch.allclose(rotary(x, positions=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))[:, 3:], rotary(x[:, 3:]))
    True
    """
    if positions is not None and positions.shape != x.shape[:2]:
        raise ValueError(f"rotary: positions must be (batch, seq) = {tuple(x.shape[:2])}, got {tuple(positions.shape)}")
    if not isinstance(x, DTensor):
        return _rope(x, positions, theta, scaling)
    spec = spec_of(x)
    if spec.axes_of(3):
        raise ValueError(f"rotary: head_dim must not be split ({spec})")
    if positions is None and not spec.axes_of(1):  # every row here, in order (tp, sp after the gather)
        return local_map(lambda t: _rope(t, None, theta, scaling), (None,), spec, check_shapes=False)(x)
    if positions is not None:
        rows = P(*spec.dims[:2])  # (batch, seq) as x's

        def rope(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
            return _rope(t, p.to(t.device), theta, scaling)

        return local_map(rope, (None, rows), spec, check_shapes=False)(x, positions)
    positions = _positions(x, 1)
    length = x.shape[1]  # global: every rank's positions are below it
    return local_map(lambda t: _rope(t, positions.to(t.device), theta, scaling, length), (None,), spec,
                     check_shapes=False)(x)
