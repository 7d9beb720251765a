"""MoE blocks inside pipeline stages: the carry between stages holds the hidden state and
the aux losses / statistics (their gradients come back like the hidden state's), the
head's aux reaches every pp rank, the router's bias (``TrainState.buffers``, replicated on
every rank) moves from the step's loads. Each equals the one-device run (fp64, 1e-10 on
the loss, ``metrics["aux"]``, the parameters and the buffers, 3 steps)."""

import math

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.testing import run

RTOL = 1e-10
STEPS = 3


def _cfg(bias: bool):
    extra = dict(router_score="sigmoid", n_groups=2, topk_group=1, router_bias_update=1e-2) if bias else {}
    return llama.config("tiny-moe", n_layers=4, moe_every=1, aux_loss_coeff=1e-2, z_loss_coeff=1e-3, **extra)


def _batch(cfg, step: int, b: int = 8) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, cfg.vocab_size, (b, 17), generator=torch.Generator().manual_seed(70 + step))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _whole(tree):
    return optree.tree_map(lambda x: (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone(), tree,
                           none_is_leaf=False)


def _train(axes: dict, layout, cfg, m: int, save_to: str | None = None, load_from: str | None = None) -> dict:
    """3 steps (``save_to``: saved after the first; ``load_from``: steps 2 and 3 from there)."""
    mesh = dtp.make_mesh(**axes)
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1)
    bias = bool(cfg.router_bias_update)
    state = dtp.TrainState.create(llama.init(cfg, seed=int(load_from is not None), dtype=torch.float64), opt,
                                  mesh=mesh, layout=layout, axes=llama.param_axes(cfg),
                                  axis_sizes=llama.axis_sizes(cfg),
                                  buffers=llama.init_buffers(cfg, torch.float64) if bias else None,
                                  buffer_update=llama.buffer_update(cfg) if bias else None)
    if load_from is not None:
        state, _ = dtp.checkpoint.load(load_from, like=state)
    model = llama.sequential(cfg)
    out = {"loss": [], "aux": [], "buffers": []}
    for step in range(int(load_from is not None), STEPS):
        state, metrics = dtp.train_step(model, state, dtp.shard_batch(_batch(cfg, step), state), microbatches=m)
        if step == 0 and save_to is not None:
            dtp.checkpoint.save(state, save_to)
        out["loss"].append(metrics["loss"])
        out["aux"].append(_whole(metrics["aux"]))
        out["buffers"].append(_whole(state.buffers) if bias else None)
    out["params"] = _whole(dtp.gather_params(state))
    return out


def _check(got: dict, want: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), rtol=RTOL, atol=0)
    for key in ("aux", "buffers", "params"):
        w_leaves = optree.tree_leaves(want[key])
        g_leaves = optree.tree_leaves(got[key])
        assert len(g_leaves) == len(w_leaves), f"{what}: {key} has {len(g_leaves)} leaves, want {len(w_leaves)}"
        for path, g, w in zip(optree.tree_paths(want[key]), g_leaves, w_leaves):
            torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-13, msg=lambda msg: f"{what} {key} {path}: {msg}")


_WANT: dict = {}


def _reference(cfg, m: int) -> dict:
    key = (cfg, m)
    if key not in _WANT:
        _WANT[key] = run(_train, {"dp": 1}, layouts.data(), cfg, m, world_size=1)[0]
    return _WANT[key]


def _ep_pp(schedule: str, **kw):
    return layouts.data() + layouts.expert() + layouts.pipeline(schedule, **kw)


CASES = {
    "pp2 x ep2 1f1b": ({"pp": 2, "ep": 2}, _ep_pp("1f1b"), False, 4),
    "pp2 x ep2 interleaved + bias": ({"pp": 2, "ep": 2}, _ep_pp("interleaved", virtual_stages=2), True, 4),
    "pp2 x ep2 dualpipev + bias": ({"pp": 2, "ep": 2}, _ep_pp("dualpipev"), True, 4),
}
SLOW = {
    "pp2 gpipe": ({"pp": 2}, layouts.pipeline("gpipe"), False, 2),
    "pp2 zb-h1 + bias": ({"pp": 2}, layouts.pipeline("zb-h1"), True, 4),
    "pp2 zbv": ({"pp": 2}, layouts.pipeline("zbv"), False, 4),
    "dp2 x pp2 x ep2 1f1b + bias": ({"dp": 2, "pp": 2, "ep": 2}, _ep_pp("1f1b"), True, 2),
}


def _equals_one_device(name: str, axes: dict[str, int], layout, bias: bool, m: int) -> None:
    cfg = _cfg(bias)
    got = run(_train, axes, layout, cfg, m, world_size=math.prod(axes.values()))
    want = _reference(cfg, m)
    for r, out in enumerate(got):  # metrics["aux"] and the buffers on every rank, not only the last stage's
        _check(out, want, f"{name} rank {r}")


@pytest.mark.parametrize("name", list(CASES))
def test_moe_under_a_pipeline_equals_one_device(name):
    _equals_one_device(name, *CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW))
def test_moe_under_every_schedule_and_dp_ep_pp_equals_one_device(name):
    _equals_one_device(name, *SLOW[name])


@pytest.fixture(scope="module")
def pp2_ep2_checkpoint(tmp_path_factory) -> tuple[str, dict]:
    """The pp2 × ep2 run (bias, m=2) that saves after its first step, and its 3 steps: one
    for both loads below, which only read the checkpoint (it was trained once per load:
    1.3 s of 4 warm ranks each, measured on torch 2.13, 2 cores)."""
    root = str(tmp_path_factory.mktemp("moe-pipeline") / "ckpt")
    return root, run(_train, {"pp": 2, "ep": 2}, _ep_pp("1f1b"), _cfg(True), 2, root, world_size=4)[0]


@pytest.mark.parametrize("into", ["ep2", "pp2"])
def test_a_pp2_ep2_checkpoint_with_the_bias_loads_under_ep2_and_pp2(into, pp2_ep2_checkpoint):
    cfg, (root, want) = _cfg(True), pp2_ep2_checkpoint
    axes, layout = ({"ep": 2}, layouts.data() + layouts.expert()) if into == "ep2" else \
        ({"pp": 2}, layouts.pipeline("zb-h1"))
    got = run(_train, axes, layout, cfg, 2, None, root, world_size=2)
    tail = {"loss": want["loss"][1:], "aux": want["aux"][1:], "buffers": want["buffers"][1:], "params": want["params"]}
    for r, out in enumerate(got):
        _check(out, tail, f"pp2 x ep2 -> {into} rank {r}")


def test_the_plan_counts_the_aux_carry_and_does_not_refuse():
    plan = dtp.plan("tiny-moe", batch=8, seq=16, pp=2, ep=2, microbatches=4)
    # The last stage (the plan's rank) sends each microbatch's hidden-state gradient (8 rows
    # / ep 2 / 4 microbatches = 1 row of 16 tokens × dim 64, fp32) and block 0's two aux
    # losses' gradients back, microbatch 0's header first (24 int64 words; the tree's
    # structure message beside it is not counted).
    assert plan.bytes["pp"]["send"] == 4 * (1 * 16 * 64 * 4 + 2 * 4) + 24 * 8
    # the grad norm (fp32), the loss (float64), and the head's aux to every stage:
    # 4 × (3 + 2 blocks × 5) float64
    assert plan.bytes["pp"]["all_reduce"] == 4 + 8 + 4 * 13 * 8


def _evaluate(axes: dict, layout, cfg) -> list:
    """``strategies.evaluate`` on two held-out batches (each one microbatch): ``(loss, aux)`` whole."""
    mesh = dtp.make_mesh(**axes)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), dtp.optim.sgd(0.1), mesh=mesh,
                                  layout=layout, axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg),
                                  buffers=llama.init_buffers(cfg, torch.float64))
    batches = [dtp.shard_batch(_batch(cfg, 10 + k), state) for k in range(2)]
    out = dtp.strategies.evaluate(llama.sequential(cfg), state.params, state.strategy, state.layout, state.mesh,
                                  batches, buffers=state.buffers)
    return [(loss, None if aux is None else _whole(dict(aux))) for loss, aux in out]


def test_evaluation_under_a_pipeline_returns_the_aux_of_one_device():
    """The forward-only schedule's aux (each block's aux / z losses, the LM loss) on every
    rank of pp2 × ep2, as the one-process evaluation returns it (it was ``None``)."""
    cfg = _cfg(True)
    want = run(_evaluate, {"dp": 1}, layouts.data(), cfg, world_size=1)[0]
    got = run(_evaluate, {"pp": 2, "ep": 2}, _ep_pp("1f1b"), cfg, world_size=4)
    for r, results in enumerate(got):
        assert len(results) == len(want)
        for (loss, aux), (w_loss, w_aux) in zip(results, want):
            torch.testing.assert_close(torch.tensor(loss), torch.tensor(w_loss), rtol=RTOL, atol=0)
            assert aux is not None, f"rank {r}: evaluate returned aux None under the pipeline"
            assert optree.tree_structure(aux) == optree.tree_structure(w_aux), f"rank {r}"
            for path, g, w in zip(optree.tree_paths(w_aux), optree.tree_leaves(aux), optree.tree_leaves(w_aux)):
                torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-13, msg=lambda m: f"rank {r} aux {path}: {m}")
