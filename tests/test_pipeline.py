"""Pipeline parallel: every schedule, alone and with dp / tp (+sp) / cp / tied embeddings,
equals the single-device run (fp64, 1e-10 on every loss and the final parameters)."""

import functools

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.testing import run

RTOL = 1e-10
STEPS = 3


def _cfg(n_layers: int = 4, tie: bool = False):
    return llama.config("tiny", n_layers=n_layers, n_kv_heads=4, tie_embeddings=tie)


def _batch(cfg, step: int, b: int = 8) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, cfg.vocab_size, (b, 17), generator=torch.Generator().manual_seed(50 + step))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _train(axes: dict, layout, cfg, m: int, clip=None, recompute=None, opt=None) -> tuple[list[float], dict]:
    mesh = dtp.make_mesh(**axes)
    opt = opt or dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), opt, mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    model = llama.sequential(cfg)
    losses = []
    for step in range(STEPS):
        state, metrics = dtp.train_step(model, state, dtp.shard_batch(_batch(cfg, step), state), microbatches=m,
                                        clip_norm=clip, recompute=recompute)
        losses.append(metrics["loss"])
    params = dtp.gather_params(state)
    full = optree.tree_map(lambda x: (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone(), params,
                           none_is_leaf=False)
    return losses, full


@functools.lru_cache(maxsize=None)
def _reference(cfg, m: int, clip=None):
    """The one-device run, once per (config, microbatches, clip): the default run's 23
    calls here and in test_pipeline_v.py ask for 9 (deterministic: seeded init and batches)."""
    return run(_train, {"dp": 1}, layouts.data(), cfg, m, clip, world_size=1)[0]


def _check(got, want):
    (gl, gp), (wl, wp) = got, want
    torch.testing.assert_close(torch.tensor(gl), torch.tensor(wl), rtol=RTOL, atol=0)
    for path, g, w in zip(optree.tree_paths(wp), optree.tree_leaves(gp), optree.tree_leaves(wp)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-13, msg=lambda msg: f"{path}: {msg}")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_schedules_equal_one_device(schedule):
    cfg = _cfg()
    got = run(_train, {"pp": 2}, layouts.pipeline(schedule), cfg, 2, world_size=2)[0]
    _check(got, _reference(cfg, 2))


CASES = {  # name -> (mesh axes, layout, cfg kwargs, microbatches, clip)
    "pp4 1f1b m=4": ({"pp": 4}, layouts.pipeline("1f1b"), {}, 4, None),
    "pp4 gpipe m=8 clip": ({"pp": 4}, layouts.pipeline("gpipe"), {}, 8, 0.5),
    "pp2 x dp2 1f1b": ({"pp": 2, "dp": 2}, layouts.data() + layouts.pipeline("1f1b"), {}, 2, None),
    "pp2 x tp2 sp": ({"pp": 2, "tp": 2}, layouts.data() + layouts.megatron(True) + layouts.pipeline("1f1b"), {}, 4,
                     1.0),
    "pp2 x tp2 no sp": ({"pp": 2, "tp": 2}, layouts.data() + layouts.megatron(False) + layouts.pipeline("gpipe"),
                        {}, 2, None),
    "pp2 tied": ({"pp": 2}, layouts.pipeline("1f1b"), {"tie": True}, 2, 1.0),
    "pp2 x cp2 ring": ({"pp": 2, "cp": 2}, layouts.data() + layouts.context("ring") + layouts.pipeline("1f1b"),
                       {}, 2, None),
}


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_composes_and_equals_one_device(name):
    axes, layout, kw, m, clip = CASES[name]
    cfg = _cfg(**kw)
    world = 1
    for n in axes.values():
        world *= n
    got = run(_train, axes, layout, cfg, m, clip, world_size=world)[0]
    _check(got, _reference(cfg, m, clip))


MORE = {
    "pp2 interleaved v=2 m=2": ({"pp": 2}, layouts.pipeline("interleaved", virtual_stages=2), {}, 2, None),
    "pp2 interleaved v=2 m=4 tied": ({"pp": 2}, layouts.pipeline("interleaved", virtual_stages=2), {"tie": True},
                                     4, 1.0),
    "pp4 interleaved v=2 m=8": ({"pp": 4}, layouts.pipeline("interleaved", virtual_stages=2), {"n_layers": 6}, 8,
                                None),
    "pp2 zb-h1 m=4": ({"pp": 2}, layouts.pipeline("zb-h1"), {}, 4, 1.0),
    "pp2 x tp2 zb-h1": ({"pp": 2, "tp": 2}, layouts.data() + layouts.megatron(True) + layouts.pipeline("zb-h1"), {},
                        2, None),
}
# The slow run's: zb-h1 on 4 stages. Its split backward is "pp2 zb-h1 m=4"'s (the same
# microbatches), the middle stages' receive-compute-send "pp4 1f1b m=4"'s and "pp4
# interleaved v=2 m=8"'s, and its action lists at p=4 test_schedules.py's (0.6-1.1 s).
MORE_SLOW = {"pp4 zb-h1 m=4": ({"pp": 4}, layouts.pipeline("zb-h1"), {}, 4, None)}
CASES.update(MORE, **MORE_SLOW)


@pytest.mark.parametrize("name", [*MORE, *(pytest.param(n, marks=pytest.mark.slow) for n in MORE_SLOW)])
def test_interleaved_and_zero_bubble_equal_one_device(name):
    test_pipeline_composes_and_equals_one_device(name)


# Clipping inside the optimizer (optax style) instead of train_step(clip_norm=...): its norm
# is the one over every stage, as one device's. It was each stage's own: silently another
# clip per stage (embed 11 % off one device after 3 steps).
CHAINED = dtp.optim.chain(dtp.optim.clip(0.05), dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10),
                                                                 weight_decay=0.1))


@pytest.mark.parametrize("axes, layout", [
    ({"pp": 2}, layouts.pipeline("1f1b")),
    ({"pp": 2, "dp": 2}, layouts.data() + layouts.zero(1, bucket_mb=0.01) + layouts.pipeline("1f1b")),
], ids=["pp2", "pp2 x dp2 zero1"])
def test_a_clip_in_the_optimizer_measures_every_stage(axes, layout):
    cfg = _cfg(tie=len(axes) == 1)  # pp2 alone: tied embeddings too (their gradient counted once)
    world = 1
    for n in axes.values():
        world *= n
    got = run(_train, axes, layout, cfg, 2, None, None, CHAINED, world_size=world)[0]
    _check(got, run(_train, {"dp": 1}, layouts.data(), cfg, 2, None, None, CHAINED, world_size=1)[0])


def _act_bytes(sp: bool) -> tuple[set, list[str]]:
    cfg = _cfg()
    mesh = dtp.make_mesh(pp=2, tp=2)
    layout = layouts.data() + layouts.megatron(sp) + layouts.pipeline("1f1b")
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), dtp.optim.sgd(0.1), mesh=mesh,
                                  layout=layout, axes=llama.param_axes(cfg))
    with dtp.comm_log() as log:
        dtp.train_step(llama.sequential(cfg), state, dtp.shard_batch(_batch(cfg, 0), state), microbatches=2)
    sends = {r.bytes for r in log.records if r.kind == "send" and r.tag.startswith("pp act") and "header" not in r.tag}
    return sends, sorted({r.tag.split(" ")[0] + " " + r.tag.split(" ")[1] for r in log.records
                          if r.tag.startswith("pp ")})


@pytest.mark.parametrize("sp", [False, True])
def test_a_tp_rank_sends_its_1_over_t_of_an_activation(sp):
    """Megatron's scatter/gather: microbatch 4 × 16 × 64 fp64 = 32 KiB whole; each of the
    2 tp ranks sends 16 KiB — scattered first without SP, already split with SP."""
    (first, first_tags), _, (_, last_tags), _ = run(_act_bytes, sp, world_size=4)  # ranks 0, 1: stage 0
    assert first == {4 * 16 * 64 * 8 // 2}
    assert ("pp scatter" in first_tags) == (not sp) and ("pp gather" in last_tags) == (not sp)


def _save_pp(axes, layout, cfg, root, m):
    mesh = dtp.make_mesh(**axes)
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), opt, mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    model, losses = llama.sequential(cfg), []
    for step in range(STEPS):
        state, metrics = dtp.train_step(model, state, dtp.shard_batch(_batch(cfg, step), state), microbatches=m)
        losses.append(metrics["loss"])
        if step == 0:
            dtp.checkpoint.save(state, root)
    return losses


def _load_pp(axes, layout, cfg, root, m):
    mesh = dtp.make_mesh(**axes)
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1)
    like = dtp.TrainState.create(llama.init(cfg, seed=1, dtype=torch.float64), opt, mesh=mesh, layout=layout,
                                 axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    state, _ = dtp.checkpoint.load(root, like=like)
    model, losses = llama.sequential(cfg), []
    for step in range(1, STEPS):
        state, metrics = dtp.train_step(model, state, dtp.shard_batch(_batch(cfg, step), state), microbatches=m)
        losses.append(metrics["loss"])
    return losses


@pytest.fixture(scope="module")
def pp2_checkpoint(tmp_path_factory) -> tuple[str, list[float]]:
    """The tied pp2 1f1b run's checkpoint after step 1 and its losses: one for both loads
    below, which only read it (it was trained once per load)."""
    root = str(tmp_path_factory.mktemp("pp2") / "ckpt")
    return root, run(_save_pp, {"pp": 2}, layouts.pipeline("1f1b"), _cfg(tie=True), root, 4, world_size=2)[0]


@pytest.mark.parametrize("into", ["pp1", "pp4"])
def test_a_pp2_checkpoint_loads_under_pp1_and_pp4(into, pp2_checkpoint):
    cfg, (root, want) = _cfg(tie=True), pp2_checkpoint
    axes, layout, world = ({"dp": 2}, layouts.data(), 2) if into == "pp1" else \
        ({"pp": 4}, layouts.pipeline("1f1b"), 4)
    got = run(_load_pp, axes, layout, cfg, root, 4, world_size=world)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[1:]), rtol=RTOL, atol=0)


def _mlp():
    """docs/pipeline-parallel.md's own (non-Llama) model: four tanh layers and an MSE loss, as layers."""
    model = dtp.Sequential([
        *(dtp.Layer(lambda p, x, b, k=k: torch.tanh((b["x"] if x is None else x) @ p[f"w{k}"]), (f"w{k}",))
          for k in range(4)),
        dtp.Layer(lambda p, x, b: ((x - b["y"]) ** 2).mean()),
    ])
    g = torch.Generator().manual_seed(0)
    params = {f"w{k}": torch.randn(16, 16, dtype=torch.float64, generator=g) * 0.3 for k in range(4)}
    axes = {f"w{k}": ("embed", "mlp") for k in range(4)}
    batch = {"x": torch.randn(8, 16, dtype=torch.float64, generator=g),
             "y": torch.randn(8, 16, dtype=torch.float64, generator=g)}
    return model, params, axes, batch


def _mlp_train(axes_of_mesh, layout):
    model, params, axes, batch = _mlp()
    state = dtp.TrainState.create(params, dtp.optim.sgd(0.1), mesh=dtp.make_mesh(**axes_of_mesh), layout=layout,
                                  axes=axes)
    losses = []
    for _ in range(STEPS):
        state, metrics = dtp.train_step(model, state, dtp.shard_batch(batch, state), microbatches=4)
        losses.append(metrics["loss"])
    return losses


def test_a_users_own_model_pipelines_the_same_way():
    want = run(_mlp_train, {"dp": 1}, layouts.data(), world_size=1)[0]
    got = run(_mlp_train, {"pp": 2, "dp": 2}, layouts.data() + layouts.pipeline("1f1b"), world_size=4)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0)


ZERO = {
    "pp2 x dp2 zero1 1f1b": ({"pp": 2, "dp": 2}, layouts.data() + layouts.zero(1, bucket_mb=1e-3) +
                             layouts.pipeline("1f1b"), {}, 2, 1.0),
    "pp2 x dp2 zero2 overlap-gather zb-h1": ({"pp": 2, "dp": 2}, layouts.data() + layouts.zero(
        2, bucket_mb=1e-3, overlap_param_gather=True) + layouts.pipeline("zb-h1"), {}, 4, None),
    "pp2 x dp2 zero1 interleaved": ({"pp": 2, "dp": 2}, layouts.data() + layouts.zero(1, bucket_mb=1e-3) +
                                    layouts.pipeline("interleaved", virtual_stages=2), {}, 2, None),
}
CASES.update(ZERO)


@pytest.mark.parametrize("name", list(ZERO))
def test_zero_1_and_2_under_each_stage_equal_one_device(name):
    test_pipeline_composes_and_equals_one_device(name)


def test_a_pp2_dp2_zero1_checkpoint_resumes_as_if_never_stopped(tmp_path):
    """The loaded optimizer state covers every stage: each rank's ZeRO cuts its stages'
    share into its buckets (it used to keep the per-parameter tree and fail in the update)."""
    cfg, root = _cfg(), str(tmp_path / "ckpt")
    axes, layout = {"pp": 2, "dp": 2}, layouts.data() + layouts.zero(1, bucket_mb=1e-3) + layouts.pipeline("1f1b")
    want = run(_save_pp, axes, layout, cfg, root, 2, world_size=4)[0]
    got = run(_load_pp, axes, layout, cfg, root, 2, world_size=4)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[1:]), rtol=RTOL, atol=0)


ORDER = {  # the mesh order the CLI never builds (RunConfig.mesh_axes puts pp first): dp outer
    "dp2 x pp2 zero1 1f1b": ({"dp": 2, "pp": 2}, layouts.data() + layouts.zero(1, bucket_mb=1e-3) +
                             layouts.pipeline("1f1b"), {}, 2, 1.0),
    "dp2 x pp2 zero2 gpipe": ({"dp": 2, "pp": 2}, layouts.data() + layouts.zero(2, bucket_mb=1e-3) +
                              layouts.pipeline("gpipe"), {}, 2, None),
}
CASES.update(ORDER)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ORDER))
def test_zero_under_stages_equals_one_device_whichever_axis_is_outer(name):
    test_pipeline_composes_and_equals_one_device(name)


def _pending_sum_on_the_wire():
    from torch.distributed.tensor import Partial
    from dtp.strategies import pipeline_wire as wire

    mesh = dtp.make_mesh(dp=1)
    x = DTensor.from_local(torch.ones(2, dtype=torch.float64), mesh, [Partial()])
    with pytest.raises(ValueError, match="only Replicate and Shard travel"):
        wire.header(x)
    return wire.read_header(wire.header(wire.sendable(x)), mesh)[2]


def test_a_pending_sum_is_reduced_before_its_header_is_written():
    """A Partial placement has no header code: sendable() reduces it (activations and,
    now, gradients alike); header() says so instead of an AttributeError."""
    assert run(_pending_sum_on_the_wire, world_size=1)[0] == (Replicate(),)


@pytest.mark.slow  # a world of 8 (~9 s each on 2 cores); pp2 × tp2 + sp and pp2 × dp2 are the default run's
@pytest.mark.parametrize("schedule,recompute", [("zb-h1", "full"), ("interleaved", "selective")])
def test_a_world_of_8_pp2_dp2_tp2_sp_with_recompute_equals_one_device(schedule, recompute):
    cfg = _cfg()
    layout = layouts.data() + layouts.megatron(True) + layouts.pipeline(
        schedule, virtual_stages=2 if schedule == "interleaved" else 1)
    got = run(_train, {"pp": 2, "dp": 2, "tp": 2}, layout, cfg, 2, 1.0, recompute, world_size=8)[0]
    _check(got, _reference(cfg, 2, 1.0))


def test_an_uneven_layer_split_equals_one_device():
    """layer_split: the embedding alone on stage 0, four blocks and the head on stage 1."""
    cfg = _cfg()
    got = run(_train, {"pp": 2}, layouts.pipeline("1f1b", layer_split=(1, 5)), cfg, 2, world_size=2)[0]
    _check(got, _reference(cfg, 2))


def _loss_tokens(m: int) -> tuple[int | None, float]:
    cfg = _cfg()
    mesh = dtp.make_mesh(pp=2)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), dtp.optim.sgd(0.1), mesh=mesh,
                                  layout=layouts.pipeline("1f1b"), axes=llama.param_axes(cfg),
                                  axis_sizes=llama.axis_sizes(cfg))
    batch = _batch(cfg, 0)
    batch["targets"][:, ::3] = dtp.ops.IGNORE_INDEX
    _, metrics = dtp.train_step(llama.sequential(cfg), state, dtp.shard_batch(batch, state), microbatches=m)
    return metrics["loss_tokens"], metrics["loss"]


def test_the_last_stage_reports_the_valid_targets_it_divided_by():
    # The count stays on the device through the schedule and is read with the loss (a
    # float from the schedule) and the norm at the step's end: the loss stage has it,
    # the other stage none.
    valid = 8 * (16 - len(range(0, 16, 3)))  # 8 rows of 16 targets, every third ignored
    (first, loss0), (last, loss1) = run(_loss_tokens, 2, world_size=2)
    assert (first, last) == (None, valid) and loss0 == loss1 > 0
