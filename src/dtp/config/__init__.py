"""``dtp.RunConfig``: one typed, frozen, torch-free description of a training run.

The model, the mesh, every strategy option, the data, the output: what ``dtp train``'s
flags say, once. The CLI fills it (flags, or ``--config run.toml`` with flags on top), the
launcher ships it to the ranks as TOML (not re-spelled as argv), the plan reads it
(``dtp.plan(config)``), the run directory and every checkpoint record it, and the layout
and the mesh derive from it here, in one place (:meth:`RunConfig.layout`,
:meth:`RunConfig.mesh_axes`).

A field is named like its flag (``cp_window`` is ``--cp-window``), so one table serves
both: :func:`flag_names` makes the checks below say ``--cp-window`` to a shell user and
``cp_window`` to a Python one. Rules that need the model or the mesh are the layouts' and
the model's (``dtp.cli.flags.preflight`` asks them before any rank starts).

>>> cfg = RunConfig(dp=2, tp=2, sp=True, steps=10)
>>> cfg.mesh_axes(), cfg.world_size, cfg.warmup
({'dp': 2, 'tp': 2}, 4, 5)
>>> cfg.layout().name
'data + megatron(sequence_parallel=True)'
>>> RunConfig(batch=6, dp=4)
Traceback (most recent call last):
...
ValueError: RunConfig: batch 6 must be divisible by dp × microbatches = 4 × 1: every rank gets equal microbatches

Modules: :mod:`.fields` (what a field is made of; the constants; field or flag names in
messages), :mod:`.run` (:class:`RunConfig`: its fields, checks and derived layout / mesh),
:mod:`.toml` (a run as TOML, a table per section).
"""

from __future__ import annotations

from .fields import (CONTEXT_FIELDS, DEFAULT_MAX_SKIPPED, DEFAULT_TIMEOUT, DEFAULT_WARMUP, DTYPES, EVAL_BATCHES, MODEL_FIELDS,
                     RECOMPUTE, SECTIONS, flag_names, flag_of, master_weights, mesh_axes_of)
from .run import RunConfig, type_error
from .toml import section_of, to_toml, toml_fields

__all__ = ["RunConfig", "DTYPES", "RECOMPUTE", "CONTEXT_FIELDS", "MODEL_FIELDS", "SECTIONS", "EVAL_BATCHES", "DEFAULT_WARMUP",
           "DEFAULT_MAX_SKIPPED", "DEFAULT_TIMEOUT", "flag_names", "flag_of", "section_of", "to_toml",
           "toml_fields", "mesh_axes_of", "master_weights", "type_error"]
