"""Checkpoints of the logical state: any layout loads any other and the loss continues
exactly (fp64, 1e-10), and on disk nothing half-written looks complete. Bad checkpoints
(missing, truncated, corrupt, crafted, of another model, optimizer or dtype) are rows of
the one bad-input table, tests/test_validation.py.

Each case trains ``K`` steps under layout A, saves, trains ``N`` more (the uninterrupted
run: other tests hold it to the single-device run); then a fresh state under layout B,
possibly on another world size, loads the checkpoint and trains the same ``N`` steps.
"""

import functools
import os
from pathlib import Path

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.testing import run

CFG = llama.config("tiny", n_layers=1, n_kv_heads=4)  # tp4 splits the kv heads too
LOSS = functools.partial(llama.loss, cfg=CFG)
K, N = 2, 2
RTOL = 1e-10


def _batch(step: int) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (8, 17), generator=torch.Generator().manual_seed(100 + step))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _layout(name: str) -> tuple[dict[str, int], dtp.Layout]:
    """Mesh axes and layout of a named case."""
    base = layouts.data() + layouts.megatron(sequence_parallel=True)
    return {
        "one": ({"dp": 1}, layouts.data()),
        "dp2": ({"dp": 2}, layouts.data()),
        "dp8": ({"dp": 8}, layouts.data()),
        "dp2_tp2_sp": ({"dp": 2, "tp": 2}, base),
        "tp4": ({"tp": 4}, layouts.megatron(sequence_parallel=False)),
        "tp2": ({"tp": 2}, layouts.megatron(sequence_parallel=False)),
        "dp4_zero1": ({"dp": 4}, layouts.data() + layouts.zero(stage=1, bucket_mb=1e-3)),
        "dp2_zero1": ({"dp": 2}, layouts.data() + layouts.zero(stage=1, bucket_mb=1e-3)),
        "dp2_zero3": ({"dp": 2}, layouts.data() + layouts.zero(stage=3, bucket_mb=1e-3)),
        "dp2_tp2_zero2": ({"dp": 2, "tp": 2}, base + layouts.zero(stage=2, bucket_mb=1e-3, overlap_param_gather=True)),
        "cp2_ring": ({"cp": 2}, layouts.data() + layouts.context(algo="ring")),
        "dp2_cp2_tp2": ({"dp": 2, "cp": 2, "tp": 2}, base + layouts.context(algo="ulysses")),
    }[name]


def _state(name: str, dtype: torch.dtype = torch.float64) -> dtp.TrainState:
    axes, layout = _layout(name)
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1)
    return dtp.TrainState.create(llama.init(CFG, seed=0, dtype=dtype), opt, mesh=dtp.make_mesh(**axes),
                                 layout=layout, axes=llama.param_axes(CFG), axis_sizes=llama.axis_sizes(CFG))


def _full(tree):
    return optree.tree_map(lambda x: (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone(), tree)


def _steps(state: dtp.TrainState, first: int, n: int) -> tuple[dtp.TrainState, list[float]]:
    losses = []
    for step in range(first, first + n):
        state, m = dtp.train_step(LOSS, state, dtp.shard_batch(_batch(step), state))
        losses.append(m["loss"])
    return state, losses


def _save_then_continue(name: str, root: str) -> tuple[list[float], dict]:
    state, _ = _steps(_state(name), 0, K)
    dtp.checkpoint.save(state, root, extra={"next_step": K})
    state, losses = _steps(state, K, N)
    return losses, _full(dtp.gather_params(state))


def _load_then_continue(name: str, root: str) -> tuple[list[float], dict, int]:
    state, extra = dtp.checkpoint.load(root, like=_state(name))
    assert state.step == K and extra == {"next_step": K}
    state, losses = _steps(state, K, N)
    return losses, _full(dtp.gather_params(state)), state.step


def _world(name: str) -> int:
    return max(1, int(torch.tensor(list(_layout(name)[0].values())).prod()))


def _on(name: str, fn, *args):
    return run(fn, name, *args, world_size=_world(name))[0]


RESHARDS = [
    ("dp2_tp2_sp", "tp4"),
    ("dp4_zero1", "dp2_zero3"),
    ("tp2", "cp2_ring"),
    ("dp2_tp2_zero2", "dp2"),
    ("tp2", "dp2_cp2_tp2"),
    ("one", "dp2_tp2_zero2"),
    ("dp2_zero3", "one"),
]


# The world of 8 (tp2 -> dp2 cp2 tp2: ~25 s on 2 cores) is the slow run's; the default
# run's reshards cover every axis at 2 and 4 ranks.
@pytest.mark.parametrize("saved,loaded", [
    pytest.param(a, b, id=f"{a}->{b}", marks=[pytest.mark.slow] if _world(b) == 8 or _world(a) == 8 else [])
    for a, b in RESHARDS])
def test_a_checkpoint_loads_into_another_layout_and_the_loss_continues_exactly(saved, loaded, tmp_path):
    root = str(tmp_path / "ckpt")
    want_losses, want_params = _on(saved, _save_then_continue, root)
    got_losses, got_params, step = _on(loaded, _load_then_continue, root)
    assert step == K + N
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=RTOL, atol=0)
    for got, want, path in zip(optree.tree_leaves(got_params), optree.tree_leaves(want_params),
                               optree.tree_paths(got_params)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-14, msg=lambda m: f"param {path}: {m}")


# --------------------------------------------------------------------------- same layout, bf16 master weights


def _resume_same(name: str, root: str, dtype: torch.dtype) -> tuple[list[float], list[float], bool]:
    state, _ = _steps(_state(name, dtype), 0, K)
    dtp.checkpoint.save(state, root)
    _, straight = _steps(state, K, N)
    restored, _ = dtp.checkpoint.load(root, like=_state(name, dtype))
    _, resumed = _steps(restored, K, N)
    saved = dtp.checkpoint.read_manifest(root)["tensors"]
    return straight, resumed, any(k.startswith("master/") for k in saved)


@pytest.mark.parametrize("name", ["dp2_zero1", "dp2"])
def test_bf16_resume_is_bit_exact_and_zero_keeps_its_fp32_master_weights(name, tmp_path):
    straight, resumed, has_master = run(_resume_same, name, str(tmp_path / "c"), torch.bfloat16, world_size=2)[0]
    assert resumed == straight  # bit-exact: the fp32 master weights and moments came back
    assert has_master == (name == "dp2_zero1")


# --------------------------------------------------------------------------- on disk


def _keep_and_partial(root: str) -> tuple[list[str], str | None, str | None]:
    state = _state("dp2")
    for step in range(4):
        state, _ = _steps(state, step, 1)
        dtp.checkpoint.save(state, root, keep=2)
    # A save that crashed mid-way leaves a .partial directory, never a complete-looking one.
    Path(root, "step_00000009.partial").mkdir(exist_ok=True)
    latest = dtp.checkpoint.latest(root)
    pending = dtp.checkpoint.save(state, root, async_save=True)  # step 4 again: replaced atomically
    state, _ = _steps(state, 4, 1)  # training goes on while it is written
    done = pending.wait()
    return sorted(os.listdir(root)), latest and latest.name, done.name


def test_keep_the_last_k_partial_saves_are_ignored_and_async_save_completes(tmp_path):
    names, latest, done = run(_keep_and_partial, str(tmp_path / "c"), world_size=2)[0]
    assert latest == "step_00000004"
    assert done == "step_00000004"
    assert names == ["step_00000003", "step_00000004", "step_00000009.partial"]


def _saves_after_going_back(root: str) -> tuple[list[str], list[str]]:
    """keep= pruned the oldest steps: after a run went back to an older checkpoint, its
    new save sat below the abandoned run's steps and was deleted at once (save returned
    a path that was gone). And a root one rank cannot write stopped that rank alone: the
    others waited in the save's first barrier until the timeout."""
    state = dtp.TrainState.create({"w": torch.ones(4)}, dtp.optim.sgd(0.1), mesh=dtp.make_mesh(dp=2),
                                  layout=layouts.data(), axes={"w": (None,)})
    ahead = state.replace(step=3)
    dtp.checkpoint.save(ahead, root)
    kept = dtp.checkpoint.save(state.replace(step=1), root, keep=2)
    first = sorted(os.listdir(root)) + [str(kept.exists())]
    dtp.checkpoint.save(state.replace(step=2), root, keep=1)
    second = sorted(os.listdir(root))
    mine = root if torch.distributed.get_rank() == 0 else "/proc/no-such-mount/ckpt"
    try:
        dtp.checkpoint.save(state, mine)
    except ValueError as e:
        second.append(str(e).split(" (")[0])
    return first, second


def test_keep_never_deletes_the_save_it_made_and_a_rank_that_cannot_write_stops_all(tmp_path):
    for first, second in run(_saves_after_going_back, str(tmp_path / "c"), world_size=2):
        assert first == ["step_00000001", "step_00000003", "True"]
        assert second[0] == "step_00000002" and len(second) == 2
        assert second[1].startswith("checkpoint.save: cannot write to /proc/no-such-mount/ckpt"), second


def _async_equals_sync(root: str) -> bool:
    state, _ = _steps(_state("dp2_tp2_zero2"), 0, K)
    pending = dtp.checkpoint.save(state, root + "/async", async_save=True)
    after, _ = _steps(state, K, 1)
    pending.wait()
    dtp.checkpoint.save(state, root + "/sync")
    a, _ = dtp.checkpoint.load(root + "/async", like=_state("dp2_tp2_zero2"))
    b, _ = dtp.checkpoint.load(root + "/sync", like=_state("dp2_tp2_zero2"))
    same = all(torch.equal(x.full_tensor(), y.full_tensor())
               for x, y in zip(optree.tree_leaves(a.params), optree.tree_leaves(b.params)))
    moments = all(torch.equal(x.full_tensor(), y.full_tensor())
                  for x, y in zip(optree.tree_leaves(a.opt_state), optree.tree_leaves(b.opt_state))
                  if isinstance(x, DTensor))
    return same and moments


def test_an_async_save_holds_the_state_it_was_given_while_training_goes_on(tmp_path):
    assert run(_async_equals_sync, str(tmp_path), world_size=4) == [True] * 4


# --------------------------------------------------------------------------- into a state that has trained


def _back_to_the_checkpoint(axes: dict[str, int], layout: dtp.Layout, root: str) -> tuple[list[float], list[float]]:
    """Save at step K, train on, then load the checkpoint into the live (stepped) state and
    train the same N steps again: a notebook going back. Under a pipeline a stepped state
    holds its stages' parameters only (the others None), and load refused it as "another
    model"."""
    cfg = llama.config("tiny", n_layers=2, n_kv_heads=4)
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.1)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), opt, mesh=dtp.make_mesh(**axes),
                                  layout=layout, axes=llama.param_axes(cfg))
    model = llama.sequential(cfg)

    def steps(state, first, n):
        losses = []
        for step in range(first, first + n):
            state, m = dtp.train_step(model, state, dtp.shard_batch(_batch(step), state), microbatches=2)
            losses.append(m["loss"])
        return state, losses

    state, _ = steps(state, 0, K)
    dtp.checkpoint.save(state, root)
    state, straight = steps(state, K, N)
    state, _ = dtp.checkpoint.load(root, like=state)
    state, again = steps(state, K, N)
    dtp.wait(state)
    return straight, again


@pytest.mark.parametrize("axes, layout", [
    ({"pp": 2}, layouts.pipeline("1f1b")),
    ({"pp": 2, "dp": 2}, layouts.data() + layouts.zero(stage=1, bucket_mb=1e-3) + layouts.pipeline("1f1b")),
], ids=["pp2", "pp2_dp2_zero1"])
def test_a_checkpoint_loads_into_a_pipeline_state_that_has_trained(axes, layout, tmp_path):
    world = 1
    for n in axes.values():
        world *= n
    for straight, again in run(_back_to_the_checkpoint, axes, layout, str(tmp_path / "c"), world_size=world):
        torch.testing.assert_close(torch.tensor(again), torch.tensor(straight), rtol=RTOL, atol=0)
