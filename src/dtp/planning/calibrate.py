"""``dtp plan --calibrate``: this machine as a :class:`~dtp.planning.hardware.Hardware`,
measured, not looked up — matmul FLOP/s by shape and dtype, causal attention's FLOP/s by
shape, elementwise memory bandwidth, the fixed cost of one op, the gloo link between two
local ranks by message size, and each collective's fixed cost by group size.

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

Three figures the time model would otherwise take from the GEMM and the link's α:

- ``attention_curve``: ``F.scaled_dot_product_attention(is_causal=True)`` forward and
  backward in float32 at :data:`ATTENTION_SHAPES`, its FLOPs (``4 · s²/2 · d`` a head
  forward, 2.5 × that backward: :mod:`.time`'s count) over the time, as fractions of the
  float32 peak. A CPU's SDPA reaches a third to two thirds of its GEMMs, more for longer
  heads, so the points are by ``seq · head_dim``.
- ``op_overhead``: a chain of :data:`OP_CHAIN` multiplies of 4 × 4 tensors, forward and
  backward, over the ops a dispatch counter sees it run: what an op costs when its bytes
  and FLOPs cost nothing (dispatch, autograd's bookkeeping).
- the link's ``collective_latency``: each of :data:`~.hardware.COLLECTIVES` through
  :mod:`dtp.comm` (the functions training calls) on :data:`COLLECTIVE_BYTES`, among
  groups of every size that divides ``ranks``, every group at once, on ``ranks``
  processes: the collective's fixed cost, which with more ranks than cores is mostly
  the ranks waiting their turn on a core, and which one pair's send/recv α does not show.

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

from .hardware import COLLECTIVES, Chip, Hardware, Link

__all__ = ["calibrate", "fit_alpha_beta"]

# Square GEMMs n³, small to large: the curve's points. 1024 is where a 2-core host's
# float32 GEMM has flattened (about 40 ms a product) within the time budget.
SIZES = (128, 256, 512, 1024)
# float64 and bfloat16 at the largest two only: their peaks, without the slow small points.
DTYPE_SIZES = {"float32": SIZES, "float64": SIZES[-2:], "bfloat16": SIZES[-2:]}
ELEMENTWISE_BYTES = 64 * 2**20          # per operand: well past any L3
LINK_BYTES = (2**10, 2**14, 2**17, 2**20, 2**22, 2**24)
# (seq, head_dim, heads) of the attention points, batch 1: Llama's head widths at short to
# mid sequences, heads chosen so each call is ~0.1-1 GFLOP (tens of ms a rank).
ATTENTION_SHAPES = ((256, 32, 16), (512, 64, 8), (1024, 128, 2))
OP_CHAIN = 64
COLLECTIVE_BYTES = 256  # small: the time is the fixed cost (β moves 256 B in well under 1 µs)


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


def attention_flops(repeats: int = 5, seconds: _Timer = _median_seconds) -> dict[int, float]:
    """``{seq · head_dim: FLOP/s}`` of causal SDPA forward and backward in float32 at
    :data:`ATTENTION_SHAPES`: ``3.5 · 4 · heads · s²/2 · d`` FLOPs (:mod:`.time`'s count,
    causal, backward 2.5 × forward) per call, each timed by ``seconds(fn, repeats)``."""
    import torch.nn.functional as F

    out = {}
    for seq, dim, heads in ATTENTION_SHAPES:
        q, k, v = (torch.randn(1, heads, seq, dim, requires_grad=True) for _ in range(3))
        grad = torch.randn(1, heads, seq, dim)

        def call() -> None:
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
            q.grad = k.grad = v.grad = None

        out[seq * dim] = 3.5 * 4 * heads * seq * (seq + 1) / 2 * dim / seconds(call, repeats)
    return out


def op_seconds(repeats: int = 5, seconds: _Timer = _median_seconds) -> float:
    """Seconds per op of a chain of :data:`OP_CHAIN` ``x * w`` on 4 × 4 tensors, forward
    and backward: its time over the ops a ``TorchDispatchMode`` counts it running (views
    aside, as :mod:`.time` counts a block's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            Count.ops += not func.is_view
            return func(*args, **(kwargs or {}))

    w = torch.ones(4, 4, requires_grad=True)
    x0 = torch.ones(4, 4, requires_grad=True)

    def chain() -> None:
        x = x0
        for _ in range(OP_CHAIN):
            x = x * w
        x.sum().backward()
        w.grad = x0.grad = None

    chain()  # the autograd graph's first build, not counted
    with Count():
        chain()
    return seconds(chain, repeats) / Count.ops


def _collective_seconds(repeats: int, seconds: _Timer) -> list[tuple[str, int, float]]:
    """On every rank of the pool: ``(kind, group size, seconds)`` of a small collective
    through :mod:`dtp.comm` among groups of each size dividing the world, every group at once."""
    import torch.distributed as dist

    from .. import comm, make_mesh  # here: runs on the calibration's ranks only (dtp's package imports this module)

    world = dist.get_world_size()
    calls = {"all_reduce": lambda x, m: comm.all_reduce(x, m, "tp"),
             "all_gather": lambda x, m: comm.all_gather(x, m, "tp"),
             "reduce_scatter": lambda x, m: comm.reduce_scatter(x, m, "tp"),
             "all_to_all": lambda x, m: comm.all_to_all(x, m, "tp", split_dim=0, concat_dim=0)}
    out = []
    for n in (g for g in range(2, world + 1) if world % g == 0):
        mesh = make_mesh(dp=world // n, tp=n)  # tp's groups: n consecutive ranks
        x = torch.zeros(n * max(1, COLLECTIVE_BYTES // 4 // n))  # splits into n (reduce_scatter, all_to_all)
        for kind in COLLECTIVES:
            out.append((kind, n, seconds(functools.partial(calls[kind], x, mesh), repeats)))
    return out


def _pool_collectives(threads: int, repeats: int) -> list[tuple[str, int, float]]:
    torch.set_num_threads(threads)
    return _collective_seconds(repeats, functools.partial(_shared_seconds, budget=0.3))


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


def _shared_measure(threads: int, repeats: int) -> tuple[dict[str, dict[int, float]], float, dict[int, float],
                                                         dict[int, float], float, list[tuple[str, int, float]]]:
    """On every rank of the pool: matmul and attention FLOP/s, a+b bandwidth and an op's
    fixed cost with all ranks running them at once; the one-way send/recv seconds with
    every pair of ranks at once; the collectives' fixed costs."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    timer = functools.partial(_shared_seconds, budget=1.0)
    flops = matmul_flops(repeats, timer)
    attention = attention_flops(repeats, timer)
    bandwidth = elementwise_bandwidth(repeats, timer)
    per_op = op_seconds(repeats, timer)
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
    collectives = _collective_seconds(repeats, functools.partial(_shared_seconds, budget=0.3))
    return flops, bandwidth, link, attention, per_op, collectives


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

            flops, bandwidth, times, attention, per_op, collectives = run(
                _shared_measure, threads, repeats, world_size=ranks, timeout=600)[0]
        else:
            flops = matmul_flops(repeats)
            attention = attention_flops(repeats)
            bandwidth = elementwise_bandwidth(repeats)
            per_op = op_seconds(repeats)
            times = link_times(repeats + 2)  # its ranks set their own threads (one each)
            collectives = []
            if ranks >= 2:
                from ..testing import run  # here: the rank pool, which only a calibration with ranks needs

                collectives = run(_pool_collectives, threads, repeats, world_size=ranks, timeout=600)[0]
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
    attention_curve = tuple((float(size), min(1.0, f / peaks["float32"])) for size, f in sorted(attention.items()))
    link = Link(bandwidth=beta, latency=alpha, collective_latency=tuple(collectives))
    fixed = ", ".join(f"{kind} {n} {t * 1e6:.0f}" for kind, n, t in collectives)
    return Hardware(
        name="cpu-calibrated",
        chip=Chip(name=f"{cpu}, {threads} of {cores} cores per rank", flops=peaks, memory=float(ram // ranks),
                  memory_bandwidth=bandwidth, matmul_efficiency=1.0, matmul_curve=curve,
                  attention_curve=attention_curve, op_overhead=per_op),
        devices_per_node=ranks,
        intra=link,
        inter=link,  # no second node was measured: the local gloo link stands for it
        host=Link(bandwidth=bandwidth, latency=0.0),  # a CPU rank's "host" is its own memory
        source=(f"dtp plan --calibrate on {platform.node()} ({elapsed:.0f} s"
                + (f", all {ranks} ranks at once" if shared else "") + f"): matmul GFLOP/s by n³ [{detail}]; "
                "causal SDPA float32 GFLOP/s by seq×head_dim ["
                + ", ".join(f"{size} {f / 1e9:.1f}" for size, f in attention.items()) + "]; "
                f"float32 a+b {bandwidth / 1e9:.1f} GB/s; an op {per_op * 1e6:.2f} us; gloo send/recv one-way "
                + ", ".join(f"{s} B {t * 1e6:.0f} us" for s, t in times.items())
                + (f"; {COLLECTIVE_BYTES} B collectives (kind, ranks, us) [{fixed}]" if collectives else "")
                + "; peak = best measured, efficiency 1.0; link α, β fitted over those sizes"),
    )
