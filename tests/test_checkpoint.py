"""Checkpoints of the logical state: any layout loads any other and the loss continues
exactly (fp64, 1e-10), on disk nothing half-written looks complete, and bad checkpoints
are a ValueError on every rank before anything is read.

Each case trains ``K`` steps under layout A, saves, trains ``N`` more (the uninterrupted
run: other tests hold it to the single-device run); then a fresh state under layout B,
possibly on another world size, loads the checkpoint and trains the same ``N`` steps.
"""

import functools
import json
import os
import tempfile
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
]


@pytest.mark.parametrize("saved,loaded", RESHARDS, ids=[f"{a}->{b}" for a, b in RESHARDS])
def test_a_checkpoint_loads_into_another_layout_and_the_loss_continues_exactly(saved, loaded, tmp_path):
    root = str(tmp_path / "ckpt")
    want_losses, want_params = _on(saved, _save_then_continue, root)
    got_losses, got_params, step = _on(loaded, _load_then_continue, root)
    assert step == K + N
    torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(want_losses), rtol=RTOL, atol=0)
    for got, want, path in zip(optree.tree_leaves(got_params), optree.tree_leaves(want_params),
                               optree.tree_paths(got_params)):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-14, msg=lambda m: f"param {path}: {m}")
