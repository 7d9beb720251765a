"""A script of ``benchmarks/`` loaded as a module by its path (benchmarks/ is no package).

Loaded once per name and kept in ``sys.modules``; ``by_value`` registers it with cloudpickle,
so functions of it travel to the rank pool's ranks, which cannot import it by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(script: str, *, by_value: bool = False) -> ModuleType:
    """``benchmarks/<script>.py`` as module ``benchmarks_<script>``."""
    name = f"benchmarks_{script}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        if by_value:
            import cloudpickle

            cloudpickle.register_pickle_by_value(module)
    return sys.modules[name]
