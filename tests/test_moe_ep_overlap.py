"""``layouts.expert(ep_overlap=True)``: microbatches in pairs of cooperative lanes, one's
expert all-to-all in flight while the other computes (dtp.strategies.ep_overlap). Each
equals the one-device run (fp64, 1e-10 on the loss, ``metrics["aux"]``, the parameters
and the router's bias, 3 steps), and the rules are refused on every rank alike."""

import math

import pytest
import torch

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.ops import lanes
from dtp.testing import run

from test_moe_pipeline import _cfg, _equals_one_device


def _ep(**kw):
    return layouts.data() + layouts.expert(ep_overlap=True, **kw)


CASES = {
    "ep2 m4 + V3 router and bias": ({"ep": 2}, _ep(), True, 4),
    "ep2 pipe-experts m4": ({"ep": 2}, _ep(pipe_experts=True), False, 4),
    "pp2 x ep2 1f1b m4 + bias": ({"pp": 2, "ep": 2}, _ep() + layouts.pipeline("1f1b"), True, 4),
    "pp2 x ep2 dualpipev m4 + bias": ({"pp": 2, "ep": 2}, _ep() + layouts.pipeline("dualpipev"), True, 4),
}
SLOW = {
    # One pair of lanes with the plain router: "ep2 m4 + V3 router and bias" runs the same
    # lanes and dispatch in two pairs, "ep2 pipe-experts m4" the plain router under lanes,
    # and test_the_lanes_take_turns_at_each_all_to_all m2's order (1.0 s on warm ranks,
    # 1.8 s in a suite run, measured on torch 2.13, 2 cores).
    "ep2 m2": ({"ep": 2}, _ep(), False, 2),
    "dp2 x ep2 zero1 m2 + bias": ({"dp": 2, "ep": 2}, _ep() + layouts.zero(1), True, 2),
    "dp2 x ep2 zero2 m2": ({"dp": 2, "ep": 2}, _ep() + layouts.zero(2), False, 2),
    # batch 8 over dp·ep 4: m 2; the last stage runs F0 | B0 F1 on lanes | B1
    "dp2 x pp2 x ep2 zero1 1f1b m2 + bias": ({"dp": 2, "pp": 2, "ep": 2},
                                              _ep() + layouts.zero(1) + layouts.pipeline("1f1b"), True, 2),
    "pp2 x ep2 interleaved v2 m4 + bias": ({"pp": 2, "ep": 2}, _ep() + layouts.pipeline("interleaved", virtual_stages=2),
                                           True, 4),
    "dp2 x ep2 m2 + bias": ({"dp": 2, "ep": 2}, _ep(), True, 2),
    "ep2 pipe-experts multi-data 2 m2 + bias": ({"ep": 2}, _ep(pipe_experts=True, multi_data=2), True, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_ep_overlap_equals_one_device(name):
    _equals_one_device(name, *CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_ep_overlap_with_dp_and_multi_data_equals_one_device(name):
    _equals_one_device(name, *SLOW[name])


def _interleaving() -> list[str]:
    """The comm log's order of a step's MoE all-to-alls under ep_overlap (ep2, m2, 1 MoE layer)."""
    cfg = llama.config("tiny-moe", n_layers=1, moe_every=1)
    mesh = dtp.make_mesh(ep=2)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.1), mesh=mesh, layout=_ep(),
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    tok = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = dtp.shard_batch({"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}, state)
    with dtp.comm_log() as log:
        dtp.train_step(llama.sequential(cfg), state, batch, microbatches=2)
    return [r.tag for r in log.records if r.kind == "all_to_all_v"]


def test_the_lanes_take_turns_at_each_all_to_all():
    """F0 posts its dispatch, F1 computes and posts its own before F0's combine: the two
    forwards interleave, then the two backwards."""
    tags = run(_interleaving, world_size=2)[0]
    assert tags == ["moe dispatch", "moe dispatch", "moe combine", "moe combine",
                    "moe combine backward", "moe combine backward", "moe dispatch backward", "moe dispatch backward"]


def test_lanes_run_one_at_a_time_and_pass_the_turn_at_hide():
    order = []

    class Done:
        def wait(self):
            return None

    def lane(name):
        def fn():
            for i in range(2):
                order.append(f"{name}{i}")
                lanes.hide(Done())
            return name
        return fn

    assert lanes.run([lane("a"), lane("b")]) == ["a", "b"]
    assert order == ["a0", "b0", "a1", "b1"]
    with pytest.raises(RuntimeError, match="boom"):
        lanes.run([lambda: (_ for _ in ()).throw(RuntimeError("boom")), lane("c")])


def _refused(axes: dict, layout, m: int) -> str:
    cfg = llama.config("tiny-moe", n_layers=1, moe_every=1)
    mesh = dtp.make_mesh(**axes)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.1), mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    tok = torch.zeros(8, 16, dtype=torch.long)
    try:
        dtp.train_step(llama.sequential(cfg), state, dtp.shard_batch({"tokens": tok, "targets": tok}, state),
                       microbatches=m)
    except ValueError as e:
        return str(e)
    return "not refused"


@pytest.mark.parametrize("axes, layout, m, match", [
    ({"ep": 2}, _ep(), 1, "needs microbatches >= 2, got 1"),
    ({"dp": 2, "ep": 1}, _ep(), 2, "has size 1 on this mesh"),
    ({"dp": 2, "ep": 2}, _ep() + layouts.zero(3), 2, "ZeRO 3 gathers and frees each bucket"),
    ({"dp": 2, "ep": 2}, _ep() + layouts.zero(2, overlap_grad_reduce=True), 2, "without overlap_grad_reduce"),
])
def test_bad_combinations_are_refused_on_every_rank(axes, layout, m, match):
    for message in run(_refused, axes, layout, m, world_size=math.prod(axes.values())):
        assert match in message


@pytest.mark.parametrize("fields, match", [
    (dict(ep_overlap=True, microbatches=2), "ep_overlap configures the expert-parallel layout: it needs ep > 1, got ep 1"),
    (dict(ep=2, ep_overlap=True, microbatches=1), "at pp 1 it needs microbatches >= 2, got 1"),
    (dict(ep=2, pp=2, pp_schedule="zbv", ep_overlap=True, microbatches=4),
     "not for pp_schedule zbv"),
    (dict(ep=2, dp=2, zero=3, ep_overlap=True, microbatches=2, batch=8), "use zero 1 or 2 without"),
])
def test_run_config_states_the_rules(fields, match):
    with pytest.raises(ValueError, match=match):
        dtp.RunConfig(model="tiny-moe", **fields)


@pytest.mark.parametrize("fields, m", [(dict(ep=2), 2), (dict(ep=2, pp=2), 4)])
def test_microbatches_default_to_pairs_for_it(fields, m):
    # two at pp 1 (one microbatch's all-to-all under the other's compute); under 1f1b twice
    # the fewest, since at m = p the first rank runs no F beside a B
    assert dtp.RunConfig(model="tiny-moe", ep_overlap=True, **fields).microbatches == m


def test_the_plan_takes_it_and_the_layout_carries_it():
    for extra in ({}, {"pp": 2}):
        rc = dtp.RunConfig(model="tiny-moe", ep=2, microbatches=4, ep_overlap=True, **extra)
        assert rc.layout().expert.ep_overlap
        assert dtp.plan(rc).bytes


def _pairs_in_lanes(schedule: str = "1f1b") -> int:
    """How many F/B pairs ran on lanes in one pp2 × ep2 m4 step of ``schedule``, on this rank."""
    from dtp.ops import lanes as lanes_mod

    calls = []
    real = lanes_mod.run

    def counting(fns):
        calls.append(len(fns))
        return real(fns)

    lanes_mod.run = counting
    try:
        cfg = _cfg(False)
        state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.1), mesh=dtp.make_mesh(pp=2, ep=2),
                                      layout=_ep() + layouts.pipeline(schedule), axes=llama.param_axes(cfg),
                                      axis_sizes=llama.axis_sizes(cfg))
        tok = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
        batch = dtp.shard_batch({"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}, state)
        dtp.train_step(llama.sequential(cfg), state, batch, microbatches=4)
    finally:
        lanes_mod.run = real
    return len(calls)


def test_under_1f1b_every_stage_pairs_a_b_with_the_next_f():
    # ranks 0, 1: stage 0 (F0 F1 | B0 F2 | B1 F3 | B2 B3); ranks 2, 3: the last stage
    # (F0 | B0 F1 | B1 F2 | B2 F3 | B3): dtp.schedules.lane_pairs
    assert run(_pairs_in_lanes, world_size=4) == [2, 2, 3, 3]


@pytest.mark.slow
def test_under_dualpipev_its_f_and_b_pairs_run_on_lanes():
    # rank 0 (stages 0, 3): F0.3&B1.1 F1.2&B0.0 F1.3&B0.1; rank 1 (stages 1, 2) adds F0.2 beside B1.0
    assert run(_pairs_in_lanes, "dualpipev", world_size=4) == [3, 3, 4, 4]
