"""The plan as a table, and the verdict against a memory budget.

Plain text (no dependency): one block of memory terms for the fullest rank, one row per
(mesh axis, collective) with bytes per step (under a pipeline one table per pipeline rank
that sends differently, each named with the stages it holds), the pipeline bubble, then
the verdict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .target import rank_stages

if TYPE_CHECKING:
    from . import Plan
    from .traffic import Traffic

__all__ = ["format_plan", "check_fits", "format_bytes", "format_count"]

GIB = 2**30


def format_count(n: int) -> str:
    """A parameter count, as ``dtp train`` and ``dtp plan`` print it.

    >>> format_count(106_816), format_count(1_234_567), format_count(70_553_706_496)
    ('106.8k', '1.2M', '70.6B')
    """
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def format_bytes(n: float) -> str:
    """Bytes in binary units.

    >>> format_bytes(1536), format_bytes(3 * 2**30)
    ('1.50 KiB', '3.00 GiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _describe(p: "Plan") -> str:
    s = p.target
    parts = [f"{a}={n}" for a, n in s.axes.items() if n > 1]
    if s.run.sp:  # RunConfig: only with tp > 1
        parts.append("sp async_tp" if s.run.async_tp else "sp")
    ctx = s.context  # the layout's: what the plan modelled, not the keywords
    if ctx is not None:
        parts.append(f"cp_algo={ctx.algo}")
        if ctx.algo == "hybrid":
            parts.append(f"ulysses_degree={ctx.ulysses_degree}")
        if ctx.window > 1:
            parts.append(f"cp_window={ctx.window}")
    if s.run.pp > 1:
        parts.append(f"{s.run.pp_schedule}" + (f" v={s.virtual_stages}" if s.virtual_stages > 1 else ""))
    if s.run.zero:
        parts.append(f"zero={s.run.zero}")
    parts += [f"microbatches={s.run.microbatches}", f"recompute={s.run.recompute}", s.run.dtype]
    parts += [s.backend] if s.backend != "gloo" else []
    ranks = f"{s.world} rank{'s' * (s.world > 1)}"
    shape = f"batch {s.run.batch} × seq {s.run.seq} on {ranks}"
    return f"{s.name} ({format_count(p.params)} params), {shape}: " + ", ".join(parts)


def format_plan(p: "Plan", memory_gb: float | None = None, time: Sequence[str] = ()) -> str:
    """The plan as a plain-text table, ``time``'s lines (:meth:`~dtp.planning.StepTime.lines`)
    after it, and the verdict last when ``memory_gb`` is given.

    >>> from dtp.planning import plan
    >>> print(format_plan(plan("tiny", batch=8, seq=16, dp=2), memory_gb=1))  # doctest: +ELLIPSIS
    tiny (106.8k params), batch 8 × seq 16 on 2 ranks: dp=2, microbatches=1, recompute=none, float32
    memory per rank (pipeline rank 0)
      parameters                            417.25 KiB
    ...
    fits: peak 3.67 MiB of 1.00 GiB (0.4 %)
    """
    m, s = p.worst, p.target
    rows = [("parameters", m.params), ("optimizer state", m.optimizer), ("gradients", m.grads),
            (f"activations ({m.in_flight} microbatch{'es' if m.in_flight > 1 else ''} in flight)",
             m.activations), ("working set", m.working)]
    if m.held:  # ZeRO-3's next-forward gathers (overlap_param_gather), held between steps
        rows.insert(2, ("gathered for the next forward", m.held))
    if s.run.pp == 1:
        lines = [_describe(p), "memory per rank (pipeline rank 0)"]
    else:  # the fullest pipeline rank; which stages it holds depends on the schedule's map
        lines = [_describe(p), f"memory per rank (the fullest: pipeline rank {m.stage} of {s.run.pp}, "
                               f"{rank_stages(s, m.stage)})"]
    lines += [f"  {name:<36}{format_bytes(v):>12}" for name, v in rows]
    lines.append(f"  {'peak in backward':<36}{format_bytes(m.backward_peak):>12}")
    lines.append(f"  {'peak in update':<36}{format_bytes(m.update_peak):>12}   (new tree beside the old)")
    lines.append(f"  {'peak':<36}{format_bytes(m.peak):>12}")
    if s.run.pp > 1:
        lines.append("  peak per pipeline rank: " + ", ".join(f"{x.stage}: {format_bytes(x.peak)}" for x in p.memory))
    # Pipeline ranks send different bytes where they hold different stages (the head's
    # cross-entropy, a V schedule's rank 0 with no block): one table per distinct rank,
    # named, so that dtp train's metrics (global rank 0: pipeline rank 0) can be compared.
    groups: dict[tuple, list[int]] = {}
    for r, rows_r in enumerate(p.traffic):
        groups.setdefault(tuple(sorted((x.axis, x.kind, x.what, x.times, x.each) for x in rows_r)), []).append(r)
    for ranks in groups.values():
        if s.run.pp == 1:
            lines.append("bytes sent per step (this rank)")
        elif len(ranks) == s.run.pp:
            lines.append("bytes sent per step (every pipeline rank)")
        else:
            where = "; ".join(f"{r} ({rank_stages(s, r)})" for r in ranks)
            logged = ": what dtp train's metrics log" if 0 in ranks else ""
            lines.append(f"bytes sent per step, pipeline rank{'s' * (len(ranks) > 1)} {where}{logged}")
        lines += _bytes_table(p.traffic[ranks[0]])
    if s.run.pp > 1 and s.cfg.num_experts:
        # Measured (tiny-moe, pp2, m 2): 504 B of all-reduce and ~1 kB of sends a step beyond the rows.
        lines.append("  (not counted: the MoE carry's structure, a pickled tree sent beside its first microbatch "
                     "and all-reduced once for the aux: about a kB a step)")
    if p.run.pp > 1:
        lines.append(f"pipeline bubble {100 * p.bubble:.1f} % of rank time ({p.run.pp_schedule}, "
                     f"p={p.run.pp}, v={p.target.virtual_stages}, m={p.run.microbatches})")
    lines += time
    if memory_gb is not None:
        lines.append(verdict(p, memory_gb))
    return "\n".join(lines)


def _bytes_table(traffic: "tuple[Traffic, ...]") -> list[str]:
    """One line per (axis, collective, what) pattern (ZeRO lists a row per bucket)."""
    grouped: dict[tuple[str, str, str], list[int]] = {}
    for r in traffic:
        g = grouped.setdefault((r.axis, r.kind, r.what), [0, 0])
        g[0] += r.times
        g[1] += r.total
    # Wide enough for the cp sub-axes the comm log names (cp_outer, cp_inner, ...).
    width = max([6] + [len(axis) + 2 for axis, _, _ in grouped])
    lines = [f"  {'axis':<{width}}{'collective':<16}{'bytes':>12}  what"]
    if not grouped:
        lines.append("  (none: no mesh axis of more than one rank)")
    for (axis, kind, what), (times, total) in sorted(grouped.items()):
        lines.append(f"  {axis:<{width}}{kind:<16}{format_bytes(total):>12}  {what} ×{times}")
    return lines


def verdict(p: "Plan", memory_gb: float) -> str:
    """One line: fits or does not, with the peak against the budget."""
    share = p.peak / (memory_gb * GIB)
    word = "fits" if share <= 1 else "DOES NOT FIT"
    return f"{word}: peak {format_bytes(p.peak)} of {format_bytes(memory_gb * GIB)} ({100 * share:.1f} %)"


def check_fits(p: "Plan", memory_gb: float, override: bool = False) -> str | None:
    """``None`` when the plan fits ``memory_gb`` GiB per rank (or ``override``); else the
    message ``dtp train`` refuses with: the plan's table and the verdict.

    >>> from dtp.planning import plan
    >>> check_fits(plan("tiny", batch=8, seq=16), 1.0) is None
    True
    >>> print(check_fits(plan("llama3-8b", batch=8, seq=4096), 80.0).splitlines()[-1])  # doctest: +ELLIPSIS
    DOES NOT FIT: peak ... of 80.00 GiB (...); ... --memory-gb ... or --ignore-memory-check
    """
    if override or p.fits(memory_gb):
        return None
    return (format_plan(p, memory_gb) + "; shard more (--tp, --pp, --zero, --recompute full), raise "
            "--memory-gb if the machine has more, or --ignore-memory-check")
