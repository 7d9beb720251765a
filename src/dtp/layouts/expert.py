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

``axis`` may also be several mesh axes that already split the tokens — ep *folded out
of* dp × cp, Megatron's other expert-data-parallel arrangement: ``expert(axis=("dp",
"cp"))`` with :func:`~dtp.layouts.data` and :func:`~dtp.layouts.context` puts experts
``Shard(0)`` over ``dp × cp`` (dp major) and dispatches over the flattened view of
those axes (:func:`dtp.mesh.flatten_axes`); it adds no data axis, since its axes are
data axes already.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the CLI checks layouts before torch loads (core.py)
    from torch.distributed.device_mesh import DeviceMesh

from .._mesh_shape import axis_names
from .core import Layout

__all__ = ["ExpertOptions", "expert"]


@dataclass(frozen=True, kw_only=True)
class ExpertOptions:
    """What :func:`expert` was asked for; checked when built.

    >>> ExpertOptions().axis
    'ep'
    """

    # the mesh axis experts are split over (and the batch, as a data axis); or a tuple of
    # token axes (mesh order) that ep is folded out of
    axis: str | tuple[str, ...] = "ep"

    def __post_init__(self) -> None:
        axes = (self.axis,) if isinstance(self.axis, str) else self.axis
        if (not isinstance(axes, (tuple, list)) or not axes or not all(isinstance(a, str) and a for a in axes)
                or len(set(axes)) != len(axes)):
            raise TypeError(f"layouts.expert: axis must be a mesh axis name or a tuple of distinct names, "
                            f"got {self.axis!r}")
        object.__setattr__(self, "axis", axes[0] if len(axes) == 1 else tuple(axes))  # canonical: "ep", not ("ep",)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes experts are split over (one, or the folded ones)."""
        return (self.axis,) if isinstance(self.axis, str) else self.axis

    @property
    def label(self) -> str:
        """The axes as a message names them: ``ep``, or ``dp×cp`` when folded."""
        return "×".join(self.axes)

    def degree(self, mesh: DeviceMesh) -> int:
        """The expert-parallel degree on ``mesh`` (axes the mesh lacks count 1)."""
        names = axis_names(mesh)
        return math.prod(mesh.size(names.index(a)) for a in self.axes if a in names)

    def check(self, sizes: Mapping[str, int], mesh: DeviceMesh, *, what: str = "model") -> None:
        """``ValueError`` (every rank alike, before any collective) when the model's
        ``expert`` count does not divide by the ``axis`` size on ``mesh``."""
        ep, experts = self.degree(mesh), sizes.get("expert")
        if experts is not None and experts % ep:
            raise ValueError(f"{what}: num_experts={experts} is not divisible by {self.label}={ep} "
                             f"(layouts.expert puts experts Shard(0) on {self.axis!r}); choose num_experts a "
                             f"multiple of {ep}, or a smaller {self.label}")


def expert(axis: str | Sequence[str] = ExpertOptions.axis) -> Layout:
    """Expert parallel over ``axis``: experts ``Shard(0)`` on it, and the batch split over
    it too (it is a data axis for everything else; module docstring). Compose with
    :func:`~dtp.layouts.data` for expert-data-parallel on a ``dp × ep`` mesh. A tuple of
    axes folds ep out of those token axes and adds no batch split.

    Raises: ``TypeError`` for an ``axis`` that is not a name or names; a model whose
    experts do not divide by the ep degree is refused by ``TrainState.create``
    (:meth:`ExpertOptions.check`).

    >>> layout = expert()
    >>> layout.params["expert"], layout.activations["batch"], layout.expert.axis
    (('ep',), ('ep',), 'ep')
    >>> expert(axis=("dp", "cp")).params["expert"], expert(axis=("dp", "cp")).activations
    (('dp', 'cp'), {})
    """
    opts = ExpertOptions(axis=tuple(axis) if isinstance(axis, (tuple, list)) else axis)
    acts = {"batch": opts.axes} if isinstance(opts.axis, str) else {}
    return Layout({"expert": opts.axes}, acts, expert=opts, name=f"expert({opts.axis!r})")
