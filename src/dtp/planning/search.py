"""The fastest layout for a model on ``N`` devices: :func:`search` (``dtp plan --search``).

The space is every layout ``dtp train`` can run on ``N`` devices: the mesh ``pp × dp × ep ×
cp × tp = N`` (ep only for an MoE model); tp with or without sequence parallel and async
TP; cp with each algorithm (double-ring at each window, hybrid at each Ulysses degree);
each pipeline schedule with its virtual stages; ZeRO 0-3 with each of its overlaps;
every microbatch count that splits a data rank's rows; each recompute policy; under ep,
EP overlap. Each layout is a :class:`dtp.RunConfig`, checked by the run's own checks and
``dtp train``'s preflight (:func:`dtp.cli.plan.preflight`, given as ``preflight``), planned by :func:`dtp.plan`
and timed by :meth:`dtp.planning.Plan.time`: the search ranks what the plan predicts and
nothing else.

It is exact with respect to that model, and fast by rules that hold in it:

- **lower bounds, best first.** A mesh with its tp and cp options and a microbatch count
  has a bound no pipeline option beats: the model's compute over the pipeline ranks, or
  one microbatch's way forward through every stage and its input gradient back, whichever
  is longer, plus the smallest optimizer step. A schedule's group has a tighter one: its
  ranks' busy time after the forwards each waits for, and the step's communication
  (:func:`.time.busy_bound`, no simulation, no memory plan). Entries are opened in the order of their bounds and the
  search stops when the next bound is above the ``show``-th best time found.
- **dominance within a group.** Recompute only adds time, and ZeRO's overlaps only hide
  it: of the variants that fit, one with less recompute and a superset of the overlaps
  is never slower, so the others are not timed (they are counted as dominated).
- **memory last.** A group's memory is planned only when it is opened; a mesh whose
  parameters' state alone cannot fit is pruned before.
- **memoised splits.** Schedules with the same chunks per rank and placement (gpipe, 1f1b,
  zb-h1; zbv, dualpipev) hold the same layers on the same ranks: their stages, traffic,
  compute and bound are computed once, and a stage's ZeRO buckets once for every variant.

A layout whose fullest rank does not fit ``memory_gb`` is pruned after its memory plan
(counted as ``memory``); one a check refuses is counted by the flag the refusal names.

>>> r = search("tiny", devices=4, batch=8, seq=64, hardware="h100-sxm", show=3)
>>> len(r.top), r.top[0].time.total <= r.top[-1].time.total, r.space >= r.planned
(3, True, True)
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import re
import time as clock
from dataclasses import dataclass
from typing import Any, Callable

from .. import schedules
from ..config import RunConfig, flag_names
from ..models import llama
from .hardware import Hardware, hardware as read_hardware
from .memory import memory
from .target import DTYPES, Leaf, Target, leaves, stage_leaves
from .time import StepTime, busy_bound, optimizer_seconds, stage_works, step_time
from .space import (_RECOMPUTE, LAYOUT_FIELDS, _divisors, _hides_more, _meshes, _options, _pp_options,
                    _zero_options, command, describe)
from .traffic import Traffic, traffic

__all__ = ["Candidate", "SearchResult", "search", "command", "describe", "LAYOUT_FIELDS"]

GIB = 2**30

#: A check of one layout (the run, its plan's target, the model) that raises ValueError.
Preflight = Callable[[RunConfig, Target, llama.LlamaConfig], None]


@dataclass(frozen=True)
class Candidate:
    """One planned layout: the run, its predicted step and its fullest rank's peak (bytes)."""

    run: RunConfig
    time: StepTime
    peak: int


@dataclass(frozen=True)
class SearchResult:
    """What :func:`search` found.

    - `top`: the fastest layouts that fit, fastest first.
    - `space`: layouts in the space before any pruning.
    - `planned`: layouts whose memory was planned; `timed`: of them, those timed in full.
    - `pruned`: layouts not planned or not kept, by reason (``memory``, ``dominated``,
      ``bound``, or ``refused: <flag>``).
    - `seconds`: the search's wall time.
    """

    top: tuple[Candidate, ...]
    space: int
    planned: int
    timed: int
    pruned: dict[str, int]
    seconds: float
    devices: int
    hardware: str
    memory_gb: float

    def lines(self) -> list[str]:
        """What ``dtp plan --search`` prints."""
        out = [f"search: {self.space:,} layouts of {self.devices} devices on {self.hardware} "
               f"({self.memory_gb:g} GiB each); {self.planned:,} planned, {self.timed:,} timed in full, "
               f"{self.seconds:.1f} s",
               "  pruned: " + ", ".join(f"{k} {v:,}" for k, v in sorted(self.pruned.items(), key=lambda kv: -kv[1]))]
        for i, c in enumerate(self.top, 1):
            t = c.time
            out.append(f"{i:>2}. {_ms(t.total)}  MFU {100 * t.mfu:.1f} %  peak {c.peak / GIB:.1f} GiB  "
                       f"{describe(c.run)}")
            out += ["      " + line.strip() for line in t.lines()[1:]]
            out.append(f"      {command(c.run)}")
        if not self.top:
            out.append("no layout fits: raise --memory-gb, or add devices")
        return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


# ----------------------------------------------------------------------------- the search


_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def _reason(error: Exception) -> str:
    """The constraint a refusal names: a flag its reason names, else the last its subject
    names (``--pp 2 --microbatches 3: schedules: ...`` is about ``--microbatches``), else
    its first words.

    >>> _reason(ValueError("--model tiny on the mesh tp=3: heads=4 is not divisible by tp=3 (--tp splits)"))
    'refused: --tp'
    >>> _reason(ValueError("--pp 2 --microbatches 3: schedules: 'interleaved' needs m a multiple of p=2"))
    'refused: --microbatches'
    """
    text = str(error)
    subject, _, why = text.partition(": ")
    found = _FLAG.findall(why) or _FLAG.findall(subject)[-1:]
    return f"refused: {found[0]}" if found else f"refused: {' '.join(text.split()[:3])}"


def _key(run: RunConfig, *drop: str) -> tuple:
    """A layout's fields (the rest of a search's runs are the same) less ``drop``."""
    return tuple(getattr(run, f) for f in LAYOUT_FIELDS if f not in drop)


def _split(s: Target) -> tuple:
    """What the pipeline's schedule changes in a plan's stages, traffic and compute: its
    chunks per rank and their placement (gpipe, 1f1b and zb-h1 plan alike)."""
    return (s.virtual_stages, schedules.placement(s.run.pp_schedule) if s.run.pp > 1 else None)


def _merged(rows: list[Traffic]) -> tuple[Traffic, ...]:
    """``rows`` with the records of one collective (axis, kind, purpose, bytes) summed into
    one: the time model costs each record as ``times`` of the same collective, and a 70B
    stage's full ZeRO buckets are dozens of equal records."""
    times: dict[tuple[str, str, str, int], int] = {}
    for r in rows:
        key = (r.axis, r.kind, r.what, r.each)
        times[key] = times.get(key, 0) + r.times
    return tuple(Traffic(axis, kind, what, n, each) for (axis, kind, what, each), n in times.items())


# A variant's ZeRO fields and recompute: what the per-split memos below leave out of their
# keys where the memoised figure does not depend on them.
_VARIANT = ("zero", "overlap_grad_reduce", "overlap_param_gather", "recompute")


class _Search:
    """One search's state: the bests so far, the counts, and the memoised stages, traffic,
    compute and bounds (a schedule's groups share them with the others of its split)."""

    def __init__(self, cfg: llama.LlamaConfig, name: str, hw: Hardware, budget: float, show: int,
                 backend: str, base: dict[str, Any], held: dict[str, Any], preflight: Preflight | None) -> None:
        self.cfg, self.name, self.hw, self.budget, self.show, self.backend = cfg, name, hw, budget, show, backend
        self.preflight: Preflight = preflight or (lambda run, target, cfg: None)
        self.base, self.held = base, held
        self.pruned: dict[str, int] = {}
        self.space = self.planned = self.timed = 0
        self.best: list[tuple[float, int, Candidate]] = []  # the show best as a max-heap (by -time)
        self.itemsize = DTYPES[base.get("dtype", "bfloat16")].itemsize
        # the memos, each keyed by what its figure depends on (the comments at their uses)
        self.leaves: dict[tuple, list[Leaf]] = {}
        self.stages: dict[tuple, list[list[Leaf]]] = {}
        self.mesh_works: dict[tuple, tuple[float, float, int] | Exception] = {}
        self.states: dict[tuple, float] = {}
        self.split_rows: dict[tuple, tuple] = {}
        self.split_works: dict[tuple, list] = {}
        self.bounds: dict[tuple, float] = {}
        self.layouts: dict[RunConfig, Any] = {}

    def prune(self, reason: str, n: int) -> None:
        self.pruned[reason] = self.pruned.get(reason, 0) + n

    def holds(self, fields_: dict[str, Any]) -> bool:
        """Whether ``fields_`` keep the fields the caller fixed."""
        return all(self.held.get(k, v) == v for k, v in fields_.items())

    @property
    def worst_kept(self) -> float:
        return -self.best[0][0] if len(self.best) == self.show else math.inf

    def variant(self, s: Target, check: bool = True, **fields_: Any) -> Target:
        """``s`` with ``fields_`` changed, checked by the run (and, with ``check``, by the
        preflight: ZeRO's options against a pipeline's rules); ``ValueError`` if refused."""
        with flag_names():
            run = dataclasses.replace(s.run, **fields_)
        if run not in self.layouts:  # a layout costs ~0.5 ms to build; runs repeat across a split's schedules
            self.layouts[run] = run.layout()
        t = dataclasses.replace(s, run=run, layout=self.layouts[run])
        if check:
            self.preflight(run, t, self.cfg)
        return t

    def rows(self, t: Target, per_stage: list[list[Leaf]]) -> tuple:
        """The stages' traffic: the same for each schedule of a split."""
        key = (_key(t.run, "pp_schedule", "virtual_stages"), _split(t))
        if key not in self.split_rows:
            self.split_rows[key] = tuple(_merged(traffic(t, lv, i)) for i, lv in enumerate(per_stage))
        return self.split_rows[key]

    def computes(self, t: Target, per_stage: list[list[Leaf]]) -> list:
        """The stages' compute: a split's, whatever its ZeRO and recompute."""
        key = (_key(t.run, "pp_schedule", "virtual_stages", *_VARIANT), _split(t))
        if key not in self.split_works:
            self.split_works[key] = stage_works(t, per_stage, self.hw)
        return self.split_works[key]

    # ---- the coarse bound: a mesh, its tp and cp options and the microbatch count

    def coarse(self, axes: dict[str, int], opts: dict[str, Any], m: int) -> float | Exception:
        """A bound on every pipeline option of ``axes`` and ``opts`` at ``m`` microbatches:
        the whole model's compute per microbatch (the stages' compute sums to it) over the
        pipeline ranks or one microbatch's way through them, whichever is longer, and the
        optimizer step of the parameters over them. A refusal, or
        a ``MemoryError`` where even the parameters' state cannot fit."""
        rows = self.base["batch"] // (axes["dp"] * axes["ep"] * m)
        # the compute's key: the leaves' (ep, cp, tp, sp), the tokens and the gradient
        # accumulation's (rows, m) and attention's blocks (the cp algorithm's ring)
        key = (axes["ep"], axes["cp"], axes["tp"], opts.get("sp", False), rows, m,
               *(opts.get(k) for k in ("cp_algo", "cp_window", "ulysses_degree")))
        if key not in self.mesh_works:
            try:  # the pipeline folded away: one rank's compute is the whole model's
                with flag_names():
                    run = RunConfig(**{**self.base, **axes, **opts, "pp": 1, "microbatches": m})
                s = Target.of(run, cfg=self.cfg, backend=self.backend, name=self.name)
                self.preflight(run, s, self.cfg)
                if key[:4] not in self.leaves:
                    self.leaves[key[:4]] = leaves(s)
                every = self.leaves[key[:4]]
                w = stage_works(s, [every], self.hw)[0]
                self.mesh_works[key] = (w.forward, w.backward, sum(x.numel for x in every))
            except ValueError as e:
                self.mesh_works[key] = e
        work = self.mesh_works[key]
        if isinstance(work, Exception):
            return work
        forward, backward, n_params = work
        # The fullest pipeline rank holds at least the mean of the stages' parameters and
        # their optimizer state (ZeRO pads each bucket to dp: 10 % of slack for it).
        if 0.9 * self.state_bytes(axes, opts) / axes["pp"] > self.budget:
            return MemoryError()
        # the optimizer's largest rank holds at least the mean of the stages' parameters
        shards = axes["pp"] * (axes["dp"] if axes["dp"] > 1 else 1)
        # Busy: the pipeline ranks share m microbatches of the model's compute. A chain: no
        # schedule ends before microbatch 0 went forward through every stage and its input
        # gradient back (a backward's I is half of its B in the model; a B without the split).
        pipeline = m * (forward + backward) / axes["pp"]
        if axes["pp"] > 1:
            pipeline = max(pipeline, forward + backward / 2)
        return pipeline + optimizer_seconds(n_params / shards, self.itemsize, self.hw)

    def state_bytes(self, axes: dict[str, int], opts: dict[str, Any]) -> float:
        """The fewest bytes of parameters and optimizer state any ZeRO stage leaves a rank
        holding every parameter of the mesh without its pipeline (a memory plan's
        ``params + optimizer``, which its peak holds): a function of the leaves' local
        shapes (tp's and ep's: cp and SP split no weight) and dp. Of the stages, ZeRO-3
        (dp > 1: it shards all three) and no ZeRO (dp = 1) hold the least
        (tests/test_search.py checks it against every stage)."""
        key = (axes["ep"], axes["tp"], axes["dp"])
        if key not in self.states:
            every = self.leaves[(axes["ep"], axes["cp"], axes["tp"], opts.get("sp", False))]
            with flag_names():
                run = RunConfig(**{**self.base, **axes, **opts, "pp": 1, "recompute": "full",
                                   "zero": 3 if axes["dp"] > 1 else 0})
            mem = memory(Target.of(run, cfg=self.cfg, backend=self.backend, name=self.name), every)
            self.states[key] = mem.params + mem.optimizer
        return self.states[key]

    # ---- the fine bound: one pipeline option

    def group(self, axes: dict[str, int], opts: dict[str, Any], m: int) -> tuple[float, Target, list] | Exception:
        """One schedule's group: its bound (:meth:`bound`), its target and its stages."""
        fields_ = {**self.base, **axes, **opts, "microbatches": m}
        try:
            with flag_names():
                run = RunConfig(**fields_)
            s = Target.of(run, cfg=self.cfg, backend=self.backend, name=self.name)
            self.preflight(run, s, self.cfg)
        except ValueError as e:
            return e
        key = (axes["ep"], axes["cp"], axes["tp"], opts.get("sp", False), run.pp, *_split(s))
        if key not in self.stages:
            # A leaf's local shape is the tp, cp, ep and SP split's (the pipeline cuts the list)
            try:  # the plan's own refusals (a stage without a layer), where no preflight said them
                if key[:4] not in self.leaves:
                    self.leaves[key[:4]] = leaves(s)
                # tuples: the ZeRO buckets of a tuple of leaves are memoised (traffic.zero_buckets)
                self.stages[key] = [tuple(lv) for lv in stage_leaves(s, self.leaves[key[:4]])]
            except ValueError as e:
                self.stages[key] = e  # type: ignore[assignment]
        per_stage = self.stages[key]
        if isinstance(per_stage, Exception):
            return per_stage
        return self.bound(s, per_stage), s, per_stage

    def bound(self, s: Target, per_stage: list[list[Leaf]]) -> float:
        """No variant of group ``s`` is faster: the fastest of its ZeRO stages without
        recompute (recompute only adds), each with the most overlaps the plan accepts
        (overlaps only hide: one another accepted variant hides more than is skipped), by
        :func:`.time.busy_bound`, which does not simulate the schedule: the same for each
        schedule of a split. Over every variant the run accepts, not only those the
        preflight does (a bound over more layouts is still a bound), and without a memory
        plan (the expensive part, left to the groups this does not prune)."""
        key = (_key(s.run, "pp_schedule", "virtual_stages", *_VARIANT), _split(s))
        if key not in self.bounds:
            best, accepted = math.inf, []
            for zopts in _zero_options(s.run.dp):  # each stage's most hidden first
                if any(_hides_more(z, zopts) for z in accepted):
                    continue
                try:
                    t = self.variant(s, check=False, **zopts, recompute="none")
                except ValueError:  # refused (the plan's pipeline rules): not a member
                    continue
                accepted.append(zopts)
                best = min(best, busy_bound(t, per_stage, self.rows(t, per_stage), self.hw,
                                            self.computes(t, per_stage)))
            self.bounds[key] = best
        return self.bounds[key]

    # ---- the variants of a group: ZeRO's and recompute

    def variants(self, s: Target, per_stage: list[list[Leaf]]) -> None:
        """Plan and time the ZeRO and recompute variants of group ``s`` that fit and that
        no other variant that fits dominates."""
        plans: dict[tuple, tuple[Target, int] | Exception] = {}

        def planned(zopts: dict[str, Any], rc: str) -> tuple[Target, int] | Exception:
            key = (*sorted(zopts.items()), rc)
            if key not in plans:
                try:
                    t = self.variant(s, **zopts, recompute=rc)
                    self.planned += 1
                    plans[key] = (t, max(memory(t, lv, i).peak for i, lv in enumerate(per_stage)))
                except ValueError as e:
                    plans[key] = e
            return plans[key]

        # The most frugal variants first (full recompute, each ZeRO stage without the
        # overlaps, which only hold more): where none fits, no variant does.
        stages = sorted({z["zero"] for z in _zero_options(s.run.dp)})
        frugal = [planned({"zero": z, **({"overlap_grad_reduce": False, "overlap_param_gather": False} if z else {})},
                          "full") for z in stages]
        if all(isinstance(p, Exception) or p[1] > self.budget for p in frugal):
            self.prune("memory", len(_zero_options(s.run.dp)) * len(_RECOMPUTE))
            return
        kept: list[tuple[dict[str, Any], int]] = []  # (ZeRO variant, recompute index) timed
        for zopts in _zero_options(s.run.dp):
            if not self.holds(zopts):
                continue
            for ri, rc in enumerate(_RECOMPUTE):
                if not self.holds({"recompute": rc}):
                    continue
                if any(_hides_more(z, zopts) and r <= ri for z, r in kept):
                    self.prune("dominated", len(_RECOMPUTE) - ri)
                    break
                got = planned(zopts, rc)
                if isinstance(got, Exception):
                    self.prune(_reason(got), 1)
                    continue
                t, peak = got
                if peak > self.budget:
                    self.prune("memory", 1)
                    continue
                step = step_time(t, per_stage, self.rows(t, per_stage), self.hw, self.computes(t, per_stage))
                self.timed += 1
                kept.append((zopts, ri))
                entry = (-step.total, -self.timed, Candidate(t.run, step, peak))
                if len(self.best) < self.show:
                    heapq.heappush(self.best, entry)
                elif step.total < self.worst_kept:
                    heapq.heapreplace(self.best, entry)
                self.prune("dominated", len(_RECOMPUTE) - ri - 1)  # more recompute than a fit: never faster
                break


def search(model: str | llama.LlamaConfig = "llama3-8b", *, devices: int, batch: int, seq: int,
           hardware: Hardware | str, memory_gb: float | None = None, show: int = 10, backend: str = "nccl",
           preflight: Preflight | None = None, **fixed: Any) -> SearchResult:
    """The ``show`` fastest layouts of ``model`` on ``devices`` devices of ``hardware`` that
    fit ``memory_gb`` GiB a device (default: the chip's memory), by :meth:`Plan.time`
    (module docstring: the space, and why the search is exact and fast).

    - `model`: a preset name or a :class:`~dtp.models.llama.LlamaConfig`.
    - `batch`, `seq`: the global batch (sequences) and sequence length.
    - `preflight`: a check every layout must pass beyond the run's and the plan's own,
      raising ``ValueError`` (``dtp plan --search`` passes ``dtp train``'s shape checks,
      :func:`dtp.cli.plan.preflight`, so that each pick is one ``dtp train`` starts).
    - `fixed`: other :class:`dtp.RunConfig` fields every layout keeps (``dtype`` defaults to
      ``"bfloat16"``); a layout field given here is held, not searched.

    >>> r = search("tiny", devices=2, batch=4, seq=32, hardware="a100-80gb", show=2)
    >>> [describe(c.run) for c in r.top]      # tiny: two pipeline stages send less than dp's all-reduce
    ['pp2 zb-h1 mb2', 'pp2 gpipe mb2']
    >>> search("tiny", devices=0, batch=4, seq=32, hardware="a100-80gb")
    Traceback (most recent call last):
    ...
    ValueError: dtp.planning.search: devices must be >= 1, got 0
    """
    start = clock.perf_counter()
    if devices < 1:
        raise ValueError(f"dtp.planning.search: devices must be >= 1, got {devices}")
    if show < 1:
        raise ValueError(f"dtp.planning.search: show must be >= 1, got {show}")
    hw = read_hardware(hardware) if isinstance(hardware, str) else hardware
    budget = (hw.chip.memory / GIB if memory_gb is None else memory_gb) * GIB
    fixed = {"dtype": "bfloat16", **fixed}
    cfg = llama.config(model) if isinstance(model, str) else model
    base = {k: v for k, v in fixed.items() if k not in LAYOUT_FIELDS}
    base.update(batch=batch, seq=seq, **({"model": model} if isinstance(model, str) else {}))
    st = _Search(cfg, model if isinstance(model, str) else "custom", hw, budget, show, backend, base,
                 {k: fixed[k] for k in LAYOUT_FIELDS if k in fixed}, preflight)
    n_layers = llama.n_sequential_layers(cfg) - 2
    per_group = lambda dp: len(_zero_options(dp)) * len(_RECOMPUTE)  # noqa: E731
    # The heap: (bound, order, coarse entry or a group). A coarse entry stands for its
    # pipeline options, each a group of ZeRO and recompute variants.
    heap: list[tuple[float, int, tuple]] = []
    for axes in _meshes(devices, bool(cfg.num_experts)):
        if not st.holds(axes):
            continue
        data = axes["dp"] * axes["ep"]
        counts = _divisors(batch // data) if batch % data == 0 else []
        pp_opts = [o for o in _pp_options(axes["pp"], n_layers) if st.holds(o)]
        for opts in _options(axes):
            if not st.holds(opts):
                continue
            n = len(pp_opts) * per_group(axes["dp"])
            if not counts:
                st.space += n
                st.prune("refused: --batch", n)
            for m in counts:
                st.space += n
                if not st.holds({"microbatches": m}):
                    continue
                bound = st.coarse(axes, {k: v for k, v in opts.items() if k != "ep_overlap"}, m)
                if isinstance(bound, Exception):
                    st.prune("memory" if isinstance(bound, MemoryError) else _reason(bound), n)
                    continue
                heap.append((bound, len(heap), ("coarse", axes, opts, m, pp_opts)))
    heapq.heapify(heap)
    order = len(heap)
    while heap:
        bound, _, entry = heapq.heappop(heap)
        if bound >= st.worst_kept:
            for _, _, rest in [(bound, 0, entry), *heap]:
                st.prune("bound", len(rest[4]) * per_group(rest[1]["dp"]) if rest[0] == "coarse"
                         else per_group(rest[1].run.dp))
            break
        if entry[0] == "coarse":
            _, axes, opts, m, pp_opts = entry
            for p_opts in pp_opts:
                got = st.group(axes, {**opts, **p_opts}, m)
                if isinstance(got, Exception):
                    st.prune("memory" if isinstance(got, MemoryError) else _reason(got), per_group(axes["dp"]))
                    continue
                order += 1
                heapq.heappush(heap, (got[0], order, ("group", got[1], got[2])))
        else:
            st.variants(entry[1], entry[2])
    top = tuple(c for _, _, c in sorted(st.best, key=lambda b: (-b[0], -b[1])))
    return SearchResult(top, st.space, st.planned, st.timed, st.pruned, clock.perf_counter() - start, devices,
                        hw.name, budget / GIB)
