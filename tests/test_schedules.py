"""dtp.schedules: every schedule is deadlock-free, has the published bubble, and refuses bad input.

The published bubbles, at ideal costs (per action; V schedules' per chunk), each rank's
idle time ``makespan - busy``: 1F1B ``(p-1)(F+B)``, ZB-H1 ``(p-1)(F+B-2W)``, DualPipeV
``(PP/2-1)(F&B+B-3W)`` with DeepSeek's ``PP = 2p`` stages, ZB-V ``(p-1)·max(F, F+I-2W)``
(the paper's ``(p-1)(F+I-2W)`` down to the last rank's unavoidable start-up).

Pure Python, no ranks: :func:`dependencies_ok` proves each generated schedule runs
(one F and one B, or one I and one W, per stage and microbatch, in an order every rank
can follow with blocking receives); :func:`simulate` measures the bubble against the
papers' formulas and the activation peaks; :func:`check`'s table pins every message.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtp.schedules import (
    SCHEDULES,
    V_SCHEDULES,
    Action,
    Pair,
    Schedule,
    chunks_per_rank,
    global_stage,
    stage_owner,
    check,
    dependencies_ok,
    format_schedule,
    lane_pairs,
    make,
    simulate,
)
from dtp.schedules.actions import flat


def _valid_cases(name: str, max_p: int = 8, max_m: int = 16):
    """Every (p, v, m) with p <= 8, m <= 16 that check() accepts for ``name``."""
    for p in range(1, max_p + 1):
        for v in (2, 3) if name == "interleaved" else (chunks_per_rank(name, 1),):
            for m in range(1, max_m + 1):
                try:
                    check(name, p=p, v=v, m=m)
                except ValueError:
                    continue
                yield p, v, m


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_satisfies_its_dependencies(name):
    cases = list(_valid_cases(name))
    assert cases, name
    for p, v, m in cases:
        schedule = make(name, p=p, v=v, m=m)
        assert len(schedule) == p, (name, p, v, m)
        dependencies_ok(schedule, p=p, v=v, m=m)


def test_valid_ranges_are_the_documented_ones():
    assert len(list(_valid_cases("gpipe"))) == 8 * 16
    # 1f1b and zb-h1: m >= p.
    assert len(list(_valid_cases("1f1b"))) == sum(17 - p for p in range(1, 9))
    assert list(_valid_cases("zb-h1")) == list(_valid_cases("1f1b"))
    # interleaved: m a multiple of p, v in (2, 3).
    assert len(list(_valid_cases("interleaved"))) == 2 * sum(16 // p for p in range(1, 9))


def test_zb_h1_splits_every_backward_and_runs_w_after_i():
    for p, v, m in _valid_cases("zb-h1"):
        for r, actions in enumerate(make("zb-h1", p=p, m=m)):
            kinds = [a.kind for a in actions]
            assert "B" not in kinds
            assert kinds.count("F") == kinds.count("I") == kinds.count("W") == m
            seen_i = set()
            for a in actions:
                if a.kind == "I":
                    seen_i.add(a.microbatch)
                if a.kind == "W":
                    assert a.microbatch in seen_i, (p, m, r, a)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(name):
    for p, v, m in _valid_cases(name):
        t = simulate(make(name, p=p, m=m), p=p, v=v, m=m, f=1.0, b=2.0)
        assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), abs=1e-9), (p, m)
        assert t.bubble_ratio == pytest.approx((p - 1) / m, abs=1e-9), (p, m)
        assert t.makespan == pytest.approx(3.0 * (m + p - 1)), (p, m)


def test_interleaved_bubble_is_p_minus_1_over_v_m():
    for p, v, m in _valid_cases("interleaved"):
        t = simulate(make("interleaved", p=p, v=v, m=m), p=p, v=v, m=m)
        assert t.bubble_ratio == pytest.approx((p - 1) / (v * m), abs=1e-9), (p, v, m)


def test_zb_h1_bubble_is_a_third_of_1f1b_at_equal_costs():
    # f = I = W = 1: b = 2, w = 1.
    for p, v, m in _valid_cases("zb-h1"):
        zb = simulate(make("zb-h1", p=p, m=m), p=p, v=1, m=m, f=1.0, b=2.0, w=1.0)
        one = simulate(make("1f1b", p=p, m=m), p=p, v=1, m=m, f=1.0, b=2.0)
        assert zb.bubble_ratio == pytest.approx((p - 1) / (3 * m), abs=1e-9), (p, m)
        if p > 1:
            assert zb.bubble_ratio < one.bubble_ratio, (p, m)
            assert zb.makespan < one.makespan, (p, m)


def test_activation_peaks():
    for p, v, m in _valid_cases("1f1b"):
        peaks = simulate(make("1f1b", p=p, m=m), p=p, v=1, m=m).peak_in_flight
        assert peaks == tuple(p - r for r in range(p)), (p, m)
        # zb-h1 holds back r weight-grads on rank r: 1f1b's rank-0 peak everywhere.
        peaks = simulate(make("zb-h1", p=p, m=m), p=p, v=1, m=m).peak_in_flight
        assert peaks == (p,) * p, (p, m)
    for p, v, m in _valid_cases("gpipe"):
        assert simulate(make("gpipe", p=p, m=m), p=p, v=1, m=m).peak_in_flight == (m,) * p


def test_interleaved_follows_megatron_warmup():
    p, v, m = 4, 2, 8
    for r, actions in enumerate(make("interleaved", p=p, v=v, m=m)):
        first_b = next(i for i, a in enumerate(actions) if a.kind == "B")
        # The warm-up forwards, then one more forward before the first backward.
        assert first_b == (p - r - 1) * 2 + (v - 1) * p + 1, r
        forwards = [a for a in actions if a.kind == "F"]
        # Microbatches go p at a time through each chunk.
        assert [(a.chunk, a.microbatch) for a in forwards[:8]] == [
            (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3),
        ]
        backwards = [a for a in actions if a.kind == "B"]
        assert [(a.chunk, a.microbatch) for a in backwards[:4]] == [(1, 0), (1, 1), (1, 2), (1, 3)]


def test_p4_m8_numbers():
    p, m = 4, 8
    got = {}
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)):
        t = simulate(make(name, p=p, v=v, m=m), p=p, v=v, m=m)
        got[name] = (round(t.bubble_fraction, 4), round(t.bubble_ratio, 4), t.peak_in_flight)
    assert got == {
        "gpipe": (0.2727, 0.375, (8, 8, 8, 8)),
        "1f1b": (0.2727, 0.375, (4, 3, 2, 1)),
        "interleaved": (0.1579, 0.1875, (11, 9, 7, 5)),
        "zb-h1": (0.1111, 0.125, (4, 4, 4, 4)),
    }


def test_simulate_times_follow_the_costs():
    t = simulate(make("gpipe", p=2, m=2), p=2, v=1, m=2, f=1.0, b=3.0)
    assert [(e.start, e.end, str(e.action)) for e in t.events[1]] == [
        (1.0, 2.0, "F0.0"), (2.0, 3.0, "F0.1"), (3.0, 6.0, "B0.0"), (6.0, 9.0, "B0.1"),
    ]
    assert t.makespan == 12.0 and t.busy == (8.0, 8.0)
    zb = simulate(make("zb-h1", p=1, m=1), p=1, v=1, m=1, f=1.0, b=2.0, w=0.5)
    assert [(e.end - e.start, e.action.kind) for e in zb.events[0]] == [(1.0, "F"), (1.5, "I"), (0.5, "W")]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2),
                                    ("dualpipev", 2)])
def test_simulate_stage_costs_override_per_stage(name, v):
    # Every stage given the uniform costs: the same timeline as the scalar costs.
    s, p, m = make(name, p=2, v=v, m=4), 2, 4
    runs = {(a.stage(r, p, s.placement), a.kind) for r, rank in enumerate(s) for item in rank for a in flat(item)}
    uniform = {(st, k): {"F": 1.0, "B": 3.0, "I": 2.0, "W": 1.0}[k] for st, k in runs}
    assert simulate(s, p=p, v=v, m=m, f=1.0, b=3.0, w=1.0, stage_costs=uniform) == \
        simulate(s, p=p, v=v, m=m, f=1.0, b=3.0, w=1.0)
    # One stage's forward slower: its rank's events of that stage take that long, the
    # makespan grows, nothing else changes cost.
    slow = simulate(s, p=p, v=v, m=m, stage_costs={(1, "F"): 2.5})
    durations = {(a.kind, a.stage(r, p, s.placement)): e.end - e.start
                 for r, rank in enumerate(slow.events) for e in rank for a in flat(e.action)
                 if not isinstance(e.action, Pair)}
    assert durations[("F", 1)] == 2.5 and durations[("F", 0)] == 1.0
    assert slow.makespan > simulate(s, p=p, v=v, m=m).makespan


def test_simulate_stage_costs_1f1b_p2():
    s = make("1f1b", p=2, m=2)
    assert simulate(s, p=2, v=1, m=2).makespan == 9.0
    assert simulate(s, p=2, v=1, m=2, stage_costs={(0, "B"): 1.0}).makespan == 8.0  # the first stage's B cheaper
    assert simulate(s, p=2, v=1, m=2, stage_costs={(1, "F"): 3.0}).makespan == 13.0
    with pytest.raises(ValueError, match=r"stage_costs maps \(stage in \[0, 2\), kind in .*got \(2, 'F'\): 1\.0"):
        simulate(s, p=2, v=1, m=2, stage_costs={(2, "F"): 1.0})
    with pytest.raises(ValueError, match=r"stage_costs maps .*got \(0, 'F'\): -1"):
        simulate(s, p=2, v=1, m=2, stage_costs={(0, "F"): -1})
    with pytest.raises(ValueError, match=r"stage_costs maps .*got \(True, 'F'\)"):
        simulate(s, p=2, v=1, m=2, stage_costs={(True, "F"): 1.0})
    with pytest.raises(ValueError, match=r"stage_costs must be a mapping"):
        simulate(s, p=2, v=1, m=2, stage_costs=[((0, "F"), 1.0)])
    # zb-h1 runs I and W, never B: a B cost is a mistake, not silently unused.
    with pytest.raises(ValueError, match=r"does not run: \[\(0, 'B'\)\]"):
        simulate(make("zb-h1", p=2, m=2), p=2, v=1, m=2, stage_costs={(0, "B"): 1.0})


def test_simulate_pair_costs_its_stages_unless_fb_is_given():
    s, p, v, m = make("dualpipev", p=2, v=2, m=4), 2, 2, 4
    slow_f = {(st, "F"): 1.5 for st in range(p * v)}
    pairs = [e for rank in simulate(s, p=p, v=v, m=m, stage_costs=slow_f).events for e in rank
             if isinstance(e.action, Pair)]
    assert pairs and all(e.end - e.start == 1.5 + 2.0 for e in pairs)  # F at its stage cost, B uniform
    given = [e for rank in simulate(s, p=p, v=v, m=m, fb=2.5, stage_costs=slow_f).events for e in rank
             if isinstance(e.action, Pair)]
    assert all(e.end - e.start == 2.5 for e in given)


def test_simulate_hop_delays_only_hand_overs_between_ranks():
    # gpipe p=2 m=2: rank 1's F waits one hop for each activation, rank 0's B one for each gradient.
    t = simulate(make("gpipe", p=2, m=2), p=2, v=1, m=2, f=1.0, b=3.0, hop=0.5)
    assert [(e.start, str(e.action)) for e in t.events[1]] == [(1.5, "F0.0"), (2.5, "F0.1"), (3.5, "B0.0"),
                                                                  (6.5, "B0.1")]
    assert [(e.start, str(e.action)) for e in t.events[0]][2:] == [(7.0, "B0.0"), (10.0, "B0.1")]
    assert t.makespan == 13.0
    # A V schedule's turn at the last stage is within rank 0: no hop there; p=1 has none at all.
    one = simulate(make("interleaved", p=1, v=2, m=2), p=1, v=2, m=2, hop=5.0)
    assert one.makespan == simulate(make("interleaved", p=1, v=2, m=2), p=1, v=2, m=2).makespan
    for name, v in (("1f1b", 1), ("zbv", 2), ("dualpipev", 2)):
        s = make(name, p=2, v=v, m=4)
        assert simulate(s, p=2, v=v, m=4, hop=0.1).makespan > simulate(s, p=2, v=v, m=4).makespan
    with pytest.raises(ValueError, match=r"hop \(the latency of one hand-over between ranks\) must be a number >= 0"):
        simulate(make("1f1b", p=2, m=2), p=2, v=1, m=2, hop=-1.0)


def test_format_schedule_1f1b_p2_m4():
    assert format_schedule(make("1f1b", p=2, m=4), p=2) == (
        "rank 0: F0.0 F0.1 .    B0.0 F0.2 B0.1 F0.3 B0.2 .    B0.3\n"
        "rank 1: .    F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3"
    )


def test_action():
    a = Action("I", 2, 5)
    assert a.stage(rank=1, p=4) == 9 and str(a) == "I2.5"
    with pytest.raises(ValueError, match=r"kind must be one of \('F', 'B', 'I', 'W'\), got 'X'"):
        Action("X", 0, 0)
    with pytest.raises(ValueError, match="chunk must be an int >= 0, got -1"):
        Action("F", -1, 0)
    with pytest.raises(ValueError, match="microbatch must be an int >= 0, got True"):
        Action("F", 0, True)


# name, p, v, m, message (regex)
CHECK_CASES = [
    ("pipedream", 2, 1, 4, "unknown schedule 'pipedream'; valid: gpipe, 1f1b, interleaved, zb-h1, zbv, dualpipev"),
    ("zbv", 2, 1, 4, r"'zbv' holds two chunks per rank \(a V: stages r and 2p-1-r\), got v=1; use v=2"),
    ("dualpipev", 2, 3, 4, r"'dualpipev' holds two chunks per rank .* got v=3"),
    ("zbv", 4, 2, 3, r"'zbv' needs at least p=4 microbatches in flight, got m=3"),
    ("dualpipev", 2, 2, 3, r"'dualpipev' needs at least 2p=4 microbatches \(one per stage of its V\), got m=3; "
                           r"use m >= 4, or 'zbv'"),
    ("1f1b", 0, 1, 4, r"p must be an int >= 1 .* got p=0"),
    ("1f1b", 2.0, 1, 4, r"p must be an int >= 1 .* got p=2\.0"),
    ("1f1b", 2, 0, 4, r"v must be an int >= 1 .* got v=0"),
    ("gpipe", 2, 1, 0, r"m must be an int >= 1 .* got m=0"),
    ("gpipe", 2, 1, True, r"m must be an int >= 1 .* got m=True"),
    ("1f1b", 2, 2, 4, r"'1f1b' runs one chunk per rank, got v=2; use v=1, or 'interleaved' for v >= 2"),
    ("gpipe", 2, 3, 4, r"'gpipe' runs one chunk per rank, got v=3"),
    ("zb-h1", 2, 2, 4, r"'zb-h1' runs one chunk per rank, got v=2"),
    ("interleaved", 2, 1, 4, r"'interleaved' needs v >= 2 .* got v=1; for one chunk per rank use '1f1b'"),
    ("interleaved", 4, 2, 6, r"'interleaved' needs m to be a multiple of p=4 .* got m=6; use m=4 or m=8"),
    ("interleaved", 4, 2, 2, r"'interleaved' needs at least p=4 microbatches in flight, got m=2"),
    ("1f1b", 4, 1, 3, r"'1f1b' needs at least p=4 microbatches in flight, got m=3; use m >= 4, or the 'gpipe'"),
    ("zb-h1", 8, 1, 7, r"'zb-h1' needs at least p=8 microbatches in flight, got m=7"),
]


@pytest.mark.parametrize(
    "name,p,v,m,message", CHECK_CASES, ids=[f"{c[0]}-p{c[1]}-v{c[2]}-m{c[3]}" for c in CHECK_CASES]
)
def test_check_refuses(name, p, v, m, message):
    with pytest.raises(ValueError, match=r"^schedules: " + message):
        check(name, p=p, v=v, m=m)
    with pytest.raises(ValueError, match=message):
        make(name, p=p, v=v, m=m)


def test_check_accepts_the_edges():
    check("gpipe", p=8, v=1, m=1)
    check("1f1b", p=4, v=1, m=4)
    check("zb-h1", p=1, v=1, m=1)
    check("interleaved", p=4, v=3, m=4)


def _bad(p: int, v: int, m: int, ranks: list[str]):
    """A schedule from strings like "F0.0 B0.0", one per rank."""
    return tuple(
        tuple(Action(s[0], int(s[1:].split(".")[0]), int(s.split(".")[1])) for s in rank.split())
        for rank in ranks
    )


BAD_SCHEDULES = [
    ("wrong rank count", 2, 1, 1, ["F0.0 B0.0"], "one action list per rank, p=2, got 1 lists"),
    ("chunk out of range", 1, 1, 1, ["F1.0 B0.0"], r"rank 0 runs F1\.0, outside chunks 0\.\.0"),
    ("missing F", 1, 1, 2, ["F0.0 B0.0 B0.1"], r"stage 0 \(rank 0, chunk 0\), microbatch 1 has 0 F actions"),
    ("two B", 1, 1, 1, ["F0.0 B0.0 B0.0"], r"has 2 B, 0 I and 0 W actions"),
    ("B and W", 1, 1, 1, ["F0.0 B0.0 W0.0"], r"has 1 B, 0 I and 1 W actions"),
    ("W before I", 1, 1, 1, ["F0.0 W0.0 I0.0"], r"deadlocks.*rank 0 at W0\.0 waits for B/I0\.0 of rank 0"),
    ("cross wait", 2, 1, 1, ["B0.0 F0.0", "F0.0 B0.0"],
     r"deadlocks.*rank 0 at B0\.0 waits for F0\.0 of rank 0 \(stage 0\), B/I0\.0 of rank 1 \(stage 1\); "
     r"rank 1 at F0\.0 waits for F0\.0 of rank 0"),
    # Rank 1 runs microbatch 1's backward before that microbatch's forward.
    ("backward before its forward", 2, 1, 2, ["F0.0 F0.1 B0.0 B0.1", "F0.0 B0.1 F0.1 B0.0"],
     r"rank 1 at B0\.1 waits for F0\.1 of rank 1"),
]


@pytest.mark.parametrize("case,p,v,m,ranks,message", BAD_SCHEDULES, ids=[c[0] for c in BAD_SCHEDULES])
def test_dependencies_ok_refuses(case, p, v, m, ranks, message):
    schedule = _bad(p, v, m, ranks)
    with pytest.raises(ValueError, match=r"^schedules\.dependencies_ok: .*" + message):
        dependencies_ok(schedule, p=p, v=v, m=m)
    with pytest.raises(ValueError, match=r"^schedules\.simulate: .*" + message):
        simulate(schedule, p=p, v=v, m=m)


def test_dependencies_ok_refuses_non_actions_and_bad_counts():
    with pytest.raises(ValueError, match=re.escape("rank 0 holds ('F', 0, 0), not a schedules.Action")):
        dependencies_ok(((("F", 0, 0),),), p=1, v=1, m=1)
    with pytest.raises(ValueError, match=re.escape("format_schedule: rank 0 holds 'F0.0', not a schedules.Action")):
        format_schedule((("F0.0",),), p=1)
    with pytest.raises(ValueError, match=r"schedules\.dependencies_ok: m must be an int >= 1 .* got m=0"):
        dependencies_ok(((),), p=1, v=1, m=0)


def test_simulate_refuses_bad_costs():
    s = make("zb-h1", p=2, m=2)
    with pytest.raises(ValueError, match=r"f \(the cost of one F\) must be a number > 0, got 0"):
        simulate(s, p=2, v=1, m=2, f=0)
    with pytest.raises(ValueError, match=r"b \(the cost of one B\) must be a number > 0, got -1"):
        simulate(s, p=2, v=1, m=2, b=-1)
    with pytest.raises(ValueError, match=r"w \(the W part of a backward\) must be in \[0, b=2\.0\], got 3"):
        simulate(s, p=2, v=1, m=2, w=3)


def test_module_imports_no_torch():
    # The CLI and the planner read schedules without a torch install; load the file on
    # its own (not through dtp/__init__, which imports torch) and look.
    path = Path(__file__).parents[1] / "src" / "dtp" / "schedules"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('schedules', {str(path / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(path)!r}])\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['schedules'] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "mod.dependencies_ok(mod.make('zb-h1', p=2, m=2), p=2, v=1, m=2)\n"
        "mod.dependencies_ok(mod.make('dualpipev', p=2, v=2, m=4), p=2, v=2, m=4)\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'numpy', 'dtp')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- the V schedules


def _idle(name: str, p: int, m: int, *, f: float, i: float, w: float, fb: float | None = None) -> list[float]:
    v = chunks_per_rank(name, 1)
    t = simulate(make(name, p=p, v=v, m=m), p=p, v=v, m=m, f=f, b=i + w, w=w, fb=fb)
    return [t.makespan - busy for busy in t.busy]


# (f, i, w) at which the published formulas hold (F = I, W <= F: the papers' setting).
_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (2.0, 2.0, 0.5), (1.0, 1.0, 0.25), (3.0, 3.0, 2.0)]


@pytest.mark.parametrize("f,i,w", _COSTS)
def test_published_bubbles_of_1f1b_and_zb_h1(f, i, w):
    for p in range(1, 6):
        for m in (p, 2 * p + 1, 3 * p):
            b = i + w
            assert _idle("1f1b", p, m, f=f, i=i, w=w) == pytest.approx([(p - 1) * (f + b)] * p), (p, m)
            assert _idle("zb-h1", p, m, f=f, i=i, w=w) == pytest.approx([(p - 1) * (f + b - 2 * w)] * p), (p, m)


@pytest.mark.parametrize("f,i,w", _COSTS)
def test_dualpipev_has_deepseeks_bubble(f, i, w):
    # DeepSeek's README: (PP/2 - 1)(F&B + B - 3W), PP the stages (2p); the most idle
    # rank's, for an F&B from no overlap (F + B) down to a forward wholly hidden (B).
    b = i + w
    for fb in (f + b, 0.5 * f + b, b):
        for p in range(1, 6):
            for m in (2 * p, 2 * p + 1, 3 * p + 2):
                pp = 2 * p
                assert max(_idle("dualpipev", p, m, f=f, i=i, w=w, fb=fb)) == pytest.approx(
                    (pp / 2 - 1) * (fb + b - 3 * w)), (fb, p, m)


@pytest.mark.parametrize("f,i,w", _COSTS)
def test_zbv_bubble_is_the_papers_down_to_the_start_up(f, i, w):
    for p in range(1, 6):
        for m in range(2 * p - 1, 3 * p + 1):
            assert _idle("zbv", p, m, f=f, i=i, w=w) == pytest.approx([(p - 1) * max(f, f + i - 2 * w)] * p), (p, m)
    # At F = I = W it is the last rank's start-up, (p-1)F: a sixth of 1f1b's on stages of
    # twice the chunk's cost, half of zb-h1's.
    p, m = 4, 8
    zbv = _idle("zbv", p, m, f=1, i=1, w=1)[0]
    assert (zbv, _idle("1f1b", p, m, f=2, i=2, w=2)[0], _idle("zb-h1", p, m, f=2, i=2, w=2)[0]) == (3, 18, 6)


def test_v_schedules_peak_activations():
    # Chunks of half a stage: zbv's 2p is 1f1b's rank-0 peak of p stages; dualpipev's
    # 2p + 1 is DeepSeek's PP + 1.
    for p in range(1, 6):
        for m in (2 * p, 3 * p):
            assert simulate(make("zbv", p=p, v=2, m=m), p=p, v=2, m=m).peak_in_flight == (2 * p,) * p, (p, m)
            assert simulate(make("dualpipev", p=p, v=2, m=m), p=p, v=2, m=m).peak_in_flight == (2 * p + 1,) * p
            assert simulate(make("1f1b", p=p, m=m), p=p, v=1, m=m).peak_in_flight[0] == p


def test_v_placement_puts_first_and_last_stage_on_rank_0():
    for p in range(1, 6):
        stages = [global_stage(c, r, p, "v") for r in range(p) for c in (0, 1)]
        assert sorted(stages) == list(range(2 * p))
        assert stage_owner(0, p, "v") == (0, 0) and stage_owner(2 * p - 1, p, "v") == (0, 1)
        assert all(stage_owner(global_stage(c, r, p, "v"), p, "v") == (r, c) for r in range(p) for c in (0, 1))
    s = make("dualpipev", p=3, v=2, m=6)
    assert isinstance(s, Schedule) and s.placement == "v" and s.stages(1) == (1, 4) and s.owner(3) == (2, 1)
    assert make("1f1b", p=2, m=2).placement == "loop"


def test_dualpipev_pairs_forward_and_backward_of_other_microbatches():
    for p, v, m in _valid_cases("dualpipev"):
        pairs = [item for rank in make("dualpipev", p=p, v=v, m=m) for item in rank if isinstance(item, Pair)]
        assert pairs, (p, m)
        assert all(x.forward.microbatch != x.backward.microbatch or x.forward.chunk != x.backward.chunk
                   for x in pairs)
    with pytest.raises(ValueError, match="needs an F action and a B action"):
        Pair(Action("B", 0, 0), Action("F", 0, 1))
    assert format_schedule(make("dualpipev", p=2, v=2, m=4), p=2).splitlines()[0].split()[9] == "F0.3&B1.1"


@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_schedules_beat_1f1b_at_equal_costs(name):
    # Stage costs F = I = W = 2 for 1f1b (b = 4), chunk costs 1 for the V: same work.
    for p in (2, 4):
        m = 2 * p
        one = simulate(make("1f1b", p=p, m=m), p=p, v=1, m=m, f=2.0, b=4.0)
        vee = simulate(make(name, p=p, v=2, m=m), p=p, v=2, m=m, f=1.0, b=2.0, w=1.0)
        assert vee.makespan < one.makespan and vee.bubble_ratio < one.bubble_ratio, (name, p)


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2), ("dualpipev", 2), ("gpipe", 1)])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (3, 5)])
def test_lane_pairs_keep_each_rank_order_and_never_deadlock(name, v, p, m):
    """Under ep_overlap each pair receives both inputs before it starts: the plan still
    runs (dependencies_ok with each pair one event), holds the same actions in the same
    order, pairs only an F with a B of another (chunk, microbatch), and keeps every one
    of the schedule's own F&B pairs (DualPipeV)."""
    try:
        plan = make(name, p=p, v=v, m=m)
    except ValueError as e:  # interleaved: m a multiple of p; dualpipev: m >= 2p
        pytest.skip(str(e))
    lanes = lane_pairs(plan, p=p, v=v, m=m)
    dependencies_ok(lanes, p=p, v=v, m=m)
    assert lanes.placement == plan.placement
    for r in range(p):
        # each item of the lanes' plan is the next one or two actions of the rank's list
        # (a pair may hold its B before its F)
        actions, k = [a for item in plan[r] for a in flat(item)], 0
        for item in lanes[r]:
            group = flat(item)
            assert set(group) == set(actions[k:k + len(group)]), (r, str(item))
            k += len(group)
            if isinstance(item, Pair):
                assert (item.forward.chunk, item.forward.microbatch) != (item.backward.chunk, item.backward.microbatch)
        assert k == len(actions)
        own = {item for item in plan[r] if isinstance(item, Pair)}
        assert own <= set(lanes[r])
    if name == "gpipe":  # every F before any B: at most the last forward beside the first backward
        assert all(sum(isinstance(item, Pair) for item in rank) <= 1 for rank in lanes)
    if name == "1f1b":  # every stage: m - (p-r-1) - 1 pairs (a B with the next F)
        assert [sum(isinstance(i, Pair) for i in lanes[r]) for r in range(p)] == [m - p + r for r in range(p)]
