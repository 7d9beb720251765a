"""dtp.plot.plot_timeline: one row per rank, a bar per compute span and per collective, all
ranks on one time axis — which holds because the ranks' clock is one clock. (The loss-curve
writer's tests sit with the CLI's, in test_cli.py.)"""

import time

import pytest
import torch

from dtp.comm import CommLog, CommRecord, Span
from dtp.plot import plot_timeline, png_size
from dtp.testing import run


def _log(t0: float, collectives: int) -> CommLog:
    records = [CommRecord("all_reduce", "dp", 64, 2, torch.float32, (16,), issued=t0 + 0.001 * i,
                          completed=t0 + 0.001 * i + 0.0005, tag=f"bucket {i}") for i in range(collectives)]
    records.append(CommRecord("all_gather", "tp", 64, 2, torch.float32, (16,), issued=t0 + 0.004))  # never completed
    return CommLog(records, [Span("forward", t0, t0 + 0.002), Span("backward", t0 + 0.002, t0 + 0.005)])


def test_timeline_has_a_row_per_rank_and_a_bar_per_event(tmp_path):
    Figure = pytest.importorskip("matplotlib.figure").Figure

    logs = [_log(100.0, 3), _log(100.010, 1)]  # rank 1 starts 10 ms later on the shared clock
    ax = Figure().subplots()
    assert plot_timeline(logs, ax, title="two ranks") is ax
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.collections) == (2 + 4) + (2 + 2)  # spans + collectives (the open one too), per rank
    starts = sorted(c.get_paths()[0].vertices[:, 0].min() for c in ax.collections)
    assert starts[0] == pytest.approx(0.0) and max(starts) == pytest.approx(14.0)  # ms from the earliest event
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["forward", "backward", "all_reduce dp", "all_gather tp"]
    plot_timeline(logs, tmp_path / "t.png")
    assert png_size((tmp_path / "t.png").read_bytes())[0] == 640


def test_ranks_read_one_clock():
    # The timeline puts every rank's time.perf_counter() on one axis: on Linux it is
    # CLOCK_MONOTONIC, the machine's clock, so a rank's reading falls between ours.
    before = time.perf_counter()
    readings = run(time.perf_counter, world_size=2)
    after = time.perf_counter()
    assert all(before <= t <= after for t in readings), (before, readings, after)
