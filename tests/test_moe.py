"""MoE on one device: route() against Megatron-core's formulas on seeded logits (top-k
then softmax, pre_softmax, capacity dropping, selection bias), the aux and z losses,
the batched experts against a per-expert loop, the MoE Llama training on one device
with its aux loss reaching the router, and dp2 (experts replicated) equal to one device
in fp64."""

import functools
import math

import pytest
import torch
import torch.nn.functional as F

import dtp
from dtp.models import llama
from dtp.ops import moe
from dtp.testing import assert_tree_close, reference_value_and_grad, run

T, E, K = 16, 4, 2


def _logits(seed=0, t=T, e=E, dtype=torch.float64):
    return torch.randn(t, e, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_default_route_is_topk_on_logits_then_softmax_over_the_k():
    logits = _logits()
    r = moe.route(logits, K)
    top = torch.topk(logits, K, dim=-1)
    assert torch.equal(r.experts, top.indices)
    torch.testing.assert_close(r.weights, torch.softmax(top.values, -1), rtol=1e-14, atol=0)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(T, dtype=torch.float64))
    torch.testing.assert_close(r.probs, torch.softmax(logits, -1))
    assert torch.equal(r.counts, torch.bincount(top.indices.reshape(-1), minlength=E))
    assert bool(r.kept.all()) and float(r.dropped_fraction) == 0.0


def test_pre_softmax_routes_softmax_then_topk_without_renormalising():
    logits = _logits(1)
    r = moe.route(logits, K, pre_softmax=True)
    top = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    assert torch.equal(r.experts, top.indices)
    torch.testing.assert_close(r.weights, top.values, rtol=1e-14, atol=0)
    assert bool((r.weights.sum(-1) < 1).all())


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_capacity_keeps_each_experts_highest_weight_tokens_unrenormalised(pre_softmax):
    logits, cf = _logits(2), 0.5
    full = moe.route(logits, K, pre_softmax=pre_softmax)
    r = moe.route(logits, K, pre_softmax=pre_softmax, capacity_factor=cf)
    capacity = math.ceil(T * K / E * cf)
    expected = torch.zeros(T, K, dtype=torch.bool)
    for e in range(E):  # each expert, by hand: its routed tokens, best weight first
        routed = [(float(full.weights[t, j]), t, j) for t in range(T) for j in range(K) if full.experts[t, j] == e]
        for _, t, j in sorted(routed, reverse=True)[:capacity]:
            expected[t, j] = True
    assert torch.equal(r.kept, expected)
    assert torch.equal(r.experts, full.experts) and torch.equal(r.counts, full.counts)  # counts before dropping
    torch.testing.assert_close(r.weights, full.weights * expected, rtol=0, atol=0)  # survivors not renormalised
    assert float(r.dropped_fraction) == pytest.approx(1 - expected.sum().item() / (T * K))
    assert float(r.dropped_fraction) > 0


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_bias_changes_selection_not_weights(pre_softmax):
    logits = _logits(3)
    bias = torch.tensor([5.0, 0.0, 0.0, -5.0], dtype=torch.float64)  # always pick 0, never 3
    r = moe.route(logits, K, pre_softmax=pre_softmax, bias=bias)
    scores = torch.softmax(logits, -1) if pre_softmax else logits
    ids = torch.topk(scores + bias, K, dim=-1).indices
    assert torch.equal(r.experts, ids)
    assert bool((r.experts == 0).any(-1).all()) and not bool((r.experts == 3).any())
    chosen = scores.gather(-1, ids)  # the unbiased scores
    torch.testing.assert_close(r.weights, chosen if pre_softmax else torch.softmax(chosen, -1), rtol=1e-14, atol=0)


def test_load_balancing_and_z_loss_match_the_formulas():
    logits = _logits(4).requires_grad_(True)
    r = moe.route(logits, K)
    coeff = 1e-2
    aux = moe.load_balancing_loss(r.probs, r.counts, K, coeff)
    p = torch.softmax(logits, -1)
    expected = sum(p[:, i].sum() * r.counts[i] for i in range(E)) * E * coeff / (K * T * T)
    torch.testing.assert_close(aux, expected, rtol=1e-14, atol=0)
    z = moe.z_loss(logits, 1e-3)
    torch.testing.assert_close(z, 1e-3 * (torch.logsumexp(logits, -1) ** 2).mean(), rtol=1e-14, atol=0)
    (g,) = torch.autograd.grad(aux, logits)
    assert float(g.abs().sum()) > 0  # the balance loss reaches the router's logits


def test_update_bias_nudges_by_sign_of_mean_minus_load():
    bias = torch.tensor([0.5, 0.0, -0.5, 0.0])
    load = torch.tensor([10.0, 2.0, 2.0, 6.0])  # mean 5
    torch.testing.assert_close(moe.update_bias(bias, load, 0.25), torch.tensor([0.25, 0.25, -0.25, -0.25]))


def test_batched_experts_equal_a_per_expert_loop():
    g = torch.Generator().manual_seed(5)
    d, f = 8, 6
    counts = torch.tensor([3, 0, 5, 1])
    x = torch.randn(int(counts.sum()), d, generator=g, dtype=torch.float64, requires_grad=True)
    w = [torch.randn(E, *s, generator=g, dtype=torch.float64, requires_grad=True) for s in ((d, f), (d, f), (f, d))]
    out = moe.experts(x, counts, *w)
    chunks, start = [], 0
    for e, n in enumerate(counts.tolist()):
        xe = x[start:start + n]
        chunks.append((F.silu(xe @ w[0][e]) * (xe @ w[1][e])) @ w[2][e])
        start += n
    loop = torch.cat(chunks)
    torch.testing.assert_close(out, loop, rtol=1e-14, atol=1e-14)
    seed = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ga = torch.autograd.grad((out * seed).sum(), [x, *w])
    gb = torch.autograd.grad((loop * seed).sum(), [x, *w])
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_moe_ffn_equals_a_dense_per_token_reference():
    g = torch.Generator().manual_seed(6)
    d, f = 8, 6
    params = {"router": torch.randn(d, E, generator=g, dtype=torch.float64),
              **{k: torch.randn(E, *s, generator=g, dtype=torch.float64) for k, s in
                 (("w_gate", (d, f)), ("w_up", (d, f)), ("w_down", (f, d)))},
              "shared_gate": torch.randn(d, f, generator=g, dtype=torch.float64),
              "shared_up": torch.randn(d, f, generator=g, dtype=torch.float64),
              "shared_down": torch.randn(f, d, generator=g, dtype=torch.float64)}
    x = torch.randn(2, T // 2, d, generator=g, dtype=torch.float64)
    y, aux = moe.moe_ffn(params, x, top_k=K, capacity_factor=0.75, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    xt = x.reshape(T, d)
    logits = xt @ params["router"]
    r = moe.route(logits, K, capacity_factor=0.75)

    def swiglu(v, a, b, c):
        return (F.silu(v @ a) * (v @ b)) @ c

    ref = torch.stack([sum(r.weights[t, j] * swiglu(xt[t], *(params[n][r.experts[t, j]] for n in ("w_gate", "w_up", "w_down")))
                           for j in range(K)) for t in range(T)])
    ref = ref + swiglu(xt, params["shared_gate"], params["shared_up"], params["shared_down"])
    torch.testing.assert_close(y.reshape(T, d), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux["aux_loss"], moe.load_balancing_loss(r.probs, r.counts, K, 1e-2))
    torch.testing.assert_close(aux["z_loss"], moe.z_loss(logits, 1e-3))
    assert torch.equal(aux["tokens_per_expert"].long(), r.counts)
    torch.testing.assert_close(aux["dropped_fraction"], r.dropped_fraction)


def test_route_rejects_bad_options():
    with pytest.raises(ValueError, match=r"route: top_k must be in \[1, 4\]"):
        moe.route(_logits(), 5)
    with pytest.raises(ValueError, match=r"route: capacity_factor must be None \(dropless\) or > 0, got 0"):
        moe.route(_logits(), 2, capacity_factor=0)
    with pytest.raises(ValueError, match=r"top_k must be in \[1, num_experts=4\], got 5"):
        llama.config("tiny-moe", top_k=5)
    with pytest.raises(ValueError, match=r"router_bias_update must be >= 0"):
        llama.config("tiny-moe", router_bias_update=-0.1)
    with pytest.raises(ValueError, match=r"router_bias_update=0.1 balances MoE experts"):
        llama.config("tiny", router_bias_update=0.1)


MOE = llama.config("tiny-moe")


def _batch(b=4, s=16, seed=1):
    tok = torch.randint(0, MOE.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def test_moe_llama_layout_of_blocks_and_params():
    cfg = llama.config("tiny-moe", n_layers=4, moe_every=2, shared_experts=1, moe_ffn_dim=32)
    params, axes = llama.init(cfg), llama.param_axes(cfg)
    assert "router" not in params["layers"][0] and params["layers"][0]["w_gate"].shape == (64, 128)
    layer = params["layers"][1]
    assert layer["router"].shape == (64, 4) and layer["router"].dtype == torch.float32
    assert layer["w_gate"].shape == (4, 64, 32) and layer["w_down"].shape == (4, 32, 64)
    assert layer["shared_gate"].shape == (64, 32)
    assert axes["layers"][1]["w_up"] == ("expert", "embed", "expert_mlp")
    assert set(axes["layers"][1]) == set(layer)
    assert llama.param_count(cfg) == sum(t.numel() for t in __import__("optree").tree_leaves(params))
    assert llama.init(llama.config("tiny-moe"), dtype=torch.bfloat16)["layers"][0]["router"].dtype == torch.float32


def test_moe_llama_trains_on_one_device_and_its_aux_loss_reaches_the_router():
    params = llama.init(MOE, seed=0)
    batch = _batch()
    loss_fn = functools.partial(llama.loss, cfg=MOE)
    total, aux = loss_fn(params, batch)
    assert set(aux) == {"lm_loss", "aux_loss", "z_loss", "tokens_per_expert", "dropped_fraction"}
    assert aux["tokens_per_expert"].shape == (MOE.n_layers, MOE.num_experts)
    assert aux["tokens_per_expert"].sum(-1).tolist() == [4 * 16 * MOE.top_k] * MOE.n_layers
    torch.testing.assert_close(total.detach(), aux["lm_loss"] + aux["aux_loss"] + aux["z_loss"])
    assert float(aux["aux_loss"]) > 0
    # The same model as a Sequential (the pipeline's layer list) gives the same loss and aux.
    seq_total, seq_aux = llama.sequential(MOE)(params, batch)
    torch.testing.assert_close(seq_total, total)
    assert torch.equal(seq_aux["tokens_per_expert"], aux["tokens_per_expert"])
    # The aux loss has a gradient into the router: switching it off changes the router's gradient.
    _, with_aux = reference_value_and_grad(loss_fn, params, batch)
    _, without = reference_value_and_grad(functools.partial(llama.loss, cfg=llama.config("tiny-moe", aux_loss_coeff=0.0)),
                                          params, batch)
    for i in range(MOE.n_layers):
        assert not torch.equal(with_aux["layers"][i]["router"], without["layers"][i]["router"])
    losses = run(_train_one_device, params, batch, world_size=1)[0]  # a rank of its own: no group left here
    assert losses[-1] < losses[0] - 0.1, losses


def _train_one_device(params, batch) -> list[float]:
    loss_fn = functools.partial(llama.loss, cfg=MOE)
    state = dtp.TrainState.create(params, dtp.optim.adamw(1e-2), mesh=dtp.make_mesh(dp=1), layout=dtp.layouts.data(),
                                  axes=llama.param_axes(MOE), axis_sizes=llama.axis_sizes(MOE))
    losses = []
    for _ in range(6):
        state, metrics = dtp.train_step(loss_fn, state, batch)
        assert math.isfinite(metrics["grad_norm"]) and not metrics["skipped"]
        losses.append(metrics["aux"]["lm_loss"].item())
    return losses


def _dp_parity(steps: int) -> bool:
    cfg = llama.config("tiny-moe")
    loss_fn = functools.partial(llama.loss, cfg=cfg)
    batch, lr = _batch(), 0.1
    params = llama.init(cfg, seed=0, dtype=torch.float64)
    ref, ref_losses = params, []
    for _ in range(steps):  # one device, plain tensors: SGD by hand
        loss, grads = reference_value_and_grad(loss_fn, ref, batch)
        ref_losses.append(loss)
        ref = __import__("optree").tree_map(lambda p, g: (p - lr * g).detach(), ref, grads)
    state = dtp.TrainState.create(params, dtp.optim.sgd(lr), mesh=dtp.make_mesh(dp=2), layout=dtp.layouts.data(),
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    placed = dtp.shard_batch(batch, state)
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as seen, dtp.comm_log() as log:
        dtp.step.value_and_grad(loss_fn, state, placed)
    assert seen.get_total_counts() == len(log.records)  # DTensor issued no collective of its own
    stats = [r for r in log.records if r.tag == "moe stats"]  # one per MoE block, forward only: 2E+2 numbers
    assert [(r.kind, r.axis, r.bytes) for r in stats] == [("all_reduce", "dp", (2 * cfg.num_experts + 2) * 8)] * cfg.n_layers
    for step in range(steps):  # the middle step recomputes each block (remat around the MoE block's (h, aux))
        state, metrics = dtp.train_step(loss_fn, state, placed, recompute="full" if step == 1 else None)
        assert abs(metrics["loss"] - ref_losses[step]) <= 1e-10 * abs(ref_losses[step]), (step, metrics["loss"])
    assert metrics["aux"]["tokens_per_expert"].sum().item() == 4 * 16 * cfg.top_k * cfg.n_layers
    assert_tree_close(state.params, ref, name="params")
    return True


def test_dp2_train_step_equals_one_device_fp64():
    # Experts replicated (layouts.data); the aux losses from global statistics (one
    # all-reduce of 2E+2 numbers per MoE block), so dp2 is exactly one device.
    assert all(run(_dp_parity, 3, world_size=2))
