"""``dtp.RunConfig``: one typed, frozen, torch-free description of a training run.

The model, the mesh, every strategy option, the data, the output: what ``dtp train``'s
flags say, once. The CLI fills it (flags, or ``--config run.toml`` with flags on top), the
launcher ships it to the ranks as JSON (not re-spelled as argv), the plan reads it
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
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator, Mapping

from . import layouts, schedules
from ._mesh_shape import MeshShape
from ._token_files import DTYPES as TOKEN_DTYPES
from .layouts import CP_ALGORITHMS, PRECISIONS, ZERO_STAGES, Layout
from .layouts.zero import misplaced_options
from ._rules import COMPILE_BACKENDS, SCORE_FUNCTIONS

__all__ = ["RunConfig", "DTYPES", "RECOMPUTE", "MODEL_FIELDS", "flag_names", "flag_of", "to_toml", "mesh_axes_of",
           "master_weights", "type_error"]

DTYPES = ("float32", "float64", "bfloat16")
RECOMPUTE = ("none", "full", "selective")
DEFAULT_WARMUP = 5
# The fields that override the model preset's (dtp.models.llama.LlamaConfig fields of the same name).
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


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run (module docstring). Checked when built: ``ValueError`` naming the
    field (or, under :func:`flag_names`, the flag), the values and what would be valid.

    >>> run = RunConfig(dp=2, tp=2, sp=True, zero=1, steps=100)
    >>> run.mesh_axes(), run.layout().zero.stage
    ({'dp': 2, 'tp': 2}, 1)
    >>> RunConfig(tp=0)
    Traceback (most recent call last):
    ...
    ValueError: RunConfig: tp must be >= 1, got 0
    """

    # ---- parallelism: the mesh (pp, dp, ep, cp, tp: outer to inner) and its strategies
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    dp: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    sp: bool = False
    async_tp: bool = False  # SP's all-gathers / reduce-scatters as rings under the matmuls (needs sp)
    cp_algo: str | None = None
    cp_window: int | None = None
    ulysses_degree: int | None = None
    cp_head_chunks: int | None = None
    zero: int = 0
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    reshard_after_forward: bool = True
    zero_prefetch: int = 1
    bucket_mb: float = 40.0
    # ---- model and training
    model: str = "tiny"
    init_from: str | None = None  # a Hugging Face directory: the model (its config.json) and its weights
    steps: int = 50
    batch: int = 8
    seq: int = 64
    dtype: str = "float32"
    precision: str | None = None  # "pure" | "mixed" (fp32 master weights); None: mixed for bfloat16
    lr: float = 3e-3
    weight_decay: float = 0.1  # AdamW's, on the weight matrices and embeddings only (Megatron's rule)
    warmup: int | None = None  # None: min(DEFAULT_WARMUP, steps)
    microbatches: int | None = None  # None: 1 (2 with ep_overlap); under pp, schedules.default_microbatches
    recompute: str = "none"
    compile: str | None = None  # a torch.compile backend (dtp.compiled); None: eager
    clip: float = 1.0  # 0: off
    seed: int = 0
    data: str | None = None  # a token file, a directory of shards, or text; None: the bundled corpus
    data_dtype: str | None = None  # a .bin file's ids, uint16 or uint32; None: its sidecar's, else uint16
    eos_id: int | None = None  # the id that ends a document; None: the token sidecar's, or --tokenizer's EOS
    tokenizer: str | None = None  # a Hugging Face tokenizer.json for text data; None: byte tokens
    document_mask: bool = False  # packed documents: attention and RoPE positions per document (ops.documents)
    max_skipped: int = DEFAULT_MAX_SKIPPED  # 0: never abort
    # ---- mixture of experts (None: the model preset's)
    num_experts: int | None = None
    top_k: int | None = None
    capacity_factor: float | None = None
    aux_loss_coeff: float | None = None  # the load-balancing loss's weight (0: aux-loss-free runs)
    router_score: str | None = None  # softmax (Megatron) | sigmoid (DeepSeek-V3)
    n_groups: int | None = None  # group-limited routing: groups of experts …
    topk_group: int | None = None  # … of which each token picks this many
    routed_scaling_factor: float | None = None  # the k combine weights times it
    router_bias_update: float | None = None  # aux-loss-free balancing's bias step (0: off)
    expert_tp: bool = False
    pipe_experts: bool = False
    multi_data: int = 1
    multi_stream: bool = False
    ep_overlap: bool = False  # one microbatch's expert all-to-alls under another's compute
    # ---- output, checkpoints, failures
    out: str | None = None
    log_every: int = 1
    eval_every: int = 0
    tensorboard: bool = False
    debug: bool = False
    save_every: int = 0
    keep: int = 3
    async_save: bool = False
    resume: bool = False
    timeout: float = DEFAULT_TIMEOUT
    max_restarts: int = 0

    def __post_init__(self) -> None:
        n, who = _NAMES.get(), _WHO.get()

        def fail(message: str) -> None:
            raise ValueError(who + message)

        self._check_types(fail, n)
        if self.warmup is None:
            object.__setattr__(self, "warmup", min(DEFAULT_WARMUP, self.steps))
        elif not 0 <= self.warmup <= self.steps:
            fail(f"{n('warmup')} must lie in [0, {n('steps')}={self.steps}], got {self.warmup}")
        derived = ""
        if self.microbatches is None:  # `--pp 2` alone runs: as many microbatches as keep every stage busy
            piped = self.pp > 1 and self.pp_schedule in schedules.SCHEDULES
            object.__setattr__(self, "microbatches", schedules.default_microbatches(
                self.pp_schedule, self.pp, self.virtual_stages, self.batch, self.dp * self.ep,
                times=2 if self.ep_overlap else 1))
            derived = (f" (the default under {n('pp')} {self.pp} {self.pp_schedule}"
                       f"{' ' + n('ep_overlap') if self.ep_overlap else ''})" if piped else
                       f" (the default with {n('ep_overlap')})" if self.ep_overlap else "")
        if self.batch % (self.dp * self.microbatches):
            fail(f"{n('batch')} {self.batch} must be divisible by {n('dp')} × {n('microbatches')} = "
                 f"{self.dp} × {self.microbatches}{derived}: every rank gets equal microbatches")
        context = {k: getattr(self, k) for k in ("cp_algo", "cp_window", "ulysses_degree", "cp_head_chunks")
                   if getattr(self, k)}
        if self.cp == 1 and context:
            names = [n(k) for k in context]
            fail(f"{' and '.join(names)} {'configure' if len(names) > 1 else 'configures'} context parallel: "
                 f"{'they need' if len(names) > 1 else 'it needs'} {n('cp')} > 1, got {n('cp')} 1")
        # Which ZeRO options need which stage is layouts.zero's rule; here it is phrased by name.
        zero_opts = {"overlap_grad_reduce": "overlap_grad_reduce", "overlap_param_gather": "overlap_param_gather",
                     "prefetch": "zero_prefetch", "reshard_after_forward": "reshard_after_forward"}
        for option, stages, why in misplaced_options(self.zero, **{o: getattr(self, f) for o, f in zero_opts.items()}):
            if stages == (3,):
                fail(f"{n(zero_opts[option])} is a ZeRO-3 option ({why}); it needs {n('zero')} 3")
            fail(f"{n(zero_opts[option])} {why.removeprefix('it ')}; overlap flags need {n('zero')} 1, 2 or 3")
        try:  # the rest (bucket size, prefetch range) as the preset states it
            self._zero_layout()
        except ValueError as e:
            fail(str(e))
        if self.precision is None and self.dtype == "bfloat16":
            # Megatron's --bf16, torchtitan's and autocast's default: pure bf16 loses every
            # update below half an ulp of its weight (lr 3e-3 never moves a norm weight at 1).
            object.__setattr__(self, "precision", "mixed")
        if self.precision == "mixed" and self.dtype != "bfloat16":
            fail(f"{n('precision')} mixed keeps fp32 master weights beside bf16 parameters: it needs {n('dtype')} "
                 f"bfloat16, got {n('dtype')} {self.dtype} (already its own master weights)")
        if self.precision == "pure" and self.zero and self.dtype == "bfloat16":
            fail(f"{n('precision')} pure is not available with {n('zero')} {self.zero}: ZeRO's distributed "
                 f"optimizer keeps fp32 master slices of bf16 parameters (mixed by construction); drop "
                 f"{n('precision')} pure or {n('zero')}")
        if self.sp and self.tp == 1:
            # Sequence parallel splits over the tp group; with a group of one it would be
            # silently off, so say so instead of running something else than was asked.
            fail(f"{n('sp')} (sequence parallel) splits the sequence over the tp group: it needs {n('tp')} > 1, "
                 f"got {n('tp')} 1")
        if self.async_tp and not self.sp:
            fail(f"{n('async_tp')} overlaps sequence parallel's all-gathers / reduce-scatters with the matmuls: "
                 f"it needs {n('tp')} > 1 {n('sp')}")
        if self.ep > 1 and self.batch % (self.dp * self.ep * self.microbatches):
            fail(f"{n('batch')} {self.batch} must be divisible by {n('dp')} × {n('ep')} × {n('microbatches')} = "
                 f"{self.dp} × {self.ep} × {self.microbatches}{derived}: ep is a data axis too")
        self._check_context(fail, n)
        self._check_experts(fail, n)
        self._check_pipeline(fail, n)
        if self.init_from is not None:
            given = [n(k) for k in ("num_experts", "top_k") if getattr(self, k) is not None]
            if self.model != _FIELDS["model"].default:
                given.insert(0, f"{n('model')} {self.model}")
            if given:
                fail(f"{' and '.join(given)} and {n('init_from')} both choose the model: it comes from "
                     f"{n('init_from')}'s config.json; drop {' and '.join(given)}")
        if self.async_save and not self.save_every:
            fail(f"{n('async_save')} needs {n('save_every')} N: there is nothing to save")
        if self.max_restarts and not self.save_every:
            fail(f"{n('max_restarts')} needs {n('save_every')} N: a restart resumes from the newest checkpoint")
        if self.resume and self.out is None:
            fail(f"{n('resume')} continues the run in {n('out')}; name it ({n('out')} runs/…)")
        if self.data_dtype is not None and self.data_dtype not in TOKEN_DTYPES:
            fail(f"{n('data_dtype')} must be one of {', '.join(TOKEN_DTYPES)}; got {self.data_dtype!r}")
        if self.data_dtype is not None and self.tokenizer is not None:
            fail(f"{n('data_dtype')} describes a token file and {n('tokenizer')} tokenizes text: choose one")

    def _check_types(self, fail: Callable[[str], None], n: Callable[[str], str]) -> None:
        for f in fields(self):
            wrong = type_error(f.name, getattr(self, f.name))
            if wrong:
                fail(f"{n(f.name)} {wrong}")
        for name in ("pp", "virtual_stages", "dp", "ep", "cp", "tp", "cp_window", "ulysses_degree", "cp_head_chunks",
                     "zero_prefetch", "steps", "batch", "seq", "microbatches", "top_k", "multi_data", "log_every",
                     "keep", "n_groups", "topk_group"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(f"{n(name)} must be >= 1, got {value}")
        for name in ("lr", "weight_decay", "clip", "max_skipped", "num_experts", "eval_every", "save_every",
                     "max_restarts", "router_bias_update", "aux_loss_coeff", "eos_id"):
            value = getattr(self, name)
            if value is not None and value < 0:
                fail(f"{n(name)} must be >= 0, got {value}")
        # torch's generators take seeds in [-2**63, 2**64); the data loader seeds epoch e with
        # seed + e, so a seed below 2**63 leaves room for any number of epochs.
        if not -(2**63) <= self.seed < 2**63:
            fail(f"{n('seed')} must lie in [-2**63, 2**63), got {self.seed}")
        for name in ("bucket_mb", "capacity_factor", "timeout", "routed_scaling_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                fail(f"{n(name)} must be > 0, got {value}")
        for name, choices in (("dtype", DTYPES), ("recompute", RECOMPUTE), ("pp_schedule", schedules.SCHEDULES),
                              ("zero", ZERO_STAGES)):
            if getattr(self, name) not in choices:
                fail(f"{n(name)} must be one of {', '.join(map(str, choices))}; got {getattr(self, name)!r}")
        if self.router_score is not None and self.router_score not in SCORE_FUNCTIONS:
            fail(f"{n('router_score')} must be one of {', '.join(SCORE_FUNCTIONS)}; got {self.router_score!r}")
        if self.compile is not None and self.compile not in COMPILE_BACKENDS:
            fail(f"{n('compile')} must be one of {', '.join(COMPILE_BACKENDS)}; got {self.compile!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            fail(f"{n('precision')} must be one of {', '.join(PRECISIONS)}; got {self.precision!r}")
        if self.cp_algo is not None and self.cp_algo not in CP_ALGORITHMS:
            fail(f"{n('cp_algo')} must be one of {', '.join(CP_ALGORITHMS)}; got {self.cp_algo!r}")

    def _check_context(self, fail: Callable[[str], None], n: Callable[[str], str]) -> None:
        # layouts.context's own rules, said with the fields' names (a shell user reads
        # --cp-window, not "window"); and an option the algorithm would ignore is refused.
        if self.cp == 1:
            return
        algo = self.cp_algo or "ring"
        if algo == "double_ring" and (self.cp_window or 1) == 1:
            fail(f"{n('cp_algo')} double_ring splits the ring into inner rings of {n('cp_window')} ranks: it "
                 f"needs {n('cp_window')} > 1 dividing {n('cp')} (a window of 1 is {n('cp_algo')} ring)")
        if algo == "hybrid" and (self.ulysses_degree or 1) == 1:
            fail(f"{n('cp_algo')} hybrid runs Ulysses in groups of {n('ulysses_degree')} ranks inside a ring: it "
                 f"needs {n('ulysses_degree')} > 1 (a degree of 1 is {n('cp_algo')} ring)")
        if self.cp_window is not None and algo not in ("double_ring", "hybrid"):
            fail(f"{n('cp_window')} sizes the inner rings of {n('cp_algo')} double_ring or hybrid; "
                 f"{n('cp_algo')} {algo} has none")
        if self.ulysses_degree is not None and algo != "hybrid":
            fail(f"{n('ulysses_degree')} sizes the Ulysses groups of {n('cp_algo')} hybrid; "
                 f"{n('cp_algo')} {algo} has none")

    def _check_experts(self, fail: Callable[[str], None], n: Callable[[str], str]) -> None:
        on = [k for k in ("pipe_experts", "multi_data", "multi_stream", "ep_overlap")
              if (getattr(self, k) > 1 if k == "multi_data" else getattr(self, k))]
        if on and self.ep == 1:
            # These schedule the ep all-to-alls (dtp.ops.moe_pipe, strategies.ep_overlap): at
            # ep 1 there are none. (--expert-tp is not among them: it splits the experts over
            # tp whatever the ep degree.)
            names = " and ".join(n(k) for k in on)
            fail(f"{names} {'configure' if len(on) > 1 else 'configures'} the expert-parallel layout: "
                 f"{'they need' if len(on) > 1 else 'it needs'} {n('ep')} > 1, got {n('ep')} 1")
        if not self.pipe_experts and (self.multi_data > 1 or self.multi_stream):
            fail(f"{n('multi_data') if self.multi_data > 1 else n('multi_stream')} splits the pipe-experts "
                 f"schedule; it needs {n('pipe_experts')}")
        if self.multi_stream and not self.sp:
            fail(f"{n('multi_stream')} keeps the ep all-to-alls apart from sequence parallel's tp all-gathers / "
                 f"reduce-scatters; it needs {n('tp')} > 1 {n('sp')}")
        if self.expert_tp and self.tp == 1:
            fail(f"{n('expert_tp')} splits each expert over tp; it needs {n('tp')} > 1")
        if self.ep_overlap:  # layouts.expert's own rules for it, said with the fields' names
            layout = layouts.expert(ep_overlap=True) + (self._zero_layout() if self.zero else Layout())
            if self.pp > 1 and self.pp_schedule in schedules.SCHEDULES:
                layout = layout + layouts.pipeline(self.pp_schedule)
            names = {"ep_overlap": n("ep_overlap"), "pipeline": "a pipeline", "pp_schedule": n("pp_schedule"),
                     "zero12": f"{n('zero')} 1 or 2", "overlap_grad_reduce": n("overlap_grad_reduce"),
                     "microbatches": n("microbatches"), "pp": n("pp")}
            try:
                layout.expert.check_overlap(layout, MeshShape(self.mesh_axes()), self.microbatches, names=names)
            except ValueError as e:
                fail(str(e))

    def _check_pipeline(self, fail: Callable[[str], None], n: Callable[[str], str]) -> None:
        if self.pp == 1 and self.virtual_stages > 1:
            fail(f"{n('virtual_stages')} {self.virtual_stages} is a pipeline option; pipeline options need "
                 f"{n('pp')} > 1")
        if self.pp == 1 and self.pp_schedule != RunConfig.pp_schedule:  # the default says nothing
            fail(f"{n('pp_schedule')} {self.pp_schedule} is a pipeline option; pipeline options need {n('pp')} > 1")
        if self.pp > 1:
            if self.virtual_stages > 1 and self.pp_schedule not in ("interleaved", *schedules.V_SCHEDULES):
                fail(f"{n('virtual_stages')} {self.virtual_stages} needs {n('pp_schedule')} interleaved")
            if self.pp_schedule == "interleaved" and self.virtual_stages == 1:
                # Said with the flag's name: the schedule's own line ("needs v >= 2 virtual
                # chunks", after "--pp 2 --microbatches 1:") named neither the flag nor its fix.
                fail(f"{n('pp_schedule')} interleaved runs {n('virtual_stages')} model chunks per pipeline rank: "
                     f"it needs {n('virtual_stages')} >= 2 (1 chunk per rank is {n('pp_schedule')} 1f1b)")
            # zbv / dualpipev hold two chunks per rank (a V): the default 1 reads as 2.
            v = schedules.chunks_per_rank(self.pp_schedule, self.virtual_stages)
            try:
                schedules.check(self.pp_schedule, p=self.pp, v=v, m=self.microbatches)
            except ValueError as e:
                fail(f"{n('pp')} {self.pp} {n('microbatches')} {self.microbatches}: {e}")

    # ------------------------------------------------------------------ derived, in one place

    def mesh_axes(self) -> dict[str, int]:
        """The mesh to build: the non-trivial axes in order pp, dp, ep, cp, tp (dp always present).

        >>> RunConfig(dp=2, tp=4).mesh_axes()
        {'dp': 2, 'tp': 4}
        """
        return mesh_axes_of(pp=self.pp, dp=self.dp, ep=self.ep, cp=self.cp, tp=self.tp, keep_ep=self.expert_tp)

    @property
    def world_size(self) -> int:
        """Ranks the mesh needs."""
        return math.prod(self.mesh_axes().values())

    def _zero_layout(self) -> Layout:
        return layouts.zero(stage=self.zero, bucket_mb=self.bucket_mb, overlap_grad_reduce=self.overlap_grad_reduce,
                            overlap_param_gather=self.overlap_param_gather,
                            reshard_after_forward=self.reshard_after_forward, prefetch=self.zero_prefetch)

    def layout(self) -> Layout:
        """``data() + megatron(sequence_parallel=sp)`` (+ ``context(...)`` with cp > 1, + ``zero``,
        + ``mixed_precision`` with precision mixed, + ``expert`` with ep > 1 or expert_tp, +
        ``pipeline`` with pp > 1): the options mapped to the presets,
        which check their own. Megatron's rules name ``tp``; on a mesh without it they are
        dropped, so the same layout serves tp = 1.

        >>> RunConfig(cp=2, cp_algo="ulysses").layout().context.algo
        'ulysses'
        """
        layout = layouts.data() + layouts.megatron(sequence_parallel=self.sp, async_tp=self.async_tp)
        if self.cp > 1:
            options = {k: v for k, v in (("algo", self.cp_algo), ("window", self.cp_window),
                                         ("ulysses_degree", self.ulysses_degree),
                                         ("head_chunks", self.cp_head_chunks)) if v is not None}
            layout = layout + layouts.context(**options)
        if self.zero:  # zero 0 is plain data parallel, which the layout already is
            layout = layout + self._zero_layout()
        if self.precision == "mixed":
            layout = layout + layouts.mixed_precision()
        if self.ep > 1 or self.expert_tp:  # expert_tp at ep 1: experts split over tp, none dispatched
            layout = layout + layouts.expert(pipe_experts=self.pipe_experts, multi_data=self.multi_data,
                                             multi_stream=self.multi_stream, tp_axis="tp" if self.expert_tp else None,
                                             ep_overlap=self.ep_overlap)
        if self.pp > 1:
            layout = layout + layouts.pipeline(self.pp_schedule, virtual_stages=self.virtual_stages)
        return layout

    def model_overrides(self) -> dict[str, Any]:
        """The model-config fields the MoE options set (the rest is the preset's).

        >>> RunConfig(num_experts=4).model_overrides()
        {'num_experts': 4}
        """
        return {k: getattr(self, k) for k in MODEL_FIELDS if getattr(self, k) is not None}

    # ------------------------------------------------------------------ reading and writing

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (what the run directory and checkpoints record)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], *, strict: bool = True) -> "RunConfig":
        """Build from a mapping of fields. ``strict=False`` ignores keys that are not fields
        (a run directory's ``config.json`` also holds the vocabulary, the mesh, the command).

        >>> RunConfig.from_dict({"dp": 2, "batch": 4}).dp
        2
        >>> RunConfig.from_dict({"dpp": 2})
        Traceback (most recent call last):
        ...
        ValueError: RunConfig: unknown field 'dpp'; the fields are pp, pp_schedule, ...
        """
        names = [f.name for f in fields(cls)]
        unknown = [k for k in values if k not in names]
        if unknown and strict:
            raise ValueError(f"{_WHO.get()}unknown field {unknown[0]!r}; the fields are {', '.join(names[:2])}, ... "
                             f"({', '.join(names)})")
        return cls(**{k: v for k, v in values.items() if k in names})

    def to_json(self) -> str:
        """One line of JSON (how the launcher ships the configuration to its ranks)."""
        return json.dumps(self.to_dict(), sort_keys=False)

    def argv(self) -> list[str]:
        """The ``dtp train`` flags that state this run, every field spelled out (the command
        a run directory records).

        >>> RunConfig(dp=2).argv()[:9]
        ['train', '--pp', '1', '--pp-schedule', '1f1b', '--virtual-stages', '1', '--dp', '2']
        """
        out = ["train"]
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                if value != (f.name == "reshard_after_forward"):
                    out.append(flag_of(f.name))
            elif value is not None:
                out += [flag_of(f.name), repr(value) if isinstance(value, float) else str(value)]
        return out


def master_weights(precision: str | None, zero: int, dtype: str) -> bool:
    """Whether a run's record says it kept fp32 master weights beside bf16 parameters:
    ``precision`` mixed, or unset under ZeRO. Runs record the resolved value now
    (:class:`RunConfig`: unset is mixed for bfloat16); an unset one is an older record's,
    whose default was mixed under ZeRO only.

    >>> master_weights(None, 1, "bfloat16"), master_weights(None, 0, "bfloat16"), master_weights("mixed", 0, "bfloat16")
    (True, False, True)
    """
    return dtype == "bfloat16" and (precision == "mixed" or (precision is None and zero > 0))


def type_error(name: str, value: Any) -> str | None:
    """What is wrong with ``value``'s type for field ``name`` (``None``: nothing).

    >>> type_error("dp", "two"), type_error("cp_window", None), type_error("sp", 1)
    ("must be an integer, got 'two'", None, 'must be True or False, got 1')
    """
    kind = str(_FIELDS[name].type)
    if value is None and "None" in kind:
        return None
    kind = kind.split(" ")[0]
    if kind == "bool" and not isinstance(value, bool):
        return f"must be True or False, got {value!r}"
    if kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
        return f"must be an integer, got {value!r}"
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))
                            or not math.isfinite(value)):
        return f"must be a finite number, got {value!r}"
    if kind == "str" and not isinstance(value, str):
        return f"must be a string, got {value!r}"
    return None


_FIELDS = {f.name: f for f in fields(RunConfig)}


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


def to_toml(config: RunConfig, *, leave_out: tuple[str, ...] = ()) -> str:
    """``config`` as a TOML document ``dtp train --config`` reads back (``None`` fields and
    those named in ``leave_out`` left out).

    >>> print(to_toml(RunConfig(dp=2, sp=False)).splitlines()[3])
    dp = 2
    >>> "warmup" in to_toml(RunConfig(steps=3), leave_out=("warmup",))
    False
    """
    lines = []
    for key, value in config.to_dict().items():
        if value is None or key in leave_out:
            continue
        lines.append(f"{key} = {json.dumps(value)}")  # JSON's scalars are TOML's: true, 1.5, "s"
    return "\n".join(lines) + "\n"
