"""ZeRO stage 3 on 2 gloo ranks: dtp vs PyTorch's FSDP2 (``fully_shard``) on the same
Llama, same weights, same batch — step time, bytes sent per rank, peak memory per rank.

    python benchmarks/zero_vs_fsdp.py --configs tiny small --seq 128 --batch 8 --repeats 7

One training step = forward + backward + AdamW (lr 1e-3, weight decay 0.01) update, fp32,
data parallel over dp=2 (each rank takes half of the global batch).

* dtp: ``layouts.data() + layouts.zero(3, bucket_mb=--bucket-mb, overlap_grad_reduce=True,
  overlap_param_gather=True)`` on ``make_mesh(dp=2)``, ``dtp.train_step`` with
  ``dtp.optim.adamw``. The default ``--bucket-mb 3`` gives about one bucket per
  transformer block of "small" (FSDP2's unit below).
* torch: the ``nn.Module`` Llama of ``tp_vs_torch.py`` (imported from it) with the weights
  of ``llama.init(cfg, seed=0)``, ``fully_shard`` on every transformer block and on the root
  (mesh = the same 1-D dp mesh, gloo CPU), ``torch.optim.AdamW``; the loss is the mean over
  the rank's half of the batch (FSDP averages gradients over dp, so the update is the one of
  the global mean). Step-0/1 losses of both are printed (torch: mean over the ranks).

Time: steps of the two alternate, each behind a barrier; an iteration's time is the slower
rank's; medians (and the ratio of the fastest iterations). No simulated link: loopback gloo.

Bytes: bytes *sent per rank* in one step with dtp.comm's ring conventions — all-gather
(n−1)×input, reduce-scatter (n−1)/n×input, all-reduce 2(n−1)/n×bytes. dtp's from
``dtp.comm_log()``; torch's by wrapping ``torch.distributed.all_gather_single``,
``reduce_scatter_single`` and ``all_reduce`` (what FSDP2's ``_fsdp_collectives`` calls)
during torch's step only.

Memory — peak per rank, not tracemalloc (which does not see torch's CPU allocations).
Each side is measured alone in freshly started rank processes (``dtp.testing.shutdown()``
in between). ``--warmup`` steps run, the resident set (VmRSS) is read, the kernel's
high-water mark is reset (``echo 5 > /proc/self/clear_refs``) and ``--mem-steps`` steps
run. Reported peak = ``state`` + ``transient``:

* ``state`` (exact): bytes of the distinct storages of the tensors that persist between
  steps on a rank — dtp: master slices + AdamW moments + the buckets gathered for the next
  forward during the update (``overlap_param_gather``; they are in the resident set after
  warm-up, so the transient below does not see them); torch: sharded parameters, their
  ``.grad`` (FSDP2 keeps them after ``step()``; ``zero_grad(set_to_none=True)`` runs at the
  start of the next step, as usual), AdamW ``exp_avg``/``exp_avg_sq``;
* ``transient`` (measured): VmHWM during the measured steps − VmRSS after warm-up —
  activations, gathered buckets / unsharded parameters, gradient and communication
  buffers at the step's worst moment. glibc is told to serve every allocation ≥ 128 KiB by
  ``mmap`` (``MALLOC_MMAP_THRESHOLD_=131072``, set before the ranks start) so that freed
  tensors leave RSS at once and RSS follows live tensor memory rather than the allocator's
  retained heap; it still counts page granularity and small allocations.

RSS above the level before the model was built is printed too, but is not the ratio: it
includes code and runtime buffers loaded lazily by the first step (tens of MiB), more than
the tensors of "tiny" or "small".

Not a test: times on a shared 2-core CPU are noisy; read the ratios.
"""

from __future__ import annotations

import os
import statistics
import sys
from functools import partial

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # before any rank process starts (see docstring)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import alternating_times, llama_step_parser  # noqa: E402
from tp_vs_torch import make_batch  # noqa: E402

LR, WD = 1e-3, 0.01


def _rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v, _kb = line.split()
                out[k[:-1]] = int(v) * 1024
    return out


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _TorchCounter:
    """Wraps the c10d calls FSDP2 makes; records (kind, bytes sent per rank) while on."""

    def __init__(self):
        import torch.distributed as dist

        self.records: list[tuple[str, int]] = []
        self.on = False
        self._orig = {}
        conv = {"all_gather_single": ("all_gather", lambda n, b: (n - 1) * b, 1),
                "reduce_scatter_single": ("reduce_scatter", lambda n, b: (n - 1) / n * b, 1),
                "all_reduce": ("all_reduce", lambda n, b: 2 * (n - 1) / n * b, 0)}
        for name, (kind, sent, arg) in conv.items():
            orig = getattr(dist, name)
            self._orig[name] = orig

            def wrapped(*args, _orig=orig, _kind=kind, _sent=sent, _arg=arg, **kwargs):
                if self.on:
                    x = args[_arg] if len(args) > _arg else kwargs.get("input" if _arg else "tensor")
                    n = dist.get_world_size(kwargs.get("group"))
                    self.records.append((_kind, int(round(_sent(n, x.numel() * x.element_size())))))
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapped)

    def restore(self) -> None:
        import torch.distributed as dist

        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def _storage_bytes(ts) -> int:
    """Bytes of the distinct storages behind ``ts`` (FSDP2's gradients are views of one
    reduce-scatter output per group: counted once)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in ts:
        st = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _setup(cfg, batch: dict, which: str, bucket_mb: float):
    """A step function for ``which`` ("dtp" or "torch") on this rank, and a probe of the
    tensors that persist between steps."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    import dtp
    from dtp.models import llama

    mesh = dtp.make_mesh(dp=2)
    if which == "dtp":
        layout = dtp.layouts.data() + dtp.layouts.zero(3, bucket_mb=bucket_mb, overlap_grad_reduce=True,
                                                       overlap_param_gather=True)
        state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(LR, weight_decay=WD), mesh=mesh,
                                      layout=layout, axes=llama.param_axes(cfg))
        box = {"state": state, "batch": dtp.shard_batch(batch, state)}
        loss_fn = partial(llama.loss, cfg=cfg)

        def step() -> float:
            box["state"], m = dtp.train_step(loss_fn, box["state"], box["batch"])
            return m["loss"]

        def state_bytes() -> int:
            st = box["state"]
            ts = [*st.strategy.master, *[x for x in torch.utils._pytree.tree_leaves(st.opt_state)
                                     if isinstance(x, torch.Tensor)]]
            if st.strategy.stage < 3:
                ts += st.strategy.buffers
            # Stage 3 with overlap_param_gather: the next forward's first buckets, gathered
            # during the update and held whole until that forward takes them.
            ts += st.strategy.pending.held()
            return _storage_bytes(ts)

        return step, state_bytes, box

    from torch.distributed.fsdp import fully_shard
    from tp_vs_torch import TorchLlama

    model = TorchLlama(cfg).load_dtp(llama.init(cfg, seed=0))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    r, n = dist.get_rank(), dist.get_world_size()
    per = batch["tokens"].shape[0] // n
    tokens, targets = batch["tokens"][r * per:(r + 1) * per], batch["targets"][r * per:(r + 1) * per]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        opt.step()
        return float(loss.detach())

    def state_bytes() -> int:
        ts = []
        for p in model.parameters():
            ts.append(p)
            if p.grad is not None:
                ts.append(p.grad)
        for s in opt.state.values():
            ts += [v for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        return _storage_bytes(ts)

    return step, state_bytes, {"model": model}


def _bench(cfg, batch: dict, bucket_mb: float, warmup: int, repeats: int) -> dict:
    import torch.distributed as dist

    import dtp

    torch.set_num_threads(1)
    steps, extra = {}, {}
    for which in ("dtp", "torch"):
        steps[which], _sb, extra[which] = _setup(cfg, batch, which, bucket_mb)
    counter = _TorchCounter()
    losses = {"dtp": [], "torch": []}
    try:
        for _ in range(max(2, warmup)):
            for which in ("dtp", "torch"):
                losses[which].append(steps[which]())
        # Bytes of a steady-state step (dtp's first step reads the replicated initial
        # parameters and gathers nothing; its buckets are fixed from step 2 on).
        with dtp.comm_log() as log:
            losses["dtp"].append(steps["dtp"]())
        counter.on = True
        losses["torch"].append(steps["torch"]())
        counter.on = False
        times = alternating_times(steps, repeats)
    finally:
        counter.restore()
    # torch's losses are per rank (its half of the batch): mean over ranks = the global loss.
    tl = torch.tensor(losses["torch"][:2], dtype=torch.float64)
    dist.all_reduce(tl)
    return dict(times=times, dtp_losses=losses["dtp"][:2], torch_losses=(tl / dist.get_world_size()).tolist(),
                dtp_recs=[(r.kind, r.bytes) for r in log.records], torch_recs=counter.records,
                buckets=len(extra["dtp"]["state"].strategy.plan.buckets))


def _memory(cfg, batch: dict, which: str, bucket_mb: float, warmup: int, steps: int) -> dict:
    import gc

    torch.set_num_threads(1)
    gc.collect()
    before = _rss()["VmRSS"]
    step, state_bytes, _keep = _setup(cfg, batch, which, bucket_mb)
    for _ in range(warmup):
        step()
    gc.collect()
    after_warmup = _rss()["VmRSS"]
    ok = _reset_hwm()
    for _ in range(steps):
        step()
    now = _rss()
    return dict(peak=now["VmHWM"] - before, transient=now["VmHWM"] - after_warmup, resident=now["VmRSS"] - before,
                state=state_bytes(), hwm_reset=ok)


def _sum_by_kind(recs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for kind, b in recs:
        out.setdefault(kind, [0, 0])
        out[kind][0] += 1
        out[kind][1] += b
    return out


def main() -> None:
    ap = llama_step_parser(__doc__, repeats=7)
    ap.add_argument("--bucket-mb", type=float, default=3.0)
    ap.add_argument("--mem-steps", type=int, default=3)
    args = ap.parse_args()
    from dtp.models import llama
    from dtp.testing import run, shutdown

    rows = []
    for name in args.configs:
        cfg = llama.config(name)
        batch = make_batch(cfg, args.batch, args.seq)
        res = run(_bench, cfg, batch, args.bucket_mb, args.warmup, args.repeats, world_size=2, timeout=1800)
        r0 = res[0]
        print(f"[{name}] losses step 0, 1: dtp {r0['dtp_losses'][0]:.7f}, {r0['dtp_losses'][1]:.7f}  "
              f"torch {r0['torch_losses'][0]:.7f}, {r0['torch_losses'][1]:.7f}; dtp buckets {r0['buckets']}")
        for who, recs in (("dtp", r0["dtp_recs"]), ("torch", r0["torch_recs"])):
            parts = ", ".join(f"{k} {c}× {b}" for k, (c, b) in sorted(_sum_by_kind(recs).items()))
            print(f"[{name}] {who:<5} collectives per step (bytes sent per rank): {parts}")
        per_iter = {k: [max(rk["times"][k][i] for rk in res) for i in range(args.repeats)] for k in ("dtp", "torch")}
        t = {k: statistics.median(v) for k, v in per_iter.items()}
        t.update({f"{k}_min": min(v) for k, v in per_iter.items()})
        db, tb = sum(b for _k, b in r0["dtp_recs"]), sum(b for _k, b in r0["torch_recs"])
        mem = {}
        for which in ("dtp", "torch"):
            shutdown()  # fresh rank processes: no allocator history from the other side
            m = run(_memory, cfg, batch, which, args.bucket_mb, args.warmup, args.mem_steps, world_size=2,
                    timeout=1800)
            mem[which] = {k: max(rk[k] for rk in m) for k in ("peak", "resident", "transient", "state")}
            mem[which]["total"] = max(rk["state"] + rk["transient"] for rk in m)
            if not all(rk["hwm_reset"] for rk in m):
                print(f"[{name}] {which}: could not reset VmHWM; peak includes initialisation")
        for which in ("dtp", "torch"):
            mm = mem[which]
            print(f"[{name}] {which:<5} memory per rank (max over ranks): state tensors {mm['state'] / 2**20:.2f} MiB, "
                  f"step peak above resident {mm['transient'] / 2**20:.1f} MiB, peak = state + that "
                  f"{mm['total'] / 2**20:.1f} MiB; (RSS above pre-build: peak {mm['peak'] / 2**20:.1f} MiB, "
                  f"after steps {mm['resident'] / 2**20:.1f} MiB, incl. lazily loaded code and runtime buffers)")
        rows.append((name, cfg, t, db, tb, mem))
    print()
    print(f"gloo, ZeRO-3 / FSDP2 over dp=2 ranks (1 thread each), fp32, AdamW, batch {args.batch}, seq {args.seq}; "
          f"time: median of {args.repeats} steps after {args.warmup} warm-up; ratio = dtp / torch")
    print(f"{'config':<8}{'params':>9}{'dtp ms':>9}{'torch ms':>10}{'time':>7}{'(mins)':>8}"
          f"{'dtp bytes':>12}{'torch bytes':>13}{'bytes':>9}{'dtp MiB':>9}{'torch MiB':>10}{'peak':>7}"
          f"{'state':>7}")
    for name, cfg, t, db, tb, mem in rows:
        print(f"{name:<8}{llama.param_count(cfg):>9}{1e3 * t['dtp']:>9.1f}{1e3 * t['torch']:>10.1f}"
              f"{t['dtp'] / t['torch']:>7.2f}{t['dtp_min'] / t['torch_min']:>8.2f}"
              f"{db:>12}{tb:>13}{db / max(1, tb):>9.4f}"
              f"{mem['dtp']['total'] / 2**20:>9.1f}{mem['torch']['total'] / 2**20:>10.1f}"
              f"{mem['dtp']['total'] / mem['torch']['total']:>7.2f}{mem['dtp']['state'] / mem['torch']['state']:>7.2f}")
    print("MiB = peak memory per rank = persistent state tensors (exact) + the steps' RSS high-water mark above "
          "the resident set after warm-up; peak = its ratio; state = ratio of the persistent tensor bytes alone")


if __name__ == "__main__":
    main()
