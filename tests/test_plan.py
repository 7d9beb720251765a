"""dtp.plan against reality: on tiny fp32 configs the predicted bytes per (mesh axis,
collective) equal a real step's comm log exactly (dp, tp with and without SP, cp ring and
Ulysses, ZeRO 1/2/3, microbatches, full recompute; EP's routed all-to-all-v within 10 %,
it depends on the routing), and the predicted per-rank peak bounds the peak the allocator
reached (torch.profiler memory events, frees matched to allocations; fp32 and bf16):
never under it by more than 2 %, never over it by more than 10 %, every pipeline schedule's
ranks included (pp2 × tp2 + SP); a 70B plan takes well
under a second and allocates nothing; the CLI prints the plan and refuses what cannot fit."""

from __future__ import annotations

import contextlib
import gc
import re
import time
from typing import Iterator

import pytest
import torch

import dtp
from dtp.models import llama
from dtp.planning import check_fits
from dtp.testing import run
from measured_step import second_step_comm

# dtp train refuses runs by the plan's peak, so it is checked one-sided: under the
# measured peak by at most MEMORY_UNDER (what the model leaves out, a few hundred bytes on
# these cases), over it by at most MEMORY_OVER (where it bounds rather than models:
# measured 0-4 % over on every case, torch 2.13).
MEMORY_UNDER = 0.02
MEMORY_OVER = 1.10


@contextlib.contextmanager
def _collective_buffers_freed_here(hold_s: float = 0.002) -> Iterator[None]:
    """Make the buffers a collective holds (its input, gloo's receive buffer) die on this
    thread, where the profiler sees the free: after a wait this thread keeps the backend's
    work object ``hold_s`` longer than gloo's worker thread does, so it drops the last
    reference. Without it the worker dropped it in about one rank-run in four (measured,
    torch 2.13): the free went unrecorded and that buffer counted as live for the rest of
    the run (dp4 ZeRO-1: the gradient bucket and the all-to-all receive buffer, 2.78 MB
    measured against 1.92 MB; dp2 × tp2 + SP ZeRO-3 m=2: 2.10 against 1.07)."""
    from dtp import comm

    wait = comm.CommHandle.wait

    def holding(self: comm.CommHandle) -> torch.Tensor:
        work = self._work
        try:
            return wait(self)
        finally:
            if work is not None:
                time.sleep(hold_s)
            del work

    comm.CommHandle.wait = holding
    try:
        yield
    finally:
        comm.CommHandle.wait = wait


def _allocator_peak(prof, window: str) -> int:
    """The most bytes live at once while the ``window`` range ran, counting every
    allocation of the profile (the state's included). Allocations are matched to their
    frees by address; one whose free was never recorded (the run deletes its state at
    the end, so everything should have been freed: the free ran on a thread the profiler
    does not see) counts only at the moment it was made: a lower bound on the peak, so a
    lost free can never make the plan look under."""
    allocation = torch._C._profiler._EventType.Allocation
    events, nodes, span = [], list(prof.profiler.kineto_results.experimental_event_tree()), (0, -1)
    while nodes:
        e = nodes.pop()
        if e.tag == allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size))
        else:
            span = (e.start_time_ns, e.end_time_ns) if e.name == window else span
            nodes.extend(e.children)
    events.sort(key=lambda e: e[0])
    freed, open_, lost = [0] * len(events), {}, set()
    for i, (_, ptr, size) in enumerate(events):
        if size > 0:
            if ptr in open_:  # the address again while still live: its free was not seen
                lost.add(open_[ptr])
            open_[ptr] = i
        elif ptr in open_:
            freed[i] = events[open_.pop(ptr)][2]
    lost.update(open_.values())
    live = peak = 0
    for i, (t, _, size) in enumerate(events):
        live -= freed[i]
        if size > 0:
            live += size
            if span[0] <= t <= span[1]:
                peak = max(peak, live)
            if i in lost:
                live -= size
    return peak


def _peak_and_bytes(kw: dict, model: str, batch: int, seq: int, memory: bool = True) -> tuple[dict, int | None]:
    """One rank: the comm log of a second step (:func:`measured_step.second_step_comm`) and
    the allocator's peak in it (state included). ``memory=False``: the comm log only, peak
    ``None`` — the profiler's memory events made the step about 4× slower (measured, 26
    two-rank cases: 63 s against 14 s), and the bytes do not need them."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if not memory:
        return second_step_comm(kw, model, batch, seq), None
    gc.collect()
    with _collective_buffers_freed_here(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        summary = second_step_comm(kw, model, batch, seq, step_context=lambda step: record_function(f"plan step {step}"))
        gc.collect()  # inside the profile: what is never seen freed after this was freed unseen
    return summary, _allocator_peak(prof, "plan step 1")


def _all(cases, memory: bool = True):
    return [_peak_and_bytes(*c, memory=memory) for c in cases]


# name -> (RunConfig fields, model, batch, seq). Short sequences where the update's new tree
# (or, at dp4 ZeRO-1, the gather of the new buckets) sets the peak, seq 128/256 where the
# loss and the saved activations do.
CASES_2 = {
    "dp2": (dict(dp=2), "tiny", 8, 16),
    "dp2 bf16 mixed": (dict(dp=2, dtype="bfloat16", precision="mixed"), "tiny", 8, 16),  # fp32 gradient reduce
    "dp2 zero1": (dict(dp=2, zero=1), "tiny", 8, 128),
    "dp2 zero2": (dict(dp=2, zero=2), "tiny", 8, 128),
    "dp2 zero3": (dict(dp=2, zero=3), "tiny", 8, 128),
    "dp2 zero1 seq16": (dict(dp=2, zero=1), "tiny", 8, 16),
    "dp2 zero2 seq16": (dict(dp=2, zero=2), "tiny", 8, 16),
    "dp2 zero3 seq16": (dict(dp=2, zero=3), "tiny", 8, 16),
    "dp2 zero3 small buckets": (dict(dp=2, zero=3, bucket_mb=0.05), "tiny", 8, 128),
    "dp2 zero3 small buckets m=2": (dict(dp=2, zero=3, bucket_mb=0.05, microbatches=2), "tiny", 8, 128),
    "dp2 zero1 small buckets": (dict(dp=2, zero=1, bucket_mb=0.05), "tiny", 8, 128),
    "tp2 sp": (dict(tp=2, sp=True), "tiny", 8, 16),
    "tp2 no sp": (dict(tp=2), "tiny", 8, 16),
    "tp2 no sp m=2 full recompute": (dict(tp=2, microbatches=2, recompute="full"), "tiny", 8, 16),
    "tp2 sp m=2 full recompute": (dict(tp=2, sp=True, microbatches=2, recompute="full"), "tiny", 8, 16),
    "tp2 sp m=2 seq256": (dict(tp=2, sp=True, microbatches=2), "tiny", 8, 256),
    "tp2 sp m=2 full recompute seq256": (dict(tp=2, sp=True, microbatches=2, recompute="full"), "tiny", 8, 256),
    "tp2 m=2 full recompute seq256": (dict(tp=2, microbatches=2, recompute="full"), "tiny", 8, 256),
    "cp2 ring": (dict(cp=2), "tiny", 8, 16),
    "cp2 ulysses": (dict(cp=2, cp_algo="ulysses"), "tiny", 8, 16),
    "dp2 seq256": (dict(dp=2), "tiny", 8, 256),
    "dp2 seq256 full recompute": (dict(dp=2, recompute="full"), "tiny", 8, 256),
    "tp2 sp seq256": (dict(tp=2, sp=True), "tiny", 8, 256),
    "cp2 ring seq256": (dict(cp=2), "tiny", 8, 256),
    "dp2 zero3 seq256": (dict(dp=2, zero=3), "tiny", 8, 256),
    "ep2 moe": (dict(ep=2), "tiny-moe", 8, 16),
}
CASES_4 = {
    "dp2 tp2 sp": (dict(dp=2, tp=2, sp=True), "tiny", 8, 16),
    "dp2 tp2 sp zero3 m=2": (dict(dp=2, tp=2, sp=True, zero=3, microbatches=2), "tiny", 8, 16),
    "dp2 cp2 zero2": (dict(dp=2, cp=2, zero=2), "tiny", 8, 128),
    "dp4 zero1": (dict(dp=4, zero=1), "tiny", 8, 16),
    "dp4 zero3 seq128": (dict(dp=4, zero=3), "small", 8, 128),
    # expert_tp at ep 1 keeps an ep axis of 1, and ZeRO buckets the experts apart on it (the
    # plan, without that axis, said 494,848 B of dp all-gather against 482,560 measured).
    "dp2 tp2 expert_tp zero3 small buckets": (dict(dp=2, tp=2, expert_tp=True, zero=3, bucket_mb=0.05), "tiny-moe",
                                              8, 16),
}
# Peak memory only: bf16, where the norms keep fp32 copies of their inputs and the loss an
# fp32 copy of the logits (the plan was 19-30 % under these before it counted them).
MEMORY_CASES_2 = {
    "dp2 bf16 seq256": (dict(dp=2, dtype="bfloat16"), "tiny", 8, 256),
    "dp2 zero1 bf16": (dict(dp=2, zero=1, dtype="bfloat16"), "tiny", 8, 128),
    "dp2 zero3 bf16 seq256": (dict(dp=2, zero=3, dtype="bfloat16"), "tiny", 8, 256),
    "tp2 sp bf16 seq256": (dict(tp=2, sp=True, dtype="bfloat16"), "tiny", 8, 256),
    "tp2 m=2 full recompute bf16 seq256": (dict(tp=2, microbatches=2, recompute="full", dtype="bfloat16"), "tiny", 8,
                                           256),
}


def _measure(memory: bool, *groups: tuple[dict, int]) -> dict[str, tuple[dict, int | None]]:
    # The shared pools, not fresh ones (which cost a restart of every pool, 8 ranks' too,
    # 40-60 s of the suite): what an earlier test left in a worker is not measured, since
    # the peak counts only allocations made inside the profile and the bytes only the
    # records of this comm_log.
    out = {}
    for cases, world in groups:
        out.update(zip(cases, run(_all, list(cases.values()), memory, world_size=world)[0]))
    return out


# Rows whose bytes differ from another row's only in size: the same run at another
# sequence length (ZeRO's traffic is the parameters', the same at any length). They are
# there for the peaks, where past seq 16 the loss and the saved activations set it; their
# bytes are the slow run's, each name's twin here checks the same collectives in the
# default run (1.6 s of the comm logs' 9.4 s on warm pools, measured on torch 2.13).
BYTES_SIZE_TWINS = {
    "dp2 zero1": "dp2 zero1 seq16", "dp2 zero2": "dp2 zero2 seq16", "dp2 zero3": "dp2 zero3 seq16",
    "dp2 zero3 seq256": "dp2 zero3 seq16", "dp2 seq256": "dp2", "tp2 sp seq256": "tp2 sp", "cp2 ring seq256": "cp2 ring",
    "tp2 sp m=2 full recompute seq256": "tp2 sp m=2 full recompute",
    "tp2 m=2 full recompute seq256": "tp2 no sp m=2 full recompute",
}


def _without(cases: dict, names) -> dict:
    return {n: c for n, c in cases.items() if n not in names}


def _only(cases: dict, names) -> dict:
    return {n: c for n, c in cases.items() if n in names}


@pytest.fixture(scope="module")
def measured() -> dict[str, tuple[dict, None]]:
    """Every case's comm log but the size twins' (no profile: the bytes checks are in the
    default run)."""
    return _measure(False, (_without(CASES_2, BYTES_SIZE_TWINS), 2), (_without(CASES_4, BYTES_SIZE_TWINS), 4))


@pytest.fixture(scope="module")
def measured_size_twins() -> dict[str, tuple[dict, None]]:
    """The size twins' comm logs (the slow run's)."""
    return _measure(False, (_only(CASES_2, BYTES_SIZE_TWINS), 2), (_only(CASES_4, BYTES_SIZE_TWINS), 4))


@pytest.fixture(scope="module")
def measured_peaks() -> dict[str, tuple[dict, int]]:
    """Every case's comm log and allocator peak, the bf16 memory cases included."""
    return _measure(True, (CASES_2, 2), (CASES_4, 4), (MEMORY_CASES_2, 2))


def _plan(name: str) -> dtp.planning.Plan:
    kw, model, batch, seq = {**CASES_2, **CASES_4, **MEMORY_CASES_2}[name]
    return dtp.plan(model, batch=batch, seq=seq, **kw)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in BYTES_SIZE_TWINS else n
                                  for n in {**CASES_2, **CASES_4} if not n.startswith("ep")])
def test_predicted_bytes_equal_the_comm_log(request, name):
    measured = request.getfixturevalue("measured_size_twins" if name in BYTES_SIZE_TWINS else "measured")
    assert _plan(name).bytes == measured[name][0], name


def test_each_size_twin_is_its_default_row_at_another_sequence_length():
    for name, twin in BYTES_SIZE_TWINS.items():
        (kw, model, batch, seq), (kw2, model2, batch2, seq2) = {**CASES_2, **CASES_4}[name], CASES_2[twin]
        assert (kw, model, batch) == (kw2, model2, batch2) and seq != seq2 and twin not in BYTES_SIZE_TWINS, name


def test_expert_parallel_bytes_equal_except_routing(measured):
    got, want = _plan("ep2 moe").bytes, measured["ep2 moe"][0]
    routed_got, routed_want = got["ep"].pop("all_to_all_v"), want["ep"].pop("all_to_all_v")
    assert got == want
    # Balanced routing predicted; the real router sends within 10 % of it on random tokens.
    assert routed_want == pytest.approx(routed_got, rel=0.10)


# MoE beside the other token axes: bytes only. The routing statistics are summed over each
# token axis (dp, cp, not only ep's); under tp: tests/test_async_tp.py.
MOE_BYTES_2 = {"moe dp2 m=2 full recompute": (dict(dp=2, microbatches=2, recompute="full"), "tiny-moe", 8, 16),
               "moe cp2": (dict(cp=2), "tiny-moe", 8, 16)}


def _bytes_only(cases):
    return [second_step_comm(*c) for c in cases]


def test_moe_bytes_over_dp_and_cp_equal_the_comm_log():
    measured = run(_bytes_only, list(MOE_BYTES_2.values()), world_size=2)[0]
    for name, got in zip(MOE_BYTES_2, measured):
        assert _plan_of(MOE_BYTES_2[name]).bytes == got, name


# Pipelines: each pipeline rank's bytes, not only the fullest rank's. The V schedules hold
# stages 0 and 2p-1 on rank 0 (the embedding and the head, no block at pp2 on tiny) and
# two middle stages on rank 1, so their ranks' tp bytes differ 4x; dtp train logs rank 0's.
PIPELINE_4 = {name: (dict(pp=2, tp=2, sp=True, pp_schedule=name, microbatches=4), "tiny", 8, 32)
              for name in ("1f1b", "zbv", "dualpipev")}


def _pipeline_bytes(cases) -> list[tuple[int, dict]]:
    """Per case, this rank's pipeline rank and the comm log of one step (a receive is
    logged with 0 bytes sent: dropped, the plan counts what is sent)."""
    out = []
    for kw, model, batch, seq in cases:
        cfg = llama.config(model)
        run_ = dtp.RunConfig(model=model, batch=batch, seq=seq, **kw)
        mesh = dtp.make_mesh(**run_.mesh_axes())
        tok = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
        state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(1e-3), mesh=mesh,
                                      layout=run_.layout(), axes=llama.param_axes(cfg))
        batch_ = dtp.shard_batch({"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}, state)
        with dtp.comm_log() as log:
            state, _ = dtp.train_step(llama.sequential(cfg), state, batch_, clip_norm=1.0,
                                      microbatches=run_.microbatches)
            dtp.wait(state)
        logged = {axis: {k: b for k, b in kinds.items() if b} for axis, kinds in log.summary().items()}
        out.append((mesh.get_local_rank("pp"), logged))
    return out


def test_every_pipeline_rank_sends_what_the_plan_predicts_v_schedules_included():
    measured = run(_pipeline_bytes, list(PIPELINE_4.values()), world_size=4)
    for k, name in enumerate(PIPELINE_4):
        plan = _plan_of(PIPELINE_4[name])
        for rank, (pp_rank, got) in enumerate(r[k] for r in measured):
            assert plan.rank_bytes(pp_rank) == got, f"{name}: global rank {rank}, pipeline rank {pp_rank}"


def _plan_of(case) -> dtp.planning.Plan:
    kw, model, batch, seq = case
    return dtp.plan(model, batch=batch, seq=seq, **kw)


# A measurement, so not in the default run (the bytes checks above are exact and stay):
# `python -m pytest -m slow tests/test_plan.py`. Repeatable to the byte between runs and
# ranks since the collectives' buffers are freed where the profiler sees it (before, one
# case or another came out 10-45 % high in a run: frees on gloo's threads went unrecorded).
@pytest.mark.slow
@pytest.mark.parametrize("name", list({**CASES_2, **CASES_4, **MEMORY_CASES_2}))
def test_predicted_peak_bounds_the_measured(measured_peaks, name):
    plan, peak = _plan(name), measured_peaks[name][1]
    m = plan.worst
    where = (f"{name}: predicted {plan.peak} ({m.moment if m.backward_peak >= m.update_peak else 'update'}), "
             f"measured {peak}")
    assert plan.peak >= peak * (1 - MEMORY_UNDER), where
    assert plan.peak <= peak * MEMORY_OVER, where


# Pipelines' peaks, every schedule, each pipeline rank: the plan walks the rank's own
# action list (dtp.schedules.make) with what each chunk saves, what zero bubble's I keeps
# for W, and a later backward's fresh weight gradients. Before that it spread a rank's
# saved activations evenly over its chunks and counted nothing between I and W: zb-h1
# rank 1 22 % under, zbv 10 %, gpipe 12 %, interleaved 8 %. In the default run the two
# cheapest schedules that were under (interleaved, zb-h1: about 10 s on a warm pool).
PIPELINE_PEAK_4 = {name: (dict(pp=2, tp=2, sp=True, pp_schedule=name, microbatches=4,
                               virtual_stages=2 if name == "interleaved" else 1), "tiny", 8, 32)
                   for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")}
PIPELINE_PEAK_DEFAULT = ("interleaved", "zb-h1")


def _pipeline_peaks(cases) -> list[tuple[int, int]]:
    """Per case, this rank's pipeline rank and its allocator peak in the second step."""
    out = []
    for kw, model, batch, seq in cases:
        mesh = dtp.make_mesh(**dtp.RunConfig(model=model, batch=batch, seq=seq, **kw).mesh_axes())
        out.append((mesh.get_local_rank("pp"), _peak_and_bytes(kw, model, batch, seq)[1]))
    return out


# The V schedules' rank 0 (embedding and head) peaks in the update: 600,360 B (the plan:
# 600,576). It measured 670,248 B in most runs, xfailed, until a step stopped leaving
# reference cycles: optim.map_param_trees' recursive closure kept the step's pipeline Run
# (two 32 KiB tensors among what it held) until Python's cyclic collector ran
# (test_step_overhead checks a step leaves none).
def _check_pipeline_peaks(names) -> None:
    measured = run(_pipeline_peaks, [PIPELINE_PEAK_4[n] for n in names], world_size=4)
    for k, name in enumerate(names):
        plan = _plan_of(PIPELINE_PEAK_4[name])
        for pp_rank, peak in {r[k][0]: r[k][1] for r in measured}.items():
            m = plan.memory[pp_rank]
            moment = m.moment if m.backward_peak >= m.update_peak else "update"
            where = f"{name} pipeline rank {pp_rank}: predicted {m.peak} ({moment}), measured {peak}"
            assert m.peak <= peak * MEMORY_OVER, where
            assert m.peak >= peak * (1 - MEMORY_UNDER), where


def test_predicted_pipeline_peak_bounds_the_measured_interleaved_and_zero_bubble():
    _check_pipeline_peaks(PIPELINE_PEAK_DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in PIPELINE_PEAK_4 if n not in PIPELINE_PEAK_DEFAULT])
def test_predicted_pipeline_peak_bounds_the_measured(name):
    _check_pipeline_peaks((name,))


def _state_at_rest(prefetch: int) -> tuple[int, int]:
    """One rank after two ZeRO-3 steps with ``overlap_param_gather``: bytes of the
    buckets its state holds for the next forward, and of everything it keeps at rest."""
    cfg = llama.config("tiny")
    layout = dtp.layouts.data() + dtp.layouts.zero(3, bucket_mb=0.05, overlap_param_gather=True, prefetch=prefetch)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(1e-3), mesh=dtp.make_mesh(dp=2),
                                  layout=layout, axes=llama.param_axes(cfg))
    tok = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = dtp.shard_batch({"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}, state)
    for _ in range(2):
        state, _ = dtp.train_step(llama.sequential(cfg), state, batch)
    dtp.wait(state)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.strategy.pending.held()}
    rest = {t.to_local().untyped_storage().data_ptr(): t.to_local().untyped_storage().nbytes()
            for t in [*state.strategy.master, *torch.utils._pytree.tree_leaves(state.opt_state)]
            if isinstance(t, torch.Tensor) and t.dim() > 0}
    return sum(held.values()), sum(held.values()) + sum(rest.values())


@pytest.mark.parametrize("prefetch", [1, 2])
def test_plan_counts_zero3_held_gathers_exactly(prefetch):
    """ZeRO-3's next-forward buckets, gathered during the update and held between steps,
    are in the plan's rest to the byte (and the rest with them)."""
    held, rest = run(_state_at_rest, prefetch, world_size=2)[0]
    layout = dtp.layouts.data() + dtp.layouts.zero(3, bucket_mb=0.05, overlap_param_gather=True, prefetch=prefetch)
    m = dtp.plan("tiny", batch=8, seq=16, dp=2, zero=3, bucket_mb=0.05, layout=layout).worst
    assert held > 0 and (m.held, m.rest) == (held, rest)
    assert dtp.plan("tiny", batch=8, seq=16, dp=2, zero=3, bucket_mb=0.05).worst.held == 0  # no overlap: none held


def test_70b_plans_in_well_under_a_second_without_allocating():
    from torch.profiler import ProfilerActivity, profile

    # This thread's CPU time, not wall time: on the shared 2-core machine at load 11 the
    # wall clock passed 0.5 s while the plan itself computed for a fraction of that. A plan
    # first, so that what is timed is planning 70B, not a first call's imports and caches
    # (measured on torch 2.13 in a fresh process: 4.3 s for the first 70B plan, 0.11 s
    # each after; the suite once timed 0.65 s here).
    # The garbage collector is off while timing: in the suite's long-lived process a full
    # collection of its heap once landed inside the plan (0.61 s of CPU, 0.07-0.13 s alone).
    dtp.plan("tiny", batch=8, seq=16, dp=2, tp=2, sp=True, pp=2, microbatches=2, zero=1, recompute="full")
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            t0 = time.thread_time()
            p = dtp.plan("llama3-70b", batch=256, seq=8192, dp=8, tp=8, sp=True, pp=4, microbatches=32, zero=1,
                         recompute="full", dtype="bfloat16")
            seconds = time.thread_time() - t0
    finally:
        gc.enable()
    allocated = sum(e.nbytes() for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.nbytes() > 0)
    assert seconds < 0.5
    assert allocated < 1 << 20  # no parameter: a layer's smallest weight is 8192 × 1024 × 2 bytes
    assert p.params == llama.param_count(llama.config("llama3-70b"))
    # 1f1b bubble (p-1)/(m+p-1)
    assert p.bubble == pytest.approx(3 / 35)


def _split_peaks(kw, batch, seq, split) -> tuple[int, dict, int]:
    """This rank's pipeline rank, its second step's comm log and allocator peak under
    ``layout`` = the run's with ``layer_split``."""
    from torch.profiler import ProfilerActivity, profile, record_function

    run_cfg = dtp.RunConfig(model="tiny", batch=batch, seq=seq, **kw)
    layout = dtp.layouts.data() + dtp.layouts.megatron() + dtp.layouts.pipeline(layer_split=split)
    mesh = dtp.make_mesh(**run_cfg.mesh_axes())
    gc.collect()
    with _collective_buffers_freed_here(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        summary = second_step_comm(kw, "tiny", batch, seq, layout=layout,
                                   step_context=lambda step: record_function(f"plan step {step}"))
        gc.collect()
    logged = {axis: {k: b for k, b in kinds.items() if b} for axis, kinds in summary.items()}  # receives: 0 B sent
    return mesh.get_local_rank("pp"), logged, _allocator_peak(prof, "plan step 1")


def test_a_layer_split_is_planned_as_it_trains():
    """The layout's layer_split (here the embedding alone on pipeline rank 0, both blocks
    and the head on rank 1) decides which rank holds what in the plan, as in training:
    each rank's bytes equal its comm log, its peak within the bounds."""
    kw, split = dict(pp=2, microbatches=2), (1, 3)
    layout = dtp.layouts.data() + dtp.layouts.megatron() + dtp.layouts.pipeline(layer_split=split)
    plan = dtp.plan("tiny", batch=8, seq=64, layout=layout, **kw)
    assert [len(lv) for lv in dtp.planning.target.stage_leaves(plan.target, dtp.planning.target.leaves(
        plan.target))] == [1, 2 * len(llama.block_shapes(llama.config("tiny"), 0)) + 2]
    for pp_rank, got, peak in run(_split_peaks, kw, 8, 64, split, world_size=2):
        assert plan.rank_bytes(pp_rank) == got, pp_rank
        m = plan.memory[pp_rank]
        assert peak * (1 - MEMORY_UNDER) <= m.peak <= peak * MEMORY_OVER, (pp_rank, m.peak, peak)


def test_plan_layout_is_the_cli_layout():
    from dtp.cli import build_parser, validate
    from dtp.cli.loop import build_layout

    argv = ["train", "--dp", "2", "--cp", "2", "--tp", "2", "--sp", "--zero", "2", "--pp", "2", "--microbatches", "2",
            "--batch", "8"]
    args = validate(build_parser().parse_args(argv))
    p = dtp.plan("tiny", batch=8, dp=2, cp=2, tp=2, sp=True, zero=2, pp=2, microbatches=2)
    assert p.target.layout == p.run.layout() == build_layout(args)


def test_megatron_distributed_optimizer_bytes_per_parameter():
    # bf16 parameters, fp32 master and moments split over dp: 6 + 12/dp bytes per parameter
    # (Megatron's distributed optimizer); dtp's fp32 gradient buffer is the "4" of the 6.
    p = dtp.plan("llama2-7b", batch=8, seq=1024, dp=8, zero=1, dtype="bfloat16")
    m, n = p.worst, p.params
    assert (m.params + m.grads + m.optimizer) / n == pytest.approx(6 + 12 / 8, rel=1e-3)


def test_check_fits_refuses_with_the_table():
    p = dtp.plan("llama3-8b", batch=8, seq=4096, dp=1)
    message = check_fits(p, 80.0)
    assert message is not None and "DOES NOT FIT" in message and "parameters" in message
    assert check_fits(p, 80.0, override=True) is None
    assert check_fits(dtp.plan("tiny", batch=8, seq=16), 1.0) is None


@pytest.mark.parametrize("kw, match", [
    (dict(batch=6, dp=4), "divisible by dp"),
    (dict(cp=2, cp_algo="double_ring"), "needs cp_window > 1"),
    (dict(pp=4, microbatches=2), "microbatches"),
    (dict(tp=3), "does not split"),
])
def test_bad_configurations_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        dtp.plan("tiny", **{"seq": 16, **kw})


def test_the_printed_plan_says_what_a_moe_pipeline_sends_beyond_its_rows():
    """Under pp the MoE carry's structure (a pickled tree) is not modelled: ~1 kB a step that
    dtp train's metrics show beyond the rows; the printed plan says so instead of claiming
    the rows are all of it (measured: tiny-moe pp2 m2, 724 B of all-reduce against 220)."""
    from dtp.planning import format_plan

    moe = format_plan(dtp.plan("tiny-moe", batch=8, seq=16, pp=2, microbatches=2))
    dense = format_plan(dtp.plan("tiny", batch=8, seq=16, pp=2, microbatches=2))
    assert "not counted: the MoE carry's structure" in moe and "not counted" not in dense


# Qwen-style attention extras (q/k/v and output biases, per-head q/k norms: every one at
# once): the biases split over tp as their weights' outputs reduce nothing over tp; the
# output bias, on the residual stream, reduces over tp like the block norms (under SP
# only); the q/k norms, applied to heads split over tp, reduce over tp with or without SP.
EXTRAS = dict(qkv_bias=True, o_bias=True, qk_norm=True)
EXTRAS_2 = {"tp2 no sp": (dict(tp=2), "tiny", 8, 16), "tp2 sp": (dict(tp=2, sp=True), "tiny", 8, 16),
            "dp2 zero3 small buckets": (dict(dp=2, zero=3, bucket_mb=0.05), "tiny", 8, 16)}


def _extras_bytes(cases) -> list[dict]:
    return [second_step_comm(*c, **EXTRAS) for c in cases]


def test_attention_extras_bytes_equal_the_comm_log():
    measured = run(_extras_bytes, list(EXTRAS_2.values()), world_size=2)[0]
    for name, got in zip(EXTRAS_2, measured):
        kw, model, batch, seq = EXTRAS_2[name]
        assert dtp.plan(llama.config(model, **EXTRAS), batch=batch, seq=seq, **kw).bytes == got, name


@pytest.mark.parametrize("kw, m", [
    (dict(pp=2), 2), (dict(pp=3), 4), (dict(pp=2, pp_schedule="dualpipev"), 4), (dict(pp=1), 1),
])
def test_the_keyword_plan_takes_dtp_trains_default_microbatches(kw, m):
    # dtp.plan("tiny", pp=2) plans what `dtp train --pp 2` runs (RunConfig's default), not m=1
    # (which 1f1b refuses): the keywords are a RunConfig's, and so is its default.
    assert dtp.plan("tiny", batch=8, seq=16, **kw).run.microbatches == m
    assert dtp.RunConfig(batch=8, seq=16, **kw).microbatches == m



def test_the_backend_decides_zero_s_reduce_scatter_buffers():
    """gloo runs ZeRO's reduce-scatter as an all-to-all whose receive buffers hold whole
    buckets (what the peaks above are measured with); nccl and hccl reduce-scatter in
    place. A GPU shape planned on a CPU machine took gloo's: llama3-8b on dp 8 with full
    recompute, 89.75 GiB instead of 60.13 (the receive buffers are every gradient again)."""
    kw = dict(batch=8, seq=8192, dp=8, zero=1, dtype="bfloat16", recompute="full")
    gloo, nccl = dtp.plan("llama3-8b", **kw), dtp.plan("llama3-8b", backend="nccl", **kw)
    assert dtp.plan("llama3-8b", backend="hccl", **kw).peak == nccl.peak
    grads = nccl.worst.grads
    assert gloo.peak - nccl.peak == pytest.approx(grads, rel=0.02), (gloo.peak, nccl.peak, grads)
    assert "bfloat16, nccl" in dtp.planning.format_plan(nccl).splitlines()[0]
    assert dtp.plan(dtp.RunConfig(model="tiny", dp=4, zero=1), backend="nccl").target.backend == "nccl"
    with pytest.raises(ValueError, match="backend must be one of gloo, nccl, hccl, got 'mpi'"):
        dtp.plan("tiny", backend="mpi")


def test_dtp_plan_and_the_memory_check_plan_for_this_machine_s_backend(monkeypatch, capsys):
    """``dtp plan`` without ``--backend`` and ``dtp train``'s memory check plan for the
    backend a run here would use (a CUDA machine: nccl's in-place reduce-scatter);
    ``--backend`` overrides."""
    import dtp.mesh
    from dtp import cli
    from dtp.cli import flags
    from dtp.cli.plan import train_refusal

    run = ["--model", "llama3-8b", "--dp", "8", "--zero", "1", "--dtype", "bfloat16", "--seq", "8192",
           "--batch", "8", "--recompute", "full", "--memory-gb", "88"]
    refused = {}
    for backend in ("gloo", "nccl"):
        monkeypatch.setattr(dtp.mesh, "detect_device", lambda device=None, b=backend: ("cpu", b))
        assert cli.main(["plan", "--dp", "2", "--zero", "1"]) == 0
        assert capsys.readouterr().out.splitlines()[0].endswith("float32" + (", nccl" if backend == "nccl" else ""))
        refused[backend] = train_refusal(dtp.cli.parse_args(["train", *run]), quiet=True)
    assert refused["gloo"] is not None and "DOES NOT FIT: peak 89.75 GiB" in refused["gloo"]
    assert refused["nccl"] is None
    assert cli.main(["plan", "--dp", "2", "--zero", "1", "--backend", "gloo"]) == 0  # the flag over the machine
    assert capsys.readouterr().out.splitlines()[0].endswith("float32")


def test_a_plan_is_of_a_run_config():
    """The keywords are a RunConfig's (its checks, said as the plan's), a plan's target holds
    that run, and a target plans again as it is; Setup and layout_for say what replaced them."""
    run_ = dtp.RunConfig(model="tiny", batch=8, seq=16, dp=2, zero=1)
    p = dtp.plan(run_, backend="nccl")
    assert p.run is run_ and p.target.backend == "nccl" and p.target.layout == run_.layout()
    assert dtp.plan(p.target).memory == p.memory
    assert dtp.plan("tiny", batch=8, seq=16, dp=2, zero=1, backend="nccl").memory == p.memory
    with pytest.raises(TypeError, match=r"a RunConfig is the whole run .*\['batch'\]"):
        dtp.plan(run_, batch=16)
    with pytest.raises(TypeError, match="a Target is the whole plan"):
        dtp.plan(p.target, backend="gloo")
    with pytest.raises(ValueError, match=r"^dtp\.plan: sp \(sequence parallel\) .* it needs tp > 1"):
        dtp.plan("tiny", sp=True)
    # MoE fields beside a LlamaConfig set its own, as beside a preset
    moe = dtp.plan(llama.config("tiny-moe"), batch=8, seq=16, num_experts=8)
    assert moe.target.cfg.num_experts == 8
    assert moe.params == dtp.plan("tiny-moe", batch=8, seq=16, num_experts=8).params
    for name, says in (("Setup", "plan a dtp.RunConfig"), ("layout_for", "RunConfig(...).layout()")):
        assert name not in dtp.planning.__all__
        match = re.escape(f"dtp.planning.{name} was removed: ") + ".*" + re.escape(says)
        with pytest.raises(AttributeError, match=match):
            getattr(dtp.planning, name)
