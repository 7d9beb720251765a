"""A rank's part of a parameter as rectangles of its global shape, in the form
torch.distributed.checkpoint writes and reads: what ZeRO's flat bucket slices hold, each
parameter's part of a slice cut into boxes of the parameter's layout. What
:meth:`dtp.strategies.zero.ZeroState.saved` hands a checkpoint (:func:`saved_slices`), so
no rank gathers a parameter or a moment to save it (Megatron's "flattened range", made
rectangular); and the way back, the slices of each parameter's runs (:func:`slices_of`:
``TrainState.from_hf``)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...core._rules import accum_dtype
from ...core._torch import StridedShard, global_offset
from ...core.mesh.devices import mesh_device
from ..optim import map_param_trees
from ...core.spec import to_placements, wrap_local
from .state import save_scalar
from .zero_plan import Leaf, ZeroPlan, boxes, flat_global, local_parts

__all__ = ["Pieces", "zero_pieces", "saved_slices", "slices_of"]


class Pieces:
    """A global tensor of which this rank holds some rectangles (views of its flat
    ZeRO slices). Speaks DCP's ``_Checkpointable`` protocol, as DTensor does, so DCP
    writes and reads each rectangle as a chunk of the one logical tensor."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, pieces: Sequence[tuple[tuple[int, ...], torch.Tensor]]):
        self.shape, self.dtype, self.pieces = torch.Size(shape), dtype, list(pieces)

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for o, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for o, t in self.pieces:
            if torch.Size(o) == index.offset:
                return t
        raise ValueError(f"checkpoint: no piece of {index.fqn} at {tuple(index.offset or ())} on this rank")


def zero_pieces(plan: ZeroPlan, leaves: Sequence[Leaf], slices: Sequence[torch.Tensor], *,
                as_params: bool = False) -> list[Pieces]:
    """Each parameter's part of this rank's flat bucket slices (local tensors), as
    rectangles of the parameter's global shape; ``as_params``: rounded to the
    parameters' dtype (bf16 parameters of fp32 master slices: a copy of the slice)."""
    flats = [s.to(b.dtype) if as_params else s for s, b in zip(slices, plan.buckets)]
    out = []
    for leaf, (bucket, cursor, start, stop) in zip(leaves, local_parts(plan, leaves)):
        flat, base, pieces = flats[bucket], _block_offset(leaf), []
        for o, size in boxes(leaf.local_shape, start, stop):
            n = math.prod(size)
            pieces.append((tuple(a + c for a, c in zip(base, o)), flat[cursor:cursor + n].view(size)))
            cursor += n
        out.append(Pieces(leaf.shape, flat.dtype, pieces))
    return out


def saved_slices(plan: ZeroPlan, leaves: Sequence[Leaf], master: Sequence[DTensor], opt_state: Any
                 ) -> dict[str, Any]:
    """A checkpoint's tensors from this rank's master slices and the optimizer state over
    them: every parameter (``param/``, rounded to its dtype), the master weights where
    they differ (``master/``), the moments (``opt/<field>/``) and scalars (``opt/<field>``)."""
    paths = [leaf.path for leaf in leaves]
    local = [m.to_local() for m in master]
    out: dict[str, Any] = {}
    for path, piece, meta in zip(paths, zero_pieces(plan, leaves, local), leaves):
        if piece.dtype != meta.dtype:  # fp32 master weights of lower-precision parameters
            out[f"master/{path}"] = piece
    for path, piece in zip(paths, zero_pieces(plan, leaves, local, as_params=True)):
        out[f"param/{path}"] = piece

    def mirror(name: str, slices: list[DTensor]) -> list[DTensor]:
        for path, piece in zip(paths, zero_pieces(plan, leaves, [x.to_local() for x in slices])):
            out[f"opt/{name}/{path}"] = piece
        return slices

    map_param_trees(opt_state, list(master), mirror, lambda name, x: save_scalar(out, name, x))
    return out


def slices_of(plan: ZeroPlan, leaves: Sequence[Leaf], parts: Sequence[torch.Tensor], mesh: DeviceMesh
              ) -> tuple[DTensor, ...]:
    """This rank's master slices, one per bucket, filled from each parameter's run of
    elements in them (``parts``, in leaf order: what :func:`~.zero_plan.local_parts`
    places here). No collective."""
    where, master = local_parts(plan, leaves), []
    for b in plan.buckets:
        flat = torch.zeros(b.shard_numel, dtype=accum_dtype(b.dtype), device=mesh_device(mesh))
        for i in b.members:
            _, cursor, start, stop = where[i]
            flat[cursor:cursor + stop - start] = parts[i]
        master.append(wrap_local(flat, mesh, b.spec, flat_global(b, mesh)))
    return tuple(master)


def _block_offset(leaf: Leaf) -> tuple[int, ...]:
    placements = to_placements(leaf.spec, leaf.mesh)
    if any(isinstance(p, StridedShard) for p in placements):
        # Its block is not one rectangle of the global tensor; no dtp layout makes one.
        raise ValueError(f"checkpoint: param {leaf.path} is split over several axes out of mesh order "
                         f"({leaf.spec}); ZeRO checkpoints support one rectangle per rank")
    return global_offset(leaf.shape, leaf.mesh, placements)
