"""``dtp.RunConfig``: the run's fields (:mod:`.fields` says what each is made of) and the
checks of their combinations, the layout and the mesh derived from them, and the run as a
dict, JSON and argv."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from .. import layouts, schedules
from ..core.mesh.shape import MeshShape
from ..data.token_files import DTYPES as TOKEN_DTYPES
from ..core._rules import COMPILE_BACKENDS, SCORE_FUNCTIONS
from ..layouts import CP_ALGORITHMS, PRECISIONS, ZERO_STAGES, Layout
from ..layouts.zero import misplaced_options
from ..models import config as model_config
from .fields import (_NAMES, _WHO, CONTEXT_FIELDS, DEFAULT_MAX_SKIPPED, DEFAULT_TIMEOUT, DEFAULT_WARMUP, DTYPES,
                     EVAL_BATCHES, MODEL_FIELDS, RECOMPUTE, SAVE_SIGNALS, _field, flag_of, mesh_axes_of)

__all__ = ["RunConfig", "type_error"]


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
    pp: int = _field(1, "pipeline-parallel degree (outermost mesh axis)", "parallelism", low=1)
    pp_schedule: str = _field("1f1b", "pipeline schedule (with --pp > 1; interleaved needs --virtual-stages >= 2; "
                              "zbv and dualpipev hold two chunks per rank in a V: rank r stages r and 2pp-1-r)",
                              "parallelism", choices=schedules.SCHEDULES)
    virtual_stages: int = _field(1, "model chunks per pipeline rank (interleaved schedule; zbv and dualpipev: 2)",
                                 "parallelism", low=1, metavar="V")
    dp: int = _field(1, "data-parallel degree", "parallelism", low=1)
    ep: int = _field(1, "expert-parallel degree: experts split over an ep mesh axis (after dp; also a data axis)",
                     "parallelism", low=1)
    cp: int = _field(1, "context-parallel degree", "parallelism", low=1)
    tp: int = _field(1, "tensor-parallel degree", "parallelism", low=1)
    sp: bool = _field(False, "Megatron sequence parallel (needs --tp > 1)", "parallelism")
    async_tp: bool = _field(False, "with --sp: the block's all-gathers / reduce-scatters as rings of send/recv hops "
                            "under the matmuls (collective matmul)", "parallelism")
    cp_algo: str | None = _field(None, "context-parallel algorithm (with --cp > 1)", "parallelism",
                                 choices=CP_ALGORITHMS)
    cp_window: int | None = _field(None, "double-ring window: cp ranks per inner ring (MindSpeed --cp-window-size; "
                                   "with --cp > 1)", "parallelism", low=1)
    ulysses_degree: int | None = _field(None, "Ulysses part of hybrid context parallel (with --cp > 1)",
                                        "parallelism", low=1)
    cp_head_chunks: int | None = _field(None, "context-parallel attention in this many head chunks (default: the "
                                        "fewest with chunks × cp >= 16 keeping each chunk's K+V >= 1 MiB; 1: "
                                        "Megatron's schedule, fewer and larger transfers, more memory; with --cp > 1)",
                                        "parallelism", low=1)
    zero: int = _field(0, "ZeRO stage over dp: 1 optimizer state, 2 + gradients, 3 + parameters (0: plain DP)",
                       "parallelism", choices=ZERO_STAGES)
    overlap_grad_reduce: bool = _field(False, "with --zero: reduce-scatter each gradient bucket during backward",
                                       "parallelism")
    overlap_param_gather: bool = _field(False, "with --zero: leave the update's parameter all-gathers in flight "
                                        "until the next forward (--zero 3: those of its first --zero-prefetch + 1 "
                                        "buckets)", "parallelism")
    reshard_after_forward: bool = _field(True, "with --zero 3 (on unless --no-…): free gathered buckets after "
                                         "forward and gather them again in backward; --no-reshard-after-forward "
                                         "keeps them until backward is done with them (2Ψ traffic instead of 3Ψ; "
                                         "parameters whole during a step)", "parallelism")
    zero_prefetch: int = _field(1, "with --zero 3: buckets gathered ahead of the one in use", "parallelism", low=1,
                                metavar="N")
    bucket_mb: float = _field(40.0, "with --zero: gradient/parameter bucket size in MiB", "parallelism", above=0)
    # ---- model and training
    model: str = _field("tiny", f"llama preset: {', '.join(model_config.CONFIGS)}", "model")
    init_from: str | None = _field(None, "fine-tune a Hugging Face Llama / Mistral / Mixtral / Qwen2 / Qwen3 / "
                                   "Qwen3-MoE: the model from HF_DIR's config.json (instead of --model), its weights "
                                   "from HF_DIR's *.safetensors; the vocabulary padded to a multiple of 128 so tp "
                                   "splits it (pip install 'dtp[hf]')", "model", metavar="HF_DIR")
    steps: int = _field(50, "optimizer steps", "training", low=1)
    batch: int = _field(8, "global batch size (sequences)", "training", low=1)
    seq: int = _field(64, "sequence length (tokens)", "training", low=1)
    dtype: str = _field("float32", "parameter and compute dtype", "model", choices=DTYPES)
    # None: mixed for bfloat16 (resolved when built)
    precision: str | None = _field(None, "with --dtype bfloat16: mixed keeps fp32 master weights, Adam moments and "
                                   "gradient accumulation (Megatron's), pure updates in bf16 (not with --zero) "
                                   "(default: mixed)", "model", choices=PRECISIONS)
    lr: float = _field(3e-3, "peak learning rate (AdamW, cosine)", "training", low=0)
    weight_decay: float = _field(0.1, "AdamW's decoupled weight decay, on the weight matrices and embeddings; norms "
                                 "and biases are not decayed (Megatron's rule)", "training", low=0)
    # None: min(DEFAULT_WARMUP, steps), resolved when built
    warmup: int | None = _field(None, f"linear warm-up steps (default: min({DEFAULT_WARMUP}, --steps))", "training")
    # None: 1 (2 with ep_overlap); under pp, schedules.default_microbatches; resolved when built
    microbatches: int | None = _field(None, "gradient-accumulation microbatches per step (default 1; under --pp the "
                                      "fewest that keep every stage busy, --pp or 2 x --pp for dualpipev, or the "
                                      "next count that splits --batch)", "training", low=1)
    recompute: str = _field("none", "activation recomputation", "training", choices=RECOMPUTE)
    compile: str | None = _field(None, "compile the local computation (each block, or each local_map body; dtp's "
                                 "collectives run between): torch.compile's inductor, or aot_eager / eager (with "
                                 "--debug: prints the graph breaks and recompiles)", "training",
                                 choices=COMPILE_BACKENDS, metavar="BACKEND", bare=COMPILE_BACKENDS[0])
    clip: float = _field(1.0, "global-norm gradient clip (0: off)", "training", low=0)
    seed: int = _field(0, "seed of the model init and the data order", "training")
    data: str | None = _field(None, "token file (.npy; .bin: uint16 ids unless --data-dtype or its sidecar says "
                              "uint32) or a directory of them, memory-mapped; or text (bytes, or --tokenizer's); "
                              "default: bundled corpus", "data")
    data_dtype: str | None = _field(None, "the ids of --data's .bin files (default: the sidecar's dtype, else "
                                    "uint16)", "data", choices=TOKEN_DTYPES)
    eos_id: int | None = _field(None, "the id that ends a document in --data (default: the sidecar's eos_id; with "
                                "--tokenizer the eos_token of a tokenizer_config.json beside it, else </s>, "
                                "<|endoftext|>, … in its vocabulary)", "data", low=0, metavar="ID")
    tokenizer: str | None = _field(None, "a Hugging Face tokenizer.json that tokenizes --data's text (pip install "
                                   "'dtp[hf]')", "data", metavar="TOKENIZER_JSON")
    document_mask: bool = _field(False, "pack documents (ended by --eos-id; in text, its lines: byte text's end at "
                                 "the newline, --tokenizer's are encoded one by one, each followed by the EOS id): "
                                 "attention within each document, positions restarting in each, the target at each "
                                 "document end masked", "data")
    # Non-finite steps: train_step skips them (state unchanged); the loop counts them.
    max_skipped: int = _field(DEFAULT_MAX_SKIPPED, "abort after N steps in a row skipped for a non-finite loss or "
                              "gradient norm (0: never)", "training", low=0, metavar="N")
    # ---- mixture of experts (None: the model preset's)
    num_experts: int | None = _field(None, "experts per MoE block (0: dense; default: the preset's)", "moe", low=0,
                                     metavar="E")
    top_k: int | None = _field(None, "experts each token is routed to (default: the preset's)", "moe", low=1,
                               metavar="K")
    capacity_factor: float | None = _field(None, "each expert keeps its ceil(T·k/E · C) highest-probability tokens "
                                           "(default: dropless)", "moe", above=0, metavar="C")
    aux_loss_coeff: float | None = _field(None, "weight of the switch load-balancing loss (default: the preset's, "
                                          "1e-2; 0: none)", "moe", low=0, metavar="C")
    router_score: str | None = _field(None, "router scores: softmax (Megatron) or sigmoid with the k chosen "
                                      "normalised (DeepSeek-V3); default: the preset's", "moe",
                                      choices=SCORE_FUNCTIONS)
    n_groups: int | None = _field(None, "group-limited routing: the experts form G groups (with --topk-group)",
                                  "moe", low=1, metavar="G")
    topk_group: int | None = _field(None, "group-limited routing: each token picks its K best groups, then its "
                                    "top-k in them", "moe", low=1, metavar="K")
    routed_scaling_factor: float | None = _field(None, "multiply the k combine weights by S (DeepSeek-V3: 2.5)",
                                                 "moe", above=0, metavar="S")
    router_bias_update: float | None = _field(None, "aux-loss-free balancing: after each step each expert's "
                                              "selection bias moves by RATE·sign(mean load − load) (DeepSeek-V3: "
                                              "1e-3; 0: off)", "moe", low=0, metavar="RATE")
    expert_tp: bool = _field(False, "split each expert's hidden width over tp (Megatron's expert tensor parallel; "
                             "needs --tp > 1, any --ep; without it every tp rank holds its experts whole and "
                             "computes them on the same tokens)", "moe")
    pipe_experts: bool = _field(False, "MindSpeed pipe-experts: move and compute the dispatched tokens per local "
                                "expert, each chunk's all-to-all in flight while another computes", "moe")
    multi_data: int = _field(1, "with --pipe-experts: split each local expert's tokens into N chunks (for 1 local "
                             "expert)", "moe", low=1, metavar="N")
    multi_stream: bool = _field(False, "with --pipe-experts and --sp: one communication stream for the ep "
                                "all-to-alls and the tp all-gathers / reduce-scatters, so they never run at the "
                                "same time", "moe")
    ep_overlap: bool = _field(False, "hide one microbatch's expert all-to-alls under another microbatch's compute "
                              "(needs --ep; at pp 1 --microbatches >= 2; under --pp 1f1b, interleaved or "
                              "dualpipev)", "moe")
    # ---- output, checkpoints, failures
    out: str | None = _field(None, "run directory (default: runs/<timestamp>)", "run")
    log_every: int = _field(1, "print a line every N steps", "run", low=1)
    eval_every: int = _field(0, f"every N steps (and after the last) the loss on a held-out tenth of the corpus, "
                             f"forward only, mean of {EVAL_BATCHES} batches (0: never; the held-out tenth then "
                             f"trains too)", "run", low=0, metavar="N")
    tensorboard: bool = _field(False, "also write TensorBoard events to <out>/tensorboard (needs the tensorboard "
                               "package)", "run")
    debug: bool = _field(False, "full Python tracebacks on the console (otherwise one line per failing rank; the "
                         "tracebacks are in <out>/logs)", "run")
    save_every: int = _field(0, "save a checkpoint every N steps and after the last (0: never). A save that "
                             "fails (a full disk) is said in one line, the checkpoint before it kept, and training "
                             "goes on; the last save failing ends the run with code 1", "checkpoint", low=0,
                             metavar="N")
    keep: int = _field(3, "keep the newest K checkpoints", "checkpoint", low=1, metavar="K")
    async_save: bool = _field(False, "write checkpoints while training goes on (each waits for the one before)",
                              "checkpoint")
    resume: bool = _field(False, "continue from the newest checkpoint in --out that verifies (a damaged newer "
                          "one is renamed step_N.corrupt and named; with --keep 1 it is refused instead), "
                          "metrics.jsonl and loss.png continuing", "checkpoint")
    save_on_signal: str | None = _field(None, "on this signal (alone: SIGTERM; SIGUSR1 for schedulers that warn "
                                        "first) every rank finishes its step, they save that step and exit 75 "
                                        "(EX_TEMPFAIL: resume with --resume); 143 if the save failed",
                                        "checkpoint", choices=SAVE_SIGNALS, metavar="SIGNAL",
                                        bare="SIGTERM")
    shutdown_timeout: int = _field(30, "after the launcher is signalled, how long its ranks may take to finish "
                                   "(a --save-on-signal save) before they are killed (torchrun's shutdown "
                                   "timeout)", "run", low=1, metavar="SECONDS")
    timeout: float = _field(DEFAULT_TIMEOUT, "a collective that waits this long for a peer fails, and every rank "
                            "exits with its last collectives (a dead peer is noticed at once)", "run", above=0,
                            metavar="SECONDS")
    max_restarts: int = _field(0, "when a rank dies, stop the others and start all again from the newest "
                               "checkpoint, up to R times (torchrun's elastic agent; needs --save-every)", "run",
                               low=0, metavar="R")

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
        context = {k: getattr(self, k) for k in CONTEXT_FIELDS.values()
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
        if self.data_dtype is not None and self.tokenizer is not None:
            fail(f"{n('data_dtype')} describes a token file and {n('tokenizer')} tokenizes text: choose one")

    def _check_types(self, fail: Callable[[str], None], n: Callable[[str], str]) -> None:
        for f in fields(self):
            wrong = type_error(f.name, getattr(self, f.name))
            if wrong:
                fail(f"{n(f.name)} {wrong}")
        for f in fields(self):  # the bounds and choices each field states (its flag's parser checks them too)
            value, low, above, choices = (getattr(self, f.name), f.metadata.get("low"), f.metadata.get("above"),
                                          f.metadata.get("choices"))
            if value is None:
                continue
            if low is not None and value < low:
                fail(f"{n(f.name)} must be >= {low}, got {value}")
            if above is not None and not value > above:
                fail(f"{n(f.name)} must be > {above}, got {value}")
            if choices is not None and value not in choices:
                fail(f"{n(f.name)} must be one of {', '.join(map(str, choices))}; got {value!r}")
        # torch's generators take seeds in [-2**63, 2**64); the data loader seeds epoch e with
        # seed + e, so a seed below 2**63 leaves room for any number of epochs.
        if not -(2**63) <= self.seed < 2**63:
            fail(f"{n('seed')} must lie in [-2**63, 2**63), got {self.seed}")

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
            options = {option: getattr(self, f) for option, f in CONTEXT_FIELDS.items() if getattr(self, f) is not None}
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
        """One line of JSON (the run as a record: the launcher ships it as TOML, :func:`dtp.config.to_toml`)."""
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
