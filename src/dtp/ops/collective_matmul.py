"""Async tensor parallel: sequence parallel's collectives as rings under the matmuls.

Under ``layouts.megatron(sequence_parallel=True, async_tp=True)`` a block's entry
all-gather and exit reduce-scatter over the tp axis become rings of
:func:`dtp.comm.send_recv` hops (the decomposition of Wang et al., ASPLOS 2023, XLA's
collective matmul), each hop moving while a matmul runs on the shard in hand: one-way
(``tp - 1`` steps) at tp 2, bidirectional (a hop each way a step, ``tp // 2`` steps)
from tp 3 up where the shards halve evenly (:mod:`dtp.ops.tp_rings` has the schedules
and says when each is chosen and what each buys on which link). The
bytes per rank per axis are the collectives' own ((n-1) shards each way); only the
records' kind changes (``send_recv``). The model does not change; ``constrain`` and
``linear`` share the work through two hand-offs:

**Entry (all-gather → column-parallel matmuls).** ``constrain`` of a seq-split input to
a gathered one (plan: one all-gather over tp) does not gather: :func:`ring_constrain`
returns a DTensor over a buffer of the gathered shape holding only this rank's shard,
with the ring's state attached to that DTensor. The first ``linear`` that reads it runs
the ring (:class:`_RingMatmul`): each step multiplies the shard in hand into its rows of
the output while the next shard moves, and copies every arriving shard into the buffer.
Every later consumer of the same input (K and V after Q; up after gate) finds the buffer
full and multiplies it whole (:class:`_RingConsumer`): ONE ring per block entry, however
many consumers. In backward the later consumers run first (autograd runs the later-made
of two ready nodes first) and compute only their weight gradients, leaving their output
gradients with the ring's state; the first consumer's backward, whose autograd input is
the seq-split input itself, then reduce-scatters the sum of all the consumers' input
gradients once, as the dual ring of partial sums, computing its own weight gradient and
the own chunk's input gradient under the hop. (It checks that every later consumer has
run first and fails loudly otherwise.) A plain consumer (a weight not split over the
ring's axis) sends its input gradient to the entry's own reduce-scatter
(:class:`_RingEntry`), and so does every consumer inside :func:`split_backward` (zero
bubble's input-gradient pass runs only the nodes on the input's path, which a
weight-gradient-only consumer is not on; the pipeline strategy sets it for schedules with
``I`` / ``W`` actions).
The buffer starts as NaN, so a reader other than ``linear`` that would see it before
the ring ran fails loudly. An op that reads it whole calls :func:`filled` first, which
runs the entry as the plain ring (the same hops, nothing under them).

**Exit (row-parallel matmul → reduce-scatter).** ``linear`` with a row-parallel weight
(its output a pending sum over tp) returns a *deferred* DTensor: a NaN placeholder of the
output's shape that remembers its input and weight. ``constrain`` to the seq-split
residual (plan: one reduce-scatter over tp) runs :class:`_MatmulScatter`: the partial sum
of one destination's rows is computed while the previous one is in flight, and each hop
adds its own term. Any other use goes through :func:`materialized` first (the plain
matmul). Its backward is the ring all-gather of the output gradient, each arriving shard
multiplied into its rows of the input gradient and added to the weight gradient while
the next one moves.

What runs under each hop: forward, the entry's first consumer's matmul on the shard in
hand (not K/V or up: they are later ``linear`` calls, not known when the ring runs) and
the exit's next partial product; backward, the exit gradient's input- and weight-gradient
products, and under the entry's reduce-scatter the next chunk's input gradient (all
consumers) plus the first consumer's weight gradient (the later consumers' weight
gradients are computed in their own nodes, before the ring: autograd can only deliver a
weight's gradient from a node that took the weight). Bidirectional, the first step's two
hops run under the own shard's product and each later step's under the two shards the
step before brought.

**MoE blocks** (dense attention, MoE FFN). The attention entries and exits keep their
rings. The MoE FFN's entry is read by the router and the token dispatch, not by a
``linear``, so :func:`dtp.ops.moe.moe_ffn` fills it before routing: its hops
stay exposed, as the all-gather they replace (the router's matmul is d × E, nothing
worth hiding, and the experts need the routing first). A shared expert's gate / up then
read the filled buffer as plain consumers; making its gate the ring's first consumer
instead would send the router's input gradient to the entry's own reduce-scatter besides
the first consumer's ring: two reduce-scatters, more bytes than non-async SP. Every
reader's input gradient reaches :class:`_RingEntry`, summed by autograd, and moves at
most once: the dual ring when the sum is pending over tp (experts split over tp, or a
shared expert), a local slice when it is whole on every tp rank (experts whole on each,
routing the same tokens: measured, no tp bytes), as non-async SP's all-gather backward.
The block's exit has no row-parallel ``linear`` to defer (the routed experts' output is
combined per token; a shared expert's deferred output is materialized for the sum), so
it keeps non-async SP's collectives: a reduce-scatter with experts over tp, else a slice
forward and an all-gather backward. **Experts over tp**
(``layouts.expert(tp_axis="tp")``, ``--expert-tp``): the tp all-gathers /
reduce-scatters of :mod:`dtp.ops.moe_pipe` stay collectives. The decomposition fits one
chunk's gather → SwiGLU → scatter, but there the legs and the compute are separate on
purpose: one engine runs forward and backward, and ``pipe_experts`` already hides each
chunk's legs under another chunk's FFN (what the ring would buy); a ring fuses a chunk's
matmuls into its own legs, which the ``multi_stream`` engine cannot take (its legs run
on another thread, one collective at a time, so they never meet an ep all-to-all) and
each other engine would need in a second, fused form. They read the rows of the filled
buffer, so they are correct under async tp, with non-async SP's bytes.

Outside a layout with async_tp, on a LocalTensor simulation (no point-to-point there) or
for any other plan, both fall back to the collectives of :mod:`dtp.redistribute`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core._torch import is_local_tensor, local_tensor
from ..layouts.core import current  # the core alone: layouts.megatron calls in here
from ..core.mesh.devices import axis_sizes, coordinates
from ..core.redistribute import local_map, reshard, reshard_steps
from ..core.spec import P, spec_of, wrap_local
from .tp_rings import both_ways, gather_ring, piece, scatter_ring

__all__ = ["ring_constrain", "ring_linear", "filled", "defers", "deferred", "materialized", "async_axis",
           "split_backward"]

_DEFERRED = "_dtp_deferred"  # attribute of a deferred DTensor: (x, w) of its row-parallel matmul
_RING = "_dtp_ring"  # attribute of an entry DTensor: (its _RingState, the buffer under it)


_split_depth = 0  # > 0 inside split_backward()


@contextlib.contextmanager
def split_backward() -> Iterator[None]:
    """Forwards run inside will have their backward split (zero bubble's ``I`` then
    ``W``): each later consumer of an entry ring sends its input gradient to the entry's
    own reduce-scatter, as a plain matmul would, instead of to the first consumer's ring.
    ``I`` runs only the nodes on the input's path, and a later consumer whose backward
    computes only its weight's gradient is not on it (module docstring).

    >>> with split_backward():
    ...     pass
    """
    global _split_depth
    _split_depth += 1
    try:
        yield
    finally:
        _split_depth -= 1


def async_axis() -> str | None:
    """The tp axis whose SP collectives run as rings: the active layout's, when it asks
    for ``async_tp``; else ``None``.

    >>> async_axis() is None   # no active layout
    True
    """
    active = current()
    if active is None or active[0].megatron is None or not active[0].megatron.async_tp:
        return None
    return active[0].megatron.axis


@dataclass
class _RingState:
    """What the entry ring of one gathered input needs: this rank's shard, where it goes."""

    shard: torch.Tensor | None  # this rank's seq shard (local, no autograd); dropped once sent
    x: DTensor | None  # the seq-split input: the first consumer's autograd input; dropped after
    mesh: DeviceMesh
    axis: str
    dim: int  # the gathered (sequence) dim
    tag: str
    filled: bool = False
    split: bool = False  # made inside split_backward(): consumers' input gradients go to the entry
    both_ways: bool = False  # the rings (forward and backward) bidirectional: dtp.ops.tp_rings.both_ways
    consumers: int = 0  # ring consumers (column-parallel linears) of the buffer in forward
    # (output gradient, weight) of each later consumer, left by its backward for the
    # first consumer's, which reduce-scatters all their input gradients in one ring.
    stash: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _ring_of(mesh: DeviceMesh, axis: str) -> tuple[int, int]:
    return axis_sizes(mesh)[axis], coordinates(mesh)[axis]


def _gather_ring(state: _RingState, buffer: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor | None:
    """Run the entry ring: fill ``buffer`` shard by shard; with ``w``, multiply each
    shard into its rows of ``buffer @ w`` while the next ones move (returned)."""
    n, me = _ring_of(state.mesh, state.axis)
    out = None if w is None else buffer.new_empty((*buffer.shape[:-1], w.shape[-1]))
    shard, state.shard = state.shard, None
    assert shard is not None, "async tp: an entry ring runs once"

    def use(c: int, part: int | None, x: torch.Tensor) -> None:
        if c != me:  # the own shard is in the buffer already (_RingEntry)
            piece(buffer, state.dim, n, c, part).copy_(x)
        if out is not None:
            piece(out, state.dim, n, c, part).copy_(x @ w)

    gather_ring(shard, n, me, state.mesh, state.axis, state.dim, state.tag, use, bidirectional=state.both_ways)
    state.filled = True
    return out


class _RingEntry(torch.autograd.Function):
    """seq-split x → the gathered-shape ``buffer`` holding only x's shard (the ring runs
    in the first consumer); backward: the gradients of every consumer, summed,
    reduce-scattered by the dual ring."""

    @staticmethod
    def forward(ctx, x: DTensor, buffer: torch.Tensor, state: _RingState, dst: P) -> DTensor:  # type: ignore[override]
        n, me = _ring_of(state.mesh, state.axis)
        ctx.src, ctx.dst, ctx.dim, ctx.axis, ctx.tag, ctx.shape = (spec_of(x), dst, state.dim, state.axis,
                                                                   state.tag, tuple(x.shape))
        ctx.both_ways = state.both_ways
        piece(buffer, state.dim, n, me).copy_(state.shard)
        return wrap_local(buffer, state.mesh, dst, tuple(x.shape))

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        pending = P(*ctx.dst.dims, partial=(ctx.axis,))
        tag = f"{ctx.tag} backward"
        if spec_of(grad) != pending:  # not the consumers' pending sum: the general path
            return reshard(grad, P(*ctx.src.dims), tag=tag), None, None, None
        mesh, g = grad.device_mesh, local_tensor(grad)
        n, me = _ring_of(mesh, ctx.axis)
        out = scatter_ring(lambda c, part: piece(g, ctx.dim, n, c, part).contiguous(), n, me, mesh, ctx.axis,
                           ctx.dim, tag, bidirectional=ctx.both_ways)
        return wrap_local(out, mesh, P(*ctx.src.dims), ctx.shape), None, None, None


class _RingMatmul(torch.autograd.Function):
    """The first consumer of an entry buffer: ``buffer @ w`` computed ring-wise while the
    buffer fills. Its autograd input is the seq-split ``x`` itself (not the buffer): its
    backward runs after every later consumer's (:class:`_RingConsumer`, made after it)
    and reduce-scatters the sum of all their input gradients as the dual ring, with this
    consumer's weight gradient and the own chunk's input gradient computed under the hop."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, buffer: torch.Tensor,  # type: ignore[override]
                state: _RingState) -> torch.Tensor:
        out = _gather_ring(state, buffer, w)
        ctx.save_for_backward(buffer, w)  # whole by now
        ctx.state, ctx.x_shape = state, tuple(x.shape)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        state: _RingState = ctx.state
        if state.split:  # its input is the buffer: the entry reduce-scatters every consumer's gradient
            gw = x.reshape(-1, x.shape[-1]).transpose(0, 1) @ g.reshape(-1, g.shape[-1])
            return g @ w.transpose(0, 1), gw, None, None
        if len(state.stash) != state.consumers - 1:
            raise RuntimeError(f"async tp ({state.tag}): the entry's first consumer ran its backward before "
                               f"{state.consumers - 1 - len(state.stash)} later consumer(s) of the same input; "
                               "its reduce-scatter needs all their gradients")
        pairs, state.stash = [(g, w), *state.stash], []
        n, me = _ring_of(state.mesh, state.axis)
        gw: list[torch.Tensor] = []

        def terms(c: int, part: int | None) -> torch.Tensor:  # Σ over consumers of chunk c's input gradient
            out = None
            for gi, wi in pairs:
                t = piece(gi, state.dim, n, c, part) @ wi.transpose(0, 1)
                out = t if out is None else out.add_(t)
            assert out is not None
            return out.contiguous()

        def weight_grad() -> None:
            gw.append(x.reshape(-1, x.shape[-1]).transpose(0, 1) @ g.reshape(-1, g.shape[-1]))

        gx = scatter_ring(terms, n, me, state.mesh, state.axis, state.dim, f"{state.tag} backward", weight_grad,
                          bidirectional=state.both_ways)
        if not gw:  # a ring of one rank: no hop to hide it under
            weight_grad()
        return gx.reshape(ctx.x_shape), gw[0], None, None


class _RingConsumer(torch.autograd.Function):
    """A later consumer of a filled entry buffer (K and V after Q; up after gate): a plain
    ``x @ w`` whose backward computes only the weight gradient and leaves the output
    gradient to the first consumer's ring (:class:`_RingMatmul`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, state: _RingState) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.state = state
        return x @ w

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        ctx.state.stash.append((g, w))
        return None, x.reshape(-1, x.shape[-1]).transpose(0, 1) @ g.reshape(-1, g.shape[-1]), None


class _MatmulScatterGrad(torch.autograd.Function):
    """The exit's autograd half: holds ``x`` and ``w`` and, in backward, runs the ring
    all-gather of the output gradient under its matmuls. Forward returns a free zero
    stand-in of the output's shape; :class:`_MatmulScatter` computes the value.

    Two nodes, so that a recompute (non-reentrant checkpoint) which only needs ``x`` and
    ``w`` back stops before the ring runs: its early stop fires when a node that saves
    is made, after that node's forward; one node would run the ring first, then stop
    (one reduce-scatter's bytes more than non-async SP per recomputed block)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, mesh: DeviceMesh, axis: str,  # type: ignore[override]
                dim: int, tag: str, bidirectional: bool) -> torch.Tensor:
        n, _ = _ring_of(mesh, axis)
        ctx.save_for_backward(x, w)
        ctx.mesh, ctx.axis, ctx.dim, ctx.tag, ctx.both_ways = mesh, axis, dim, tag, bidirectional
        shape = list(x.shape[:-1]) + [w.shape[-1]]
        shape[dim] //= n
        return x.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        n, me = _ring_of(ctx.mesh, ctx.axis)
        gx = torch.empty_like(x)
        gw = torch.zeros_like(w)

        def use(c: int, part: int | None, gc: torch.Tensor) -> None:  # under the hops in flight
            piece(gx, ctx.dim, n, c, part).copy_(gc @ w.transpose(0, 1))
            xc = piece(x, ctx.dim, n, c, part)
            gw.add_(xc.reshape(-1, xc.shape[-1]).transpose(0, 1) @ gc.reshape(-1, gc.shape[-1]))

        gather_ring(g.contiguous(), n, me, ctx.mesh, ctx.axis, ctx.dim, f"{ctx.tag} backward", use,
                    bidirectional=ctx.both_ways)
        return gx, gw, None, None, None, None, None


class _MatmulScatter(torch.autograd.Function):
    """Row-parallel ``x @ w`` reduce-scattered over ``axis`` along ``dim``, as the dual
    ring; its gradient passes to :class:`_MatmulScatterGrad` through ``stand_in``."""

    @staticmethod
    def forward(ctx, stand_in: torch.Tensor, x: torch.Tensor,  # type: ignore[override]
                w: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int, tag: str, bidirectional: bool) -> torch.Tensor:
        n, me = _ring_of(mesh, axis)
        return scatter_ring(lambda c, part: piece(x, dim, n, c, part) @ w, n, me, mesh, axis, dim, tag,
                            bidirectional=bidirectional)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None, None, None, None, None, None, None


def _matmul_scatter(x: torch.Tensor, w: torch.Tensor, mesh: DeviceMesh, axis: str, dim: int,
                    tag: str) -> torch.Tensor:
    n, _ = _ring_of(mesh, axis)
    bidirectional = both_ways(n, x.shape[dim] // n)  # taken once: forward and backward alike
    stand_in = _MatmulScatterGrad.apply(x, w, mesh, axis, dim, tag, bidirectional)
    return _MatmulScatter.apply(stand_in, x.detach(), w.detach(), mesh, axis, dim, tag, bidirectional)


def _single(x: DTensor, dst: P, kind: str, axis: str) -> int | None:
    """The tensor dim of the one ``kind`` step over ``axis`` that takes ``x`` to ``dst``
    (a leading dim, not the last), or ``None`` when the plan is anything else."""
    steps = reshard_steps(spec_of(x), dst, x.dim())
    if len(steps) == 1 and steps[0].kind == kind and steps[0].axis == axis and 0 <= steps[0].dim < x.dim() - 1:
        return steps[0].dim
    return None


def ring_constrain(x: DTensor, dst: P, *, tag: str) -> DTensor | None:
    """``constrain``'s async-tp path: the entry ring's buffer (a gather over the tp axis),
    the exit's dual ring (a deferred row-parallel output reduce-scattered over it), or
    ``None`` for every other move (the caller reshards; a deferred ``x`` is materialized
    here first).

    >>> ring_constrain(torch.ones(2), P(), tag="x") is None   # a plain tensor: nothing to do
    True
    """
    axis = async_axis()
    if axis is None or not isinstance(x, DTensor) or is_local_tensor(local_tensor(x)):
        return None
    held = getattr(x, _DEFERRED, None)
    if held is not None:
        dim = _single(x, dst, "reduce_scatter", axis)
        if dim is None:
            return reshard(materialized(x), dst, tag=tag)
        xin, w, _ = held
        n = axis_sizes(x.device_mesh)[axis]
        if x.shape[dim] % n:
            return reshard(materialized(x), dst, tag=tag)
        fn = functools.partial(_matmul_scatter, mesh=x.device_mesh, axis=axis, dim=dim, tag=tag)  # eager: _RING_BODY
        return local_map(fn, (None, None), dst, check_shapes=False)(xin, w)
    dim = _single(x, dst, "all_gather", axis)
    if dim is None:
        return None
    local = local_tensor(x)
    shape = list(local.shape)
    shape[dim] *= axis_sizes(x.device_mesh)[axis]
    # NaN until the ring fills it: a reader other than linear fails loudly (module docstring).
    buffer = torch.full(shape, float("nan"), dtype=local.dtype, device=local.device)
    state = _RingState(local.detach().contiguous(), x, x.device_mesh, axis, dim, tag, split=_split_depth > 0,
                       both_ways=both_ways(axis_sizes(x.device_mesh)[axis], local.shape[dim]))
    out = _RingEntry.apply(x, buffer, state, dst)
    setattr(out, _RING, (state, buffer))
    return out


def filled(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, with an entry buffer no ``linear`` has filled yet filled now by the
    plain ring (its hops with nothing under them): for ops that read a block's
    gathered input other than through ``linear`` (the MoE router and token dispatch).

    Its gradient reaches the entry's own reduce-scatter (:class:`_RingEntry`, the dual
    ring when it is a pending sum over tp), summed there by autograd with every other
    consumer's: one reduce-scatter per entry, as non-async SP's all-gather backward.

    >>> filled(torch.ones(2)).tolist()   # not an entry buffer: as is
    [1.0, 1.0]
    """
    held: tuple[_RingState, torch.Tensor] | None = getattr(x, _RING, None)
    if held is not None and not held[0].filled:
        state, buffer = held
        # The first consumer of an unfilled buffer: no ring consumer takes the seq-split
        # input after this (ring_linear finds it filled), so drop the reference now.
        state.x = None
        with torch.no_grad():
            _gather_ring(state, buffer, None)
    return x


def defers(x: torch.Tensor, w_in: tuple[str, ...]) -> bool:
    """Whether ``linear`` leaves ``x @ w`` to the exit's ring: under async tp, for a weight
    whose input dim is split over exactly the tp axis (row parallel) and an ``x`` with no
    pending sum, on real ranks (a LocalTensor simulation has no point-to-point).

    >>> defers(torch.ones(2), ("tp",))   # no active layout
    False
    """
    axis = async_axis()
    return (axis is not None and isinstance(x, DTensor) and w_in == (axis,) and not spec_of(x).partial
            and not is_local_tensor(local_tensor(x)))


def deferred(x: DTensor, w: DTensor, spec: P) -> DTensor:
    """``x @ w`` for a row-parallel ``w``, not yet computed: a NaN placeholder laid out as
    ``spec`` that :func:`ring_constrain` computes as the dual ring (or
    :func:`materialized` as a plain matmul)."""
    local_x, local_w = local_tensor(x), local_tensor(w)
    shape = (*local_x.shape[:-1], local_w.shape[-1])
    placeholder = torch.full((1,) * len(shape), float("nan"), dtype=local_x.dtype,
                             device=local_x.device).expand(shape)
    out = wrap_local(placeholder, x.device_mesh, spec, (*x.shape[:-1], w.shape[-1]))
    setattr(out, _DEFERRED, (x, w, spec))
    return out


def materialized(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself, or a deferred row-parallel output computed as a plain local matmul.

    >>> materialized(torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    held = getattr(x, _DEFERRED, None)
    if held is None:
        return x
    xin, w, spec = held
    return local_map(torch.matmul, (None, None), spec, check_shapes=False)(xin, w)


def ring_linear(x: DTensor, w: DTensor, spec: P) -> DTensor | None:
    """``linear``'s async-tp path: ``x @ w`` (output laid out as ``spec``) when ``x`` is an
    entry buffer the ring has not filled yet: the ring runs here under the matmul; or,
    for a later column-parallel consumer of a filled one, the matmul whose input gradient
    joins the first consumer's ring. For a weight not split over the ring's axis the ring
    only fills the buffer. ``None`` when the caller multiplies as usual (``x`` no entry
    buffer, or a plain consumer of a filled one).

    >>> ring_linear(torch.ones(2, 2), torch.ones(2, 2), P()) is None
    True
    """
    held: tuple[_RingState, torch.Tensor] | None = getattr(x, _RING, None)
    if held is None:
        return None
    state, buffer = held
    column = state.axis in spec_of(w).axes_of(1) and not spec_of(x).axes_of(x.dim() - 1)
    if state.filled:
        if not column or not state.consumers or state.split:
            return None  # a plain consumer: its input gradient reaches the entry's own ring
        state.consumers += 1
        # x detached: this consumer's input gradient goes to the first one's ring instead.
        later = lambda xl, wl: _RingConsumer.apply(xl, wl, state)  # noqa: E731
        return local_map(later, (None, None), spec, check_shapes=False)(x.detach(), w)
    if not column:
        filled(x)
        return None
    first = functools.partial(_ring_matmul, buffer=buffer, state=state)  # eager: _RING_BODY
    if state.split:  # the entry's own reduce-scatter serves every consumer (split_backward)
        return local_map(first, (None, None), spec, check_shapes=False)(x, w)
    xs, state.x, state.consumers = state.x, None, 1
    return local_map(first, (None, None), spec, check_shapes=False)(xs, w)


# _RING_BODY: a ring's local body is its hops and the matmuls between them, given to
# local_map as a functools.partial, not a function, so that train_step(compile=...) runs it
# as it is instead of tracing a region around its collectives (every hop a graph break; and
# under zb-h1's split backward dynamo failed outright on the entry buffer the ring fills in
# place: "Output 0 of _ToLocal is a view ... modified inplace", pp2 x tp2).
def _ring_matmul(xl: torch.Tensor, wl: torch.Tensor, *, buffer: torch.Tensor, state: _RingState) -> torch.Tensor:
    return _RingMatmul.apply(xl, wl, buffer, state)
