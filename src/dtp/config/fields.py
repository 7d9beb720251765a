"""What a :class:`~dtp.config.RunConfig` field is made of (its doc, section, bounds,
choices: :func:`_field`), the constants the fields use, and how a check names a field: by
itself (Python) or by its ``dtp train`` flag (:func:`flag_names`)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

__all__ = ["DTYPES", "RECOMPUTE", "SAVE_SIGNALS", "CONTEXT_FIELDS", "MODEL_FIELDS", "SECTIONS", "EVAL_BATCHES", "DEFAULT_WARMUP",
           "DEFAULT_MAX_SKIPPED", "DEFAULT_TIMEOUT", "flag_names", "flag_of", "mesh_axes_of", "master_weights"]

DTYPES = ("float32", "float64", "bfloat16")
RECOMPUTE = ("none", "full", "selective")
# --save-on-signal: what schedulers send before they kill (SLURM's --signal, Kubernetes' and
# SLURM's SIGTERM at the end, Ctrl-C's SIGINT). Not SIGQUIT (a core dump's) nor SIGKILL (uncatchable).
SAVE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGINT")
DEFAULT_WARMUP = 5
# The fields that override the model preset's (dtp.models.llama.LlamaConfig fields of the same name).
# layouts.context's options and the RunConfig fields that set them (--cp-window is window).
CONTEXT_FIELDS = {"algo": "cp_algo", "window": "cp_window", "ulysses_degree": "ulysses_degree",
                  "head_chunks": "cp_head_chunks"}
MODEL_FIELDS = ("num_experts", "top_k", "capacity_factor", "aux_loss_coeff", "router_score", "n_groups", "topk_group",
                "routed_scaling_factor", "router_bias_update")
# Ten in a row is no bad batch any more but a diverged run: stop it rather than burn the
# remaining steps on updates that are all skipped.
DEFAULT_MAX_SKIPPED = 10
# timeout: torch's gloo default (30 min) leaves a stalled job hanging half an hour. A
# collective waits only for its slowest peer to post it, not for a whole step: the longest
# wait in any collective of `dtp train --nproc 4 --dp 2 --tp 2 --sp --model small --seq 256`
# (20 steps, 4 ranks on 2 loaded cores) was 0.25 s, the first one (model init skew) 0.20 s.
# 300 s leaves three orders of magnitude for larger models and slower machines, and still
# turns a hang into an error within 5 minutes. A dead peer is noticed at once regardless.
DEFAULT_TIMEOUT = 300.0

# --eval-every: the held-out split is the corpus's last tenth (dtp.data.token_files.training_split), and
# each evaluation averages the loss of its first EVAL_BATCHES batches: the same tokens every
# time, so the curve compares step with step.
EVAL_BATCHES = 4

#: The sections a run's fields fall in: ``dtp train --help``'s groups (with these titles) and
#: the tables of a ``--config`` TOML file (with these names), in this order.
SECTIONS = {
    "parallelism": "parallelism (the mesh: pp, dp, ep, cp, tp, outer to inner; and the strategies over it)",
    "model": "model",
    "training": "training",
    "data": "data",
    "moe": "mixture of experts (or --model tiny-moe)",
    "checkpoint": "checkpoints (in <out>/checkpoints; any parallel flags can resume any others)",
    "run": "run (output, failures)",
}


def _field(default: Any, doc: str, section: str, *, low: float | None = None, above: float | None = None,
           choices: tuple[Any, ...] | None = None, metavar: str | None = None, bare: Any = None) -> Any:
    """A :class:`RunConfig` field and what its flag is made of: its ``doc`` (the flag's help),
    its ``section``, the bounds (``>= low``, ``> above``) and ``choices`` the config checks
    and the flag's parser checks too, a ``metavar``, and ``bare``: the value of the flag given
    alone (``--compile``)."""
    assert section in SECTIONS, section
    return dataclasses.field(default=default, metadata={"doc": doc, "section": section, "low": low, "above": above,
                                                        "choices": choices, "metavar": metavar, "bare": bare})


# How a check names a field: the field itself (Python), or its flag (dtp train).
_NAMES: contextvars.ContextVar[Callable[[str], str]] = contextvars.ContextVar("dtp_config_names",
                                                                              default=lambda name: name)
_WHO: contextvars.ContextVar[str] = contextvars.ContextVar("dtp_config_who", default="RunConfig: ")


def flag_of(name: str) -> str:
    """The ``dtp train`` flag of a field (the one on/off flag that turns a default off is ``--no-…``).

    >>> flag_of("cp_window"), flag_of("reshard_after_forward")
    ('--cp-window', '--no-reshard-after-forward')
    """
    flag = "--" + name.replace("_", "-")
    return "--no-reshard-after-forward" if name == "reshard_after_forward" else flag


@contextlib.contextmanager
def flag_names() -> Iterator[None]:
    """Within, :class:`RunConfig`'s errors name flags (``--cp-window``) instead of fields,
    with no prefix: the CLI's one-line errors.

    >>> from dtp.config import RunConfig
    >>> with flag_names():
    ...     RunConfig(sp=True)
    Traceback (most recent call last):
    ...
    ValueError: --sp (sequence parallel) splits the sequence over the tp group: it needs --tp > 1, got --tp 1
    """
    names, who = _NAMES.set(flag_of), _WHO.set("")
    try:
        yield
    finally:
        _NAMES.reset(names)
        _WHO.reset(who)


def master_weights(precision: str | None, zero: int, dtype: str) -> bool:
    """Whether a run's record says it kept fp32 master weights beside bf16 parameters:
    ``precision`` mixed, or unset under ZeRO. Runs record the resolved value now
    (:class:`RunConfig`: unset is mixed for bfloat16); an unset one is an older record's,
    whose default was mixed under ZeRO only.

    >>> master_weights(None, 1, "bfloat16"), master_weights(None, 0, "bfloat16"), master_weights("mixed", 0, "bfloat16")
    (True, False, True)
    """
    return dtype == "bfloat16" and (precision == "mixed" or (precision is None and zero > 0))


def mesh_axes_of(*, pp: int, dp: int, ep: int, cp: int, tp: int, keep_ep: bool = False) -> dict[str, int]:
    """The mesh of these degrees: the non-trivial axes in order pp, dp, ep, cp, tp, dp always;
    ``keep_ep``: ep even at 1 (``--expert-tp`` at ``--ep 1``: ``layouts.expert`` names it).

    >>> mesh_axes_of(pp=2, dp=1, ep=1, cp=1, tp=2)
    {'pp': 2, 'dp': 1, 'tp': 2}
    >>> mesh_axes_of(pp=1, dp=2, ep=1, cp=1, tp=2, keep_ep=True)
    {'dp': 2, 'ep': 1, 'tp': 2}
    """
    axes = {"pp": pp} if pp > 1 else {}
    axes["dp"] = dp
    axes.update({name: n for name, n in (("ep", ep), ("cp", cp), ("tp", tp)) if n > 1 or (name == "ep" and keep_ep)})
    return axes
