"""Checking and timing a schedule: :func:`dependencies_ok`, :func:`lane_pairs`, :func:`simulate`,
:func:`format_schedule`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from .actions import KINDS, Action, Pair, Schedule, flat, placement_of, stage_owner
from .build import check_counts, make  # noqa: F401 (make: the doctests use it)

__all__ = ["Event", "Timeline", "dependencies_ok", "lane_pairs", "simulate", "format_schedule"]

# A schedule as read here: a Schedule, or any per-rank lists (placement "loop").
Ranks = Sequence[Sequence["Action | Pair"]]

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


def _key_label(key: tuple[str, int, int], p: int, pl: str) -> str:
    kind, stage, mb = key
    name = {"F": "F", "G": "B/I", "W": "W"}[kind]
    rank, chunk = stage_owner(stage, p, pl)
    return f"{name}{chunk}.{mb} of rank {rank} (stage {stage})"


def _validate(fn: str, schedule: Ranks, p: int, v: int, m: int) -> set[tuple[int, str]]:
    """Raise unless ``schedule`` is well formed (:func:`dependencies_ok`'s rules but the
    order); returns the ``(stage, kind)`` pairs it runs."""
    check_counts(fn, p, v, m)
    if len(schedule) != p:
        raise ValueError(
            f"{fn}: a schedule holds one action list per rank, p={p}, got {len(schedule)} lists"
        )
    pl = placement_of(schedule)
    if pl == "v" and v != 2:
        raise ValueError(f"{fn}: a V placement holds two chunks per rank, got v={v}")
    counts: dict[tuple[str, int, int], int] = {}
    for r, actions in enumerate(schedule):
        for item in actions:
            if not isinstance(item, (Action, Pair)):
                raise ValueError(f"{fn}: rank {r} holds {item!r}, not a schedules.Action")
            for a in flat(item):
                if a.chunk >= v or a.microbatch >= m:
                    raise ValueError(
                        f"{fn}: rank {r} runs {a}, outside chunks 0..{v - 1} and microbatches 0..{m - 1}"
                    )
                key = (a.kind, a.stage(r, p, pl), a.microbatch)
                counts[key] = counts.get(key, 0) + 1
    for stage in range(p * v):
        for mb in range(m):
            n = {kind: counts.get((kind, stage, mb), 0) for kind in KINDS}
            where = "stage {} (rank {}, chunk {}), microbatch {}".format(stage, *stage_owner(stage, p, pl), mb)
            if n["F"] != 1:
                raise ValueError(
                    f"{fn}: {where} has {n['F']} F actions; every (stage, microbatch) needs exactly one"
                )
            if (n["B"], n["I"], n["W"]) not in ((1, 0, 0), (0, 1, 1)):
                raise ValueError(
                    f"{fn}: {where} has {n['B']} B, {n['I']} I and {n['W']} W actions; it needs "
                    f"exactly one B, or exactly one I and one W"
                )
    return {(stage, kind) for kind, stage, _ in counts}


def _execute(
    fn: str, schedule: Ranks, p: int, v: int, cost: dict[str, float], hop: float = 0.0,
    stage_costs: Mapping[tuple[int, str], float] | None = None,
) -> list[list[Event]]:
    """Run every rank's list in order, each action as soon as its rank and inputs are free.

    Start times depend only on the rank's previous end and the inputs' ends, so visiting
    ranks round-robin gives the same times as a global clock would. A :class:`Pair` is
    one event that needs both inputs and delivers both at its end; it costs
    ``cost["F&B"]``, or with ``stage_costs`` and no ``"F&B"`` in ``cost`` its two
    actions' sum. ``stage_costs`` (``(global stage, kind) -> cost``) overrides ``cost``
    for that stage's actions of that kind. An input made on another rank is there
    ``hop`` after its action ends.
    """
    stages, pl = p * v, placement_of(schedule)

    def cost_of(r: int, item: Action | Pair) -> float:
        if not stage_costs:
            return cost["F&B" if isinstance(item, Pair) else item.kind]
        if isinstance(item, Pair) and "F&B" in cost:
            return cost["F&B"]
        return sum(stage_costs.get((a.stage(r, p, pl), a.kind), cost[a.kind]) for a in flat(item))

    done: dict[tuple[str, int, int], float] = {}
    made_on: dict[tuple[str, int, int], int] = {}
    events: list[list[Event]] = [[] for _ in range(p)]
    pos = [0] * p
    free = [0.0] * p

    def needs_of(r: int, item: Action | Pair) -> list[tuple[str, int, int]]:
        return [k for a in flat(item) for k in _deps(a.kind, a.stage(r, p, pl), a.microbatch, stages)]

    moved = True
    while moved:
        moved = False
        for r, actions in enumerate(schedule):
            while pos[r] < len(actions):
                item = actions[pos[r]]
                needs = needs_of(r, item)
                if any(key not in done for key in needs):
                    break
                start = max([free[r]] + [done[key] + (hop if made_on[key] != r else 0.0) for key in needs])
                free[r] = start + cost_of(r, item)
                events[r].append(Event(start, free[r], item))
                for a in flat(item):
                    stage = a.stage(r, p, pl)
                    key = ({"B": "G", "I": "G"}.get(a.kind, a.kind), stage, a.microbatch)
                    done[key], made_on[key] = free[r], r
                    if a.kind == "B":
                        done[("W", stage, a.microbatch)], made_on[("W", stage, a.microbatch)] = free[r], r
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(schedule[r])]
    if stuck:
        lines = []
        for r in stuck:
            item = schedule[r][pos[r]]
            waits = ", ".join(_key_label(k, p, pl) for k in needs_of(r, item) if k not in done)
            lines.append(f"rank {r} at {item} waits for {waits}")
        raise ValueError(f"{fn}: the schedule deadlocks, no rank can move: " + "; ".join(lines))
    return events


def dependencies_ok(schedule: Ranks, *, p: int, v: int, m: int) -> None:
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
    _execute(fn, schedule, p, v, dict.fromkeys((*KINDS, "F&B"), 1.0))


def lane_pairs(schedule: Ranks, *, p: int, v: int, m: int) -> Schedule:
    """``schedule`` with the F and B actions that may run side by side on one rank (two
    cooperative lanes, ``layouts.expert(ep_overlap=True)``) made :class:`Pair` s, and its
    own pairs that may not split into their F then B: the plan the pipeline runner runs
    under ``ep_overlap``, every pair on lanes.

    A pair on lanes receives both inputs before either action starts, and its outputs
    count only from its end: a rank blocked on a receive inside a lane would hold the
    turn. So a pairing is safe when :func:`dependencies_ok` holds with each pair as one
    event, exactly its model of a :class:`Pair`. Candidates, greedily, each kept only if
    the whole schedule still runs: the schedule's own pairs (DualPipeV's F&B), then a B
    followed by an F, then an F followed by a B, each of two different microbatches or
    chunks, ranks in order, each list left to right. The order matters: under 1f1b,
    "B then F" pairs every stage's steady state (``p-r-1`` warm-up forwards: ``m-p+r``
    pairs on rank r), where "F then B" on the first stage would make the last stage's
    pairs wait on themselves. I / W actions (zero bubble) stay alone. Costs one walk per
    candidate: cache it.

    Raises: ``ValueError`` as :func:`dependencies_ok`.

    >>> s = lane_pairs(make("1f1b", p=2, m=4), p=2, v=1, m=4)
    >>> [" ".join(map(str, rank)) for rank in s]
    ['F0.0 F0.1 F0.2&B0.0 F0.3&B0.1 B0.2 B0.3', 'F0.0 F0.1&B0.0 F0.2&B0.1 F0.3&B0.2 B0.3']
    """
    fn = "schedules.lane_pairs"
    _validate(fn, schedule, p, v, m)
    pl = placement_of(schedule)
    costs = dict.fromkeys((*KINDS, "F&B"), 1.0)
    own = [{(a.forward, a.backward) for a in rank if isinstance(a, Pair)} for rank in schedule]
    units: list[list[Action | Pair]] = [[a for item in rank for a in flat(item)] for rank in schedule]

    def runs(candidate: list[list[Action | Pair]]) -> bool:
        try:
            _execute(fn, candidate, p, v, costs)
        except ValueError:
            return False
        return True

    tiers = (lambda r, a, b: (a, b) in own[r],
             lambda r, a, b: a.kind == "B" and b.kind == "F",
             lambda r, a, b: a.kind == "F" and b.kind == "B")
    for wanted in tiers:
        for r in range(p):
            k = 0
            while k + 1 < len(units[r]):
                a, b = units[r][k], units[r][k + 1]
                if (isinstance(a, Action) and isinstance(b, Action) and {a.kind, b.kind} == {"F", "B"}
                        and (a.chunk, a.microbatch) != (b.chunk, b.microbatch) and wanted(r, a, b)):
                    pair = Pair(*((a, b) if a.kind == "F" else (b, a)))
                    trial = [list(rank) for rank in units]
                    trial[r][k:k + 2] = [pair]
                    if runs(Schedule(trial, pl)):
                        units = trial
                k += 1
    return Schedule(units, pl)


def _peak_in_flight(actions: Sequence[Action | Pair]) -> int:
    alive: set[tuple[int, int]] = set()
    peak = 0
    for a in (a for item in actions for a in flat(item)):
        if a.kind == "F":
            alive.add((a.chunk, a.microbatch))
            peak = max(peak, len(alive))
        elif a.kind in ("B", "W"):
            alive.discard((a.chunk, a.microbatch))
    return peak


def simulate(
    schedule: Ranks,
    *,
    p: int,
    v: int,
    m: int,
    f: float = 1.0,
    b: float = 2.0,
    w: float | None = None,
    fb: float | None = None,
    hop: float = 0.0,
    stage_costs: Mapping[tuple[int, str], float] | None = None,
) -> Timeline:
    """Time ``schedule`` event by event: each rank runs its list in order, comm costs
    ``hop`` per hand-over between ranks (0 by default).

    An action starts when its rank is free and its inputs are done (:func:`dependencies_ok`)
    — an input from another rank ``hop`` later.

    - `f`: cost of one ``F``, default 1.0. `b`: cost of one ``B``, default 2.0.
    - `w`: cost of one ``W``, default ``b / 2``; an ``I`` costs ``b - w``.
    - `fb`: cost of one :class:`Pair` (``F&B``), default ``f + b`` (one thread runs
      both; less where one's communication would otherwise show).
    - `hop`: the transport's latency of one hand-over between ranks (an activation or
      a gradient from another rank), default 0; a hand-over within a rank (a V
      schedule's turn, interleaved at p=1) costs nothing. A measured transport latency,
      so that a runner is compared with what its transport allows
      (``benchmarks/pipeline.py`` measures it with bare gloo sends).
    - `stage_costs`: ``{(global stage, kind): cost}`` where stages differ (measured:
      the first stage has no input gradient to compute, the last a loss), overriding
      the uniform cost of that kind there; a Pair then costs its two actions' sum
      unless ``fb`` is given.

    Costs are per action, i.e. per chunk: to compare makespans of ``v`` chunks with
    ``v = 1``, pass ``f / v`` and ``b / v`` (bubble ratios do not change with the scale).

    Raises: ``ValueError`` as :func:`dependencies_ok`, or for costs not ``f > 0``,
    ``b > 0``, ``0 <= w <= b``, ``hop >= 0``, or ``stage_costs`` not a mapping of
    ``(stage in [0, p·v), kind)`` to a cost ``>= 0`` for actions the schedule runs.

    >>> from dtp.schedules import simulate  # the doctest namespace's simulate is dtp.testing's
    >>> t = simulate(make("1f1b", p=4, m=8), p=4, v=1, m=8)
    >>> t.makespan, round(t.bubble_fraction, 4), t.bubble_ratio, t.peak_in_flight
    (33.0, 0.2727, 0.375, (4, 3, 2, 1))
    >>> simulate(make("1f1b", p=4, m=8), p=4, v=1, m=8, hop=0.25).makespan  # 16 hops on its critical path
    37.0
    >>> simulate(make("1f1b", p=2, m=2), p=2, v=1, m=2, stage_costs={(0, "B"): 1.0}).makespan  # vs 9.0
    8.0
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
    given_fb, fb = fb is not None, f + b if fb is None else fb
    if not isinstance(fb, (int, float)) or isinstance(fb, bool) or not fb > 0:
        raise ValueError(f"{fn}: fb (the cost of one F&B pair) must be a number > 0, got {fb!r}")
    if not isinstance(hop, (int, float)) or isinstance(hop, bool) or not hop >= 0:
        raise ValueError(f"{fn}: hop (the latency of one hand-over between ranks) must be a number >= 0, "
                         f"got {hop!r}")
    if stage_costs is not None and not isinstance(stage_costs, Mapping):
        raise ValueError(f"{fn}: stage_costs must be a mapping (stage, kind) -> cost, got {type(stage_costs).__name__}")
    for key, value in (stage_costs or {}).items():
        ok_key = isinstance(key, tuple) and len(key) == 2 and key[1] in KINDS and \
            isinstance(key[0], int) and not isinstance(key[0], bool) and 0 <= key[0] < p * v
        if not ok_key or not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{fn}: stage_costs maps (stage in [0, {p * v}), kind in {KINDS}) to a cost >= 0, "
                             f"got {key!r}: {value!r}")
    runs = _validate(fn, schedule, p, v, m)
    if stage_costs:  # a cost for an action the schedule never runs is a mistake, not a no-op
        if unused := sorted(set(stage_costs) - runs):
            raise ValueError(f"{fn}: stage_costs names actions this schedule does not run: {unused}")
    cost = {"F": f, "B": b, "I": b - w, "W": w}
    if given_fb or not stage_costs:
        cost["F&B"] = fb
    events = _execute(fn, schedule, p, v, cost, hop, stage_costs)
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


def format_schedule(schedule: Ranks, *, p: int) -> str:
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
    check_counts(fn, p, 1, 1)
    # Non-actions are left to _validate, which names them.
    items = [a for rank in schedule for a in rank if isinstance(a, (Action, Pair))]
    actions = [a for item in items for a in flat(item)]
    v = max((a.chunk for a in actions), default=0) + 1
    m = max((a.microbatch for a in actions), default=0) + 1
    _validate(fn, schedule, p, v, m)
    events = _execute(fn, schedule, p, v, dict.fromkeys((*KINDS, "F&B"), 1.0))
    width = max((len(str(a)) for a in items), default=1)
    label = len(f"rank {p - 1}")
    rows = []
    for r, rank in enumerate(events):
        cells = ["."] * int(max((e.end for e in rank), default=0))
        for e in rank:
            cells[int(e.start)] = str(e.action)
        row = " ".join(c.ljust(width) for c in cells).rstrip()
        rows.append(f"{f'rank {r}'.ljust(label)}: {row}".rstrip())
    return "\n".join(rows)
