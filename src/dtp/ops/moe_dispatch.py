"""Expert-parallel token dispatch and combine: the uneven all-to-all pair around the
local experts (Megatron's all-to-all token dispatcher), on a rank's local tokens.

Experts are ``Shard(0)`` on the ``ep`` axis: coordinate c holds experts
``[c·L, (c+1)·L)``, ``L = num_experts / ep``. One layer's exchange, per rank:

1. rows (one per (token, choice): already replicated for top-k) are sorted by expert;
2. the per-expert counts go to their owners (:func:`dtp.comm.exchange_counts`, an
   all-to-all of ``L`` int64 per coordinate) and are read on the host — the layer's one
   host sync, since the next step's split sizes must be host ints;
3. the rows go to their owners (:func:`dtp.comm.all_to_all_v`). They arrive ordered
   [source rank][local expert] and are regrouped [local expert][source rank], so each
   local expert's rows are contiguous (a grouped matmul over ``plan.tokens_per_expert``).

:func:`combine` is the exact inverse: regroup back, all-to-all back, unsort. Autograd:
dispatch's backward is combine's all-to-all and vice versa; the sort and the regroup are
permutations, so gradients are moved, never summed.

==================  ============================================  ==================
collective          what moves (per rank)                          recorded as
==================  ============================================  ==================
counts              (ep-1) × L × 8 bytes                          all_to_all
dispatch / its bwd  rows sent to other ranks × bytes per row      all_to_all_v
combine / its bwd   rows received from other ranks × bytes/row    all_to_all_v
==================  ============================================  ==================

A rank whose ``expert_ids`` are bad (not int, wrong length, out of range) sends counts
of -1: every rank sees them in the counts exchange and raises the same ``ValueError``
before the token all-to-all, so nobody hangs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..core import comm
from ..core.mesh.devices import axis_size
from . import lanes

__all__ = ["DispatchPlan", "plan_dispatch", "dispatch", "combine"]


@dataclass(frozen=True)
class DispatchPlan:
    """How one layer's tokens went out, so :func:`combine` can bring them back."""

    mesh: DeviceMesh
    axis: str
    num_experts: int
    order: torch.Tensor  # local rows sorted by expert: sorted = x[order]
    unorder: torch.Tensor  # its inverse: x = sorted[unorder]
    regroup: torch.Tensor  # [source][expert] arrival → [expert][source]: grouped = arrived[regroup]
    ungroup: torch.Tensor  # its inverse
    send_splits: tuple[int, ...]  # rows this rank sent to each coordinate
    recv_splits: tuple[int, ...]  # rows it received from each coordinate
    send_counts: tuple[tuple[int, ...], ...]  # [destination coordinate][its local expert]
    recv_counts: tuple[tuple[int, ...], ...]  # [source coordinate][local expert]
    tokens_per_expert: tuple[int, ...]  # rows per local expert, in the grouped order

    @property
    def local_experts(self) -> int:
        return len(self.tokens_per_expert)


class _AllToAllV(torch.autograd.Function):
    """The uneven all-to-all; its backward is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, mesh, axis, send, recv, tag):  # type: ignore[override]
        ctx.args = (mesh, axis, send, recv, tag)
        return _exchange(x, mesh, axis, send, recv, tag)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        mesh, axis, send, recv, tag = ctx.args
        back = _exchange(grad, mesh, axis, recv, send, f"{tag} backward")
        return back, None, None, None, None, None


def _exchange(x: torch.Tensor, mesh: DeviceMesh, axis: str, send: tuple[int, ...], recv: tuple[int, ...],
              tag: str) -> torch.Tensor:
    """The all-to-all; inside a lane (``ep_overlap``) posted, and the other lanes compute
    while it travels (:func:`dtp.ops.lanes.hide`)."""
    if lanes.active():
        return lanes.hide(comm.all_to_all_v(x, mesh, axis, send_counts=send, recv_counts=recv, async_op=True,
                                            tag=tag))
    return comm.all_to_all_v(x, mesh, axis, send_counts=send, recv_counts=recv, tag=tag)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _regroup_index(recv: torch.Tensor) -> torch.Tensor:
    """Rows arrive in blocks ``recv[src, e]`` ordered [src][e]; the index that reads them
    in [e][src] order (one gather, no Python loop over blocks)."""
    flat = recv.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).reshape(recv.shape).t().reshape(-1)  # block starts, [e][src] order
    lengths = recv.t().reshape(-1)
    total = int(flat.sum())
    block_first = torch.cumsum(lengths, 0) - lengths  # where each block lands in the grouped order
    return torch.repeat_interleave(starts - block_first, lengths, output_size=total) + torch.arange(
        total, device=recv.device)


def _bad_ids(fn: str, x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> tuple[str | None, torch.Tensor]:
    """(this rank's error or None, its per-expert counts)."""
    if expert_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return f"{fn}: expert_ids must be an integer tensor, got {expert_ids.dtype}", torch.empty(0)
    if expert_ids.dim() != 1 or x.dim() < 1 or expert_ids.shape[0] != x.shape[0]:
        return (f"{fn}: expert_ids must be 1-D with one id per row of x, got {tuple(expert_ids.shape)} "
                f"for x {tuple(x.shape)}"), torch.empty(0)
    ids = expert_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        return (f"{fn}: expert_ids must lie in [0, {num_experts}), got values in "
                f"[{int(ids.min())}, {int(ids.max())}]"), torch.empty(0)
    return None, torch.bincount(ids, minlength=num_experts)


def plan_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, mesh: DeviceMesh,
         axis: str = "ep", *, fn: str = "moe dispatch") -> DispatchPlan:
    """Where each row of ``x`` goes and what arrives, before any row moves: the counts
    exchange (:func:`dtp.comm.exchange_counts`) and its one host sync, with the checks
    of :func:`dispatch` (which runs it first; so does :mod:`dtp.ops.moe_pipe`)."""
    n = axis_size(mesh, axis)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1 or num_experts % n:
        raise ValueError(f"{fn}: num_experts must be an int >= 1 divisible by the {axis!r} size {n}, "
                         f"got {num_experts!r}")
    local = num_experts // n
    error, counts = _bad_ids(fn, x, expert_ids, num_experts)
    send_counts = torch.full((n, local), -1, dtype=torch.int64, device=x.device) if error else counts.reshape(n, local)
    if lanes.active():  # ep_overlap: the other lanes compute while the counts travel (behind earlier transfers)
        recv = lanes.hide(comm.exchange_counts(send_counts, mesh, axis, async_op=True, tag="moe dispatch counts"))
    else:
        recv = comm.exchange_counts(send_counts, mesh, axis, tag="moe dispatch counts")
    recv_list = recv.tolist()  # the layer's one host sync
    if error:
        raise ValueError(error)
    bad = [src for src, row in enumerate(recv_list) if any(c < 0 for c in row)]
    if bad:
        raise ValueError(f"{fn}: expert_ids on {axis!r} coordinate(s) {bad} are invalid (see that rank's error)")
    order = torch.argsort(expert_ids.long(), stable=True)
    regroup = _regroup_index(recv)
    return DispatchPlan(mesh, axis, num_experts, order, _inverse(order), regroup, _inverse(regroup),
                        tuple(int(c) for c in send_counts.sum(1).tolist()), tuple(sum(row) for row in recv_list),
                        tuple(tuple(row) for row in send_counts.tolist()), tuple(tuple(row) for row in recv_list),
                        tuple(int(c) for c in recv.sum(0).tolist()))


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, mesh: DeviceMesh,
             axis: str = "ep") -> tuple[torch.Tensor, DispatchPlan]:
    """Send each row of ``x`` to the rank holding expert ``expert_ids[row]``; return the
    rows this rank's experts get, grouped by local expert, and the plan to come back.

    Issues :func:`dtp.comm.exchange_counts` then :func:`dtp.comm.all_to_all_v` over
    ``axis`` (bytes in the module docstring); one host sync (the counts). Differentiable.

    - `x`: local rows ``(N, *feature)``, one per (token, choice).
    - `expert_ids`: ``(N,)`` integer ids in ``[0, num_experts)``.
    - `num_experts`: the global expert count, divisible by the axis size.

    Raises: ``ValueError`` for experts not divisible by the axis, or bad ``expert_ids`` on
    any rank (on every rank alike, before the token all-to-all).
    """
    p = plan_dispatch(x, expert_ids, num_experts, mesh, axis)
    arrived = _AllToAllV.apply(x[p.order], mesh, axis, p.send_splits, p.recv_splits, "moe dispatch")
    return arrived[p.regroup], p


def combine(y: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Bring expert outputs home: the inverse of :func:`dispatch` for rows ``(M, *feature)``
    in dispatch's grouped order (``M = sum(plan.tokens_per_expert)``; ``feature`` may
    differ from the input's). Returns rows in the original order of dispatch's ``x``.

    Issues one :func:`dtp.comm.all_to_all_v` over ``plan.axis``. Differentiable.

    Raises: ``ValueError`` when ``y`` does not have the dispatched row count.
    """
    rows = sum(plan.recv_splits)
    if y.dim() < 1 or y.shape[0] != rows:
        raise ValueError(f"moe combine: y must have the {rows} rows dispatch delivered, got shape {tuple(y.shape)}")
    back = _AllToAllV.apply(y[plan.ungroup], plan.mesh, plan.axis, plan.recv_splits, plan.send_splits, "moe combine")
    return back[plan.unorder]
