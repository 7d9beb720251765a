"""``benchmarks/moe.py`` runs end to end on tiny sizes (slow: 4 gloo ranks, not in the
default run): the pipe-experts sweep of one scenario returns a row per option the layout
accepts, with the token all-to-alls the schedule promises (4 unpipelined, 4 × local
experts × multi_data pipelined) and a bandwidth calibrated from the expert compute; the
multi_stream options come back refused with the layout's reason; the torchtitan part
prints its one-line skip when torchtitan is not installed."""

from __future__ import annotations

import sys

import pytest

import benchmark_module
from dtp.testing import run

pytestmark = pytest.mark.slow


def _bench():
    return benchmark_module.load("moe", by_value=True)


def test_sweep_runs_every_accepted_option_with_its_chunks() -> None:
    bench = _bench()
    # per rank 1×16 tokens, dim 16, hidden 32, top-2; no warm-up, one repeat
    res = run(bench._sweep, 1, 16, 16, 32, 2, 0, 1, 0.0, ["E8/ep4"], world_size=4)
    for rank, out in enumerate(res):
        r = out["E8/ep4"]
        assert r["n_a2a"] == {"off": 4, "on md1": 8, "on md2": 16, "on md4": 32}, (rank, r["n_a2a"])
        assert sorted(r["skipped"]) == ["on md1 ms", "on md2 ms", "on md4 ms"], rank
        assert all("sequence_parallel=True" in why for why in r["skipped"].values()), r["skipped"]
        assert r["bandwidth"] > 0 and r["bytes"] > 0, rank
        for label, row in r["opts"].items():
            assert len(row["linked"]) == 1 and row["comm"][0] > 0, (rank, label)


def test_without_torchtitan_the_comparison_prints_one_skip_line(monkeypatch, capsys) -> None:
    bench = _bench()
    monkeypatch.setattr(bench, "_titan_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["moe.py", "--parts", "torchtitan"])
    # main() imports its sibling moe_ep_overlap as a script does (sys.path[0] = benchmarks/)
    monkeypatch.syspath_prepend(str(benchmark_module.BENCHMARKS))
    bench.main()
    assert capsys.readouterr().out.strip() == bench.TITAN_MISSING


def test_ep_overlap_part_times_both_runs_with_and_without_the_link() -> None:
    """``benchmarks/moe.py --ep-overlap`` (benchmarks/moe_ep_overlap.py) on tiny sizes: the
    four runs come back, the same MoE all-to-alls in each (4 per layer and microbatch, and
    the counts exchange), and the report prints its two targets."""
    module = benchmark_module.load("moe_ep_overlap", by_value=True)
    # dim 32, hidden 32, 1 layer, per rank 1×8 tokens per microbatch, m 2; no warm-up, one repeat
    res = run(module._bench, 32, 32, 1, 1, 8, 2, 0, 1, world_size=2)
    for out in res:
        assert set(out["rows"]) == {"plain free", "plain link", "ep-overlap free", "ep-overlap link"}
        assert {row[0]["n"] for row in out["rows"].values()} == {2 * (4 + 1)}, out["rows"]
    args = type("Args", (), dict(ep_dim=32, ep_hidden=32, ep_layers=1, ep_batch=1, ep_seq=8, microbatches=2,
                                 repeats=1))()
    figures = module.report(res, args)
    assert set(figures) == {"plain", "ep-overlap", "ratio", "fb ratio"}
    # pp 2 × ep 2 under dualpipev (4 ranks): 4 layers over its 4 stages, m 4: every rank
    # holds MoE blocks, each 4 + 1 all-to-alls per microbatch, the same in every run
    res = run(module._bench, 32, 32, 4, 1, 8, 4, 0, 1, 2, "dualpipev", world_size=4)
    for out in res:
        (n,) = {row[0]["n"] for row in out["rows"].values()}
        assert n > 0 and n % (4 * (4 + 1)) == 0, out["rows"]
    assert set(module.report(res, args)) == {"plain", "ep-overlap", "ratio", "fb ratio"}
