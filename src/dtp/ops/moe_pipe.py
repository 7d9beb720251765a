"""MindSpeed's pipe-experts: the expert all-to-all hidden behind the expert FFN.

Without it an MoE block under expert parallel runs in three blocking steps: every
dispatched row crosses the ``ep`` axis (:func:`dtp.ops.moe_dispatch.dispatch`), every
local expert computes, every result crosses back. With ``layouts.expert(pipe_experts=True)``
the rows move and compute in *chunks*: one per local expert, each split again into
``multi_data`` pieces (``--pipe-experts-multi-data N``; the only way to get more than one
chunk when ``ep = num_experts``). Chunk c holds, from every source rank, the rows for one
local expert (piece j of them), so it needs no regrouping and one expert's weights.

Each chunk's all-to-alls are posted asynchronously through :mod:`dtp.comm` (recorded;
the simulated link applies). Every chunk's dispatch is posted up front; chunk c
computes as soon as it has arrived — while chunk c+1's rows are on the wire — and its
result is posted back at once for the combine. Backward is the same pipeline in reverse (combine's all-to-all of the output
gradient, the chunk's expert backward, dispatch's all-to-all of the input gradient), so
both directions hide all but the first and the last chunk's transfer.

Numerics equal the unpipelined layer: the expert FFN is row-wise, so computing it chunk
by chunk moves no row's arithmetic; only the weight gradient is summed over the
``multi_data`` pieces of an expert (in fp64 within 1e-15 of one matmul).

Unlike MindSpeed, where pipe-experts stops working once experts are fused into a grouped
GEMM and does not support dropless routing, this works dropless and with capacity:
the chunk sizes come from the one counts exchange every layer does anyway (the split
of a count into ``multi_data`` pieces is arithmetic both sides do alike), so it adds
no host sync.

All of it is posted from the calling thread, in an order that depends only on the
exchanged counts: gloo and NCCL match collectives on a group by issue order, so a second
thread posting on the ``ep`` group beside the main thread's (data-parallel gradient
reductions run over ``ep`` too) would cross them — measured: gloo aborts with
"Received data size doesn't match expected size".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from .. import comm
from . import moe_dispatch

__all__ = ["Chunks", "chunks", "pipelined_experts"]


def _piece(n: int, parts: int, j: int) -> tuple[int, int]:
    """(offset, length) of piece j when n rows are split into ``parts`` near-equal pieces."""
    q, r = divmod(n, parts)
    return j * q + min(j, r), q + (j < r)


@dataclass(frozen=True)
class Chunks:
    """The pipe-experts schedule of one layer on one rank: chunk c is local expert
    ``expert[c]``'s piece ``c % multi_data``."""

    expert: tuple[int, ...]  # local expert of each chunk
    rows: tuple[torch.Tensor, ...]  # per chunk: which sorted rows it sends (grouped by destination)
    send: tuple[tuple[int, ...], ...]  # per chunk: rows to each coordinate
    recv: tuple[tuple[int, ...], ...]  # per chunk: rows from each coordinate


def chunks(p: moe_dispatch.DispatchPlan, multi_data: int) -> Chunks:
    """Cut a layer's dispatch into chunks (local expert major, then piece). Rows are
    sorted by global expert id ``d·L + l`` (destination d, its local expert l).

    >>> import types
    >>> p = types.SimpleNamespace(send_counts=((2, 1), (0, 3)), recv_counts=((2, 1), (1, 1)))
    >>> c = chunks(p, 2)
    >>> c.expert, [r.tolist() for r in c.rows], c.send, c.recv
    ((0, 0, 1, 1), [[0], [1], [2, 3, 4], [5]], ((1, 0), (1, 0), (1, 2), (0, 1)), ((1, 1), (1, 0), (1, 1), (0, 0)))
    """
    send, recv = p.send_counts, p.recv_counts
    local = len(send[0])
    flat = [n for row in send for n in row]
    start = [sum(flat[:g]) for g in range(len(flat))]
    expert, rows, sends, recvs = [], [], [], []
    for l in range(local):
        for j in range(multi_data):
            parts = [_piece(row[l], multi_data, j) for row in send]
            idx = [torch.arange(start[d * local + l] + off, start[d * local + l] + off + n) for d, (off, n) in
                   enumerate(parts)]
            expert.append(l)
            rows.append(torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long))
            sends.append(tuple(n for _, n in parts))
            recvs.append(tuple(_piece(row[l], multi_data, j)[1] for row in recv))
    return Chunks(tuple(expert), tuple(rows), tuple(sends), tuple(recvs))


def _ffn(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w_gate) * (x @ w_up)) @ w_down


@dataclass(frozen=True)
class _Run:
    mesh: DeviceMesh
    axis: str
    chunks: Chunks


def _exchange(run: _Run, x: torch.Tensor, send: tuple[int, ...], recv: tuple[int, ...], tag: str) -> comm.CommHandle:
    return comm.all_to_all_v(x, run.mesh, run.axis, send_counts=list(send), recv_counts=list(recv), async_op=True,
                             tag=tag)


class _Pipelined(torch.autograd.Function):
    """Dispatch → local expert → combine, chunk by chunk, each chunk's transfers on the
    wire while another computes; backward likewise (module docstring)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, run):  # type: ignore[override]
        c = run.chunks
        arriving = [_exchange(run, x[rows], s, r, f"moe pipe dispatch {i}")
                    for i, (rows, s, r) in enumerate(zip(c.rows, c.send, c.recv))]
        # Weight leaves per local expert: each chunk's graph ends at its expert's slices.
        leaves = [tuple(w.detach()[l].requires_grad_() for w in (w_gate, w_up, w_down))
                  for l in range(w_gate.shape[0])]
        graphs, returning = [], []
        for i, l in enumerate(c.expert):
            xa = arriving[i].wait().requires_grad_()
            with torch.enable_grad():
                y = _ffn(xa, *leaves[l])
            graphs.append((xa, y))
            returning.append(_exchange(run, y.detach(), c.recv[i], c.send[i], f"moe pipe combine {i}"))
        out = x.new_empty((x.shape[0], w_down.shape[-1]))
        for rows, back in zip(c.rows, returning):
            out[rows] = back.wait()
        ctx.run, ctx.graphs, ctx.leaves = run, graphs, leaves
        ctx.shapes = (x.shape, w_gate.shape, w_up.shape, w_down.shape)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        run, c = ctx.run, ctx.run.chunks
        arriving = [_exchange(run, grad[rows].contiguous(), s, r, f"moe pipe combine backward {i}")
                    for i, (rows, s, r) in enumerate(zip(c.rows, c.send, c.recv))]
        x_shape, *w_shapes = ctx.shapes
        grads_w = [grad.new_zeros(shape) for shape in w_shapes]
        returning = []
        for i, l in enumerate(c.expert):
            xa, y = ctx.graphs[i]
            gx, *gw = torch.autograd.grad(y, (xa, *ctx.leaves[l]), arriving[i].wait())
            for acc, g in zip(grads_w, gw):
                acc[l] += g
            returning.append(_exchange(run, gx, c.recv[i], c.send[i], f"moe pipe dispatch backward {i}"))
        grad_x = grad.new_empty(x_shape)
        for rows, back in zip(c.rows, returning):
            grad_x[rows] = back.wait()
        ctx.graphs = ctx.leaves = None
        return grad_x, *grads_w, None


def pipelined_experts(rows: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, w_gate: torch.Tensor,
                      w_up: torch.Tensor, w_down: torch.Tensor, mesh: DeviceMesh, axis: str, *,
                      multi_data: int = 1) -> torch.Tensor:
    """The local experts' SwiGLU outputs for ``rows`` (N, d) routed to ``expert_ids``
    (global ids), each row computed by its expert on the rank that holds it: dispatch,
    experts and combine of :mod:`dtp.ops.moe_dispatch` and :func:`dtp.ops.moe.experts`,
    pipelined over chunks (module docstring). Weights are this rank's ``L`` experts:
    (L, d, f), (L, d, f), (L, f, d). Differentiable; one counts exchange and its host
    sync, then ``2·L·multi_data`` all-to-alls forward and as many backward.

    Raises: as :func:`dtp.ops.moe_dispatch.plan` (every rank alike).
    """
    p = moe_dispatch.plan(rows, expert_ids, num_experts, mesh, axis, fn="moe pipe-experts")
    run = _Run(mesh, axis, chunks(p, multi_data))
    return _Pipelined.apply(rows[p.order], w_gate, w_up, w_down, run)[p.unorder]
