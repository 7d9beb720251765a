"""Pipeline actions and the stage-to-rank map: what a schedule is made of (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["SCHEDULES", "V_SCHEDULES", "PLACEMENTS", "KINDS", "Action", "Pair", "Schedule", "placement",
           "chunks_per_rank", "global_stage", "stage_owner", "flat", "placement_of", "is_int"]

#: The schedule names :func:`make` knows.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
#: The schedules whose ranks hold two chunks in a V (placement ``"v"``).
V_SCHEDULES = ("zbv", "dualpipev")
#: Stage-to-rank maps: ``"loop"`` (round-robin) and ``"v"``.
PLACEMENTS = ("loop", "v")
#: Action kinds: forward, full backward, input-grad, weight-grad.
KINDS = ("F", "B", "I", "W")


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
        if self.kind not in KINDS:
            raise ValueError(f"schedules.Action: kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("chunk", "microbatch"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"schedules.Action: {name} must be an int >= 0, got {value!r}")

    def stage(self, rank: int, p: int, placement: str = "loop") -> int:
        """The global stage of this action on ``rank`` of ``p`` (:func:`global_stage`)."""
        return global_stage(self.chunk, rank, p, placement)

    def __str__(self) -> str:
        return f"{self.kind}{self.chunk}.{self.microbatch}"


@dataclass(frozen=True)
class Pair:
    """DualPipeV's ``F&B``: ``forward`` (an ``F``) and ``backward`` (a ``B``) of two
    microbatches on one rank, run back to back with their transfers posted together
    (the forward's send is in flight while the backward computes, and both inputs were
    on the wire during the action before). One event in :func:`simulate` (cost ``fb``).

    Raises: ``ValueError`` unless ``forward`` is an ``F`` and ``backward`` a ``B``.

    >>> str(Pair(Action("F", 0, 3), Action("B", 1, 1)))
    'F0.3&B1.1'
    """

    forward: Action
    backward: Action

    def __post_init__(self) -> None:
        if not (isinstance(self.forward, Action) and self.forward.kind == "F"
                and isinstance(self.backward, Action) and self.backward.kind == "B"):
            raise ValueError(f"schedules.Pair: needs an F action and a B action, got {self.forward!r}, "
                             f"{self.backward!r}")

    def __str__(self) -> str:
        return f"{self.forward}&{self.backward}"


def flat(item: "Action | Pair") -> tuple[Action, ...]:
    """The actions of one list item: the action, or a pair's forward then backward."""
    return (item.forward, item.backward) if isinstance(item, Pair) else (item,)


class Schedule(tuple):
    """One action list per rank (a tuple of tuples of :class:`Action` / :class:`Pair`)
    and the stage-to-rank map they run under, ``placement`` (:data:`PLACEMENTS`): what
    :func:`make` returns. A plain tuple of lists is read with placement ``"loop"``.

    >>> from dtp.schedules import make
    >>> s = make("zbv", p=2, v=2, m=2)
    >>> s.placement, s.stages(0), s.owner(3)
    ('v', (0, 3), (0, 1))
    """

    placement: str

    def __new__(cls, ranks: Sequence[Sequence["Action | Pair"]], placement: str = "loop") -> "Schedule":
        if placement not in PLACEMENTS:
            raise ValueError(f"schedules.Schedule: placement must be one of {PLACEMENTS}, got {placement!r}")
        out = super().__new__(cls, (tuple(rank) for rank in ranks))
        out.placement = placement
        return out

    def stages(self, rank: int) -> tuple[int, ...]:
        """The global stages ``rank`` holds, chunk order."""
        chunks = 1 + max((a.chunk for item in self[rank] for a in flat(item)), default=0)
        return tuple(global_stage(c, rank, len(self), self.placement) for c in range(chunks))

    def owner(self, stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` holding global ``stage`` (:func:`stage_owner`)."""
        return stage_owner(stage, len(self), self.placement)


def placement(name: str) -> str:
    """The stage-to-rank map schedule ``name`` runs under: ``"v"`` for :data:`V_SCHEDULES`,
    else ``"loop"``.

    >>> placement("dualpipev"), placement("interleaved")
    ('v', 'loop')
    """
    return "v" if name in V_SCHEDULES else "loop"


def chunks_per_rank(name: str, v: int) -> int:
    """The chunks per rank schedule ``name`` runs with ``virtual_stages=v``: a V schedule
    holds two (``v`` 1, the default, reads as 2), the others ``v``.

    >>> chunks_per_rank("zbv", 1), chunks_per_rank("interleaved", 3)
    (2, 3)
    """
    return 2 if name in V_SCHEDULES and v == 1 else v


def placement_of(schedule: Sequence) -> str:
    """A :class:`Schedule`'s placement; ``"loop"`` for plain lists."""
    return getattr(schedule, "placement", "loop")


def global_stage(chunk: int, rank: int, p: int, placement: str = "loop") -> int:
    """The stage-to-rank map, the one place it is written. ``"loop"``: chunk ``c`` of
    rank ``r`` of ``p`` is global stage ``c·p + r`` (Megatron's round-robin: rank ``r``
    holds stages ``r, r+p, ..., r+(v-1)p``). ``"v"`` (two chunks): chunk 0 is stage
    ``r``, chunk 1 stage ``2p-1-r``.

    >>> [global_stage(c, 1, 4) for c in range(2)], stage_owner(5, 4)
    ([1, 5], (1, 1))
    >>> [global_stage(c, 1, 4, "v") for c in range(2)], stage_owner(5, 4, "v")
    ([1, 6], (2, 1))
    """
    if placement == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def stage_owner(stage: int, p: int, placement: str = "loop") -> tuple[int, int]:
    """``(rank, chunk)`` holding global ``stage``: the inverse of :func:`global_stage`."""
    if placement == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def is_int(x: object) -> bool:
    """An int and not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)
