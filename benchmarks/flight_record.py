"""What the always-on flight recorder (dtp.comm.flight_record) costs per collective.

    python benchmarks/flight_record.py --repeats 7

* record: ``dtp.comm.flight._record`` as it is (a CommRecord, the comm logs, a sequence number,
  the ring append, the mirror check) vs the same function without the three flight-recorder
  lines (what it was before), timed alternately in this process, median of ``--repeats``
  blocks of 20,000 calls each.
* completion: what the completion callback adds, ``fut.value()`` on a done future (so a
  failed collective is marked failed, not done).
* mirror: ``_FlightFile.write`` + ``update`` (what a rank launched by ``dtp train`` adds:
  its record mirrored to a memory-mapped file), same way.
* collective: the cheapest real collective for scale, a 4-byte ``dtp.comm.all_reduce`` on
  2 gloo ranks (median of 2,000), to read the recorder's cost as a fraction of it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dtp
from dtp import comm
from dtp.testing import run

CALLS = 20_000


def _record_without_flight(kind, axis, nbytes, n, x, async_op, tag):
    # dtp.comm.flight._record before the flight recorder: the record and the comm logs only.
    rec = comm.CommRecord(kind, axis, int(round(nbytes)), n, x.dtype, tuple(x.shape), time.perf_counter(), None,
                          async_op, tag)
    for log in comm.active_logs():
        log.records.append(rec)
    return rec


def _per_call_us(fn, *args) -> float:
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn(*args)
    return (time.perf_counter() - t0) / CALLS * 1e6


def _collective_us(calls: int) -> float:
    torch.set_num_threads(1)
    mesh = dtp.make_mesh(dp=2)
    x = torch.ones(1)
    for _ in range(100):
        comm.all_reduce(x, mesh, "dp")
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        comm.all_reduce(x, mesh, "dp", tag="bench")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000, help="collectives timed on 2 ranks")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.ones(1)
    rec_args = ("all_reduce", "dp", 4.0, 2, x, False, "grad reduce")
    old, new, mirror, check = [], [], [], []
    fut = torch.futures.Future()
    fut.set_result([x])
    with tempfile.TemporaryDirectory() as d:
        ff = comm.flight._FlightFile(Path(d) / "flight-rank0.bin")
        rec = comm.flight._record(*rec_args)
        rec.completed = time.perf_counter()

        def mirrored(r):
            ff.write(r)
            ff.update(r)

        for i in range(args.repeats):
            order = [(old, _record_without_flight), (new, comm.flight._record)]
            for bucket, fn in (order if i % 2 else order[::-1]):
                bucket.append(_per_call_us(fn, *rec_args))
            mirror.append(_per_call_us(mirrored, rec))
            check.append(_per_call_us(fut.value))
    coll = run(_collective_us, args.calls, world_size=2, timeout=600)[0]
    o, n, m, c = (statistics.median(v) for v in (old, new, mirror, check))
    print(f"record without flight recorder  {o:7.2f} us/collective")
    print(f"record with flight recorder     {n:7.2f} us/collective  (+{n - o:.2f} us)")
    print(f"completion check (fut.value())  {c:7.2f} us/collective")
    print(f"mirror to file (dtp train)      {m:7.2f} us/collective")
    print(f"4-byte all_reduce, 2 gloo ranks {coll:7.1f} us: recorder + check {100 * (n - o + c) / coll:.2f}%, "
          f"with the mirror {100 * (n - o + c + m) / coll:.2f}% of the cheapest collective")


if __name__ == "__main__":
    main()
