"""What the Llama step benchmarks share (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable


def llama_step_parser(doc: str | None, *, repeats: int, profile_help: str | None = None) -> argparse.ArgumentParser:
    """Flags of a benchmark timing Llama training steps: configs, shapes, repeats and, where
    the benchmark has one (``profile_help`` given), ``--profile STEPS``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"], help="llama.config names")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=repeats)
    if profile_help is not None:
        ap.add_argument("--profile", type=int, default=0, metavar="STEPS", help=profile_help)
    return ap


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up, every rank
    starting each call together (a barrier before each)."""
    import torch.distributed as dist

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def alternating_times(steps: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each of two steps over ``repeats`` rounds, the order swapped every round
    (so neither always runs first), every rank starting each call together."""
    import torch.distributed as dist

    first, second = steps
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(repeats):
        for name in ((first, second) if i % 2 == 0 else (second, first)):
            dist.barrier()
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def attention_parser(doc: str | None, *, seq: list[int] | int) -> argparse.ArgumentParser:
    """Flags of the attention benchmarks: sequence length(s), heads, head_dim, repeats."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if isinstance(seq, list):
        ap.add_argument("--seq", type=int, nargs="+", default=seq)
    else:
        ap.add_argument("--seq", type=int, default=seq, help="total sequence length (fixed across cp)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    return ap


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak live bytes of the CPU allocator while ``fn`` runs: ``torch.profiler`` with
    ``profile_memory=True`` records every allocation and free (every thread, gloo's
    included) as a ``[memory]`` event with its signed size; the running sum peaks at the
    answer (see context_memory.py for why not RSS)."""
    import itertools

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    return max(itertools.accumulate((e.nbytes() for e in events), initial=0))


def hf_model_parser(doc: str | None, *, repeats: int) -> argparse.ArgumentParser:
    """Flags of the Hugging Face load / export benchmarks: the model's width and depth, repeats."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=repeats)
    return ap


def hf_model_config(dim: int, layers: int):
    """The Llama-3-shaped model those benchmarks load and export: a 32k vocabulary, GQA 8/4."""
    from dtp.models import llama

    return llama.config("tiny", vocab_size=32000, dim=dim, n_layers=layers, n_heads=8, n_kv_heads=4,
                        ffn_dim=int(dim * 8 / 3) // 64 * 64)


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``(start, end)`` intervals merged where they touch or overlap, sorted; empty ones dropped.

    >>> union([(3.0, 4.0), (0.0, 1.0), (0.5, 2.0), (5.0, 5.0)])
    [(0.0, 2.0), (3.0, 4.0)]
    """
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def uncovered(span: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    """How much of ``span`` no interval of ``merged`` (:func:`union`'s) covers.

    >>> uncovered((0.0, 10.0), union([(1.0, 3.0), (2.0, 4.0), (9.0, 12.0)]))
    6.0
    """
    a, b = span
    return max(0.0, b - a - sum(max(0.0, min(b, e) - max(a, s)) for s, e in merged))
