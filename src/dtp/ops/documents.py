"""Packed documents: per-document attention masks, positions and a balanced cp order.

A packed row of ``tokens`` holds several documents, each ended by the EOS id. The batch
then carries two more ``(batch, seq)`` int64 entries, sharded like the tokens by
``shard_batch``:

* ``documents`` -- the running index of each token's document in its row (0, 1, ...);
* ``positions`` -- each token's position inside its document (RoPE restarts there).

Query ``i`` attends key ``j`` iff both are in the same document and ``positions[j] <=
positions[i]`` (:func:`document_keep`). That rule needs no global token index, so the
data may be in *any* order along the sequence: under context parallel ``shard_batch``
puts each row in :func:`balanced_order` (chunks of the row dealt to the cp ranks so the
attended (query, key) pairs -- the FLOPs of the masked attention -- are even), not the
fixed zigzag, which balances one causal sequence but not packed documents.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from .._rules import IGNORE_INDEX

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..layouts import Layout

__all__ = ["pack_documents", "document_keep", "balanced_order", "attended_pairs", "DOC_KEYS", "PLACED",
           "check_placed"]

# Set by dtp.shard_batch on the entries it placed. Under zigzag context parallel the
# sequence order is in the values, not the placement: a (batch, seq) entry placed by hand
# (dtp.shard(tokens, mesh, P(None, "cp"))) has shard_batch's spec, yet trained silently on
# a permuted sequence (RoPE and the causal mask read the layout's order).
PLACED = "_dtp_shard_batch"


def check_placed(what: str, batch: Mapping[str, object], layout: "Layout", mesh: "DeviceMesh") -> None:
    """``ValueError`` when, under zigzag context parallel, a (batch, seq) DTensor of
    ``batch`` did not come from ``shard_batch``, the one place that puts the sequence in
    the layout's order (packed documents carry theirs as data, ``positions``, and run in
    any). The same on every rank: each placed its batch alike.

    >>> check_placed("train_step", {"tokens": torch.zeros(2, 8)}, None, None)  # no DTensor: nothing to check
    """
    opts = getattr(layout, "context", None)
    if opts is None or opts.load_balance is None or "positions" in batch:
        return
    for key, v in batch.items():
        if not isinstance(v, DTensor) or v.dim() < 2 or getattr(v, PLACED, False):
            continue
        cp = layout.context_degree(mesh)
        if cp > 1:
            raise ValueError(
                f"{what}: batch[{key!r}] was not placed by dtp.shard_batch: under layouts.context("
                f"load_balance={opts.load_balance!r}) on cp={cp} the sequence must be in the layout's order (rank "
                f"r holds chunks r and {2 * cp - 1}-r), which no placement shows; place the global batch with "
                f"dtp.shard_batch(batch, state)")

#: The batch entries that describe packed documents (``documents``, ``positions``).
DOC_KEYS = ("documents", "positions")


def pack_documents(batch: dict[str, torch.Tensor], eos_id: int) -> dict[str, torch.Tensor]:
    """``batch`` with ``documents`` and ``positions`` added and the target at each
    document end (an EOS token, whose target opens the next document) set to
    :data:`~dtp.ops.IGNORE_INDEX`. A document runs up to and including its EOS.

    >>> b = pack_documents({"tokens": torch.tensor([[5, 2, 7, 8]]), "targets": torch.tensor([[2, 7, 8, 9]])}, 2)
    >>> b["documents"].tolist(), b["positions"].tolist(), b["targets"].tolist()
    ([[0, 0, 1, 1]], [[0, 1, 0, 1]], [[2, -100, 8, 9]])
    """
    tokens = batch["tokens"]
    if tokens.dim() != 2:
        raise ValueError(f"pack_documents: tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
    ends = (tokens == eos_id).to(torch.int64)
    docs = torch.cumsum(ends, 1) - ends  # the EOS belongs to the document it ends
    idx = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    # A document's start is the first index with its id: the running max of the starts.
    start = torch.where(torch.cat([torch.ones_like(docs[:, :1], dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], 1),
                        idx, torch.zeros_like(idx))
    start = torch.cummax(start, 1).values
    out = dict(batch)
    out["documents"], out["positions"] = docs, idx - start
    if "targets" in batch:
        out["targets"] = batch["targets"].masked_fill(ends.bool(), IGNORE_INDEX)
    return out


def document_keep(ids_q: torch.Tensor, pos_q: torch.Tensor, ids_k: torch.Tensor, pos_k: torch.Tensor,
                  causal: bool = True) -> torch.Tensor:
    """Boolean ``(batch, s_q, s_k)``: True where query ``i`` may attend key ``j`` (same
    document, and with ``causal`` ``pos_k[j] <= pos_q[i]``). Inputs are ``(batch, s)``.

    >>> ids, pos = torch.tensor([[0, 0, 1]]), torch.tensor([[0, 1, 0]])
    >>> document_keep(ids, pos, ids, pos).int().tolist()
    [[[1, 0, 0], [1, 1, 0], [0, 0, 1]]]
    """
    keep = ids_q[:, :, None] == ids_k[:, None, :]
    if causal:
        keep &= pos_k[:, None, :] <= pos_q[:, :, None]
    return keep


def _chunks_per_rank(local: int, most: int = 16) -> int:
    return max(c for c in range(1, min(local, most) + 1) if local % c == 0)


def balanced_order(positions: torch.Tensor, cp: int, chunks: int | None = None) -> torch.Tensor:
    """Per row, the order (indices into the sequence) that deals ``cp * chunks`` equal
    contiguous chunks to the cp ranks (rank ``r`` holds entries ``[r·s/cp, (r+1)·s/cp)``
    of the order), each rank ``chunks`` of them, balancing the attended pairs
    (``Σ positions + 1`` over a rank's queries): largest chunk first to the least-loaded
    rank with room (greedy LPT). A rank's chunks keep their original order. ``chunks``
    defaults to the largest divisor of ``s/cp`` up to 16.

    >>> pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    >>> balanced_order(pos, 2, chunks=2).tolist()
    [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    b, s = positions.shape
    if cp < 1 or s % cp:
        raise ValueError(f"balanced_order: seq={s} must divide by cp={cp}")
    local = s // cp
    k = _chunks_per_rank(local) if chunks is None else chunks
    if k < 1 or local % k:
        raise ValueError(f"balanced_order: chunks={k} must divide the {local} tokens per rank")
    size = local // k
    weight = (positions.to(torch.float64) + 1).view(b, cp * k, size).sum(-1)
    rows = []
    for r in range(b):
        load, owned = [0.0] * cp, [[] for _ in range(cp)]
        for c in torch.argsort(weight[r], descending=True, stable=True).tolist():
            dst = min((i for i in range(cp) if len(owned[i]) < k), key=lambda i: load[i])
            owned[dst].append(c)
            load[dst] += float(weight[r, c])
        picked = torch.tensor([c for o in owned for c in sorted(o)], dtype=torch.int64)
        rows.append((picked[:, None] * size + torch.arange(size)).reshape(-1))
    return torch.stack(rows).to(positions.device)


def attended_pairs(positions: torch.Tensor, order: torch.Tensor, cp: int) -> torch.Tensor:
    """Attended (query, key) pairs per cp rank, summed over the rows, when the sequence
    is in ``order`` (``(batch, s)`` or ``(s,)``): the causal document attention's FLOPs.

    >>> pos = torch.tensor([[0, 1, 2, 3]])
    >>> attended_pairs(pos, torch.tensor([0, 3, 1, 2]), 2).tolist()
    [5, 5]
    """
    order = order.expand_as(positions) if order.dim() == 1 else order
    return (torch.gather(positions, 1, order) + 1).view(positions.shape[0], cp, -1).sum((0, 2))


def document_order(batch: dict[str, torch.Tensor], cp: int) -> torch.Tensor | None:
    """The sequence order ``shard_batch`` gives a packed-document batch under ``cp > 1``
    (:func:`balanced_order` of its ``positions``); ``None`` for any other batch, which
    keeps the layout's fixed order.

    >>> document_order({"tokens": torch.zeros(1, 4)}, 2) is None
    True
    """
    if cp <= 1 or "positions" not in batch:
        return None
    return balanced_order(batch["positions"], cp)


def reorder(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x`` (``(batch, seq, ...)``) with each row's sequence in ``order`` (``(batch, seq)``).

    >>> reorder(torch.tensor([[10, 11, 12]]), torch.tensor([[2, 0, 1]])).tolist()
    [[12, 10, 11]]
    """
    index = order.view(*order.shape, *([1] * (x.dim() - 2))).expand(*order.shape, *x.shape[2:])
    return torch.gather(x, 1, index.to(x.device))
