"""Layouts: rules from logical axis names to mesh axes (Flax / MaxText style); see :mod:`.core`."""

from .core import *  # noqa: F403
from .core import (  # noqa: F401  names outside core's __all__ that other modules import from here
    CONTEXT_ALGORITHMS,
    _check_cp,
    _check_divisible,
    _check_load_balance,
    attended_kv_heads,
    cp_permutation,
    from_cp_order,
    to_cp_order,
    zigzag_permutation,
)
from .core import __all__  # noqa: F401
