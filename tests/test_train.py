"""train_step parity with the single-device run for data, tensor and sequence parallel
layouts; its lr and aux metrics against that run; Megatron-SP collectives in the comm
log; clear errors for bad splits."""

import functools
import math
import re

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp.models import llama
from dtp.testing import assert_tree_close, reference_value_and_grad, run

# GQA with heads and kv-heads that split 4 ways, so tp4 runs the same model.
CFG = llama.config("tiny", n_heads=8, n_kv_heads=4)
LOSS = functools.partial(llama.loss, cfg=CFG)


def _batch(b=8, s=16, seed=1):
    tok = torch.randint(0, CFG.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _layout(sp: bool) -> dtp.Layout:
    return dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=sp)


def _state(mesh_axes, sp, dtype, optimizer=None, context=None, cfg=CFG):
    mesh = dtp.make_mesh(**mesh_axes)
    layout = _layout(sp) + (dtp.layouts.context(**context) if context else dtp.Layout())
    return dtp.TrainState.create(llama.init(cfg, seed=0, dtype=dtype), optimizer or dtp.optim.sgd(0.1), mesh=mesh,
                                 layout=layout, axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))


def _parity(mesh_axes, sp, dtype, variants, context=None, cfg=CFG):
    from torch.distributed.tensor.debug import CommDebugMode

    loss_fn = LOSS if cfg is CFG else functools.partial(llama.loss, cfg=cfg)
    batch = _batch()
    ref_loss, ref_grads = reference_value_and_grad(loss_fn, llama.init(cfg, seed=0, dtype=dtype), batch)
    state = _state(mesh_axes, sp, dtype, context=context, cfg=cfg)
    placed = dtp.shard_batch(batch, state)
    rtol = dtp.testing.tolerance(dtype)[0]
    for microbatches, recompute in variants:
        with CommDebugMode() as seen, dtp.comm_log() as log:
            loss, _, grads = dtp.step.value_and_grad(loss_fn, state, placed, microbatches=microbatches,
                                                     recompute=recompute)
        # Every collective that ran went through dtp's recorded path: DTensor issued none of its own.
        # (CommDebugMode does not see point-to-point ops, which DTensor never issues.)
        collectives = len([r for r in log.records if r.kind != "send_recv"])
        assert seen.get_total_counts() == collectives, (seen.get_comm_counts(), collectives)
        what = f"{mesh_axes} sp={sp} microbatches={microbatches} recompute={recompute}"
        assert abs(loss - ref_loss) <= rtol * abs(ref_loss), (what, loss, ref_loss)
        assert_tree_close(grads, ref_grads, name=f"grads [{what}]")
    return True


VARIANTS = [(1, None), (2, None), (2, "full")]


@pytest.mark.parametrize("mesh_axes, sp", [
    ({"dp": 2}, False),
    ({"tp": 2}, False),
    ({"tp": 2}, True),
    ({"dp": 2, "tp": 2}, True),
    ({"tp": 4}, True),
    pytest.param({"dp": 2, "tp": 4}, True, marks=pytest.mark.slow),  # a world of 8
], ids=["dp2", "tp2", "tp2+sp", "dp2xtp2+sp", "tp4+sp", "dp2xtp4+sp"])
def test_loss_and_grads_match_single_device_fp64(mesh_axes, sp):
    ws = 1
    for n in mesh_axes.values():
        ws *= n
    assert all(run(_parity, mesh_axes, sp, torch.float64, VARIANTS, world_size=ws))


@pytest.mark.parametrize("context", [
    dict(algo="ring"),
    dict(algo="ring", load_balance=None),
    dict(algo="ulysses"),
    dict(algo="double_ring", window=2),
    dict(algo="hybrid", ulysses_degree=2),
    dict(algo="ring", head_chunks=1),
], ids=["ring", "ring-contiguous", "ulysses", "double_ring-w2", "hybrid-u2", "ring-one-chunk"])
def test_context_parallel_cp4_matches_single_device(context):
    assert all(run(_parity, {"cp": 4}, False, torch.float64, [(1, None)], context, world_size=4))


# Tied embeddings: the head is the transposed vocab-parallel embedding, so the embedding's
# gradient sums the lookup's (scattered rows) and the head's (a vocab-sharded matmul).
TIED = llama.config("tiny", n_heads=8, n_kv_heads=4, tie_embeddings=True)


# dp2 × tp2 + sp is the slow run's (1.6 s on 4 warm ranks, 3.0 s in a suite run): the tied
# gradient's sum is tp2 + sp's (vocab-parallel lookup and head), its reduction over dp
# dp2's, and dp2 × tp2 + sp reduces every other vocab-sharded parameter over dp the same
# way (test_loss_and_grads_match_single_device_fp64[dp2xtp2+sp]).
@pytest.mark.parametrize("mesh_axes, sp", [
    ({"dp": 2}, False),
    ({"tp": 2}, True),
    pytest.param({"dp": 2, "tp": 2}, True, marks=pytest.mark.slow),
], ids=["dp2", "tp2+sp", "dp2xtp2+sp"])
def test_tied_embeddings_match_single_device_fp64(mesh_axes, sp):
    ws = 1
    for n in mesh_axes.values():
        ws *= n
    assert all(run(_parity, mesh_axes, sp, torch.float64, VARIANTS, cfg=TIED, world_size=ws))


@pytest.mark.parametrize("mesh_axes", [{"cp": 2, "tp": 2},
                                       pytest.param({"dp": 2, "cp": 2, "tp": 2}, marks=pytest.mark.slow)],
                         ids=["cp2xtp2", "dp2xcp2xtp2"])  # a world of 8: ~40 s on 2 cores
def test_context_and_tensor_parallel_sp_match_single_device(mesh_axes):
    variants = [(1, None), (2, "full")]
    assert all(run(_parity, mesh_axes, True, torch.float64, variants, dict(algo="ring"),
                   world_size=math.prod(mesh_axes.values())))


def test_selective_recompute_and_fp32():
    assert all(run(_parity, {"dp": 2, "tp": 2}, True, torch.float64, [(2, "selective")], world_size=4))
    assert all(run(_parity, {"dp": 2, "tp": 2}, True, torch.float32, [(2, None)], world_size=4))  # within 1e-5


def _adamw():
    return dtp.optim.adamw(dtp.optim.warmup_cosine(3e-3, 1, 3), weight_decay=0.1)


def _three_adamw_steps(mesh_axes, sp):
    state = _state(mesh_axes, sp, torch.float64, _adamw())
    first = state
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # step count; 1-device params
    before = [local(p).clone() for p in optree.tree_leaves((first.params, first.opt_state))]
    for step in range(3):
        state, metrics = dtp.train_step(LOSS, state, dtp.shard_batch(_batch(seed=step), state),
                                        microbatches=2, clip_norm=0.05)
    after = [local(p) for p in optree.tree_leaves((first.params, first.opt_state))]
    assert first.step == 0 and all(torch.equal(a, b) for a, b in zip(before, after))  # inputs untouched
    leaves = optree.tree_leaves(state, namespace="dtp")  # the state is a pytree
    assert len(leaves) == len(optree.tree_leaves(state.params)) + len(optree.tree_leaves(state.opt_state))
    return optree.tree_map(lambda p: local(p.full_tensor() if isinstance(p, DTensor) else p).detach(), state.params), metrics


def test_three_adamw_steps_with_clipping_match_single_device():
    # Single device: plain tensors, no mesh, no DTensor.
    params = llama.init(CFG, seed=0, dtype=torch.float64)
    opt = _adamw()
    opt_state = opt.init(params)
    for step in range(3):
        _, grads = reference_value_and_grad(LOSS, params, _batch(seed=step))
        grads, norm = dtp.optim.clip_by_global_norm(grads, 0.05)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
    assert float(norm) > 0.05  # clipping was active
    got, metrics = run(_three_adamw_steps, {"dp": 2, "tp": 2}, True, world_size=4)[0]
    assert metrics["grad_norm"] == pytest.approx(float(norm), rel=1e-10)
    assert_tree_close(got, params, name="params after 3 steps")
    # A mesh of one device keeps plain tensors (no DTensor dispatch): same numbers.
    got, metrics = run(_three_adamw_steps, {"dp": 1}, False, world_size=1)[0]
    assert_tree_close(got, params, name="params after 3 steps on one device")


# metrics["lr"] and a loss_fn's aux, against the single-device run. The schedule warms up
# from 0 at step 0, so there the update (weight decay included) is zero in both runs.
SCHEDULE = dtp.optim.warmup_cosine(3e-3, 1, 3)  # 0, the peak 3e-3, then 1.5e-3 half-way down
LR_AUX_STEPS = 3
LR_AUX_CASES = [  # (name, zero options, clip_norm)
    ("replicated", None, 0.05),
    ("zero 1, per-bucket update", dict(stage=1, bucket_mb=0.02, overlap_grad_reduce=True), None),
    ("zero 3, clipped", dict(stage=3, bucket_mb=0.02, overlap_grad_reduce=True, overlap_param_gather=True), 0.05),
]


def _aux(batch):
    """What the loss_fn reports besides its loss: the tokens it saw, and a fresh object to
    check identity by."""
    return {"tokens": int(batch["tokens"].numel()), "marker": object()}


def _loss_with_aux(params, batch):
    return LOSS(params, batch), _aux(batch)


def _lr_and_aux(cases):
    out = []
    for name, zero, clip in cases:
        layout = _layout(True) + (dtp.layouts.zero(**zero) if zero else dtp.Layout())
        state = dtp.TrainState.create(llama.init(CFG, seed=0, dtype=torch.float64),
                                      dtp.optim.adamw(SCHEDULE, weight_decay=0.1), mesh=dtp.make_mesh(dp=2, tp=2),
                                      layout=layout, axes=llama.param_axes(CFG), axis_sizes=llama.axis_sizes(CFG))
        given = []

        def loss_fn(params, batch):
            loss, aux = _loss_with_aux(params, batch)
            given.append(aux)
            return loss, aux

        steps = []
        for step in range(LR_AUX_STEPS):
            state, m = dtp.train_step(loss_fn, state, dtp.shard_batch(_batch(seed=step), state), clip_norm=clip)
            assert m["aux"] is given[-1], name  # returned as given: the very object
            steps.append((m["lr"], m["loss"], m["aux"]["tokens"]))
        params = optree.tree_map(lambda p: (p.full_tensor() if isinstance(p, DTensor) else p).detach(),
                                 dtp.gather_params(state))
        out.append((steps, params))
    return out


def _lr_and_aux_reference(clip):
    params = llama.init(CFG, seed=0, dtype=torch.float64)
    opt = dtp.optim.adamw(SCHEDULE, weight_decay=0.1)
    opt_state, steps = opt.init(params), []
    for step in range(LR_AUX_STEPS):
        batch = _batch(seed=step)
        loss, grads = reference_value_and_grad(_loss_with_aux, params, batch)
        if clip is not None:
            grads, _ = dtp.optim.clip_by_global_norm(grads, clip)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
        steps.append((SCHEDULE(step), loss, _aux(batch)["tokens"]))
    return steps, optree.tree_map(torch.Tensor.detach, params)


def test_metrics_lr_and_aux_match_the_reference_replicated_and_zero():
    results = run(_lr_and_aux, LR_AUX_CASES, world_size=4)[0]
    assert [SCHEDULE(k) for k in range(LR_AUX_STEPS)] == [0.0, 3e-3, 1.5e-3]
    for (name, _, clip), (steps, params) in zip(LR_AUX_CASES, results):
        ref_steps, ref_params = _lr_and_aux_reference(clip)
        for k, ((lr, loss, tokens), (ref_lr, ref_loss, ref_tokens)) in enumerate(zip(steps, ref_steps)):
            assert lr == ref_lr, (name, k, lr, ref_lr)  # the schedule at the step, exactly
            assert loss == pytest.approx(ref_loss, rel=1e-10), (name, k)
            assert tokens == ref_tokens == 8 * 16, (name, k, tokens)  # the global batch's tokens
        # The parameters match a run that applied exactly those lrs (0 at step 0).
        assert_tree_close(params, ref_params, name=f"{name}: params after {LR_AUX_STEPS} steps")


def _sp_comm(b, s):
    state = _state({"tp": 2}, True, torch.float32)
    with dtp.comm_log() as log:
        dtp.step.value_and_grad(LOSS, state, dtp.shard_batch(_batch(b, s), state))
    return [(r.kind, r.axis, r.bytes, r.tag) for r in log.records]


def test_sequence_parallel_comm_is_megatron_sp():
    b, s, tp = 8, 16, 2
    records = run(_sp_comm, b, s, world_size=2)[0]
    act = b * (s // tp) * CFG.dim * 4  # one rank's residual-stream shard, fp32
    block_edges = {"attn_in", "mlp_in", "head_in"}
    gathers = [r for r in records if r[0] == "all_gather"]
    scatters = [r for r in records if r[0] == "reduce_scatter"]
    # Forward: an all-gather entering each attention/MLP (and the head); a reduce-scatter
    # leaving each (and the embedding). Backward: the mirror image.
    assert sorted(r[3] for r in gathers if r[3] in block_edges) == sorted(["attn_in", "mlp_in"] * CFG.n_layers + ["head_in"])
    assert sorted(r[3] for r in scatters if not r[3].endswith("backward")) == sorted(
        ["attn_out", "mlp_out"] * CFG.n_layers + ["embed_out"])
    assert len([r for r in gathers if r[3].endswith("backward")]) == 2 * CFG.n_layers + 1
    assert len([r for r in scatters if r[3].endswith("backward")]) == 2 * CFG.n_layers + 1
    for kind, axis, nbytes, tag in gathers + scatters:
        assert axis == "tp"
        if tag.split()[0] in block_edges | {"attn_out", "mlp_out", "embed_out"}:
            assert nbytes == (tp - 1) * act if kind == "all_gather" else nbytes == (tp - 1) * act, (kind, tag, nbytes)
    # No all-reduce of activations: only per-token loss scalars and small gradients.
    for kind, axis, nbytes, tag in records:
        if kind == "all_reduce":
            assert tag in {"cross_entropy max", "cross_entropy", "loss", "grad reduce"}, tag
            assert nbytes < act, (tag, nbytes)
    # The full logits are never gathered.
    logits_bytes = b * s * CFG.vocab_size * 4 // tp
    assert all(n < logits_bytes for k, _, n, _ in records if k == "all_gather")


def _bad(kind):
    if kind == "heads":
        cfg = llama.config("tiny", n_heads=6, n_kv_heads=6, dim=48)
    elif kind == "kv_heads":
        cfg = llama.config("tiny", n_heads=4, n_kv_heads=1)
    elif kind == "vocab":
        cfg = llama.config("tiny", n_kv_heads=4, vocab_size=255)
    mesh = dtp.make_mesh(tp=4)
    dtp.TrainState.create(llama.init(cfg), dtp.optim.sgd(0.1), mesh=mesh, layout=_layout(True),
                          axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))


@pytest.mark.parametrize("kind, message", [
    ("heads", r"heads=6 is not divisible by tp=4"),
    ("kv_heads", r"kv_heads=1 is not divisible by tp=4"),
    ("vocab", r"vocab=255 is not divisible by tp=4"),
])
def test_bad_tp_splits_are_clear_errors_on_every_rank(kind, message):
    with pytest.raises(dtp.testing.RankError, match=r"failed on ranks \[0, 1, 2, 3\]") as e:
        run(_bad, kind, world_size=4)
    assert re.search(message, str(e.value))


def _bad_batch():
    state = _state({"dp": 2}, False, torch.float32)
    dtp.train_step(LOSS, state, dtp.shard_batch(_batch(b=6), state), microbatches=2)


def test_batch_must_divide_by_dp_times_microbatches():
    with pytest.raises(dtp.testing.RankError, match=r"batch size 6, not divisible by the batch split 2 × microbatches 2 = 4"):
        run(_bad_batch, world_size=2)


def _bad_context(context, mesh_axes):
    _state(mesh_axes, False, torch.float32, context=context)


@pytest.mark.parametrize("context, mesh_axes, message", [
    # The one double-ring window rule (issue 15: "[1, cp)" contradicted "window > 1").
    (dict(algo="double_ring", window=3), {"cp": 4}, r"got window=3 at cp=4 \(valid: \[2\]\)"),
    (dict(algo="double_ring", window=4), {"cp": 4}, r"got window=4 at cp=4 \(valid: \[2\]\)"),
    (dict(algo="hybrid", ulysses_degree=4), {"cp": 4}, r"ring degree cp/ulysses_degree > 1"),
    (dict(algo="hybrid", ulysses_degree=3), {"cp": 4}, r"cp=4 divisible by ulysses_degree=3"),
    (dict(algo="ulysses"), {"cp": 2, "tp": 2}, None),  # heads 8 / (2 × 2): fine
    (dict(algo="ring", head_chunks=3), {"cp": 4}, r"head_chunks=3 must divide the 4 kv heads each rank"),
    (dict(algo="ulysses", head_chunks=2), {"cp": 4}, r"head_chunks=2 must divide the 1 kv heads.*Ulysses degree 4"),
    (dict(algo="hybrid", ulysses_degree=2, head_chunks=2), {"cp": 4}, None),  # 4 kv heads / 2 per rank
])
def test_context_rules_are_checked_at_create(context, mesh_axes, message):
    if message is None:
        run(_bad_context, context, mesh_axes, world_size=4)
        return
    with pytest.raises(dtp.testing.RankError, match=message):
        run(_bad_context, context, mesh_axes, world_size=4)


def test_context_preset_rejects_bad_options():
    with pytest.raises(ValueError, match="algo must be one of"):
        dtp.layouts.context("spiral")
    with pytest.raises(ValueError, match="double_ring needs window > 1"):
        dtp.layouts.context("double_ring")
    with pytest.raises(ValueError, match="hybrid needs ulysses_degree > 1"):
        dtp.layouts.context("hybrid")
    with pytest.raises(ValueError, match="head_chunks must be an integer >= 1"):
        dtp.layouts.context("ring", head_chunks=0)
