"""How a step reduces gradients and updates parameters: one small interface, one object per strategy.

``train_step`` (:mod:`dtp.step`) writes the step once — split the batch, run each
microbatch's forward and backward under the recompute policy, clip, update, metrics —
and asks a :class:`StepRun` for the parts that differ between strategies:

==========================  ===============================================================
``run.params()``            the parameter tree ``loss_fn`` reads in one microbatch's forward
``run.forward()``           a context around that forward (ZeRO-3: saved activations refer to
                            their bucket instead of holding it)
``run.backward(loss, k)``   backward of microbatch ``k`` (``loss`` already weighted 1/m);
                            where gradients go is the strategy's business
``run.gradients()``         ``(group, reduced gradient)`` as each group's reduction lands
``run.targets()``           what the optimizer updates, one entry per group (the parameters
                            themselves, or ZeRO's fp32 master slices)
``run.opt_state(opt, s, t)`` the optimizer state over the targets ``t`` (``s`` as it is, or,
                            in ZeRO's first step, ``s`` cut into the buckets / a fresh one)
``run.norm(grads)``          the global gradient norm (the pipeline sums it over stages)
``run.schedule(f, mbs)``    a :class:`Scheduled` run (the pipeline's) orders forwards and
                            backwards itself: it runs the microbatches here
``run.grouped``             ``False``: one group, and the optimizer state covers its tree;
                            ``True``: the optimizer state covers the list of groups
``run.in_flight()``         a reduction :meth:`gradients` has not yielded is still on the wire
``run.updated(i, new)``     group ``i``'s update is final (grouped runs, elementwise optimizer,
                            groups in order, before ``finish``): ZeRO posts its
                            all-gather there, under the rest of the update
``run.finish(updated)``     the new ``(params, opt_state-independent strategy state)``
==========================  ===============================================================

Strategies today: :mod:`.replicated` (gradients all-reduced to the parameters' layout,
DDP), :mod:`.zero` (ZeRO 1/2/3 buckets: reduce-scatter, sharded update, all-gather) and
:mod:`.pipeline` (stages over ``pp``: any schedule's action list, sends and receives).
:mod:`.precision` (``layouts.mixed_precision``) wraps the replicated or pipeline run so the
optimizer updates fp32 master weights (ZeRO's own slices already are). Where the layout
splits only the batch, the replicated and ZeRO runs compute on plain local tensors
(:mod:`.local`; ``train_step`` calls ``loss_fn`` through :func:`computing`).

What a strategy keeps between steps is a :class:`~.state.StrategyState` (``TrainState.strategy``):
it answers what it owns, gathers, waits for, which run a step begins, and what it saves and
loads (:mod:`.state`). Adding a strategy: options as a frozen, self-checking object in
``dtp.layouts``; the collectives through :mod:`dtp.comm`; a ``StepRun`` and the state that
begins it. ``train_step``, checkpoints and the model stay as they are.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..buffers import with_buffers
from ...layouts import Layout, use_layout
from ...layouts.pipeline import assign
from ...core.redistribute import value_of
from ...models.sequential import Sequential
from . import ep_overlap, local, pipeline, precision, replicated, zero
from .state import PLAIN, Plain, StrategyState, register_state, state_makers

__all__ = ["StepRun", "Scheduled", "StrategyState", "Plain", "PLAIN", "register_state", "begin", "computing", "create", "compute_mesh",
           "gather", "check", "evaluate", "replicated", "zero", "pipeline", "precision", "ep_overlap", "local"]

PyTree = Any


class _Run(Protocol):
    """What every strategy's step run offers, however its microbatches are ordered."""

    grouped: bool

    def params(self) -> PyTree: ...

    def gradients(self) -> Iterator[tuple[int, PyTree]]: ...

    def targets(self) -> list[PyTree]: ...

    def opt_state(self, optimizer: Any, opt_state: PyTree, targets: list[PyTree]) -> PyTree: ...

    def norm(self, grads: PyTree) -> torch.Tensor: ...

    def mask_flags(self, mask: Any, name: str) -> list[Any] | None: ...

    def in_flight(self) -> bool: ...

    def updated(self, i: int, target: PyTree) -> None: ...

    def finish(self, updated: list[PyTree]) -> tuple[PyTree, Any]: ...


class StepRun(_Run, Protocol):
    """One step's in-flight work under a strategy; lives for one ``train_step``, whose
    loop runs each microbatch's forward inside :meth:`forward` and hands its loss to
    :meth:`backward`."""

    def forward(self) -> ContextManager[None]: ...

    def backward(self, loss: torch.Tensor, microbatch: int) -> None: ...


@runtime_checkable
class Scheduled(_Run, Protocol):
    """A run that orders the microbatches' forwards and backwards itself (the pipeline's
    schedules): ``train_step`` hands it the whole list instead of its own loop."""

    def schedule(self, loss_fn: Any, microbatches: list[Any]) -> tuple[float, Any]: ...


def create(params: PyTree, optimizer: Any, layout: Layout, mesh: DeviceMesh) -> tuple[PyTree, StrategyState]:
    """``(opt_state, strategy state)`` of a new :class:`dtp.TrainState` over laid-out
    ``params``: the first registered option of the layout that makes one
    (:func:`.state.register_state`: ZeRO's buckets when it shards over a data axis of more
    than one device, then ``layouts.mixed_precision``'s master weights over bf16
    parameters), else the optimizer's own state and :data:`PLAIN`."""
    for family, make in state_makers():
        opts = layout.option(family)
        made = None if opts is None else make(params, optimizer, opts, layout, mesh)
        if made is not None:
            return made
    return optimizer.init(params), PLAIN


def _pipeline_options(layout: Layout, mesh: DeviceMesh) -> Any:
    opts = layout.pipeline
    return opts if opts is not None and opts.active(mesh) else None


def compute_mesh(layout: Layout, mesh: DeviceMesh) -> DeviceMesh | None:
    """Where a state's computations run: ``mesh``, or under a pipeline the stage mesh
    (``None`` when a stage is one device: its tensors are plain)."""
    opts = _pipeline_options(layout, mesh)
    return mesh if opts is None else pipeline.stage_mesh(mesh, opts.axis)


def gather(params: PyTree, state: StrategyState, layout: Layout, mesh: DeviceMesh) -> PyTree:
    """Whole parameters on every rank (a collective under ZeRO-3 or a pipeline; see
    :func:`dtp.gather_params`)."""
    state = PLAIN if state is None else state  # what TrainState.strategy was called before (zero=None)
    opts = _pipeline_options(layout, mesh)
    if opts is not None:
        state.wait()  # ZeRO 1/2 under the stages: their views may still be filling
        return pipeline.gather(params, mesh, opts.axis)
    return state.gather(params)


def check(loss_fn: Any, layout: Layout, mesh: DeviceMesh, microbatches: int) -> None:
    """The strategies' rules for this step's model and microbatches (the pipeline's: a
    :class:`dtp.Sequential`, its layers and microbatches, what it composes with;
    ``ep_overlap``'s: an expert axis, a schedule it pairs, ZeRO 1/2 without
    overlap_grad_reduce, microbatches >= 2 at pp 1)."""
    ep_overlap.check(layout, mesh, microbatches)
    opts = _pipeline_options(layout, mesh)
    if opts is None:
        return
    if not isinstance(loss_fn, Sequential):
        raise TypeError(f"train_step: under layouts.pipeline loss_fn must be the model as a dtp.Sequential of "
                        f"layers (e.g. llama.sequential(cfg)), got {type(loss_fn).__name__}")
    opts.check(n_layers=len(loss_fn), mesh=mesh, microbatches=microbatches)
    first, last = loss_fn.paths(0, 1), loss_fn.paths(len(loss_fn) - 1)
    opts.check_composition(layout, mesh, shared=sorted(set(first) & set(last)))


def evaluate(loss_fn: Any, params: PyTree, state: Any, layout: Layout, mesh: DeviceMesh,
             batches: Sequence[Any], *, buffers: PyTree = None) -> list[tuple[float, Any]]:
    """``(loss, aux)`` of ``loss_fn`` on each of ``batches`` (placed by ``shard_batch``),
    forward only, the same on every rank (call it on every rank).

    Under a pipeline the batches are the microbatches of a forward-only schedule over the
    stages (``loss_fn`` the :class:`dtp.Sequential`; one all-reduce of the losses over pp;
    aux as in a training step: an MoE model's on every rank, shared over pp); elsewhere ``loss_fn`` runs whole on :func:`gather`'s parameters (under
    ZeRO-3 an all-gather of every bucket). ``buffers`` (``TrainState.buffers``) are laid
    over the parameters there and over each stage's, as in a training step.

    Raises: ``TypeError`` / ``ValueError`` (before any collective) for a pipeline's
    ``loss_fn`` that is no Sequential or whose layers do not fill its stages, and for a
    batch not placed by ``shard_batch`` under zigzag context parallel
    (:meth:`dtp.Layout.check_arranged`).
    """
    state = PLAIN if state is None else state
    for batch in batches:  # a hand-placed batch under zigzag cp would evaluate a permuted sequence
        layout.check_arranged("evaluate", batch, mesh)
    opts = _pipeline_options(layout, mesh)
    if opts is None:
        whole = with_buffers(gather(params, state, layout, mesh), buffers)
        out = []
        with torch.no_grad(), use_layout(layout, mesh):
            for batch in batches:
                result = loss_fn(whole, batch)
                loss, aux = result if isinstance(result, tuple) else (result, None)
                out.append((value_of(loss.detach()), aux))
        return out
    if not isinstance(loss_fn, Sequential):
        raise TypeError(f"evaluate: under layouts.pipeline loss_fn must be the model as a dtp.Sequential of "
                        f"layers (e.g. llama.sequential(cfg)), got {type(loss_fn).__name__}")
    # The layers and what composes (a forward-only schedule runs any number of batches).
    opts.check_composition(layout, mesh, what="evaluate")
    assign(len(loss_fn), opts.degree(mesh), opts.virtual_stages, opts.layer_split, what="evaluate")
    state.wait()  # ZeRO 1/2 under the stages: their views may still be filling
    run = pipeline.Run(params, pipeline.Context(layout, mesh, loss_fn, len(batches), buffers=buffers),
                       forward_only=True)
    return run.evaluate(list(batches))


def computing(run: Any, loss_fn: Any) -> Any:
    """``loss_fn`` as ``run`` calls it: on this rank's batch rows in local batch mode
    (:mod:`.local`), else as it is.

    >>> f = lambda params, batch: 0.0
    >>> computing(replicated.Run({}, 1), f) is f
    True
    """
    return local.wrap(loss_fn, getattr(run, "local", None))


def begin(params: PyTree, state: StrategyState, microbatches: int, *, loss_fn: Any = None,
          layout: Layout | None = None, mesh: DeviceMesh | None = None, gradients_only: bool = False,
          buffers: PyTree = None) -> StepRun | Scheduled:
    """The step's run: the pipeline's when the layout has one on ``mesh`` (continuing
    from ``state.stage_state()``, wrapped by ``state.wrap_stages``), else the state's own
    (:meth:`StrategyState.run`: replicated, mixed precision's or ZeRO's), under
    ``layouts.expert(ep_overlap=True)`` in two lanes. ``gradients_only``
    (:func:`dtp.step.value_and_grad`): a strategy whose gradients never take the
    parameters' layout refuses. ``buffers`` (``TrainState.buffers``): the pipeline's
    stages lay them over their parameters (elsewhere ``loss_fn`` reads them). The
    replicated and ZeRO runs compute on plain local tensors when :func:`.local.decide`
    allows; call ``loss_fn`` through :func:`computing`."""
    state = PLAIN if state is None else state  # what TrainState.strategy was called before (zero=None)
    piped = layout is not None and mesh is not None and _pipeline_options(layout, mesh) is not None
    if gradients_only and piped:
        raise ValueError("value_and_grad: under layouts.pipeline a rank holds the gradients of its stages only, not "
                         "laid out like the parameters; call train_step (or drop layouts.pipeline)")
    refusal = state.gradients_only() if gradients_only else None
    if refusal is not None:
        raise ValueError(refusal)
    if piped:
        ctx = pipeline.Context(layout, mesh, loss_fn, microbatches, state.stage_state(), buffers)
        return state.wrap_stages(pipeline.Run(params, ctx))
    batch = None
    if not gradients_only:  # value_and_grad hands back gradients in the parameters' layout
        batch = local.decide(state.specs(params), loss_fn, layout, mesh, buffers=buffers)
    run = state.run(params, microbatches, local=batch)
    if layout is not None and mesh is not None and ep_overlap.active(layout) and not gradients_only:
        return ep_overlap.Run(run)  # its microbatches in lanes (check() has refused what it cannot run)
    return run
