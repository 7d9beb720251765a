"""An MoE state saved under expert parallel loads under another ep size and on one
process, and the loss continues exactly (fp64)."""

import pytest
import torch

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.testing import run

CFG = llama.config("tiny-moe", n_layers=2)
MODEL = llama.sequential(CFG)


def _batch(step: int) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (8, 17), generator=torch.Generator().manual_seed(70 + step))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _state(axes: dict, seed: int = 0) -> dtp.TrainState:
    layout = layouts.data() + (layouts.expert() if "ep" in axes else dtp.Layout())
    return dtp.TrainState.create(llama.init(CFG, seed=seed, dtype=torch.float64), dtp.optim.adamw(1e-2),
                                 mesh=dtp.make_mesh(**axes), layout=layout, axes=llama.param_axes(CFG),
                                 axis_sizes=llama.axis_sizes(CFG))


def _save_and_continue(axes: dict, root: str) -> list[float]:
    state, losses = _state(axes), []
    for step in range(3):
        state, m = dtp.train_step(MODEL, state, dtp.shard_batch(_batch(step), state))
        losses.append(m["loss"])
        if step == 0:
            dtp.checkpoint.save(state, root)
    return losses[1:]


def _load_and_continue(axes: dict, root: str) -> list[float]:
    state, _ = dtp.checkpoint.load(root, like=_state(axes, seed=1))
    losses = []
    for step in range(1, 3):
        state, m = dtp.train_step(MODEL, state, dtp.shard_batch(_batch(step), state))
        losses.append(m["loss"])
    return losses


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory) -> tuple[str, list[float]]:
    """The dp2 × ep2 run's checkpoint after step 1 and its losses after it: one for both
    loads below, which only read it (it was trained once per load)."""
    root = str(tmp_path_factory.mktemp("moe-checkpoint") / "ckpt")
    return root, run(_save_and_continue, {"dp": 2, "ep": 2}, root, world_size=4)[0]


@pytest.mark.parametrize("into", [{"ep": 4}, {"dp": 1}])
def test_an_ep2_checkpoint_loads_under_ep4_and_one_process(into, ep2_checkpoint):
    root, want = ep2_checkpoint
    got = run(_load_and_continue, into, root, world_size=4 if "ep" in into else 1)[0]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-10, atol=0)
