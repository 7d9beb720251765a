"""The layouts :func:`dtp.planning.search.search` ranks, as :class:`dtp.RunConfig` fields: the
meshes of ``N`` devices and each axis's options, ZeRO's and recompute's variants, and a
layout's words (:func:`describe`) and ``dtp train`` command (:func:`command`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from .. import schedules
from ..config import RunConfig

__all__ = ["LAYOUT_FIELDS", "describe", "command"]


#: The fields a layout sets (the search's); the rest of the run is the caller's.
LAYOUT_FIELDS = ("pp", "pp_schedule", "virtual_stages", "dp", "ep", "cp", "tp", "sp", "async_tp", "cp_algo",
                  "cp_window", "ulysses_degree", "zero", "overlap_grad_reduce", "overlap_param_gather",
                  "microbatches", "recompute", "ep_overlap")


def describe(run: RunConfig) -> str:
    """A layout in a few words.

    >>> describe(RunConfig(dp=2, tp=2, sp=True, zero=1, overlap_grad_reduce=True, microbatches=2))
    'dp2 tp2 sp zero1 ogr mb2'
    """
    parts = [f"{a}{getattr(run, a)}" for a in ("pp", "dp", "ep", "cp", "tp") if getattr(run, a) > 1]
    if run.pp > 1:
        parts.append(run.pp_schedule + (f" v{run.virtual_stages}" if run.pp_schedule == "interleaved" else ""))
    if run.cp > 1:
        parts.append(run.cp_algo or "ring")
        if run.cp_window:
            parts.append(f"w{run.cp_window}")
        if run.ulysses_degree:
            parts.append(f"u{run.ulysses_degree}")
    parts += [name for name in ("sp", "async_tp", "ep_overlap") if getattr(run, name)]
    if run.zero:
        parts.append(f"zero{run.zero}")
        parts += [short for name, short in (("overlap_grad_reduce", "ogr"), ("overlap_param_gather", "opg"))
                  if getattr(run, name)]
    if run.microbatches > 1:
        parts.append(f"mb{run.microbatches}")
    if run.recompute != "none":
        parts.append(f"recompute {run.recompute}")
    return " ".join(parts) or "one device"


def command(run: RunConfig) -> str:
    """The ``dtp train`` command of ``run``: the flags of the fields it sets away from their
    defaults (under torchrun, as ``python -m dtp train ...`` on every node).

    >>> command(RunConfig(model="llama3-8b", dp=2, tp=4, sp=True, batch=16, seq=2048))
    'dtp train --dp 2 --tp 4 --sp --model llama3-8b --batch 16 --seq 2048'
    """
    from ..config import flag_of  # the flags are the fields' (dtp.config.fields)

    default = RunConfig()
    out = ["dtp train"]
    for f in dataclasses.fields(run):
        value = getattr(run, f.name)
        if value == getattr(default, f.name) and f.name != "microbatches" or value is None:
            continue
        if f.name == "microbatches" and value == 1:
            continue
        if isinstance(value, bool):
            out.append(flag_of(f.name) if value else f"--no-{flag_of(f.name)[2:]}")
        else:
            out += [flag_of(f.name), str(value)]
    return " ".join(out)


# ----------------------------------------------------------------------------- the space


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(n: int, moe: bool) -> Iterator[dict[str, int]]:
    for pp in _divisors(n):
        for cp in _divisors(n // pp):
            for tp in _divisors(n // (pp * cp)):
                rest = n // (pp * cp * tp)
                for ep in (_divisors(rest) if moe else [1]):
                    yield {"pp": pp, "dp": rest // ep, "ep": ep, "cp": cp, "tp": tp}


def _tp_options(tp: int) -> list[dict[str, Any]]:
    if tp == 1:
        return [{}]
    return [{"sp": False}, {"sp": True}, {"sp": True, "async_tp": True}]


def _cp_options(cp: int) -> list[dict[str, Any]]:
    if cp == 1:
        return [{}]
    inner = [d for d in _divisors(cp) if 1 < d < cp]
    return ([{"cp_algo": "ring"}, {"cp_algo": "ulysses"}] + [{"cp_algo": "double_ring", "cp_window": w} for w in inner]
            + [{"cp_algo": "hybrid", "ulysses_degree": u} for u in inner])


def _pp_options(pp: int, n_layers: int) -> list[dict[str, Any]]:
    if pp == 1:
        return [{}]
    out: list[dict[str, Any]] = []
    for name in schedules.SCHEDULES:
        if name == "interleaved":  # every chunk count the layers allow (embedding and head are layers)
            out += [{"pp_schedule": name, "virtual_stages": v} for v in range(2, (n_layers + 2) // pp + 1)]
        else:
            out.append({"pp_schedule": name})
    return out


def _ep_options(ep: int) -> list[dict[str, Any]]:
    return [{}] if ep == 1 else [{}, {"ep_overlap": True}]


# The variants a group is timed over: ZeRO stages with their overlaps (most hidden first,
# the order dominance is checked in), and the recompute policies, least recompute first.
_RECOMPUTE = ("none", "selective", "full")


def _zero_options(dp: int) -> list[dict[str, Any]]:
    if dp == 1:
        return [{"zero": 0}]
    out = [{"zero": 0}]
    for stage in (1, 2, 3):
        for ogr, opg in ((True, True), (True, False), (False, True), (False, False)):
            out.append({"zero": stage, "overlap_grad_reduce": ogr, "overlap_param_gather": opg})
    return out


def _hides_more(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether ZeRO variant ``a`` is ``b`` with at least its overlaps."""
    return a["zero"] == b["zero"] and all(a.get(k, False) >= b.get(k, False)
                                          for k in ("overlap_grad_reduce", "overlap_param_gather"))


def _options(axes: dict[str, int]) -> Iterator[dict[str, Any]]:
    """The tp, cp and ep options of a mesh (its pipeline's are a group's)."""
    for t in _tp_options(axes["tp"]):
        for c in _cp_options(axes["cp"]):
            for e in _ep_options(axes["ep"]):
                yield {**t, **c, **e}
