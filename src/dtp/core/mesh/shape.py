"""A mesh's shape without torch: axis names and sizes, and a stand-in mesh that has only those.

The layouts check a model against a mesh through two questions only, "which axes, in
which order" (:func:`axis_names`) and "how large is each" (``mesh.size(i)``). The CLI asks
them before torch is imported (``dtp train`` answers a bad flag at once), so both live
here, with :class:`MeshShape`: a :class:`~torch.distributed.device_mesh.DeviceMesh`'s shape
and nothing else (no devices, no process group).

>>> mesh = MeshShape({"dp": 2, "tp": 4})
>>> axis_names(mesh), mesh.size(1), mesh.size()
(('dp', 'tp'), 4, 8)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["axis_names", "MeshShape"]


def axis_names(mesh: Any) -> tuple[str, ...]:
    """The mesh's axis names, outer to inner (a ``DeviceMesh`` or a :class:`MeshShape`).

    Raises: ``ValueError`` for a mesh without names.

    >>> axis_names(make_mesh(dp=1, tp=1))
    ('dp', 'tp')
    """
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError("dtp needs a mesh with named axes; build it with dtp.make_mesh(dp=…, tp=…)")
    return tuple(names)


class MeshShape:
    """The shape of a mesh ``{axis: size}`` (outer to inner), answering what the layouts'
    checks ask of a ``DeviceMesh``: ``mesh_dim_names``, ``size()``, ``size(i)``, ``ndim``."""

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self.sizes = dict(sizes)
        self.mesh_dim_names = tuple(self.sizes)
        self.ndim = len(self.sizes)

    def size(self, mesh_dim: int | None = None) -> int:
        """The size of axis ``mesh_dim``, or of the whole mesh."""
        values = list(self.sizes.values())
        return math.prod(values) if mesh_dim is None else values[mesh_dim]

    def __repr__(self) -> str:
        return f"MeshShape({self.sizes})"
