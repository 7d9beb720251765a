"""Bad input gets the same clear error on every rank, within a second, and nothing hangs.

One table, the catalogue of DESIGN §5: each row builds its inputs on every rank of a
4-rank gloo pool (some rows give one rank different inputs: a check that fails there
only, options or values that differ between ranks), then makes the call that must fail.
Every rank must raise the row's exception type with a message matching its pattern
(the offender, the numbers, what is valid), within a second of CPU (and well before any timeout), with no
collective recorded in the caller's comm log before the error (the guard's own
exchange, :mod:`dtp.guard`, goes to its own log). A row may add a check after the call:
the checkpoint rows save a 1-step checkpoint (collectives before the call, not in it),
spoil it on rank 0, and check that the failed load lost or changed no file and ran no
code. Then: the guard's exchange runs once per state and batch signature, stays out of
a step's records, and ``DTP_CHECKS=0`` turns it off with a warning.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import tempfile
import time
import zlib
from pathlib import Path

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


def _detached_loss(p, b):  # no collective before the check (a pending sum, not reduced)
    return _per_token_loss(p, b).sum().detach()


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


def _create_with(rank, mesh_axes, layout, **cfg):
    """``TrainState.create`` of a llama of ``cfg`` (tiny, one layer) with its axis sizes."""
    mesh = dtp.make_mesh(**mesh_axes)
    c = llama.config("tiny", **{"n_layers": 1, **cfg})
    params = llama.init(c)
    return lambda: dtp.TrainState.create(params, dtp.optim.sgd(0.1), mesh=mesh, layout=layout,
                                         axes=llama.param_axes(c), axis_sizes=llama.axis_sizes(c))


def _context(algo, **options):
    return dtp.layouts.data() + dtp.layouts.context(algo, **options)


def _seq(rank, s, place=False, evaluate=False, into=False):
    """A zigzag ring on dp=2 × cp=2 and a batch of sequence length ``s``: placed by
    shard_batch (the call) or by the user with dtp.shard (the call is train_step, or
    ``evaluate``: dtp.strategies.evaluate); ``into``: the user's entries put into a batch
    shard_batch placed."""
    mesh = dtp.make_mesh(dp=2, cp=2)
    state = _state(mesh, _context("ring"))
    if not place:
        return lambda: dtp.shard_batch(_batch(s=s), state)
    batch = {k: dtp.shard(v, mesh, P("dp", "cp")) for k, v in _batch(s=s).items()}
    if into:
        placed = dtp.shard_batch(_batch(s=s), state)
        placed["tokens"] = batch["tokens"]  # a PlacedBatch still, but not this entry
        batch = placed
    if evaluate:
        return lambda: dtp.strategies.evaluate(LOSS, state.params, state.strategy, state.layout, state.mesh, [batch])
    return lambda: dtp.train_step(LOSS, state, batch)


def _shard(rank, shape, spec):
    mesh = _dp_tp()
    return lambda: dtp.shard(torch.zeros(shape), mesh, spec, name="x")


# ---- checkpoints: a 1-step dp=4 checkpoint, spoiled on rank 0, loaded


def _digest(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def _pwned(root):
    return f"{root}.pwned"  # what the crafted metadata's code would create


def _data_file(ckpt):
    return max(ckpt.glob("*.distcp"), key=lambda f: (f.stat().st_size, f.name))


def _truncate(ckpt):
    f = _data_file(ckpt)
    f.write_bytes(f.read_bytes()[:-7])


def _flip(path):
    b = bytearray(path.read_bytes())
    b[len(b) // 2] ^= 0xFF
    path.write_bytes(bytes(b))


def _evil_metadata(ckpt):
    """A .metadata that would run code when unpickled; the manifest updated to match, as
    an attacker would."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {_pwned(ckpt.parent)}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((ckpt / "manifest.json").read_text())
    blob = (ckpt / ".metadata").read_bytes()
    manifest["files"][".metadata"] = [len(blob), zlib.crc32(blob)]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _ckpt_state(cfg=CFG, opt=None, dtype=torch.float64):
    return dtp.TrainState.create(llama.init(cfg, dtype=dtype), opt or dtp.optim.adamw(1e-2),
                                 mesh=dtp.make_mesh(dp=4), layout=dtp.layouts.data(), axes=llama.param_axes(cfg))


def _shared_tempdir():
    made = [tempfile.mkdtemp(prefix="dtp-validation-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(made, src=0)
    return Path(made[0])


def _checkpoint(rank, spoil=None, where="", saved=None, **like):
    """Train a state one step and save it in a fresh directory; rank 0 spoils it. The
    call loads ``root/where`` into a state made with ``like``, the saved one with
    ``saved`` (both :func:`_ckpt_state`'s arguments: dp=4, fp64, AdamW unless given);
    after it every file must be as it was and no code must have run. Then the
    directory goes."""
    root = _shared_tempdir()
    saved = saved or {}
    state = _ckpt_state(**saved)
    cfg = saved.get("cfg", CFG)
    batch = dtp.shard_batch(_batch(vocab=cfg.vocab_size), state)
    state, _ = dtp.train_step(functools.partial(llama.loss, cfg=cfg), state, batch)
    ckpt = dtp.checkpoint.save(state, root)
    torch.distributed.barrier()
    if rank == 0 and spoil is not None:
        spoil(ckpt)
    torch.distributed.barrier()
    before = _digest(root)
    into = _ckpt_state(**like)

    def after():
        now = _digest(root)
        problems = [f"{name} {'lost' if name not in now else 'changed'}"
                    for name in before if now.get(name) != before[name]]
        problems += [f"{name} appeared" for name in now if name not in before]
        if os.path.exists(_pwned(root)):
            problems.append("the crafted metadata's code ran")
        torch.distributed.barrier()  # every rank has looked
        if rank == 0:
            shutil.rmtree(root)
            Path(_pwned(root)).unlink(missing_ok=True)
        return problems

    return (lambda: dtp.checkpoint.load(root / where, like=into)), after


CKPT = r"checkpoint \S+/step_00000001"  # the checkpoint a row's message names

def _pipeline_step(rank, layout, microbatches, b=8, model=None, axes=None, call=None):
    """A dp=2 × pp=2 state (or ``axes``) under ``layout``; the call is the step (or ``call``:
    ``dtp.step.value_and_grad``)."""
    mesh = dtp.make_mesh(**(axes or {"pp": 2, "dp": 2}))
    state = _state(mesh, layout)
    batch = dtp.shard_batch(_batch(b=b), state)
    model = llama.sequential(CFG) if model is None else model
    return lambda: (call or dtp.train_step)(model, state, batch, microbatches=microbatches)


# Added with their features (they do not exist yet): pipe-experts options without MoE;
# multi-stream without sequence parallel.
CASES = {
    # ---- expert parallel
    "experts not divisible by ep": (
        lambda r: _create_with(r, {"dp": 2, "ep": 2}, dtp.layouts.data() + dtp.layouts.expert(), num_experts=3),
        "ValueError", r"TrainState.create: num_experts=3 is not divisible by ep=2 \(layouts.expert puts experts "
        r"Shard\(0\) on 'ep'\); choose num_experts a multiple of 2, or a smaller ep"),
    # ---- pipeline
    "pipeline microbatches fewer than stages (1f1b)": (
        lambda r: _pipeline_step(r, dtp.layouts.pipeline("1f1b"), 1), "ValueError",
        r"train_step: schedules: '1f1b' needs at least p=2 microbatches in flight, got m=1; use m >= 2, or the "
        r"'gpipe' schedule"),
    "interleaved microbatches not a multiple of pp": (
        lambda r: _pipeline_step(r, dtp.layouts.pipeline("interleaved", virtual_stages=2), 3, b=12), "ValueError",
        r"train_step: schedules: 'interleaved' needs m to be a multiple of p=2 .*got m=3; use m=2 or m=4"),
    "layers fewer than pp × virtual stages": (
        lambda r: _pipeline_step(r, dtp.layouts.pipeline("interleaved", virtual_stages=2), 4, axes={"pp": 4}),
        "ValueError", r"train_step: the model has 3 layers, fewer than pp=4 × virtual_stages=2 = 8 stages"),
    "pipeline loss_fn not a sequence of layers": (
        lambda r: _pipeline_step(r, dtp.layouts.pipeline("gpipe"), 2, model=LOSS), "TypeError",
        r"train_step: under layouts.pipeline loss_fn must be the model as a dtp.Sequential of layers "
        r"\(e.g. llama.sequential\(cfg\)\), got partial"),
    "zero 3 with pipeline": (
        lambda r: _pipeline_step(r, dtp.layouts.data() + dtp.layouts.zero(3) + dtp.layouts.pipeline("1f1b"), 2),
        "ValueError", r"train_step: layouts.zero\(3\) with layouts.pipeline is not supported: stage 3 frees and "
        r"re-gathers buckets by counting reads per microbatch.*use stage 1 or 2"),
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
    "an integer parameter on one rank": (  # was torch's RuntimeError on rank 1 alone; the others hung
        lambda r: lambda: dtp.TrainState.create({"w": torch.ones(4, dtype=torch.int64 if r == 1 else torch.float64)},
                                                dtp.optim.sgd(0.1), mesh=dtp.make_mesh(dp=4),
                                                layout=dtp.layouts.data(), axes={"w": (None,)}),
        "TypeError", r"TrainState.create: param w is torch.int64; parameters are floating point"),
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
    "a list given to shard": (  # was "'list' object has no attribute 'shape'"
        lambda r: lambda: dtp.shard([1.0, 2.0], dtp.make_mesh(dp=4), P("dp"), name="x"), "TypeError",
        r"x: dtp.shard lays out a torch.Tensor, got list"),
    "an empty batch given to shard_batch": (
        lambda r: _shard_batch(r, lambda r: {}), "ValueError", r"shard_batch: the batch holds no tensors"),
    "a list given to shard_batch": (  # was "'list' object has no attribute 'items'"
        lambda r: _shard_batch(r, lambda r: [_batch()["tokens"]]), "TypeError",
        r"shard_batch: the batch is a mapping of names to tensors"),
    "a plain per-rank loss for a DTensor batch": (  # was trained on: each rank its own loss, silently
        lambda r: _custom_loss(r, lambda p, b: _per_token_loss(p, b).to_local().mean()), "ValueError",
        r"train_step: loss_fn returned a plain tensor for a batch of DTensors: each rank's own value"),
    "loss that does not depend on the parameters": (  # was autograd's "element 0 of tensors does not require grad"
        lambda r: _custom_loss(r, _detached_loss), "ValueError",
        r"train_step: loss_fn returned a loss that does not depend on the parameters"),
    "loss with two things beside it": (  # was "too many values to unpack (expected 2)"
        lambda r: _custom_loss(r, lambda p, b: (_per_token_loss(p, b).sum(), 1, 2)), "TypeError",
        r"train_step: loss_fn must return a scalar loss or \(loss, aux\), got a tuple of 3"),
    # ---- context parallel: heads, cp, window and sequence (checked at create / on the batch)
    "heads not divisible by the Ulysses degree (ulysses, cp=4)": (
        lambda r: _create_with(r, {"cp": 4}, _context("ulysses"), n_heads=6, n_kv_heads=2, dim=96), "ValueError",
        r"^TrainState.create: heads=6 must be divisible by the Ulysses degree 4 × tp=1 = 4 for ulysses context "
        r"parallel; choose heads a multiple of 4, or a smaller cp, or algo='ring'$"),
    "heads not divisible by tp·cp (ulysses, cp=2 × tp=2)": (
        lambda r: _create_with(r, {"cp": 2, "tp": 2}, _context("ulysses") + dtp.layouts.megatron(False),
                               n_heads=6, n_kv_heads=2, dim=96), "ValueError",
        r"^TrainState.create: heads=6 must be divisible by the Ulysses degree 2 × tp=2 = 4 for ulysses context "
        r"parallel; choose heads a multiple of 4, or a smaller cp or tp, or algo='ring'$"),
    "heads not divisible by the Ulysses degree (hybrid)": (
        lambda r: _create_with(r, {"cp": 4}, _context("hybrid", ulysses_degree=2), n_heads=3, n_kv_heads=1, dim=96),
        "ValueError", r"^TrainState.create: heads=3 must be divisible by the Ulysses degree 2 × tp=1 = 2 for hybrid "
        r"context parallel; choose heads a multiple of 2, or a smaller ulysses_degree, or algo='ring'$"),
    "cp not divisible by the Ulysses degree (hybrid)": (
        lambda r: _create_with(r, {"cp": 4}, _context("hybrid", ulysses_degree=3)), "ValueError",
        r"^TrainState.create: hybrid context parallel needs cp=4 divisible by ulysses_degree=3 with a ring degree "
        r"cp/ulysses_degree > 1 \(got 1.33333\); valid ulysses_degree at cp=4: \[2\]$"),
    "Ulysses degree leaves no ring (hybrid, ulysses_degree = cp)": (
        lambda r: _create_with(r, {"cp": 4}, _context("hybrid", ulysses_degree=4)), "ValueError",
        r"needs cp=4 divisible by ulysses_degree=4 with a ring degree cp/ulysses_degree > 1 \(got 1\); "
        r"valid ulysses_degree at cp=4: \[2\]$"),
    "cp not divisible by the double-ring window": (
        lambda r: _create_with(r, {"cp": 4}, _context("double_ring", window=3)), "ValueError",
        r"^TrainState.create: double_ring needs window > 1, window < cp and cp divisible by window; got window=3 "
        r"at cp=4 \(valid: \[2\]\)$"),
    "window not dividing the hybrid ring degree": (
        lambda r: _create_with(r, {"cp": 4}, _context("hybrid", ulysses_degree=2, window=2)), "ValueError",
        r"^TrainState.create: window=2 must be in \[1, 2\) and divide the ring degree cp/ulysses_degree=2 "
        r"\(valid: \[1\]\)$"),
    "seq not divisible by 2·cp (zigzag ring, shard_batch)": (
        lambda r: _seq(r, 14), "ValueError",
        r"^shard_batch: batch\['tokens'\] of shape \(8, 14\): zigzag load balancing cuts the sequence into 2\*cp "
        r"chunks, so seq_len must be divisible by 2\*cp; got seq_len=14, cp=2 \(seq_len % 4 = 2\); valid: seq_len "
        r"a multiple of 4 \(load_balance=None needs a multiple of 2\)$"),
    "seq not divisible by 2·cp (zigzag ring, a batch the user placed, train_step)": (
        lambda r: _seq(r, 6, place=True), "ValueError",
        r"^train_step: batch\['tokens'\] of shape \(8, 6\): zigzag .* got seq_len=6, cp=2 \(seq_len % 4 = 2\); "
        r"valid: seq_len a multiple of 4"),
    # Its spec is shard_batch's, but the sequence is in natural order, not zigzag's: it trained
    # silently on a permuted sequence (loss 5.5766 where one device's is 5.5750).
    "a batch the user placed under a zigzag ring (train_step)": (
        lambda r: _seq(r, 16, place=True), "ValueError",
        r"^train_step: batch\['tokens'\] was not placed by dtp.shard_batch: under layouts.context\("
        r"load_balance='zigzag'\) on cp=2 the sequence must be in the layout's order \(rank r holds chunks r and "
        r"3-r\), which no placement shows; place the global batch with dtp.shard_batch\(batch, state\)$"),
    "an entry the user placed into shard_batch's batch under a zigzag ring (train_step)": (
        lambda r: _seq(r, 16, place=True, into=True), "ValueError",
        r"^train_step: batch\['tokens'\] was not placed by dtp.shard_batch: under layouts.context\("),
    "a batch the user placed under a zigzag ring (evaluate)": (
        lambda r: _seq(r, 16, place=True, evaluate=True), "ValueError",
        r"^evaluate: batch\['tokens'\] was not placed by dtp.shard_batch: under layouts.context\("),
    # It failed on every rank inside the step: "spec_of expects a DTensor, got Tensor".
    "value_and_grad under a pipeline": (
        lambda r: _pipeline_step(r, dtp.layouts.data() + dtp.layouts.pipeline("1f1b"), 2,
                                 call=dtp.step.value_and_grad), "ValueError",
        r"^value_and_grad: under layouts.pipeline a rank holds the gradients of its stages only, not laid out like "
        r"the parameters; call train_step \(or drop layouts.pipeline\)$"),
    # ---- meshes and specs
    "mesh sizes not matching the world": (
        lambda r: (lambda: dtp.make_mesh(dp=3)), "ValueError",
        r"^make_mesh: dp=3 = 3 devices, but the world size is 4; the product of the axis sizes must equal the "
        r"world size$"),
    "mesh sizes not matching the world (two axes)": (
        lambda r: (lambda: dtp.make_mesh(dp=2, tp=4)), "ValueError",
        r"^make_mesh: dp=2 × tp=4 = 8 devices, but the world size is 4"),
    "spec naming an unknown mesh axis": (
        lambda r: _shard(r, (4, 4), P("xx")), "ValueError",
        r"^x: spec P\('xx'\) names unknown mesh axis 'xx'; the mesh axes are \('dp', 'tp'\)$"),
    "mesh axis used twice in a spec": (
        lambda r: _shard(r, (4, 4), P("dp", "dp")), "ValueError",
        r"^x: spec P\('dp', 'dp'\) uses mesh axis 'dp' twice; each axis may split one dim or be partial, once$"),
    "uneven shard": (
        lambda r: _shard(r, (6, 4), P(("dp", "tp"))), "ValueError",
        r"^x: dim 0 of size 6 is not divisible by dp=2 × tp=2 = 4 \(spec P\(\('dp', 'tp'\)\)\); uneven shards "
        r"are not supported — pad dim 0 to a multiple of 4 or shard it over fewer devices$"),
    # ---- checkpoints: a ValueError naming the file or tensor, and no file lost or changed
    "checkpoint: missing path": (
        lambda r: _checkpoint(r, where="nowhere"), "ValueError",
        r"^checkpoint: no checkpoint at \S+/nowhere \(no manifest.json there, nor a step_\* directory holding one\)$"),
    "checkpoint: truncated data file": (
        lambda r: _checkpoint(r, _truncate), "ValueError",
        rf"^{CKPT}: file __\d_0.distcp has \d+ bytes, \d+ were written \(truncated or replaced\)$"),
    "checkpoint: corrupted data file (one rank checks it)": (
        lambda r: _checkpoint(r, lambda c: _flip(_data_file(c))), "ValueError",
        rf"^{CKPT}: file __\d_0.distcp is corrupt \(CRC32 [0-9a-f]{{8}}, written [0-9a-f]{{8}}\) \[rank \d failed "
        r"this check, the other ranks passed; every rank raises this error\]$"),
    "checkpoint: corrupted metadata": (
        lambda r: _checkpoint(r, lambda c: _flip(c / ".metadata")), "ValueError",
        rf"^{CKPT}: file .metadata is corrupt \(CRC32 [0-9a-f]{{8}}, written [0-9a-f]{{8}}\)$"),
    "checkpoint: code pickled into the metadata": (
        lambda r: _checkpoint(r, _evil_metadata), "ValueError",
        r"^checkpoint: \S+/.metadata is missing or corrupt \(UnpicklingError: posix.system is not part of a DCP "
        r"metadata file\)$"),
    "checkpoint: garbled manifest": (
        lambda r: _checkpoint(r, lambda c: (c / "manifest.json").write_text("{")), "ValueError",
        r"^checkpoint: \S+/manifest.json is unreadable \(Expecting property name"),
    "checkpoint of another vocab": (
        lambda r: _checkpoint(r, cfg=llama.config("tiny", n_layers=1, vocab_size=384)), "ValueError",
        rf"^{CKPT}: tensor 'param/embed' has shape \(256, 64\) in the checkpoint, \(384, 64\) in this state "
        r"\(another model config\?\)$"),
    "checkpoint of another shape (ffn_dim)": (
        lambda r: _checkpoint(r, cfg=llama.config("tiny", n_layers=1, ffn_dim=192)), "ValueError",
        rf"^{CKPT}: tensor 'param/layers.0.w_down' has shape \(128, 64\) in the checkpoint, \(192, 64\) in this "
        r"state \(another model config\?\)$"),
    "checkpoint of fewer layers": (
        lambda r: _checkpoint(r, cfg=llama.config("tiny", n_layers=2)), "ValueError",
        rf"^{CKPT}: its parameters are not this state's: 9 only in this state \(e.g. param/layers.1.attn_norm, "
        r"param/layers.1.mlp_norm, param/layers.1.w_down\); it was saved from another model \(another n_layers\?\): "
        r"load it into a state of that model$"),
    "checkpoint of more layers": (
        lambda r: _checkpoint(r, saved={"cfg": llama.config("tiny", n_layers=2)}), "ValueError",
        rf"^{CKPT}: its parameters are not this state's: 9 only in the checkpoint \(e.g. param/layers.1.attn_norm, "
        r"param/layers.1.mlp_norm, param/layers.1.w_down\); it was saved from another model"),
    "checkpoint of more layers, optimizer state alike (plain SGD)": (
        lambda r: _checkpoint(r, saved={"cfg": llama.config("tiny", n_layers=2), "opt": dtp.optim.sgd(1e-2)},
                              opt=dtp.optim.sgd(1e-2)), "ValueError",
        rf"^{CKPT}: its parameters are not this state's: 9 only in the checkpoint"),
    "checkpoint of another optimizer": (
        lambda r: _checkpoint(r, opt=dtp.optim.sgd(1e-2, momentum=0.9)), "ValueError",
        rf"^{CKPT}: its optimizer state does not match this state's optimizer \(e.g. .*\); load it with the "
        r"optimizer it was saved with$"),
    "checkpoint of another dtype": (
        lambda r: _checkpoint(r, dtype=torch.float32), "ValueError",
        rf"^{CKPT}: tensor 'param/embed' is torch.float64 in the checkpoint, torch.float32 in this state; cast the "
        r"model \(dtp does not cast silently\)$"),
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
        made = build(rank)  # the call, or (the call, a check after it returning problems)
        call, after = made if isinstance(made, tuple) else (made, None)
        with dtp.comm_log() as log:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                call()
                got = ("no error", "")
            except (ValueError, TypeError) as e:
                got = (type(e).__name__, str(e))
            elapsed = (time.perf_counter() - t0, time.thread_time() - c0)
        out.append((*got, len(log), elapsed, after() if after is not None else []))
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
    for rank, (got, msg, n_records, elapsed, problems) in enumerate(ranks):
        assert got == kind, f"{name} rank {rank}: expected {kind}, got {got}: {msg}"
        assert re.search(pattern, msg), f"{name} rank {rank}: {msg!r} does not match {pattern!r}"
        # Never a hang: a rank left in a collective would wait for the pool's timeout. The
        # work before the error is under a second of the calling thread's CPU; wall time only
        # bounds the wait (four ranks on a loaded 2-core machine took up to 3.3 s of wall,
        # past a 1 s wall bound). A row raised after the compute runs a first train_step (its
        # one-time set-up: 1.0 s of CPU measured here) before the loss's shape is known.
        wall, cpu = elapsed
        assert cpu < (3.0 if name in AFTER_COMPUTE else 1.0) and wall < 10.0, \
            f"{name} rank {rank}: raised after {wall:.2f}s ({cpu:.2f}s of CPU)"
        if kind != "no error" and name not in AFTER_COMPUTE:
            assert n_records == 0, f"{name} rank {rank}: {n_records} collectives before the error"
        assert not problems, f"{name} rank {rank}: after the call: {problems}"
    assert len({r[1] for r in ranks}) == 1, f"{name}: the ranks' messages differ: {ranks}"


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


def test_llama_loss_names_the_keys_a_batch_lacks():
    """A batch without ``targets`` (a user's loop building its own batches): the keys the
    model reads and the ones given, not a bare ``KeyError: 'targets'`` from inside it."""
    from dtp.models import llama

    cfg = llama.config("tiny")
    with pytest.raises(KeyError, match=r"llama.loss: the batch needs 'tokens' and 'targets' .* got \['tokens'\]"):
        llama.loss(llama.init(cfg), {"tokens": torch.zeros(2, 8, dtype=torch.long)}, cfg)


@pytest.mark.parametrize("pipelined", [False, True])
def test_llama_names_targets_that_are_not_one_per_token(pipelined):
    """``targets`` of (batch, seq - 1) beside ``tokens`` (batch, seq), the off-by-one of a
    hand-built batch: one line with both shapes, from the plain loss and from the first
    layer a pipeline runs, not ``F.cross_entropy``'s flattened batch sizes."""
    cfg = llama.config("tiny", n_layers=1)
    toks = torch.zeros(2, 9, dtype=torch.long)
    fn = llama.sequential(cfg) if pipelined else functools.partial(llama.loss, cfg=cfg)
    with pytest.raises(ValueError, match=r"batch\['targets'\] has shape \(2, 8\), batch\['tokens'\] \(2, 9\)"):
        fn(llama.init(cfg), {"tokens": toks, "targets": toks[:, 1:]})
