"""Bad input gets the same clear error on every rank, within a second, and nothing hangs.

One table: each row builds its inputs on every rank of a 4-rank gloo pool (some rows give
one rank different inputs: a check that fails there only, options or values that differ
between ranks), then makes the call that must fail. Every rank must raise the row's
exception type with a message matching its pattern, within a second of the call, with
no collective recorded in the caller's comm log before the error (the guard's own
exchange, :mod:`dtp.guard`, goes to its own log). Then: the guard's exchange runs once per
state and batch signature, stays out of a step's records, and ``DTP_CHECKS=0`` turns it
off with a warning.
"""

from __future__ import annotations

import functools
import re
import time

import pytest
import torch

import dtp
from dtp import P
from dtp.models import llama
from dtp.testing import run

CFG = llama.config("tiny", n_layers=1)
LOSS = functools.partial(llama.loss, cfg=CFG)


def _batch(b=8, s=16, seed=0, vocab=CFG.vocab_size):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, vocab, (b, s + 1), generator=g)
    return {"tokens": toks[:, :-1].contiguous(), "targets": toks[:, 1:].contiguous()}


def _state(mesh, layout=None, seed=0, dtype=torch.float32, axes=None):
    layout = layout if layout is not None else dtp.layouts.data() + dtp.layouts.megatron(True)
    return dtp.TrainState.create(llama.init(CFG, seed=seed, dtype=dtype), dtp.optim.sgd(0.1), mesh=mesh,
                                 layout=layout, axes=axes or llama.param_axes(CFG), axis_sizes=llama.axis_sizes(CFG))


def _dp_tp():
    return dtp.make_mesh(dp=2, tp=2)


def _step(rank, **options):
    """A state on dp=2 × tp=2 and a placed batch; the call is the step with ``options``
    (a callable of the rank gives per-rank values)."""
    state = _state(_dp_tp())
    batch = dtp.shard_batch(_batch(), state)
    opts = {k: (v(rank) if callable(v) else v) for k, v in options.items()}
    return lambda: dtp.train_step(LOSS, state, batch, **opts)


def _shard_batch(rank, batch_of_rank):
    state = _state(_dp_tp())
    return lambda: dtp.shard_batch(batch_of_rank(rank), state)


def _placed(rank, tokens_of_rank):
    """The user places the batch (dtp.shard): shards that tp ranks should share differ."""
    mesh = _dp_tp()
    state = _state(mesh)
    b = _batch()
    batch = {"tokens": dtp.shard(tokens_of_rank(rank, b["tokens"]), mesh, P("dp")),
             "targets": dtp.shard(b["targets"], mesh, P("dp"))}
    return lambda: dtp.train_step(LOSS, state, batch)


def _create(rank, **kw):
    mesh = kw.pop("mesh", None) or _dp_tp()
    kw = {k: (v(rank) if callable(v) and k != "axes" else v) for k, v in kw.items()}
    return lambda: _state(mesh, **kw)


def _custom_loss(rank, loss, x_dtype=torch.float64):
    mesh = dtp.make_mesh(dp=4)
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(8, 4, dtype=torch.float64, generator=g)}
    state = dtp.TrainState.create(params, dtp.optim.sgd(0.1), mesh=mesh, layout=dtp.layouts.data(),
                                  axes={"w": ("embed", "mlp")})
    batch = {"x": dtp.shard(torch.randn(8, 8, dtype=x_dtype, generator=g), mesh, P("dp"))}
    return lambda: dtp.train_step(loss, state, batch)


def _per_token_loss(p, batch):
    return dtp.ops.linear(batch["x"], p["w"]).sum(-1)


def _sum_loss(p, batch):
    return dtp.reshard(dtp.ops.linear(batch["x"], p["w"]), P()).sum()


def _other_mesh(rank):
    state = _state(dtp.make_mesh(dp=4), dtp.layouts.data())
    other = dtp.make_mesh(dp=2, tp=2)
    b = _batch()
    batch = {k: dtp.shard(v, other, P("dp")) for k, v in b.items()}
    return lambda: dtp.train_step(LOSS, state, batch)


def _constrain(rank):
    mesh = _dp_tp()
    x = dtp.shard(torch.zeros(4, 8, 2), mesh, P("dp"))

    def call():
        with dtp.use_layout(dtp.layouts.data(), mesh):
            return dtp.constrain(x, ("batch", "sq", "embed"), name="h")

    return call


def _ids(bad):
    def batch(rank):
        b = _batch()
        b["targets"][1, 3] = bad
        return b
    return batch


CASES = {
    # ---- fail together: a check that fails on one rank is the same error on all
    "microbatches on one rank do not split the batch": (
        lambda r: _step(r, microbatches=lambda r: 3 if r == 1 else 2), "ValueError",
        r"batch size 8, not divisible by the batch split 2 × microbatches 3 = 6 \[rank 1 failed this check, "
        r"the other ranks passed; every rank raises this error\]"),
    "one rank's global batch does not split over dp": (
        lambda r: _shard_batch(r, lambda r: _batch(b=5 if r == 2 else 8)), "ValueError",
        r"batch\['tokens'\].*\[rank 2 failed this check"),
    # ---- the guard: inputs that differ between ranks
    "microbatches differ between ranks": (
        lambda r: _step(r, microbatches=lambda r: 4 if r == 1 else 2), "ValueError",
        r"train_step: the ranks disagree on option microbatches — ranks \[0, 2, 3\]: 2; rank 1: 4"),
    "clip_norm differs between ranks": (
        lambda r: _step(r, clip_norm=lambda r: 2.0 if r == 3 else 1.0), "ValueError",
        r"disagree on option clip_norm — ranks \[0, 1, 2\]: 1.0; rank 3: 2.0"),
    "recompute differs between ranks": (
        lambda r: _step(r, recompute=lambda r: "full" if r == 0 else None), "ValueError",
        r"disagree on option recompute — rank 0: 'full'; ranks \[1, 2, 3\]: None"),
    "batch shape differs between ranks": (
        lambda r: _shard_batch(r, lambda r: _batch(s=8 if r == 3 else 16)), "ValueError",
        r"shard_batch: the ranks disagree on batch\['tokens'\] — ranks \[0, 1, 2\]: \(8, 16\) int64; "
        r"rank 3: \(8, 8\) int64"),
    "batch values differ between ranks": (
        lambda r: _shard_batch(r, lambda r: _batch(seed=1 if r == 1 else 0)), "ValueError",
        r"shard_batch: batch\['tokens'\] differs between ranks \[0, 1, 2, 3\] \(it must be identical on every "
        r"rank\) — ranks \[0, 2, 3\]: checksum 0x[0-9a-f]+; rank 1: checksum"),
    "tp ranks hold different shards of a batch split over dp": (
        lambda r: _placed(r, lambda r, t: t + (r == 1)), "ValueError",
        r"train_step: batch\['tokens'\] differs between ranks \[0, 1\] \(split over dp: ranks with equal "
        r"coordinates on it hold the same shard\)"),
    "parameters differ between ranks": (
        lambda r: _create(r, seed=lambda r: 1 if r == 2 else 0), "ValueError",
        r"TrainState.create: param embed \(the global value given to TrainState.create\) differs between "
        r"ranks \[0, 1, 2, 3\].*rank 2: checksum"),
    "parameter dtype differs between ranks": (
        lambda r: _create(r, dtype=lambda r: torch.float64 if r == 0 else torch.float32), "ValueError",
        r"disagree on param embed — rank 0: \(256, 64\) float64 axes \('vocab', 'embed'\); ranks \[1, 2, 3\]"),
    "layout differs between ranks": (
        lambda r: _create(r, layout=lambda r: dtp.layouts.data() + dtp.layouts.megatron(r == 0)), "ValueError",
        r"TrainState.create: the ranks disagree on layout — rank 0: data \+ megatron\(sequence_parallel=True\)"),
    # ---- ids against the vocabulary (the parameters' 'vocab' axis)
    "target id past the vocabulary (shard_batch)": (
        lambda r: _shard_batch(r, _ids(300)), "ValueError",
        r"shard_batch: batch\['targets'\] holds ids from 0 to 300, outside the vocabulary \[0, 256\)"),
    "negative target id (shard_batch)": (
        lambda r: _shard_batch(r, _ids(-1)), "ValueError", r"holds ids from -1 to \d+, outside the vocabulary"),
    "id past the vocabulary on some ranks' shards (train_step)": (
        lambda r: _placed(r, lambda r, t: torch.where(torch.arange(8)[:, None] == 5, 999, t)), "ValueError",
        r"train_step: batch\['tokens'\] holds ids from 0 to 999 \(on ranks \[2, 3\]\), outside the vocabulary"),
    # ---- strict validation, alike on every rank
    "unknown logical axis of a parameter": (
        lambda r: _create(r, axes={**llama.param_axes(CFG), "final_norm": ("embd",)}), "ValueError",
        r"param final_norm: unknown logical axis 'embd' \(layout data \+ megatron.*known: batch, embed.*"
        r"dtp.Layout\(\{'embd': \(\)\}\)"),
    "a declared logical axis is fine": (
        lambda r: _create(r, axes={**llama.param_axes(CFG), "final_norm": ("out",)},
                          layout=dtp.layouts.data() + dtp.Layout({"out": ()})), "no error", ""),
    "unknown logical axis of an activation": (
        _constrain, "ValueError", r"h: unknown logical axis 'sq'"),
    "zero's axis missing from the mesh": (
        lambda r: _create(r, mesh=dtp.make_mesh(dp=4), layout=dtp.layouts.data() + dtp.layouts.zero(1, axis="fsdp")),
        "ValueError", r"TrainState.create: layouts.zero\(axis='fsdp'\) names a mesh axis this mesh lacks \(its axes: "
        r"dp\), so zero would silently be off"),
    "context's axis missing from the mesh": (
        lambda r: _create(r, layout=dtp.layouts.data() + dtp.layouts.context("ring", axis="sp")), "ValueError",
        r"layouts.context\(axis='sp'\) names a mesh axis this mesh lacks \(its axes: dp, tp\)"),
    "zero's axis not a name": (
        lambda r: (lambda: dtp.layouts.zero(1, axis=3)), "TypeError", r"layouts.zero: axis must be a mesh axis name"),
    "clip_norm = 0": (lambda r: _step(r, clip_norm=0), "ValueError",
                      r"train_step: clip_norm must be finite and > 0 \(or None: no clipping\), got 0"),
    "clip_norm < 0": (lambda r: _step(r, clip_norm=-1.0), "ValueError", r"clip_norm must be finite and > 0.*got -1.0"),
    "clip_norm = nan": (lambda r: _step(r, clip_norm=float("nan")), "ValueError", r"clip_norm.*got nan"),
    "clip_norm = inf": (lambda r: _step(r, clip_norm=float("inf")), "ValueError", r"clip_norm.*got inf"),
    "clip_norm a string": (lambda r: _step(r, clip_norm="1"), "TypeError", r"clip_norm must be a number"),
    "batch placed on another mesh": (
        _other_mesh, "ValueError", r"train_step: batch\['tokens'\] is placed on another mesh .* than the state's"),
    "float token ids": (
        lambda r: _placed(r, lambda r, t: t.float()), "TypeError",
        r"batch\['tokens'\] holds vocabulary ids and must be an integer tensor, got torch.float32"),
    "batch dtype differs from the parameters'": (
        lambda r: _custom_loss(r, _sum_loss, torch.float32), "TypeError",
        r"batch\['x'\] is torch.float32 but the parameters are torch.float64; cast it"),
    "non-scalar loss": (
        lambda r: _custom_loss(r, _per_token_loss), "ValueError",
        r"train_step: loss_fn must return a scalar loss \(the batch mean\), got shape \(8,\)"),
    "make_mesh on a device this machine lacks": (
        lambda r: (lambda: dtp.make_mesh(dp=4, device="cuda")), "ValueError",
        r"make_mesh: device 'cuda' asked for, but this machine has no usable cuda device"),
}
# The loss is computed before it can be checked: collectives ran (alike on every rank).
AFTER_COMPUTE = {"non-scalar loss"}


def _run_cases(names):
    out = []
    rank = torch.distributed.get_rank()
    for name in names:
        build, _, _ = CASES[name]
        call = build(rank)
        with dtp.comm_log() as log:
            t0 = time.perf_counter()
            try:
                call()
                got = ("no error", "")
            except (ValueError, TypeError) as e:
                got = (type(e).__name__, str(e))
            elapsed = time.perf_counter() - t0
        out.append((*got, len(log), elapsed))
    return out


@pytest.fixture(scope="module")
def results():
    names = list(CASES)
    per_rank = run(_run_cases, names, world_size=4)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(names)}


@pytest.mark.parametrize("name", list(CASES))
def test_same_error_on_every_rank_within_a_second(results, name):
    _, kind, pattern = CASES[name]
    ranks = results[name]
    for rank, (got, msg, n_records, elapsed) in enumerate(ranks):
        assert got == kind, f"{name} rank {rank}: expected {kind}, got {got}: {msg}"
        assert re.search(pattern, msg), f"{name} rank {rank}: {msg!r} does not match {pattern!r}"
        assert elapsed < 1.0, f"{name} rank {rank}: raised after {elapsed:.2f}s"
        if kind != "no error" and name not in AFTER_COMPUTE:
            assert n_records == 0, f"{name} rank {rank}: {n_records} collectives before the error"
    assert len({msg for _, msg, _, _ in ranks}) == 1, f"{name}: the ranks' messages differ: {ranks}"


def _guard_traffic():
    import warnings

    import os

    mesh = _dp_tp()
    before = len(dtp.guard.log.records)
    state = _state(mesh)
    created = len(dtp.guard.log.records) - before
    batch = dtp.shard_batch(_batch(), state)
    counts, step_records = [], []
    for _ in range(3):
        with dtp.comm_log() as log:
            state, _ = dtp.train_step(LOSS, state, dtp.shard_batch(_batch(), state))
        counts.append(len(dtp.guard.log.records) - before)
        step_records.append(sorted((r.kind, r.axis, r.tag) for r in log.records))
    state, _ = dtp.train_step(LOSS, state, batch, microbatches=2)  # a new signature
    counts.append(len(dtp.guard.log.records) - before)
    os.environ["DTP_CHECKS"] = "0"
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state, _ = dtp.train_step(LOSS, state, batch, clip_norm=1.0)  # new, but the guard is off
            state, _ = dtp.train_step(LOSS, state, batch, clip_norm=2.0)
    finally:
        del os.environ["DTP_CHECKS"]
    counts.append(len(dtp.guard.log.records) - before)
    guard_bytes = [r.bytes for r in dtp.guard.log.records[before:before + 1]]
    return created, counts, step_records, [str(w.message) for w in seen], guard_bytes


def test_guard_exchanges_once_per_state_and_signature_outside_the_step_log():
    created, counts, records, warned, nbytes = run(_guard_traffic, world_size=4)[0]
    assert created == 1
    # Step 1: shard_batch's and train_step's first exchange; steps 2, 3: none; a new
    # signature (microbatches=2): one; DTP_CHECKS=0: none.
    assert counts == [3, 3, 3, 4, 4]
    assert records[0] == records[1] == records[2]  # the guard never shows in a step's records
    assert all("guard" not in tag for _, _, tag in records[0])
    assert nbytes == [3 * dtp.guard.WIDTH * 8]  # one all-gather of WIDTH int64 over 4 ranks
    assert len(warned) == 1 and "DTP_CHECKS=0" in warned[0] and "guard is off" in warned[0]
