"""Tensor parallel + sequence parallel on 2 gloo ranks: dtp vs PyTorch's own
``parallelize_module`` (torchtitan's plan) on the same Llama, same weights, same batch.

    python benchmarks/tp_vs_torch.py --configs tiny small --seq 128 --batch 8 --repeats 11

One training step = forward + backward + SGD update (fp32).

* dtp: ``layouts.data() + layouts.megatron(sequence_parallel=True)`` on ``make_mesh(tp=2)``,
  ``dtp.train_step(partial(llama.loss, cfg=cfg), state, dtp.shard_batch(batch, state))``
  with ``dtp.optim.sgd``.
* torch: an ``nn.Module`` Llama with the weights of ``llama.init(cfg, seed=0)`` (its
  single-process loss is checked against ``llama.loss`` first), parallelized with
  ``parallelize_module`` as torchtitan does (colwise q/k/v/gate/up, rowwise o/down with
  ``Shard(1)`` outputs, ``SequenceParallel`` norms, ``PrepareModuleInput`` into attention
  and feed-forward, row-wise embedding, col-wise head with ``loss_parallel``),
  ``torch.optim.SGD``.

``--compile BACKEND`` compiles both sides with the same backend (``inductor``,
``aot_eager``): dtp with ``train_step(..., compile=BACKEND)`` (under tp its regions are the
``local_map`` bodies, :mod:`dtp.compiled`), torch with ``torch.compile(model)`` over the
whole parallelized model, the cross-entropy under ``loss_parallel`` left eager. torchtitan
compiles each block instead; on torch 2.13 CPU / gloo that fails in the first backward
(aot_eager and inductor alike: the compiled block hands a plain-tensor gradient to the
eager ``PrepareModuleInput`` redistribute, ``AttributeError: 'Tensor' object has no
attribute '_local_tensor'``), so the whole model is the region a torch user can compile
here. The first step of each (compiling) is a warm-up step.

Steps of the two are interleaved (alternating which goes first), each behind a barrier;
the time of an iteration is the slower rank's; the table shows medians, and the ratio of
the fastest iterations as a less noise-prone second reading. Bytes are bytes *sent per
rank* per step, with dtp.comm's ring conventions for both: dtp's from
``dtp.comm_log()``; torch's from a ``TorchDispatchMode`` that sees every
``_c10d_functional`` collective DTensor issues. Not a test: numbers on a shared 2-core
machine are noisy; the ratios are measured side by side in one run.
"""

from __future__ import annotations


import statistics
from collections import defaultdict
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import alternating_times, llama_step_parser

LR = 0.1

# --------------------------------------------------------------------------- torch's Llama


_TABLES: dict[tuple[int, int, float, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_tables(seq: int, head_dim: int, theta: float,
                 device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin over (seq, 1, head_dim), made once per shape and device, as Hugging Face's
    ``LlamaRotaryEmbedding`` (once per forward for every layer) and torchtitan's
    ``freqs_cis`` buffer do — not per call. (A dict, not ``functools.lru_cache``: the rank
    pool ships this script's functions by value, and an lru_cache wrapper goes by name.)"""
    key = (seq, head_dim, theta, str(device))
    if key not in _TABLES:
        _TABLES[key] = tuple(t.to(device) for t in _make_tables(seq, head_dim, theta))
    return _TABLES[key]


def _make_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    half = head_dim // 2
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    ang = torch.arange(seq, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of (batch, seq, heads, head_dim), halves rotated (as dtp.ops.rotary),
    in Hugging Face's form ``x·cos + rotate_half(x)·sin``: the same bits as the halves' form."""
    cos, sin = _rope_tables(x.shape[1], x.shape[-1], theta, x.device)
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim, self.theta = hd, cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Under TP the projections return local tensors: -1 is the *local* head count.
        q = _rope(self.wq(x).view(b, s, -1, self.head_dim), self.theta).transpose(1, 2)
        k = _rope(self.wk(x).view(b, s, -1, self.head_dim), self.theta).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h))
        return h + self.feed_forward(self.ffn_norm(h))


class TorchLlama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # Llama 3.2 1B's head is its embedding (one parameter, as llama.init)
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def load_dtp(self, params: dict) -> "TorchLlama":
        """Copy ``llama.init`` parameters (x @ W layout) into nn.Linear's (out, in) layout."""
        self.tok_embeddings.weight.copy_(params["embed"])
        names = {"wq": "attention.wq", "wk": "attention.wk", "wv": "attention.wv", "wo": "attention.wo",
                 "w_gate": "feed_forward.w_gate", "w_up": "feed_forward.w_up", "w_down": "feed_forward.w_down"}
        for layer, p in zip(self.layers, params["layers"]):
            layer.attention_norm.weight.copy_(p["attn_norm"])
            layer.ffn_norm.weight.copy_(p["mlp_norm"])
            for k, path in names.items():
                layer.get_submodule(path).weight.copy_(p[k].t())
        self.norm.weight.copy_(params["final_norm"])
        if "lm_head" in params:  # else tied: the embedding copied above
            self.output.weight.copy_(params["lm_head"].t())
        return self


def parallelize_torchtitan(model: TorchLlama, mesh) -> TorchLlama:
    """torchtitan's TP + SP plan (``apply_tp`` with ``loss_parallel``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w_gate": ColwiseParallel(),
            "feed_forward.w_up": ColwiseParallel(),
            "feed_forward.w_down": RowwiseParallel(output_layouts=Shard(1)),
        })
    return model


# --------------------------------------------------------------------------- torch's bytes


_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}


class CollectiveCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes sent per rank by every functional collective, with dtp.comm's conventions."""

    KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "all_to_all_single": "all_to_all",
             "all_gather_into_tensor_coalesced": "all_gather", "reduce_scatter_tensor_coalesced": "reduce_scatter",
             "all_reduce_coalesced": "all_reduce"}

    def __init__(self):
        super().__init__()
        self.phase = ""
        self.records: list[tuple[str, str, int, tuple]] = []  # (kind, phase, bytes, shape)
        self.unknown: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        # Modes run before tensor subclasses: let DTensor desugar the op first, so the
        # collectives it issues (redistributions, loss_parallel) come back through here
        # on local tensors (CommDebugMode does the same).
        if any(t is DTensor for t in types):
            return NotImplemented
        ns = func.namespace
        name = func._opname
        if ns in ("_c10d_functional", "_c10d_functional_autograd", "c10d") and name not in _NOT_COLLECTIVES:
            kind = self.KINDS.get(name)
            if kind is None:
                self.unknown.add(f"{ns}.{name}")
            else:
                from torch.distributed.distributed_c10d import _resolve_process_group

                n = _resolve_process_group(args[-1] if not isinstance(args[-1], list) else args[-1]).size()
                inputs = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
                for x in inputs:
                    b = x.numel() * x.element_size()
                    sent = {"all_gather": (n - 1) * b, "reduce_scatter": (n - 1) / n * b,
                            "all_reduce": 2 * (n - 1) / n * b, "all_to_all": (n - 1) / n * b}[kind]
                    self.records.append((kind, self.phase, int(round(sent)), tuple(x.shape)))
        return func(*args, **(kwargs or {}))


# --------------------------------------------------------------------------- the run


def make_batch(cfg, batch: int, seq: int, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g)
    return {"tokens": toks[:, :-1].contiguous(), "targets": toks[:, 1:].contiguous()}


def check_single_process(cfg, batch) -> tuple[float, float, float]:
    """(llama.loss, TorchLlama loss, max relative grad difference) on one process."""
    from dtp.models import llama

    params = llama.init(cfg, seed=0)
    leaves = {"embed": params["embed"], "wq0": params["layers"][0]["wq"], "norm0": params["layers"][0]["attn_norm"],
              "lm_head": params["lm_head"]}
    for t in leaves.values():
        t.requires_grad_(True)
    ref = llama.loss(params, batch, cfg)
    ref_g = torch.autograd.grad(ref, list(leaves.values()))
    model = TorchLlama(cfg).load_dtp(params)
    logits = model(batch["tokens"])
    out = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
    out.backward()
    mine = [model.tok_embeddings.weight.grad, model.layers[0].attention.wq.weight.grad.t(),
            model.layers[0].attention_norm.weight.grad, model.output.weight.grad.t()]
    rel = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(mine, ref_g))
    return float(ref.detach()), float(out.detach()), rel


def _bench(cfg, batch: dict, warmup: int, repeats: int, backend: str | None = None) -> dict:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel

    import dtp
    from dtp.models import llama

    torch.set_num_threads(1)
    mesh = dtp.make_mesh(tp=2)
    # (a) dtp
    layout = dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=True)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(LR), mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    loss_fn = partial(llama.loss, cfg=cfg)
    dtp_batch = dtp.shard_batch(batch, state)
    box = {"state": state}

    def dtp_step() -> float:
        box["state"], m = dtp.train_step(loss_fn, box["state"], dtp_batch, compile=backend or False)
        return m["loss"]

    # (b) torch
    model = parallelize_torchtitan(TorchLlama(cfg).load_dtp(llama.init(cfg, seed=0)), mesh)
    if backend:  # the whole model: per-block regions fail on CPU / gloo (module docstring)
        model = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tokens, targets = batch["tokens"], batch["targets"]
    counter = CollectiveCounter()

    def torch_step() -> float:
        opt.zero_grad(set_to_none=True)
        with loss_parallel():
            counter.phase = "forward"
            logits = model(tokens)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            counter.phase = "backward"
            loss.backward()
        counter.phase = "optimizer"
        opt.step()
        loss = loss.detach()
        return float(loss.to_local() if isinstance(loss, DTensor) else loss)

    # One counted step each (also the first warm-up step): losses and collectives.
    with dtp.comm_log() as log:
        dtp_losses = [dtp_step()]
    with counter:
        torch_losses = [torch_step()]
    grad_placements = {n.removeprefix("_orig_mod."): str(p.grad.placements) for n, p in model.named_parameters()
                       if n.removeprefix("_orig_mod.") in ("norm.weight", "layers.0.attention_norm.weight",
                                                           "layers.0.attention.wq.weight")}
    dtp_losses.append(dtp_step())
    torch_losses.append(torch_step())
    for _ in range(max(0, warmup - 2)):
        dtp_step(), torch_step()
    times = alternating_times({"dtp": dtp_step, "torch": torch_step}, repeats)
    dtp_recs = [(r.kind, r.tag, r.bytes, r.shape) for r in log.records]
    return dict(times=times, dtp_losses=dtp_losses, torch_losses=torch_losses, dtp_recs=dtp_recs,
                torch_recs=counter.records, unknown=sorted(counter.unknown), grad_placements=grad_placements)


def _dtp_phase(tag: str) -> str:
    if tag.endswith("backward"):
        return "backward"
    if tag in ("grad reduce", "global_norm"):
        return tag
    return "forward"


def _breakdown(recs, phase_of) -> dict[tuple[str, str], list[int]]:
    out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for kind, tag, b, _shape in recs:
        key = (kind, phase_of(tag))
        out[key][0] += 1
        out[key][1] += b
    return out


def _profile(cfg, batch: dict, steps: int) -> str:
    """cProfile of dtp's tp=2 step on rank 0: the top dtp-side functions by own time."""
    import cProfile
    import io
    import pstats

    import torch.distributed as dist

    import dtp
    from dtp.models import llama

    torch.set_num_threads(1)
    mesh = dtp.make_mesh(tp=2)
    layout = dtp.layouts.data() + dtp.layouts.megatron(sequence_parallel=True)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(LR), mesh=mesh, layout=layout,
                                  axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
    loss_fn, b = partial(llama.loss, cfg=cfg), dtp.shard_batch(batch, state)
    for _ in range(2):
        state, _ = dtp.train_step(loss_fn, state, b)
    dist.barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        state, _ = dtp.train_step(loss_fn, state, b)
    prof.disable()
    if dist.get_rank():
        return ""
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(r"dtp/", 25)
    st.sort_stats("tottime").print_stats(12)
    return s.getvalue()


def main() -> None:
    ap = llama_step_parser(__doc__, repeats=11, profile_help="instead: cProfile STEPS dtp steps of the last config on rank 0")
    ap.add_argument("--compile", default=None, choices=("inductor", "aot_eager"),
                    help="compile both sides with this backend (module docstring)")
    args = ap.parse_args()
    from dtp.models import llama
    from dtp.testing import run

    if args.profile:
        cfg = llama.config(args.configs[-1])
        print(run(_profile, cfg, make_batch(cfg, args.batch, args.seq), args.profile, world_size=2, timeout=1200)[0])
        return

    rows = []
    for name in args.configs:
        cfg = llama.config(name)
        batch = make_batch(cfg, args.batch, args.seq)
        ref, mine, grel = check_single_process(cfg, batch)
        print(f"[{name}] single process: llama.loss {ref:.7f}  TorchLlama {mine:.7f}  |diff| {abs(ref - mine):.2e}  "
              f"max rel grad diff {grel:.2e}")
        res = run(_bench, cfg, batch, args.warmup, args.repeats, args.compile, world_size=2, timeout=1800)
        r0 = res[0]
        print(f"[{name}] tp=2 losses step 0, 1: dtp {r0['dtp_losses'][0]:.7f}, {r0['dtp_losses'][1]:.7f}  "
              f"torch {r0['torch_losses'][0]:.7f}, {r0['torch_losses'][1]:.7f}")
        print(f"[{name}] torch grad placements after backward: {r0['grad_placements']}")
        if r0["unknown"]:
            print(f"[{name}] torch collectives not counted: {r0['unknown']}")
        # An iteration takes as long as its slowest rank.
        per_iter = {k: [max(rk["times"][k][i] for rk in res) for i in range(args.repeats)] for k in ("dtp", "torch")}
        t = {k: statistics.median(v) for k, v in per_iter.items()}
        t.update({f"{k}_min": min(v) for k, v in per_iter.items()})
        db = sum(b for *_x, b, _s in r0["dtp_recs"])
        tb = sum(b for *_x, b, _s in r0["torch_recs"])
        rows.append((name, cfg, t, db, tb))
        print(f"[{name}] per-collective bytes sent per rank, one step:")
        print(f"    {'':<7}{'kind':<16}{'phase':<14}{'count':>6}{'bytes':>12}")
        for who, recs, phase_of in (("dtp", r0["dtp_recs"], _dtp_phase), ("torch", r0["torch_recs"], lambda p: p)):
            by_phase = sorted(_breakdown(recs, phase_of).items(), key=lambda kv: (kv[0][1], kv[0][0]))
            for (kind, phase), (cnt, b) in by_phase:
                print(f"    {who:<7}{kind:<16}{phase:<14}{cnt:>6}{b:>12}")
    print()
    compiled = f"compiled ({args.compile}), " if args.compile else ""
    print(f"gloo, tp=2 + sequence parallel on 2 ranks (1 thread each), {compiled}fp32, batch {args.batch}, "
          f"seq {args.seq}; median of {args.repeats} steps (fwd+bwd+SGD) after {args.warmup} warm-up; ratio = dtp / torch")
    print(f"{'config':<8}{'params':>9}{'dtp ms':>9}{'torch ms':>10}{'time':>7}{'(mins)':>8}"
          f"{'dtp bytes':>12}{'torch bytes':>13}{'bytes':>9}")
    for name, cfg, t, db, tb in rows:
        print(f"{name:<8}{llama.param_count(cfg):>9}{1e3 * t['dtp']:>9.1f}{1e3 * t['torch']:>10.1f}"
              f"{t['dtp'] / t['torch']:>7.2f}{t['dtp_min'] / t['torch_min']:>8.2f}"
              f"{db:>12}{tb:>13}{db / max(1, tb):>9.6f}")


if __name__ == "__main__":
    main()
