"""Mixed precision (``layouts.mixed_precision``, Megatron's recipe) under every layout: bf16
parameters compute, fp32 master weights and Adam moments are updated, gradients
accumulate over microbatches and are reduced in fp32. Each layout tracks an fp32
single-device run within the bound derived below, where pure bf16 does not; collectives
carry the same bytes as before except the fp32 gradient reduction; checkpoints keep the
master weights and resume across precision modes."""

import math

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.strategies.precision import MasterWeights
from dtp.strategies.zero import ZeroState
from dtp.step import value_and_grad
from dtp.testing import reference_value_and_grad, run

CFG = llama.config("tiny", n_layers=2, n_heads=8, n_kv_heads=4)
MODEL = llama.sequential(CFG)  # a loss_fn for every layout, the pipeline's stages included
LR, STEPS = 3e-3, 6
BF16 = torch.bfloat16

# The bound. bf16 keeps 8 significant bits: unit roundoff u = 2^-8. Mixed precision
# stores nothing in bf16 but the parameters and activations, so (1) each step's loss is
# the fp32 run's up to the rounding of the parameters and activations feeding it: a
# relative error of order u, of which random signs average most out — bound u/2
# (measured 0.19-0.22 u on every layout; pure bf16 0.92-0.98 u); (2) each weight tensor
# moves by Adam's normalised update lr·m/√v, which a relative gradient error δ changes by
# at most ~2δ of the move itself, and δ is a few u (bf16 products summed in fp32, rounded
# once per op; ≈ 7 u measured on the worst tensor) — so every tensor's master weights stay
# within 2·7·u ≈ 0.055 of the distance the fp32 run moved it (measured 0.042-0.053),
# bound 0.15. Pure bf16 loses every update below half an ulp of the weight (lr 3e-3 <
# 2^-9 for the norm weights at 1.0): they never move, an error of 1.0 of the move.
U = 2.0**-8
LOSS_RTOL, MOVED_RTOL = U / 2, 0.15

CASES = {
    "one": ({"dp": 1}, layouts.data(), 1),
    "dp2 m=2": ({"dp": 2}, layouts.data(), 2),
    "tp2 sp": ({"tp": 2}, layouts.data() + layouts.megatron(sequence_parallel=True), 1),
    "pp2 m=2": ({"pp": 2}, layouts.pipeline("1f1b"), 2),
    "dp2 zero1": ({"dp": 2}, layouts.data() + layouts.zero(1, bucket_mb=1e-3), 1),
}


def _batch() -> dict[str, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (8, 17), generator=torch.Generator().manual_seed(7))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _full(x: torch.Tensor) -> torch.Tensor:
    return (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone()


def _held(tree) -> dict[str, torch.Tensor]:
    """``path -> whole tensor`` of what this rank holds (a pipeline rank: its stage's)."""
    return {".".join(map(str, p)): _full(x) for p, x in zip(optree.tree_paths(tree), optree.tree_leaves(tree))}


def _zero_master(z: ZeroState) -> dict[str, torch.Tensor]:
    """ZeRO's fp32 master slices gathered and cut back into parameters (dp-only mesh)."""
    flats = [m.full_tensor() for m in z.master]
    out = {}
    for b in z.plan.buckets:
        for i, off in zip(b.members, b.offsets):
            out[z.leaves[i].path] = z.leaves[i].view(flats[b.index], off).clone()
    return out


def _records(log) -> list[tuple]:
    return [(r.kind, r.axis, r.tag, r.dtype, r.shape, r.bytes) for r in log.records]


def _train(name: str, mixed: bool) -> dict:
    axes, layout, m = CASES[name]
    mesh = dtp.make_mesh(**axes)
    layout = layout + (layouts.mixed_precision() if mixed else dtp.Layout())
    state = dtp.TrainState.create(llama.init(CFG, seed=0, dtype=BF16), dtp.optim.adamw(LR), mesh=mesh,
                                  layout=layout, axes=llama.param_axes(CFG), axis_sizes=llama.axis_sizes(CFG))
    losses, records = [], []
    for _ in range(STEPS):
        with dtp.comm_log() as log:
            state, metrics = dtp.train_step(MODEL, state, dtp.shard_batch(_batch(), state), microbatches=m)
        losses.append(metrics["loss"])
        records.append(_records(log))
    z = state.strategy
    master = (_zero_master(z) if isinstance(z, ZeroState) else _held(z.master) if isinstance(z, MasterWeights)
              else _held(state.params))
    moments = {x.dtype for x in optree.tree_leaves(state.opt_state) if x is not None and x.dim() > 0}
    params = _held(dtp.gather_params(state))
    return {"losses": losses, "master": master, "params": params, "moments": moments, "records": records[-1]}


def _merge(ranks: list[dict]) -> dict:
    """One result of every rank's: the losses (the same on every rank), and the union of
    what each holds (a pipeline's stages)."""
    out = dict(ranks[0])
    for key in ("master", "params"):
        out[key] = {k: v for r in ranks for k, v in r[key].items()}
    return out


def _reference():
    """The same steps on one device in fp32, from the bf16-rounded initial parameters."""
    init = optree.tree_map(lambda x: x.float(), llama.init(CFG, seed=0, dtype=BF16))
    params, opt = init, dtp.optim.adamw(LR)
    opt_state, losses = opt.init(params), []
    for _ in range(STEPS):
        loss, grads = reference_value_and_grad(MODEL, params, _batch())
        updates, opt_state = opt.update(grads, opt_state, params)
        params = dtp.optim.apply_updates(params, updates)
        losses.append(loss)
    return losses, _held(init), _held(params)


def _moved_error(actual: dict, expected: dict, start: dict) -> float:
    """The worst tensor's ||actual − expected|| / ||expected − start||: its error as a
    fraction of how far the fp32 run moved it."""
    def one(k: str) -> float:
        err = float((actual[k].double() - expected[k].double()).pow(2).sum())
        return math.sqrt(err / float((expected[k].double() - start[k].double()).pow(2).sum()))

    return max(one(k) for k in expected)


def _all_cases() -> dict:
    out = {}
    for name, (axes, _, _) in CASES.items():
        world = math.prod(axes.values())
        out[name] = _merge(run(_train, name, True, world_size=world))
        if name in ("dp2 m=2", "dp2 zero1", "pp2 m=2"):
            out[name + " pure"] = _merge(run(_train, name, False, world_size=world))
    return out


@pytest.fixture(scope="module")
def results():
    return _all_cases(), _reference()


@pytest.mark.parametrize("name", list(CASES))
def test_mixed_precision_tracks_an_fp32_reference_within_the_bound(results, name):
    got, (ref_losses, init, ref_params) = results[0][name], results[1]
    assert {x.dtype for x in got["params"].values()} == {BF16}, name
    assert {x.dtype for x in got["master"].values()} == {torch.float32} and got["moments"] == {torch.float32}, name
    for path, p in got["params"].items():  # the parameters are the master weights rounded, exactly
        assert torch.equal(p, got["master"][path].to(BF16)), (name, path)
    loss_err = max(abs(a - b) / b for a, b in zip(got["losses"], ref_losses))
    moved_err = _moved_error(got["master"], ref_params, init)
    assert loss_err <= LOSS_RTOL, f"{name}: loss rel error {loss_err:.2e} > {LOSS_RTOL:.2e}"
    assert moved_err <= MOVED_RTOL, f"{name}: master weights off by {moved_err:.3f} of the move > {MOVED_RTOL}"


@pytest.mark.parametrize("name", ["dp2 m=2", "pp2 m=2"])
def test_pure_bf16_does_not_meet_the_bound(results, name):
    got, (_, init, ref_params) = results[0][name + " pure"], results[1]
    assert _moved_error(got["params"], ref_params, init) > MOVED_RTOL, name


@pytest.mark.parametrize("name", ["dp2 m=2", "pp2 m=2", "dp2 zero1"])
def test_bytes_per_collective_are_pure_bf16s_but_the_fp32_gradient_reduction(results, name):
    mixed, pure = results[0][name]["records"], results[0][name + " pure"]["records"]
    if name == "dp2 zero1":  # ZeRO's buckets already were fp32: nothing changes
        assert mixed == pure
        return
    grads = [(r, q) for r, q in zip(mixed, pure) if r[2] == "grad reduce"]
    assert len(mixed) == len(pure) and (grads or "dp" not in name), name  # pp2 alone reduces over no dp
    assert [r for r in mixed if r[2] != "grad reduce"] == [q for q in pure if q[2] != "grad reduce"], name
    for r, q in grads:  # the same gradients, in fp32: twice the bytes
        assert r[3] == torch.float32 and q[3] == BF16 and r[4] == q[4] and r[5] == 2 * q[5], (name, r, q)


def _accumulation() -> tuple[bool, bool, torch.dtype]:
    mesh = dtp.make_mesh(dp=1)
    cfg = llama.config("tiny", n_layers=1)
    init = llama.init(cfg, seed=0, dtype=BF16)

    def state(layout):
        return dtp.TrainState.create(init, dtp.optim.adamw(LR), mesh=mesh, layout=layout, axes=llama.param_axes(cfg))

    loss = llama.sequential(cfg)
    tok = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(3))
    batch = {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}
    _, _, mixed = value_and_grad(loss, state(layouts.data() + layouts.mixed_precision()), batch, microbatches=4)
    _, _, pure = value_and_grad(loss, state(layouts.data()), batch, microbatches=4)
    # Each microbatch's bf16 gradient (of its mean weighted 1/4: a power of two, exact),
    # summed in fp32 in microbatch order: what the fp32 accumulator must hold, bit for bit.
    parts = [value_and_grad(loss, state(layouts.data()), {k: v[k_::4] for k, v in batch.items()})[2]
             for k_ in range(4)]
    want = optree.tree_map(lambda *g: sum((x.float() / 4 for x in g[1:]), g[0].float() / 4), *parts)
    exact = all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(mixed), optree.tree_leaves(want)))
    differs = any(not torch.equal(a.float(), b) for a, b in zip(optree.tree_leaves(pure), optree.tree_leaves(want)))
    return exact, differs, optree.tree_leaves(mixed)[0].dtype


def test_microbatch_gradients_accumulate_in_fp32():
    exact, pure_differs, dtype = run(_accumulation, world_size=1)[0]
    assert dtype == torch.float32 and exact  # the fp32 sum of the bf16 microbatch gradients, exactly
    assert pure_differs  # pure bf16 rounds every partial sum


# --------------------------------------------------------------------------- checkpoints

CKPT_CASES = {
    "dp2 mixed": ({"dp": 2}, layouts.data() + layouts.mixed_precision()),
    "dp2 pure": ({"dp": 2}, layouts.data()),
    "dp2 zero1": ({"dp": 2}, layouts.data() + layouts.zero(1, bucket_mb=1e-3)),
    "tp2 mixed": ({"tp": 2}, layouts.megatron(sequence_parallel=True) + layouts.mixed_precision()),
    "pp2 mixed": ({"pp": 2}, layouts.pipeline("1f1b") + layouts.mixed_precision()),
}


def _ckpt_state(name: str) -> dtp.TrainState:
    axes, layout = CKPT_CASES[name]
    return dtp.TrainState.create(llama.init(CFG, seed=0, dtype=BF16), dtp.optim.adamw(LR), mesh=dtp.make_mesh(**axes),
                                 layout=layout, axes=llama.param_axes(CFG), axis_sizes=llama.axis_sizes(CFG))


def _steps(state: dtp.TrainState, n: int) -> tuple[dtp.TrainState, list[float]]:
    losses = []
    for _ in range(n):
        state, metrics = dtp.train_step(MODEL, state, dtp.shard_batch(_batch(), state), microbatches=2)
        losses.append(metrics["loss"])
    return state, losses


def _save_and_resume(saved: str, loaded: str, root: str) -> tuple[list[float], list[float], list[str], dict]:
    state, _ = _steps(_ckpt_state(saved), 2)
    dtp.checkpoint.save(state, root)
    _, straight = _steps(state, 2)
    restored, _ = dtp.checkpoint.load(root, like=_ckpt_state(loaded))
    masters = _held(restored.strategy.master) if isinstance(restored.strategy, MasterWeights) else {}
    params = _held(restored.params)
    masters = {k: (m, torch.equal(m, params[k].float())) for k, m in masters.items()}  # (master, == the param)
    _, resumed = _steps(restored, 2)
    keys = sorted(k for k in dtp.checkpoint.read_manifest(root)["tensors"] if k.startswith("master/"))
    return straight, resumed, keys, masters


@pytest.mark.parametrize("saved,loaded", [("dp2 mixed", "dp2 mixed"), ("dp2 mixed", "dp2 zero1"),
                                          ("dp2 zero1", "tp2 mixed"), ("pp2 mixed", "dp2 mixed")])
def test_checkpoints_keep_the_master_weights_and_resume_bit_exact(saved, loaded, tmp_path):
    straight, resumed, keys, _ = run(_save_and_resume, saved, loaded, str(tmp_path / "c"), world_size=2)[0]
    assert keys and all(k.startswith("master/") for k in keys)  # every bf16 parameter's fp32 master weights
    if CKPT_CASES[saved][0] == CKPT_CASES[loaded][0]:
        assert resumed == straight  # same mesh: the same computation from the same fp32 state, bit for bit
    else:  # tp2 sums in another order; the state it starts from is the same
        assert max(abs(a - b) / b for a, b in zip(resumed, straight)) <= LOSS_RTOL


def test_resume_across_precision_modes():
    """pure → mixed: the master weights start as the bf16 parameters, exactly; mixed →
    pure: the parameters are the master weights rounded (what pure would have kept)."""
    import tempfile

    root = tempfile.mkdtemp()
    _, resumed, keys, masters = run(_save_and_resume, "dp2 pure", "dp2 mixed", root + "/a", world_size=2)[0]
    assert not keys and masters and {m.dtype for m, _ in masters.values()} == {torch.float32}
    assert all(same for _, same in masters.values())
    assert all(math.isfinite(x) for x in resumed)
    _, resumed, keys, _ = run(_save_and_resume, "dp2 mixed", "dp2 pure", root + "/b", world_size=2)[0]
    assert keys and all(math.isfinite(x) for x in resumed)


# --------------------------------------------------------------------------- the mesh's device


def test_a_one_device_run_computes_on_the_mesh_device():
    """On a fake npu (tests/scripts/fake_npu_device.py: tensors on "npu" computed on CPU),
    parameters, Adam moments, master weights and batches are on the mesh's device before
    and after two mixed-precision steps, and the losses are the CPU run's."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "fake_npu_train.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert "fake npu train ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


# --------------------------------------------------------------------------- float16


def _float16_adamw() -> tuple[str, bool, set[torch.dtype]]:
    mesh = dtp.make_mesh(dp=1)
    cfg = llama.config("tiny", n_layers=1)
    init, axes = llama.init(cfg, seed=0, dtype=torch.float16), llama.param_axes(cfg)
    with pytest.raises(ValueError) as pure:  # moments in fp16: g² underflows, eps=1e-8 rounds to 0
        dtp.TrainState.create(init, dtp.optim.adamw(LR), mesh=mesh, layout=layouts.data(), axes=axes)
    state = dtp.TrainState.create(init, dtp.optim.adamw(LR), mesh=mesh,
                                  layout=layouts.data() + layouts.mixed_precision(), axes=axes)
    tok = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(3))
    batch = {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}
    for _ in range(2):
        state, metrics = dtp.train_step(llama.sequential(cfg), state, batch)
    finite = all(bool(torch.isfinite(p).all()) for p in optree.tree_leaves(state.params))
    return str(pure.value), finite and math.isfinite(float(metrics["loss"])), \
        {x.dtype for x in optree.tree_leaves(state.opt_state) if x is not None and x.dim() > 0}


def test_float16_adamw_needs_master_weights():
    said, finite, moments = run(_float16_adamw, world_size=1)[0]
    assert said.startswith("adamw: float16 parameters make float16 moments, where (1 - b2)·g² underflows to 0 for "
                           "|g| below 0.005 and eps=1e-08 rounds to 0") and "layouts.mixed_precision()" in said
    assert finite and moments == {torch.float32}  # fp32 master weights and moments: no NaN
