"""Mixed precision without ZeRO (``layouts.mixed_precision``): master weights beside the parameters.

Megatron's recipe, on the replicated and pipeline runs (ZeRO's fp32 master slices and
fp32 gradient buckets already are the same thing, so a ZeRO state is never wrapped):

* forward and backward compute in the parameters' dtype (bf16);
* each microbatch's gradient is added into an accumulator in the accumulation dtype
  (:func:`dtp.core._rules.accum_dtype`: fp32), and the accumulated gradient is reduced in it
  (``grad reduce`` moves fp32: 4 bytes per parameter, as ZeRO's reduce-scatter and
  Megatron's ``--accumulate-allreduce-grads-in-fp32``, which it forces for bf16);
* the optimizer updates the **master weights** (:class:`MasterWeights`, laid out like
  the parameters, in the accumulation dtype), its moments in the same dtype;
* the new parameters are the master weights rounded (a local cast, no collective).

The parameters of a dtype that is already the accumulation dtype (fp32, fp64) are their
own master weights: for them nothing changes. :func:`wrap` puts a :class:`Run` around
the strategy's own run; the run offers ``mirror(tree)`` (a per-parameter tree laid out as
its targets: itself, or a pipeline stage's part of it) and accumulates in fp32 when asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Mapping

import optree
import torch

from ...core._rules import accum_dtype
from ...ops.local_batch import LocalBatch
from . import replicated
from .state import StrategyState, register_state

__all__ = ["MasterWeights", "needed", "create", "Run", "ScheduledRun", "wrap"]

PyTree = Any


@dataclass(frozen=True)
class MasterWeights(StrategyState):
    """Mixed precision's part of a :class:`dtp.TrainState` (``state.strategy``):
    ``master``, the master weights as a tree laid out like the parameters (a pipeline
    rank's: its stages' after step one, ``None`` elsewhere), each leaf in the
    accumulation dtype of its parameter. Plain data; its pytree child is ``master``.
    The optimizer updates it; the parameters are it rounded."""

    master: PyTree
    keeps_master: ClassVar[bool] = True

    def __repr__(self) -> str:
        dtypes = sorted({str(x.dtype).removeprefix("torch.") for x in optree.tree_leaves(self.master)})
        return f"MasterWeights({', '.join(dtypes)})"

    def describe(self) -> str:
        return f", master={self!r}"

    @property
    def owns_params(self) -> bool:
        return True

    def run(self, params: PyTree, microbatches: int, *, local: LocalBatch | None = None) -> "Run":
        # fp32 accumulators, the master weights updated
        return wrap(replicated.Run(params, microbatches, accumulate=True, local=local), self)

    def wrap_stages(self, run: Any) -> "Run":
        return wrap(run, self)

    def master_tree(self) -> PyTree:
        return self.master

    def restored(self, params: PyTree, master: PyTree, opt_state: PyTree, optimizer: Any,
                 own: Any = None) -> tuple[PyTree, Any]:
        # Saved without master weights (pure bf16): they start as the parameters, exactly.
        weights = create(params) if master is None else MasterWeights(master)
        return (optimizer.init(weights.master) if opt_state is None else opt_state), weights


optree.register_pytree_node(MasterWeights, lambda s: ((s.master,), None, ("master",)),
                            lambda aux, children: MasterWeights(children[0]), namespace="dtp")


def needed(params: PyTree) -> bool:
    """Whether any parameter computes in a dtype lower than its accumulation dtype (bf16,
    fp16): only then do master weights differ from the parameters.

    >>> needed({"w": torch.ones(2, dtype=torch.bfloat16)}), needed({"w": torch.ones(2)})
    (True, False)
    """
    return any(x.dtype != accum_dtype(x.dtype) for x in optree.tree_leaves(params) if x.is_floating_point())


def _master(x: torch.Tensor) -> torch.Tensor:
    # An fp32 parameter is its own master weight: an alias, not a copy (updates are functional).
    return x.detach().to(accum_dtype(x.dtype))


def create(params: PyTree) -> MasterWeights:
    """Master weights of laid-out ``params``: each in its accumulation dtype, on its
    device and in its layout (a local cast: no collective).

    >>> create({"w": torch.ones(2, dtype=torch.bfloat16)})
    MasterWeights(float32)
    """
    return MasterWeights(optree.tree_map(_master, params))


def _make(params: PyTree, optimizer: Any, opts: Any, layout: Any, mesh: Any) -> tuple[PyTree, MasterWeights] | None:
    # bf16 parameters only: fp32 ones are their own master weights.
    if not needed(params):
        return None
    master = create(params)
    return optimizer.init(master.master), master


register_state("precision", _make, order=20)


class Run:
    """A strategy's run whose optimizer updates the master weights: forward, backward and
    the gradients are the inner run's (which accumulates in fp32); the targets are the
    master weights; ``finish`` rounds them into the new parameters."""

    def __init__(self, inner: Any, state: MasterWeights):
        self.inner, self.state = inner, state
        self.grouped = inner.grouped
        self.local = getattr(inner, "local", None)  # local batch mode is the inner run's

    def params(self) -> PyTree:
        return self.inner.params()

    def forward(self) -> ContextManager[None]:
        return self.inner.forward()

    def backward(self, loss: torch.Tensor, microbatch: int) -> None:
        self.inner.backward(loss, microbatch)

    def gradients(self) -> Iterator[tuple[int, PyTree]]:
        return self.inner.gradients()

    def targets(self) -> list[PyTree]:
        return [self.inner.mirror(self.state.master)]

    def opt_state(self, optimizer: Any, opt_state: PyTree, targets: list[PyTree]) -> PyTree:
        return self.inner.opt_state(optimizer, opt_state, targets)

    def norm(self, grads: PyTree) -> torch.Tensor:
        return self.inner.norm(grads)

    def in_flight(self) -> bool:
        return self.inner.in_flight()

    def mask_flags(self, mask: Any, name: str) -> None:
        """``None``: the targets are the master weights, one per parameter."""
        return None

    def updated(self, i: int, target: PyTree) -> None:
        """Nothing yet: the parameters are the master weights rounded, at :meth:`finish`."""

    def finish(self, updated: list[PyTree]) -> tuple[PyTree, MasterWeights]:
        master = optree.tree_map(torch.Tensor.detach, updated[0])
        # The parameters are the master weights rounded to their own dtypes (the run's
        # parameters say which: an MoE router stays fp32 beside bf16 blocks).
        params = optree.tree_map(lambda m, p: m.detach().to(p.dtype).requires_grad_(True), master,
                                 self.inner.targets()[0])
        params, _ = self.inner.finish([params])
        return params, MasterWeights(master)


class ScheduledRun(Run):
    """:class:`Run` around a run that orders its microbatches itself (the pipeline's)."""

    def schedule(self, loss_fn: Callable, microbatches: list[Mapping[str, Any]]) -> tuple[float, Any]:
        return self.inner.schedule(loss_fn, microbatches)


def wrap(inner: Any, state: MasterWeights) -> Run:
    """``inner`` updating ``state``'s master weights (a :class:`ScheduledRun` when
    ``inner`` schedules its microbatches itself)."""
    return (ScheduledRun if hasattr(inner, "schedule") else Run)(inner, state)
