"""TrainState is plain data: reading a field never communicates, the pytree's leaves are
its tensors, and ``dtp.gather_params`` is the one call that waits for or gathers the
parameters; every strategy runs through the same ``train_step``."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import optree
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp.models import llama
from dtp.testing import assert_tree_close, run

CFG = llama.config("tiny")
LOSS = functools.partial(llama.loss, cfg=CFG)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (4, 17), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _full(x):
    return (x.full_tensor() if isinstance(x, DTensor) else x).detach()


def _reads(zero):
    """Per stage: collectives issued by reading every field and repr; by gather_params."""
    mesh = dtp.make_mesh(dp=2)
    layout = dtp.layouts.data() + (dtp.layouts.zero(**zero) if zero else dtp.Layout())
    state = dtp.TrainState.create(llama.init(CFG, seed=0, dtype=torch.float64), dtp.optim.adamw(1e-2),
                                  mesh=mesh, layout=layout, axes=llama.param_axes(CFG))
    fresh_leaves = len(optree.tree_leaves(state, namespace="dtp"))
    for step in range(2):
        state, _ = dtp.train_step(LOSS, state, dtp.shard_batch(_batch(step), state))
    with dtp.comm_log() as log:
        fields = (state.step, state.params, state.opt_state, state.strategy, state.layout, repr(state))
        leaves = optree.tree_leaves(state, namespace="dtp")
    reads = len(log.records)
    with dtp.comm_log() as log:
        params = dtp.gather_params(state)
    gathers = sorted({r.kind for r in log.records})
    tensors = all(isinstance(x, torch.Tensor) for x in leaves)
    stage3_params = fields[1] if zero and zero["stage"] == 3 else "n/a"
    return reads, gathers, tensors, fresh_leaves > 0, stage3_params, optree.tree_map(_full, params)


def test_reading_a_state_never_communicates_and_gather_params_is_explicit():
    def go():
        return [_reads(z) for z in (None, dict(stage=2, bucket_mb=1e-3, overlap_param_gather=True),
                                    dict(stage=3, bucket_mb=1e-3))]

    (plain, zero2, zero3) = run(go, world_size=2)[0]
    for name, (reads, gathers, tensors, fresh, _, _) in zip(("plain", "zero2", "zero3"), (plain, zero2, zero3)):
        assert reads == 0, name  # no attribute read, repr or flatten issues a collective
        assert tensors and fresh, name  # the pytree's leaves are tensors, from create on
    assert plain[1] == [] and zero2[1] == []  # waiting for in-flight gathers is no collective
    assert zero3[1] == ["all_gather"]  # stage 3 keeps slices: gathering them is the explicit collective
    assert zero3[4] is None  # and its state holds no whole parameters
    assert_tree_close(zero2[5], plain[5], rtol=1e-10)
    assert_tree_close(zero3[5], plain[5], rtol=1e-10)


def test_replace_keeps_fields_and_refuses_new_params_under_zero():
    def go():
        mesh = dtp.make_mesh(dp=2)
        state = dtp.TrainState.create(llama.init(CFG, seed=0), dtp.optim.sgd(0.1), mesh=mesh,
                                      layout=dtp.layouts.data() + dtp.layouts.zero(1), axes=llama.param_axes(CFG))
        state, _ = dtp.train_step(LOSS, state, dtp.shard_batch(_batch(0), state))
        later = state.replace(step=7)
        try:
            state.replace(params=state.params)
        except ValueError as e:
            return later.step, later.strategy is state.strategy, str(e)
        return later.step, later.strategy is state.strategy, ""

    step, same_zero, message = run(go, world_size=2)[0]
    assert step == 7 and same_zero
    assert "new parameters need a new state" in message


def test_state_zero_is_a_deprecated_alias_of_state_strategy():
    with dtp.testing.simulate(2):
        state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=dtp.make_mesh(dp=2),
                                      layout=dtp.layouts.data(), axes={"w": ("embed",)})
        with pytest.warns(DeprecationWarning, match="TrainState.strategy"):
            alias = state.zero
        with pytest.warns(DeprecationWarning, match="strategy="):
            replaced = state.replace(zero=dtp.strategies.PLAIN)
    assert alias is state.strategy is dtp.strategies.PLAIN and replaced.strategy is dtp.strategies.PLAIN


def _aux_per_microbatch():
    mesh = dtp.make_mesh(dp=1)
    state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=mesh,
                                  layout=dtp.layouts.data(), axes={"w": ("embed",)})

    def loss(p, b):
        return (p["w"] * b["x"]).sum(-1).mean(), {"rows": b["x"].shape[0]}

    batch = {"x": torch.arange(8.0).reshape(4, 2)}
    _, two = dtp.train_step(loss, state, batch, microbatches=2)
    _, one = dtp.train_step(loss, state, batch)
    return two["aux"], two["loss"], one["aux"], one["loss"]


def test_aux_of_every_microbatch_is_returned():
    """With microbatches > 1 the metrics carry each microbatch's aux (a count is not halved)."""
    two, loss2, one, loss1 = run(_aux_per_microbatch, world_size=1)[0]  # a rank of its own: no group left here
    assert two == ({"rows": 2}, {"rows": 2}) and loss2 == loss1 == 7.0
    assert one == {"rows": 4}


# Both ends take the same exit path (dtp.comm's handler); the default run keeps the plain
# exit, destroy_process_group first is the slow run's (a 2-rank process tree, ~14 s each).
@pytest.mark.parametrize("end", ["exit", pytest.param("destroy", marks=pytest.mark.slow)])
def test_a_loop_that_forgets_wait_still_exits_cleanly(end):
    """A user's loop under ZeRO-1 + overlap_param_gather that ends without dtp.wait: the
    last step's all-gathers are in flight when the script ends. Before dtp.comm waited for
    them at exit, 5 runs of 6 (both ends) trained and then aborted there ("terminate called
    without an active exception", exit 1; torch 2.13, gloo, 2 ranks, 2 cores)."""
    script = Path(__file__).parent / "scripts" / "loop_without_wait.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), *(["destroy"] if end == "destroy" else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert output.count("trained: loss") == 2, output
    assert "terminate called" not in output, output


def _unnamed_dims():
    """A dim whose logical axis is None is replicated (JAX / Flax's logical partitioning)."""
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(4, 8, generator=g, dtype=torch.float64),
              "w2": torch.randn(8, 4, generator=g, dtype=torch.float64)}
    batch = {"x": torch.randn(4, 4, generator=g, dtype=torch.float64)}

    def loss_fn(p, b):
        return (torch.tanh(b["x"] @ p["w1"]) @ p["w2"]).pow(2).mean()

    layout = dtp.layouts.data() + dtp.layouts.megatron()
    state = dtp.TrainState.create(params, dtp.optim.sgd(0.1), mesh=dtp.make_mesh(tp=2), layout=layout,
                                  axes={"w1": (None, "mlp"), "w2": ("mlp", None)})
    specs = {k: str(dtp.spec_of(v)) for k, v in state.params.items()}
    state, _ = dtp.train_step(loss_fn, state, dtp.shard_batch(batch, state))
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss_fn(ref, batch).backward()
    errors = {k: (_full(state.params[k]) - (ref[k] - 0.1 * ref[k].grad)).abs().max().item() for k in ref}
    try:
        dtp.TrainState.create(params, dtp.optim.sgd(0.1), mesh=dtp.make_mesh(tp=2), layout=layout,
                              axes={"w1": ("mlp",), "w2": ("mlp", None)})
        refused = ""
    except ValueError as e:
        refused = str(e)
    return specs, errors, refused


def test_a_logical_axis_of_none_is_a_replicated_dim():
    # Before: TrainState.create refused ("embed", None) with "logical axes ('embed', None) do
    # not match its shape (4, 2)" although the lengths match; only str names were accepted.
    for specs, errors, refused in run(_unnamed_dims, world_size=2):
        assert specs == {"w1": "P(None, 'tp')", "w2": "P('tp')"}, specs
        assert max(errors.values()) < 1e-12, errors
        assert "param w1: logical axes ('mlp',) do not match its shape (4, 8); give a tuple of 2" in refused, refused
