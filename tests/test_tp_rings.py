"""The hop schedules of async tp (``dtp.ops.tp_rings``), one-way and bidirectional, on
rings of 2 to 5 gloo ranks: the ring all-gather hands every shard (or both halves of it)
to the caller exactly once and equals the gathered tensor; the dual ring equals the
reduce-scatter of the sum in fp64; each sends the collective's bytes per rank, in
``n - 1`` one-way hops or two hops a step over ``n // 2`` steps."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import dtp
from dtp.ops.tp_rings import both_ways, gather_ring, one_way, piece, scatter_ring
from dtp.testing import run

DIM = 1  # the ring's dim, as the sequence dim of (batch, seq, embed)


def _tensors(n: int, rows: int, seed: int) -> torch.Tensor:
    """(n, batch, n * rows, embed): rank r's term tensor; its chunk r is rank r's shard."""
    return torch.randn(n, 2, n * rows, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _rings(n: int, rows: int, bidirectional: bool):
    if dist.get_world_size() == n:
        return _ring(dtp.make_mesh(tp=n), rows, bidirectional)
    # A ring of n on the first n ranks of a larger pool (tp3 on the pool of 4: a pool of 3
    # would start for this case alone, ~10 s). Every rank joins the group's creation; the
    # ranks outside the ring then return None.
    mesh = DeviceMesh("cpu", torch.arange(n), mesh_dim_names=("tp",))
    if dist.get_rank() >= n:
        return None
    try:
        return _ring(mesh, rows, bidirectional)
    finally:
        dist.destroy_process_group(mesh.get_group("tp"))


def _ring(mesh: DeviceMesh, rows: int, bidirectional: bool):
    n, me = mesh.size(0), mesh.get_local_rank(0)
    full = _tensors(n, rows, seed=n)
    whole = torch.cat([piece(full[r], DIM, n, r) for r in range(n)], DIM)  # every rank's shard, gathered
    got = torch.full_like(whole, float("nan"))
    seen: list[tuple[int, int | None]] = []

    def use(c: int, part: int | None, x: torch.Tensor) -> None:
        seen.append((c, part))
        piece(got, DIM, n, c, part).copy_(x)

    with dtp.comm_log() as gather_log:
        gather_ring(piece(full[me], DIM, n, me).contiguous(), n, me, mesh, "tp", DIM, "test", use,
                    bidirectional=bidirectional)
    with dtp.comm_log() as scatter_log:
        out = scatter_ring(lambda c, part: piece(full[me], DIM, n, c, part), n, me, mesh, "tp", DIM, "test",
                           bidirectional=bidirectional)
    want = piece(full.sum(0), DIM, n, me)
    return dict(gathered=(got - whole).abs().max().item(),
                scattered=((out - want).abs().max() / want.abs().max()).item(),
                seen=sorted(seen, key=lambda cp: (cp[0], -1 if cp[1] is None else cp[1])),
                gather=(len(gather_log), gather_log.summary()), scatter=(len(scatter_log), scatter_log.summary()),
                shard_bytes=whole.numel() * 8 // n)


# (n, rows per shard): bidirectional with halves (even n), with whole shards (odd n), and
# one-way where halves would not split evenly (odd rows, even n) or n = 2.
# A ring of 5 is one more pool of ranks: slow.
CASES = [(2, 2), (3, 3), (4, 2), (4, 3), pytest.param(5, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("n,rows", CASES, ids=["tp2 rows2", "tp3 rows3", "tp4 rows2", "tp4 rows3", "tp5 rows2"])
def test_rings_equal_the_collectives_with_their_bytes(n, rows):
    bidirectional = both_ways(n, rows)
    assert bidirectional == (n >= 3 and (n % 2 == 1 or rows % 2 == 0))
    for mode in sorted({False, bidirectional}):  # one-way always works, bidirectional where chosen
        pool = 4 if n == 3 else n  # the ring of 3 on the pool of 4 (see _rings)
        res = run(_rings, n, rows, mode, world_size=pool)
        assert res[n:] == [None] * (pool - n)
        res = res[:n]
        for me, r in enumerate(res):
            what = f"tp{n} rows{rows} {'bidirectional' if mode else 'one-way'} rank {me}"
            assert r["gathered"] == 0.0, what
            assert r["scattered"] <= 1e-10, what
            halves = mode and n % 2 == 0
            opposite = (me + n // 2) % n
            want = [(c, None) for c in range(n) if not (halves and c == opposite)]
            want += [(opposite, 0), (opposite, 1)] if halves else []
            assert r["seen"] == sorted(want, key=lambda cp: (cp[0], -1 if cp[1] is None else cp[1])), what
            hops = 2 * (n // 2) if mode else n - 1  # two a step (n // 2 steps), or n - 1
            for name in ("gather", "scatter"):
                count, summary = r[name]
                assert count == hops, (what, name, count)
                assert summary == {"tp": {"send_recv": (n - 1) * r["shard_bytes"]}}, (what, name, summary)


def test_one_way_forces_one_way_and_ring_of_two_is_one_way():
    assert both_ways(4, 2) and both_ways(3, 1) and not both_ways(2, 2)
    with one_way():
        assert not both_ways(4, 2) and not both_ways(3, 1)
    assert both_ways(4, 2)
