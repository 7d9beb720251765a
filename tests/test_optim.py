"""dtp.optim: trajectories equal torch.optim, schedules, purity, and the global norm of
sharded gradients (values, collectives) on a 2 × 2 mesh."""

import math

import optree
import pytest
import torch

import dtp
from dtp import P
from dtp import optim
from dtp.testing import run

STEPS = 5


def _tree(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, dtype=torch.float64, generator=gen),
        "layers": [torch.randn(5, dtype=torch.float64, generator=gen),
                   torch.randn(2, 2, dtype=torch.float64, generator=gen)],
    }


def _grads(params, step: int):
    gen = torch.Generator().manual_seed(100 + step)
    return optree.tree_map(lambda p: torch.randn(p.shape, dtype=p.dtype, generator=gen), params)


def _leaves(tree):
    return optree.tree_leaves(tree)


def _close(a, b, rtol=1e-12, atol=1e-14):
    for x, y in zip(_leaves(a), _leaves(b), strict=True):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def _torch_trajectory(make_opt, params, lrs=None):
    """Run a torch.optim optimizer over the same grads; return the params after each step."""
    ts = [p.clone().requires_grad_(True) for p in _leaves(params)]
    opt = make_opt(ts)
    out = []
    for k in range(STEPS):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[k]
        for t, g in zip(ts, _leaves(_grads(params, k))):
            t.grad = g.clone()
        opt.step()
        out.append([t.detach().clone() for t in ts])
    return out


def _ours_trajectory(opt, params, fused=False):
    """``fused``: ``optim.step`` (the optimizer's ``apply``, one pass) instead of
    ``update`` + ``apply_updates``."""
    state = opt.init(params)
    out = []
    for k in range(STEPS):
        if fused:
            params, state = optim.step(opt, _grads(params, k), state, params)
        else:
            updates, state = opt.update(_grads(params, k), state, params)
            params = optim.apply_updates(params, updates)
        out.append(_leaves(params))
    return out, state


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.0, False, 0.1), (0.9, False, 0.0),
                                                    (0.9, True, 0.05), (0.5, False, 0.01)])
def test_sgd_matches_torch(momentum, nesterov, wd, fused):
    params = _tree()
    ours, state = _ours_trajectory(optim.sgd(0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd), params,
                                   fused)
    ref = _torch_trajectory(lambda ts: torch.optim.SGD(ts, lr=0.1, momentum=momentum, nesterov=nesterov,
                                                       weight_decay=wd), params)
    for k in range(STEPS):
        _close(ours[k], ref[k])
    assert int(state.count) == STEPS
    assert (state.momentum is None) == (momentum == 0)


@pytest.mark.parametrize("wd, betas, eps", [(0.0, (0.9, 0.999), 1e-8), (0.1, (0.9, 0.95), 1e-8),
                                            (0.01, (0.8, 0.99), 1e-3)])
@pytest.mark.parametrize("fused", [False, True])
def test_adamw_matches_torch(wd, betas, eps, fused):
    params = _tree(1)
    ours, state = _ours_trajectory(optim.adamw(1e-2, b1=betas[0], b2=betas[1], eps=eps, weight_decay=wd), params,
                                   fused)
    ref = _torch_trajectory(lambda ts: torch.optim.AdamW(ts, lr=1e-2, betas=betas, eps=eps, weight_decay=wd,
                                                         foreach=False), params)
    for k in range(STEPS):
        _close(ours[k], ref[k])
    assert int(state.count) == STEPS


def test_schedules_drive_the_lr_per_step():
    sched = optim.warmup_cosine(0.1, warmup_steps=2, total_steps=5, final_lr=0.01)
    lrs = [sched(k) for k in range(STEPS)]
    params = _tree(2)
    for ours_opt, torch_opt in [
        (optim.adamw(sched, weight_decay=0.1), lambda ts: torch.optim.AdamW(ts, lr=1.0, weight_decay=0.1, foreach=False)),
        (optim.sgd(sched, momentum=0.9), lambda ts: torch.optim.SGD(ts, lr=1.0, momentum=0.9)),
    ]:
        ours, _ = _ours_trajectory(ours_opt, params)
        ref = _torch_trajectory(torch_opt, params, lrs)
        for k in range(STEPS):
            _close(ours[k], ref[k])


def test_schedule_values():
    s = optim.warmup_cosine(2.0, warmup_steps=4, total_steps=14, final_lr=0.2)
    assert [s(k) for k in range(5)] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0], abs=1e-15)  # linear ramp
    assert s(9) == pytest.approx(0.2 + 0.5 * 1.8, abs=1e-15)  # half-way through the cosine
    for k in range(4, 14):
        assert s(k) == pytest.approx(0.2 + 0.9 * (1 + math.cos(math.pi * (k - 4) / 10)), abs=1e-15)
    assert s(14) == 0.2 and s(1000) == 0.2  # ends at final_lr and stays there
    assert all(s(k) >= s(k + 1) for k in range(4, 20))
    assert optim.warmup_cosine(1.0, 0, 10)(0) == 1.0  # no warm-up: starts at the peak
    assert optim.warmup_cosine(1.0, 0, 10)(10) == 0.0
    assert optim.constant(0.3)(0) == optim.constant(0.3)(10**6) == 0.3
    with pytest.raises(ValueError):
        optim.warmup_cosine(1.0, 10, 5)


def test_pure_inputs_unchanged():
    params = _tree(3)
    grads = _grads(params, 0)
    snap = [x.clone() for x in _leaves((params, grads))]
    for opt in [optim.sgd(0.1, momentum=0.9, weight_decay=0.1), optim.adamw(1e-2, weight_decay=0.1),
                optim.chain(optim.clip(0.5), optim.adamw(1e-2))]:
        state = opt.init(params)
        state_snap = [x.clone() for x in _leaves(state)]
        updates, new_state = opt.update(grads, state, params)
        updates, new_state = opt.update(grads, new_state, params)  # a second step reads the new state
        new_params = optim.apply_updates(params, updates)
        optim.clip_by_global_norm(grads, 0.1)
        optim.global_norm(grads)
        for a, b in zip(_leaves((params, grads)), snap, strict=True):
            assert torch.equal(a, b)
        for a, b in zip(_leaves(state), state_snap, strict=True):
            assert torch.equal(a, b)
        assert all(n is not p for n, p in zip(_leaves(new_params), _leaves(params)))


def test_apply_updates_keeps_requires_grad_leaves():
    params = {"w": torch.ones(3, requires_grad=True)}
    new = optim.apply_updates(params, {"w": torch.full((3,), 0.5)})
    assert new["w"].requires_grad and new["w"].is_leaf
    new["w"].sum().backward()
    assert torch.equal(new["w"].grad, torch.ones(3))


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e3])
def test_clip_by_global_norm_matches_torch(max_norm):
    grads = _grads(_tree(4), 0)
    ts = [g.clone() for g in _leaves(grads)]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in ts]
    for p, t in zip(params, ts):
        p.grad = t.clone()
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    clipped, norm = optim.clip_by_global_norm(grads, max_norm)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=0)
    _close(clipped, [p.grad for p in params])
    torch.testing.assert_close(optim.global_norm(grads), torch.linalg.vector_norm(torch.cat([t.flatten() for t in ts])),
                               rtol=1e-12, atol=0)


def test_low_precision_norm_accumulates_in_fp32():
    g = {"a": torch.full((4096,), 0.01, dtype=torch.bfloat16), "b": torch.ones(3, dtype=torch.float16)}
    norm = optim.global_norm(g)
    assert norm.dtype == torch.float32
    expected = math.sqrt(4096 * float(torch.tensor(0.01, dtype=torch.bfloat16)) ** 2 + 3)
    assert norm.item() == pytest.approx(expected, rel=1e-6)
    clipped, _ = optim.clip_by_global_norm(g, 0.1)
    assert clipped["a"].dtype == torch.bfloat16 and clipped["b"].dtype == torch.float16


def test_bad_arguments():
    with pytest.raises(ValueError, match="nesterov"):
        optim.sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="weight_decay needs the params"):
        opt = optim.adamw(0.1, weight_decay=0.1)
        opt.update({"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}), None)
    with pytest.raises(ValueError, match="shape"):
        opt = optim.sgd(0.1, momentum=0.9)
        opt.update({"w": torch.ones(2)}, opt.init({"w": torch.ones(3)}), None)
    assert optim.global_norm({}).item() == 0.0


# --------------------------------------------------------------------------- distributed (2 × 2 gloo)

SPECS = {"row": P("tp", None), "col": P(None, "tp"), "rep": P(), "flat": P(("dp", "tp")),
         "strided": P(None, ("tp", "dp")), "dp_row": P("dp", None)}


def _global_tree(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"row": (4, 6), "col": (6, 4), "rep": (3, 5), "flat": (8,), "strided": (2, 8), "dp_row": (4, 2)}
    return {k: torch.randn(s, dtype=torch.float64, generator=gen) for k, s in shapes.items()}


def _sharded(tree, mesh, specs=SPECS):
    return {k: dtp.shard(v, mesh, specs[k], name=k) for k, v in tree.items()}


def _full(tree):
    return {k: v.full_tensor() for k, v in tree.items()}  # tests only: gathers outside dtp's log


def _norm_on_mesh():
    mesh = dtp.make_mesh(dp=2, tp=2)
    grads = _global_tree(7)
    ref = torch.linalg.vector_norm(torch.cat([g.flatten() for g in optree.tree_leaves(grads)]))
    with dtp.comm_log() as log:
        norm = optim.global_norm(_sharded(grads, mesh))
    assert type(norm) is torch.Tensor and norm.dim() == 0 and norm.dtype == torch.float64
    torch.testing.assert_close(norm, ref, rtol=1e-12, atol=0)
    # Groups {tp}, {dp}, {dp,tp}, {}: one pending sum over dp and tp, one element each.
    records = [(r.kind, r.axis, r.shape) for r in log.records]
    assert records == [("all_reduce", "dp", (1,)), ("all_reduce", "tp", (1,))], records

    only_tp = {k: grads[k] for k in ("row", "col", "rep")}
    with dtp.comm_log() as log:
        n_tp = optim.global_norm(_sharded(only_tp, mesh))
    assert [(r.kind, r.axis) for r in log.records] == [("all_reduce", "tp")]
    torch.testing.assert_close(n_tp, torch.sqrt(sum(g.square().sum() for g in only_tp.values())), rtol=1e-12, atol=0)
    with dtp.comm_log() as log:
        n_rep = optim.global_norm({"rep": dtp.shard(grads["rep"], mesh, P())})
    assert len(log) == 0
    torch.testing.assert_close(n_rep, torch.linalg.vector_norm(grads["rep"]), rtol=1e-12, atol=0)

    # clipping: same placements out, equal to the single-device clip
    sharded = _sharded(grads, mesh)
    clipped, cnorm = optim.clip_by_global_norm(sharded, 1.0)
    assert all(clipped[k].placements == sharded[k].placements for k in SPECS)
    expected = {k: g * min(1.0, 1.0 / (ref.item() + 1e-6)) for k, g in grads.items()}
    for k, v in _full(clipped).items():
        torch.testing.assert_close(v, expected[k], rtol=1e-12, atol=0)

    with pytest.raises(ValueError, match="pending sums"):
        optim.global_norm({"ok": sharded["row"], "bad": dtp.shard(grads["rep"], mesh, P(None, partial=("tp",)))})
    with pytest.raises(ValueError, match="pending sums"):
        opt = optim.sgd(0.1)
        opt.update({"bad": dtp.shard(grads["rep"], mesh, P(partial="dp"))}, opt.init(None), None)
    with pytest.raises(ValueError, match="laid out"):
        opt = optim.adamw(0.1)
        opt.update({"w": sharded["row"]}, opt.init({"w": dtp.shard(grads["row"], mesh, P(None, "tp"))}), None)
    return norm.item()


def test_global_norm_of_sharded_grads():
    norms = run(_norm_on_mesh, world_size=4)
    assert len(set(norms)) == 1, norms  # bitwise identical on every rank


def _adamw_on_mesh():
    mesh = dtp.make_mesh(dp=2, tp=2)
    params = _global_tree(1)
    opt = optim.chain(optim.clip(2.0), optim.adamw(optim.warmup_cosine(1e-2, 1, 3), weight_decay=0.1))
    ref_p, ref_s = params, opt.init(params)
    d_p = _sharded(params, mesh)
    d_s = opt.init(d_p)
    for step in range(3):
        grads = _global_tree(10 + step)
        d_g = _sharded(grads, mesh)
        ref_u, ref_s = opt.update(grads, ref_s, ref_p)
        ref_p = optim.apply_updates(ref_p, ref_u)
        with dtp.comm_log() as log:
            d_u, d_s = opt.update(d_g, d_s, d_p)
            d_p = optim.apply_updates(d_p, d_u)
        # only the clip's global norm communicates; the update itself is shard-local
        assert {r.kind for r in log.records} == {"all_reduce"}, str(log)
    for k, spec in SPECS.items():
        assert dtp.spec_of(d_p[k]) == spec
        assert dtp.spec_of(d_s[1].mu[k]) == spec and dtp.spec_of(d_s[1].nu[k]) == spec
    for k, v in _full(d_p).items():
        torch.testing.assert_close(v, ref_p[k], rtol=1e-12, atol=1e-14)
    for k, v in _full(d_s[1].nu).items():
        torch.testing.assert_close(v, ref_s[1].nu[k], rtol=1e-12, atol=1e-14)
    return d_p["rep"].to_local().detach()


def test_adamw_on_dtensors_equals_single_device():
    reps = run(_adamw_on_mesh, world_size=4)
    assert all(torch.equal(r, reps[0]) for r in reps)  # the replicated param stays identical


def _per_leaf_sgd(g, buf, p, *, rate, momentum, nesterov, wd):
    """The single-tensor SGD step dtp ran leaf by leaf before its foreach kernels."""
    d = g.add(p, alpha=wd) if wd else g
    if momentum:
        buf = buf.mul(momentum).add(d)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    return d.mul(-rate), buf


def _per_leaf_adamw(g, m, v, p, *, rate, step, b1, b2, eps, wd):
    """The single-tensor AdamW step dtp ran leaf by leaf before its foreach kernels."""
    step_size, bc2_sqrt = rate / (1.0 - b1**step), (1.0 - b2**step) ** 0.5
    m = torch.lerp(m, g, 1.0 - b1)
    v = torch.addcmul(v.mul(b2), g, g, value=1.0 - b2)
    denom = v.sqrt().div(bc2_sqrt).add(eps)
    u = torch.addcdiv(p.mul(-rate * wd), m, denom, value=-step_size) if wd else torch.div(m, denom).mul(-step_size)
    return u, m, v


@pytest.mark.parametrize("momentum, nesterov, wd", [(0.0, False, 0.0), (0.9, True, 0.05), (0.5, False, 0.01)])
def test_foreach_sgd_is_bit_for_bit_the_per_leaf_step(momentum, nesterov, wd):
    params, opt = _tree(), optim.sgd(0.1, momentum=momentum, nesterov=nesterov, weight_decay=wd)
    state, ref_p, ref_b = opt.init(params), _leaves(params), [torch.zeros_like(p) for p in _leaves(params)]
    for k in range(STEPS):
        g = _grads(params, k)
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
        ref = [_per_leaf_sgd(*x, rate=0.1, momentum=momentum, nesterov=nesterov, wd=wd)
               for x in zip(_leaves(g), ref_b, ref_p)]
        ref_p, ref_b = [p + u for p, (u, _) in zip(ref_p, ref)], [b for _, b in ref]
        assert all(torch.equal(a, b) for a, b in zip(_leaves(params), ref_p, strict=True))
        if momentum:
            assert all(torch.equal(a, b) for a, b in zip(_leaves(state.momentum), ref_b, strict=True))


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_foreach_adamw_is_bit_for_bit_the_per_leaf_step(wd):
    params, opt = _tree(), optim.adamw(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=wd)
    state, ref_p = opt.init(params), _leaves(params)
    ref_m, ref_v = [torch.zeros_like(p) for p in ref_p], [torch.zeros_like(p) for p in ref_p]
    for k in range(STEPS):
        g = _grads(params, k)
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
        ref = [_per_leaf_adamw(*x, rate=1e-2, step=k + 1, b1=0.8, b2=0.95, eps=1e-6, wd=wd)
               for x in zip(_leaves(g), ref_m, ref_v, ref_p)]
        ref_p = [p + u for p, (u, _, _) in zip(ref_p, ref)]
        ref_m, ref_v = [m for _, m, _ in ref], [v for _, _, v in ref]
        for ours, theirs in ((params, ref_p), (state.mu, ref_m), (state.nu, ref_v)):
            assert all(torch.equal(a, b) for a, b in zip(_leaves(ours), theirs, strict=True))


@pytest.mark.parametrize("make, make_torch", [
    (lambda: optim.sgd(0.1), lambda ts: torch.optim.SGD(ts, lr=0.1, foreach=False)),
    (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
     lambda ts: torch.optim.SGD(ts, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05, foreach=False)),
    (lambda: optim.adamw(1e-2), lambda ts: torch.optim.AdamW(ts, lr=1e-2, weight_decay=0.0, foreach=False)),
    (lambda: optim.adamw(1e-2, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.1),
     lambda ts: torch.optim.AdamW(ts, lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)),
])
def test_fused_step_is_bit_for_bit_torch_optim(make, make_torch):
    """``optim.step`` (the optimizer's ``apply``) runs torch.optim's single-tensor ops, the
    last one writing the parameter: the same bits as torch.optim, step after step."""
    params = _tree(5)
    ours, _ = _ours_trajectory(make(), params, fused=True)
    ref = _torch_trajectory(make_torch, params)
    for k in range(STEPS):
        assert all(torch.equal(a, b) for a, b in zip(ours[k], ref[k], strict=True)), k


def test_fused_step_keeps_inputs_and_requires_grad():
    params = {"w": torch.ones(3, requires_grad=True), "b": torch.ones(2)}
    grads = {"w": torch.full((3,), 0.5), "b": torch.full((2,), 0.5)}
    for opt in [optim.sgd(0.1, momentum=0.9), optim.adamw(1e-2, weight_decay=0.1),
                optim.chain(optim.clip(0.5), optim.adamw(1e-2))]:
        state = opt.init(params)
        snap = [x.clone() for x in _leaves((params, grads, state))]
        new, new_state = optim.step(opt, grads, state, params)
        assert all(torch.equal(a, b) for a, b in zip(_leaves((params, grads, state)), snap, strict=True))
        assert new["w"].requires_grad and new["w"].is_leaf and not new["b"].requires_grad
        updates, ref_state = opt.update(grads, state, params)
        torch.testing.assert_close(new, optim.apply_updates(params, updates))
        assert optree.tree_structure(new_state) == optree.tree_structure(ref_state)


def test_adamw_refuses_moments_whose_first_step_cannot_be_right():
    """torch.optim.AdamW takes these steps: float16 moments turn small gradients into NaN /
    inf (or, with a larger eps, m / eps: far past lr); an eps that rounds to 0 gives 0 / 0."""
    half = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16)}
    g = {"w": torch.tensor([0.0, 1e-4, 1e-3], dtype=torch.float16)}
    for eps in (1e-8, 1e-6):  # what the refusal saves: NaN / inf, then an update 10^3 x lr
        ref = torch.nn.Parameter(half["w"].clone())
        ref.grad = g["w"].clone()
        torch.optim.AdamW([ref], lr=1e-3, eps=eps, weight_decay=0.0, foreach=False).step()
        moved = (ref.detach().float() - half["w"].float()).abs()
        assert not torch.isfinite(moved).all() or moved.max() > 100 * 1e-3, (eps, moved)  # Adam moves ~lr
        with pytest.raises(ValueError, match=r"adamw: float16 parameters make float16 moments.*mixed_precision"):
            optim.adamw(1e-3, eps=eps).init(half)
    with pytest.raises(ValueError, match=r"eps=1e-46 rounds to 0 in float32.*give eps >= 1.4e-45"):
        optim.adamw(1e-3, eps=1e-46).init({"w": torch.ones(2)})
    with pytest.raises(ValueError, match=r"eps must be finite and > 0"):
        optim.adamw(1e-3, eps=0.0)
    optim.adamw(1e-3).init({"w": torch.ones(2, dtype=torch.bfloat16)})  # float32's range: the default holds


def test_nan_and_inf_settings_and_negative_schedules_are_refused() -> None:
    """Every range check was a comparison NaN passes: sgd(nan) was built, and its first
    step turned every weight NaN (then every later step was skipped, forever); a schedule
    that went negative was applied (gradient ascent)."""
    nan, inf = float("nan"), float("inf")
    for make in (lambda: optim.sgd(nan), lambda: optim.sgd(inf), lambda: optim.sgd(0.1, momentum=nan),
                 lambda: optim.sgd(0.1, weight_decay=inf), lambda: optim.adamw(nan), lambda: optim.adamw(1e-3, eps=nan),
                 lambda: optim.adamw(1e-3, weight_decay=nan), lambda: optim.adamw(1e-3, b1=nan)):
        with pytest.raises(ValueError, match=r"finite|must lie in"):
            make()
    p = {"w": torch.ones(2)}
    for lr in (lambda step: -5.0, lambda step: nan):
        opt = optim.sgd(lr)
        with pytest.raises(ValueError, match=r"^sgd: the lr schedule gave (-5.0|nan) at step 0; a learning rate is finite"):
            opt.update({"w": torch.ones(2)}, opt.init(p), p)
