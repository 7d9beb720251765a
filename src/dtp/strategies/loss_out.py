"""What a ``train_step`` loss function returns: a scalar loss, or ``(loss, aux)``. One check,
shared by the step's microbatch loop and the strategies that run microbatches themselves."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["split"]


def split(out: Any) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` of a loss function's result (``aux`` is ``None`` when it returned the
    loss alone); the loss must be a 0-dim tensor.

    >>> split(torch.tensor(2.0))
    (tensor(2.), None)
    >>> split((torch.ones(3), {}))
    Traceback (most recent call last):
    ...
    ValueError: train_step: loss_fn must return a scalar loss (the batch mean), got shape (3,); reduce it, e.g. loss.mean()
    """
    loss, aux = out if isinstance(out, tuple) else (out, None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"train_step: loss_fn must return a scalar tensor (or (loss, aux)), got "
                        f"{type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"train_step: loss_fn must return a scalar loss (the batch mean), got shape "
                         f"{tuple(loss.shape)}; reduce it, e.g. loss.mean()")
    return loss, aux
