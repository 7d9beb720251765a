"""Activation recomputation policy, set by ``train_step`` and read by the model's blocks.

``"full"`` recomputes each transformer block in backward (only its input is kept);
``"selective"`` recomputes just the attention core (Megatron's selective recompute: the
softmax activations are the big ones). The model calls :func:`remat` around a block and
the attention op asks :func:`policy`; the model itself never branches on it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator

import optree
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ..core.compiled import active, region

__all__ = ["policy", "recompute", "remat", "POLICIES"]

POLICIES = (None, "full", "selective")
_state = threading.local()


def policy() -> str | None:
    """The active recompute policy (``None``, ``"full"`` or ``"selective"``)."""
    return getattr(_state, "policy", None)


@contextlib.contextmanager
def recompute(name: str | None) -> Iterator[None]:
    """Make ``name`` the recompute policy inside the block.

    >>> cfg = llama.config("tiny", n_layers=1)
    >>> batch = {"tokens": torch.zeros(2, 16, dtype=torch.long), "targets": torch.zeros(2, 16, dtype=torch.long)}
    >>> with recompute("full"):
    ...     loss = llama.loss(llama.init(cfg), batch, cfg)
    ...     policy()
    'full'
    """
    if name not in POLICIES:
        raise ValueError(f"recompute must be one of {POLICIES}, got {name!r}")
    previous = policy()
    _state.policy = name
    try:
        yield
    finally:
        _state.policy = previous


def _read(x: Any) -> Any:
    """``x`` with every mapping read into a dict and every list-like sequence into a list,
    recursively (a lazy parameter view is read through); tensors and tuples as they are.

    >>> import types
    >>> _read(types.MappingProxyType({"w": types.MappingProxyType({"b": 1})}))
    {'w': {'b': 1}}
    """
    if isinstance(x, Mapping):
        return {k: _read(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes, tuple)):
        return [_read(v) for v in x]
    return x


def remat(fn: Callable[..., Any], *args: Any, level: str = "full") -> Any:
    """Call ``fn(*args)``, recomputing it in backward when the policy is ``level``.

    A block (``level="full"``) on plain tensors is a compiled region under
    ``train_step(compile=...)`` (:mod:`dtp.compiled`): nothing in it communicates. On
    DTensors the regions are the :func:`dtp.local_map` bodies inside it instead.

    >>> runs = []
    >>> def block(w, x):
    ...     runs.append(1)
    ...     return torch.tanh(x @ w)
    >>> w = torch.randn(4, 4, requires_grad=True)
    >>> with recompute("full"):                      # train_step(..., recompute="full") sets this
    ...     remat(block, w, torch.randn(2, 4)).sum().backward()
    >>> len(runs)                                     # forward, and again in backward
    2
    """
    if level == "full" and active() is not None and not any(isinstance(a, DTensor) for a in optree.tree_leaves(args[:2])):
        # A strategy's lazy parameter view (ZeRO's: a read waits for the bucket's gather and
        # adds an autograd Function) is read just before the region, outside it: traced, it
        # would guard on the bucket's index and the read's shape and recompile each block.
        # Inside what checkpoint re-runs, so a recomputed block reads (re-gathers) again,
        # as in eager, instead of keeping forward's views and their buckets alive.
        compiled = region(fn)

        def fn(*lazy: Any) -> Any:
            return compiled(*(_read(a) for a in lazy))
    if policy() == level:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
