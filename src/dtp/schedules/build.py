"""The schedules' action lists: :func:`make` and the rules :func:`check` (no torch)."""

from __future__ import annotations

from . import v as v_shape
from .actions import SCHEDULES, V_SCHEDULES, Action, Schedule, chunks_per_rank, is_int, placement

__all__ = ["check", "make", "forward_only", "check_counts", "least_microbatches", "fewest_microbatches",
           "default_microbatches"]


def check_counts(fn: str, p: object, v: object, m: object) -> None:
    """``ValueError`` from ``fn`` unless ``p``, ``v``, ``m`` are ints >= 1."""
    for name, value in (("p", p), ("v", v), ("m", m)):
        if not is_int(value) or value < 1:
            raise ValueError(
                f"{fn}: {name} must be an int >= 1 (p pipeline ranks, v virtual chunks "
                f"per rank, m microbatches), got {name}={value!r}"
            )


def least_microbatches(name: str, p: int) -> int:
    """The fewest microbatches schedule ``name`` runs on ``p`` ranks with every rank busy at
    once: ``p`` (what 1f1b, interleaved, zb-h1 and zbv need in flight; gpipe runs fewer, but
    with idle ranks), ``2p`` for dualpipev (one per stage of its V). ``dtp train --pp``'s
    default ``--microbatches``; the bubble shrinks as (p - 1) / m with more.

    >>> least_microbatches("1f1b", 4), least_microbatches("dualpipev", 2), least_microbatches("gpipe", 2)
    (4, 4, 2)
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedules: unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    check_counts("schedules", p, 1, 1)
    return 2 * p if name == "dualpipev" else p


def fewest_microbatches(name: str, p: int) -> int:
    """The fewest microbatches schedule ``name`` runs on ``p`` ranks at all (:func:`check`'s
    minimum): :func:`least_microbatches`, but 1 for gpipe, which runs any count with ranks
    idle.

    >>> fewest_microbatches("gpipe", 4), fewest_microbatches("1f1b", 4)
    (1, 4)
    """
    return 1 if name == "gpipe" else least_microbatches(name, p)


def default_microbatches(name: str, p: int, v: int, batch: int, data: int, *, times: int = 1) -> int:
    """``--microbatches``' default (``dtp train`` and :func:`dtp.plan` alike) for a batch of
    ``batch`` rows over ``data`` data-parallel ranks (dp × ep), ``times`` 2 with
    ``--ep-overlap`` (it pairs one microbatch's all-to-all with another's compute).

    Without a pipeline (``p`` 1, or a schedule name that is refused elsewhere): ``times``.
    Under one: the fewest that keep every stage busy (:func:`least_microbatches`, ``times``
    that: at the fewest, 1f1b's first rank runs no F beside a B for ``--ep-overlap`` to
    pair), or the next count up to twice that which the schedule runs (``v``: its
    ``virtual_stages``) and which splits each rank's rows evenly; else the fewest, which
    the divisibility check then refuses by name (a batch of 7 rows is not cut in 7).

    >>> default_microbatches("1f1b", 1, 1, 8, 1), default_microbatches("1f1b", 2, 1, 8, 1)
    (1, 2)
    >>> default_microbatches("1f1b", 3, 1, 8, 1), default_microbatches("1f1b", 2, 1, 7, 1)
    (4, 2)
    """
    if p == 1 or name not in SCHEDULES:
        return times
    least = least_microbatches(name, p) * times
    rows = batch // data if batch % data == 0 else 0
    for m in range(least, min(rows, 2 * least) + 1):
        try:
            check(name, p=p, v=chunks_per_rank(name, v), m=m)
        except ValueError:
            continue
        if rows % m == 0:
            return m
    return least


def check(name: str, *, p: int, v: int, m: int) -> None:
    """Check that schedule ``name`` can run ``m`` microbatches on ``p`` ranks of ``v`` chunks.

    - `name`: one of :data:`SCHEDULES`.
    - `p`, `v`, `m`: pipeline ranks, virtual chunks per rank, microbatches; ints >= 1.

    Raises: ``ValueError`` naming the numbers and what is valid: an unknown name; ``v > 1``
    except for interleaved, interleaved with ``v < 2``, ``v != 2`` for zbv and dualpipev;
    ``m < p`` for 1f1b, interleaved, zb-h1 and zbv (they need ``p`` microbatches in
    flight), ``m < 2p`` for dualpipev; interleaved with ``m`` not a multiple of ``p``
    (Megatron's rule). gpipe runs any ``m >= 1``.

    >>> check("1f1b", p=4, v=1, m=8)
    >>> check("1f1b", p=4, v=1, m=2)
    Traceback (most recent call last):
    ...
    ValueError: schedules: '1f1b' needs at least p=4 microbatches in flight, got m=2; use m >= 4, ...
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedules: unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    check_counts("schedules", p, v, m)
    if name in V_SCHEDULES:
        if v != 2:
            raise ValueError(
                f"schedules: {name!r} holds two chunks per rank (a V: stages r and 2p-1-r), got v={v}; "
                f"use v=2 (dtp.schedules.chunks_per_rank)"
            )
    elif name != "interleaved" and v > 1:
        raise ValueError(
            f"schedules: {name!r} runs one chunk per rank, got v={v}; use v=1, or "
            f"'interleaved' for v >= 2"
        )
    if name == "interleaved" and v < 2:
        raise ValueError(
            f"schedules: 'interleaved' needs v >= 2 virtual chunks per rank, got v={v}; "
            f"for one chunk per rank use '1f1b'"
        )
    # Steady-state schedules keep p microbatches in flight to fill the pipe (with fewer
    # torchtitan hangs; dtp refuses up front); gpipe runs any count, ranks idle.
    least = fewest_microbatches(name, p)
    if m < least and name == "dualpipev":
        raise ValueError(
            f"schedules: 'dualpipev' needs at least 2p={least} microbatches (one per stage of its V), "
            f"got m={m}; use m >= {least}, or 'zbv'"
        )
    if m < least:
        raise ValueError(
            f"schedules: {name!r} needs at least p={least} microbatches in flight, got m={m}; "
            f"use m >= {least}, or the 'gpipe' schedule"
        )
    if name == "interleaved" and m % p:
        below, above = m - m % p, m - m % p + p
        raise ValueError(
            f"schedules: 'interleaved' needs m to be a multiple of p={p} (Megatron's rule: "
            f"microbatches go p at a time through each chunk), got m={m}; use m={below} "
            f"or m={above}"
        )


def make(name: str, *, p: int, v: int = 1, m: int) -> Schedule:
    """The action lists of schedule ``name``, one per pipeline rank ``0..p-1``.

    - `name`: one of :data:`SCHEDULES` (module docstring: the table of schedules).
    - `p`: pipeline ranks; `v`: virtual chunks per rank, default 1; `m`: microbatches.

    gpipe runs all forwards, then all backwards in microbatch order ``0..m-1``. 1f1b
    and zb-h1 warm up with ``p-r-1`` forwards on rank ``r``; interleaved follows
    Megatron-core. zb-h1 splits every backward into ``I`` and ``W``. zbv and dualpipev
    (``v = 2``, placement ``"v"``) are :mod:`dtp.schedules.v`'s.

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
    elif name in V_SCHEDULES:
        ranks = [getattr(v_shape, name)(r, p, m) for r in range(p)]
    else:
        ranks = [_one_f_one_b(r, p, m, zero_bubble=name == "zb-h1") for r in range(p)]
    return Schedule(ranks, placement(name))


def forward_only(name: str, *, p: int, v: int = 1, m: int) -> Schedule:
    """An evaluation's schedule under ``name``'s stage map: each rank's forwards only,
    chunk by chunk, microbatches ``0..m-1`` (sends never block, so no order deadlocks;
    any ``m >= 1``). Not a training schedule: :func:`dependencies_ok` wants backwards.

    Raises: ``ValueError`` for an unknown name or counts not ints >= 1.

    >>> forward_only("zbv", p=2, v=2, m=2)[1]
    (Action(kind='F', chunk=0, microbatch=0), Action(kind='F', chunk=0, microbatch=1), \
Action(kind='F', chunk=1, microbatch=0), Action(kind='F', chunk=1, microbatch=1))
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedules: unknown schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    check_counts("schedules.forward_only", p, v, m)
    return Schedule([[Action("F", c, i) for c in range(v) for i in range(m)] for _ in range(p)], placement(name))


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
