"""pipe-experts (``layouts.expert(pipe_experts=True, multi_data=N)``, :mod:`dtp.ops.moe_pipe`):
the ``tiny-moe`` Llama (4 experts) trained 3 SGD steps in fp64 equals one device — loss
and parameters within 1e-10 — per local expert on ep2 (2 local experts), with
multi_data 2 on ep2 (top-1), with multi_data 4 on ep4 (one local expert: MindSpeed's
case for multi-data), on dp2 × ep2 (``-m slow``) and with ep folded out of dp4; the
middle step recomputes each block, so the pipeline runs again in backward. With a capacity (per-rank
dropping) it equals the unpipelined ep run. The comm log shows the schedule: every
chunk's dispatch is handed out before the first chunk's combine, each chunk's bytes add
up to the unpipelined dispatch's, and the backward moves the same chunks the other way.
Bad options are a ``ValueError`` on every rank before any collective."""

from __future__ import annotations

import functools

import optree
import pytest
import torch

import dtp
from dtp.models import llama
from dtp.testing import assert_tree_close, reference_value_and_grad, run

STEPS, LR, B, S = 3, 0.1, 4, 16
# name: (mesh axes, expert axis, tiny-moe overrides, layouts.expert options, megatron sequence_parallel or None)
TP_PIPE = dict(pipe_experts=True, tp_axis="tp")
CASES = {
    "ep2 per expert": (dict(ep=2), "ep", {}, dict(pipe_experts=True), None),
    "ep2 multi_data 2 top1": (dict(ep=2), "ep", {"top_k": 1}, dict(pipe_experts=True, multi_data=2), None),
    "ep4 multi_data 4": (dict(ep=4), "ep", {}, dict(pipe_experts=True, multi_data=4), None),
    "dp2 x ep2 multi_data 2": (dict(dp=2, ep=2), "ep", {}, dict(pipe_experts=True, multi_data=2), None),
    "ep folded = dp4 multi_data 3": (dict(dp=4), "dp", {}, dict(pipe_experts=True, multi_data=3), None),
    # experts split over tp (expert tensor parallel): tp all-gather / reduce-scatter per chunk
    "ep2 x tp2 + sp, experts over tp": (dict(ep=2, tp=2), "ep", {}, dict(tp_axis="tp"), True),
    "ep2 x tp2 + sp, experts over tp, multi_data 2": (dict(ep=2, tp=2), "ep", {"top_k": 1},
                                                      dict(TP_PIPE, multi_data=2), True),
    "ep2 x tp2 + sp, experts over tp, multi_stream": (dict(ep=2, tp=2), "ep", {}, dict(TP_PIPE, multi_stream=True),
                                                      True),
    "ep2 x tp2, experts over tp, no sp": (dict(ep=2, tp=2), "ep", {}, TP_PIPE, False),
    "ep2 x tp2 + sp, experts whole, multi_stream": (dict(ep=2, tp=2), "ep", {},
                                                    dict(pipe_experts=True, multi_stream=True), True),
}


def _batch(seed=1):
    tok = torch.randint(0, 256, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


def _train(cfg, axes, layout, steps=STEPS, microbatches=1):
    loss_fn = functools.partial(llama.loss, cfg=cfg)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.float64), dtp.optim.sgd(LR),
                                  mesh=dtp.make_mesh(**axes), layout=layout, axes=llama.param_axes(cfg),
                                  axis_sizes=llama.axis_sizes(cfg))
    placed, losses = dtp.shard_batch(_batch(), state), []
    with dtp.comm_log() as log:
        for step in range(steps):  # the middle step recomputes every block
            state, metrics = dtp.train_step(loss_fn, state, placed, recompute="full" if step == 1 else None,
                                            microbatches=microbatches)
            losses.append(metrics["loss"])
    params = optree.tree_map(lambda p: p.full_tensor().detach(), dtp.gather_params(state))
    return losses, params, [(r.kind, r.axis, r.tag, r.bytes, r.issued, r.completed) for r in log.records]


def _rank(names: list[str]) -> dict:
    out = {}
    for name in names:
        axes, axis, overrides, opts, sp = CASES[name]
        layout = dtp.layouts.data() + dtp.layouts.expert(axis=axis, **opts)
        if sp is not None:
            layout = layout + dtp.layouts.megatron(sequence_parallel=sp)
        out[name] = _train(llama.config("tiny-moe", **overrides), axes, layout, steps=STEPS)
    return out


@functools.lru_cache(maxsize=None)
def _reference(overrides: tuple) -> tuple[list[float], dict]:
    cfg = llama.config("tiny-moe", **dict(overrides))
    loss_fn = functools.partial(llama.loss, cfg=cfg)
    params, batch, losses = llama.init(cfg, seed=0, dtype=torch.float64), _batch(), []
    for _ in range(STEPS):
        loss, grads = reference_value_and_grad(loss_fn, params, batch)
        losses.append(loss)
        params = optree.tree_map(lambda p, g: (p - LR * g).detach(), params, grads)
    return losses, params


# The slow run's: multi_data 2 on dp2 × ep2. Its chunks are "ep2 multi_data 2 top1"'s
# (the ep group's tokens, whatever dp gave it), dp beside ep is test_expert_parallel.py's
# dp2 x ep2 (1.0 s of the 4-rank cases' 7.5 on warm ranks, measured on torch 2.13, 2 cores).
SLOW = {"dp2 x ep2 multi_data 2"}


@functools.lru_cache(maxsize=None)
def _results(world: int, slow: bool = False) -> dict:
    names = [n for n, (axes, *_) in CASES.items()
             if int(torch.tensor(list(axes.values())).prod()) == world and (n in SLOW) == slow]
    return run(_rank, names, world_size=world)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES])
def test_pipe_experts_trains_as_one_device_fp64(name) -> None:
    axes, axis, overrides, opts, _ = CASES[name]
    losses, params = _reference(tuple(sorted(overrides.items())))
    world = int(torch.tensor(list(axes.values())).prod())
    for r, res in enumerate(_results(world, True) if name in SLOW else _results(world)):  # one cache key each
        got_losses, got_params, records = res[name]
        for step, (a, e) in enumerate(zip(got_losses, losses)):
            assert abs(a - e) <= 1e-10 * abs(e), f"{name}: rank {r} step {step}: {a} vs {e}"
        assert_tree_close(got_params, params, name=f"{name} rank {r} params", rtol=1e-10, atol=1e-12)
        tags = [t[2] for t in records]
        chunks = {t for t in tags if t.startswith("moe pipe dispatch ") and "backward" not in t}
        local = 4 // axes.get(axis, 1)
        assert len(chunks) == local * opts.get("multi_data", 1), (name, sorted(chunks))
        assert "moe dispatch" not in tags, "the unpipelined dispatch ran too"
        over_tp = any(t.startswith("moe pipe gather ") for t in tags)
        assert over_tp == ("tp_axis" in opts), (name, "tp legs")


def test_the_schedule_hands_out_every_dispatch_before_the_first_combine() -> None:
    name = "ep4 multi_data 4"
    for r, res in enumerate(_results(4)):
        records = res[name][2]
        # the first MoE block's forward: its counts exchange, then its chunks
        start = next(i for i, t in enumerate(records) if t[2] == "moe dispatch counts")
        block = records[start + 1:start + 1 + 8]
        kinds = [t[2] for t in block]
        assert kinds == [f"moe pipe dispatch {i}" for i in range(4)] + [f"moe pipe combine {i}" for i in range(4)], (
            r, kinds)
        # issued in that order: a chunk's combine is posted after its rows arrived and computed
        assert all(a[4] <= b[4] for a, b in zip(block, block[1:])), r
        back = [t for t in records if "backward" in t[2] and t[2].startswith("moe pipe")]
        assert {t[2] for t in back} == {f"moe pipe {w} backward {i}" for w in ("combine", "dispatch")
                                        for i in range(4)}


def test_multi_stream_never_runs_an_ep_all_to_all_beside_a_tp_gather_or_scatter() -> None:
    name = "ep2 x tp2 + sp, experts over tp, multi_stream"
    for r, res in enumerate(_results(4)):
        legs = [t for t in res[name][2] if t[2].startswith("moe pipe")]
        ep = [(t[4], t[5]) for t in legs if t[1] == "ep"]
        tp = [(t[4], t[5]) for t in legs if t[1] == "tp"]
        assert ep and tp and len(ep) + len(tp) == len(legs), (r, len(ep), len(tp))
        clash = [(a, b) for a in ep for b in tp if a[0] < b[1] and b[0] < a[1]]
        assert not clash, f"rank {r}: {len(clash)} ep/tp overlaps, first {clash[0]}"


def _capacity_rank() -> dict:
    cfg = llama.config("tiny-moe", capacity_factor=1.0)
    plain = dtp.layouts.data() + dtp.layouts.expert()
    piped = dtp.layouts.data() + dtp.layouts.expert(pipe_experts=True, multi_data=2)
    return {"plain": _train(cfg, dict(ep=2), plain), "piped": _train(cfg, dict(ep=2), piped)}


def _moved(records, prefix: str) -> int:
    return sum(t[3] for t in records if t[2] == prefix or (t[2].startswith(prefix + " ") and t[2][len(prefix) + 1:].isdigit()))


def test_with_capacity_pipe_experts_equals_unpipelined_ep_and_moves_the_same_bytes() -> None:
    for r, res in enumerate(run(_capacity_rank, world_size=2)):
        (pl, pp, precs), (ql, qp, qrecs) = res["plain"], res["piped"]
        for step, (a, e) in enumerate(zip(ql, pl)):
            assert abs(a - e) <= 1e-10 * abs(e), f"rank {r} step {step}: {a} vs {e}"
        assert_tree_close(qp, pp, name=f"rank {r}", rtol=1e-10, atol=1e-12)
        # the chunks carry exactly the rows the one-shot exchange carries, each way, fwd and bwd
        for plain, piped in (("moe dispatch", "moe pipe dispatch"), ("moe combine", "moe pipe combine"),
                             ("moe dispatch backward", "moe pipe dispatch backward"),
                             ("moe combine backward", "moe pipe combine backward")):
            assert _moved(precs, plain) == _moved(qrecs, piped) > 0, (r, plain, _moved(precs, plain),
                                                                       _moved(qrecs, piped))


def _bad_rank() -> dict:
    out = {}
    moe, dense = llama.config("tiny-moe"), llama.config("tiny")
    cases = {
        "pipe_experts on a dense model": (dense, dict(ep=2), dtp.layouts.data() + dtp.layouts.expert(
            pipe_experts=True)),
        "multi_stream without sp": (moe, dict(ep=2), dtp.layouts.data() + dtp.layouts.expert(
            pipe_experts=True, multi_stream=True)),
        "multi_data above the tokens": (moe, dict(ep=2), dtp.layouts.data() + dtp.layouts.expert(
            pipe_experts=True, multi_data=B * S)),
        # a rank's B/2 rows pass shard_batch (32 tokens), a microbatch's 16 do not: moe_ffn
        # failed on the ranks, where a pipeline's peers would have waited for it
        "multi_data above a microbatch's tokens": (moe, dict(ep=2), dtp.layouts.data() + dtp.layouts.expert(
            pipe_experts=True, multi_data=B * S // 4 + 1), 2),
    }
    for key, (cfg, axes, layout, *microbatches) in cases.items():
        with dtp.comm_log() as log:
            try:
                _train(cfg, axes, layout, steps=1, microbatches=microbatches[0] if microbatches else 1)
                out[key] = ("no error", None)
            except ValueError as e:
                out[key] = (str(e), len(log.records))
    return out


def test_bad_options_fail_alike_on_every_rank_before_any_collective() -> None:
    results = run(_bad_rank, world_size=2)
    expected = {"pipe_experts on a dense model": "needs a mixture-of-experts model",
                "multi_stream without sp": "needs layouts.megatron(sequence_parallel=True)",
                "multi_data above the tokens": "fewer than layouts.expert(multi_data=64) pieces",
                "multi_data above a microbatch's tokens": "train_step: batch['tokens'] of shape (4, 16) in 2 "
                                                          "microbatches gives each rank 16 tokens, fewer than "
                                                          "layouts.expert(multi_data=17) pieces"}
    for key, words in expected.items():
        messages = {res[key][0] for res in results}
        assert len(messages) == 1, (key, messages)
        message, collectives = results[0][key]
        assert words in message, (key, message)
        assert collectives == 0, (key, collectives)
    for opts, words in ((dict(multi_data=2), "needs pipe_experts=True"), (dict(multi_stream=True),
                        "needs pipe_experts=True"), (dict(pipe_experts=True, multi_data=0), "int >= 1")):
        with pytest.raises(ValueError, match=words.replace("=", "=").replace("(", r"\(")):
            dtp.layouts.expert(**opts)
