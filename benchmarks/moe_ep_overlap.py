"""``--ep-overlap`` on a simulated link: one microbatch's expert all-to-alls under another
microbatch's compute (``layouts.expert(ep_overlap=True)``, dtp.strategies.ep_overlap),
2 gloo ranks, ep 2, pp 1 — the part of ``benchmarks/moe.py --ep-overlap``; with ``--ep-pp 2``
4 ranks, pp 2 × ep 2, under ``--ep-schedule`` (1f1b, interleaved v2 or dualpipev; on 2
cores: reported, not gated).

    python benchmarks/moe.py --ep-overlap            # ~2 minutes on 2 loaded cores
    python benchmarks/moe_ep_overlap.py --repeats 7  # the same
    python benchmarks/moe_ep_overlap.py --ep-pp 2 --ep-schedule dualpipev --ep-layers 4 --repeats 5

(dualpipev's 2·pp stages need ``--ep-layers`` ≥ 4 for a MoE block on each.)

One step = ``dtp.train_step`` (sgd, lr 0: the routing stays put) of a Llama MoE
(``tiny-moe`` widened: ``--ep-dim``, ``--ep-hidden`` per expert, ``--ep-layers`` every
one MoE, 2 experts on ep 2 — one local expert, top-2, multi_data 1) on ``--microbatches``
m microbatches of ``--ep-batch`` × ``--ep-seq`` tokens per rank. Every collective on ``ep`` runs
under ``dtp.comm.simulated_link(B, axes=("ep",))``, ``B`` calibrated so the step's token
all-to-alls (dispatch, combine and their backwards) take as long on the link as the
experts' fwd+bwd take to compute: ``moe.experts`` fwd+bwd on top_k × tokens rows, × m ×
the stage's layers (layers / pp), the fastest of several runs (load only ever adds), the
slower rank.

Four runs per repeat, in an order reversed every repeat: {plain, ep-overlap} × {no
link, link}. Reported (medians over the repeats, the slower rank of each):

* ``step``: the whole ``train_step`` (its gradient all-reduce over ep is on the link
  too, the same in both); ``fb``: from the step's start to its first ``grad reduce``
  collective (the microbatches alone);
* ``exposed``: Σ ``CommRecord.waited`` over the MoE all-to-alls (tags ``moe dispatch``,
  ``moe combine`` and their backwards, and the ``moe dispatch counts`` exchange: on the
  link it queues behind the token transfers), the time a rank sat blocked in them; ``added`` =
  exposed with the link − without it (what the link costs), against ``link`` = Σ bytes/B
  of the same records (what the link needs). Target: added ≤ 30 % of link;
* ``ratio``: ep-overlap's step / the plain step, both under the link. Target ≤ 0.85.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

WORLD = 2


def _is_moe_a2a(r) -> bool:
    return r.kind in ("all_to_all_v", "all_to_all") and r.tag.startswith("moe")


def _cfg(dim: int, hidden: int, layers: int):
    from dtp.models import llama

    return llama.config("tiny-moe", dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=hidden,
                        num_experts=WORLD, top_k=2, moe_ffn_dim=hidden, aux_loss_coeff=1e-2)


def _expert_seconds(cfg, rows: int, repeats: int) -> float:
    """fwd+bwd of one local expert on ``rows`` rows, the fastest of ``repeats``."""
    from dtp.ops import moe

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cfg.dim, generator=g).requires_grad_()
    ws = [torch.randn(1, cfg.dim, cfg.moe_ffn_dim, generator=g).requires_grad_(),
          torch.randn(1, cfg.dim, cfg.moe_ffn_dim, generator=g).requires_grad_(),
          torch.randn(1, cfg.moe_ffn_dim, cfg.dim, generator=g).requires_grad_()]
    grad = torch.randn(rows, cfg.dim, generator=g)
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        moe.experts(x, torch.tensor([rows]), *ws).backward(grad)
        best = min(best, time.perf_counter() - t0)
    return best


def _bench(dim: int, hidden: int, layers: int, batch: int, seq: int, m: int, warmup: int, repeats: int,
           pp: int = 1, schedule: str = "1f1b") -> dict:
    import torch.distributed as dist

    import dtp
    from dtp import layouts
    from dtp.models import llama

    torch.set_num_threads(1)
    cfg = _cfg(dim, hidden, layers)
    mesh = dtp.make_mesh(pp=pp, ep=WORLD) if pp > 1 else dtp.make_mesh(ep=WORLD)
    pipe = layouts.pipeline(schedule, virtual_stages=2 if schedule == "interleaved" else 1) if pp > 1 else None
    tok = torch.randint(0, cfg.vocab_size, (WORLD * m * batch, seq + 1), generator=torch.Generator().manual_seed(1))
    states, batches = {}, {}
    for label, on in (("plain", False), ("ep-overlap", True)):
        states[label] = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.sgd(0.0), mesh=mesh,
                                              layout=_layout(layouts, on, pipe),
                                              axes=llama.param_axes(cfg), axis_sizes=llama.axis_sizes(cfg))
        batches[label] = dtp.shard_batch({"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()},
                                         states[label])
    model = llama.sequential(cfg)

    def step(label: str, link: float | None) -> dict:
        ctx = dtp.comm.simulated_link(link, axes=("ep",)) if link else _nothing()
        with ctx:
            dist.barrier()
            with dtp.comm_log() as log:
                t0 = time.perf_counter()
                states[label], _ = dtp.train_step(model, states[label], batches[label], microbatches=m)
                dt = time.perf_counter() - t0
        a2a = [r for r in log.records if _is_moe_a2a(r)]
        reduce = [r.issued for r in log.records if r.tag == "grad reduce"]
        return {"step": dt, "fb": (min(reduce) if reduce else t0 + dt) - t0,
                "exposed": sum(r.waited for r in a2a), "bytes": sum(r.bytes for r in a2a), "n": len(a2a)}

    for _ in range(warmup):
        for label in states:
            step(label, None)
    nbytes = step("plain", None)["bytes"]
    compute = _expert_seconds(cfg, batch * seq * cfg.top_k, 3) * m * layers / pp  # one stage's layers
    agreed = torch.tensor([compute, nbytes], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank models the same link
    bandwidth = float(agreed[1] / agreed[0])
    runs = [(label, link) for label in states for link in (None, bandwidth)]
    rows: dict = {f"{label} {'link' if link else 'free'}": [] for label, link in runs}
    for i in range(repeats):
        for label, link in (runs if i % 2 == 0 else list(reversed(runs))):
            rows[f"{label} {'link' if link else 'free'}"].append(step(label, link))
    return {"rows": rows, "bandwidth": bandwidth, "expert": float(agreed[0]), "bytes": float(agreed[1])}


def _layout(layouts, on: bool, pipe):
    layout = layouts.data() + layouts.expert(ep_overlap=on)
    return layout if pipe is None else layout + pipe


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


def _slowest(res: list[dict], key: str, field: str) -> list[float]:
    return [max(r["rows"][key][i][field] for r in res) for i in range(len(res[0]["rows"][key]))]


def report(res: list[dict], args) -> dict:
    """Print the table; return the headline figures."""
    med = statistics.median
    bw, comm = res[0]["bandwidth"], res[0]["bytes"] / res[0]["bandwidth"]
    print(f"ep-overlap, ep {WORLD} pp {getattr(args, 'ep_pp', 1)} {getattr(args, 'ep_schedule', '')}, 1 local expert, top-2, dim {args.ep_dim}, expert hidden {args.ep_hidden}, "
          f"{args.ep_layers} MoE layers, m {args.microbatches} × {args.ep_batch}×{args.ep_seq} tokens per rank; "
          f"link {bw / 1e6:.1f} MB/s: token all-to-alls {1e3 * comm:.1f} ms/step on it, experts "
          f"{1e3 * res[0]['expert']:.1f} ms/step; medians of {args.repeats} alternated repeats, slower rank")
    print(f"{'run':<18}{'step ms':>9}{'fb ms':>8}{'exposed ms':>12}")
    for key in res[0]["rows"]:
        print(f"{key:<18}{1e3 * med(_slowest(res, key, 'step')):>9.1f}{1e3 * med(_slowest(res, key, 'fb')):>8.1f}"
              f"{1e3 * med(_slowest(res, key, 'exposed')):>12.1f}")
    out = {}
    for label in ("plain", "ep-overlap"):
        added = med(_slowest(res, f"{label} link", "exposed")) - med(_slowest(res, f"{label} free", "exposed"))
        out[label] = added / comm
        print(f"{label}: the link adds {1e3 * added:.1f} ms blocked in the all-to-alls = {100 * added / comm:.0f} % "
              f"of the link's {1e3 * comm:.1f} ms (target for ep-overlap <= 30 %)")
    out["ratio"] = med(_slowest(res, "ep-overlap link", "step")) / med(_slowest(res, "plain link", "step"))
    out["fb ratio"] = med(_slowest(res, "ep-overlap link", "fb")) / med(_slowest(res, "plain link", "fb"))
    print(f"step under the link, ep-overlap / plain: {out['ratio']:.2f} (target <= 0.85); microbatches alone "
          f"(to the first grad reduce): {out['fb ratio']:.2f}")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The shape flags (also ``benchmarks/moe.py --ep-overlap``'s: hence the ``ep-`` prefix)."""
    ap.add_argument("--ep-dim", dest="ep_dim", type=int, default=256)
    ap.add_argument("--ep-hidden", dest="ep_hidden", type=int, default=512, help="the expert's hidden width")
    ap.add_argument("--ep-layers", dest="ep_layers", type=int, default=2)
    ap.add_argument("--ep-batch", dest="ep_batch", type=int, default=2, help="sequences per rank per microbatch")
    ap.add_argument("--ep-seq", dest="ep_seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--ep-pp", dest="ep_pp", type=int, default=1, help="pipeline stages (2: 4 ranks)")
    ap.add_argument("--ep-schedule", dest="ep_schedule", default="1f1b", choices=("1f1b", "interleaved", "dualpipev"))


def run_bench(args) -> dict:
    import sys

    import cloudpickle

    from dtp.testing import run

    if __name__ != "__main__":  # imported (by moe.py, a test): the ranks cannot import it by name
        cloudpickle.register_pickle_by_value(sys.modules[__name__])

    res = run(_bench, args.ep_dim, args.ep_hidden, args.ep_layers, args.ep_batch, args.ep_seq, args.microbatches,
              args.warmup, args.repeats, args.ep_pp, args.ep_schedule, world_size=WORLD * args.ep_pp, timeout=3600)
    return report(res, args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    run_bench(ap.parse_args())


if __name__ == "__main__":
    main()
