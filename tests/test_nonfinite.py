"""Non-finite steps: a NaN/inf loss or gradient norm skips the update on every rank alike,
even when the NaN comes from one rank only (its data, or one element of its gradient that
lands in one ZeRO slice). The skipped step leaves parameters, master slices, optimizer
state and ``step`` bit-identical, says so in ``metrics["skipped"]`` on every rank, warns on
the first rank only, and training goes on exactly as if the bad batch had never come —
on the all-reduce, clipped, ZeRO per-bucket (streaming) and ZeRO-3 paths, under tp + sp,
and when the skipped step is ZeRO's first. The CLI counts skips and aborts after
``--max-skipped`` in a row."""

import contextlib
import functools
import json
import math
import warnings
from collections.abc import Mapping

import optree
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import dtp
from dtp.strategies.zero import ZeroState
from dtp.cli.loop import SkipCounter, TrainingAborted
from dtp.models import llama
from dtp.ops import cross_entropy
from dtp.testing import run

CFG = llama.config("tiny", n_layers=1)
LOSS = functools.partial(llama.loss, cfg=CFG)
CLIP = 0.05
BUCKET = 0.02  # several buckets, so the per-bucket path has more than one


def _batch(seed, b=8, s=16):
    tok = torch.randint(0, CFG.vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}


class _PoisonGrad(torch.autograd.Function):
    """Identity forward; backward writes ``value`` into element 0 of the local gradient
    on rank ``rank`` only (one rank's pending sum, before any reduction)."""

    @staticmethod
    def forward(ctx, x, rank, value):  # type: ignore[override]
        ctx.rank, ctx.value = rank, value
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        if dist.get_rank() != ctx.rank:
            return g, None, None
        # On the local tensor: a DTensor op on one rank alone could redistribute (a
        # collective the other ranks never join); from_local with run_check=False sends nothing.
        local = (g.to_local() if isinstance(g, DTensor) else g).clone()
        local[(0,) * local.dim()] = ctx.value
        if not isinstance(g, DTensor):
            return local, None, None
        return DTensor.from_local(local, g.device_mesh, g.placements, run_check=False, shape=g.shape,
                                  stride=g.stride()), None, None


class _Poisoned(Mapping):
    """The parameter tree with ``lm_head`` behind :class:`_PoisonGrad`; every rank reads
    the parameters in the same order (ZeRO builds its buckets from that order)."""

    def __init__(self, params, rank, value):
        self.params, self.rank, self.value = params, rank, value

    def __getitem__(self, key):
        x = self.params[key]
        return _PoisonGrad.apply(x, self.rank, self.value) if key == "lm_head" else x

    def __iter__(self):
        return iter(self.params)

    def __len__(self):
        return len(self.params)


def _bad_loss(poison, rank):
    """A loss whose NaN/inf starts on ``rank`` alone: ``"loss"`` multiplies that rank's
    logits shard by NaN (loss and gradients non-finite); ``"grad nan"``/``"grad inf"``
    poisons one element of that rank's ``lm_head`` gradient (the loss stays finite)."""
    def loss(params, batch):
        if poison == "loss":
            logits = llama.apply(params, batch["tokens"], CFG)
            if dist.get_rank() == rank:
                logits = logits * float("nan")  # a local op: the other ranks' shards stay finite
            return cross_entropy(logits, batch["targets"])
        value = float("nan") if poison == "grad nan" else float("inf")
        return LOSS(_Poisoned(params, rank, value), batch)
    return loss


def _local(x):
    return (x.to_local() if isinstance(x, DTensor) else x).detach().clone()


def _snapshot(state):
    """Everything a skipped step must leave alone: step, whole parameters, this rank's
    master slices (ZeRO) and optimizer state."""
    params = optree.tree_map(lambda x: x.full_tensor().detach() if isinstance(x, DTensor) else x.detach(),
                             dtp.gather_params(state))
    return {"step": state.step, "params": optree.tree_leaves(params),
            "master": [_local(m) for m in state.strategy.master] if isinstance(state.strategy, ZeroState) else [],
            "opt_state": [_local(x) for x in optree.tree_leaves(state.opt_state)]}


def _same(a, b, parts=("step", "params", "master", "opt_state")):
    """Bit-identical (``torch.equal``), part by part."""
    return a["step"] == b["step"] and all(
        len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k])) for k in parts if k != "step")


@contextlib.contextmanager
def _local_gradients_seen():
    """Whether this rank's reduced gradients (its slices under ZeRO) held a non-finite
    value, per step: read where train_step hands them to the global norm."""
    from dtp.strategies import replicated, zero

    seen, norm = [], dtp.optim.global_norm

    def spy(grads, **kwargs):  # kwargs: the leaves a run holds already
        seen.append(not all(bool(torch.isfinite(_local(g)).all()) for g in optree.tree_leaves(grads)))
        return norm(grads, **kwargs)

    # The strategy's norm (run.norm), which clipping reuses: once per step either way.
    replicated.global_norm = zero.global_norm = spy
    try:
        yield seen
    finally:
        replicated.global_norm = zero.global_norm = norm


def _steps(mesh_axes, zero, clip, schedule, bad):
    """Train on ``schedule`` (batch seeds; ``None`` is the poisoned batch); returns the
    final state, every step's metrics and the warnings each step raised."""
    mesh = dtp.make_mesh(**mesh_axes)
    layout = dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel="tp" in mesh_axes)
    layout = layout + (dtp.layouts.zero(**zero, bucket_mb=BUCKET) if zero else dtp.Layout())
    opt = dtp.optim.adamw(dtp.optim.warmup_cosine(3e-3, 1, 4), weight_decay=0.1)
    state = dtp.TrainState.create(llama.init(CFG, seed=0, dtype=torch.float64), opt, mesh=mesh, layout=layout,
                                  axes=llama.param_axes(CFG), axis_sizes=llama.axis_sizes(CFG))
    metrics, warned, states = [], [], [state]
    for seed in schedule:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state, m = dtp.train_step(LOSS if seed is not None else bad, state,
                                      dtp.shard_batch(_batch(2 if seed is None else seed), state), clip_norm=clip)
        metrics.append(m)
        warned.append([str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)])
        states.append(state)
    return states, metrics, warned


def _case(mesh_axes, zero, clip, poison, bad_rank):
    """Facts about one case on this rank: run A trains on batches 0, 1 and run B on 0, bad,
    1; under ZeRO run C on bad, 0, 1 too (the skipped step is the one that builds the
    buckets, cuts the master slices and initialises the optimizer state)."""
    bad = _bad_loss(poison, bad_rank)
    a_states, _, _ = _steps(mesh_axes, zero, clip, [0, 1], bad)
    with _local_gradients_seen() as local_bad:
        b_states, b_metrics, b_warned = _steps(mesh_axes, zero, clip, [0, None, 1], bad)
    a_end = _snapshot(a_states[-1])
    facts = {
        "skipped": [m["skipped"] for m in b_metrics],
        "loss": b_metrics[1]["loss"],
        "grad_norm": b_metrics[1]["grad_norm"],
        "kept": _same(_snapshot(b_states[1]), _snapshot(b_states[2])),
        "b_equals_a": _same(_snapshot(b_states[-1]), a_end),
        "steps": (a_states[-1].step, b_states[-1].step),
        "warned": [len(w) for w in b_warned],
        "message": (b_warned[1] or [""])[0],
        "local_bad": local_bad,
    }
    if zero:
        c_states, c_metrics, c_warned = _steps(mesh_axes, zero, clip, [None, 0, 1], bad)
        skipped = c_states[1]
        fresh = skipped.optimizer.init(list(skipped.strategy.master))
        facts.update({
            "c_skipped": [m["skipped"] for m in c_metrics],
            # Before the first step there are no master slices nor optimizer state to compare.
            "first_kept": _same(_snapshot(skipped), _snapshot(c_states[0]), ("step", "params")),
            "first_opt_fresh": all(torch.equal(_local(x), _local(y)) for x, y in zip(
                optree.tree_leaves(skipped.opt_state), optree.tree_leaves(fresh))),
            "c_equals_a": _same(_snapshot(c_states[-1]), a_end),
            "c_warned": [len(w) for w in c_warned],
        })
    return facts


def _cases(mesh_axes, cases):
    return [_case(mesh_axes, *case) for case in cases]


# (zero options, clip, poison, rank the NaN starts on). Rank 1 is not the rank that warns,
# and under ZeRO not the owner of the slice its poisoned element is reduce-scattered to.
DP2_CASES = {
    "dp2 all-reduce, NaN loss": (None, None, "loss", 1),
    "dp2 clipped, NaN in one gradient element": (None, CLIP, "grad nan", 1),
    "dp2 zero1 per-bucket, NaN in one rank's slice": (dict(stage=1), None, "grad nan", 1),
    "dp2 zero1 overlapped per-bucket, inf gradient": (dict(stage=1, overlap_grad_reduce=True,
                                                            overlap_param_gather=True), None, "grad inf", 1),
    "dp2 zero3 per-bucket, NaN loss": (dict(stage=3), None, "loss", 1),
    "dp2 zero3 clipped, NaN gradient": (dict(stage=3, overlap_grad_reduce=True), CLIP, "grad nan", 1),
}
# dp2 × tp2 with sequence parallel: the NaN starts on rank 3 (dp 1, tp 1) only. One case:
# four ranks on a small machine are slow, and ZeRO and clipping are covered above.
TP_CASES = {
    "dp2×tp2+sp clipped, NaN in one tp shard's gradient": (None, CLIP, "grad nan", 3),
}


@functools.lru_cache(maxsize=None)
def _results(world):
    mesh_axes, cases = ({"dp": 2}, DP2_CASES) if world == 2 else ({"dp": 2, "tp": 2}, TP_CASES)
    per_rank = run(_cases, mesh_axes, list(cases.values()), world_size=world)
    return {name: [r[i] for r in per_rank] for i, name in enumerate(cases)}


@pytest.mark.parametrize("world, name", [(2, n) for n in DP2_CASES] + [(4, n) for n in TP_CASES])
def test_a_non_finite_step_is_skipped_on_every_rank_and_training_resumes_exactly(world, name):
    ranks = _results(world)[name]
    poison = {**DP2_CASES, **TP_CASES}[name][2]
    for r, facts in enumerate(ranks):
        what = f"{name}, rank {r}"
        assert facts["skipped"] == [False, True, False], what  # the same on every rank
        assert facts["kept"], f"{what}: the skipped step changed the state"
        assert facts["b_equals_a"], f"{what}: training after the skip differs from never seeing the bad batch"
        assert facts["steps"] == (2, 2), f"{what}: step counts applied updates, got {facts['steps']}"
        # One warning per skipped step, on the mesh's first rank only.
        assert facts["warned"] == ([0, 1, 0] if r == 0 else [0, 0, 0]), what
        if "c_skipped" in facts:  # ZeRO, the first step skipped
            assert facts["c_skipped"] == [True, False, False], what
            assert facts["first_kept"], f"{what}: a skipped first step changed the parameters or step"
            assert facts["first_opt_fresh"], f"{what}: a skipped first step left no fresh optimizer state"
            assert facts["c_equals_a"], f"{what}: training after a skipped first step differs"
            assert facts["c_warned"] == ([1, 0, 0] if r == 0 else [0, 0, 0]), what
    assert all(not math.isfinite(f["grad_norm"]) for f in ranks), name
    if poison == "loss":
        assert all(math.isnan(f["loss"]) for f in ranks), name
        assert "non-finite loss (nan)" in ranks[0]["message"], ranks[0]["message"]
    else:  # the loss is fine; only the gradient norm, global on every rank, shows the poison
        assert all(f["loss"] == ranks[0]["loss"] and math.isfinite(f["loss"]) for f in ranks), name
        assert "non-finite gradient norm" in ranks[0]["message"] and "loss" not in ranks[0]["message"]
    assert "at step 1: update skipped" in ranks[0]["message"], ranks[0]["message"]
    local_bad = [f["local_bad"][1] for f in ranks]  # the bad step's gradients, as each rank holds them
    if "slice" in name:  # the poisoned element reached one rank's slice; every rank skipped all the same
        assert local_bad.count(True) == 1, (name, local_bad)
    if "tp shard" in name:  # only the tp ranks holding that vocab shard (1 and 3) saw it
        assert local_bad == [False, True, False, True], (name, local_bad)
    assert any(local_bad) and all(f["local_bad"][0] is f["local_bad"][2] is False for f in ranks), name


# --------------------------------------------------------------------------- the CLI


def test_skip_counter_counts_totals_and_aborts_after_max_in_a_row():
    counter = SkipCounter(max_skipped=2)
    for step, skipped, total in [(1, False, 0), (2, True, 1), (3, False, 1), (4, True, 2)]:
        counter.add(skipped)
        counter.check(step)  # never two in a row yet
        assert counter.total == total
    counter.add(True)
    with pytest.raises(TrainingAborted, match=r"step 5: 2 steps in a row skipped .*since step 3.*--max-skipped 2"):
        counter.check(5)
    never = SkipCounter(max_skipped=0)  # 0: count, never abort
    for step in range(1, 20):
        never.add(True)
        never.check(step)
    assert never.total == never.in_a_row == 19


def test_cli_counts_skipped_steps_and_aborts_after_max_skipped(tmp_path, capsys):
    # An lr of 1e20 with no warm-up: the first update blows the weights up, every later
    # forward overflows to NaN, and each of those steps is skipped until the limit.
    # The step lines say SKIPPED: train_step's own warning (counting updates, not the run's
    # steps) is not shown beside them.
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        code = dtp.cli.main(["train", "--steps", "6", "--batch", "2", "--seq", "16", "--lr", "1e20", "--warmup", "0",
                             "--clip", "0", "--max-skipped", "2", "--out", str(out)])
    captured = capsys.readouterr()
    assert captured.out.count("SKIPPED (non-finite)") == 2, captured.out
    err = captured.err
    assert code == 1, err
    assert "training aborted at step 3: 2 steps in a row skipped" in err and len(err.strip().splitlines()) == 1, err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["skipped"], r["skipped_steps"]) for r in records] == [(False, 0), (True, 1), (True, 2)]


def test_report_marks_skipped_steps_and_summary_counts_them():
    step = {"loss": float("nan"), "grad_norm": float("nan"), "lr": 1e-3, "tokens": 32, "step_time": 0.01,
            "comm_bytes": {}, "skipped": True}
    assert dtp.cli.format_step(2, 3, step).endswith("comm none SKIPPED (non-finite)")
    assert not dtp.cli.format_step(2, 3, {**step, "loss": 4.0, "skipped": False}).endswith(")")
    summary = dtp.cli.summarize([{**step, "loss": 5.0, "skipped": False}, step, {**step, "loss": 4.5,
                                                                                  "skipped": False}])
    assert summary["skipped_steps"] == 1 and summary["min_loss"] == 4.5  # the NaN of the skipped step left out


def test_an_aborted_run_finishes_the_checkpoint_it_was_writing(tmp_path, capsys):
    """--async-save: the step-1 checkpoint is still being written when step 2 is skipped and
    --max-skipped 1 aborts the run; every rank aborts at the same step, so the save is
    finished first. Before, it stayed step_00000001.partial and --resume found nothing."""
    out = tmp_path / "run"
    code = dtp.cli.main(["train", "--steps", "6", "--batch", "2", "--seq", "16", "--lr", "1e20", "--warmup", "0",
                         "--clip", "0", "--max-skipped", "1", "--save-every", "1", "--async-save", "--out", str(out)])
    assert code == 1 and "training aborted at step 2" in capsys.readouterr().err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]


def test_a_resume_goes_on_counting_the_skipped_steps(tmp_path, capsys):
    """The skip counters restarted at 0 on a resume: ``skipped_steps`` went back to 0, and a
    run aborted by --max-skipped 3 resumed for 3 more skips, saying "unchanged since" a
    later step than the truth. The total is the iterations less the updates; the run in a
    row travels in the checkpoint. The resumed run aborts where the run would have."""
    out = tmp_path / "run"
    run = ["train", "--steps", "8", "--batch", "2", "--seq", "16", "--lr", "1e20", "--warmup", "0", "--clip", "0",
           "--max-skipped", "3", "--save-every", "1", "--out", str(out)]
    assert dtp.cli.main(run) == 1
    aborted = "training aborted at step 4: 3 steps in a row skipped (non-finite loss or gradient norm; parameters " \
              "unchanged since step 1)"
    assert aborted in capsys.readouterr().err
    # the last checkpoint is of iteration 3 (the abort comes before step 4's save), two skipped in a row
    assert dtp.cli.main([*run, "--resume"]) == 1
    assert aborted in capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped"], r["skipped_steps"]) for r in records] == \
        [(1, False, 0), (2, True, 1), (3, True, 2), (4, True, 3)]
