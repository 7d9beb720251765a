"""dtp.planning.search and ``dtp plan --search``: exact against a brute force of the same
space, only layouts ``dtp train`` accepts and that fit, stable under small changes of the
hardware it ranks on."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from dtp import RunConfig
from dtp.cli import main, parse_args
from dtp.cli.flags import check_config
from dtp.planning import plan
from dtp.planning.hardware import Chip, Hardware, Link, hardware
from dtp.cli.plan import preflight as _preflight
from dtp.planning.space import _cp_options, _meshes, _pp_options, _tp_options, _zero_options
from dtp.planning.search import (command, describe,
                                 search)
from dtp.models import llama

GIB = 2**30


def _brute(model: str, devices: int, batch: int, seq: int, hw: Hardware,
           budget_gb: float) -> list[tuple[float, RunConfig]]:
    """Every layout of the search's space that dtp train accepts, planned and timed: no
    bound, no dominance."""
    cfg = llama.config(model)
    out = []
    n_layers = cfg.n_layers
    for axes in _meshes(devices, False):
        data = axes["dp"] * axes["ep"]
        if batch % data:
            continue
        for t, c, p in itertools.product(_tp_options(axes["tp"]), _cp_options(axes["cp"]),
                                         _pp_options(axes["pp"], n_layers)):
            for m in [d for d in range(1, batch // data + 1) if (batch // data) % d == 0]:
                for z, rc in itertools.product(_zero_options(axes["dp"]), ("none", "selective", "full")):
                    try:
                        run = RunConfig(model=model, batch=batch, seq=seq, dtype="bfloat16", microbatches=m,
                                        recompute=rc, **axes, **t, **c, **p, **z)
                        pl = plan(run, backend="nccl")
                        _preflight(run, pl.target, cfg)  # dtp train's shape checks (plan has its own)
                    except ValueError:
                        continue
                    if pl.peak <= budget_gb * GIB:
                        out.append((pl.time(hw).total, run))
    return sorted(out, key=lambda x: x[0])


_RC = ("none", "selective", "full")
_OVERLAPS = ("overlap_grad_reduce", "overlap_param_gather")


def _dominates(a: RunConfig, b: RunConfig) -> bool:
    """``a`` is ``b`` with less recompute or more of ZeRO's overlaps (the search keeps ``a``)."""
    same = {f.name for f in dataclasses.fields(RunConfig)} - {"recompute", *_OVERLAPS}
    return (a != b and all(getattr(a, k) == getattr(b, k) for k in same)
            and _RC.index(a.recompute) <= _RC.index(b.recompute)
            and all(getattr(a, k) >= getattr(b, k) for k in _OVERLAPS))


@pytest.fixture(scope="module")
def tight() -> tuple[Hardware, float]:
    """h100-sxm with a budget that the small model's fattest layouts do not fit."""
    return hardware("h100-sxm"), 0.05


def test_the_search_finds_what_planning_every_layout_finds(tight):
    """Bounds, dominance and memoised stages change how much is planned, not the answer:
    the search's top times are the brute force's (over the same space, on 4 devices)."""
    hw, budget = tight
    brute = _brute("small", 4, 8, 64, hw, budget)
    found = search("small", preflight=_preflight, devices=4, batch=8, seq=64, hardware=hw, memory_gb=budget, show=8)
    assert len(brute) > 50 and found.pruned.get("memory", 0) > 0
    assert math.isclose(found.top[0].time.total, brute[0][0])
    kept = {c.run for c in found.top}
    assert all(math.isclose(c.time.total, dict((r, t) for t, r in brute)[c.run]) for c in found.top)
    # What is faster than the last kept and not kept is dominated by a layout that fits
    # and is no slower (less recompute, more overlap): the search times only that one.
    for t, run in brute:
        if t < found.top[-1].time.total and run not in kept:
            assert any(_dominates(a, run) and ta <= t * (1 + 1e-12) for ta, a in brute), describe(run)
    assert found.planned < len(brute)


def test_every_layout_found_runs_and_fits():
    """Each pick is one ``dtp train`` accepts (its shape checks, through its own flags) and
    whose plan fits the budget."""
    found = search("llama3-8b", preflight=_preflight, devices=8, batch=8, seq=2048, hardware="h100-sxm", memory_gb=60, show=6)
    assert found.top
    for c in found.top:
        argv = command(c.run).split()[2:]  # "dtp train ..."
        args = parse_args(["plan", *argv])
        check_config(args)  # raises UsageError where dtp train would refuse
        again = plan(RunConfig.from_dict({**dataclasses.asdict(c.run)}), backend="nccl")
        assert again.peak == c.peak <= 60 * GIB
        assert math.isclose(again.time("h100-sxm").total, c.time.total)


def _scaled(hw: Hardware, what: str, by: float) -> Hardware:
    chip, intra, inter = hw.chip, hw.intra, hw.inter
    if what == "flops":
        chip = dataclasses.replace(chip, flops={k: v * by for k, v in chip.flops.items()})
    elif what == "memory_bandwidth":
        chip = dataclasses.replace(chip, memory_bandwidth=chip.memory_bandwidth * by)
    elif what in ("intra", "inter"):
        link = getattr(hw, what)
        link = dataclasses.replace(link, bandwidth=link.bandwidth * by, latency=link.latency * by)
        intra, inter = (link, inter) if what == "intra" else (intra, link)
    return dataclasses.replace(hw, chip=chip, intra=intra, inter=inter)


@pytest.mark.parametrize("what", [pytest.param("flops", marks=pytest.mark.slow),
                                  pytest.param("memory_bandwidth", marks=pytest.mark.slow),
                                  pytest.param("intra", marks=pytest.mark.slow), "inter"])
def test_a_one_percent_change_moves_the_pick_by_about_one_percent(what):
    """Under a 1 % change of a hardware figure the top pick's time moves by <= ~1 %, and the
    order changes only among layouts within 2 % of each other."""
    hw = hardware("h100-sxm")
    kw = dict(devices=8, batch=16, seq=2048, memory_gb=40, show=6)
    before = search("1b", preflight=_preflight, hardware=hw, **kw)
    after = search("1b", preflight=_preflight, hardware=_scaled(hw, what, 1.01), **kw)
    assert abs(after.top[0].time.total / before.top[0].time.total - 1) <= 0.011
    rank = {describe(c.run): c.time.total for c in before.top}
    for a, b in itertools.combinations([describe(c.run) for c in after.top if describe(c.run) in rank], 2):
        if rank[a] > rank[b]:  # swapped: they were within 2 %
            assert rank[a] / rank[b] - 1 <= 0.02, (a, b)


def test_no_layout_fits():
    found = search("llama3-8b", preflight=_preflight, devices=2, batch=8, seq=4096, hardware="h100-sxm", memory_gb=1, show=3)
    assert found.top == () and found.pruned["memory"] > 0
    assert found.lines()[-1] == "no layout fits: raise --memory-gb, or add devices"


def test_held_fields_are_kept():
    found = search("small", preflight=_preflight, devices=4, batch=8, seq=64, hardware="h100-sxm", show=4, tp=2, zero=1)
    assert found.top and all(c.run.tp == 2 and c.run.zero == 1 for c in found.top)


def test_cli_search(capsys):
    rc = main(["plan", "--search", "--devices", "4", "--hardware", "h100-sxm", "--model", "small",
               "--batch", "8", "--seq", "64", "--show", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].startswith("search: ") and " layouts of 4 devices on h100-sxm" in lines[0]
    assert lines[1].startswith("  pruned: ")
    assert sum(line.strip().startswith("dtp train ") for line in lines) == 2


def test_cli_search_needs_devices_and_hardware(capsys):
    assert main(["plan", "--search", "--hardware", "h100-sxm"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "dtp plan: error: --search lays the run out on --devices N devices: give --devices"


def test_tiny_hardware_toy_link():
    """A hardware of the user's own (no preset) is searched alike."""
    nv = Link(bandwidth=3e11, latency=3e-6)
    hw = Hardware(name="toy", chip=Chip(name="toy", flops={"bfloat16": 1e15}, memory=8e10, memory_bandwidth=2e12,
                                        matmul_efficiency=0.8), devices_per_node=8, intra=nv, inter=nv, host=nv)
    found = search("tiny", preflight=_preflight, devices=2, batch=4, seq=32, hardware=hw, show=1)
    assert found.hardware == "toy" and found.top




@pytest.mark.parametrize("model,axes", [("tiny", {"dp": 4}), ("tiny", {"dp": 2, "tp": 2}), ("llama3-8b", {"dp": 8, "tp": 2}),
                                        ("tiny-moe", {"dp": 2, "ep": 2})])
def test_zero3_holds_the_least_state_of_the_stages(model, axes):
    """The search's memory prune of a mesh (``_Search.state_bytes``) plans ZeRO-3 only: it
    must hold no more parameters and optimizer state than any other stage."""
    from dtp.planning.memory import memory
    from dtp.planning.target import Target, leaves

    held = {}
    for z in (0, 1, 2, 3):
        s = Target.of(RunConfig(model=model, batch=8, seq=64, dtype="bfloat16", zero=z, recompute="full", **axes),
                      backend="nccl")
        mem = memory(s, leaves(s))
        held[z] = mem.params + mem.optimizer
    assert held[3] == min(held.values()), held
