"""The expert-parallel preset: experts ``Shard(0)`` over an ``ep`` mesh axis.

``layouts.expert(axis="ep")`` puts the ``expert`` logical axis (dim 0 of an MoE block's
``w_gate`` / ``w_up`` / ``w_down``) on ``axis``: coordinate c holds experts
``[c·L, (c+1)·L)``, ``L = experts / ep``. As in Megatron's expert-data-parallel, ``axis``
is *also* a data axis for everything else: the batch is split over it (over
``(dp, ep)`` with :func:`~dtp.layouts.data`), dense parameters (attention, norms,
router, embeddings) are replicated over it and their gradients are reduced over
``dp × ep`` like any data-parallel gradient. Inside an MoE block each rank's tokens go
to the ranks that hold their experts and back (:mod:`dtp.ops.moe_dispatch`), so an
expert's gradient is already complete for ``ep`` on its owner — it comes from the
tokens of every ``ep`` rank — and only pending over the remaining data axes (``dp``):
expert gradients are reduced only over the ranks that hold the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torch.distributed.device_mesh import DeviceMesh

from ..mesh import axis_names
from .core import Layout

__all__ = ["ExpertOptions", "expert"]


@dataclass(frozen=True, kw_only=True)
class ExpertOptions:
    """What :func:`expert` was asked for; checked when built.

    >>> ExpertOptions().axis
    'ep'
    """

    axis: str = "ep"  # the mesh axis experts are split over (and the batch, as a data axis)

    def __post_init__(self) -> None:
        if not isinstance(self.axis, str) or not self.axis:
            raise TypeError(f"layouts.expert: axis must be a mesh axis name (a str), got {self.axis!r}")

    def degree(self, mesh: DeviceMesh) -> int:
        """The expert-parallel degree on ``mesh`` (1 without the axis)."""
        names = axis_names(mesh)
        return mesh.size(names.index(self.axis)) if self.axis in names else 1

    def check(self, sizes: Mapping[str, int], mesh: DeviceMesh, *, what: str = "model") -> None:
        """``ValueError`` (every rank alike, before any collective) when the model's
        ``expert`` count does not divide by the ``axis`` size on ``mesh``."""
        ep, experts = self.degree(mesh), sizes.get("expert")
        if experts is not None and experts % ep:
            raise ValueError(f"{what}: num_experts={experts} is not divisible by {self.axis}={ep} "
                             f"(layouts.expert puts experts Shard(0) on {self.axis!r}); choose num_experts a "
                             f"multiple of {ep}, or a smaller {self.axis}")


def expert(axis: str = ExpertOptions.axis) -> Layout:
    """Expert parallel over ``axis``: experts ``Shard(0)`` on it, and the batch split over
    it too (it is a data axis for everything else; module docstring). Compose with
    :func:`~dtp.layouts.data` for expert-data-parallel on a ``dp × ep`` mesh.

    Raises: ``TypeError`` for an ``axis`` that is not a name; a model whose experts do not
    divide by the axis is refused by ``TrainState.create`` (:meth:`ExpertOptions.check`).

    >>> layout = expert()
    >>> layout.params["expert"], layout.activations["batch"], layout.expert.axis
    (('ep',), ('ep',), 'ep')
    """
    opts = ExpertOptions(axis=axis)
    return Layout({"expert": (opts.axis,)}, {"batch": (opts.axis,)}, expert=opts, name=f"expert({opts.axis!r})")
