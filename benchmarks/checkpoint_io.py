"""Checkpoints: what a saving step costs (sync vs async), save/load MB/s per rank, and the
peak memory a save adds on a rank.

    python benchmarks/checkpoint_io.py --dim 512 --layers 8 --repeats 5

Two gloo ranks, a Llama of the given shape in fp32 with AdamW, for each layout: dp2 ZeRO-1,
tp2 + SP, dp2 ZeRO-3. After warm-up, rounds of three kinds of step, the order rotated
each round, a barrier before each:

* ``step``: a plain ``train_step``;
* ``sync``: a step, then ``dtp.checkpoint.save`` (the loop waits for the files);
* ``async``: a step, then ``save(..., async_save=True)`` — the loop is blocked only while
  the tensors are staged — then one more step while the files are written, then
  ``wait()``; reported: the blocked time, that next step's time, and the wait left.

Throughput per rank: the bytes of the files this rank wrote (``__<rank>_*.distcp``) over
the sync save's time; load: the same checkpoint into a fresh state of the same layout,
the bytes of the rank's blocks of every tensor over the load time. **Peak**: the CPU
allocator's peak live bytes during a sync save (``torch.profiler`` memory events), next to
this rank's state (parameters + optimizer state it holds): under ZeRO the parameters are
written straight from the master slices as rectangles, so a save stages at most a copy of
the rank's slices in the parameters' dtype. Files go to ``--dir`` (default: a temporary
directory). Medians over ``--repeats`` rounds; not a test.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optree  # noqa: E402
import torch  # noqa: E402

import dtp  # noqa: E402
from dtp.models import llama  # noqa: E402
from dtp.testing import run  # noqa: E402

LAYOUTS = {
    "dp2 zero1": ({"dp": 2}, lambda: dtp.layouts.data() + dtp.layouts.zero(stage=1)),
    "tp2 sp": ({"tp": 2}, lambda: dtp.layouts.megatron(sequence_parallel=True)),
    "dp2 zero3": ({"dp": 2}, lambda: dtp.layouts.data() + dtp.layouts.zero(stage=3)),
}


def _held_bytes(state: dtp.TrainState) -> int:
    """Bytes of parameters and optimizer state this rank holds."""
    leaves = optree.tree_leaves(state, namespace="dtp")
    local = [x.to_local() if isinstance(x, torch.distributed.tensor.DTensor) else x for x in leaves]
    seen, total = set(), 0
    for t in local:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _bench(name: str, dim: int, layers: int, repeats: int, root: str) -> dict[str, float]:
    from _common import peak_bytes

    torch.set_num_threads(1)
    axes, layout = LAYOUTS[name]
    cfg = llama.config("small", dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4, ffn_dim=3 * dim)
    mesh = dtp.make_mesh(**axes)
    state = dtp.TrainState.create(llama.init(cfg, seed=0), dtp.optim.adamw(1e-3), mesh=mesh, layout=layout(),
                                  axes=llama.param_axes(cfg))
    tok = torch.randint(0, cfg.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0))
    batch = dtp.shard_batch({"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}, state)
    loss = functools.partial(llama.loss, cfg=cfg)
    rank = torch.distributed.get_rank()

    def step() -> None:
        nonlocal state
        state, _ = dtp.train_step(loss, state, batch)

    for _ in range(2):
        step()
    times: dict[str, list[float]] = {k: [] for k in ("step", "sync", "blocked", "next", "wait", "save", "load")}
    written: list[int] = []

    def plain() -> None:
        t0 = time.perf_counter()
        step()
        times["step"].append(time.perf_counter() - t0)

    def sync() -> None:
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        path = dtp.checkpoint.save(state, root + "/sync", keep=1)
        t2 = time.perf_counter()
        times["sync"].append(t2 - t0)
        times["save"].append(t2 - t1)
        written.append(sum(p.stat().st_size for p in Path(path).glob(f"__{rank}_*.distcp")))

    def asynchronous() -> None:
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        pending = dtp.checkpoint.save(state, root + "/async", keep=1, async_save=True)
        t2 = time.perf_counter()
        step()
        t3 = time.perf_counter()
        pending.wait()
        t4 = time.perf_counter()
        times["blocked"].append(t2 - t1)
        times["next"].append(t3 - t2)
        times["wait"].append(t4 - t3)

    kinds = [plain, sync, asynchronous]
    for r in range(repeats):
        for fn in kinds[r % 3:] + kinds[:r % 3]:
            torch.distributed.barrier()
            fn()
    for _ in range(repeats):
        like = dtp.TrainState.create(llama.init(cfg, seed=1), dtp.optim.adamw(1e-3), mesh=mesh, layout=layout(),
                                     axes=llama.param_axes(cfg))
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loaded, _ = dtp.checkpoint.load(root + "/sync", like=like)
        times["load"].append(time.perf_counter() - t0)
    held = _held_bytes(state)
    torch.distributed.barrier()
    peak = peak_bytes(lambda: dtp.checkpoint.save(state, root + "/peak", keep=1))
    dtp.wait(state)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    mb = statistics.median(written) / 2**20
    return {**med, "written_mb": mb, "save_mb_s": mb / (med["save"] / 1e3),
            "load_mb_s": mb / (med["load"] / 1e3), "held_mb": held / 2**20, "peak_mb": peak / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="dtp-ckpt-bench-")
    print(f"{'layout':<11}{'step ms':>9}{'+sync':>9}{'+async':>9}{'next':>8}{'wait':>8}"
          f"{'MB/rank':>9}{'save MB/s':>10}{'load MB/s':>10}{'held MB':>9}{'save peak MB':>13}")
    try:
        for name in args.layouts:
            per_rank = run(_bench, name, args.dim, args.layers, args.repeats, f"{root}/{name.replace(' ', '_')}",
                           world_size=2, timeout=1800)
            r = max(per_rank, key=lambda x: x["sync"])
            print(f"{name:<11}{r['step']:>9.1f}{r['sync']:>9.1f}{r['step'] + r['blocked']:>9.1f}{r['next']:>8.1f}"
                  f"{r['wait']:>8.1f}{r['written_mb']:>9.1f}{r['save_mb_s']:>10.0f}{r['load_mb_s']:>10.0f}"
                  f"{r['held_mb']:>9.1f}{r['peak_mb']:>13.1f}", flush=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
