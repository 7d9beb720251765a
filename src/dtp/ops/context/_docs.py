"""Packed documents under context parallel: which (Q tile, K/V tile) pairs a rank
computes, with which mask, and the count of the tiles it skips. No collectives here:
the document ids and positions of the whole sequence are on every rank of a cp group
(gathered once per attention call, two int64 per token), so each rank knows the rows of
every K/V block that reaches it without sending anything more."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from ..blockwise import BlockTask
from ..documents import document_keep

__all__ = ["block_counts"]

_counts: dict[str, int] | None = None


@contextlib.contextmanager
def block_counts() -> Iterator[dict[str, int]]:
    """Count the forward tiles this rank computes and skips under packed documents.

    Yields a dict that fills with ``computed``, ``skipped`` (a batch row's tiles no
    document spans: no kernel runs for them) and ``attended`` (the (query, key) pairs
    attended).

    >>> with block_counts() as counts:
    ...     pass
    >>> counts
    {'computed': 0, 'skipped': 0, 'attended': 0}
    """
    global _counts
    previous, counts = _counts, {"computed": 0, "skipped": 0, "attended": 0}
    _counts = counts
    try:
        yield counts
    finally:
        _counts = previous


def _mask_of(keep: torch.Tensor) -> object:
    """The cheapest mask that says ``keep``: "full" / "causal" take the fused kernels."""
    if bool(keep.all()):
        return "full"
    sq, sk = keep.shape[1:]
    if sq == sk and torch.equal(keep, torch.ones(sq, sk, dtype=torch.bool, device=keep.device).tril().expand_as(keep)):
        return "causal"
    return keep


def _count(key: str, n: int) -> None:
    if _counts is not None:
        _counts[key] += n


@dataclass(frozen=True)
class Docs:
    """Document ids and positions of the rows each ring coordinate holds (``ids[c]``,
    ``pos[c]``: ``(batch, L)``), and whether attention is causal within a document."""

    ids: tuple[torch.Tensor, ...]
    pos: tuple[torch.Tensor, ...]
    causal: bool
    tiles: int = 2  # K/V and Q blocks are cut into this many tiles each for skipping

    def keep(self, a: int, b: int) -> torch.Tensor:
        return document_keep(self.ids[a], self.pos[a], self.ids[b], self.pos[b], self.causal)

    def tasks(self, rank: int, src: int, phase: str) -> list[BlockTask]:
        """The tiles of Q (this rank) × K/V (from ``src``) that some document spans, per
        run of batch rows. In the diagonal block the diagonal tiles come first: each of
        their rows sees itself, so the ring's accumulator starts from them."""
        keep = self.keep(rank, src)
        L = keep.shape[1]
        t = self.tiles if L % self.tiles == 0 else 1
        size, out = L // t, []
        pairs = [(i, j) for i in range(t) for j in range(t)]
        if src == rank:  # the diagonal tiles first: every row of theirs sees itself
            pairs.sort(key=lambda p: p[0] != p[1])
        for i, j in pairs:
            qs, ks = slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size)
            sub = keep[:, qs, ks]
            spans = sub.flatten(1).any(1).tolist()  # per row: does a document span this tile?
            if phase == "fwd":
                _count("computed", sum(spans))
                _count("skipped", len(spans) - sum(spans))
                _count("attended", int(sub.sum()))
            for rows in _runs(spans):  # one kernel per run of consecutive rows that need it
                out.append(BlockTask(qs, ks, _mask_of(sub[rows]), rows))  # type: ignore[arg-type]
        return out


def _runs(flags: list[bool]) -> list[slice]:
    """Slices of the runs of True in ``flags``; the whole batch as ``slice(None)``."""
    runs, start = [], None
    for i, f in enumerate([*flags, False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append(slice(None) if (start, i) == (0, len(flags)) else slice(start, i))
            start = None
    return runs


def gathered(full: torch.Tensor, first: int, u: int, L: int,
             slots: list[list[tuple[slice, slice]]]) -> torch.Tensor:
    """The rows of cp pieces ``first .. first+u-1`` of ``full`` (``(batch, cp·L)``, data
    order) placed as a Ulysses gather places them (``slots``, from ``ulysses._slots``)."""
    out = full.new_empty((full.shape[0], u * L))
    for j, places in enumerate(slots):
        piece = full[:, (first + j) * L:(first + j + 1) * L]
        for dst, src in places:
            out[:, dst] = piece[:, src]
    return out
