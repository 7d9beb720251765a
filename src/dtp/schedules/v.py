"""The V schedules, zbv and dualpipev: each rank holds two chunks, stages ``r`` and ``2p-1-r``.

Data only (no torch), built by :func:`dtp.schedules.make`; :mod:`.actions` holds the stage
map (placement ``"v"``), :mod:`.simulate` the checks and the timing. A microbatch runs down the
ranks on chunk 0 (stages ``0..p-1``), turns on the last rank (stage ``p-1`` hands to
stage ``p`` on the same rank, no transfer) and comes back up on chunk 1, so the loss and
the embedding both sit on rank 0. Costs below are per chunk (half a 1f1b stage):
``F`` forward, ``I`` input-grad, ``W`` weight-grad, ``B = I + W`` a full backward, ``F&B``
a :class:`~dtp.schedules.Pair`.

**zbv** (zero bubble's V, Qi et al. 2024, "Pipeline Parallelism with Controllable
Memory" §6; the phases as torch 2.13's ``ScheduleZBVZeroBubble`` lays them out, code our
own). Rank ``r`` warms up with ``2(p-r)-1`` chunk-0 forwards, then ``r`` pairs of
chunk-1 / chunk-0 forwards, then ``p-r`` times chunk 1's ``F I W``; the steady state runs
``F0 I0 W0 F1 I1 W1``; the cool-down runs ``r`` times ``I0 I1``, ``p-r`` times ``I0 W0``
and the held ``W``'s. Its bubble (:func:`dtp.schedules.simulate`, every rank's idle
time, ``m >= 2p-1``, ``F = I``, ``W <= F``) is exactly ``(p-1)·max(F, F+I-2W)``: the
paper's ``(p-1)(F+I-2W)`` (its B is our I) while ``W <= F/2``, and from there the last
rank's start-up ``(p-1)F``, which no schedule avoids (the first forward crosses ``p-1``
ranks before it reaches stage ``p-1``). The paper's "zero bubble at F = B = W" is this
floor: ``(p-1)F`` with ``F`` a chunk's forward, 1/6 of 1f1b's ``(p-1)(F+B)`` on stages
of twice the cost. Activations peak at ``2p`` chunks (``p`` stages' worth: 1f1b's rank-0
peak).

**dualpipev** (DeepSeek-V3's DualPipe cut in half; DeepSeek's DualPipe README, whose
phases torch 2.13's ``ScheduleDualPipeV`` follows; code our own). Eight phases on rank
``r``: ``2(p-r-1)`` ``F0``; ``r+1`` times ``F0 F1``; ``p-r-1`` times ``I1 W F1``; then
``m-2p+r+1`` times ``F0&B1, F1&B0`` (the last rank's first ``F0``, ``B1`` unpaired);
``p-r-1`` times ``B1, F1&B0``; ``r+1`` times ``B1 B0`` whose second half splits into
``I`` (the ``W``'s wait); ``p-r-1`` times ``W, B0``; ``r+1`` ``W``. Its per-rank bubble
is DeepSeek's ``(PP/2-1)(F&B+B-3W)`` with ``PP = 2p`` stages, i.e. ``(p-1)(F&B+B-3W)``
(exactly, for the most idle rank, at ``F = I``, ``W <= F``, ``F&B <= F+B``); activations
peak at ``2p+1`` chunks (the README's ``PP+1``). It needs ``m >= 2p``.
"""

from __future__ import annotations

from .actions import Action, Pair

__all__ = ["zbv", "dualpipev"]


class _Counts:
    """The next microbatch of each (kind, chunk), and the I's whose W is still due."""

    def __init__(self) -> None:
        self.next: dict[tuple[str, int], int] = {}
        self.due_w: list[tuple[int, int]] = []

    def take(self, kind: str, chunk: int) -> Action:
        # A full backward and an input-grad advance one count: either ends the chunk's
        # backward of that microbatch.
        key = ("I" if kind == "B" else kind, chunk)
        i = self.next.get(key, 0)
        self.next[key] = i + 1
        if kind == "I":
            self.due_w.append((chunk, i))
        return Action(kind, chunk, i)


def zbv(r: int, p: int, m: int) -> list[Action]:
    """Rank ``r``'s zbv actions over ``m`` microbatches (module docstring).

    >>> " ".join(map(str, zbv(1, 2, 2)))
    'F0.0 F1.0 F0.1 F1.1 I1.0 W1.0 I0.0 W0.0 I1.1 W1.1 I0.1 W0.1'
    """
    # The phases assume 2p-1 microbatches; with fewer, the actions of the missing ones
    # are dropped (every rank drops the same, so the dependencies still hold).
    n = max(2 * p - 1, m)
    out: list[Action] = []
    c = _Counts()
    w_done = {0: 0, 1: 0}

    def f(chunk: int) -> None:
        out.append(c.take("F", chunk))

    def i_w(chunk: int) -> None:
        out.append(c.take("I", chunk))
        c.due_w.pop()
        w(chunk)

    def w(chunk: int) -> None:
        out.append(Action("W", chunk, w_done[chunk]))
        w_done[chunk] += 1

    def count(kind: str, chunk: int) -> int:
        return c.next.get((kind, chunk), 0)

    for _ in range(2 * (p - r) - 1):
        f(0)
    for _ in range(r):
        f(1)
        f(0)
    for _ in range(p - r):
        f(1)
        i_w(1)
    while count("F", 1) < count("F", 0) or count("F", 0) < n:
        if count("F", 0) < n:
            f(0)
        i_w(0)
        f(1)
        i_w(1)
    for _ in range(r):
        out.append(c.take("I", 0))
        out.append(c.take("I", 1))
    for _ in range(p - r):
        out.append(c.take("I", 0))
        w(0)
    for chunk in (1, 0):
        while w_done[chunk] < count("I", chunk):
            w(chunk)
    return [a for a in out if a.microbatch < m]


def dualpipev(r: int, p: int, m: int) -> list[Action | Pair]:
    """Rank ``r``'s dualpipev actions over ``m >= 2p`` microbatches (module docstring).

    >>> " ".join(map(str, dualpipev(1, 2, 4)))
    'F0.0 F1.0 F0.1 F1.1 F0.2 B1.0 F1.2&B0.0 F0.3&B1.1 F1.3&B0.1 B1.2 B0.2 I1.3 I0.3 W1.3 W0.3'
    """
    out: list[Action | Pair] = []
    c = _Counts()

    def act(kind: str, chunk: int) -> None:
        out.append(c.take(kind, chunk))

    def pair(forward: int, backward: int) -> None:
        out.append(Pair(c.take("F", forward), c.take("B", backward)))

    def w() -> None:
        if c.due_w:  # the oldest I's weight-grad
            out.append(Action("W", *c.due_w.pop(0)))

    for _ in range(2 * (p - r - 1)):
        act("F", 0)
    for _ in range(r + 1):
        act("F", 0)
        act("F", 1)
    for _ in range(p - r - 1):
        act("I", 1)
        w()
        act("F", 1)
    for k in range(m - 2 * p + r + 1):
        if k == 0 and r == p - 1:
            # The turn of the V: chunk 1's backward needs this very forward's output
            # (handed over on this rank), so the two cannot overlap.
            act("F", 0)
            act("B", 1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(p - r - 1):
        act("B", 1)
        pair(1, 0)
    # The last r+1 backwards of each chunk split: their W's fill the cool-down. The split
    # starts half-way, before chunk 1's backward on odd ranks, between the two on even.
    split = False
    for k in range(r + 1):
        if k == (r + 1) // 2 and r % 2 == 1:
            split = True
        act("I" if split else "B", 1)
        if k == (r + 1) // 2 and r % 2 == 0:
            split = True
        act("I" if split else "B", 0)
    for _ in range(p - r - 1):
        w()
        act("I" if split else "B", 0)
    while c.due_w:
        w()
    return out
