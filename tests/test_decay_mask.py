"""Weight decay on the matrices only (Megatron's default ``no_weight_decay_cond``): sgd and
adamw with ``mask=dtp.optim.decay_matrices`` equal torch.optim with two param groups bit
for bit on one device, and every layout — ZeRO 1/2/3 (whose flat bucket slices mix
decayed and undecayed parameters), tp + sp, pipeline stages, pp × ZeRO — equals the
single-device run in fp64 after three steps."""

import optree
import pytest
import torch
from torch.distributed.tensor import DTensor

import dtp
from dtp import layouts
from dtp.models import llama
from dtp.testing import run

CFG = llama.config("tiny", n_layers=4, n_kv_heads=4)
STEPS = 3
RTOL = 1e-10
BUCKET = 0.02  # several buckets, each holding norms beside matrices


def _batch(step: int, b: int = 8) -> dict[str, torch.Tensor]:
    tok = torch.randint(0, CFG.vocab_size, (b, 17), generator=torch.Generator().manual_seed(70 + step))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _adamw(masked: bool = True) -> dtp.optim.GradientTransformation:
    # A large decay, so that decaying a norm or not moves it by far more than the tolerance.
    return dtp.optim.adamw(dtp.optim.warmup_cosine(1e-2, 1, 10), weight_decay=0.5,
                           mask=dtp.optim.decay_matrices if masked else None)


def _train(axes: dict, layout: dtp.Layout, m: int = 1, clip: float | None = None,
           masked: bool = True) -> dict:
    mesh = dtp.make_mesh(**axes)
    state = dtp.TrainState.create(llama.init(CFG, seed=0, dtype=torch.float64), _adamw(masked), mesh=mesh,
                                  layout=layout, axes=llama.param_axes(CFG), axis_sizes=llama.axis_sizes(CFG))
    model = llama.sequential(CFG)
    for step in range(STEPS):
        state, _ = dtp.train_step(model, state, dtp.shard_batch(_batch(step), state), microbatches=m, clip_norm=clip)
    return optree.tree_map(lambda x: (x.full_tensor() if isinstance(x, DTensor) else x).detach().clone(),
                           dtp.gather_params(state))


def _cases(world: int, cases: dict) -> dict:
    out = {name: _train(*case) for name, case in cases.items()}
    return out if torch.distributed.get_rank() == 0 else None


def _zero(stage: int, overlap: bool = True) -> dtp.Layout:
    return dtp.layouts.zero(stage=stage, bucket_mb=BUCKET, overlap_grad_reduce=overlap, overlap_param_gather=overlap)


def _reference(clip: float | None = None, masked: bool = True) -> dict:
    return run(_train, {"dp": 1}, layouts.data(), 1, clip, masked, world_size=1)[0]


def _check(got: dict, want: dict, name: str) -> None:
    for path, g, w in zip(optree.tree_paths(want), optree.tree_leaves(got), optree.tree_leaves(want)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=1e-13, msg=lambda msg: f"{name}, {path}: {msg}")


def test_masked_decay_is_torch_with_two_param_groups_bit_for_bit():
    torch.manual_seed(0)
    params = {"w": torch.randn(4, 3), "norm": torch.randn(3) + 1, "b": torch.randn(4)}
    for make, torch_opt, kw in [
        (dtp.optim.adamw, torch.optim.AdamW, dict(weight_decay=0.3)),
        (dtp.optim.sgd, torch.optim.SGD, dict(weight_decay=0.3, momentum=0.9, nesterov=True)),
    ]:
        opt = make(0.05, mask=dtp.optim.decay_matrices, **kw)
        ours, state = dict(params), opt.init(params)
        theirs = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        reference = torch_opt([{"params": [theirs["w"]]},
                               {"params": [theirs["norm"], theirs["b"]], "weight_decay": 0.0}], lr=0.05,
                              foreach=False, **kw)
        for step in range(3):
            grads = {k: torch.randn_like(v, generator=torch.Generator().manual_seed(step)) for k, v in params.items()}
            ours, state = dtp.optim.step(opt, grads, state, ours)
            for k, p in theirs.items():
                p.grad = grads[k].clone()
            reference.step()
        for k in params:
            assert torch.equal(ours[k].detach(), theirs[k].detach()), (make.__name__, k)
        # and the mask matters: the norm and bias are not where decaying them would take them
        everything, s = dict(params), make(0.05, **kw).init(params)
        for step in range(3):
            grads = {k: torch.randn_like(v, generator=torch.Generator().manual_seed(step)) for k, v in params.items()}
            everything, s = dtp.optim.step(make(0.05, **kw), grads, s, everything)
        assert torch.equal(everything["w"], ours["w"].detach())
        assert not torch.equal(everything["norm"], ours["norm"].detach())


def test_a_mask_not_shaped_like_the_params_is_refused():
    params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    opt = dtp.optim.adamw(0.1, weight_decay=0.1, mask={"w": True})
    with pytest.raises(ValueError, match="adamw: the weight-decay mask is not shaped like the params"):
        opt.update(params, opt.init(params), params)
    opt = dtp.optim.sgd(0.1, weight_decay=0.1, mask=lambda p: {"w": torch.tensor(True), "b": False})
    with pytest.raises(TypeError, match="sgd: a weight-decay mask's leaves are bools .* got Tensor"):
        opt.update(params, opt.init(params), params)


DP2 = {
    # clip None: each bucket updated as its reduce-scatter lands; clip 0.5: all at once
    "dp2 zero1": ({"dp": 2}, layouts.data() + _zero(1)),
    "dp2 zero2 clip": ({"dp": 2}, layouts.data() + _zero(2, overlap=False), 1, 0.5),
    "dp2 zero3 m2": ({"dp": 2}, layouts.data() + _zero(3), 2),
    "tp2 sp": ({"tp": 2}, layouts.data() + layouts.megatron(sequence_parallel=True)),
    "pp2 1f1b m2": ({"pp": 2}, layouts.pipeline("1f1b"), 2),
}
WORLD4 = {
    "dp2 tp2 sp zero3": ({"dp": 2, "tp": 2}, layouts.data() + layouts.megatron(sequence_parallel=True) + _zero(3), 2),
    "pp2 dp2 zero1": ({"pp": 2, "dp": 2}, layouts.data() + layouts.pipeline("1f1b") + _zero(1, overlap=False), 2),
}


@pytest.mark.parametrize("world, cases", [(2, DP2), (4, WORLD4)], ids=["world2", "world4"])
def test_masked_decay_on_every_layout_equals_one_device(world, cases):
    got = run(_cases, world, cases, world_size=world)[0]
    want = {clip: _reference(clip) for clip in (None, 0.5)}
    for name, case in cases.items():
        clip = case[3] if len(case) > 3 else None
        _check(got[name], want[clip], name)
    # The mask is applied, not ignored: decaying every leaf moves the norms elsewhere.
    unmasked = run(_train, {"dp": 1}, layouts.data(), 1, None, False, world_size=1)[0]
    assert not torch.allclose(unmasked["layers"][0]["attn_norm"], want[None]["layers"][0]["attn_norm"], rtol=1e-6)
