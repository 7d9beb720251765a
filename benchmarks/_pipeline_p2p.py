"""The transport under ``benchmarks/pipeline.py``, measured with bare ``torch.distributed``
(no dtp): how long a receive waits for a message already sent, posted ahead or when
needed (:func:`p2p_latency`), and the hop latency of one hand-over (:func:`hop_latency`),
which ``dtp.schedules.simulate(hop=…)`` charges per hand-over between ranks. Split out so
the benchmark stays under 600 lines."""

from __future__ import annotations

import statistics
import time

import torch


def _spin(a: torch.Tensor, seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a


def p2p_latency(rows: int, dim: int, repeats: int) -> dict[str, float] | None:
    """Rank 0 sends one ``rows × dim`` fp32 message and computes for 20 ms; rank 1 computes
    for 5 ms (the message is sent by then) and waits for it, its receive posted before the
    5 ms or after them. Median wait in ms (rank 1; ``None`` on rank 0)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    a, x = torch.randn(256, 256), torch.randn(rows, dim)
    waits: dict[str, list[float]] = {"ahead": [], "when needed": []}
    for k in range(2 * (repeats + 1)):
        how = ("ahead", "when needed")[k % 2]
        dist.barrier()
        if rank == 0:
            work = dist.isend(x, 1, tag=k)
            _spin(a, 0.02)
            work.wait()
            continue
        buf = torch.empty(rows, dim)
        work = dist.irecv(buf, 0, tag=k) if how == "ahead" else None
        _spin(a, 0.005)
        t0 = time.perf_counter()
        if work is None:
            work = dist.irecv(buf, 0, tag=k)
        work.wait()
        if k >= 2:
            waits[how].append(1e3 * (time.perf_counter() - t0))
    return {how: statistics.median(ws) for how, ws in waits.items()} if rank == 1 else None


def hop_latency(rows: int, dim: int, repeats: int) -> float:
    """One hand-over as a pipeline makes it, in seconds (median; the same on both ranks):
    the receiver has posted its receive ahead and waits; the sender posts one ``rows ×
    dim`` fp32 message, then computes for 5 ms (its next action). The hop runs from the
    sender's post to the end of the receiver's wait (``time.perf_counter`` is the
    system's monotonic clock, shared by the two processes; the send time travels in the
    message). Each direction in turn, ``4 × repeats`` hops after two warm-up ones."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = dist.get_rank()
    a, x = torch.randn(256, 256), torch.randn(rows, dim)
    stamp = x.view(-1)[:2].view(torch.float64)  # 8 bytes of the body carry the send time
    hops = []
    for k in range(4 * repeats + 2):
        sender = k % 2
        dist.barrier()
        if rank == sender:
            _spin(a, 0.001)  # the receiver is waiting by now
            stamp[0] = time.perf_counter()
            work = dist.isend(x, 1 - sender, tag=k)
            _spin(a, 0.005)
            work.wait()
            continue
        buf = torch.empty(rows, dim)
        work = dist.irecv(buf, sender, tag=k)
        work.wait()
        done = time.perf_counter()
        if k >= 2:
            hops.append(done - float(buf.view(-1)[:2].view(torch.float64)[0]))
    mine = torch.tensor([statistics.median(hops)], dtype=torch.float64)
    dist.all_reduce(mine)
    return float(mine[0]) / 2
