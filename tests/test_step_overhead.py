"""dtp's fixed cost per step, counted (never timed): ``DTensor.from_local`` wraps and
collectives waited right after posting (``async_op=False`` records), per steady-state
step of a tiny Llama on 2 gloo ranks. A regression shows up as a count, not as noise.

Before the counts were cut (tiny, per step): tp=2 + SP 141 wraps and 28 synchronous
collectives, ZeRO-3 103 and 3, plain data parallel 176 and 23.

Python function calls per step (cProfile's count, rank 0), tiny Llama, SGD: world size 1
2,300 → 1,320 (the eager step around the same model: 425), tp=2 + SP 30,570 → 25,130
(foreach optimizer over local shards, ``ops.rms_norm`` on local shards, no runtime
protocol check per step). Later, world 1 1,278 → 1,113 and tp=2 + SP 24,147 → 23,899
(torch 2.13): loops instead of a generator per leaf where every step checks its leaves
(``leafwise._all_plain``, ``global_norm``'s dtype, ``_as_params``), replicated
gradients on one device passed through without a spec each, the step's specs read only
where a mesh of several devices could compute locally. Bounded loosely: the counts move
with torch's own code."""

from __future__ import annotations

from functools import partial

import torch

from dtp.testing import run


def _counts(which: str, steps: int = 1) -> tuple[float, dict[str, float], float]:
    import dtp
    from dtp.models import llama
    from torch.distributed.tensor import DTensor

    cfg = llama.config("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    tokens[0, 3] = -100  # a masked target: the count's all-reduce has work to do
    batch = {"tokens": tokens[:, :-1].clamp(min=0), "targets": tokens[:, 1:]}
    if which == "tp":
        mesh, layout, opt = (dtp.make_mesh(tp=2), dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=True),
                             dtp.optim.sgd(0.1))
    else:
        zero = dtp.layouts.zero(3, overlap_grad_reduce=True, overlap_param_gather=True) if which == "zero3" else None
        mesh, layout, opt = dtp.make_mesh(dp=2), dtp.layouts.data() + zero if zero else dtp.layouts.data(), \
            dtp.optim.adamw(1e-3, weight_decay=0.01)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), opt, mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    b = dtp.shard_batch(batch, state)
    loss_fn = partial(llama.loss, cfg=cfg)
    for _ in range(2):  # step one plans ZeRO's buckets and checks the batch signature
        state, _ = dtp.train_step(loss_fn, state, b)
    wraps = [0]
    original = DTensor.from_local

    def counted(*args, **kwargs):
        wraps[0] += 1
        return original(*args, **kwargs)

    DTensor.from_local = staticmethod(counted)
    try:
        with dtp.comm_log() as log:
            for _ in range(steps):
                state, metrics = dtp.train_step(loss_fn, state, b)
    finally:
        DTensor.from_local = original
    waited: dict[str, float] = {}
    for r in log.records:
        if not r.async_op:
            waited[r.tag] = waited.get(r.tag, 0) + 1 / steps
    return wraps[0] / steps, waited, metrics["loss"]


def test_wraps_and_immediately_waited_collectives_per_step() -> None:
    tp, zero3, dp = (run(_counts, which, world_size=2)[0] for which in ("tp", "zero3", "dp"))
    # Every wrap of a known placement is built directly (reshard results, local_map
    # outputs, gradients, optimizer updates, ZeRO's saved bucket views): none left.
    assert (tp[0], zero3[0], dp[0]) == (0, 0, 0)
    # tp + SP: the sequence-parallel collectives (the async-TP rings' business) and the
    # two cross-entropy exchanges are needed at once; the gradient-norm all-reduce
    # decides the non-finite skip. The norm weights' gradient all-reduces are posted
    # together and waited after (async), the target count is posted before forward.
    sp = {t: c for t, c in tp[1].items() if t.endswith(("_in", "_out", "backward"))}
    assert sum(sp.values()) == 20 and "grad reduce" not in tp[1], tp[1]
    assert {t: c for t, c in tp[1].items() if t not in sp} == {"cross_entropy": 1, "cross_entropy max": 1,
                                                               "global_norm": 1}
    # ZeRO-3 and data parallel: the loss's own all-reduce (and ZeRO's gradient norm over
    # the dp slices); the count is posted before forward, the gradients' are async.
    assert zero3[1] == {"loss": 1, "global_norm": 1}, zero3[1]
    assert dp[1] == {"loss": 1}, dp[1]  # reduced gradients are replicated: their norm needs no collective


def _python_calls(which: str, steps: int = 2) -> tuple[float, float]:
    """cProfile's count of Python calls per steady-state step, and of the walks over a
    whole tree among them (optree's flatten and flatten_up_to, ~10 µs each on tiny's 21
    leaves)."""
    import cProfile
    import pstats

    import dtp
    from dtp.models import llama

    torch.set_num_threads(1)
    cfg = llama.config("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (8, 129), generator=torch.Generator().manual_seed(1))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    mesh, layout = ((dtp.make_mesh(tp=2), dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=True))
                    if which == "tp" else (dtp.make_mesh(dp=1), dtp.layouts.data()))
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.1), mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    b, loss_fn = dtp.shard_batch(batch, state), partial(llama.loss, cfg=cfg)
    for _ in range(2):
        state, _ = dtp.train_step(loss_fn, state, b)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        state, _ = dtp.train_step(loss_fn, state, b)
    prof.disable()
    stats = pstats.Stats(prof)
    walks = sum(calls for (_, _, name), (_, calls, *_) in stats.stats.items()  # type: ignore[attr-defined]
                if name in ("<built-in method optree._C.flatten>", "<built-in method optree.flatten_up_to>"))
    return stats.total_calls / steps, walks / steps


def test_python_calls_per_step() -> None:
    # World 1: the optimizer's foreach kernels, paths built only for errors, no protocol
    # isinstance, loops over the leaves (no generator per leaf). tp + SP: also the norms on
    # local shards. Before: 2,300 and 30,570; world 1 then 1,278 before the loops, 1,113 after.
    (one, one_walks), (tp, _) = run(_python_calls, "one", world_size=1)[0], run(_python_calls, "tp", world_size=2)[0]
    assert one < 1_200, one
    assert tp < 27_500, tp
    # The tree walks of a world-1 step: the run's flatten of the parameters and the
    # optimizer's of the gradients plus its parameters'. Before: 7 (the step's specs,
    # global_norm and the new parameters' requires_grad each walked the tree again).
    assert one_walks == 3, one_walks


def _update_passes(opt_name: str) -> dict[str, int]:
    """The foreach ops one steady-state world-1 step runs over the parameters (the
    update and the gradient norm; the model has none), counted by a dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import dtp

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name.startswith("_foreach"):
                self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    opt = {"sgd": dtp.optim.sgd(0.1), "adamw": dtp.optim.adamw(1e-3, weight_decay=0.01)}[opt_name]
    state = dtp.TrainState.create({"w": torch.ones(4, 3), "b": torch.ones(3)}, opt, mesh=dtp.make_mesh(dp=1),
                                  layout=dtp.layouts.data(), axes={"w": ("vocab", "embed"), "b": ("embed",)})
    loss_fn = lambda p, batch: ((batch["x"] @ p["w"]) * p["b"]).square().mean()  # noqa: E731
    batch = {"x": torch.ones(2, 4)}
    state, _ = dtp.train_step(loss_fn, state, batch)
    with Count() as count:
        dtp.train_step(loss_fn, state, batch)
    return count.ops


def test_the_update_writes_the_parameters_in_its_last_op() -> None:
    # Before optim.step, sgd made an update tensor (_foreach_mul) that apply_updates
    # added in a second pass (_foreach_add), and adamw's last op wrote an update too;
    # now the last op writes the new parameter, as torch.optim's does.
    assert run(_update_passes, "sgd", world_size=1)[0] == {"_foreach_norm": 1, "_foreach_add": 1}
    adamw = run(_update_passes, "adamw", world_size=1)[0]
    assert adamw == {"_foreach_norm": 1, "_foreach_lerp": 1, "_foreach_mul": 2, "_foreach_addcmul_": 1,
                     "_foreach_sqrt": 1, "_foreach_div_": 1, "_foreach_add_": 1, "_foreach_addcdiv_": 1}, adamw


def _scalar_reads(microbatches: int) -> tuple[list[str], float, float]:
    """Where one steady-state world-1 step of tiny Llama reads a scalar to the host
    (``aten._local_scalar_dense``: ``float()``, ``int()``, ``.item()``), by function."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    import dtp
    from dtp.models import llama

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.where: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_local_scalar_dense":
                frames = [f for f in traceback.extract_stack() if "/dtp/" in f.filename]
                self.where.append(frames[-1].name if frames else "?")
            return func(*args, **(kwargs or {}))

    cfg = llama.config("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.1), mesh=dtp.make_mesh(dp=1),
                                  layout=dtp.layouts.data(), axes=llama.param_axes(cfg),
                                  axis_sizes=llama.axis_sizes(cfg))
    loss_fn = partial(llama.loss, cfg=cfg)
    state, _ = dtp.train_step(loss_fn, state, batch, microbatches=microbatches)
    with Reads() as reads:
        _, metrics = dtp.train_step(loss_fn, state, batch, microbatches=microbatches)
    return reads.where, metrics["loss"], metrics["grad_norm"]


def test_a_step_reads_the_device_once_for_its_loss_and_norm() -> None:
    # Before: one read per microbatch's loss, the norm twice (the skip decision, the
    # metric), the target count and the optimizer's host count: 8 at m = 4. Now the
    # loss (summed on the device), the norm and the target count (the cross-entropy
    # divides by it on the device) come back in one ``tolist`` at the end; what is
    # left reads the optimizer's step count, a host tensor.
    (one, loss1, norm1), = run(_scalar_reads, 1, world_size=1)
    (four, loss4, norm4), = run(_scalar_reads, 4, world_size=1)
    assert one == four == ["_next_count"], (one, four)
    assert abs(loss1 - loss4) < 1e-5 and abs(norm1 - norm4) < 1e-4 and loss1 > 0 and norm1 > 0


def _garbage_tensors(cases: list[tuple[dict, str | None, int]]) -> list[tuple[int, int]]:
    """Per case (mesh axes, pipeline schedule or ``None``, microbatches): the tensors (and
    their bytes) that Python's cyclic collector finds left by two steady-state steps of
    tiny Llama, this rank's. The first step is not counted: a process's first DTensor
    step imports ``torch._dynamo`` (test_compiled checks that one)."""
    import gc

    import dtp
    from dtp.models import llama

    cfg = llama.config("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    out = []
    for axes, schedule, m in cases:
        layout = dtp.layouts.data() + dtp.layouts.pipeline(schedule) if schedule else dtp.layouts.data()
        state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(1e-3), mesh=dtp.make_mesh(**axes),
                                      layout=layout, axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
        loss_fn = llama.sequential(cfg)
        b = dtp.shard_batch(batch, state)
        state, _ = dtp.train_step(loss_fn, state, b, microbatches=m)
        gc.collect()
        gc.disable()
        try:
            for _ in range(2):
                state, _ = dtp.train_step(loss_fn, state, b, microbatches=m)
            gc.set_debug(gc.DEBUG_SAVEALL)  # what it would free, kept in gc.garbage to look at
            gc.collect()
            tensors = [g for g in gc.garbage if isinstance(g, torch.Tensor)]
            out.append((len(tensors), sum(t.untyped_storage().nbytes() for t in tensors)))
            del tensors
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
            gc.collect()
    return out


def test_a_step_leaves_no_tensor_in_a_reference_cycle() -> None:
    # A cycle frees its tensors only when Python's cyclic collector runs, so a peak that
    # depends on its timing. Before: a pipeline step's optimizer state went through
    # optim.map_param_trees, whose recursive closure (a cycle) held the step's Run — its
    # parameters, gradients and microbatches: in these two steps 36 tensors (431 KB) on
    # rank 0 at pp2 1f1b and 22 (267 KB) at zbv, where two of them put 69,888 B on rank
    # 0's measured peak in most runs (test_plan's V schedules).
    cases = [({"dp": 2}, None, 1), ({"pp": 2}, "1f1b", 4), ({"pp": 2}, "zbv", 4)]
    for rank in run(_garbage_tensors, cases, world_size=2):
        assert rank == [(0, 0)] * len(cases), rank
