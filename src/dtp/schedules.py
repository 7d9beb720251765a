"""Pipeline schedules as data: one list of actions per pipeline rank, no torch.

A schedule is a tuple with one action list per pipeline rank ``0..p-1``. The runner
executes each rank's list in order; a send never blocks and a receive waits only for
the data it needs, so a schedule is valid when some global order of all actions is
consistent with every rank's list (:func:`dependencies_ok`). Rank ``r`` holds the
``v`` virtual chunks ``r, r+p, ..., r+(v-1)p`` of the ``p·v`` global stages
(Megatron's round-robin); an :class:`Action` names its chunk and microbatch, and
:meth:`Action.stage` gives its global stage.

Action kinds: ``F`` forward; ``B`` full backward (input and weight grads); ``I``
input-grad only; ``W`` weight-grad only (``I`` then ``W`` is zero bubble's split ``B``).

=============  ===========================  ==========================  ==================
schedule       warm-up forwards on rank r   bubble ratio (f=1, b=2)     peak in flight
=============  ===========================  ==========================  ==================
gpipe          all m, then all m backwards  (p-1)/m                     m
1f1b           p-r-1 (PipeDream-flush)      (p-1)/m                     p-r
interleaved    2(p-r-1) + (v-1)p, ≤ m·v     (p-1)/(v·m)                 warm-up + 1
zb-h1          p-r-1; rank r defers r W's   (p-1)/(3m) at I = W = f     p
=============  ===========================  ==========================  ==================

(Interleaved's peak counts (chunk, microbatch) pairs: its warm-up plus one, at most m·v.)

Two normalisations of the bubble are reported by :func:`simulate`: ``bubble_fraction``
is idle time over all ranks' time, ``1 - busy / (p · makespan)`` (gpipe and 1f1b:
``(p-1)/(m+p-1)``), and ``bubble_ratio`` is idle time over compute time,
``(p · makespan - busy) / busy`` (the papers' ``(p-1)/m``). Peak in flight counts the
(chunk, microbatch) pairs whose activations a rank holds: ``F`` done, its ``B`` or ``W``
not yet; for ``v = 1`` that is microbatches.

Where the schedules come from (facts learnt, code our own): GPipe (Huang et al. 2019);
1F1B is PipeDream-flush (Narayanan et al. 2021); interleaved is Megatron-core's
``forward_backward_pipelining_with_interleaving`` (virtual microbatch ``k`` runs chunk
``(k mod p·v) // p`` on microbatch ``(k // p·v)·p + k mod p``, backwards walk the chunks
in reverse); zb-h1 is zero bubble's handcrafted H1 (Qi et al. 2023), whose rank ``r``
holds back ``r`` weight-grads in the steady state to fill its cool-down bubble, so its
peak memory stays at 1f1b's rank-0 peak of ``p`` microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "Timeline",
    "check",
    "make",
    "dependencies_ok",
    "simulate",
    "global_stage",
    "stage_owner",
    "format_schedule",
]

#: The schedule names :func:`make` knows.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")

_KINDS = ("F", "B", "I", "W")
# Steady-state schedules keep p microbatches in flight to fill the pipe; with fewer
# torchtitan hangs, dtp refuses up front.
_NEED_P_MICROBATCHES = ("1f1b", "interleaved", "zb-h1")

Schedule = Sequence[Sequence["Action"]]


@dataclass(frozen=True)
class Action:
    """One compute step of one rank: ``kind`` on virtual ``chunk`` for ``microbatch``.

    - `kind`: ``"F"`` forward, ``"B"`` full backward, ``"I"`` input-grad only, ``"W"``
      weight-grad only.
    - `chunk`: the virtual chunk on this rank, ``0..v-1``.
    - `microbatch`: ``0..m-1``.

    Raises: ``ValueError`` for an unknown kind or a negative / non-int index.

    >>> a = Action("F", 1, 3)
    >>> str(a), a.stage(rank=2, p=4)
    ('F1.3', 6)
    """

    kind: str
    chunk: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"schedules.Action: kind must be one of {_KINDS}, got {self.kind!r}")
        for name in ("chunk", "microbatch"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"schedules.Action: {name} must be an int >= 0, got {value!r}")

    def stage(self, rank: int, p: int) -> int:
        """The global stage of this action on ``rank`` of ``p`` (:func:`global_stage`)."""
        return global_stage(self.chunk, rank, p)

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


def global_stage(chunk: int, rank: int, p: int) -> int:
    """The stage-to-rank map, the one place it is written: chunk ``c`` of rank ``r`` of
    ``p`` is global stage ``c·p + r`` (Megatron's round-robin: rank ``r`` holds stages
    ``r, r+p, ..., r+(v-1)p``).

    >>> [global_stage(c, 1, 4) for c in range(2)], stage_owner(5, 4)
    ([1, 5], (1, 1))
    """
    return chunk * p + rank


def stage_owner(stage: int, p: int) -> tuple[int, int]:
    """``(rank, chunk)`` holding global ``stage``: the inverse of :func:`global_stage`."""
    return stage % p, stage // p


class Event(NamedTuple):
    """One action of one rank in a simulated timeline, from ``start`` to ``end``."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` found: per-rank events, makespan, bubble and memory.

    - `events`: per rank, its actions in order with start and end times.
    - `makespan`: when the last action ends.
    - `busy`: per rank, the time it computed.
    - `bubble_fraction`: ``1 - sum(busy) / (p · makespan)``, idle over all time.
    - `bubble_ratio`: ``(p · makespan - sum(busy)) / sum(busy)``, idle over compute.
    - `peak_in_flight`: per rank, the most (chunk, microbatch) pairs with ``F`` done and
      ``B`` / ``W`` not yet (activations alive).
    """

    events: tuple[tuple[Event, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    bubble_fraction: float
    bubble_ratio: float
    peak_in_flight: tuple[int, ...]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_counts(fn: str, p: object, v: object, m: object) -> None:
    for name, value in (("p", p), ("v", v), ("m", m)):
        if not _is_int(value) or value < 1:
            raise ValueError(
                f"{fn}: {name} must be an int >= 1 (p pipeline ranks, v virtual chunks "
                f"per rank, m microbatches), got {name}={value!r}"
            )


def check(name: str, *, p: int, v: int, m: int) -> None:
    """Check that schedule ``name`` can run ``m`` microbatches on ``p`` ranks of ``v`` chunks.

    - `name`: one of :data:`SCHEDULES`.
    - `p`, `v`, `m`: pipeline ranks, virtual chunks per rank, microbatches; ints >= 1.

    Raises: ``ValueError`` naming the numbers and what is valid: an unknown name; ``v > 1``
    except for interleaved, interleaved with ``v < 2``; ``m < p`` for 1f1b, interleaved
    and zb-h1 (they need ``p`` microbatches in flight); interleaved with ``m`` not a
    multiple of ``p`` (Megatron's rule). gpipe runs any ``m >= 1``.

    >>> check("1f1b", p=4, v=1, m=8)
    >>> check("1f1b", p=4, v=1, m=2)
    Traceback (most recent call last):
    ...
    ValueError: schedules: '1f1b' needs at least p=4 microbatches in flight, got m=2; use m >= 4, ...
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedules: unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    _check_counts("schedules", p, v, m)
    if name != "interleaved" and v > 1:
        raise ValueError(
            f"schedules: {name!r} runs one chunk per rank, got v={v}; use v=1, or "
            f"'interleaved' for v >= 2"
        )
    if name == "interleaved" and v < 2:
        raise ValueError(
            f"schedules: 'interleaved' needs v >= 2 virtual chunks per rank, got v={v}; "
            f"for one chunk per rank use '1f1b'"
        )
    if name in _NEED_P_MICROBATCHES and m < p:
        raise ValueError(
            f"schedules: {name!r} needs at least p={p} microbatches in flight, got m={m}; "
            f"use m >= {p}, or the 'gpipe' schedule"
        )
    if name == "interleaved" and m % p:
        below, above = m - m % p, m - m % p + p
        raise ValueError(
            f"schedules: 'interleaved' needs m to be a multiple of p={p} (Megatron's rule: "
            f"microbatches go p at a time through each chunk), got m={m}; use m={below} "
            f"or m={above}"
        )


def make(name: str, *, p: int, v: int = 1, m: int) -> tuple[tuple[Action, ...], ...]:
    """The action lists of schedule ``name``, one per pipeline rank ``0..p-1``.

    - `name`: one of :data:`SCHEDULES` (module docstring: the table of schedules).
    - `p`: pipeline ranks; `v`: virtual chunks per rank, default 1; `m`: microbatches.

    gpipe runs all forwards, then all backwards in microbatch order ``0..m-1``. 1f1b
    and zb-h1 warm up with ``p-r-1`` forwards on rank ``r``; interleaved follows
    Megatron-core. zb-h1 splits every backward into ``I`` and ``W``.

    Raises: ``ValueError`` as :func:`check`.

    >>> for rank in make("1f1b", p=2, m=3):
    ...     print(" ".join(map(str, rank)))
    F0.0 F0.1 B0.0 F0.2 B0.1 B0.2
    F0.0 B0.0 F0.1 B0.1 F0.2 B0.2
    """
    check(name, p=p, v=v, m=m)
    if name == "gpipe":
        ranks = [_gpipe(m) for _ in range(p)]
    elif name == "interleaved":
        ranks = [_interleaved(r, p, v, m) for r in range(p)]
    else:
        ranks = [_one_f_one_b(r, p, m, zero_bubble=name == "zb-h1") for r in range(p)]
    return tuple(tuple(rank) for rank in ranks)


def _gpipe(m: int) -> list[Action]:
    # Backwards in microbatch order (torch.distributed.pipelining's GPipe): the last
    # stage can start microbatch 0's backward as soon as its last forward ends.
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def _one_f_one_b(r: int, p: int, m: int, *, zero_bubble: bool) -> list[Action]:
    warm = min(p - r - 1, m)
    out = [Action("F", 0, i) for i in range(warm)]
    weights_done = 0

    def backward(i: int) -> None:
        nonlocal weights_done
        if not zero_bubble:
            out.append(Action("B", 0, i))
            return
        out.append(Action("I", 0, i))
        # Rank r holds back r weight-grads: its activations then peak at p - r + r = p
        # (1f1b's rank-0 peak), and the held W's fill the idle time 1f1b leaves at the
        # end of rank r, which finishes r backwards before rank 0.
        if i >= r:
            out.append(Action("W", 0, weights_done))
            weights_done += 1

    for i in range(m - warm):
        out.append(Action("F", 0, warm + i))
        backward(i)
    for i in range(m - warm, m):
        backward(i)
    if zero_bubble:
        out.extend(Action("W", 0, i) for i in range(weights_done, m))
    return out


def _interleaved(r: int, p: int, v: int, m: int) -> list[Action]:
    total = m * v
    # Megatron: rank r runs ahead 2 forwards per rank below it (a forward and the
    # backward coming back), plus one chunk-round of p on every rank, capped at m·v.
    warm = min((p - r - 1) * 2 + (v - 1) * p, total)

    def virtual(k: int, forward: bool) -> Action:
        group, in_group = divmod(k, p * v)
        chunk = in_group // p
        return Action(
            "F" if forward else "B",
            chunk if forward else v - 1 - chunk,
            group * p + k % p,
        )

    # Megatron-core runs every forward first when m == p; with asynchronous sends the
    # formula is deadlock-free there too (tests: dependencies_ok) and its bubble is the
    # same (p-1)/(v·m), so dtp does not special-case it.
    out = [virtual(k, True) for k in range(warm)]
    for k in range(total - warm):
        out += [virtual(warm + k, True), virtual(k, False)]
    out += [virtual(k, False) for k in range(total - warm, total)]
    return out


# ------------------------------------------------------------------ checking, timing
# A dependency key: ("F", stage, mb) forward done; ("G", stage, mb) input grad done (by
# B or I); ("W", stage, mb) weight grad done.


def _deps(kind: str, stage: int, mb: int, stages: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", stage - 1, mb)] if stage else []
    if kind == "W":
        return [("G", stage, mb)]
    grad = [("G", stage + 1, mb)] if stage + 1 < stages else []
    return [("F", stage, mb)] + grad


def _key_label(key: tuple[str, int, int], p: int) -> str:
    kind, stage, mb = key
    name = {"F": "F", "G": "B/I", "W": "W"}[kind]
    rank, chunk = stage_owner(stage, p)
    return f"{name}{chunk}.{mb} of rank {rank} (stage {stage})"


def _validate(fn: str, schedule: Schedule, p: int, v: int, m: int) -> None:
    _check_counts(fn, p, v, m)
    if len(schedule) != p:
        raise ValueError(
            f"{fn}: a schedule holds one action list per rank, p={p}, got {len(schedule)} lists"
        )
    counts: dict[tuple[str, int, int], int] = {}
    for r, actions in enumerate(schedule):
        for a in actions:
            if not isinstance(a, Action):
                raise ValueError(f"{fn}: rank {r} holds {a!r}, not a schedules.Action")
            if a.chunk >= v or a.microbatch >= m:
                raise ValueError(
                    f"{fn}: rank {r} runs {a}, outside chunks 0..{v - 1} and microbatches 0..{m - 1}"
                )
            key = (a.kind, a.stage(r, p), a.microbatch)
            counts[key] = counts.get(key, 0) + 1
    for stage in range(p * v):
        for mb in range(m):
            n = {kind: counts.get((kind, stage, mb), 0) for kind in _KINDS}
            where = "stage {} (rank {}, chunk {}), microbatch {}".format(stage, *stage_owner(stage, p), mb)
            if n["F"] != 1:
                raise ValueError(
                    f"{fn}: {where} has {n['F']} F actions; every (stage, microbatch) needs exactly one"
                )
            if (n["B"], n["I"], n["W"]) not in ((1, 0, 0), (0, 1, 1)):
                raise ValueError(
                    f"{fn}: {where} has {n['B']} B, {n['I']} I and {n['W']} W actions; it needs "
                    f"exactly one B, or exactly one I and one W"
                )


def _execute(
    fn: str, schedule: Schedule, p: int, v: int, cost: dict[str, float]
) -> list[list[Event]]:
    """Run every rank's list in order, each action as soon as its rank and inputs are free.

    Start times depend only on the rank's previous end and the inputs' ends, so visiting
    ranks round-robin gives the same times as a global clock would.
    """
    stages = p * v
    done: dict[tuple[str, int, int], float] = {}
    events: list[list[Event]] = [[] for _ in range(p)]
    pos = [0] * p
    free = [0.0] * p
    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(schedule):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                stage = a.stage(r, p)
                needs = _deps(a.kind, stage, a.microbatch, stages)
                if any(key not in done for key in needs):
                    break
                start = max([free[r]] + [done[key] for key in needs])
                free[r] = start + cost[a.kind]
                events[r].append(Event(start, free[r], a))
                done[({"B": "G", "I": "G"}.get(a.kind, a.kind), stage, a.microbatch)] = free[r]
                if a.kind == "B":
                    done[("W", stage, a.microbatch)] = free[r]
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(schedule[r])]
    if stuck:
        lines = []
        for r in stuck:
            a = schedule[r][pos[r]]
            stage = a.stage(r, p)
            missing = [k for k in _deps(a.kind, stage, a.microbatch, stages) if k not in done]
            waits = ", ".join(_key_label(k, p) for k in missing)
            lines.append(f"rank {r} at {a} waits for {waits}")
        raise ValueError(f"{fn}: the schedule deadlocks, no rank can move: " + "; ".join(lines))
    return events


def dependencies_ok(schedule: Schedule, *, p: int, v: int, m: int) -> None:
    """Raise ``ValueError`` unless ``schedule`` runs ``p·v`` stages on ``m`` microbatches.

    Valid: every (stage, microbatch) has exactly one ``F`` and one ``B``, or one ``I``
    and one ``W``; and some global order, consistent with every rank's list, runs
    ``F(s, i)`` after ``F(s-1, i)``, ``B/I(s, i)`` after ``F(s, i)`` and ``B/I(s+1, i)``,
    and ``W(s, i)`` after ``I(s, i)``. Sends are asynchronous and receives block, as in
    the runner. Costs nothing but the walk over the actions.

    Raises: ``ValueError`` naming the rank and action (a deadlock names what each stuck
    rank waits for).

    >>> dependencies_ok(make("interleaved", p=2, v=2, m=4), p=2, v=2, m=4)
    >>> dependencies_ok(((Action("B", 0, 0), Action("F", 0, 0)),), p=1, v=1, m=1)
    Traceback (most recent call last):
    ...
    ValueError: schedules.dependencies_ok: the schedule deadlocks, no rank can move: rank 0 at B0.0 waits
    for F0.0 of rank 0 (stage 0)
    """
    fn = "schedules.dependencies_ok"
    _validate(fn, schedule, p, v, m)
    _execute(fn, schedule, p, v, dict.fromkeys(_KINDS, 1.0))


def _peak_in_flight(actions: Sequence[Action]) -> int:
    alive: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.kind == "F":
            alive.add((a.chunk, a.microbatch))
            peak = max(peak, len(alive))
        elif a.kind in ("B", "W"):
            alive.discard((a.chunk, a.microbatch))
    return peak


def simulate(
    schedule: Schedule,
    *,
    p: int,
    v: int,
    m: int,
    f: float = 1.0,
    b: float = 2.0,
    w: float | None = None,
) -> Timeline:
    """Time ``schedule`` event by event: each rank runs its list in order, comm costs 0.

    An action starts when its rank is free and its inputs are done (:func:`dependencies_ok`).

    - `f`: cost of one ``F``, default 1.0. `b`: cost of one ``B``, default 2.0.
    - `w`: cost of one ``W``, default ``b / 2``; an ``I`` costs ``b - w``.

    Costs are per action, i.e. per chunk: to compare makespans of ``v`` chunks with
    ``v = 1``, pass ``f / v`` and ``b / v`` (bubble ratios do not change with the scale).

    Raises: ``ValueError`` as :func:`dependencies_ok`, or for costs not ``f > 0``,
    ``b > 0``, ``0 <= w <= b``.

    >>> from dtp.schedules import simulate  # the doctest namespace's simulate is dtp.testing's
    >>> t = simulate(make("1f1b", p=4, m=8), p=4, v=1, m=8)
    >>> t.makespan, round(t.bubble_fraction, 4), t.bubble_ratio, t.peak_in_flight
    (33.0, 0.2727, 0.375, (4, 3, 2, 1))
    """
    fn = "schedules.simulate"
    w = b / 2 if w is None else w
    for name, value in (("f", f), ("b", b)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ValueError(
                f"{fn}: {name} (the cost of one {name.upper()}) must be a number > 0, got {value!r}"
            )
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w <= b:
        raise ValueError(f"{fn}: w (the W part of a backward) must be in [0, b={b}], got {w!r}")
    _validate(fn, schedule, p, v, m)
    events = _execute(fn, schedule, p, v, {"F": f, "B": b, "I": b - w, "W": w})
    makespan = max((rank[-1].end for rank in events if rank), default=0.0)
    busy = tuple(sum(e.end - e.start for e in rank) for rank in events)
    total = sum(busy)
    idle = p * makespan - total
    return Timeline(
        events=tuple(tuple(rank) for rank in events),
        makespan=makespan,
        busy=busy,
        bubble_fraction=idle / (p * makespan) if makespan else 0.0,
        bubble_ratio=idle / total if total else 0.0,
        peak_in_flight=tuple(_peak_in_flight(rank) for rank in schedule),
    )


def format_schedule(schedule: Schedule, *, p: int) -> str:
    """A text table of ``schedule``: one row per rank, one column per time slot.

    Every action takes one slot and starts as early as :func:`simulate` would start it
    (so ``.`` marks a rank waiting for its inputs); cells read ``F0.3`` (forward, chunk
    0, microbatch 3). ``v`` and ``m`` are read off the actions. What ``dtp train
    --print-schedule`` prints.

    Raises: ``ValueError`` as :func:`dependencies_ok`.

    >>> print(format_schedule(make("1f1b", p=2, m=2), p=2))
    rank 0: F0.0 F0.1 .    B0.0 .    B0.1
    rank 1: .    F0.0 B0.0 F0.1 B0.1
    """
    fn = "schedules.format_schedule"
    _check_counts(fn, p, 1, 1)
    # Non-actions are left to _validate, which names them.
    actions = [a for rank in schedule for a in rank if isinstance(a, Action)]
    v = max((a.chunk for a in actions), default=0) + 1
    m = max((a.microbatch for a in actions), default=0) + 1
    _validate(fn, schedule, p, v, m)
    events = _execute(fn, schedule, p, v, dict.fromkeys(_KINDS, 1.0))
    width = max((len(str(a)) for a in actions), default=1)
    label = len(f"rank {p - 1}")
    rows = []
    for r, rank in enumerate(events):
        cells = ["."] * int(max((e.end for e in rank), default=0))
        for e in rank:
            cells[int(e.start)] = str(e.action)
        row = " ".join(c.ljust(width) for c in cells).rstrip()
        rows.append(f"{f'rank {r}'.ljust(label)}: {row}".rstrip())
    return "\n".join(rows)
