"""The MoE router's math on one device: scores, (group-limited) top-k, combine weights,
capacity dropping, the auxiliary losses and aux-loss-free balancing's bias step.

Routing follows Megatron-core's ``topk_routing_with_score_function``:

==================  ===============================================================
``softmax``         top-k on the logits, softmax over the k chosen (weights sum to 1)
+ ``pre_softmax``   softmax over all experts, then top-k; no renormalisation
``sigmoid``         DeepSeek-V3: ``s = sigmoid(logits)``, top-k on ``s``, the k chosen
                    normalised to sum to 1 (``s / (Σ_k s + 1e-20)``; not at k = 1)
``n_groups``,       group-limited (node-limited) routing: the experts form ``n_groups``
``topk_group``      equal groups, a group scores the sum of its top ``k // topk_group``
                    scores, each token picks its ``topk_group`` best groups and its top-k
                    among their experts only (DeepSeek-V3: 8 groups, 4 picked, top-2 sums)
``bias``            added to the scores for *selection only* (groups and experts;
                    aux-loss-free balancing): weights come from the unbiased scores
``scaling_factor``  the k weights multiplied by it (DeepSeek-V3's routed scaling factor,
                    Megatron's ``moe_router_topk_scaling_factor``)
``capacity_factor`` each expert keeps its ``ceil(T·k/E · cf)`` highest-weight tokens
                    (Megatron's "probs" drop policy); the survivors are not renormalised
==================  ===============================================================

The load-balancing loss reads the full distribution over experts (``Routing.probs``):
the softmax, or under ``sigmoid`` the sigmoid scores normalised over all experts
(Megatron's ``compute_routing_scores_for_aux_loss``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..core._rules import SCORE_FUNCTIONS, check_groups

__all__ = ["Routing", "SCORE_FUNCTIONS", "route", "group_limited_topk", "balance", "load_balancing_loss", "z_loss",
           "update_bias", "check_groups"]

_EPS = 1e-20  # Megatron's guard in the sigmoid normalisations


class Routing(NamedTuple):
    """What :func:`route` decides for T tokens, E experts and top-k."""

    experts: torch.Tensor  # (T, k) int64: chosen expert ids
    weights: torch.Tensor  # (T, k): combine weights, zero where the token was dropped
    kept: torch.Tensor  # (T, k) bool: the choice survived the capacity (all True when dropless)
    probs: torch.Tensor  # (T, E): the full distribution over experts (for the aux loss)
    counts: torch.Tensor  # (E,) int64: tokens routed to each expert before dropping
    dropped_fraction: torch.Tensor  # scalar: dropped choices / (T·k)


def group_limited_topk(scores: torch.Tensor, top_k: int, n_groups: int, topk_group: int) -> torch.Tensor:
    """The (T, k) expert ids of each token's top-k among the experts of its
    ``topk_group`` best groups, a group scored by the sum of its top ``k // topk_group``
    scores (Megatron-core's ``group_limited_topk``).

    >>> s = torch.tensor([[0.9, 0.1, 0.5, 0.6]])        # groups {0, 1}: 1.0, {2, 3}: 1.1
    >>> group_limited_topk(s, 2, n_groups=2, topk_group=1).tolist()
    [[3, 2]]
    """
    t, e = scores.shape
    grouped = scores.reshape(t, n_groups, e // n_groups)
    group_scores = grouped.topk(top_k // topk_group, dim=-1).values.sum(-1)
    picked = torch.topk(group_scores, topk_group, dim=-1).indices
    allowed = torch.zeros(t, n_groups, dtype=torch.bool, device=scores.device).scatter(1, picked, True)
    allowed = allowed.unsqueeze(-1).expand(t, n_groups, e // n_groups).reshape(t, e)
    return torch.topk(scores.masked_fill(~allowed, float("-inf")), top_k, dim=-1).indices


def route(logits: torch.Tensor, top_k: int, *, pre_softmax: bool = False, capacity_factor: float | None = None,
          bias: torch.Tensor | None = None, score: str = "softmax", n_groups: int | None = None,
          topk_group: int | None = None, scaling_factor: float | None = None) -> Routing:
    """Route T tokens over E experts from router ``logits`` (T, E) (keep them fp32).

    - `top_k`: experts per token, 1 ≤ k ≤ E.
    - `score`: ``"softmax"`` (default) or ``"sigmoid"`` (module docstring).
    - `pre_softmax`: softmax over all E then top-k (weights not renormalised); default
      False: top-k on the logits then softmax over the k chosen. Softmax only.
    - `n_groups`, `topk_group`: group-limited routing (both or neither; :func:`check_groups`).
    - `scaling_factor`: the combine weights times it; default None (1).
    - `capacity_factor`: ``None`` (dropless, default) or > 0: each expert keeps its
      ``ceil(T·k/E·cf)`` highest-weight tokens; dropped choices get weight 0.
    - `bias`: (E,) added to the selection scores only (logits, probabilities with
      ``pre_softmax``, sigmoid scores with ``sigmoid``); default None.

    Raises: ``ValueError`` for a ``top_k`` outside [1, E], a ``capacity_factor`` ≤ 0, an
    unknown ``score``, ``pre_softmax`` with ``sigmoid``, or bad groups.

    >>> r = route(torch.tensor([[2.0, 0.0, 1.0]]), 2)
    >>> r.experts.tolist(), [round(w, 4) for w in r.weights[0].tolist()], r.counts.tolist()
    ([[0, 2]], [0.7311, 0.2689], [1, 0, 1])
    >>> r = route(torch.tensor([[2.0, 0.0, 1.0]]), 2, score="sigmoid")
    >>> [round(w, 4) for w in r.weights[0].tolist()]
    [0.5464, 0.4536]
    """
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"route: top_k must be in [1, {e}] (the number of experts), got {top_k}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"route: capacity_factor must be None (dropless) or > 0, got {capacity_factor!r}")
    if score not in SCORE_FUNCTIONS:
        raise ValueError(f"route: score must be one of {SCORE_FUNCTIONS}, got {score!r}")
    if pre_softmax and score != "softmax":
        raise ValueError(f"route: pre_softmax is a softmax option; score={score!r} has no softmax")
    check_groups(e, top_k, n_groups, topk_group)
    if score == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / (scores.sum(-1, keepdim=True) + _EPS)  # what the aux loss reads
    else:
        probs = torch.softmax(logits, dim=-1)
        scores = probs if pre_softmax else logits
    select = scores if bias is None else scores + bias.to(scores.dtype)
    with torch.no_grad():
        if n_groups is None or topk_group is None:
            ids = torch.topk(select, top_k, dim=-1).indices
        else:
            ids = group_limited_topk(select, top_k, n_groups, topk_group)
    chosen = scores.gather(-1, ids)
    if score == "sigmoid":
        weights = chosen / (chosen.sum(-1, keepdim=True) + _EPS) if top_k > 1 else chosen
    else:
        weights = chosen if pre_softmax else torch.softmax(chosen, dim=-1)
    if scaling_factor is not None:
        weights = weights * scaling_factor
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    kept = torch.ones_like(ids, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = min(t, math.ceil(t * top_k / e * capacity_factor))
        with torch.no_grad():
            dense = torch.zeros(t, e, dtype=weights.dtype, device=weights.device).scatter(-1, ids, weights.detach())
            routed = torch.zeros(t, e, dtype=torch.bool, device=ids.device).scatter(-1, ids, True)
            top = torch.topk(dense, capacity, dim=0).indices  # (capacity, E): each expert's best tokens
            within = torch.zeros_like(routed).scatter(0, top, True) & routed
            kept = within.gather(-1, ids)
        weights = weights * kept
    dropped = 1.0 - kept.sum().to(probs.dtype) / (t * top_k)
    return Routing(ids, weights, kept, probs, counts, dropped)


def balance(p_sum: torch.Tensor, counts: torch.Tensor, tokens: int, top_k: int, coeff: float) -> torch.Tensor:
    """The load-balancing loss from the summed distribution ``p_sum`` (E,) and the counts
    of ``tokens`` tokens (what :func:`load_balancing_loss` computes, from global sums).

    >>> float(balance(torch.tensor([2.0, 2.0]), torch.tensor([4, 4]), 4, 2, 1.0))  # balanced: coeff
    1.0
    """
    e = p_sum.shape[-1]
    return (p_sum * counts.to(p_sum.dtype)).sum() * (e * coeff / (top_k * tokens * tokens))


def load_balancing_loss(p_full: torch.Tensor, counts_before_drop: torch.Tensor, top_k: int,
                        coeff: float) -> torch.Tensor:
    """The switch load-balancing loss ``E·coeff/(k·T²) · Σ_i (Σ_t p_ti)·n_i`` for the full
    distribution ``p_full`` (T, E) and the per-expert counts before dropping.

    >>> float(load_balancing_loss(torch.full((4, 2), 0.5), torch.tensor([4, 4]), 2, 1.0))  # balanced: coeff
    1.0
    """
    return balance(p_full.sum(0), counts_before_drop, p_full.shape[0], top_k, coeff)


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """The router z-loss ``coeff · mean_t logsumexp(logits_t)²`` over logits (T, E).

    >>> float(z_loss(torch.zeros(3, 1), 2.0))
    0.0
    """
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing's step: ``bias + rate·sign(mean load − load)`` — an
    overloaded expert's selection bias goes down, an idle one's up.

    >>> update_bias(torch.zeros(3), torch.tensor([4.0, 1.0, 1.0]), 0.1).tolist()
    [-0.10000000149011612, 0.10000000149011612, 0.10000000149011612]
    """
    load = load.to(bias.dtype)
    return bias + rate * torch.sign(load.mean() - load)
