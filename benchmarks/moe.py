"""MindSpeed's pipe-experts on 4 gloo ranks (ep=4): how much of the expert all-to-all it
hides on a simulated link, and dtp's MoE layer beside torchtitan's.

    python benchmarks/moe.py                        # a few minutes on 2 loaded cores
    python benchmarks/moe.py --quick                # smaller tokens, 3 repeats

One step = forward + backward of one MoE FFN (``dtp.ops.moe.moe_ffn``, dropless, top-2
softmax routing, SwiGLU experts), fp32, on ``make_mesh(ep=4)`` under ``layouts.data() +
layouts.expert(pipe_experts=..., multi_data=..., multi_stream=...)``: each rank routes its
``--batch × --seq`` tokens of width ``--dim`` to ``E`` experts of hidden width
``--hidden``; the seed's three scenarios E = 4, 16, 8 on ep 4 (1, 4, 2 local experts).

**(a) pipe-experts sweep.** Loopback gloo is nearly free, so every collective on ``ep``
runs under ``dtp.comm.simulated_link(B, --latency, axes=("ep",))`` (see
``zero_overlap.py``): its modelled transfer (latency + bytes/B, queued per axis, one
message at a time for both directions) starts when the real one has finished. ``B`` is
measured per scenario so that the unpipelined layer's four token all-to-alls (dispatch,
combine and their backwards) take as long on the link as its experts take to compute:
``expert`` = fwd+bwd of ``dtp.ops.moe.experts`` alone on the rows this rank's experts
receive (no link, the fastest of several runs — load only adds — and the slower rank),
``B = bytes / (expert − 4·latency)``; ``comm`` = expert. Then every option runs, in
rotated order (repeat i starts at the i-th option: each takes each place equally often),
once without the link (its own ``compute``: chunking costs something) and once under it,
each call behind a barrier.
Columns:

* ``a2a``: token all-to-alls per fwd+bwd (4, or 4 × local experts × multi_data);
* ``ms``: median fwd+bwd under the link, the slower rank of each repeat;
* ``exposed``: Σ ``CommRecord.waited`` over the MoE token all-to-alls (tags ``moe
  dispatch``, ``moe combine``, ``moe pipe dispatch i``, ``moe pipe combine i``, and their
  ``backward``): the time the rank sat blocked on them, median of the slower rank;
  ``base``: the same without the link (the real gloo all-to-alls and waiting for a
  slower rank: several ms per collective on a loaded 2-core machine);
* ``hidden`` = 1 − exposed / comm, where ``comm`` = Σ (latency + bytes/B) over the same
  records, the time the link needs for them (the same for every option: pipe-experts
  moves the same rows in chunks). The goal is ≥ 70 %. ``net`` = 1 − (exposed − base) /
  comm, the link's share alone. ``hid/dur`` = 1 − exposed / Σ (completed − issued), the
  same against the records' durations; those include the time a chunk waits in the
  link's queue behind the chunks posted before it, so it reads higher once chunks queue;
* ``ratio`` = ms / max(compute, comm) with this option's own compute (≈ 1: all hidden);
* ``speed-up`` = the unpipelined option's ms / this option's; ``(mins)`` the same of the
  fastest repeats.

The best possible is not 100 %: forward carries dispatch and combine (half the
all-to-all time) past one third of the expert compute, and the first chunk's dispatch
and the last one's combine of each direction overlap nothing. ``model`` is that bound
for the option's chunk count (:func:`model_hidden`: 0, 50, 71, 77, 80 % for 1, 2, 4, 8,
16 chunks); nothing at all hides the router, the permutations and the counts exchange.

Options the layout refuses print ``n/a`` and the reason (``layouts.expert(multi_stream=
True)`` needs sequence parallel, and these ep=4 scenarios have no tp: ``Layout.check_sizes``
raises the ``ValueError`` that ``TrainState.create`` would).

**(b) dtp vs torchtitan.** torchtitan 0.3.0's ``MoE`` (``torchtitan.models.common.moe``:
``TokenChoiceTopKRouter`` softmax + ``route_norm`` = dtp's top-k then softmax over the
k, ``RoutedExperts`` with ``AllToAllTokenDispatcher``, ``GroupedExperts``), same weights,
tokens, sizes and top-k, expert parallel over the same 4 ranks through its own
``Module.parallelize(ParallelDims(dp_shard=4, ep=4))``, vs dtp's unpipelined
``moe_ffn``; no link. What it took to run on CPU gloo (every knob, see ``_titan_moe``):

* ``pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro docstring-parser
  typeguard`` (tyro's two pure-python deps are imported when torchtitan's config is);
* ``torchtitan.distributed.minimal_async_ep.kernels`` imports ``triton``, which a CPU
  install lacks: the module is stubbed (names that raise) before the import — the
  symmetric-memory dispatcher that uses it is not the one measured;
* ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` without an
  accelerator: ``parallel_dims.device_type = "cpu"`` before ``build_mesh``;
* ``set_spmd_backend("full_dtensor")`` and ``ParallelDims(spmd_backend="full_dtensor")``:
  the default ``spmd_types`` backend calls ``spmd.all_to_all`` with uneven lists, which
  gloo rejects; ``full_dtensor`` takes ``all_to_all_single`` with split sizes;
* ``set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False, ...)`` (what the
  model's own config does for ep > 1), ``load_balance_coeff=None`` (no bias buffer);
* ``GroupedExperts`` casts tokens and weights to bf16 for ``torch._grouped_mm``: the
  ``tt ms`` column overrides its ``_grouped_mm`` seam to compute in fp32 (inputs are
  still rounded to bf16 first), as dtp does; ``tt bf16`` is torchtitan as shipped.

Bytes are sent per rank in one fwd+bwd with dtp.comm's conventions (all-to-all-v: rows
sent to the other ranks × row bytes; all-to-all (n−1)/n × input; all-reduce 2(n−1)/n ×
bytes): dtp's from ``dtp.comm_log``, torchtitan's from a ``TorchDispatchMode`` on the
``_c10d_functional`` collectives. ``max |Δy|`` is the largest difference of the two
layers' outputs (torchtitan fp32 variant) relative to the largest output.

Not a test: times on a shared CPU are noisy; read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import types
import warnings

import torch

SCENARIOS = {"E4/ep4": 4, "E16/ep4": 16, "E8/ep4": 8}  # the seed's three: experts on ep 4
# label: layouts.expert options
OPTIONS = {"off": {}}
for _ms in (False, True):
    for _md in (1, 2, 4):
        OPTIONS[f"on md{_md}{' ms' if _ms else ''}"] = dict(pipe_experts=True, multi_data=_md, multi_stream=_ms)
EP = 4
TITAN_MISSING = ("skipped: torchtitan not installed (pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 "
                 "tyro)")
TITAN_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _is_token_a2a(r) -> bool:
    return r.kind == "all_to_all_v" and r.tag.startswith("moe")


def _params(experts: int, dim: int, hidden: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"router": torch.randn(dim, experts, generator=g) * dim ** -0.5,
            "w_gate": torch.randn(experts, dim, hidden, generator=g) * dim ** -0.5,
            "w_up": torch.randn(experts, dim, hidden, generator=g) * dim ** -0.5,
            "w_down": torch.randn(experts, hidden, dim, generator=g) * hidden ** -0.5}


def _inputs(batch: int, seq: int, dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global (EP·batch, seq, dim) tokens and output gradient (every rank alike)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(EP * batch, seq, dim, generator=g), torch.randn(EP * batch, seq, dim, generator=g)


class _DtpLayer:
    """moe_ffn on this rank's block of the tokens under one layout; ``step()`` = fwd+bwd."""

    def __init__(self, mesh, layout, full: dict, x: torch.Tensor, gy: torch.Tensor, top_k: int):
        import dtp
        from dtp.spec import P

        self.mesh, self.layout, self.top_k = mesh, layout, top_k
        self.params = {k: dtp.shard(v, mesh, P(None, None) if k == "router" else P("ep", None, None)
                                    ).requires_grad_() for k, v in full.items()}
        self.x = dtp.shard(x, mesh, P("ep", None, None)).requires_grad_()
        self.gy = dtp.shard(gy, mesh, P("ep", None, None)).to_local()

    def forward(self):
        import dtp
        from dtp.ops.moe import moe_ffn

        with dtp.use_layout(self.layout, self.mesh):
            return moe_ffn(self.params, self.x, top_k=self.top_k)[0]

    def step(self) -> None:
        y = self.forward()
        (y.to_local() * self.gy).sum().backward()
        for t in (self.x, *self.params.values()):
            t.grad = None


def _expert_compute(layer: _DtpLayer):
    """A function running fwd+bwd of just this rank's experts on the rows the unpipelined
    layer dispatches to them (routed and dispatched once, here, as ``moe_ffn`` does)."""
    from dtp.ops import moe, moe_dispatch

    xt = layer.x.to_local().detach().reshape(-1, layer.x.shape[-1])
    router = layer.params["router"].to_local().detach()
    e = router.shape[-1]
    r = moe.route(xt @ router, layer.top_k)
    ids = r.experts.reshape(-1)
    order = torch.argsort(ids, stable=True)
    arrived, plan = moe_dispatch.dispatch(xt[order // layer.top_k], ids[order], e, layer.mesh, "ep")
    here = torch.tensor(plan.tokens_per_expert, dtype=torch.long)
    weights = [layer.params[k].to_local().detach().requires_grad_() for k in ("w_gate", "w_up", "w_down")]
    rows = arrived.detach().requires_grad_()
    grad = torch.randn(rows.shape, generator=torch.Generator().manual_seed(2))

    def step() -> None:
        moe.experts(rows, here, *weights).backward(grad)
        for t in (rows, *weights):
            t.grad = None

    return step


def _timed(fn, link: tuple[float, float] | None) -> tuple[float, list]:
    """(seconds, this rank's comm records) of one ``fn()`` behind a barrier."""
    import torch.distributed as dist

    import dtp

    ctx = dtp.comm.simulated_link(link[0], link[1], axes=("ep",)) if link else contextlib.nullcontext()
    with ctx:
        dist.barrier()
        with dtp.comm_log() as log:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
    return dt, log.records


def _sweep(batch: int, seq: int, dim: int, hidden: int, top_k: int, warmup: int, repeats: int,
           latency: float, scenarios: list[str]) -> dict:
    import torch.distributed as dist

    import dtp

    torch.set_num_threads(1)
    mesh = dtp.make_mesh(ep=EP)
    x, gy = _inputs(batch, seq, dim)
    out: dict = {}
    for name in scenarios:
        experts = SCENARIOS[name]
        full = _params(experts, dim, hidden)
        layers, skipped = {}, {}
        for label, opts in OPTIONS.items():
            try:
                layout = dtp.layouts.data() + dtp.layouts.expert(**opts)
                layout.check_sizes({"expert": experts}, mesh, what="benchmarks/moe.py")
            except ValueError as e:
                skipped[label] = str(e)
                continue
            layers[label] = _DtpLayer(mesh, layout, full, x, gy, top_k)
        # the expert compute (no link) of the unpipelined layer and its token all-to-all bytes set B
        for _ in range(warmup):
            for layer in layers.values():
                layer.step()
        expert_step = _expert_compute(layers["off"])
        expert_times = [_timed(expert_step, None)[0] for _ in range(max(3, repeats))]
        recs = [r for r in _timed(layers["off"].step, None)[1] if _is_token_a2a(r)]
        # the fastest of the runs: load on a shared machine only ever adds to a time
        agreed = torch.tensor([min(expert_times), sum(r.bytes for r in recs)], dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank models the same link
        compute, nbytes = float(agreed[0]), float(agreed[1])
        if compute <= len(recs) * latency:
            raise ValueError(f"--latency {latency} × {len(recs)} all-to-alls exceeds the expert compute time "
                             f"{compute:.4f}s")
        bandwidth = nbytes / (compute - len(recs) * latency)
        res: dict = {"opts": {}, "skipped": skipped, "bandwidth": bandwidth, "calib": compute, "bytes": nbytes,
                     "n_a2a": {}}
        rows = {label: {"free": [], "base": [], "linked": [], "exposed": [], "comm": [], "dur": []} for label in layers}
        for i in range(repeats):
            order = list(layers)[i % len(layers):] + list(layers)[:i % len(layers)]  # each option takes each place equally often
            for label in order:
                row = rows[label]
                dt, records = _timed(layers[label].step, None)
                row["free"].append(dt)
                row["base"].append(sum(r.waited for r in records if _is_token_a2a(r)))
                dt, records = _timed(layers[label].step, (bandwidth, latency))
                a2a = [r for r in records if _is_token_a2a(r)]
                row["linked"].append(dt)
                row["exposed"].append(sum(r.waited for r in a2a))
                row["comm"].append(sum(latency + r.bytes / bandwidth for r in a2a))
                row["dur"].append(sum(r.duration for r in a2a))
                res["n_a2a"][label] = len(a2a)
        res["opts"] = rows
        out[name] = res
    return out


# --------------------------------------------------------------------------- torchtitan


def _titan_available() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("torchtitan", "spmd_types", "tyro"))


def _stub_triton_kernels() -> None:
    """minimal_async_ep's kernels import triton at module level; without triton (a CPU
    install) stand in names that raise, so torchtitan's MoE module imports."""
    if TITAN_KERNELS in sys.modules:
        return
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(TITAN_KERNELS)

    def _needs_triton(*args, **kwargs):
        raise RuntimeError("torchtitan minimal_async_ep needs triton (stubbed by benchmarks/moe.py)")

    for fn in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
               "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
               "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
        setattr(stub, fn, _needs_triton)
    sys.modules[TITAN_KERNELS] = stub


def _titan_dims():
    _stub_triton_kernels()
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend

    parallel_dims.device_type = "cpu"  # torchtitan.tools.utils falls back to "cuda" without an accelerator
    set_spmd_backend("full_dtensor")  # spmd_types' uneven all_to_all lists: gloo rejects them
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=EP, cp=1, tp=1, pp=1, ep=EP, world_size=EP,
                                      spmd_backend="full_dtensor")
    dims.build_mesh()
    return dims


def _titan_moe(dims, full: dict, top_k: int, fp32: bool):
    """torchtitan's MoE with dtp's weights, parallelized by its own Module.parallelize."""
    import spmd_types as spmd
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.moe_sharding import set_moe_sharding_config
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    dim, experts = full["router"].shape
    hidden = full["w_gate"].shape[-1]
    cfg = MoE.Config(
        num_experts=experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts),
            token_dispatcher=AllToAllTokenDispatcher.Config(num_experts=experts, top_k=top_k)),
        router=TokenChoiceTopKRouter.Config(num_experts=experts, top_k=top_k, score_func="softmax", route_norm=True,
                                            gate=Linear.Config(in_features=dim, out_features=experts)))
    set_moe_sharding_config(cfg, enable_ep=True, enable_sp=False,
                            expert_param_layout={"w1_EFD": spmd.S(1), "w2_EDF": spmd.S(2), "w3_EFD": spmd.S(1)})
    moe = cfg.build()
    with torch.no_grad():
        moe.router.gate.weight.copy_(full["router"].t())
        inner = moe.routed_experts.inner_experts
        inner.w1_EFD.copy_(full["w_gate"].transpose(1, 2))
        inner.w3_EFD.copy_(full["w_up"].transpose(1, 2))
        inner.w2_EDF.copy_(full["w_down"].transpose(1, 2))
    if fp32:  # its overridable seam: the grouped GEMM in fp32, as dtp computes
        inner._grouped_mm = lambda *, A, B_t, offs: torch._grouped_mm(A.float(), B_t.float(), offs=offs)
    moe.parallelize(dims)
    return moe


class _TitanLayer:
    def __init__(self, dims, full: dict, x: torch.Tensor, gy: torch.Tensor, top_k: int, fp32: bool):
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor, Replicate, Shard

        self.moe = _titan_moe(dims, full, top_k, fp32)
        mesh = dims.get_activated_mesh(["dp_replicate", "dp_shard", "cp", "tp"])
        b = x.shape[0] // EP
        me = dist.get_rank()
        placements = [Shard(0) if n == "dp_shard" else Replicate() for n in mesh.mesh_dim_names]
        self.x = DTensor.from_local(x[me * b:(me + 1) * b].clone().requires_grad_(), mesh, placements)
        self.gy = gy[me * b:(me + 1) * b]

    def forward(self):
        return self.moe(self.x)

    def step(self) -> None:
        (self.forward().to_local() * self.gy).sum().backward()
        for t in (self.x, *self.moe.parameters()):
            t.grad = None


def _count_collectives():
    """Bytes sent per rank by the functional collectives under it, dtp.comm's conventions."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.records: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.distributed.tensor import DTensor

            if any(t is DTensor for t in types):
                return NotImplemented
            name = func._opname
            if func.namespace in ("_c10d_functional", "_c10d_functional_autograd") and name not in (
                    "wait_tensor", "_wrap_tensor_autograd"):
                x, group = args[0], _resolve_process_group(args[-1])
                n, row = dist.get_world_size(group), x[0].numel() * x.element_size() if x.dim() else 0
                if name == "all_to_all_single" and not x.is_floating_point():  # the counts exchange
                    sent, kind = (n - 1) / n * x.numel() * x.element_size(), "all_to_all"
                elif name == "all_to_all_single" and args[2] is not None:  # uneven: rows to the others
                    splits = list(args[2])
                    sent = (sum(splits) - splits[dist.get_rank(group)]) * row
                    kind = "all_to_all_v"
                elif name == "all_to_all_single":
                    sent, kind = (n - 1) / n * x.numel() * x.element_size(), "all_to_all"
                elif name == "all_reduce":
                    sent, kind = 2 * (n - 1) / n * x.numel() * x.element_size(), "all_reduce"
                else:
                    raise RuntimeError(f"benchmarks/moe.py: uncounted collective {func}")
                self.records.append((kind, int(round(sent))))
            return func(*args, **(kwargs or {}))

    return Count()


def _vs_titan(batch: int, seq: int, dim: int, hidden: int, top_k: int, warmup: int, repeats: int,
              scenarios: list[str]) -> dict:
    import torch.distributed as dist

    import dtp

    warnings.filterwarnings("ignore", message="In CPU autocast")  # its router's fp32 autocast (a no-op on CPU)
    torch.set_num_threads(1)
    mesh = dtp.make_mesh(ep=EP)
    dims = _titan_dims()
    x, gy = _inputs(batch, seq, dim)
    out: dict = {}
    for name in scenarios:
        full = _params(SCENARIOS[name], dim, hidden)
        layers = {"dtp": _DtpLayer(mesh, dtp.layouts.data() + dtp.layouts.expert(), full, x, gy, top_k),
                  "tt": _TitanLayer(dims, full, x, gy, top_k, fp32=True),
                  "tt bf16": _TitanLayer(dims, full, x, gy, top_k, fp32=False)}
        with torch.no_grad():
            ya, yb = layers["dtp"].forward().to_local(), layers["tt"].forward().to_local()
        err = float((ya - yb).abs().max() / ya.abs().max())
        for _ in range(warmup):
            for layer in layers.values():
                layer.step()
        with dtp.comm_log() as log:
            layers["dtp"].step()
        counter = _count_collectives()
        with counter:
            layers["tt"].step()
        kinds: dict[str, dict[str, list[int]]] = {"dtp": {}, "tt": {}}
        for r in log.records:
            kinds["dtp"].setdefault(r.kind, [0, 0])
            kinds["dtp"][r.kind][0] += 1
            kinds["dtp"][r.kind][1] += r.bytes
        for kind, b in counter.records:
            kinds["tt"].setdefault(kind, [0, 0])
            kinds["tt"][kind][0] += 1
            kinds["tt"][kind][1] += b
        times: dict[str, list[float]] = {k: [] for k in layers}
        for i in range(repeats):
            for label in list(layers)[i % len(layers):] + list(layers)[:i % len(layers)]:
                times[label].append(_timed(layers[label].step, None)[0])
        dist.barrier()
        out[name] = {"times": times, "kinds": kinds, "err": err}
    return out


# --------------------------------------------------------------------------- the report


def model_hidden(chunks: int, forward_share: float = 1 / 3) -> float:
    """The hidden share the pipe-experts schedule allows on the modelled link when the
    four all-to-all phases together take as long as the expert compute (1), backward
    computing twice what forward does, nothing else costing anything: every chunk's
    dispatch posted up front, chunk i computing once it has arrived and the one before
    has computed, its combine queued behind everything already on the one link; the
    same in backward. 0 for one chunk, 5/6 − 1/(2·chunks) from 3 chunks on (forward
    carries half the traffic past a third of the compute).

    >>> [round(model_hidden(n), 3) for n in (1, 2, 4, 8, 16)]
    [0.0, 0.5, 0.708, 0.771, 0.802]
    """
    d = 0.25 / chunks  # one chunk of one phase on the link
    exposed = 0.0
    for compute in (forward_share, 1 - forward_share):
        arrived = [d * (i + 1) for i in range(chunks)]
        link, t = arrived[-1], 0.0
        for i in range(chunks):
            t = max(t, arrived[i]) + compute / chunks
            link = max(t, link) + d
        exposed += max(t, link) - compute
    return 1 - exposed


def _slowest(res: list[dict], get) -> list[float]:
    """Per repeat, the slower rank's value."""
    return [max(vals) for vals in zip(*(get(r) for r in res))]


def _print_sweep(res: list[dict], args) -> None:
    print(f"(a) pipe-experts on ep=4 gloo ranks under simulated_link (latency {args.latency}s), fp32, per rank "
          f"{args.batch}x{args.seq} tokens, dim {args.dim}, hidden {args.hidden}, top-{args.top_k}; median of "
          f"{args.repeats}, slower rank")
    for name in args.scenarios:
        r0 = res[0][name]
        local = SCENARIOS[name] // EP
        print()
        print(f"[{name}: {local} local expert{'s' if local > 1 else ''}] link B = {r0['bandwidth'] / 1e6:.2f} MB/s "
              f"(token all-to-all bytes/step {int(r0['bytes'])}; the experts' fwd+bwd alone, no link, "
              f"{1e3 * r0['calib']:.1f} ms = comm)")
        print(f"{'option':<12}{'a2a':>5}{'compute':>9}{'comm':>8}{'ms':>8}{'exposed':>9}{'base':>7}{'hidden':>8}"
              f"{'net':>6}{'hid/dur':>9}{'model':>7}{'ratio':>7}{'speed-up':>10}{'(mins)':>8}")
        med = {}
        for label in r0["opts"]:
            m = {k: statistics.median(_slowest(res, lambda r, k=k: r[name]["opts"][label][k]))
                 for k in ("free", "base", "linked", "exposed", "comm", "dur")}
            med[label] = m
        mins = {label: min(_slowest(res, lambda r, k=label: r[name]["opts"][k]["linked"])) for label in r0["opts"]}
        for label in OPTIONS:
            if label in r0["skipped"]:
                reason = r0["skipped"][label].split(": ", 1)[-1]
                print(f"{label:<12}  n/a  {reason}")
                continue
            m, off = med[label], med["off"]
            print(f"{label:<12}{r0['n_a2a'][label]:>5}{1e3 * m['free']:>9.1f}{1e3 * m['comm']:>8.1f}"
                  f"{1e3 * m['linked']:>8.1f}{1e3 * m['exposed']:>9.1f}{1e3 * m['base']:>7.1f}"
                  f"{1 - m['exposed'] / m['comm']:>8.0%}{1 - (m['exposed'] - m['base']) / m['comm']:>6.0%}"
                  f"{1 - m['exposed'] / m['dur']:>9.0%}{model_hidden(r0['n_a2a'][label] // 4):>7.0%}"
                  f"{m['linked'] / max(m['free'], m['comm']):>7.2f}"
                  f"{off['linked'] / m['linked']:>10.2f}{mins['off'] / mins[label]:>8.2f}")
    print()
    print("a2a = token all-to-alls per fwd+bwd; compute = the option's fwd+bwd without the link; comm = link time of "
          "its a2a (latency + bytes/B); exposed / base = time blocked in its a2a with / without the link; hidden = "
          "1 - exposed/comm (goal >= 70%); net = 1 - (exposed - base)/comm; hid/dur = 1 - exposed/sum(completed - "
          "issued); model = the hidden share the schedule allows (model_hidden); ratio = ms / max(compute, comm); "
          "speed-up = off ms / ms; (mins) = the same of the fastest repeats")


def _print_titan(res: list[dict], args) -> None:
    print(f"(b) dtp moe_ffn (layouts.expert(), unpipelined) vs torchtitan 0.3.0 MoE + AllToAllTokenDispatcher, ep=4 "
          f"gloo ranks, no link, fp32, same weights/tokens; fwd+bwd median of {args.repeats}, slower rank")
    print(f"{'scenario':<10}{'dtp ms':>8}{'tt ms':>8}{'dtp/tt':>8}{'tt bf16':>9}{'dtp bytes':>11}{'tt bytes':>10}"
          f"{'bytes':>7}{'max|dy|':>10}")
    for name in args.scenarios:
        r0 = res[0][name]
        t = {k: statistics.median(_slowest(res, lambda r, k=k: r[name]["times"][k])) for k in r0["times"]}
        bd = sum(b for _, b in r0["kinds"]["dtp"].values())
        bt = sum(b for _, b in r0["kinds"]["tt"].values())
        print(f"{name:<10}{1e3 * t['dtp']:>8.1f}{1e3 * t['tt']:>8.1f}{t['dtp'] / t['tt']:>8.2f}"
              f"{1e3 * t['tt bf16']:>9.1f}"
              f"{bd:>11}{bt:>10}{bd / bt:>7.3f}{r0['err']:>10.1e}")
    print("collectives per fwd+bwd, rank 0 (kind count× bytes):")
    for name in args.scenarios:
        for who in ("dtp", "tt"):
            kinds = res[0][name]["kinds"][who]
            print(f"  {name:<9}{who:<4}" + ", ".join(f"{k} {c}× {b}" for k, (c, b) in sorted(kinds.items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024, help="each expert's hidden width")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--latency", type=float, default=0.0, help="modelled seconds per collective")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=["sweep", "torchtitan"], choices=["sweep", "torchtitan"])
    ap.add_argument("--quick", action="store_true", help="per rank 1x256 tokens, dim 128, hidden 256, 3 repeats")
    ap.add_argument("--ep-overlap", action="store_true",
                    help="instead: --ep-overlap vs without on 2 ranks (ep 2, pp 1; benchmarks/moe_ep_overlap.py, "
                         "its --ep-* shape flags; --repeats 7 or more)")
    import moe_ep_overlap  # this directory (sys.path[0] when run as a script)

    moe_ep_overlap.add_arguments(ap)
    args = ap.parse_args()
    if args.ep_overlap:
        moe_ep_overlap.run_bench(args)
        return
    if args.quick:
        args.batch, args.dim, args.hidden, args.repeats = 1, 128, 256, 3

    from dtp.testing import run

    shape = (args.batch, args.seq, args.dim, args.hidden, args.top_k, args.warmup, args.repeats)
    if "sweep" in args.parts:
        res = run(_sweep, *shape, args.latency, args.scenarios, world_size=EP, timeout=3600)
        _print_sweep(res, args)
    if "torchtitan" in args.parts:
        print()
        if not _titan_available():
            print(TITAN_MISSING)
            return
        res = run(_vs_titan, *shape, args.scenarios, world_size=EP, timeout=3600)
        _print_titan(res, args)


if __name__ == "__main__":
    main()
