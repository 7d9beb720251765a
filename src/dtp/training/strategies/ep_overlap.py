"""``layouts.expert(ep_overlap=True)``: one microbatch's expert all-to-alls hidden under
another microbatch's compute (Megatron-core's ``--overlap-moe-expert-parallel-comm``,
DeepSeek's two-microbatch overlap). At pp = 1 this module's :class:`Run`; under a pipeline
(1f1b, interleaved, dualpipev) the runner puts the pairs of its lanes' plan
(:func:`dtp.strategies.pipeline_plan.rank_steps` with ``lanes=True``) on the same lanes
(``dtp.strategies.pipeline.Run._in_lanes``, :data:`PIPELINE_SCHEDULES`).

A :class:`Run` wraps the step's own run (replicated or mixed precision): the same
gradients, targets and update; only the order of the microbatches' forwards and
backwards is its own. They run on two cooperative lanes (:mod:`dtp.ops.lanes`), lane j
taking the microbatches k ≡ j (mod 2), each forward then backward (:func:`chains`)::

    lane 0:  F0 B0 F2 B2 …
    lane 1:  F1 B1 F3 B3 …

A lane keeps the turn until its MoE block posts an all-to-all — the counts exchange,
dispatch or combine, forward or its gradient's in backward (:mod:`dtp.ops.moe_dispatch`,
:mod:`dtp.ops.moe_pipe`) — then the other lane computes (its attention and router, its
experts, its backward) while the transfer travels. Nothing waits between microbatches,
so only the step's first all-to-all and its last ones lack a partner.

Numbers: each microbatch computes exactly what it computes in the plain loop, its loss
weighted 1/m, its gradients added to the run's accumulators when its backward ends
(the lanes' backwards may end in either order: sums equal to rounding). Collective
order: the turn passes only at those all-to-alls, so it is the same on every rank.
Memory: two microbatches' activations are alive at once (the plain loop: one).

Thread-local state the step set — the layout, the recompute policy, the loss divisor
(:func:`dtp.ops.mean_over`), the comm logs and the compile options — is carried into
each lane. On a GPU a backward's autograd functions run on the device's autograd
thread, not the lane: there the backward all-to-alls are waited in place (forwards
still overlap).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from ...core import comm
from ...core.compiled import active as compile_options, compiling
from ...layouts import Layout, current, use_layout
from ...layouts.expert import EP_OVERLAP_SCHEDULES
from ...ops import lanes
from ...ops.parallel import mean_over_here
from ...ops.recompute import policy, recompute
from ...core.redistribute import value_of
from .loss_out import split as split_loss

__all__ = ["Run", "chains", "carry", "check", "active", "PIPELINE_SCHEDULES"]

#: The pipeline schedules whose F / B actions of two microbatches run side by side on two
#: lanes where :func:`dtp.schedules.lane_pairs` pairs them (``dtp.strategies.pipeline.Run._in_lanes``).
PIPELINE_SCHEDULES = EP_OVERLAP_SCHEDULES


def active(layout: Layout) -> bool:
    """Whether the layout asks for ep_overlap (``layouts.expert(ep_overlap=True)``)."""
    return layout.expert is not None and layout.expert.ep_overlap


def check(layout: Layout, mesh: DeviceMesh, microbatches: int) -> None:
    """``layouts.expert(ep_overlap=True)``'s rules for a step on ``mesh``, every rank alike
    (:meth:`dtp.layouts.ExpertOptions.check_overlap`). Nothing without ep_overlap."""
    if active(layout):
        layout.expert.check_overlap(layout, mesh, microbatches, what="train_step")


def chains(m: int) -> list[list[tuple[str, int]]]:
    """Each lane's tasks in order: ``("F", k)`` is microbatch k's forward, ``("B", k)`` its
    backward; lane j takes the microbatches k ≡ j (mod 2), each forward then backward.

    >>> chains(4)
    [[('F', 0), ('B', 0), ('F', 2), ('B', 2)], [('F', 1), ('B', 1), ('F', 3), ('B', 3)]]
    """
    if m < 2:
        raise ValueError(f"ep_overlap: needs microbatches >= 2 (one microbatch's all-to-all hides under "
                         f"another's compute), got {m}")
    return [[(kind, k) for k in range(j, m, 2) for kind in "FB"] for j in range(2)]


def carry() -> Callable[[], contextlib.AbstractContextManager[None]]:
    """What a lane enters to see the step's thread-local state (module docstring)."""
    layout, policy_now, options = current(), policy(), compile_options()
    logs, divisor = comm.active_logs(), mean_over_here()

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if layout is not None:
                stack.enter_context(use_layout(*layout))
            for ctx in (recompute(policy_now), compiling(options), comm.record_into(logs), divisor()):
                stack.enter_context(ctx)
            yield

    return enter


class Run:
    """The step's run with its microbatches scheduled in lanes (module docstring):
    everything but :meth:`schedule` is the wrapped run's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:  # params, gradients, targets, opt_state, norm, in_flight, updated, finish, grouped
        return getattr(self.inner, name)

    def schedule(self, loss_fn: Any, microbatches: list[Any]) -> tuple[float, Any]:
        m, run = len(microbatches), self.inner
        enter = carry()
        outs: list[tuple[torch.Tensor, Any] | None] = [None] * m

        def forward(k: int) -> None:
            with enter(), comm.span("forward"), run.forward():
                out = loss_fn(run.params(), microbatches[k])
            loss, aux = split_loss(out)
            outs[k] = (loss, aux)

        def backward(k: int) -> None:
            loss = outs[k][0]  # type: ignore[index]
            with enter(), comm.span("backward"):
                run.backward(loss / m, k)
            outs[k] = (loss.detach(), outs[k][1])  # type: ignore[index]  # the graph is spent

        def lane(tasks: list[tuple[str, int]]) -> Callable[[], None]:
            def work() -> None:
                for kind, k in tasks:
                    (forward if kind == "F" else backward)(k)
            return work

        lanes.run([lane(tasks) for tasks in chains(m)])
        total = 0.0
        for loss, _ in outs:  # type: ignore[misc]
            total += value_of(loss.detach()) / m
        auxes = [aux for _, aux in outs]  # type: ignore[misc]
        if all(a is None for a in auxes):
            return total, None
        return total, tuple(auxes)
