"""``dtp plan --calibrate``: this machine as a :class:`~dtp.planning.hardware.Hardware`,
measured, not looked up — matmul FLOP/s by shape and dtype, elementwise memory bandwidth,
and the gloo link between two local ranks by message size.

Each figure is the median of repeats after a warm-up. Each device is one rank of
``ranks`` sharing this host, so it is measured with its share of the cores
(``cpu_count // ranks`` threads, what ``dtp train --nproc`` gives a rank) and its share
of the RAM. With more ranks than cores (``shared``, the default then) that share is a
fraction of a core, which one process alone cannot measure: the matmuls and the
bandwidth then run on all ``ranks`` processes at once, each figure the rank's throughput
while every rank runs the same work (the slowest rank's, barrier to barrier), and the
link is timed with every pair of ranks (0↔1, 2↔3, …) sending at once — what the cores'
time-sharing does to each rank's compute and each message, measured, as it is during
``dtp train --nproc ranks``.

What a CPU has no datasheet for is said as measured: the peak per dtype is the best
FLOP/s any measured shape reached, so ``matmul_efficiency`` is 1.0 by construction, and
``matmul_curve`` records the other shapes as fractions of that peak (float32's, the
dtype every CPU runs natively). The link's α and β come from a weighted least-squares
fit of one-way send/recv times over the sizes (weights 1/t², so the small messages that
decide α count as much as the large ones that decide β); ``efficiency`` is 1.0 since
β is itself measured. This is calibration of the machine, not a fit to the runs the
time model predicts.

Not run as a doctest (it takes tens of seconds; tests/test_hardware.py runs it):

>>> hw = calibrate()                                          # doctest: +SKIP
>>> hw.chip.flops["float32"] > 0                              # doctest: +SKIP
True
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from typing import Callable

import torch

from .hardware import Chip, Hardware, Link

__all__ = ["calibrate", "fit_alpha_beta"]

# Square GEMMs n³, small to large: the curve's points. 1024 is where a 2-core host's
# float32 GEMM has flattened (about 40 ms a product) within the time budget.
SIZES = (128, 256, 512, 1024)
# float64 and bfloat16 at the largest two only: their peaks, without the slow small points.
DTYPE_SIZES = {"float32": SIZES, "float64": SIZES[-2:], "bfloat16": SIZES[-2:]}
ELEMENTWISE_BYTES = 64 * 2**20          # per operand: well past any L3
LINK_BYTES = (2**10, 2**14, 2**17, 2**20, 2**22, 2**24)


def _median_seconds(fn: Callable[[], object], repeats: int, budget: float = 1.0) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after one warm-up; fewer repeats
    (at least 3) when the warm-up says they would pass ``budget`` seconds."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    n = max(3, min(repeats, int(budget / max(first, 1e-9))))
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bf16_supported() -> bool:
    """Whether this CPU build runs a bfloat16 matmul (every torch build does, some
    emulated; a failure here means it cannot)."""
    try:
        torch.ones(8, 8, dtype=torch.bfloat16) @ torch.ones(8, 8, dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


_Timer = Callable[[Callable[[], object], int], float]


def matmul_flops(repeats: int = 5, seconds: _Timer = _median_seconds) -> dict[str, dict[int, float]]:
    """``{dtype: {n: FLOP/s}}`` of ``n × n`` by ``n × n`` products (2n³ FLOPs each), each
    timed by ``seconds(fn, repeats)`` (this process alone, or every rank at once)."""
    out: dict[str, dict[int, float]] = {}
    for name, sizes in DTYPE_SIZES.items():
        if name == "bfloat16" and not _bf16_supported():
            continue
        dtype = getattr(torch, name)
        out[name] = {}
        for n in sizes:
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            out[name][n] = 2 * n**3 / seconds(lambda: torch.mm(a, b), repeats)
    return out


def elementwise_bandwidth(repeats: int = 5, seconds: _Timer = _median_seconds) -> float:
    """Bytes/s of a large float32 ``a + b`` into ``c``: two operands read, one written."""
    n = ELEMENTWISE_BYTES // 4
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    return 3 * ELEMENTWISE_BYTES / seconds(lambda: torch.add(a, b, out=c), repeats)


def _ping_pong(sizes: tuple[int, ...], repeats: int) -> dict[int, float]:
    """On 2 ranks: one-way seconds by size, half the median round trip rank 0 → 1 → 0."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8)

        def trip() -> None:
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        dist.barrier()
        out[size] = _median_seconds(trip, repeats, budget=0.5) / 2
    return out


def fit_alpha_beta(points: dict[int, float]) -> tuple[float, float]:
    """``(α seconds, β bytes/s)`` of ``t = α + bytes/β`` through ``{bytes: seconds}``, by
    least squares weighted 1/t² (relative errors). A negative intercept is clipped to 0.

    >>> a, b = fit_alpha_beta({10**3: 1e-5 + 1e3 / 1e9, 10**6: 1e-5 + 1e6 / 1e9, 10**8: 1e-5 + 1e8 / 1e9})
    >>> round(a * 1e6, 6), round(b / 1e9, 6)
    (10.0, 1.0)
    """
    xs, ts = list(points), list(points.values())
    w = [1 / t**2 for t in ts]
    sw, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, ts))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    if not slope > 0:
        raise ValueError(f"calibrate: link times do not grow with size, no bandwidth to fit: {points}")
    return max(0.0, (st - slope * sx) / sw), 1 / slope


def link_times(repeats: int = 7) -> dict[int, float]:
    """One-way gloo send/recv seconds by message size between 2 local ranks (:func:`dtp.testing.run`)."""
    from ..testing import run  # here: the rank pool costs seconds to start, and only calibration needs it

    return run(_ping_pong, LINK_BYTES, repeats, world_size=2)[0]


def _shared_seconds(fn: Callable[[], object], repeats: int, budget: float) -> float:
    """On every rank of the pool at once: seconds per call of ``fn`` while all ranks run
    it, the same count of calls each (``repeats``, or as many as fill ``budget`` seconds
    by the warm-up's time, at least 3), over the span from the first rank's start to the
    last rank's end (``perf_counter`` is the host's monotonic clock, one for every
    process), so a rank the scheduler let run alone does not count as faster."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    start = time.perf_counter()
    fn()
    first = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(first, op=dist.ReduceOp.MAX)  # the same count on every rank
    n = max(3, repeats, int(budget / max(float(first), 1e-9)))
    dist.barrier()
    span = torch.tensor([-time.perf_counter(), 0.0], dtype=torch.float64)
    for _ in range(n):
        fn()
    span[1] = time.perf_counter()
    dist.all_reduce(span, op=dist.ReduceOp.MAX)  # -(earliest start), latest end
    return float(span[0] + span[1]) / n


def _shared_measure(threads: int, repeats: int) -> tuple[dict[str, dict[int, float]], float, dict[int, float]]:
    """On every rank of the pool: matmul FLOP/s and a+b bandwidth with all ranks running
    them at once, and the one-way send/recv seconds with every pair of ranks at once."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    timer = functools.partial(_shared_seconds, budget=1.0)
    flops = matmul_flops(repeats, timer)
    bandwidth = elementwise_bandwidth(repeats, timer)
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank ^ 1
    link: dict[int, float] = {}
    for size in LINK_BYTES:
        buf = torch.zeros(size, dtype=torch.uint8)

        def trip() -> None:
            if peer >= world:  # an odd rank out keeps the count of barriers, sends nothing
                return
            if rank % 2 == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)

        link[size] = _shared_seconds(trip, repeats + 2, budget=0.5) / 2
    return flops, bandwidth, link


def calibrate(ranks: int = 2, *, repeats: int = 5, shared: bool | None = None) -> Hardware:
    """This machine measured as a system of ``ranks`` devices on one node (the CPU ranks of
    ``dtp train --nproc ranks``). About 30–60 s on 2 cores, most of it the link's rank pool.

    ``shared`` (default: when ``ranks`` exceeds the cores) measures every figure on
    ``ranks`` processes at once (the module's docstring); else one process measures the
    chip with its share of the cores and two ranks the link."""
    cores = os.cpu_count() or 1
    threads = max(1, cores // ranks)
    shared = ranks > cores if shared is None else shared
    if shared and ranks < 2:
        raise ValueError(f"calibrate: shared measurement needs ranks >= 2, got {ranks}")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        started = time.perf_counter()
        if shared:
            from ..testing import run  # here: the rank pool, only calibration needs it

            flops, bandwidth, times = run(_shared_measure, threads, repeats, world_size=ranks, timeout=600)[0]
        else:
            flops = matmul_flops(repeats)
            bandwidth = elementwise_bandwidth(repeats)
            times = link_times(repeats + 2)  # its ranks set their own threads (one each)
    finally:
        torch.set_num_threads(before)
    alpha, beta = fit_alpha_beta(times)
    peaks = {name: max(by_size.values()) for name, by_size in flops.items()}
    curve = tuple((float(n**3), min(1.0, f / peaks["float32"])) for n, f in sorted(flops["float32"].items()))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = platform.processor() or platform.machine()
    elapsed = time.perf_counter() - started
    detail = "; ".join(f"{name} " + ", ".join(f"{n}³ {f / 1e9:.1f}" for n, f in by_size.items())
                       for name, by_size in flops.items())
    link = Link(bandwidth=beta, latency=alpha)
    return Hardware(
        name="cpu-calibrated",
        chip=Chip(name=f"{cpu}, {threads} of {cores} cores per rank", flops=peaks, memory=float(ram // ranks),
                  memory_bandwidth=bandwidth, matmul_efficiency=1.0, matmul_curve=curve),
        devices_per_node=ranks,
        intra=link,
        inter=link,  # no second node was measured: the local gloo link stands for it
        host=Link(bandwidth=bandwidth, latency=0.0),  # a CPU rank's "host" is its own memory
        source=(f"dtp plan --calibrate on {platform.node()} ({elapsed:.0f} s"
                + (f", all {ranks} ranks at once" if shared else "") + f"): matmul GFLOP/s by n³ [{detail}]; "
                f"float32 a+b {bandwidth / 1e9:.1f} GB/s; gloo send/recv one-way "
                + ", ".join(f"{s} B {t * 1e6:.0f} us" for s, t in times.items())
                + "; peak = best measured, efficiency 1.0; link α, β fitted over those sizes"),
    )
