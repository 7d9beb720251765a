"""``TrainState`` and ``train_step``: training as a pure function over placements.

Four ranks simulated in one process (:func:`dtp.testing.simulate`); under torchrun the
body is the same without the ``with``:

>>> from functools import partial
>>> from dtp import layouts
>>> cfg = llama.config("tiny", n_layers=1)
>>> batch = {"tokens": torch.zeros(4, 16, dtype=torch.long), "targets": torch.zeros(4, 16, dtype=torch.long)}
>>> with dtp.testing.simulate(4):
...     mesh = dtp.make_mesh(dp=2, tp=2)
...     state = dtp.TrainState.create(llama.init(cfg), dtp.optim.adamw(3e-3), mesh=mesh,
...                                   layout=layouts.data() + layouts.megatron(True), axes=llama.param_axes(cfg))
...     state, metrics = dtp.train_step(partial(llama.loss, cfg=cfg), state, dtp.shard_batch(batch, state))
>>> metrics["tokens"], sorted(metrics["comm_bytes"])
(64, ['dp', 'tp'])
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import time
import warnings
from typing import Any, Callable, Mapping, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import guard
from . import strategies
from .buffers import apply_update, reading
from ..core._rules import is_positive_int
from ..core.comm import comm_log, span
from ..core.compiled import CompileOptions, compiling, options_of
from ..layouts import PlacedBatch, use_layout
from ..core.mesh.devices import mesh_device
from .optim import GradientTransformation, clip_by_global_norm, measured_by, state_join, state_part
from .optim.transform import mask_flags_by
from .optim import step as optimizer_step
from ..ops.parallel import DeviceDivisor, mean_over, target_count
from ..ops.recompute import POLICIES, recompute as recompute_policy
from ..core.redistribute import local_map, scalar_of
from ..core.spec import shard, spec_of
from .state import TrainState, _single_device
from .strategies.loss_out import split as split_loss

__all__ = ["train_step", "value_and_grad", "shard_batch", "PlacedBatch"]

PyTree = Any
# A step's loss before it is read: a 0-d fp64 tensor on the device, or a float (a schedule
# reads its own).
Loss = Union[torch.Tensor, float]
_BATCH_AXES = ("batch", "seq")


def shard_batch(batch: Mapping[str, torch.Tensor], state: TrainState) -> PlacedBatch:
    """Place global (batch, seq) tensors where the layout computes them (batch on dp …).

    Every rank passes the same global batch (the loader is deterministic): the ids of
    ``tokens``/``targets`` are checked against the vocabulary here (a min/max) every
    call, and the first call with each batch shape has the ranks agree (:mod:`dtp.guard`)
    on the batch and on each rank's check result, so a failure is the same error on
    every rank. One device: the batch moves to the mesh's device, plain.

    >>> from dtp import layouts
    >>> cfg = llama.config("tiny", n_layers=1)
    >>> tokens = torch.zeros(4, 16, dtype=torch.long)
    >>> with simulate(2):
    ...     state = dtp.TrainState.create(llama.init(cfg), dtp.optim.sgd(0.1), mesh=make_mesh(dp=2),
    ...                                   layout=layouts.data(), axes=llama.param_axes(cfg))
    ...     batch = shard_batch({"tokens": tokens, "targets": tokens}, state)
    ...     dtp.spec_of(batch["tokens"]), batch["tokens"].to_local().shape  # 2 rows a rank
    (P('dp'), torch.Size([2, 16]))
    """
    if not isinstance(batch, Mapping):  # was "'list' object has no attribute 'items'"
        raise TypeError(f"shard_batch: the batch is a mapping of names to tensors (e.g. {{'tokens': ..., "
                        f"'targets': ...}}), got {type(batch).__name__}")
    if not batch:  # was {} back, and an error only at train_step
        raise ValueError("shard_batch: the batch holds no tensors")
    mesh = compute_mesh(state)
    if _single_device(mesh):
        device = mesh_device(state.mesh)
        return PlacedBatch.of({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
    out, error = {}, None
    try:
        for k, v in batch.items():
            if k in guard.ID_KEYS and isinstance(v, torch.Tensor) and v.numel() and not v.is_floating_point():
                found = guard.id_range(k, v)  # a target of -100 is masked (IGNORE_INDEX), not an id
                if found is not None:
                    guard.check_ids(k, *found, state.checks.vocab, "shard_batch")
            state.layout.check_batch("shard_batch", k, tuple(v.shape), state.mesh)
        # The layout owns the sequence order (zigzag, packed documents): then a contiguous split.
        for k, v in state.layout.arrange_batch(batch, state.mesh).items():
            spec = state.layout.activation_spec(_BATCH_AXES[: v.dim()], mesh)
            out[k] = shard(v, mesh, spec, name=f"shard_batch: batch[{k!r}]")
    except (ValueError, TypeError) as e:
        error = e
    guard.check_step(state.checks, state.mesh, state.layout, state.step, batch, {}, error, what="shard_batch")
    return PlacedBatch.of(out)


def compute_mesh(state: TrainState) -> DeviceMesh | None:
    """Where ``state``'s computations run: its mesh, or under a pipeline the stage mesh
    (``None`` when a stage is one device)."""
    return strategies.compute_mesh(state.layout, state.mesh)


def microbatch_rows(rows: int, n: int, k: int) -> slice:
    """The rows of microbatch ``k`` of ``n`` in a batch of ``rows``: every ``n``-th row,
    from row ``k`` — the one definition for every layout and the one-device run.

    Strided, not contiguous, because it is the one grouping a data-parallel split keeps:
    a rank's contiguous block of rows ``[r·R/dp, (r+1)·R/dp)`` taken every ``n``-th row from
    its own row ``k`` is exactly its part of the global ``batch[k::n]`` (``R/dp`` divides by
    ``n``). Contiguous local slices would make microbatch ``k`` the k-th slice of every rank,
    a different set of rows for each dp size; a dense model's mean does not see that, but
    MoE's per-microbatch token statistics (the aux loss) do.

    >>> list(range(8))[microbatch_rows(8, 2, 1)]
    [1, 3, 5, 7]
    """
    if rows % n:
        raise ValueError(f"microbatch_rows: {rows} rows do not split into {n} microbatches")
    return slice(k, None, n)


def _split_microbatches(batch: Mapping[str, DTensor], n: int) -> list[dict[str, DTensor]]:
    if n == 1:
        return [dict(batch)]
    parts: list[dict[str, DTensor]] = [{} for _ in range(n)]

    def cut(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x[microbatch_rows(x.shape[0], n, k)].contiguous() for k in range(n))

    for key, v in batch.items():
        if not isinstance(v, DTensor):
            pieces = cut(v)
        else:
            # Each rank cuts its own rows (microbatch_rows says why that is the global
            # batch[k::n]). _check_inputs proved the rows divide, so no shape check is needed.
            spec = spec_of(v)
            pieces = local_map(cut, (spec,), (spec,) * n, check_shapes=False)(v)
        for i, piece in enumerate(pieces):
            parts[i][key] = piece
    return parts


def _check_inputs(batch: Mapping[str, torch.Tensor], state: TrainState, microbatches: int,
                  recompute: str | None, clip_norm: float | None = None) -> None:
    if recompute not in POLICIES:
        raise ValueError(f"train_step: recompute must be one of {POLICIES}, got {recompute!r}")
    if not is_positive_int(microbatches):
        raise ValueError(f"train_step: microbatches must be an int >= 1, got {microbatches!r}")
    if clip_norm is not None:
        if not isinstance(clip_norm, (int, float)) or isinstance(clip_norm, bool):
            raise TypeError(f"train_step: clip_norm must be a number (or None: no clipping), got {clip_norm!r}")
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"train_step: clip_norm must be finite and > 0 (or None: no clipping), got {clip_norm!r}")
    if not isinstance(batch, Mapping) or not batch:
        raise TypeError(f"train_step: batch must be a non-empty dict of tensors, got {type(batch).__name__}")
    dp = state.layout.degree("batch", state.mesh)
    param_dtype = state.checks.param_dtype
    mesh = compute_mesh(state)
    single, device = _single_device(mesh), mesh_device(state.mesh)  # once, not per entry
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"train_step: batch[{k!r}] must be a tensor, got {type(v).__name__}")
        if not isinstance(v, DTensor) and not single:
            raise ValueError(f"train_step: batch[{k!r}] is a plain tensor; place it with dtp.shard_batch(batch, state)")
        if not isinstance(v, DTensor) and v.device != device:
            raise ValueError(f"train_step: batch[{k!r}] is on {v.device}, the state on {device}; "
                             f"place it with dtp.shard_batch(batch, state)")
        if isinstance(v, DTensor) and v.device_mesh is not mesh and v.device_mesh != mesh:
            raise ValueError(f"train_step: batch[{k!r}] is placed on another mesh ({v.device_mesh}) than the "
                             f"state's ({mesh}); place it with dtp.shard_batch(batch, state)")
        if k in guard.ID_KEYS and (v.is_floating_point() or v.is_complex() or v.dtype == torch.bool):
            raise TypeError(f"train_step: batch[{k!r}] holds vocabulary ids and must be an integer tensor, "
                            f"got {v.dtype}")
        if param_dtype is not None and v.is_floating_point() and v.dtype != param_dtype:
            raise TypeError(f"train_step: batch[{k!r}] is {v.dtype} but the parameters are {param_dtype}; "
                            f"cast it (batch[{k!r}].to({param_dtype})): dtp does not cast inputs")
        if v.dim() == 0:
            raise ValueError(f"train_step: batch[{k!r}] is a scalar; batch entries are (batch, …) tensors")
        if v.shape[0] % (dp * microbatches):
            raise ValueError(
                f"train_step: batch[{k!r}] has batch size {v.shape[0]}, not divisible by the batch split "
                f"{dp} × microbatches {microbatches} = {dp * microbatches}"
            )
        if isinstance(v, DTensor):  # one device computes a plain batch whatever the layout
            state.layout.check_batch("train_step", k, tuple(v.shape), state.mesh, microbatches=microbatches)
    state.layout.check_arranged("train_step", batch, state.mesh)


def _forward_backward(loss_fn: Callable, run: strategies.StepRun | strategies.Scheduled,
                      batch: Mapping[str, torch.Tensor], m: int) -> tuple[Loss, Any, torch.Tensor | None]:
    """The one microbatch loop: each microbatch's loss weighted 1/m. With ``targets`` in
    the batch, the cross-entropy divides by their valid count over the whole batch / m
    (:func:`dtp.ops.mean_over`; one small all-reduce per axis that splits them, the
    first posted before forward and waited at the first loss — at a pipeline's last
    stage, which schedules itself, all run at its first loss), so the step's loss is the
    mean over every valid target whatever the layout and ``m``. Returns the loss, aux
    and that count (the loss and the count on the device, not read yet: :func:`_read`;
    the count ``None`` with no ``targets``, or on a pipeline stage without the loss).
    Where the gradients go is the run's business."""
    microbatches = _split_microbatches(batch, m)
    if "targets" not in batch:
        return (*_run_microbatches(loss_fn, run, microbatches), None)
    counted: list[torch.Tensor] = []
    count = target_count(batch["targets"], post_now=not _scheduled(run))  # waited late, never read here

    def divisor() -> DeviceDivisor:  # called by the first cross-entropy, after its forward (mean_over)
        counted.append(count())
        # max(count, 1) / m as the float it was, but on the device: no host read here.
        value = counted[0].clamp_min(1).to(torch.float64)
        return DeviceDivisor(value / m if m > 1 else value)

    with mean_over(divisor):
        loss, aux = _run_microbatches(loss_fn, run, microbatches)
    return loss, aux, (counted[0] if counted else None)


def _scheduled(run: strategies.StepRun | strategies.Scheduled) -> bool:
    """The run orders its microbatches itself (:class:`dtp.strategies.Scheduled`). Asked
    by attribute: ``isinstance`` against the runtime-checkable protocol walks its members
    in Python, ~60 calls each time, twice a step."""
    return hasattr(run, "schedule")


def _run_microbatches(loss_fn: Callable, run: strategies.StepRun | strategies.Scheduled,
                      microbatches: list[dict[str, torch.Tensor]]) -> tuple[Loss, Any]:
    if _scheduled(run):  # it orders forwards and backwards itself
        return run.schedule(loss_fn, microbatches)
    total: torch.Tensor | None = None
    auxes, m = [], len(microbatches)
    for k, mb in enumerate(microbatches):
        with span("forward"), run.forward():
            out = loss_fn(run.params(), mb)
        loss, aux = split_loss(out)
        if k == 0 and not isinstance(loss, DTensor) and getattr(run, "local", None) is None and \
                any(isinstance(v, DTensor) for v in mb.values()):
            # each rank's own value (a to_local() inside?): every rank trained on a different
            # loss, and reported it, with nothing said
            raise ValueError("train_step: loss_fn returned a plain tensor for a batch of DTensors: each rank's "
                             "own value, not the global loss; return the DTensor (e.g. dtp.reshard(loss, P())), "
                             "or compute on local tensors with dtp.ops.local_batch")
        with span("backward"):
            # x / 1 is x bit for bit: one microbatch skips the op and its backward node.
            run.backward(loss / m if m > 1 else loss, k)
        # Summed on the device in fp64 — the bits a Python float sum of each value / m
        # gives — and read once with the norm at the step's end: a host read here would
        # wait for each microbatch's backward before the next forward is queued.
        part = scalar_of(loss.detach()).to(torch.float64)
        part = part / m if m > 1 else part  # x / 1 is x: the op skipped, as the backward's
        total = part if total is None else total + part
        auxes.append(aux)
    # One aux per microbatch: dtp cannot know whether to sum (token counts) or average
    # (accuracies) them, and keeping only the last silently halved a count at m=2.
    if all(a is None for a in auxes):
        return total, None
    return total, auxes[0] if m == 1 else tuple(auxes)


def value_and_grad(loss_fn: Callable[[PyTree, Mapping[str, torch.Tensor]], Any], state: TrainState,
                   batch: Mapping[str, torch.Tensor], *, microbatches: int = 1,
                   recompute: str | None = None,
                   compile: bool | str | CompileOptions = False) -> tuple[float, Any, PyTree]:
    """Mean loss (a float), aux and gradients laid out like the parameters (what ``train_step`` uses).

    Gradient accumulation equals one big batch: the cross-entropy's mean is over the
    valid targets of the whole batch (:func:`_forward_backward`). ``compile`` compiles
    the local computation as ``train_step``'s does (:mod:`dtp.compiled`; the gradients
    come back laid out like the parameters, so the regions are the ``local_map`` bodies
    wherever the mesh has more than one device).

    >>> mesh = dtp.make_mesh(dp=1)
    >>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=mesh,
    ...                               layout=dtp.layouts.data(), axes={"w": ("embed",)})
    >>> loss_fn = lambda params, batch: (params["w"] * batch["x"]).sum()
    >>> loss, aux, grads = dtp.step.value_and_grad(loss_fn, state, {"x": torch.ones(1, 2)}, compile="eager")
    >>> loss, grads["w"]
    (2.0, tensor([1., 1.]))
    """
    options = options_of(compile)  # a bad argument fails here, before any collective
    run = strategies.begin(state.params, state.strategy, microbatches, layout=state.layout, mesh=state.mesh,
                           gradients_only=True)  # a pipeline or ZeRO refuses
    _check_inputs(batch, state, microbatches, recompute)
    with use_layout(state.layout, state.mesh), recompute_policy(recompute), compiling(options):
        loss, aux, _ = _forward_backward(reading(loss_fn, state.buffers), run, batch, microbatches)
        (_, grads), = run.gradients()
    return float(loss), aux, grads


def train_step(loss_fn: Callable[[PyTree, Mapping[str, torch.Tensor]], Any], state: TrainState,
               batch: Mapping[str, torch.Tensor], *, microbatches: int = 1, recompute: str | None = None,
               clip_norm: float | None = None, compile: bool | str | CompileOptions = False) -> tuple[TrainState, dict]:
    """One optimizer step: forward/backward over ``microbatches``, gradient reduction to
    the parameters' layout, optional global-norm clipping, the optimizer update.

    ``loss_fn(params, batch)`` returns the mean loss (or ``(loss, aux)``; with
    ``microbatches > 1`` ``metrics["aux"]`` is the tuple of every microbatch's aux).
    ``recompute`` is ``None``, ``"full"`` (each block) or ``"selective"`` (attention core).
    How gradients are reduced and parameters updated is the state's strategy
    (:mod:`dtp.strategies`: replicated all-reduce, or ZeRO buckets), not this function's;
    where the layout splits only the batch and ``loss_fn`` is
    :func:`dtp.ops.local_batch.batch_local` (``llama.loss``), it runs on plain local tensors.

    ``clip_norm`` is ``None`` (no clipping) or a finite number > 0. ``compile`` (``True``,
    a backend or :class:`dtp.CompileOptions`) compiles the local computation (:mod:`dtp.compiled`).

    Before any collective the inputs are checked, and (first step of each batch
    signature, :mod:`dtp.guard`) the ranks agree that they were given the same batch
    shapes, options, layout and mesh, and each rank's check result: a failure on any
    rank is the same error on every rank. ``DTP_CHECKS=0`` skips the agreement.

    A non-finite loss or gradient norm skips the update: parameters, optimizer state and
    ``step`` come back as they were (on every rank alike: both values are global), and
    the mesh's first rank issues a ``RuntimeWarning`` (Python shows a repeated message
    once; ``metrics["skipped"]`` is the per-step signal). ``step`` counts applied updates,
    as the optimizer's own count and Megatron's lr scheduler do, so the schedule does not
    advance past a batch that taught nothing.

    Loss masks: targets equal to ``dtp.ops.IGNORE_INDEX`` (-100) are skipped, and the
    loss is the mean over the valid targets of the whole global batch — every microbatch,
    every rank — as one device taking the batch at once computes it.

    Metrics: ``loss``, ``grad_norm``, ``lr``, ``tokens`` (processed), ``loss_tokens`` (the
    valid targets the loss averaged over; ``None`` on a pipeline stage without the loss),
    ``step_time`` (s), ``comm_bytes`` (``{axis: {collective: bytes sent per rank}}``),
    ``skipped`` (bool) and, compiled, ``compile_graphs`` and ``compile_breaks``.

    >>> import warnings
    >>> mesh = dtp.make_mesh(dp=1)                  # one process: a mesh of one device
    >>> state = dtp.TrainState.create({"w": torch.ones(2)}, dtp.optim.sgd(0.1), mesh=mesh,
    ...                               layout=dtp.layouts.data(), axes={"w": ("embed",)})
    >>> loss_fn = lambda params, batch: (params["w"] * batch["x"]).mean()
    >>> state, metrics = dtp.train_step(loss_fn, state, {"x": torch.ones(1, 2)})
    >>> state.step, metrics["skipped"], state.params["w"]
    (1, False, tensor([0.9500, 0.9500], requires_grad=True))
    >>> with warnings.catch_warnings(record=True) as seen:  # non-finite loss (nan) and gradient norm (nan)
    ...     state, metrics = dtp.train_step(loss_fn, state, {"x": torch.full((1, 2), float("nan"))})
    >>> state.step, metrics["skipped"], state.params["w"], len(seen)
    (1, True, tensor([0.9500, 0.9500], requires_grad=True), 1)
    """
    t0, error, options = time.perf_counter(), None, None
    dynamo_before = _DYNAMO in sys.modules
    try:
        _check_inputs(batch, state, microbatches, recompute, clip_norm)
        options = options_of(compile)
        strategies.check(loss_fn, state.layout, state.mesh, microbatches)
    except (ValueError, TypeError) as e:
        error = e
    guard.check_step(state.checks, state.mesh, state.layout, state.step, batch,
                     {"microbatches": microbatches, "recompute": recompute, "clip_norm": clip_norm,
                      "compile": repr(options)}, error)
    run = strategies.begin(state.params, state.strategy, microbatches, loss_fn=loss_fn, layout=state.layout,
                           mesh=state.mesh, buffers=state.buffers)
    with comm_log() as log:
        with use_layout(state.layout, state.mesh), recompute_policy(recompute), compiling(options) as watch:
            loss, aux, counted = _forward_backward(strategies.computing(run, reading(loss_fn, state.buffers)), run,
                                                   batch, microbatches)
        with torch.no_grad(), span("update"):
            updated, opt_state, (loss, norm, counted), bad = _update(run, state.optimizer, state.opt_state,
                                                                     clip_norm, loss, counted)
            # On a skip ``updated`` is the targets as they were: ZeRO still gathers them into
            # new buffers (first step: cuts them), so every step has the same collectives.
            params, strategy = run.finish(updated)
            buffers = state.buffers
            if buffers and state.buffer_update is not None and bad is None:  # a skip keeps them too
                buffers = apply_update(state.buffer_update, buffers, aux, state.mesh)
    if bad is not None and _first_rank(state.mesh):
        # The same on every rank (a global norm, a replicated loss): one rank says it,
        # not world-size copies; metrics["skipped"] is on every rank.
        warnings.warn(f"dtp.train_step: non-finite {bad} at step {state.step}: update skipped "
                      f"(parameters, optimizer state and step unchanged)", RuntimeWarning, stacklevel=2)
    new = dataclasses.replace(state, step=state.step + (bad is None), params=params, opt_state=opt_state, strategy=strategy,
                              buffers=buffers)
    if not dynamo_before and _DYNAMO in sys.modules:
        _drop_import_frames()
    return new, {**_metrics(state, batch, loss, aux, norm, t0, log, skipped=bad is not None, counted=counted),
                 **(watch.metrics() if options else {})}


_DYNAMO = "torch._dynamo"


def _drop_import_frames() -> None:
    """Free the frames the process's one import of ``torch._dynamo`` left in a cycle, when
    this step made it (DTensor's first sharding propagation makes a ``FakeTensorMode``,
    which imports it; so do recompute and ``compile``): ``torch.fx.wrap``, called at the
    top of ``torch._dynamo.utils``, keeps its own frame in a local, and that frame's
    ``f_back`` chain runs down through the step's finished frames — the forward's
    activations, the batch, the microbatches — which stayed until Python's cyclic
    collector next ran a full pass (measured, torch 2.13, tiny tp2 + sp: 115 tensors,
    2.4 MB; dp2 m=2: 194, 3.9 MB). torch's cycle, not one dtp can break where it is
    made, so it is collected here: once per process, on a step that already paid the
    import (about 1 s), never on the steps after."""
    gc.collect()


def _first_rank(mesh: DeviceMesh) -> bool:
    """This rank is the mesh's first (a process with no group counts as first)."""
    return not dist.is_initialized() or dist.get_rank() == int(mesh.mesh.flatten()[0])


def _read(loss: Loss, norm: torch.Tensor, count: torch.Tensor | None) -> tuple[float, float, int | None]:
    """The step's loss, gradient norm and valid-target count (``None``: none counted) in
    one host read, the step's one wait for the device (a float loss comes from a
    schedule). A count is exact in float64 up to 2**53 targets."""
    parts = [torch.as_tensor(loss, dtype=torch.float64, device=norm.device), norm.to(torch.float64)]
    if count is not None:
        parts.append(count.reshape(()).to(device=norm.device, dtype=torch.float64))
    values = torch.stack(parts).cpu().tolist()  # one transfer (a subclass has no tolist)
    return values[0], values[1], (int(values[2]) if count is not None else None)


def _non_finite(loss: float, norm: float) -> str | None:
    """What is non-finite (``None``: nothing). Both are identical on every rank — the loss
    is the replicated mean and the norm is reduced over every axis and every ZeRO bucket,
    so a NaN in any rank's gradient slice reaches it — and deciding on them needs no
    collective of its own. Reading them (:func:`_read`) waits for the norm (a device sync,
    as Megatron's found-inf check), before the parameters are gathered: which ones depends
    on it."""
    bad = [f"loss ({loss})"] * (not math.isfinite(loss))
    bad += [f"gradient norm ({norm})"] * (not math.isfinite(norm))
    return " and ".join(bad) or None


def _update(run: strategies.StepRun, optimizer: GradientTransformation, opt_state: PyTree,
            clip_norm: float | None, loss: Loss, count: torch.Tensor | None
            ) -> tuple[list[PyTree], PyTree, tuple[float, float, int | None], str | None]:
    """The one update path: the run's reduced gradients, clipped to ``clip_norm`` over
    all of them, applied to the run's targets. Returns the new targets, optimizer state,
    the loss, gradient norm and target count read (:func:`_read`) and what was
    non-finite (``None``: the update was applied); with a non-finite loss or norm the
    targets and state come back untouched.

    With several groups (ZeRO buckets), an elementwise optimizer (sgd, adamw) and no
    clipping, each group is updated as its reduction lands while later ones are still on
    the wire (``run.in_flight()``); once all have landed, the norm is taken and the
    groups are handed in group order (the next forward's read order) to
    ``run.updated``, where ZeRO posts each all-gather, the groups not updated yet updated
    just before theirs. The last group to land is the one the next forward reads first,
    so no gather could start earlier; this way the update runs under the reduce-scatters
    still in flight and, for what is left of it, under the gathers. The norm comes first
    because a skip must gather the old targets. Clipping needs the norm before any
    update, and updates all groups at once."""
    targets = run.targets()
    opt_state = run.opt_state(optimizer, opt_state, targets)  # ZeRO's first step makes or cuts it
    n = len(targets)
    grads: list[PyTree] = [None] * n
    masks: dict[int, list[Any] | None] = {}  # an optimizer's masks on the targets (_flags_of)
    if run.grouped and clip_norm is None and optimizer.elementwise:
        parts: list[PyTree] = [None] * n
        new: list[PyTree | None] = [None] * n

        def update(i: int) -> None:
            with mask_flags_by(_flags_of(run, [i], masks)):
                (new[i],), parts[i] = optimizer_step(optimizer, [grads[i]], state_part(opt_state, targets, i),
                                                     [targets[i]])

        for i, g in run.gradients():
            grads[i] = g
            if run.in_flight():
                update(i)  # under the later groups' transfers; a skip drops it
        values = _read(loss, run.norm(grads), count)
        if bad := _non_finite(*values[:2]):  # as Megatron: the optimizer does not run at all
            return targets, opt_state, values, bad
        for i in range(n):
            if new[i] is None:
                update(i)
            run.updated(i, new[i])
        return new, state_join(opt_state, targets, parts), values, None
    for i, g in run.gradients():
        grads[i] = g
    tree, params = (grads, targets) if run.grouped else (grads[0], targets[0])
    norm = run.norm(tree)
    if clip_norm is not None:
        tree, norm = clip_by_global_norm(tree, clip_norm, norm=norm)
    values = _read(loss, norm, count)
    if bad := _non_finite(*values[:2]):  # as Megatron: the optimizer does not run at all
        return targets, opt_state, values, bad
    with measured_by(run.norm), mask_flags_by(_flags_of(run, range(n), masks) if run.grouped else None):
        # an optimizer's own clip() measures every stage, as one device
        new, opt_state = optimizer_step(optimizer, tree, opt_state, params)
    return (new if run.grouped else [new]), opt_state, values, None


def _flags_of(run: strategies.StepRun, chosen: Sequence[int],
              cache: dict[int, list[Any] | None]) -> Callable[[str, Any], list[Any] | None]:
    """How an optimizer's per-parameter mask (weight decay's) falls on the targets
    ``chosen`` (ZeRO's bucket slices; ``None`` from the run: the targets are parameters,
    whose mask the optimizer reads itself), worked out once a step per mask (``cache``)."""
    def flags(name: str, mask: Any) -> list[Any] | None:
        if id(mask) not in cache:
            cache[id(mask)] = run.mask_flags(mask, name)
        every = cache[id(mask)]
        return None if every is None else [every[i] for i in chosen]
    return flags


def _metrics(state: TrainState, batch: Mapping[str, torch.Tensor], loss: float, aux: Any, norm: float,
             t0: float, log: Any, *, skipped: bool, counted: int | None) -> dict[str, Any]:
    tokens = batch["tokens"].numel() if "tokens" in batch else next(iter(batch.values())).numel()
    metrics = {
        # the targets the loss averaged over (IGNORE_INDEX excluded; None: no loss on this
        # pipeline stage, or no targets); ``tokens``: those processed
        "loss_tokens": counted,
        "loss": loss,
        "grad_norm": norm,
        "lr": state.optimizer.schedule(state.step) if state.optimizer.schedule else float("nan"),
        "tokens": int(tokens),
        "step_time": time.perf_counter() - t0,
        "comm_bytes": log.summary(),
        "skipped": skipped,
    }
    if aux is not None:
        metrics["aux"] = aux
    return metrics
