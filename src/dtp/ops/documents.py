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

import torch

from ..core._rules import IGNORE_INDEX
# The sequence orders are the context layout's (it arranges a batch: dtp.shard_batch); here
# for what builds on them.
from ..layouts.context import balanced_order, document_order, reorder

__all__ = ["pack_documents", "document_keep", "balanced_order", "document_order", "reorder", "attended_pairs",
           "DOC_KEYS"]

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


def attended_pairs(positions: torch.Tensor, order: torch.Tensor, cp: int) -> torch.Tensor:
    """Attended (query, key) pairs per cp rank, summed over the rows, when the sequence
    is in ``order`` (``(batch, s)`` or ``(s,)``): the causal document attention's FLOPs.

    >>> pos = torch.tensor([[0, 1, 2, 3]])
    >>> attended_pairs(pos, torch.tensor([0, 3, 1, 2]), 2).tolist()
    [5, 5]
    """
    order = order.expand_as(positions) if order.dim() == 1 else order
    return (torch.gather(positions, 1, order) + 1).view(positions.shape[0], cp, -1).sum((0, 2))
