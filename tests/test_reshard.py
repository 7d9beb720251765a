"""reshard: every spec to every spec, values and gradients, and the bytes it moves."""

import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import dtp
from dtp import P
from dtp.core._torch import StridedShard
from dtp.redistribute import reshard_steps
from dtp.spec import to_placements
from dtp.testing import run, simulate
from spec_cases import all_specs, covering_pairs, spec_pairs


def _check_pairs(axes: dict[str, int], pairs: list[tuple[P, P]]) -> int:
    mesh = dtp.make_mesh(**axes)
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(8, 8, dtype=torch.float64, generator=gen)
    w = torch.randn(8, 8, dtype=torch.float64, generator=gen)  # d loss / d x = w
    for src, dst in pairs:
        x = dtp.shard(g, mesh, src).requires_grad_(True)
        y = dtp.reshard(x, dst)
        assert dtp.spec_of(y) == dst
        # One gather serves the value check and the backward: a second full_tensor() for
        # the backward made the 324 pairs on 2 × 2 take 6.2-7.7 s against 5.1-5.3 s
        # (measured on torch 2.13, 2 cores).
        whole = y.full_tensor()
        torch.testing.assert_close(whole.detach(), g, rtol=1e-12, atol=1e-12, msg=lambda m: f"{src}->{dst}: {m}")
        # A non-uniform upstream gradient exercises the backward redistribution.
        (whole * w).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), w, rtol=1e-12, atol=1e-12,
                                   msg=lambda m: f"grad {src}->{dst}: {m}")
    return len(pairs)


def test_every_pair_on_2x2():
    pairs = spec_pairs(all_specs(("a", "b"), 2), None)
    assert run(_check_pairs, {"a": 2, "b": 2}, pairs, world_size=4) == [324] * 4


def _placement_kinds(axes: dict[str, int], specs: list[P]) -> dict[P, tuple[str, ...]]:
    """Per spec, the kind of placement DTensor holds on each mesh axis (in mesh order):
    R(eplicate), S(hard) or strided (``_StridedShard``) with the tensor dim, or P(artial)."""
    names = {Replicate: "R", Shard: "S", StridedShard: "strided", Partial: "P"}
    with simulate(math.prod(axes.values())):
        mesh = dtp.make_mesh(**axes)
        return {s: tuple(names[type(p)] + (str(p.dim) if isinstance(p, (Shard, StridedShard)) else "")
                         for p in to_placements(s, mesh)) for s in specs}


@pytest.mark.slow  # a world of 8 (~22 s on 2 cores); every pair on 2 × 2 is the default run's
def test_pairs_on_2x2x2():
    """A default-run slice of the 92² = 8,464 pairs on the 2×2×2 mesh (all of them: the
    slow test below), values and gradients on real gloo ranks.

    The slice: the 36 pairs that :func:`spec_cases.covering_pairs` picks (greedy set cover
    over a seed-0 shuffle of all pairs) so that every (mesh axis, from-kind, to-kind)
    triple that any pair has is covered, plus 20 seeded random pairs. A kind is the
    placement DTensor holds on that axis, with its dim: R, S0, S1, strided0, strided1, P.
    Axes a and b take all six, so 36 from→to pairs each; c takes four (it is never
    strided: that needs a more major axis later in mesh order, and c is last), 16 pairs —
    88 triples in all. 36 pairs is the fewest that can cover them (each pair shows one
    triple per axis, and a alone has 36); 60 random pairs alone cover 69 of the 88."""
    axes = {"a": 2, "b": 2, "c": 2}
    specs = all_specs(tuple(axes), 2)
    kinds = _placement_kinds(axes, specs)

    def triples(pair):
        return {(axis, src, dst) for axis, src, dst in zip(axes, kinds[pair[0]], kinds[pair[1]])}

    every = set().union(*(triples((a, b)) for a in specs for b in specs))
    per_axis = {axis: {src for x, src, _ in every if x == axis} for axis in axes}
    assert per_axis["a"] == per_axis["b"] == {"R", "S0", "S1", "strided0", "strided1", "P"}
    assert per_axis["c"] == {"R", "S0", "S1", "P"}
    assert len(every) == 6 * 6 + 6 * 6 + 4 * 4 == 88  # every from→to pair of kinds occurs
    cover = covering_pairs(specs, triples, seed=0)
    assert len(cover) == 36
    pairs = cover + spec_pairs(specs, 20, seed=1)
    assert set().union(*map(triples, pairs)) == every  # the coverage the docstring claims
    assert run(_check_pairs, axes, pairs, world_size=8) == [len(pairs)] * 8


def _a2a_bytes(axes: dict[str, int], axis: str, shape: tuple[int, ...], src: P, dst: P):
    mesh = dtp.make_mesh(**axes)
    x = dtp.shard(torch.randn(shape, generator=torch.Generator().manual_seed(1)), mesh, src)
    with dtp.comm_log() as log:
        y = dtp.reshard(x, dst)
    assert torch.equal(y.full_tensor(), x.full_tensor())
    return [(r.kind, r.axis, r.bytes) for r in log.records]


@pytest.mark.parametrize("axes, axis, src, dst", [
    ({"a": 4}, "a", P("a", None, None), P(None, None, "a")),
    ({"a": 4}, "a", P(None, "a"), P("a")),
    ({"a": 2, "b": 2}, "b", P("a", "b"), P(("a", "b"))),
    ({"a": 2, "b": 2}, "a", P(None, "a", "b"), P("a", None, "b")),
])
def test_shard_to_shard_is_one_all_to_all_of_the_right_volume(axes, axis, src, dst):
    shape = (8, 16, 4)[: max(len(src.dims), len(dst.dims), 2)]
    numel, ws = torch.Size(shape).numel(), 4
    records = run(_a2a_bytes, axes, axis, shape, src, dst, world_size=4)
    n = axes[axis]
    # Per rank the local shard holds numel/ws elements; all but 1/n of it leaves the rank.
    expected = (n - 1) * numel * 4 // (n * ws)
    if n == ws:
        assert expected == (ws - 1) * numel * 4 // ws**2  # the formula on a 1-D mesh
    for rank_records in records:
        assert rank_records == [("all_to_all", axis, expected)], rank_records  # never all-gather


def test_plans_use_the_cheapest_collective():
    assert reshard_steps(P("tp"), P(None, "tp"), 2) == [dtp.redistribute.Step("all_to_all", "tp", 0, 1)]
    assert [s.kind for s in reshard_steps(P(partial="tp"), P("tp"), 1)] == ["reduce_scatter"]
    assert [s.kind for s in reshard_steps(P(partial="tp"), P(), 1)] == ["all_reduce"]
    assert [s.kind for s in reshard_steps(P("tp"), P(), 1)] == ["all_gather"]
    assert [s.kind for s in reshard_steps(P(), P("tp"), 1)] == ["slice"]
    assert [s.kind for s in reshard_steps(P(), P(partial="tp"), 1)] == ["zero"]
    # reduce before gathering: the all-reduce runs on the smaller shard
    sizes = {"dp": 2, "tp": 2}
    assert [s.kind for s in reshard_steps(P("dp", partial="tp"), P(), 1, sizes)] == ["all_reduce", "all_gather"]
    # removing a major axis of a tuple goes through the minor one first
    assert [s.kind for s in reshard_steps(P(("dp", "tp")), P("tp"), 1)] == ["all_gather", "all_gather", "slice"]


def _log_and_async(axes):
    mesh = dtp.make_mesh(**axes)
    x = torch.arange(8.0) + dtp.mesh.axis_names(mesh).index("a")
    with dtp.comm_log() as outer:
        with dtp.comm_log() as inner:
            h = dtp.comm.all_gather(x, mesh, "a", async_op=True, tag="t")
            out = h.wait()
        dtp.comm.all_reduce(x, mesh, "a")
    r = inner.records[0]
    return (len(outer), len(inner), r.kind, r.tag, r.async_op, r.completed is not None and r.completed >= r.issued,
            tuple(out.shape), outer.summary())


def test_comm_log_nests_and_records_async_completion():
    res = run(_log_and_async, {"a": 2}, world_size=2)[0]
    assert res[:7] == (2, 1, "all_gather", "t", True, True, (16,))
    assert res[7] == {"a": {"all_gather": 32, "all_reduce": 32}}


def _async_reduce_scatter_runs_in_background():
    import time

    import torch.distributed as dist

    mesh = dtp.make_mesh(a=4)
    rank = dist.get_rank()
    x = torch.arange(12.0, dtype=torch.float64).reshape(4, 3) * (rank + 1)
    with dtp.comm_log() as log:
        h = dtp.comm.reduce_scatter(x, mesh, "a", async_op=True, tag="grad")
        deadline = time.monotonic() + 10
        while not h.is_completed() and time.monotonic() < deadline:  # nobody waits on it
            time.sleep(0.001)
        done_unwaited = h.is_completed()
        got = h.wait()
    return done_unwaited, got, log.records[0].completed is not None, log.bytes()


def test_async_reduce_scatter_completes_without_a_wait():
    # Overlap needs the collective to run while the caller computes; gloo's own
    # reduce-scatter only runs inside wait(), so dtp posts an all-to-all there.
    res = run(_async_reduce_scatter_runs_in_background, world_size=4)
    total = sum(r + 1 for r in range(4))
    for rank, (done, got, recorded, nbytes) in enumerate(res):
        assert done and recorded
        assert torch.equal(got, (torch.arange(12.0, dtype=torch.float64).reshape(4, 3) * total)[rank:rank + 1])
        assert nbytes == 3 * 3 * 8  # (n-1)/n of the 4x3 fp64 input: a reduce-scatter's volume


@pytest.mark.slow  # ~4 CPU-minutes: run with `python -m pytest -m slow`
def test_every_pair_on_2x2x2_simulated():
    """All 92² spec pairs on a 2×2×2 mesh, values checked rank by rank (one process).

    Gradients need no separate sweep: the backward of src → dst is itself a reshard from
    the gradient's spec to src without its pending sums — another pair of this set — and
    the autograd wiring is checked on real gloo ranks above.
    """
    from dtp.testing import rank_values, simulate

    specs = all_specs(("a", "b", "c"), 2)
    g = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with simulate(8):
        mesh = dtp.make_mesh(a=2, b=2, c=2)
        placed = {s: dtp.shard(g, mesh, s) for s in specs}
        for src in specs:
            for dst in specs:
                got = rank_values(dtp.reshard(placed[src], dst).to_local())
                want = rank_values(placed[dst].to_local())
                if dst.partial:  # a pending sum's terms may split differently; compare sums
                    got, want = [sum(got)], [sum(want)]
                for r, (a, b) in enumerate(zip(got, want)):
                    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), f"{src} -> {dst}, rank {r}"
