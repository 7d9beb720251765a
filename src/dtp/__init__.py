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
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import TYPE_CHECKING, Any, Sequence



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
_SUBMODULES = {"comm": ".core.comm", "layouts": ".layouts", "ops": ".ops", "optim": ".training.optim",
               "schedules": ".schedules", "strategies": ".training.strategies", "checkpoint": ".checkpoint"}
# Public name -> the module that defines it (a submodule itself when the name is one).
_SOURCES: dict[str, str] = {
    **_SUBMODULES,
    "CommLog": ".core.comm", "CommRecord": ".core.comm", "comm_log": ".core.comm",
    "Layout": ".layouts", "constrain": ".layouts", "use_layout": ".layouts",
    "detect_device": ".core.mesh.devices", "flatten_axes": ".core.mesh.devices", "make_mesh": ".core.mesh.devices",
    "Layer": ".models.sequential", "Sequential": ".models.sequential",
    "from_local": ".core.redistribute", "local_map": ".core.redistribute", "reshard": ".core.redistribute",
    "P": ".core.spec", "shard": ".core.spec", "spec_of": ".core.spec",
    "TrainState": ".training.state", "gather_params": ".training.state", "wait": ".training.state",
    "shard_batch": ".training.step", "train_step": ".training.step",
    "zero": ".training.strategies", "visualize": ".core.visualization", "plan": ".planning", "RunConfig": ".config",
    "with_buffers": ".training.buffers", "CompileOptions": ".core.compiled",
}

# Where the modules of dtp 0.1's flat tree live now (dtp.mesh is dtp.core.mesh.devices):
# ``import dtp.mesh`` and ``from dtp.step import ...`` go on working, and give the module
# itself, not a copy (one module object: a monkeypatch or an isinstance sees the same).
# A package moved whole takes its submodules along (dtp.comm.link).
MOVED = {
    "dtp.comm": "dtp.core.comm", "dtp.optim": "dtp.training.optim",
    "dtp.spec": "dtp.core.spec", "dtp.redistribute": "dtp.core.redistribute",
    "dtp.visualization": "dtp.core.visualization", "dtp.mesh": "dtp.core.mesh.devices",
    "dtp.launch": "dtp.core.mesh.launch", "dtp.state": "dtp.training.state", "dtp.step": "dtp.training.step",
    "dtp.buffers": "dtp.training.buffers", "dtp.guard": "dtp.training.guard",
    "dtp.compiled": "dtp.core.compiled", "dtp.leafwise": "dtp.training.leafwise",
    "dtp.plot": "dtp.training.plot", "dtp.hf_state": "dtp.training.hf_state", "dtp.strategies": "dtp.training.strategies",
    "dtp.models.hf_config": "dtp.models.hf.config",
}


def moved_to(name: str) -> str | None:
    """Where the module ``name`` of the flat tree lives now (``None``: it did not move).

    >>> moved_to("dtp.mesh"), moved_to("dtp.comm.link"), moved_to("dtp.layouts")
    ('dtp.core.mesh.devices', 'dtp.core.comm.link', None)
    """
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return None


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.InspectLoader):
    """Finds a moved module under its old name and hands back the module itself."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if not name.startswith("dtp."):  # every import of the process asks: the cheap answer first
            return None
        new = moved_to(name)
        if new is None or importlib.util.find_spec(new) is None:  # dtp.optim.nope stays not found
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(moved_to(spec.name))  # type: ignore[arg-type]
        spec.loader_state = module.__spec__  # its own, which importlib is about to overwrite
        return module

    def exec_module(self, module: Any) -> None:
        # It ran under its own name already; importlib has just set its __spec__ to the old
        # name's, which would make it another module to reload or run with -m: put it back.
        module.__spec__ = module.__spec__.loader_state

    def get_source(self, fullname: str) -> str | None:  # python -m <old name> runs the module's code
        spec = importlib.util.find_spec(moved_to(fullname))  # type: ignore[arg-type]
        loader = spec.loader if spec is not None else None
        return loader.get_source(spec.name) if isinstance(loader, importlib.abc.InspectLoader) else None


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    # First: after `import dtp.comm` (the package dtp.core.comm under its old name), the path
    # finder would find dtp.comm.link in that package's folder and run link.py a second time,
    # as another module. No old name exists as a module of its own, so nothing else is shadowed.
    sys.meta_path.insert(0, _Moved())


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use (PEP 562) and cache the name here."""
    if name == "__version__":
        # pyproject.toml is its one source, read from the installed distribution's metadata
        # (on first use: the lookup scans sys.path). A source tree on PYTHONPATH that was
        # never installed has no metadata.
        from importlib.metadata import PackageNotFoundError, version

        try:
            globals()[name] = version("dtp")
        except PackageNotFoundError:
            globals()[name] = "0+unknown"
        return globals()[name]
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
    from . import checkpoint, layouts, ops, schedules
    from .core import comm
    from .training import strategies
    from .training import optim
    from .core.comm import CommLog, CommRecord, comm_log
    from .layouts import Layout, constrain, use_layout
    from .core.mesh.devices import detect_device, flatten_axes, make_mesh
    from .models.sequential import Layer, Sequential
    from .core.redistribute import from_local, local_map, reshard
    from .core.spec import P, shard, spec_of
    from .training.state import TrainState, gather_params, wait
    from .training.step import shard_batch, train_step
    from .training.strategies import zero
    from .core.visualization import visualize
    from .planning import plan
    from .config import RunConfig
    from .training.buffers import with_buffers
    from .core.compiled import CompileOptions
