"""Mixture of experts: the auxiliary losses from the (global) statistics, the local
experts as one batched matmul, and the whole MoE FFN.

Routing is :mod:`dtp.ops.moe_router` (Megatron-core's softmax routers and DeepSeek-V3's
sigmoid router with group-limited top-k and the selection bias; its names are re-exported
here). Dropless by default. The switch load-balancing loss is ``E·coeff/(k·T²) · Σ_i P_i·n_i``
with ``P_i = Σ_t p_ti`` over the full distribution and ``n_i`` the tokens routed to expert
i *before* dropping; the router z-loss is ``coeff · mean_t logsumexp(logits_t)²``.

:func:`moe_ffn` takes plain tensors or DTensors. With DTensors the per-token work
(route, permute, experts, combine) runs on each rank's own tokens through
:func:`dtp.local_map`, on the expert weights as they are laid out, and the aux losses
come from the *global* sums ``P``, ``n`` and ``Σ lse²`` — one all-reduce of ``2E + 2``
numbers over the token axes (tag ``moe stats``), posted asynchronously and waited where
the aux loss is read (:mod:`dtp.ops.moe_stats`) — so a data-parallel run equals one
device. Expert parallel: when the active layout puts the ``expert`` axis on a mesh axis
of size > 1 (``layouts.expert()``, which also splits the batch over it), each rank
holds ``E / ep`` experts; its kept (token, choice) rows go to their experts' ranks
(:func:`dtp.ops.moe_dispatch.dispatch`), the local experts run on what arrived, and
:func:`~dtp.ops.moe_dispatch.combine` brings the results home — routing, capacity and
the statistics are unchanged. The expert weights' local gradients then hold every ep
rank's tokens: complete over ``ep``, pending only over the other token axes (``dp``),
which is what :func:`dtp.local_map` makes of a split input. Capacity, though, is per
rank: it is computed from the tokens a rank routes (Megatron does the same), so with
``capacity_factor`` and a split batch dropping differs from one device.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..core._torch import grouped_mm, grouped_mm_usable
from ..layouts import current
from ..layouts.expert import ExpertOptions
from ..core.mesh.devices import axis_names, flatten_axes
from ..core.redistribute import local_map
from ..core.spec import P, spec_of
from . import collective_matmul, moe_dispatch, moe_pipe
from .moe_router import SCORE_FUNCTIONS, Routing, balance, load_balancing_loss, route, update_bias, z_loss
from .local_batch import batch_split
from .moe_stats import Aux, PendingStats
from .parallel import linear  # the shared expert is a dense MLP: tensor parallel like one

__all__ = ["Routing", "SCORE_FUNCTIONS", "route", "load_balancing_loss", "z_loss", "update_bias", "experts",
           "padded_experts", "moe_ffn", "AUX_KEYS"]

#: What :func:`moe_ffn`'s aux holds.
AUX_KEYS = ("aux_loss", "z_loss", "tokens_per_expert", "dropped_fraction")


def experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU of every local expert over its tokens, in one grouped matmul.

    ``x_sorted`` (N, d) holds the tokens grouped by expert, ``counts[i]`` rows for expert
    i; weights are (E, d, f), (E, d, f), (E, f, d). On a GPU with a grouped-GEMM kernel
    (Hopper, bf16: ``torch._grouped_mm``) each projection is one kernel over the ragged
    groups. Elsewhere each group is padded to the largest (one host sync:
    ``counts.max()``), run through ``torch.bmm``, and un-padded. Either way equal to a
    loop over the experts, without the loop.

    >>> x, w = torch.arange(6.0).reshape(3, 2), torch.ones(2, 2, 2)
    >>> experts(x, torch.tensor([1, 2]), w, w, w).shape
    torch.Size([3, 2])
    """
    if grouped_mm_usable(x_sorted, w_gate, w_up, w_down):
        offsets = torch.cumsum(counts.to(device=x_sorted.device), 0).to(torch.int32)
        h = F.silu(grouped_mm(x_sorted, w_gate, offsets)) * grouped_mm(x_sorted, w_up, offsets)
        return grouped_mm(h, w_down, offsets)
    return padded_experts(x_sorted, counts, w_gate, w_up, w_down)


def padded_experts(x_sorted: torch.Tensor, counts: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor) -> torch.Tensor:
    """:func:`experts` without the grouped-GEMM kernel: each group padded to the largest
    (one host sync), one ``torch.bmm`` per projection, un-padded."""
    e = w_gate.shape[0]
    n, d = x_sorted.shape
    counts = counts.to(device=x_sorted.device, dtype=torch.long)
    width = int(counts.max()) if n else 0
    owner = torch.repeat_interleave(torch.arange(e, device=x_sorted.device), counts)
    slot = torch.arange(n, device=x_sorted.device) - (torch.cumsum(counts, 0) - counts)[owner]
    padded = x_sorted.new_zeros(e, width, d).index_put((owner, slot), x_sorted)
    h = F.silu(torch.bmm(padded, w_gate)) * torch.bmm(padded, w_up)
    return torch.bmm(h, w_down)[owner, slot]


def _local_moe(x: torch.Tensor, router: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
               w_down: torch.Tensor, bias: torch.Tensor | None, top_k: int, routing: Mapping[str, Any],
               ep: _ExpertGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, stats)`` for this rank's tokens: ``stats = [Σ_t p (E), n (E), Σ_t lse², kept]``.
    With ``ep`` the expert weights are this rank's ``E / ep`` experts and the rows travel
    to their experts' ranks and back (:mod:`dtp.ops.moe_pipe` when pipelined or with
    experts split over tp; then ``y`` is this tp rank's share, and so are the stats:
    tp rank 0 reports them, the others zeros, so that summed over tp they count once)."""
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    logits = xt.to(router.dtype) @ router  # the router runs in fp32 (fp64 stays fp64)
    r = route(logits, top_k, bias=bias, **routing)
    e = router.shape[-1]
    flat_ids, flat_kept = r.experts.reshape(-1), r.kept.reshape(-1)
    slots = torch.nonzero(flat_kept).squeeze(-1)  # (token, choice) pairs that survived
    order = slots[torch.argsort(flat_ids[slots], stable=True)]  # grouped by expert
    token = order // top_k
    if ep is None or ep.view is None:  # every expert here (whole, or its tp share of the width)
        out = experts(xt[token], torch.bincount(flat_ids[order], minlength=e), w_gate, w_up, w_down)
    elif ep.options.pipe_experts or ep.tp_axis is not None:
        o = ep.options
        out = moe_pipe.expert_path(xt[token], flat_ids[order], e, w_gate, w_up, w_down, ep.mesh, ep.axes,
                                   tp_axis=ep.tp_axis, pipe_experts=o.pipe_experts, multi_data=o.multi_data,
                                   multi_stream=o.multi_stream)
    else:
        arrived, plan = moe_dispatch.dispatch(xt[token], flat_ids[order], e, ep.view, axis_names(ep.view)[0])
        here = torch.tensor(plan.tokens_per_expert, dtype=torch.long, device=arrived.device)
        out = moe_dispatch.combine(experts(arrived, here, w_gate, w_up, w_down), plan)
    w = r.weights.reshape(-1)[order].to(out.dtype).unsqueeze(-1)
    y = xt.new_zeros(xt.shape).index_add(0, token, out * w).reshape(shape)
    lse2 = torch.logsumexp(logits, dim=-1).square().sum()
    stats = torch.cat([r.probs.sum(0), r.counts.to(logits.dtype), lse2.reshape(1),
                       flat_kept.sum().to(logits.dtype).reshape(1)])
    if ep is not None and ep.tp_axis is not None and ep.mesh.get_local_rank(ep.tp_axis):
        stats = stats * 0  # every tp rank routed the same tokens: count them once (tp rank 0)
    return y, stats


class _ExpertGroup(NamedTuple):
    mesh: DeviceMesh  # the whole mesh
    axes: tuple[str, ...]  # the expert axes
    view: DeviceMesh | None  # their 1-D view, to dispatch over; None: one ep rank, nothing to dispatch
    options: ExpertOptions
    tp_axis: str | None  # splits each expert's width (size > 1), or None


def _expert_group(params: Mapping[str, torch.Tensor], x: DTensor,
                  token_axes: tuple[str, ...]) -> _ExpertGroup | None:
    """Where to dispatch when the active layout splits experts (over one axis, or several
    folded into their flattened view), or ``None`` when it does not. With experts split
    over tp (``layouts.expert(tp_axis=...)``) and one ep rank (an ep axis of size 1, or
    none in the mesh): a group with no view — nothing to dispatch, every expert's tp share
    of the width computed here, the output a pending sum over tp as a dense MLP's
    (Megatron's expert tensor parallel at ep 1).

    Raises ``ValueError`` (every rank alike: it reads only layouts and specs) when the
    tokens are not split over every expert axis (each ep rank would send the same tokens,
    counting them ep times in the expert gradients), or when the expert weights are not
    laid out as the layout says."""
    active = current()
    if active is None:
        return None
    layout, _ = active
    mesh = x.device_mesh
    names = axis_names(mesh)
    axes = layout.mesh_axes("expert", mesh, activation=False)
    opts = layout.expert
    tp = opts.tp_axis if opts is not None and opts.tp_axis in names and mesh.size(names.index(opts.tp_axis)) > 1 \
        else None
    split = math.prod(mesh.size(names.index(a)) for a in axes) > 1
    if not split and tp is None:
        return None
    opts = opts or ExpertOptions(axis=axes)  # split: the expert rules name axes, without layouts.expert's options
    missing = [a for a in axes if a not in token_axes and mesh.size(names.index(a)) > 1]
    if missing:
        raise ValueError(f"moe_ffn: the layout puts experts on {axes} but the tokens are not split over "
                         f"{missing} (x is {spec_of(x)}); expert axes must also be data axes, as "
                         f"layouts.expert() makes its own axis")
    for name in ("w_gate", "w_up", "w_down"):
        w = params[name]
        if not isinstance(w, DTensor) or spec_of(w).axes_of(0) != axes:
            got = spec_of(w) if isinstance(w, DTensor) else "a plain tensor"
            raise ValueError(f"moe_ffn: the layout puts experts on {axes} but {name} is {got}; lay the "
                             f"parameters out with the same layout (TrainState.create)")
    if split:
        opts.check_tokens(math.prod(x.to_local().shape[:-1]), f"moe_ffn: x of shape {tuple(x.shape)}")
    if tp is not None:
        if tp in token_axes:
            raise ValueError(f"moe_ffn: layouts.expert(tp_axis={tp!r}) needs every {tp} rank to route the same "
                             f"tokens, but x is split over {tp} ({spec_of(x)}); gather it first (the Llama block's "
                             f"MLP input is)")
        for name, dim in (("w_gate", 2), ("w_up", 2), ("w_down", 1)):
            if spec_of(params[name]).axes_of(dim) != (tp,):
                raise ValueError(f"moe_ffn: layouts.expert(tp_axis={tp!r}) splits each expert's width, but "
                                 f"{name} is {spec_of(params[name])}; lay the parameters out with the same layout")
    # ep folded out of several axes: its view's coordinates are row-major, as Shard(0) nests
    return _ExpertGroup(mesh, axes, flatten_axes(mesh, axes) if split else None, opts, tp)


def moe_ffn(params: Mapping[str, torch.Tensor], x: torch.Tensor, *, top_k: int, pre_softmax: bool = False,
            capacity_factor: float | None = None, aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0,
            bias: torch.Tensor | None = None, score: str = "softmax", n_groups: int | None = None,
            topk_group: int | None = None, scaling_factor: float | None = None
            ) -> tuple[torch.Tensor, Mapping[str, torch.Tensor]]:
    """The MoE FFN on ``x`` (..., d): router (fp32) → :func:`route` → permute tokens by
    expert → :func:`experts` → weighted combine (unpermute, sum over k), plus the shared
    expert (a dense SwiGLU every token passes through) when ``params`` has ``shared_gate``.

    ``params``: ``router`` (d, E), ``w_gate``/``w_up`` (E, d, f), ``w_down`` (E, f, d);
    optional ``shared_gate``/``shared_up`` (d, f_s), ``shared_down`` (f_s, d). Routing
    options as :func:`route` (``bias``: the (E,) selection bias, a plain tensor or a
    replicated DTensor, no gradient), and the two loss coefficients (default 0).

    Returns ``(y, aux)``: ``aux`` (a mapping, keys :data:`AUX_KEYS`) has ``aux_loss`` and
    ``z_loss`` (scalars in the graph: add them to the loss) and ``tokens_per_expert``
    (E,) and ``dropped_fraction`` (detached). With DTensors: the per-token work on local
    shards, the statistics summed over the token axes by an all-reduce that is in flight
    until the first read of ``aux`` (:mod:`dtp.ops.moe_stats`); under ``layouts.expert``
    the rows are dispatched to their experts' ranks and combined back (module docstring).

    Raises: ``ValueError`` when the active layout splits experts over an axis the tokens
    are not split over, or the expert weights are not laid out on it (every rank alike).

    >>> p = {"router": torch.zeros(2, 2), "w_gate": torch.ones(2, 2, 3), "w_up": torch.ones(2, 2, 3),
    ...      "w_down": torch.ones(2, 3, 2)}
    >>> y, aux = moe_ffn(p, torch.ones(4, 2), top_k=1, score="sigmoid")
    >>> tuple(y.shape), aux["tokens_per_expert"].tolist()
    ((4, 2), [4.0, 0.0])
    """
    weights = (params["router"], params["w_gate"], params["w_up"], params["w_down"])
    routing = dict(pre_softmax=pre_softmax, capacity_factor=capacity_factor, score=score, n_groups=n_groups,
                   topk_group=topk_group, scaling_factor=scaling_factor)
    ep: _ExpertGroup | None = None

    def local(x_l: torch.Tensor, router: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
              w_down: torch.Tensor, bias_l: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return _local_moe(x_l, router, w_gate, w_up, w_down, bias_l, top_k, routing, ep)

    e = params["router"].shape[-1]
    # global: a DTensor's shape is the whole tensor's; a plain tensor in local batch mode
    # holds one rank's even share of the batch (dtp.ops.local_batch)
    tokens = math.prod(x.shape[:-1]) * (1 if isinstance(x, DTensor) else batch_split())
    if isinstance(x, DTensor):
        # Under async tp x may be a block entry's buffer that only linear fills; the router
        # and the dispatch read it whole, so its ring runs now (its gradient is still
        # reduce-scattered once, at the entry: dtp.ops.collective_matmul.filled).
        x = collective_matmul.filled(x)
        spec = spec_of(x)
        token_axes = tuple(a for d in range(x.dim() - 1) for a in spec.axes_of(d))
        ep = _expert_group(params, x, token_axes)
        pending = () if ep is None or ep.tp_axis is None else (ep.tp_axis,)  # y and stats: each tp rank's share
        out_specs = (P(*spec.dims, partial=spec.partial + pending), P(None, partial=token_axes + pending))
        y, stats = local_map(local, (None,) * 6, out_specs, check_shapes=False)(x, *weights, bias)
    else:
        y, stats = local(x, *weights, bias)
    posted = PendingStats(stats)  # in flight until the aux is read (the loss, at the head)
    if "shared_gate" in params:
        shared = linear(F.silu(linear(x, params["shared_gate"])) * linear(x, params["shared_up"]),
                        params["shared_down"])
        # Async tp defers a row-parallel output to the exit's ring; this sum reads it first.
        y = y + collective_matmul.materialized(shared)

    def aux(total: torch.Tensor) -> dict[str, torch.Tensor]:
        p_sum, counts, lse2, kept = total[:e], total[e:2 * e].detach(), total[2 * e], total[2 * e + 1].detach()
        return {"aux_loss": balance(p_sum, counts, tokens, top_k, aux_loss_coeff),
                "z_loss": z_loss_coeff * lse2 / tokens,
                "tokens_per_expert": counts,
                "dropped_fraction": 1.0 - kept / (tokens * top_k)}

    return y, Aux(AUX_KEYS, posted, aux)
