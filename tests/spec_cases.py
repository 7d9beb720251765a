"""Enumerations of PartitionSpecs for exhaustive layout tests."""

from __future__ import annotations

import itertools
import random
from typing import Callable, Hashable, Iterable

from dtp import P


def all_specs(axes: tuple[str, ...], ndim: int, *, partial: bool = True) -> list[P]:
    """Every spec of an ``ndim``-dim tensor over mesh ``axes``: each axis splits one dim
    (in every major→minor order), is a pending sum, or is unused."""
    specs = set()
    choices = list(range(ndim)) + (["partial"] if partial else []) + [None]
    for assign in itertools.product(choices, repeat=len(axes)):
        per_dim = [[a for a, c in zip(axes, assign) if c == d] for d in range(ndim)]
        pend = tuple(a for a, c in zip(axes, assign) if c == "partial")
        for orders in itertools.product(*(itertools.permutations(d) for d in per_dim)):
            specs.add(P(*[tuple(o) if o else None for o in orders], partial=pend))
    return sorted(specs, key=repr)


def spec_pairs(specs: list[P], k: int | None, seed: int = 0) -> list[tuple[P, P]]:
    """All ordered pairs, or a seeded sample of ``k`` of them."""
    pairs = [(a, b) for a in specs for b in specs]
    if k is None or k >= len(pairs):
        return pairs
    return random.Random(seed).sample(pairs, k)


def covering_pairs(specs: list[P], features: Callable[[tuple[P, P]], Iterable[Hashable]],
                   seed: int = 0) -> list[tuple[P, P]]:
    """A small deterministic set of ordered pairs that together show every feature any
    pair shows: greedy set cover — repeatedly the pair adding the most features not yet
    covered, ties going to the earlier pair in a ``seed``-shuffled order of all pairs."""
    pairs = [(a, b) for a in specs for b in specs]
    random.Random(seed).shuffle(pairs)
    feats = [frozenset(features(p)) for p in pairs]
    todo = set().union(*feats)
    chosen = []
    while todo:
        best = max(range(len(pairs)), key=lambda i: len(feats[i] & todo))
        chosen.append(pairs[best])
        todo -= feats[best]
    return chosen
