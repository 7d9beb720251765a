"""Small rules several layers share, stated once (the ops, the model, the optimizer and
ZeRO all accumulate; every layer checks counts).

>>> accum_dtype(torch.bfloat16), accum_dtype(torch.float32, torch.float64)
(torch.float32, torch.float64)
>>> is_positive_int(2), is_positive_int(True), is_positive_int(0)
(True, False, False)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

__all__ = ["accum_dtype", "is_positive_int", "STEP_TOLERANCE", "RUN_RTOL", "SCORE_FUNCTIONS", "COMPILE_BACKENDS", "check_groups", "said", "setting",
           "IGNORE_INDEX", "TRAIN_ADAMW", "FLOAT32_MAX"]

#: torch.compile's backends a compiled step (dtp.compiled, ``dtp train --compile``) runs with.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

#: The MoE router's score functions (dtp.ops.moe_router): Megatron's softmax, DeepSeek-V3's sigmoid.
SCORE_FUNCTIONS = ("softmax", "sigmoid")

#: ``dtp train``'s optimizer: :func:`dtp.optim.adamw`'s options (the rank builds it, the
#: preflight checks its step size; b1 sets the bias correction, up to 1 / (1 - b1) = 10×).
TRAIN_ADAMW = {"b1": 0.9, "b2": 0.999}

#: float32's largest finite number (torch.finfo(torch.float32).max), for checks made without torch.
FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127

# A target that is no target (Hugging Face's and torch's ``ignore_index``): the loss skips it
# and it is not counted in the mean; the guard accepts it in ``targets`` (only there).
IGNORE_INDEX = -100

# The correctness bar (DESIGN §4), one table for both of its uses. One step's loss and
# gradients against the single-device run: (rtol, atol) per dtype name (dtp.testing reads
# it as STEP_TOLERANCE, keyed by torch dtype). Names, not dtypes: the CLI reads this module
# before torch is imported (it only needs RUN_RTOL).
_STEP_TOLERANCE: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-12),
    "float32": (1e-5, 1e-6),
    "bfloat16": (2e-2, 1e-2),
    "float16": (5e-3, 1e-3),
}
# A whole run's losses against the single-process run (`dtp train --check`), rtol per
# --dtype name: looser than one step, since rounding differences compound over the steps.
RUN_RTOL: dict[str, float] = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}


def __getattr__(name: str) -> Any:
    """``STEP_TOLERANCE``: :data:`_STEP_TOLERANCE` keyed by torch dtype, built (and torch
    imported) on first use (PEP 562)."""
    if name == "STEP_TOLERANCE":
        import torch

        table = {getattr(torch, k): v for k, v in _STEP_TOLERANCE.items()}
        globals()[name] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def accum_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype sums, softmax statistics, norms and master weights are kept in: fp64 when
    any input is fp64 (the tests prove exactness there), fp32 for everything lower —
    log-sum-exp differences, merged outputs and Adam moments lose too much in bf16/fp16."""
    import torch  # here, not at the top: see _STEP_TOLERANCE (a dict lookup once torch is loaded)

    return torch.float64 if torch.float64 in dtypes else torch.float32


def is_positive_int(value: object) -> bool:
    """An ``int`` >= 1, and not a ``bool`` (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def said(names: Mapping[str, str] | None, key: str) -> str:
    """A field or mesh axis as a message names it: in the caller's words where it has them.

    >>> said(None, "window"), said({"window": "--cp-window"}, "window")
    ('window', '--cp-window')
    """
    return (names or {}).get(key, key)


def setting(names: Mapping[str, str] | None, field: str, *values: object) -> str:
    """A field set to a value (or to one of several), as the API shows it or in the caller's
    words (``None``: a flag not given).

    >>> setting(None, "algo", "ulysses", "ring"), setting({"algo": "--cp-algo"}, "algo", "ring")
    ("algo='ulysses' or 'ring'", '--cp-algo ring')
    """
    if names and field in names:
        return f"{names[field]} " + " or ".join("not given" if v is None else str(v) for v in values)
    return f"{field}=" + " or ".join(repr(v) for v in values)


def check_groups(num_experts: int, top_k: int, n_groups: int | None, topk_group: int | None,
                 what: str = "route", names: Mapping[str, str] | None = None) -> None:
    """Group-limited routing's rules (``ValueError`` naming the option, in ``names``' words
    where given: :func:`said`): both or neither given, ``n_groups`` divides the experts,
    ``topk_group`` in [1, n_groups] and dividing ``top_k``, and the picked groups hold at
    least ``top_k`` experts.

    >>> check_groups(8, 4, 4, 3)
    Traceback (most recent call last):
    ...
    ValueError: route: topk_group=3 must divide top_k=4 (a group scores its top top_k // topk_group)
    """
    n = names
    if (n_groups is None) != (topk_group is None):
        raise ValueError(f"{what}: {said(n, 'n_groups')} and {said(n, 'topk_group')} go together (group-limited "
                         f"routing), got {setting(n, 'n_groups', n_groups)} and {setting(n, 'topk_group', topk_group)}")
    if n_groups is None or topk_group is None:
        return
    if n_groups < 1 or num_experts % n_groups:
        raise ValueError(f"{what}: {setting(n, 'n_groups', n_groups)} must be >= 1 and divide the {num_experts} "
                         f"experts")
    if not 1 <= topk_group <= n_groups:
        raise ValueError(f"{what}: {said(n, 'topk_group')} must be in [1, {setting(n, 'n_groups', n_groups)}], got "
                         f"{topk_group}")
    if top_k % topk_group:
        raise ValueError(f"{what}: {setting(n, 'topk_group', topk_group)} must divide {setting(n, 'top_k', top_k)} "
                         f"(a group scores its top {said(n, 'top_k')} // {said(n, 'topk_group')})")
    if topk_group * (num_experts // n_groups) < top_k:
        raise ValueError(f"{what}: {setting(n, 'topk_group', topk_group)} groups of {num_experts // n_groups} experts "
                         f"hold fewer than {setting(n, 'top_k', top_k)}")
