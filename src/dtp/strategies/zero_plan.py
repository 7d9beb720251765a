"""ZeRO's bucket geometry, fixed in the first step: which parameter lies where in which
flat bucket (:class:`Leaf`, :class:`Bucket`, :class:`ZeroPlan`, :func:`make_plan`), the
ranks' agreement on it, and the per-bucket slice / gather helpers
:mod:`dtp.strategies.zero` runs the step with."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import comm
from ..layouts.zero import ZeroOptions, bucket_groups, padded_numel
from ..mesh import axis_names, axis_sizes, coordinates
from ..spec import P

__all__ = ["Leaf", "Bucket", "ZeroPlan", "make_plan", "check_same_plan", "flat_global", "slice_of", "param_slice",
           "gather_bucket"]


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
    """Buckets and use order, fixed in the first step."""

    axis: str
    mesh: DeviceMesh
    buckets: tuple[Bucket, ...]
    where: tuple[tuple[int, int], ...]  # leaf -> (bucket, offset)
    use_order: tuple[str, ...]  # parameter paths in the order forward first read them


def make_plan(leaves: Sequence[Leaf], options: ZeroOptions, used: Sequence[int]) -> ZeroPlan:
    """Buckets in first-use order (``used``: the leaf indices forward read, in order),
    one open bucket per (dtype, sharded axes).

    >>> mesh = make_mesh(dp=1)
    >>> leaves = [Leaf("w", mesh, P(), (4, 3), (4, 3), torch.float32), Leaf("b", mesh, P(), (3,), (3,), torch.float32)]
    >>> plan = make_plan(leaves, ZeroOptions(stage=3), used=[1, 0])
    >>> [(b.members, b.offsets, b.numel) for b in plan.buckets], plan.use_order
    ([((1, 0), (0, 3), 15)], ('b', 'w'))
    """
    all_leaves = leaves
    mesh = all_leaves[0].mesh
    names, sizes = axis_names(mesh), axis_sizes(mesh)
    axis, dp = options.axis, sizes[options.axis]
    order = list(dict.fromkeys(used)) + [i for i in range(len(all_leaves)) if i not in set(used)]
    leaves = [all_leaves[i] for i in order]
    groups = [(key, [order[k] for k in members]) for key, members in bucket_groups(
        [(leaf.dtype, tuple(a for a in names if a in set(leaf.spec.used_axes()))) for leaf in leaves],
        [leaf.numel for leaf in leaves], [leaf.dtype.itemsize for leaf in leaves], options.bucket_mb)]
    last_read = {i: pos for pos, i in enumerate(used)}
    buckets, where = [], [(-1, -1)] * len(all_leaves)
    for index, ((dtype, axes), members) in enumerate(groups):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            where[i] = (index, total)
            total += all_leaves[i].numel
        padded = padded_numel(total, dp)
        spec = P(tuple(a for a in names if a in set(axes) | {axis}))
        last = max((last_read.get(i, len(used)) for i in members), default=len(used))
        buckets.append(Bucket(index, tuple(members), tuple(offsets), padded, dtype, spec,
                              tuple(all_leaves[i].path for i in members), dp, last))
    return ZeroPlan(axis, mesh, tuple(buckets), tuple(where), tuple(all_leaves[i].path for i in order))


def flat_global(b: Bucket, mesh: DeviceMesh) -> tuple[int]:
    """The global shape of bucket ``b``'s flat slices as a DTensor on ``mesh``.

    >>> mesh = make_mesh(dp=1)
    >>> plan = make_plan([Leaf("w", mesh, P(), (4, 3), (4, 3), torch.float32)], ZeroOptions(stage=3), [0])
    >>> flat_global(plan.buckets[0], mesh)
    (12,)
    """
    sizes = axis_sizes(mesh)
    return (b.shard_numel * math.prod(sizes[a] for a in b.spec.axes_of(0)),)


def slice_of(plan: ZeroPlan, b: Bucket, flat: torch.Tensor) -> torch.Tensor:
    """This rank's dp slice of a whole flat bucket ``flat``.

    >>> mesh = make_mesh(dp=1)
    >>> plan = make_plan([Leaf("w", mesh, P(), (2,), (2,), torch.float32)], ZeroOptions(stage=3), [0])
    >>> slice_of(plan, plan.buckets[0], torch.arange(2.0)).tolist()
    [0.0, 1.0]
    """
    r = coordinates(plan.mesh)[plan.axis]
    return flat[r * b.shard_numel:(r + 1) * b.shard_numel]


def param_slice(master: DTensor, b: Bucket) -> torch.Tensor:
    """This rank's slice of a bucket in the parameters' dtype (from the master slice).

    >>> mesh = make_mesh(dp=1)
    >>> plan = make_plan([Leaf("w", mesh, P(), (2,), (2,), torch.bfloat16)], ZeroOptions(stage=3), [0])
    >>> param_slice(dtp.shard(torch.ones(2), mesh, P("dp")), plan.buckets[0]).dtype
    torch.bfloat16
    """
    return master.to_local().to(b.dtype)


def gather_bucket(plan: ZeroPlan, b: Bucket, piece: torch.Tensor, *, async_op: bool, tag: str,
                  out: torch.Tensor | None = None) -> Any:
    """All-gather bucket ``b`` from this rank's slice ``piece`` (into ``out`` if given);
    with ``async_op`` a :class:`dtp.comm.CommHandle`.

    >>> mesh = make_mesh(dp=1)
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

    >>> mesh = make_mesh(dp=1)
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
