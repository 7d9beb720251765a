"""dtp — Megatron-LM / MindSpeed training-parallel strategies on PyTorch DTensor.

Every parallel strategy is a set of placements on a named device mesh plus
redistribution rules; training is a pure function ``train_step(loss_fn, state, batch)``.
This module only re-exports the public surface.

The re-exports are lazy (PEP 562): ``import dtp`` imports nothing heavy, and the first
``dtp.make_mesh`` (or any other name below) imports the module that defines it. That is
what lets ``dtp train`` parse and check its flags before torch is imported, so a bad
argument answers at once instead of after torch's start-up.

>>> import dtp
>>> dtp.make_mesh is dtp.mesh.make_mesh, callable(dtp.visualize)
(True, True)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "P", "make_mesh", "detect_device", "flatten_axes",
    "shard", "from_local", "local_map", "spec_of", "reshard", "visualize",
    "comm_log", "CommLog", "CommRecord",
    "Layout", "layouts", "use_layout", "constrain", "ops", "optim", "strategies", "zero", "comm", "schedules",
    "TrainState", "train_step", "shard_batch", "gather_params", "wait", "checkpoint", "Layer", "Sequential", "plan",
    "RunConfig", "with_buffers", "CompileOptions",
]

# Public names that are submodules. (``dtp.visualize`` is a function: its module is
# ``visualization``, so that importing it, as unpickling a reference to it in a rank does,
# cannot shadow the function with a module of the same name.)
_SUBMODULES = ("comm", "layouts", "ops", "optim", "schedules", "strategies", "checkpoint")
# Public name -> the module that defines it (a submodule itself when the name is one).
_SOURCES: dict[str, str] = {
    **{m: f".{m}" for m in _SUBMODULES},
    "CommLog": ".comm", "CommRecord": ".comm", "comm_log": ".comm",
    "Layout": ".layouts", "constrain": ".layouts", "use_layout": ".layouts",
    "detect_device": ".mesh", "flatten_axes": ".mesh", "make_mesh": ".mesh",
    "Layer": ".models.sequential", "Sequential": ".models.sequential",
    "from_local": ".redistribute", "local_map": ".redistribute", "reshard": ".redistribute",
    "P": ".spec", "shard": ".spec", "spec_of": ".spec",
    "TrainState": ".state", "gather_params": ".state", "wait": ".state", "shard_batch": ".step", "train_step": ".step",
    "zero": ".strategies", "visualize": ".visualization", "plan": ".planning", "RunConfig": ".config",
    "with_buffers": ".buffers", "CompileOptions": ".compiled",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562) and cache the name here."""
    source = _SOURCES.get(name)
    if source is None:
        # Any other submodule (dtp.mesh, dtp.step, dtp.testing, ...): the eager imports of
        # before made them attributes of the package as a side effect; keep that working.
        if name.startswith("__") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'dtp' has no attribute {name!r}")
        source = f".{name}"
    module = importlib.import_module(source, __name__)
    value = module if name in _SUBMODULES or name not in _SOURCES else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports of before
    from . import checkpoint, comm, layouts, ops, optim, schedules, strategies
    from .comm import CommLog, CommRecord, comm_log
    from .layouts import Layout, constrain, use_layout
    from .mesh import detect_device, flatten_axes, make_mesh
    from .models.sequential import Layer, Sequential
    from .redistribute import from_local, local_map, reshard
    from .spec import P, shard, spec_of
    from .state import TrainState, gather_params, wait
    from .step import shard_batch, train_step
    from .strategies import zero
    from .visualization import visualize
    from .planning import plan
    from .config import RunConfig
    from .buffers import with_buffers
    from .compiled import CompileOptions
