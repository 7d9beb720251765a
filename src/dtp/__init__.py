"""dtp — Megatron-LM / MindSpeed training-parallel strategies on PyTorch DTensor.

Every parallel strategy is a set of placements on a named device mesh plus
redistribution rules; training is a pure function ``train_step(loss_fn, state, batch)``.
This module only re-exports the public surface.
"""

from . import comm, layouts, ops, optim, schedules, strategies
from .comm import CommLog, CommRecord, comm_log
from .layouts import Layout, constrain, use_layout
from .mesh import detect_device, flatten_axes, make_mesh
from .models.sequential import Layer, Sequential
from .redistribute import from_local, local_map, reshard
from .spec import P, shard, spec_of
from .step import TrainState, gather_params, shard_batch, train_step, wait
from . import checkpoint
from .planning import plan
from .strategies import zero
from .visualize import visualize

__version__ = "0.1.0"

__all__ = [
    "P", "make_mesh", "detect_device", "flatten_axes",
    "shard", "from_local", "local_map", "spec_of", "reshard", "visualize",
    "comm_log", "CommLog", "CommRecord",
    "Layout", "layouts", "use_layout", "constrain", "ops", "optim", "strategies", "zero", "comm", "schedules",
    "TrainState", "train_step", "shard_batch", "gather_params", "wait", "checkpoint", "Layer", "Sequential", "plan",
]
