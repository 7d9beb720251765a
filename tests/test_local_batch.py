"""Local batch mode (:mod:`dtp.strategies.local`): where the layout splits only the batch,
the replicated and ZeRO runs compute on plain local tensors. Three fp64 steps equal the
single-device run (loss and parameters) for dp 2 (microbatches 1 and 2), ZeRO 1/2/3,
dp 4 (``-m slow``) and an MoE model at dp 2, with masked targets; the collectives are those
of the DTensor run, byte for byte; a loss function not marked ``batch_local`` keeps DTensors."""

import functools

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp import strategies
from dtp.models import llama
from dtp.ops.local_batch import batch_local, is_batch_local
from dtp.testing import assert_tree_close, reference_value_and_grad, run

CFG = llama.config("tiny", n_layers=1)
MOE = llama.config("tiny-moe", n_layers=2, aux_loss_coeff=0.01, z_loss_coeff=0.001)
STEPS = 3


def _batch(cfg, step, b=8, s=16):
    tok = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(step))
    batch = {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}
    batch["targets"][: 3, : 5] = -100  # loss masks: ranks hold different valid counts
    batch["targets"][5] = -100
    return batch


def _layout(zero):
    return dtp.layouts.data() + (dtp.layouts.zero(zero, bucket_mb=0.02) if zero else dtp.Layout())


def _full(x):
    return (x.full_tensor() if isinstance(x, DTensor) else x).detach()


def _steps(cfg, zero, microbatches, loss_fn=None, recompute=None):
    mesh = dtp.make_mesh(dp=torch.distributed.get_world_size())
    loss_fn = loss_fn or functools.partial(llama.loss, cfg=cfg)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), dtp.optim.adamw(1e-2), mesh=mesh,
                                  layout=_layout(zero), axes=llama.param_axes(cfg))
    local = strategies.begin(state.params, state.strategy, microbatches, loss_fn=loss_fn, layout=state.layout,
                             mesh=mesh).local
    losses = []
    with dtp.comm_log() as log:
        for step in range(STEPS):
            state, metrics = dtp.train_step(loss_fn, state, dtp.shard_batch(_batch(cfg, step), state),
                                            microbatches=microbatches, recompute=recompute)
            losses.append(metrics["loss"])
    records = sorted((r.kind, r.tag, r.axis, r.bytes) for r in log.records)
    return optree.tree_map(_full, dtp.gather_params(state)), losses, local is not None, records


def _cases(cases):
    out = [_steps(*case) for case in cases]
    return out if torch.distributed.get_rank() == 0 else None


@functools.lru_cache(maxsize=2)
def _reference(cfg):
    params = llama.init(cfg, seed=0, dtype=torch.float64)
    opt = dtp.optim.adamw(1e-2)
    opt_state, losses = opt.init(params), []
    for step in range(STEPS):
        loss, grads = reference_value_and_grad(functools.partial(llama.loss, cfg=cfg), params, _batch(cfg, step))
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
        losses.append(loss)
    return optree.tree_map(torch.Tensor.detach, params), losses


def _check(cases, results):
    for (cfg, zero, mb, *rest), (params, losses, local, _) in zip(cases, results):
        what = f"experts={cfg.num_experts} zero={zero} microbatches={mb} {rest}"
        ref, ref_losses = _reference(cfg)
        assert local, what
        assert losses == pytest.approx(ref_losses, rel=1e-10, abs=0), what
        assert_tree_close(params, ref, name=what, rtol=1e-10, atol=1e-12)


DP2 = [(CFG, None, 1), (CFG, None, 2), (CFG, 1, 1), (CFG, 2, 2), (CFG, 3, 1), (CFG, 3, 2), (MOE, None, 1),
       (MOE, 3, 1), (CFG, 3, 2, None, "full")]  # the last: blocks recomputed in backward read their buckets again


def test_local_mode_matches_single_device_dp2():
    results = run(_cases, DP2, world_size=2)[0]
    _check(DP2, results)


DP4 = [(CFG, None, 1), (CFG, 3, 2)]


# The slow run's: dp 4 runs dp 2's two cases (replicated, ZeRO-3 on two microbatches) with
# each rank's rows and slices halved again; test_zero.py's dp4 trains llama.loss (batch
# local) in local mode at dp 4 too, ZeRO 1/2/3 and plain, against one device (this test:
# 1.0 s on warm ranks, measured on torch 2.13, 2 cores).
@pytest.mark.slow
def test_local_mode_matches_single_device_dp4():
    _check(DP4, run(_cases, DP4, world_size=4)[0])


def _bytes_both(cfg, zero):
    """The same steps with the marked loss (local) and an unmarked copy of it (DTensors)."""
    unmarked = lambda params, batch: llama.loss(params, batch, cfg)  # noqa: E731
    local, dtensor = _steps(cfg, zero, 2), _steps(cfg, zero, 2, unmarked)
    return (local[2], dtensor[2], local[3] == dtensor[3], local[1], dtensor[1]) \
        if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("cfg,zero", [(CFG, None), (CFG, 3), (MOE, 2)], ids=["dp", "zero3", "moe-zero2"])
def test_same_collectives_as_dtensor_mode_and_unmarked_loss_keeps_dtensors(cfg, zero):
    local, dtensor, same, local_losses, dtensor_losses = run(_bytes_both, cfg, zero, world_size=2)[0]
    assert local and not dtensor  # only a batch_local loss_fn runs on plain tensors
    assert same  # every collective: kind, tag, axis and bytes
    assert local_losses == pytest.approx(dtensor_losses, rel=1e-12)


def test_batch_local_marks_llama_losses():
    assert is_batch_local(functools.partial(llama.loss, cfg=CFG)) and is_batch_local(llama.sequential(CFG))
    assert not is_batch_local(lambda params, batch: 0.0)
    assert is_batch_local(batch_local(lambda params, batch: 0.0))
