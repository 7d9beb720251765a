"""The V schedules (zbv, dualpipev) under the one runner: each equals the single-device run
(fp64, 1e-10 on every loss and the final parameters) alone and with dp / tp + sp / ZeRO /
tied embeddings, their checkpoints load under 1f1b and back, and DualPipeV's F&B posts
both of a pair's receives before the action ahead of it computes."""

import optree
import pytest
import torch

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.strategies import pipeline_plan
from dtp.testing import run
from test_pipeline import RTOL, _cfg, _check, _load_pp, _reference, _save_pp, _train

V_CASES = {  # name -> (mesh axes, layout, cfg kwargs, microbatches, clip)
    "pp2 zbv m=2": ({"pp": 2}, layouts.pipeline("zbv"), {}, 2, None),
    "pp2 dualpipev m=4 tied clip": ({"pp": 2}, layouts.pipeline("dualpipev"), {"tie": True}, 4, 1.0),
    "pp2 x dp2 dualpipev": ({"pp": 2, "dp": 2}, layouts.data() + layouts.pipeline("dualpipev"), {}, 4, None),
    "pp2 x dp2 zero1 zbv": ({"pp": 2, "dp": 2}, layouts.data() + layouts.zero(1, bucket_mb=1e-3) +
                            layouts.pipeline("zbv"), {}, 2, 1.0),
}
SLOW_CASES = {
    "pp4 zbv m=4": ({"pp": 4}, layouts.pipeline("zbv"), {"n_layers": 6}, 4, None),
    "pp4 dualpipev m=8": ({"pp": 4}, layouts.pipeline("dualpipev"), {"n_layers": 6}, 8, None),
}


def _world(axes: dict) -> int:
    n = 1
    for size in axes.values():
        n *= size
    return n


def _parity(axes, layout, kw, m, clip) -> None:
    cfg = _cfg(**kw)
    got = run(_train, axes, layout, cfg, m, clip, world_size=_world(axes))[0]
    _check(got, _reference(cfg, m, clip))


@pytest.mark.parametrize("name", list(V_CASES))
def test_v_schedules_equal_one_device(name):
    _parity(*V_CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_v_schedules_on_four_ranks_equal_one_device(name):
    _parity(*SLOW_CASES[name])


@pytest.mark.slow  # a world of 8 (~8 s each on 2 cores)
@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
def test_a_world_of_8_pp2_dp2_tp2_sp_v_schedule_equals_one_device(schedule):
    cfg = _cfg()
    layout = layouts.data() + layouts.megatron(True) + layouts.pipeline(schedule)
    got = run(_train, {"pp": 2, "dp": 2, "tp": 2}, layout, cfg, 4, 1.0, None, world_size=8)[0]
    _check(got, _reference(cfg, 4, 1.0))


@pytest.mark.parametrize("save,load", [("dualpipev", "1f1b"), ("1f1b", "zbv")])
def test_checkpoints_interchange_with_1f1b(save, load, tmp_path):
    """Saved after step 1 under one schedule, loaded under the other: steps 2 and 3 equal
    the saving run's (the stages' parameters sit on other ranks under the V)."""
    cfg, root = _cfg(tie=True), str(tmp_path / "ckpt")
    want = run(_save_pp, {"pp": 2}, layouts.pipeline(save), cfg, root, 4, world_size=2)[0]
    got = run(_load_pp, {"pp": 2}, layouts.pipeline(load), cfg, root, 4, world_size=2)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[1:]), rtol=RTOL, atol=0)


def _first_pair_posts(m: int) -> list[str]:
    """Rank 0's pp receives, in the order posted, over one dualpipev step."""
    cfg = _cfg()
    mesh = dtp.make_mesh(pp=2)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), dtp.optim.sgd(0.1), mesh=mesh,
                                  layout=layouts.pipeline("dualpipev"), axes=llama.param_axes(cfg))
    tok = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}
    with dtp.comm_log() as log:
        dtp.train_step(llama.sequential(cfg), state, dtp.shard_batch(batch, state), microbatches=m)
    return [r.tag for r in log.records if r.kind == "recv" and "header" not in r.tag]


def test_dualpipev_posts_a_pairs_receives_ahead():
    # Rank 0 (stages 0 and 3) at p=2, m=4 runs ... F1.2&B0.0 B1.2 F1.3&B0.1 ...: the pair
    # F1.3&B0.1 needs stage 3's activation of mb 3 and stage 0's gradient of mb 1, both
    # posted before B1.2 computes (the runner posts pipeline_plan.AHEAD items ahead).
    _, steps = pipeline_plan.rank_steps("dualpipev", 2, 2, 4, 0)
    k = next(k for k, s in enumerate(steps) if str(s.item) == "F1.3&B0.1")
    assert str(steps[k - 1].item) == "B1.2"
    assert {("act", 3, 3), ("grad", 0, 1)} <= {r for s in steps[:k - 1] for r in s.posts}
    # The runner posts in the plan's order; microbatch 0's bodies once its header is read.
    tags = run(_first_pair_posts, 4, world_size=2)[0]
    want = [f"pp {kind} stage {stage} mb {i}" for s in steps for kind, stage, i in s.posts if i]
    assert [t for t in tags if not t.endswith(" mb 0")] == want, tags


# ------------------------------------------------------------------ evaluation under a pipeline


def _eval(axes: dict, layout, cfg, n_batches: int) -> list[float]:
    """Held-out losses before and after one training step (state laid out whole, then
    as each stage's), forward only."""
    mesh = dtp.make_mesh(**axes)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), dtp.optim.sgd(0.1), mesh=mesh,
                                  layout=layout, axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    model = llama.sequential(cfg)
    held_out = [dtp.shard_batch(_batch_of(cfg, 100 + k), state) for k in range(n_batches)]
    before = dtp.strategies.evaluate(model, state.params, state.strategy, state.layout, state.mesh, held_out)
    state, _ = dtp.train_step(model, state, dtp.shard_batch(_batch_of(cfg, 0), state), microbatches=4)
    after = dtp.strategies.evaluate(model, state.params, state.strategy, state.layout, state.mesh, held_out)
    return [loss for loss, _ in before + after]


def _batch_of(cfg, seed: int) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


EVAL_CASES = {  # name -> (mesh axes, layout, batches: fewer than the stages, too)
    "pp2 dualpipev": ({"pp": 2}, layouts.pipeline("dualpipev"), 3),
    "pp2 x dp2 1f1b, 1 batch": ({"pp": 2, "dp": 2}, layouts.data() + layouts.pipeline("1f1b"), 1),
    "pp2 x tp2 sp interleaved": ({"pp": 2, "tp": 2}, layouts.data() + layouts.megatron(True) +
                                 layouts.pipeline("interleaved", virtual_stages=2), 2),
}


@pytest.mark.parametrize("name", list(EVAL_CASES))
def test_eval_under_a_pipeline_equals_one_process(name):
    axes, layout, n = EVAL_CASES[name]
    cfg = _cfg()
    want = run(_eval, {"dp": 1}, layouts.data(), cfg, n, world_size=1)[0]
    got = run(_eval, axes, layout, cfg, n, world_size=_world(axes))
    for rank_losses in got:  # the same on every rank
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(want), rtol=RTOL, atol=0)


# ------------------------------------------------------------------ the split backward: I + W = B


def _stage_backward_flops(first: int, stop: int, tie: bool) -> tuple[int, int, int, list, list]:
    from torch.utils.flop_counter import FlopCounterMode

    from dtp.strategies import pipeline_split

    cfg = _cfg(tie=tie)
    params = llama.init(cfg, seed=0, dtype=torch.float64)
    model = llama.sequential(cfg)
    weights = [w.requires_grad_(True) for w in optree.tree_leaves(params)]
    batch = _batch_of(cfg, 0)
    h = model.run(params, None, batch, 0, first).detach().requires_grad_(True)

    def forward():
        out = model.run(params, h, batch, first, stop)
        return out, (None if out.dim() == 0 else torch.ones_like(out))

    out, grad = forward()
    with FlopCounterMode(display=False) as full:
        want = torch.autograd.grad(out, [h, *weights], grad_outputs=grad, allow_unused=True)
    out, grad = forward()
    with FlopCounterMode(display=False) as i_count:
        dx, kept = pipeline_split.backward_input(out, grad, h, weights)
    del out
    with FlopCounterMode(display=False) as w_count:
        got = kept.run(weights)
    return full.get_total_flops(), i_count.get_total_flops(), w_count.get_total_flops(), [dx, *got], list(want)


@pytest.mark.parametrize("first,stop,tie", [(1, 3, False), (2, 4, False), (1, 4, True)])
def test_split_backward_costs_what_the_full_one_does(first, stop, tie):
    """Blocks, and blocks + head (the loss; tied: the head reads the embedding too): I
    computes the input's gradient, W the weights' from what I kept, their FLOPs sum to
    the full backward's (the input chain is not run twice) and the gradients are B's."""
    b, i, w, got, want = _stage_backward_flops(first, stop, tie)
    assert i > 0 and w > 0 and i + w == b, (i, w, b)
    for g, x in zip(got, want):
        assert (g is None) == (x is None)
        if g is not None:
            torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-14)


def _backward_flops(axes: dict, layout, m: int) -> dict[str, int]:
    """FLOPs of one rank's B, I and W actions over :func:`_train`'s steps."""
    from torch.utils.flop_counter import FlopCounterMode

    from dtp.strategies import pipeline as pl

    totals: dict[str, int] = {}
    saved = {name: getattr(pl.Run, name) for name in ("_B", "_I", "_W")}
    inside = [False]

    def counting(kind: str, fn):
        def action(self, *args, **kwargs):
            if inside[0]:  # B runs through I: count the outer action
                return fn(self, *args, **kwargs)
            inside[0] = True
            try:
                with FlopCounterMode(display=False) as counter:
                    return fn(self, *args, **kwargs)
            finally:
                inside[0] = False
                totals[kind] = totals.get(kind, 0) + counter.get_total_flops()
        return action

    for name, fn in saved.items():
        setattr(pl.Run, name, counting(name[1], fn))
    try:
        _train(axes, layout, _cfg(), m)
    finally:
        for name, fn in saved.items():
            setattr(pl.Run, name, fn)
    return totals


def test_under_zero_i_plus_w_is_b_on_every_rank():
    """ZeRO's parameters are views of one anchor: W asks for each view's gradient, then
    runs that view's backward (its bucket's add); no rank computes more than 1f1b's B."""
    zero = layouts.data() + layouts.zero(1, bucket_mb=1e-3)
    full = run(_backward_flops, {"pp": 2, "dp": 2}, zero + layouts.pipeline("1f1b"), 2, world_size=4)
    split = run(_backward_flops, {"pp": 2, "dp": 2}, zero + layouts.pipeline("zb-h1"), 2, world_size=4)
    for rank, (b, iw) in enumerate(zip(full, split)):
        assert iw.get("I", 0) + iw["W"] == b["B"], (rank, b, iw)
    assert split[2]["I"] > 0  # the second stage's I computes the input's gradient
