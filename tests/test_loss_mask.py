"""Loss masks: targets equal to IGNORE_INDEX (-100) are skipped and the loss is the mean
over the valid targets of the whole global batch. Under data, vocab (tp + sp) and context
parallel and with microbatches, on a batch whose masks are uneven across ranks, rows,
microbatches and sequence halves, the loss and gradients equal one device taking the batch
at once (fp64, 1e-10); the guard accepts -100 in targets and nothing else negative."""

import functools
import itertools

import pytest
import torch

import dtp
from dtp.models import llama
from dtp.ops import IGNORE_INDEX, count_targets, cross_entropy
from dtp.testing import assert_tree_close, reference_value_and_grad, run

CFG = llama.config("tiny", n_heads=4, n_kv_heads=2, n_layers=1)
LOSS = functools.partial(llama.loss, cfg=CFG)


def _masked_batch(b: int = 8, s: int = 16) -> dict[str, torch.Tensor]:
    """Rows 0..b/2-1 (dp rank 0's) mostly masked, row 1 entirely; the even rows (microbatch 0)
    more than the odd; the sequence's first half (cp rank 0's, contiguous) more than the rest."""
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, CFG.vocab_size, (b, s + 1), generator=g)
    targets = tok[:, 1:].clone()
    p = torch.full((b, s), 0.1, dtype=torch.float64)
    p[: b // 2] = 0.6
    p[::2] += 0.2
    p[:, : s // 2] += 0.1
    targets[torch.rand(b, s, generator=g, dtype=torch.float64) < p] = IGNORE_INDEX
    targets[1] = IGNORE_INDEX
    return {"tokens": tok[:, :-1].contiguous(), "targets": targets}


def _state(mesh_axes, layout):
    return dtp.TrainState.create(llama.init(CFG, seed=0, dtype=torch.float64), dtp.optim.sgd(0.1),
                                 mesh=dtp.make_mesh(**mesh_axes), layout=layout, axes=llama.param_axes(CFG),
                                 axis_sizes=llama.axis_sizes(CFG))


def _parity(mesh_axes, layout, microbatches):
    batch = _masked_batch()
    ref_loss, ref_grads = reference_value_and_grad(LOSS, llama.init(CFG, seed=0, dtype=torch.float64), batch)
    state = _state(mesh_axes, layout)
    placed = dtp.shard_batch(batch, state)
    out = []
    for m in microbatches:
        loss, _, grads = dtp.step.value_and_grad(LOSS, state, placed, microbatches=m)
        assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), (mesh_axes, m, loss, ref_loss)
        assert_tree_close(grads, ref_grads, name=f"grads {mesh_axes} microbatches={m}")
        out.append(loss)
    _, metrics = dtp.train_step(LOSS, state, placed, microbatches=microbatches[-1])
    return out, metrics["loss_tokens"]


CASES = {
    "dp2 (microbatches 1, 2)": ({"dp": 2}, dtp.layouts.data(), (1, 2)),
    "tp2+sp vocab parallel": ({"tp": 2}, dtp.layouts.megatron(sequence_parallel=True), (1, 2)),
    "cp2 ring": ({"cp": 2}, dtp.layouts.context("ring"), (1,)),
    "cp2 ring contiguous + dp2, microbatches 2": (
        {"dp": 2, "cp": 2}, dtp.layouts.data() + dtp.layouts.context("ring", load_balance=None), (2,)),
}


@pytest.mark.parametrize("name", CASES)
def test_masked_loss_matches_one_device_fp64(name):
    mesh_axes, layout, microbatches = CASES[name]
    world = 1
    for n in mesh_axes.values():
        world *= n
    results = run(_parity, mesh_axes, layout, microbatches, world_size=world)
    valid = int((_masked_batch()["targets"] != IGNORE_INDEX).sum())
    assert all(r[1] == valid for r in results), (name, [r[1] for r in results], valid)


def test_microbatches_equal_one_big_batch_on_one_device():
    """Gradient accumulation is not an average of microbatch means: microbatch 0 holds far
    fewer valid targets than microbatch 1, and the step still equals the whole batch."""
    batch = _masked_batch()
    evens, odds = (int((batch["targets"][k::2] != IGNORE_INDEX).sum()) for k in (0, 1))
    assert evens < 0.7 * odds
    ref_loss, ref_grads = reference_value_and_grad(LOSS, llama.init(CFG, seed=0, dtype=torch.float64), batch)
    with dtp.testing.simulate(1):  # no process group left behind in the test process
        state = _state({"dp": 1}, dtp.layouts.data())
        loss, _, grads = dtp.step.value_and_grad(LOSS, state, batch, microbatches=2)
    assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
    assert_tree_close(grads, ref_grads, name="grads")


def test_masked_targets_add_nothing_and_all_masked_is_zero():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[1, IGNORE_INDEX, 4], [IGNORE_INDEX, IGNORE_INDEX, 0]])
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1), ignore_index=-100)
    assert abs(float(cross_entropy(logits, targets)) - float(expected)) < 1e-14
    assert count_targets(targets) == 3
    none = cross_entropy(logits, torch.full((2, 3), IGNORE_INDEX))
    none.backward()
    assert float(none) == 0.0 and float(logits.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_local_loss_is_torch_cross_entropy_bitwise(dtype):
    """On plain tensors (local batch mode) the loss and the logits' gradient are
    ``F.cross_entropy``'s bit for bit, masked rows included; its backward writes the
    gradient in place, so it holds two logits-sized tensors where autograd's holds three."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 64, 256, generator=g)).to(dtype)
    targets = torch.randint(0, 256, (4, 64), generator=g)
    targets[:, ::5] = IGNORE_INDEX
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy(ours, targets)
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # the loss runs in fp32 (fp64 stays)
    ref = torch.nn.functional.cross_entropy(theirs.reshape(-1, 256).to(acc), targets.reshape(-1), ignore_index=-100,
                                            reduction="sum") / count_targets(targets)
    assert torch.equal(loss, ref), (float(loss), float(ref))
    peaks = []
    for out, x in ((loss, ours), (ref, theirs)):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out.backward()
        sizes = [e.nbytes() for e in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
                 if e.name() == "[memory]"]
        peaks.append(max(itertools.accumulate(sizes, initial=0)))
    assert torch.equal(ours.grad, theirs.grad)
    # Ours: the gradient (bf16: then its cast); autograd's: nll_loss's gradient beside
    # log-softmax's (bf16: the cast once the former is gone) — a logits-sized tensor more.
    saved = logits.numel() * logits.element_size()
    assert peaks[0] <= peaks[1] - saved + 4096, (peaks, saved)


def _guard(targets):
    state = _state({"dp": 2}, dtp.layouts.data())
    batch = {"tokens": torch.zeros(4, 8, dtype=torch.long), "targets": targets}
    try:
        dtp.train_step(LOSS, state, dtp.shard_batch(batch, state))
    except ValueError as e:
        return str(e)
    return None


def test_guard_accepts_ignore_index_and_rejects_other_negative_ids():
    ok = torch.zeros(4, 8, dtype=torch.long)
    ok[:2] = IGNORE_INDEX  # rank 0's rows: nothing to learn from there
    bad = ok.clone()
    bad[3, 0] = -5
    assert run(_guard, ok, world_size=2) == [None, None]
    errors = run(_guard, bad, world_size=2)
    assert errors[0] == errors[1] and "holds ids from -5" in errors[0], errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 7])
def test_the_device_divisor_gives_the_float_divisors_bits(dtype, m):
    """``train_step`` divides by the valid count / m as a float64 tensor on the device
    (:class:`DeviceDivisor`, never read to the host); the loss and the logits' gradient
    are the bits the Python float ``max(count, 1) / m`` gave (plain tensors; the sharded
    path divides its sum the same way, ``_divide``)."""
    from dtp.ops.parallel import DeviceDivisor, mean_over

    g = torch.Generator().manual_seed(m)
    logits = (3 * torch.randn(2, 37, 50, generator=g)).to(dtype)
    targets = torch.randint(0, 50, (2, 37), generator=g)
    targets[:, ::4] = IGNORE_INDEX
    count = count_targets(targets)
    out = []
    for divisor in (max(count, 1) / m, lambda: DeviceDivisor(torch.tensor([count]).clamp_min(1).to(torch.float64) / m)):
        x = logits.clone().requires_grad_()
        with mean_over(divisor):
            loss = cross_entropy(x, targets)
        loss.backward()
        out.append((loss.detach(), x.grad))
    (l1, g1), (l2, g2) = out
    assert l1.dtype == l2.dtype and torch.equal(l1, l2) and torch.equal(g1, g2), (float(l1), float(l2))


def test_a_tensor_divisor_is_still_checked():
    from dtp.ops.parallel import mean_over

    logits, targets = torch.zeros(1, 2, 4), torch.tensor([[0, 1]])
    for bad in (0.0, torch.tensor(0.0), torch.tensor(-2.0)):
        with mean_over(bad), pytest.raises(ValueError, match="mean_over: divisor must be > 0"):
            cross_entropy(logits, targets)
