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
``run.schedule(f, mbs)``    optional: a strategy that orders forwards and backwards itself
                            (the pipeline's schedules) runs the microbatches here
``run.grouped``             ``False``: one group, and the optimizer state covers its tree;
                            ``True``: the optimizer state covers the list of groups
``run.finish(updated)``     the new ``(params, opt_state-independent strategy state)``
==========================  ===============================================================

Strategies today: :mod:`.replicated` (gradients all-reduced to the parameters' layout,
DDP), :mod:`.zero` (ZeRO 1/2/3 buckets: reduce-scatter, sharded update, all-gather) and
:mod:`.pipeline` (stages over ``pp``: any schedule's action list, sends and receives).

Adding a strategy: options as a frozen, self-checking object in ``dtp.layouts``; the
collectives through :mod:`dtp.comm`; a ``StepRun`` here; :func:`begin` picks it from the
state. ``train_step`` and the model stay as they are.
"""

from __future__ import annotations

from typing import Any, ContextManager, Iterator, Protocol

import torch

from . import pipeline, replicated, zero

__all__ = ["StepRun", "begin", "replicated", "zero", "pipeline"]

PyTree = Any


class StepRun(Protocol):
    """One step's in-flight work under a strategy; lives for one ``train_step``."""

    grouped: bool

    def params(self) -> PyTree: ...

    def forward(self) -> ContextManager[None]: ...

    def backward(self, loss: torch.Tensor, microbatch: int) -> None: ...

    def gradients(self) -> Iterator[tuple[int, PyTree]]: ...

    def targets(self) -> list[PyTree]: ...

    def opt_state(self, optimizer: Any, opt_state: PyTree, targets: list[PyTree]) -> PyTree: ...

    def norm(self, grads: PyTree) -> torch.Tensor: ...

    def finish(self, updated: list[PyTree]) -> tuple[PyTree, Any]: ...


def begin(params: PyTree, zero_state: zero.ZeroState | None, microbatches: int,
          pipeline_context: pipeline.Context | None = None) -> StepRun:
    """The run of the strategy a state's fields are laid out for (ZeRO when it holds a
    ZeRO state, the pipeline when the step gives its context); ``dtp.step`` passes them,
    so nothing here knows the state's type."""
    if pipeline_context is not None:
        return pipeline.Run(params, pipeline_context)
    if zero_state is not None:
        return zero.Run(zero_state, params, microbatches)
    return replicated.Run(params, microbatches)
