"""What a strategy keeps in a :class:`dtp.TrainState` between steps, and the questions it answers.

A state's strategy part (``TrainState.strategy``) is an object of a subclass of
:class:`StrategyState`; the rest of dtp asks it, never tests its type:

=============================  ================================================================
``describe()``                 its part of the state's repr (``""``: nothing to say)
``owns_params``                whether the parameters derive from it (a new parameter tree then
                               needs a new state)
``wait()``                     wait for what it has in flight (no new collective)
``gather(params)``             the whole parameters laid out as the layout says (ZeRO-3: a
                               collective)
``specs(params)``              the parameters' specs at rest, lazily
``run(params, m, local=)``     the step's run (:class:`dtp.strategies.StepRun`) outside a pipeline
``stage_state()``              what a pipeline stage's run continues from (ZeRO's buckets)
``wrap_stages(run)``           a pipeline's run as the state updates it (mixed precision's masters)
``gradients_only()``           why ``value_and_grad`` cannot hand back its gradients, or ``None``
``saved(params, opt_state)``   the checkpoint's tensors: ``param/``, ``master/``, ``opt/`` entries
``manifest()``                 its fields of the checkpoint's manifest
``empty_params(params)``       empty parameters laid out as a load fills them
``own_targets()``              tensors of its own a load fills (names as ``saved`` gives them)
``keeps_master``               whether the optimizer state and master weights are in the
                               accumulation dtype (fp32 for bf16 parameters)
``restored(params, master,     ``(opt_state, state)`` after a checkpoint's load (``own``: the
opt_state, optimizer, own)``   filled ``own_targets``)
=============================  ================================================================

:func:`register_state` says which options make a state of their own (ZeRO's, mixed
precision's, a new strategy's): :func:`dtp.strategies.create` asks each registered family
the layout has, in order. The base class answers for plain parameters — the replicated strategy (data parallel,
DDP's all-reduce; tensor, context and expert parallel's layouts too), whose state holds
nothing: :data:`PLAIN` is its one instance. ZeRO's buckets
(:class:`dtp.strategies.zero.ZeroState`) and mixed precision's master weights
(:class:`dtp.strategies.precision.MasterWeights`) override what differs.

>>> PLAIN.owns_params, PLAIN.describe(), PLAIN.manifest()
(False, '', {'zero_stage': 0})
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

import optree
import torch
from torch.distributed.tensor import DTensor

from ...ops.local_batch import LocalBatch
from ..optim import map_param_trees
from ...core.spec import P, spec_of, wrap_local
from . import replicated

__all__ = ["StrategyState", "Plain", "PLAIN", "saved_tensors", "save_scalar", "tensor_paths", "empty_like",
           "register_state", "state_makers"]

PyTree = Any


def tensor_paths(tree: PyTree) -> list[str]:
    """The dotted paths of a tree's leaves (``layers.0.wq``): the checkpoint's names."""
    return [".".join(map(str, p)) for p in optree.tree_paths(tree)]


def save_scalar(out: dict[str, Any], name: str, x: Any) -> Any:
    """Put optimizer scalar ``name`` (the update count) into a checkpoint's ``out`` as
    ``opt/<name>``; ``TypeError`` for anything but a tensor."""
    if isinstance(x, torch.Tensor):
        out[f"opt/{name}"] = (x.to_local() if isinstance(x, DTensor) else x).detach()
        return x
    raise TypeError(f"checkpoint: optimizer state entry {name!r} is a {type(x).__name__}; only tensors "
                    f"(and trees of them) can be saved")


def saved_tensors(params: PyTree, master: PyTree, opt_state: PyTree) -> dict[str, Any]:
    """``name -> tensor`` of per-parameter trees: every parameter (``param/<path>``), the
    master weights where they differ from the parameters' dtype (``master/<path>``), the
    optimizer state (``opt/<field>/<path>``, and its scalars ``opt/<field>``).

    >>> saved_tensors({"w": torch.ones(2)}, None, None)
    {'param/w': tensor([1., 1.])}
    """
    paths = tensor_paths(params)
    out: dict[str, Any] = {f"param/{p}": x.detach() for p, x in zip(paths, optree.tree_leaves(params))}
    if master is not None:
        for p, x, param in zip(paths, optree.tree_leaves(master), optree.tree_leaves(params)):
            if x.dtype != param.dtype:  # an fp32 parameter is its own master weight
                out[f"master/{p}"] = x.detach()
    if opt_state is not None:
        def mirror(name: str, tree: PyTree) -> PyTree:
            for p, x in zip(paths, optree.tree_leaves(tree)):
                out[f"opt/{name}/{p}"] = x.detach()
            return tree

        map_param_trees(opt_state, params, mirror, lambda name, x: save_scalar(out, name, x))
    return out


class StrategyState:
    """A strategy's state between steps; the base answers for plain parameters (the
    module docstring lists the questions). Plain data: reading it never communicates."""

    keeps_master: bool = False  # the optimizer state is over the parameters, in their dtype

    # ---- the step
    def describe(self) -> str:
        """Its part of a ``TrainState``'s repr (``", zero=stage 1"``), ``""`` for none."""
        return ""

    @property
    def owns_params(self) -> bool:
        """Whether the parameters derive from this state: new ones need a new state."""
        return False

    def wait(self) -> None:
        """Wait for every collective this state still has in flight; starts none."""

    def gather(self, params: PyTree) -> PyTree:
        """The whole parameter tree laid out as the layout says (outside a pipeline)."""
        return params

    def specs(self, params: PyTree) -> Iterator[P | None]:
        """The parameters' specs at rest (``None``: a plain tensor), lazily: a step on one
        device never asks (:func:`dtp.strategies.local.decide`)."""
        for x in optree.tree_leaves(params):
            yield spec_of(x) if isinstance(x, DTensor) else None

    def run(self, params: PyTree, microbatches: int, *, local: LocalBatch | None = None) -> Any:
        """The step's run outside a pipeline: gradients reduced to the parameters' layout."""
        return replicated.Run(params, microbatches, local=local)

    def stage_state(self) -> Any:
        """What each pipeline stage's run continues from (``None``: nothing)."""
        return None

    def wrap_stages(self, run: Any) -> Any:
        """A pipeline's run as this state updates it (``run`` itself: the optimizer
        updates what the run's targets are)."""
        return run

    def gradients_only(self) -> str | None:
        """Why ``value_and_grad`` cannot hand back the gradients laid out like the
        parameters under this state, or ``None`` when it can."""
        return None

    # ---- checkpoints
    def saved(self, params: PyTree, opt_state: PyTree) -> dict[str, Any]:
        """The checkpoint's tensors of this state (:func:`saved_tensors`)."""
        return saved_tensors(params, self.master_tree(), opt_state)

    def master_tree(self) -> PyTree:
        """The master weights as a tree laid out like the parameters, or ``None``."""
        return None

    def manifest(self) -> dict[str, Any]:
        """This state's fields of a checkpoint's ``manifest.json`` (``zero_stage`` since
        format 1: 0 without ZeRO)."""
        return {"zero_stage": 0}

    def empty_params(self, params: PyTree) -> PyTree:
        """Empty parameters laid out as ``params`` (what a checkpoint's load fills)."""
        return optree.tree_map(empty_like, params)

    def own_targets(self) -> dict[str, Any]:
        """Empty tensors, laid out as this state holds them, for what a checkpoint saved
        of its own beyond parameters, master weights and optimizer state (names as
        :meth:`saved` writes them); a load fills them and hands them to :meth:`restored`."""
        return {}

    def restored(self, params: PyTree, master: PyTree, opt_state: PyTree, optimizer: Any,
                 own: Mapping[str, Any]) -> tuple[PyTree, Any]:
        """``(opt_state, state)`` over loaded ``params`` (``master``: loaded master
        weights, ``None`` when the checkpoint had none or this state keeps none;
        ``opt_state``: loaded, or ``None`` for a fresh one; ``own``: the filled
        :meth:`own_targets`)."""
        return (optimizer.init(params) if opt_state is None else opt_state), self


def empty_like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor laid out as ``x`` (a DTensor: the same spec and global shape), in
    ``dtype`` (default ``x``'s).

    >>> empty_like(torch.ones(2, 3), torch.float64).shape
    torch.Size([2, 3])
    """
    dtype = dtype or x.dtype
    if isinstance(x, DTensor):
        local = torch.empty(x.to_local().shape, dtype=dtype, device=x.to_local().device)
        return wrap_local(local, x.device_mesh, spec_of(x), tuple(x.shape))
    return torch.empty(x.shape, dtype=dtype, device=x.device)


class Plain(StrategyState):
    """The state of plain parameters: nothing beyond them (:data:`PLAIN`)."""

    def __repr__(self) -> str:
        return "PLAIN"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Plain)

    def __hash__(self) -> int:
        return hash(Plain)


PLAIN = Plain()

#: ``make(params, optimizer, options, layout, mesh) -> (opt_state, state) | None``
StateMaker = Callable[[PyTree, Any, Any, Any, Any], "tuple[PyTree, StrategyState] | None"]
_MAKERS: list[tuple[int, str, StateMaker]] = []


def register_state(family: str, make: StateMaker, *, order: int = 50) -> None:
    """Let the layout option of ``family`` make a new state's strategy part:
    ``make(params, optimizer, options, layout, mesh)`` returns ``(opt_state, state)``, or
    ``None`` where it does not apply on that mesh. Families are asked in ``order`` (lower
    first; ZeRO 10, mixed precision 20: ZeRO's slices already are master weights); the
    first answer wins, and without one the state is :data:`PLAIN`. Registering a family
    again replaces its maker.

    >>> [family for family, _ in state_makers()][:2]
    ['zero', 'precision']
    """
    _MAKERS[:] = [m for m in _MAKERS if m[1] != family]
    _MAKERS.append((order, family, make))
    _MAKERS.sort(key=lambda m: m[0])


def state_makers() -> list[tuple[str, StateMaker]]:
    """``(family, make)`` of every registered maker, in the order they are asked."""
    return [(family, make) for _, family, make in _MAKERS]

optree.register_pytree_node(Plain, lambda s: ((), None, ()), lambda aux, children: PLAIN, namespace="dtp")
