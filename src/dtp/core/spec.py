"""PartitionSpecs with JAX semantics, compiled to DTensor placements and back.

``P("dp", ("cp", "tp"), None, partial=("pp",))`` says, per tensor dimension, which mesh
axes split it (a tuple is major → minor), and which axes hold a pending sum. Trailing
dimensions left out are replicated, and so is every mesh axis the spec does not name.

The meaning of a spec on a mesh with rank coordinates ``c``: dimension ``d`` with axes
``(a1, …, ak)`` is cut into ``prod(size(ai))`` equal chunks and the rank holds chunk
``mixed_radix(c[a1], …, c[ak])`` (a1 most significant). DTensor applies placements mesh
dim by mesh dim (outer first), so a tuple whose order differs from the mesh order
compiles to ``_StridedShard`` with the split factor that reproduces the same chunk.
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Sequence, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ._torch import StridedShard, maybe_run_for_local_tensor, new_dtensor
from .mesh.devices import axis_names, axis_sizes, block_index, mesh_device

__all__ = ["P", "to_placements", "from_placements", "shard", "spec_of", "check_spec", "wrap_local", "wrap_like",
           "wrap_placed"]

DimSpec = Union[None, str, Sequence[str]]



class P:
    """A PartitionSpec: per tensor dimension, the mesh axes that split it.

    >>> P("dp", None, "tp")
    P('dp', None, 'tp')
    >>> P(("dp", "cp"), partial=("tp",)).axes_of(0)
    ('dp', 'cp')
    """

    __slots__ = ("dims", "partial")

    def __init__(self, *dims: DimSpec, partial: Iterable[str] | str = ()):
        norm: list[tuple[str, ...]] = []
        for d in dims:
            if d is None:
                norm.append(())
            elif isinstance(d, str):
                norm.append((d,))
            elif isinstance(d, (tuple, list)) and all(isinstance(a, str) for a in d):
                norm.append(tuple(d))
            else:
                raise ValueError(f"P: each dimension is None, an axis name or a tuple of axis names; got {d!r}")
        while norm and not norm[-1]:  # trailing unspecified dims are replicated anyway
            norm.pop()
        self.dims: tuple[tuple[str, ...], ...] = tuple(norm)
        if isinstance(partial, str):
            partial = (partial,)
        elif not isinstance(partial, (tuple, list)) or not all(isinstance(a, str) for a in partial):
            # was tuple()'s "'int' object is not iterable" (P("dp", partial=5))
            raise ValueError(f"P: partial is an axis name or a tuple of axis names; got {partial!r}")
        self.partial: tuple[str, ...] = tuple(partial)

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """The mesh axes splitting ``dim`` (major → minor); ``()`` when replicated."""
        return self.dims[dim] if dim < len(self.dims) else ()

    def used_axes(self) -> list[str]:
        return [a for d in self.dims for a in d] + list(self.partial)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and self.dims == other.dims and set(self.partial) == set(other.partial)

    def __hash__(self) -> int:
        return hash((self.dims, frozenset(self.partial)))

    def __repr__(self) -> str:
        def one(d: tuple[str, ...]) -> str:
            return "None" if not d else repr(d[0]) if len(d) == 1 else repr(d)

        parts = [one(d) for d in self.dims]
        if self.partial:
            parts.append(f"partial={self.partial!r}")
        return f"P({', '.join(parts)})"


def check_spec(spec: P, mesh: DeviceMesh, shape: Sequence[int] | None = None, name: str = "tensor") -> None:
    """Raise ``ValueError`` (naming the tensor, dim and axis) unless ``spec`` fits.

    Checks: every axis exists on the mesh, no axis is used twice, the spec has no more
    dims than the tensor, and every sharded dim divides evenly.

    >>> check_spec(P("dp"), make_mesh(dp=1), (4, 3), "x")
    >>> check_spec(P("tp"), make_mesh(dp=1), (4, 3), "x")
    Traceback (most recent call last):
    ValueError: x: spec P('tp') names unknown mesh axis 'tp'; the mesh axes are ('dp',)
    """
    if not isinstance(spec, P):
        raise ValueError(f"{name}: expected a dtp.P spec, got {spec!r}")
    sizes = axis_sizes(mesh)
    seen: set[str] = set()
    for axis in spec.used_axes():
        if axis not in sizes:
            raise ValueError(f"{name}: spec {spec} names unknown mesh axis {axis!r}; the mesh axes are {tuple(sizes)}")
        if axis in seen:
            raise ValueError(f"{name}: spec {spec} uses mesh axis {axis!r} twice; each axis may split one dim or be partial, once")
        seen.add(axis)
    if shape is None:
        return
    if len(spec.dims) > len(shape):
        raise ValueError(f"{name}: spec {spec} has {len(spec.dims)} dims but the tensor has shape {tuple(shape)}")
    for d, axes in enumerate(spec.dims):
        n = math.prod(sizes[a] for a in axes)
        if shape[d] % n:
            split = " × ".join(f"{a}={sizes[a]}" for a in axes) + (f" = {n}" if len(axes) > 1 else "")
            raise ValueError(
                f"{name}: dim {d} of size {shape[d]} is not divisible by {split} "
                f"(spec {spec}); uneven shards are not supported — pad dim {d} to a multiple of {n} "
                f"or shard it over fewer devices"
            )


def to_placements(spec: P, mesh: DeviceMesh) -> tuple[Placement, ...]:
    """Compile a spec to one DTensor placement per mesh dim (cached: a pure function).

    >>> to_placements(P(None, "tp"), make_mesh(dp=1, tp=1))
    (Replicate(), Shard(dim=1))
    """
    return _to_placements(spec, mesh)


@functools.lru_cache(maxsize=4096)
def _to_placements(spec: P, mesh: DeviceMesh) -> tuple[Placement, ...]:
    check_spec(spec, mesh)
    names = axis_names(mesh)
    sizes = axis_sizes(mesh)
    placements: list[Placement] = [Replicate() for _ in names]
    for axis in spec.partial:
        placements[names.index(axis)] = Partial("sum")
    for d, axes in enumerate(spec.dims):
        for k, axis in enumerate(axes):
            m = names.index(axis)
            # Axes more major in the tuple but later in mesh order have not split the
            # tensor yet when DTensor applies this mesh dim: they become the split factor.
            sf = math.prod(sizes[b] for b in axes[:k] if names.index(b) > m)
            placements[m] = Shard(d) if sf == 1 else StridedShard(d, split_factor=sf)
    return tuple(placements)


def from_placements(placements: Sequence[Placement], mesh: DeviceMesh) -> P:
    """The spec of a DTensor's placements (inverse of :func:`to_placements`; cached)."""
    return _from_placements(tuple(placements), mesh)


@functools.lru_cache(maxsize=4096)
def _from_placements(placements: tuple[Placement, ...], mesh: DeviceMesh) -> P:
    names = axis_names(mesh)
    sizes = axis_sizes(mesh)
    partial: list[str] = []
    per_dim: dict[int, list[tuple[int, str, int]]] = {}
    for m, pl in enumerate(placements):
        if isinstance(pl, Partial):
            if pl.reduce_op != "sum":
                raise ValueError(f"dtp specs express pending sums only; mesh axis {names[m]!r} is Partial({pl.reduce_op!r})")
            partial.append(names[m])
        elif isinstance(pl, StridedShard):
            per_dim.setdefault(pl.dim, []).append((m, names[m], pl.split_factor))
        elif isinstance(pl, Shard):
            per_dim.setdefault(pl.dim, []).append((m, names[m], 1))
    dims: list[tuple[str, ...]] = [()] * (max(per_dim) + 1 if per_dim else 0)
    for d, entries in per_dim.items():
        order: list[str] = []
        # Rebuild the major→minor order from the last mesh dim backwards: each axis sits
        # where the axes before it (all later in mesh order) multiply to its split factor.
        for m, axis, sf in sorted(entries, reverse=True):
            prefix, pos = 1, None
            for i in range(len(order) + 1):
                if prefix == sf:
                    pos = i
                    break
                if i < len(order):
                    prefix *= sizes[order[i]]
            if pos is None:
                raise ValueError(f"placements {tuple(placements)} have no PartitionSpec equivalent (dim {d})")
            order.insert(pos, axis)
        dims[d] = tuple(order)
    return P(*dims, partial=tuple(partial))


@maybe_run_for_local_tensor
def _take_block(t: torch.Tensor, spec: P, mesh: DeviceMesh, *coord: int) -> torch.Tensor:
    """This rank's block of ``t`` under ``spec`` given its mesh coordinate (plain ints;
    the decorator evaluates it once per simulated rank under LocalTensorMode)."""
    c, n = dict(zip(axis_names(mesh), coord)), axis_sizes(mesh)
    out = t
    for d, axes in enumerate(spec.dims):
        count = math.prod(n[a] for a in axes)
        if count > 1:
            step = t.shape[d] // count
            out = out.narrow(d, block_index(mesh, axes, c) * step, step)
    out = out.clone()
    if any(c[a] != 0 for a in spec.partial):
        out.zero_()  # a pending sum: the value lives on coordinate 0 only
    return out


def shard(tensor: torch.Tensor, mesh: DeviceMesh, spec: P, *, name: str = "tensor") -> DTensor:
    """Turn a global tensor, identical on every rank, into a DTensor laid out as ``spec``.

    No communication: each rank keeps its own block, on the mesh's device
    (:func:`dtp.mesh.mesh_device`; only the block is copied there). Axes in ``partial``
    keep the value on coordinate 0 and zeros elsewhere, so the pending sum is the
    original tensor.

    >>> mesh = make_mesh(dp=1)
    >>> x = shard(torch.arange(4.0), mesh, P("dp"))
    >>> spec_of(x)
    P('dp')
    """
    if isinstance(tensor, DTensor):
        raise ValueError(f"{name}: already a DTensor with spec {spec_of(tensor)}; use dtp.reshard to move it")
    if not isinstance(tensor, torch.Tensor):  # was "'list' object has no attribute 'shape'"
        raise TypeError(f"{name}: dtp.shard lays out a torch.Tensor, got {type(tensor).__name__}")
    check_spec(spec, mesh, tensor.shape, name)
    local = _take_block(tensor.detach(), spec, mesh, *mesh.get_coordinate())
    device = mesh_device(mesh)
    if local.device != device:
        local = local.to(device)
    # A new leaf (like distribute_tensor): gradients land on the DTensor itself.
    return wrap_local(local, mesh, spec, tuple(tensor.shape)).requires_grad_(tensor.requires_grad)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def wrap_local(local: torch.Tensor, mesh: DeviceMesh, spec: P, shape: tuple[int, ...]) -> DTensor:
    """The DTensor whose piece on this rank is ``local``, of global ``shape`` laid out as
    ``spec``: no check and no collective — for callers that know every rank's piece fits
    (:func:`dtp.from_local` is the checked, differentiable way).

    >>> wrap_local(torch.ones(2, 3), make_mesh(dp=1), P("dp"), (2, 3)).shape
    torch.Size([2, 3])
    """
    placements, stride = to_placements(spec, mesh), _contiguous_stride(tuple(shape))
    if _plain_wrap(local, mesh):
        # The placement is known and no gradient flows through ``local`` (a collective's
        # result inside an autograd Function, an optimizer update, a gradient): the
        # DTensor is built directly, without from_local's autograd node (~99 per tp step).
        return new_dtensor(local, mesh, placements, tuple(shape), stride)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def wrap_like(local: torch.Tensor, ref: DTensor) -> DTensor:
    """:func:`wrap_local` with ``ref``'s mesh, placements, global shape and stride: the
    DTensor holding ``local`` where ``ref`` holds its shard (an optimizer's result for a
    parameter); built directly when no gradient flows through ``local``.

    >>> ref = shard(torch.zeros(2, 3), make_mesh(dp=1), P("dp"))
    >>> spec_of(wrap_like(torch.ones(2, 3), ref)), wrap_like(torch.ones(2, 3), ref).shape
    (P('dp'), torch.Size([2, 3]))
    """
    return wrap_placed(local, ref.device_mesh, tuple(ref.placements), tuple(ref.shape), ref.stride())


def wrap_placed(local: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...], shape: tuple[int, ...],
                stride: tuple[int, ...]) -> DTensor:
    """``DTensor.from_local(local, mesh, placements, run_check=False, shape=, stride=)``,
    built directly (no autograd node, a shared spec) when no gradient flows through
    ``local``: for callers that hold the placements already (a saved tensor's).

    >>> mesh = make_mesh(dp=1)
    >>> wrap_placed(torch.ones(2, 3), mesh, to_placements(P("dp"), mesh), (2, 3), (3, 1)).placements
    (Shard(dim=0),)
    """
    if _plain_wrap(local, mesh):
        return new_dtensor(local, mesh, tuple(placements), tuple(shape), tuple(stride))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=tuple(stride))


def _plain_wrap(local: torch.Tensor, mesh: DeviceMesh) -> bool:
    """Whether :func:`wrap_local` may skip ``from_local``: nothing to differentiate
    through, the shard already on the mesh's device type, no compiler tracing."""
    return (not (local.requires_grad and torch.is_grad_enabled()) and local.device.type == mesh.device_type
            and not torch.compiler.is_compiling())


def spec_of(x: torch.Tensor) -> P:
    """The :class:`P` of a DTensor.

    >>> spec_of(shard(torch.zeros(4, 4), make_mesh(dp=1), P(None, "dp")))
    P(None, 'dp')
    """
    if not isinstance(x, DTensor):
        raise TypeError(f"spec_of expects a DTensor, got {type(x).__name__}; use dtp.shard to lay a tensor out")
    return from_placements(x.placements, x.device_mesh)
