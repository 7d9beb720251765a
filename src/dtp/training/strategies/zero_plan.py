"""ZeRO's bucket geometry on a mesh: which parameter lies where in which flat bucket, and
which elements of it are this rank's (:mod:`dtp.strategies.zero` runs the steps).

The grouping rule itself is :func:`dtp.layouts.zero.bucket_groups` (shared with the plan
and checkpoints); here it is applied to the parameters as a rank holds them (its tp/cp
block, replicated over the ZeRO axis). A plan needs only each parameter's spec, shape and
dtype, never its values: the first step builds one from the order its forward read the
parameters, and :func:`dtp.TrainState.from_hf` builds one before any weight is read, so
that each rank reads only the elements of its bucket slices.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...core import comm
from ...layouts.zero import ZeroOptions, bucket_groups, padded_numel
from ...core.mesh.devices import axis_names, axis_sizes, coordinates
from ...core.spec import P

__all__ = ["Leaf", "Bucket", "ZeroPlan", "leaf", "make_plan", "check_same_plan", "local_parts", "flat_global", "slice_of",
           "param_slice", "gather_bucket", "boxes", "bytes_per_parameter"]


@dataclass(frozen=True)
class Leaf:
    """One parameter as this rank holds it (its tp/cp shard, replicated over dp)."""

    path: str
    mesh: DeviceMesh
    spec: P
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    def view(self, flat: torch.Tensor, offset: int) -> torch.Tensor:
        """This parameter's shard inside a flat bucket buffer starting at ``offset``."""
        return flat.narrow(0, offset, self.numel).view(self.local_shape)


def leaf(path: str, mesh: DeviceMesh, spec: P, shape: Sequence[int], dtype: torch.dtype, axis: str) -> Leaf:
    """The :class:`Leaf` of a parameter of global ``shape`` laid out as ``spec`` (even
    splits, as ``dtp.shard`` checks), without the tensor.

    Raises: ``ValueError`` when ``spec`` splits the ZeRO ``axis`` itself.

    >>> leaf("w", dtp.make_mesh(dp=1), P(), (4, 3), torch.float32, "dp").local_shape
    (4, 3)
    """
    if axis in spec.used_axes():
        raise ValueError(f"param {path}: spec {spec} splits the ZeRO axis {axis!r}; ZeRO shards "
                         f"the optimizer over it itself — keep parameters replicated over {axis!r}")
    sizes = axis_sizes(mesh)
    local = tuple(n // math.prod(sizes[a] for a in spec.axes_of(d)) for d, n in enumerate(shape))
    return Leaf(path, mesh, spec, tuple(shape), local, dtype)


@dataclass(frozen=True)
class Bucket:
    """A contiguous flat buffer of parameters; ``numel`` is padded to divide by dp."""

    index: int
    members: tuple[int, ...]  # leaf indices in buffer order (= first use)
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    spec: P  # spec of the flat slices (dp and whatever splits the members)
    paths: tuple[str, ...]
    dp: int
    last_use: int  # position of the bucket's last read in the first step's forward

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp


@dataclass(frozen=True)
class ZeroPlan:
    """Buckets and use order, fixed in the first step (or at a sharded load)."""

    axis: str
    mesh: DeviceMesh
    buckets: tuple[Bucket, ...]
    where: tuple[tuple[int, int], ...]  # leaf -> (bucket, offset)
    use_order: tuple[str, ...]  # parameter paths in the order forward first read them


def make_plan(leaves: Sequence[Leaf], options: ZeroOptions, used: Sequence[int]) -> ZeroPlan:
    """Buckets in first-use order (``used``: leaf indices as the forward read them,
    repeats included), one open bucket per (dtype, sharded axes); leaves never read go
    last.

    >>> from dtp.layouts.zero import ZeroOptions
    >>> mesh = dtp.make_mesh(dp=1)
    >>> ws = [leaf(n, mesh, P(), (2, 3), torch.float32, "dp") for n in ("a", "b")]
    >>> p = make_plan(ws, ZeroOptions(stage=3), used=[1, 0])
    >>> p.use_order, [b.numel for b in p.buckets], local_parts(p, ws), flat_global(p.buckets[0], mesh)
    (('b', 'a'), [12], [(0, 6, 0, 6), (0, 0, 0, 6)], (12,))
    """
    mesh = leaves[0].mesh
    names, sizes = axis_names(mesh), axis_sizes(mesh)
    axis, dp = options.axis, sizes[options.axis]
    seen = set(used)
    order = list(dict.fromkeys(used)) + [i for i in range(len(leaves)) if i not in seen]
    ordered = [leaves[i] for i in order]
    groups = [(key, [order[k] for k in members]) for key, members in bucket_groups(
        [(x.dtype, tuple(a for a in names if a in set(x.spec.used_axes()))) for x in ordered],
        [x.numel for x in ordered], [x.dtype.itemsize for x in ordered], options.bucket_mb)]
    last_read = {i: pos for pos, i in enumerate(used)}
    buckets, where = [], [(-1, -1)] * len(leaves)
    for index, ((dtype, axes), members) in enumerate(groups):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            where[i] = (index, total)
            total += leaves[i].numel
        padded = padded_numel(total, dp)
        spec = P(tuple(a for a in names if a in set(axes) | {axis}))
        last = max((last_read.get(i, len(used)) for i in members), default=len(used))
        buckets.append(Bucket(index, tuple(members), tuple(offsets), padded, dtype, spec,
                              tuple(leaves[i].path for i in members), dp, last))
    return ZeroPlan(axis, mesh, tuple(buckets), tuple(where), tuple(leaves[i].path for i in order))


def local_parts(p: ZeroPlan, leaves: Sequence[Leaf]) -> list[tuple[int, int, int, int]]:
    """Where each parameter lies in this rank's bucket slices: per leaf ``(bucket, first
    element in the slice, first and stop element in the parameter's flat local shard)``;
    an empty range when none of it is here."""
    r = coordinates(p.mesh)[p.axis]
    out: list[tuple[int, int, int, int]] = [(0, 0, 0, 0)] * len(leaves)
    for b in p.buckets:
        lo, hi = r * b.shard_numel, (r + 1) * b.shard_numel
        for i, off in zip(b.members, b.offsets):
            start, stop = max(off, lo), min(off + leaves[i].numel, hi)
            out[i] = (b.index, start - lo, start - off, max(start, stop) - off)
    return out


def slice_flags(p: ZeroPlan, leaves: Sequence[Leaf], chosen: Sequence[bool]) -> list[bool | tuple[tuple[int, int], ...]]:
    """Per bucket, where this rank's slice holds the parameters ``chosen`` (one bool per
    leaf; a weight-decay mask): ``True`` when every member of the bucket is chosen,
    ``False`` when none is, else the ``(start, stop)`` element ranges of the slice that
    hold chosen ones (neighbours merged), which may be none on this rank."""
    ranges: list[list[tuple[int, int]]] = [[] for _ in p.buckets]
    for i, (b, first, start, stop) in enumerate(local_parts(p, leaves)):
        if chosen[i] and stop > start:
            here = ranges[b]
            if here and here[-1][1] == first:
                here[-1] = (here[-1][0], first + stop - start)
            else:
                here.append((first, first + stop - start))
    out: list[bool | tuple[tuple[int, int], ...]] = []
    for b in p.buckets:
        picked = {bool(chosen[i]) for i in b.members}
        out.append(picked.pop() if len(picked) == 1 else tuple(sorted(ranges[b.index])))
    return out


def flat_global(b: Bucket, mesh: DeviceMesh) -> tuple[int]:
    """The global shape of bucket ``b``'s flat slices as one DTensor (every rank's slice)."""
    sizes = axis_sizes(mesh)
    return (b.shard_numel * math.prod(sizes[a] for a in b.spec.axes_of(0)),)


def slice_of(p: ZeroPlan, b: Bucket, flat: torch.Tensor) -> torch.Tensor:
    """This rank's slice of bucket ``b``'s whole flat buffer ``flat``."""
    r = coordinates(p.mesh)[p.axis]
    return flat[r * b.shard_numel:(r + 1) * b.shard_numel]


def boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` as rectangles
    ``(offsets, sizes)`` in order, each a contiguous run of the flat order.

    >>> boxes((3, 4), 2, 9)        # the end of row 0, row 1, the start of row 2
    [((0, 2), (1, 2)), ((1, 0), (1, 4)), ((2, 0), (1, 1))]
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)
    rest = tuple(shape[1:])

    def row(r: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((r, *o), (1, *z)) for o, z in boxes(rest, a, b)]

    if r0 == r1:
        return row(r0, c0, c1)
    out = []
    if c0:
        out += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0, *(0,) * len(rest)), (r1 - r0, *rest)))
    if c1:
        out += row(r1, 0, c1)
    return out


def param_slice(master: DTensor, b: Bucket) -> torch.Tensor:
    """This rank's slice of a bucket in the parameters' dtype (from the master slice).

    >>> mesh = dtp.make_mesh(dp=1)
    >>> plan = make_plan([Leaf("w", mesh, P(), (2,), (2,), torch.bfloat16)], ZeroOptions(stage=3), [0])
    >>> param_slice(dtp.shard(torch.ones(2), mesh, P("dp")), plan.buckets[0]).dtype
    torch.bfloat16
    """
    return master.to_local().to(b.dtype)


def gather_bucket(plan: ZeroPlan, b: Bucket, piece: torch.Tensor, *, async_op: bool, tag: str,
                  out: torch.Tensor | None = None) -> Any:
    """All-gather bucket ``b`` from this rank's slice ``piece`` (into ``out`` if given);
    with ``async_op`` a :class:`dtp.comm.CommHandle`.

    >>> mesh = dtp.make_mesh(dp=1)
    >>> plan = make_plan([Leaf("w", mesh, P(), (2,), (2,), torch.float32)], ZeroOptions(stage=3), [0])
    >>> gather_bucket(plan, plan.buckets[0], torch.ones(2), async_op=False, tag="read").tolist()
    [1.0, 1.0]
    """
    out = piece.new_empty(b.numel) if out is None else out
    return comm.all_gather(piece, plan.mesh, plan.axis, out=out, async_op=async_op, tag=f"{tag} bucket {b.index}")


def check_same_plan(plan: ZeroPlan, device: torch.device) -> None:
    """Every dp rank must have read the parameters in the same order (so built the same
    buckets); a data-dependent forward could differ. One tiny all-reduce, in step one
    (none over a dp axis of one).

    >>> mesh = dtp.make_mesh(dp=1)
    >>> check_same_plan(make_plan([Leaf("w", mesh, P(), (2,), (2,), torch.float32)], ZeroOptions(stage=3), [0]),
    ...                 torch.device("cpu"))
    """
    digest = hashlib.sha256(repr((plan.use_order, [b.numel for b in plan.buckets])).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:6], "big"), -int.from_bytes(digest[:6], "big")],
                        dtype=torch.float64, device=device)
    both = comm.all_reduce(mine, plan.mesh, plan.axis, op="max", tag="zero plan check")
    if both[0] != -both[1]:
        raise ValueError(
            f"ZeRO: ranks on {plan.axis!r} read the parameters in different orders in the first step "
            f"(this rank: {list(plan.use_order)[:6]}…), so their buckets would not line up; the forward "
            f"must read every parameter in the same order on every rank")


def bytes_per_parameter(param_bytes: int, dp: int, *, master: bool) -> float:
    """Megatron's distributed-optimizer memory per parameter with Adam (bytes): the
    parameter and its gradient buffer stay whole, fp32 master weights and both moments
    are split over ``dp`` — 6 + 12/dp for bf16 parameters with fp32 master weights.

    >>> bytes_per_parameter(2, 8, master=True)
    7.5
    """
    if master:  # low-precision params: fp32 gradient buffer, fp32 master + two fp32 moments
        grad, sharded = 4, 4 + 8
    else:  # fp32/fp64 params are their own master weights; moments in the params' dtype
        grad, sharded = param_bytes, 2 * param_bytes
    return param_bytes + grad + sharded / dp
