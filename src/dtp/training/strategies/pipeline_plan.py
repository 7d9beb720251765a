"""A pipeline rank's action list as the runner walks it: per item, the actions to run and
the receives to post first (:class:`Step`), made once per (schedule, p, v, m, rank) and
cached, so a step does no per-action stage arithmetic.

Receives are posted :data:`AHEAD` items ahead of the action that reads them. Measured on
gloo (2 CPU ranks, 2 cores, ``benchmarks/pipeline.py``'s ping-pong): posting a receive
costs 40-110 µs when it is posted before the peer's send, but 0.16-2.7 ms when the send
is already pending and the sender is computing (the receive then waits for the sender's
transport thread to be scheduled). One item ahead (the runner before) often posts after
the peer's send in 1F1B's steady state (the previous stage's next forward runs beside
this stage's forward); three items ahead posts before it, at the price of up to three
receive buffers allocated early.

>>> steps = rank_steps("1f1b", 2, 1, 4, 1)[1]
>>> [(str(s.item), s.posts) for s in steps[:3]]
[('F0.0', (('act', 1, 0), ('act', 1, 1))), ('B0.0', (('act', 1, 2),)), ('F0.1', ())]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ... import schedules
from ...schedules.actions import flat

__all__ = ["AHEAD", "Step", "rank_steps", "receive_of"]

#: How many items ahead of the action that reads it a receive is posted.
AHEAD = 3

Recv = tuple[str, int, int]  # (kind "act" / "grad", the receiving stage, microbatch)


@dataclass(frozen=True)
class Step:
    """One item of a rank's list: ``runs`` its actions ``(kind, chunk, microbatch)`` in
    order (two for a :class:`dtp.schedules.Pair`), after posting ``posts``, the receives
    first needed by this item or the next :data:`AHEAD` ones."""

    item: "schedules.Action | schedules.Pair"
    runs: tuple[tuple[str, int, int], ...]
    posts: tuple[Recv, ...]


def receive_of(action: "schedules.Action", rank: int, p: int, placement: str, n_stages: int) -> Recv | None:
    """What ``action`` receives from another rank (a hand-over within the rank is local:
    ``None``).

    >>> receive_of(schedules.make("1f1b", p=2, v=1, m=2)[1][0], 1, 2, "loop", 2)
    ('act', 1, 0)
    """
    stage = action.stage(rank, p, placement)
    if action.kind == "F" and stage > 0:
        kind, frm = "act", stage - 1
    elif action.kind in ("B", "I") and stage < n_stages - 1:
        kind, frm = "grad", stage + 1
    else:
        return None
    if schedules.stage_owner(frm, p, placement)[0] == rank:
        return None
    return kind, stage, action.microbatch


@functools.lru_cache(maxsize=64)
def rank_steps(name: str, p: int, v: int, m: int, rank: int, forward_only: bool = False,
         ahead: int = AHEAD, lanes: bool = False) -> tuple["schedules.Schedule", tuple[Step, ...]]:
    """``(the schedule, rank's steps)`` for schedule ``name`` (``forward_only``: the
    evaluation's, :func:`dtp.schedules.forward_only`; ``lanes``: ep_overlap's, whose
    :class:`dtp.schedules.Pair` items run on two lanes, :func:`dtp.schedules.lane_pairs`).
    Cached: the same tuple each step.

    >>> s, steps = rank_steps("zbv", 2, 2, 2, 0)
    >>> s.placement, len(steps) == len(s[0])
    ('v', True)
    >>> [" ".join(map(str, rank)) for rank in rank_steps("1f1b", 2, 1, 3, 0, lanes=True)[0]]
    ['F0.0 F0.1 F0.2&B0.0 B0.1 B0.2', 'F0.0 F0.1&B0.0 F0.2&B0.1 B0.2']
    """
    schedule = (schedules.forward_only if forward_only else schedules.make)(name, p=p, v=v, m=m)
    if lanes:
        schedule = schedules.lane_pairs(schedule, p=p, v=v, m=m)
    items = schedule[rank]
    n_stages = p * v
    acts = [flat(item) for item in items]
    needs = [[r for a in item_acts if (r := receive_of(a, rank, p, schedule.placement, n_stages)) is not None]
             for item_acts in acts]
    posted: set[Recv] = set()
    steps = []
    for k, item in enumerate(items):
        posts = [r for later in needs[k:k + 1 + ahead] for r in later if r not in posted]
        posted.update(posts)
        steps.append(Step(item, tuple((a.kind, a.chunk, a.microbatch) for a in acts[k]), tuple(posts)))
    return schedule, tuple(steps)
