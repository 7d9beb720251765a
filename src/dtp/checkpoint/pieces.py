"""DCP's save and load planners, taught one more kind of tensor: a strategy's
:class:`~dtp.strategies.zero_pieces.Pieces` (a global tensor of which this rank holds some
rectangles), which they write and read chunk by chunk as they do a DTensor's."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from ..training.strategies.zero_pieces import Pieces

__all__ = ["Pieces", "SavePlanner", "LoadPlanner"]


class SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else super().lookup_tensor(index)
