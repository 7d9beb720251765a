"""Layouts: rules from logical axis names to mesh axes (Flax / MaxText style).

Model code names its axes — a weight is ``("embed", "mlp")``, an activation
``("batch", "seq", "embed")`` — and a :class:`Layout` decides where each lives. A layout
knows two mappings, like Levanter's: where **parameters** rest (and where optimizer
state lives) and where **activations** are computed. Presets compose with ``+``::

    layout = layouts.data() + layouts.megatron(sequence_parallel=True)

Each preset keeps its options in a frozen dataclass that checks itself, its mesh and its
batch (an :class:`Option`: :class:`MegatronOptions`, :class:`ContextOptions`,
:class:`ZeroOptions`, :class:`ExpertOptions`, ...); a layout holds them as a collection it
iterates, ``layout.options``, and answers each by its family: ``layout.megatron``,
``layout.context``, ``layout.zero``, ``layout.pipeline``, ``layout.expert`` (``None`` when
unset). A new strategy's option is a new module: subclassing :class:`Option` registers it.

Composition rules:

* a logical axis mapped by several presets is split over all their mesh axes, ordered
  by *mesh order* when resolved (``seq`` on ``cp`` and, with SP, ``tp`` gives
  ``("cp", "tp")`` on a ``dp×cp×tp`` mesh — Megatron's CP-outer, SP-inner split);
* mesh axes the mesh does not have are dropped, so one layout serves every mesh (which
  ones is logged once, logger ``dtp``); except the axis of ``zero``, ``context``,
  ``pipeline`` and ``expert``, which must be on any mesh of more than one device
  (:meth:`Layout.check_mesh`: otherwise the feature would silently be off);
* a logical axis must be a model axis (the table below, :data:`MODEL_AXES`) or named by
  one of the layout's rules: anything else is a ``ValueError`` (a typo would silently
  be replicated). Declare a new one with ``+ Layout({"experts": ()})`` (replicated);
* within one tensor a mesh axis splits at most one dim: the first logical axis that
  claims it wins (later claims are dropped), as in MaxText;
* options: each preset family (megatron, context, zero, pipeline, expert, precision) is
  given once; the same family on both sides with different options is a ``ValueError``
  (their rules would merge, so neither side's options would describe the run).

Logical axes of the reference model:

============  ===================================================================
batch         the batch
seq           sequence where attention / MLP compute happens (cp splits it)
res_seq       sequence in the residual stream: norms, residual adds (cp, and tp with SP)
embed         the model width
heads         query heads (also the flattened heads × head_dim of projections)
kv_heads      key/value heads
mlp           the MLP hidden width
vocab         the vocabulary
head_dim      per-head width (never split)
expert        the experts of an MoE block (replicated unless a layout splits it)
expert_mlp    each expert's hidden width (replicated unless a layout splits it)
router        the router's scores over all experts (never split)
============  ===================================================================

Modules: :mod:`.core` (``Layout``, the active layout), :mod:`.megatron` (``data``,
``megatron``), :mod:`.context` (``context`` and the cp sequence order), :mod:`.zero`,
:mod:`.pipeline` (``pipeline``: stages, schedule, virtual stages), :mod:`.expert` (``expert``:
experts over ``ep``, which is also a data axis), :mod:`.precision` (``mixed_precision``: fp32
master weights and gradient accumulation beside bf16 parameters).
The package attributes ``megatron``, ``context`` and ``zero`` are the preset functions;
import the modules as ``from dtp.layouts.zero import ZeroOptions`` when you need them.
"""

from .context import (
    CP_ALGORITHMS,
    LOAD_BALANCE,
    ContextOptions,
    check_cp,
    check_divisible,
    check_load_balance,
    check_window,
    attended_kv_heads,
    context,
    context_options,
    cp_permutation,
    from_cp_order,
    to_cp_order,
    zigzag_permutation,
)
from .core import MODEL_AXES, Axes, Layout, PlacedBatch, constrain, current, use_layout
from .option import Option
from .expert import ExpertOptions, expert
from .megatron import MegatronOptions, data, megatron
from .pipeline import PipelineOptions, pipeline
from .precision import PRECISIONS, PrecisionOptions, mixed_precision
from .zero import ZERO_STAGES, ZeroOptions, zero

__all__ = [
    "Layout", "data", "megatron", "context", "context_options", "zero", "pipeline", "PipelineOptions", "expert",
    "ExpertOptions", "mixed_precision", "PrecisionOptions", "PRECISIONS", "use_layout", "current", "constrain",
    "MegatronOptions", "ContextOptions", "ZeroOptions", "CP_ALGORITHMS", "LOAD_BALANCE", "ZERO_STAGES",
    "Axes", "MODEL_AXES", "attended_kv_heads", "check_cp", "check_divisible", "check_load_balance", "check_window",
    "zigzag_permutation", "cp_permutation", "to_cp_order", "from_cp_order", "Option", "PlacedBatch",
]
