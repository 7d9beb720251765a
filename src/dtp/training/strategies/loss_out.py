"""What a ``train_step`` loss function returns: a scalar loss, or ``(loss, aux)``. One check,
shared by the step's microbatch loop and the strategies that run microbatches themselves."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["split"]


def split(out: Any) -> tuple[torch.Tensor, Any]:
    """``(loss, aux)`` of a loss function's result (``aux`` is ``None`` when it returned the
    loss alone); the loss must be a 0-dim tensor that depends on the parameters.

    >>> split(torch.tensor(2.0, requires_grad=True))
    (tensor(2., requires_grad=True), None)
    >>> split((torch.ones(3), {}))
    Traceback (most recent call last):
    ...
    ValueError: train_step: loss_fn must return a scalar loss (the batch mean), got shape (3,); reduce it, e.g. loss.mean()
    """
    if isinstance(out, tuple) and len(out) != 2:  # was "too many values to unpack (expected 2)"
        raise TypeError(f"train_step: loss_fn must return a scalar loss or (loss, aux), got a tuple of {len(out)}; "
                        f"put what goes beside the loss in one aux (a tuple or dict)")
    loss, aux = out if isinstance(out, tuple) else (out, None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"train_step: loss_fn must return a scalar tensor (or (loss, aux)), got "
                        f"{type(loss).__name__}")
    if loss.dim() != 0:
        raise ValueError(f"train_step: loss_fn must return a scalar loss (the batch mean), got shape "
                         f"{tuple(loss.shape)}; reduce it, e.g. loss.mean()")
    if not loss.requires_grad:  # was autograd's "element 0 of tensors does not require grad"
        raise ValueError("train_step: loss_fn returned a loss that does not depend on the parameters (no "
                         "gradient flows to them: detached, computed under no_grad, or from the batch alone)")
    return loss, aux
