"""Reshard throughput on gloo: dtp vs the raw torch.distributed collective moving the
same bytes, and dtp vs DTensor's own ``redistribute`` for Shard(i) → Shard(j).

    python benchmarks/reshard.py --world-size 4 --mb 4 16 --repeats 7

Prints medians of ``--repeats`` timed runs (after a warm-up) and ratios measured side by
side in one run. Not a test: numbers on a shared 2-core machine are noisy; compare ratios.
"""

from __future__ import annotations

import argparse

import torch


def _bench(world: int, mb: float, repeats: int) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.debug import CommDebugMode

    import dtp
    from dtp import P

    mesh = dtp.make_mesh(a=world)
    group = mesh.get_group("a")
    n = int(mb * 2**20 / 4)
    rows = world * world * 16
    cols = max(world, (n // rows) // world * world)
    g = torch.randn(rows, cols)
    local_bytes = g.numel() * 4 // world

    def timeit(fn) -> float:
        from _common import median_time

        return median_time(fn, repeats)

    out = []
    x_rows = dtp.shard(g, mesh, P("a"))
    loc = x_rows.to_local().contiguous()
    # all-gather: Shard(0) -> Replicate
    buf = torch.empty(g.shape)
    t_dtp = timeit(lambda: dtp.reshard(x_rows, P()))
    t_raw = timeit(lambda: dist.all_gather_into_tensor(buf, loc, group=group))
    out.append(dict(op="all_gather  S(0)->R", dtp=t_dtp, other=t_raw, vs="raw c10d"))
    # reduce-scatter: Partial -> Shard(0)
    xp = dtp.shard(g, mesh, P(partial="a"))
    full = xp.to_local().contiguous()
    rs = torch.empty(loc.shape)
    t_dtp = timeit(lambda: dtp.reshard(xp, P("a")))
    t_raw = timeit(lambda: dist.reduce_scatter_tensor(rs, full, group=group))
    out.append(dict(op="reduce_scatter P->S(0)", dtp=t_dtp, other=t_raw, vs="raw c10d"))
    # all-to-all: Shard(0) -> Shard(1)
    a2a = torch.empty_like(loc)
    t_dtp = timeit(lambda: dtp.reshard(x_rows, P(None, "a")))
    t_raw = timeit(lambda: dist.all_to_all_single(a2a, loc, group=group))
    out.append(dict(op="all_to_all  S(0)->S(1)", dtp=t_dtp, other=t_raw, vs="raw c10d"))
    # dtp vs DTensor's own redistribute for the same Shard(0) -> Shard(1)
    t_dt = timeit(lambda: x_rows.redistribute(mesh, [Shard(1)]))
    with CommDebugMode() as seen:
        x_rows.redistribute(mesh, [Shard(1)])
    with dtp.comm_log() as log:
        dtp.reshard(x_rows, P(None, "a"))
    ops = {str(k).split(".")[-1]: v for k, v in seen.get_comm_counts().items()}
    # DTensor's bytes from the collectives it ran (counted per op by CommDebugMode).
    per_op = {"all_gather_into_tensor": (world - 1) * local_bytes, "_allgather_base_": (world - 1) * local_bytes,
              "all_to_all_single": (world - 1) * local_bytes // world, "alltoall_base_": (world - 1) * local_bytes // world}
    dt_bytes = sum(per_op.get(k, 0) * v for k, v in ops.items())
    out.append(dict(op="S(0)->S(1) vs DTensor", dtp=t_dtp, other=t_dt, vs=f"DTensor {ops}",
                    dtp_bytes=log.bytes(), other_bytes=dt_bytes))
    for r in out:
        r["mb"] = round(g.numel() * 4 / 2**20, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--mb", type=float, nargs="+", default=[4.0, 16.0], help="global tensor sizes in MiB")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from dtp.testing import run

    print(f"gloo, {args.world_size} ranks, median of {args.repeats}; ratio = dtp / other (lower is better)")
    print(f"{'op':<24}{'MiB':>7}{'dtp ms':>10}{'other ms':>10}{'ratio':>8}  other / bytes")
    for mb in args.mb:
        for r in run(_bench, args.world_size, mb, args.repeats, world_size=args.world_size, timeout=1200)[0]:
            extra = r["vs"]
            if "dtp_bytes" in r:
                extra += f"; bytes/rank dtp {r['dtp_bytes']} vs DTensor {r['other_bytes']} (ratio {r['dtp_bytes'] / max(1, r['other_bytes']):.3f})"
            print(f"{r['op']:<24}{r['mb']:>7}{1e3 * r['dtp']:>10.2f}{1e3 * r['other']:>10.2f}{r['dtp'] / r['other']:>8.2f}  {extra}")


if __name__ == "__main__":
    main()
