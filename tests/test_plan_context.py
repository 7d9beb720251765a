"""dtp.plan for every context-parallel algorithm, and dtp train's use of it.

The predicted bytes per (mesh axis, collective) of double ring and hybrid (USP) context
parallel equal a real step's comm log exactly, sub-axes included (the rings and
all-to-alls run on mesh views that split ``cp`` into ``cp_outer`` × ``cp_inner``, or
``cp_ring`` × ``cp_uly``); the plan reads the layout the CLI builds; and ``dtp train`` is
never refused because the plan cannot model a configuration (it says so and goes on).
Measured with tests/test_plan.py's helpers, on one 4-rank pool.
"""

from __future__ import annotations

import argparse

import pytest

import dtp
from dtp.cli import build_layout, main, parse_args
from dtp.cli.plan import plan_from_args, train_refusal
from dtp.testing import run
from test_plan import _all

# name -> (RunConfig fields, model, batch, seq): tiny model, 4 ranks of cp, a few tokens each.
CASES = {
    "double_ring w2": (dict(cp=4, cp_algo="double_ring", cp_window=2), "tiny", 2, 16),
    "hybrid u2": (dict(cp=4, cp_algo="hybrid", ulysses_degree=2), "tiny", 2, 16),
    # tiny has 2 kv heads: Ulysses over 4 repeats each one twice before the all-to-all.
    "ulysses GQA repeat": (dict(cp=4, cp_algo="ulysses"), "tiny", 2, 16),
    # bf16: the dK/dV partials travel in fp32 (inner and outer ring); 2 head chunks, 2
    # microbatches, the forward (and its K/V hops) again under full recompute.
    "double_ring bf16 chunks m=2 full": (dict(cp=4, cp_algo="double_ring", cp_window=2, cp_head_chunks=2,
                                              dtype="bfloat16", microbatches=2, recompute="full"), "tiny", 2, 16),
}


@pytest.fixture(scope="module")
def measured() -> dict[str, dict]:
    """Every case's comm-log summary on rank 0 (the cp ranks are alike)."""
    results = run(_all, list(CASES.values()), False, world_size=4)[0]
    return {name: summary for name, (summary, _peak) in zip(CASES, results)}


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_bytes_equal_the_comm_log(measured, name):
    kw, model, batch, seq = CASES[name]
    assert dtp.plan(model, batch=batch, seq=seq, **kw).bytes == measured[name]


def test_the_comm_log_names_the_sub_axes(measured):
    assert {"cp_inner", "cp_outer"} <= set(measured["double_ring w2"])
    assert {"cp_ring", "cp_uly"} <= set(measured["hybrid u2"])


DOUBLE_RING = ["train", "--nproc", "4", "--cp", "4", "--cp-algo", "double_ring", "--cp-window", "2", "--seq", "128"]


def test_train_is_no_longer_refused_for_double_ring(capsys):
    assert train_refusal(parse_args(DOUBLE_RING + ["--memory-gb", "1"])) is None
    assert "does not model" not in capsys.readouterr().err
    # The plan really checks it now: a budget it cannot fit is refused with the table.
    refusal = train_refusal(parse_args(DOUBLE_RING + ["--memory-gb", "0.0001"]))
    assert refusal is not None and "DOES NOT FIT" in refusal and "cp_inner" in refusal


def test_train_goes_on_when_the_plan_cannot_model_it(monkeypatch, capsys):
    def cannot(*args, **kwargs):
        raise ValueError("dtp.plan: something new is not modelled yet")

    monkeypatch.setattr(dtp.planning, "plan", cannot)
    assert train_refusal(parse_args(DOUBLE_RING)) is None
    err = capsys.readouterr().err.strip()
    assert err == ("dtp train: the plan does not model this configuration (something new is not modelled yet); "
                   "not checking memory")


def test_dtp_plan_prints_hybrid_and_errs_in_one_line(capsys):
    argv = ["plan", "--cp", "4", "--cp-algo", "hybrid", "--ulysses-degree", "2", "--seq", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cp_algo=hybrid, ulysses_degree=2" in out and "cp_uly" in out and "cp_ring" in out
    # A double ring needs a window: one readable line, exit 2.
    assert main(["plan", "--cp", "4", "--cp-algo", "double_ring"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "it needs --cp-window > 1" in err


def test_the_plan_reads_the_layout_the_cli_builds():
    args = parse_args(["train", "--cp", "4", "--cp-algo", "hybrid", "--ulysses-degree", "2", "--cp-head-chunks", "1",
                       "--dp", "2", "--zero", "1", "--seq", "64"])
    p = plan_from_args(args)
    assert p.target.layout == build_layout(args)
    assert (p.target.context.algo, p.target.context.ulysses_degree, p.target.context.head_chunks) == ("hybrid", 2, 1)
    # dtp.plan's keywords are a RunConfig's, whose layout is the one build_layout makes of the flags.
    kw = dict(batch=8, seq=64, dp=2, zero=1, cp=4, cp_algo="hybrid", ulysses_degree=2, cp_head_chunks=1)
    assert dtp.plan("tiny", **kw).target.layout == dtp.RunConfig(**kw).layout() == build_layout(args)


def test_context_keywords_must_agree_with_a_given_layout():
    layout = build_layout(parse_args(DOUBLE_RING))
    assert dtp.plan("tiny", seq=128, cp=4, layout=layout).target.context.window == 2
    assert dtp.plan("tiny", seq=128, cp=4, layout=layout, cp_algo="double_ring", cp_window=2).bytes
    with pytest.raises(ValueError, match="disagree"):
        dtp.plan("tiny", seq=128, cp=4, layout=layout, cp_algo="ring")
    with pytest.raises(ValueError, match="no context parallel"):
        dtp.plan("tiny", seq=128, cp=4, layout=build_layout(argparse.Namespace(**{
            **vars(parse_args(["train", "--dp", "4"])), "cp": 1})))
