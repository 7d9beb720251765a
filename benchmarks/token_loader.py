"""The token loader on a token file larger than it could hold whole (``dtp.data.open_tokens``
+ ``TokenLoader``): the preflight's cost, batches/s, tokens/s and resident memory.

    python benchmarks/token_loader.py --size-gb 32 --batch 8 --seq 2048 --batches 300

Makes a sparse uint16 ``.bin`` of ``--size-gb`` (no disk written; holes read as zeros, so the
reads come from the page cache, not the disk: this measures dtp's side, not the drive's) —
or reads ``--path``. Whole, as the int64 tensor ``load_tokens`` builds, it would take 4× the
file: more than this machine's memory. Prints:

* ``token_stats`` (what ``dtp train``'s preflight reads): seconds, ids read;
* the loader's start (one epoch's ``randperm`` of the windows) and then ``--batches``
  batches: batches/s, tokens/s, and the process's ``VmRSS`` / ``RssAnon`` / ``RssFile``
  before and after (file pages are the mapped windows: reclaimable cache, not the
  loader's memory);
* the same loader over an in-memory int64 tensor of a ``--small-mb`` slice vs the mapped
  loader on the same slice, batches alternated, median per-batch time of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dtp.data.token_files import SAMPLE_TOKENS, Tokens, token_stats
from dtp.data import TokenLoader, open_tokens


def _status() -> dict[str, float]:
    """This process's memory from /proc/self/status, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _fmt(m: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.0f} MiB" for k, v in m.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=32.0)
    ap.add_argument("--path", type=Path, default=None, help="an existing uint16 .bin instead of a sparse one")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=300)
    ap.add_argument("--small-mb", type=int, default=256, help="the in-memory comparison's slice")
    ap.add_argument("--repeats", type=int, default=200, help="alternated batches of the comparison")
    args = ap.parse_args()
    torch.set_num_threads(1)

    tmp = tempfile.TemporaryDirectory(prefix="dtp-token-bench-")
    path = args.path
    if path is None:
        path = Path(tmp.name) / "big.bin"
        with open(path, "wb") as f:
            f.truncate(int(args.size_gb * 2**30) // 2 * 2)
    size = path.stat().st_size
    print(f"file {path}: {size / 2**30:.1f} GiB, {size // 2:,} uint16 ids; as int64 whole: {size * 4 / 2**30:.0f} GiB")
    print(f"start: {_fmt(_status())}")

    read = []
    real = Tokens.read
    Tokens.read = lambda self, a, b: read.append(b - a) or real(self, a, b)  # count what is read
    t0 = time.perf_counter()
    n, largest = token_stats(path)
    print(f"token_stats: {time.perf_counter() - t0:.3f} s, {n:,} ids, largest {largest}, "
          f"read {sum(read):,} ids ({sum(read) * 2 / 2**20:.1f} MiB; SAMPLE_TOKENS {SAMPLE_TOKENS:,})")
    Tokens.read = real

    t0 = time.perf_counter()
    loader = TokenLoader(open_tokens(path), batch_size=args.batch, seq_len=args.seq, seed=0)
    loader.next_batch()
    print(f"loader start + first batch: {time.perf_counter() - t0:.3f} s ({loader.num_windows:,} windows); "
          f"{_fmt(_status())}")
    t0 = time.perf_counter()
    for _ in range(args.batches):
        loader.next_batch()
    dt = time.perf_counter() - t0
    tokens = args.batches * args.batch * args.seq
    print(f"{args.batches} batches of {args.batch}×{args.seq}: {args.batches / dt:,.0f} batches/s, "
          f"{tokens / dt / 1e6:,.1f} M tokens/s; {_fmt(_status())}")

    # In memory vs mapped, on a slice small enough to hold whole; batches alternated.
    small = Path(tmp.name) / "small.bin"
    ids = np.random.default_rng(0).integers(0, 50_000, args.small_mb * 2**20 // 2).astype("<u2")
    ids.tofile(small)
    loaders = {"in memory": TokenLoader(torch.from_numpy(ids.astype(np.int64)), batch_size=args.batch,
                                        seq_len=args.seq, seed=1),
               "mapped": TokenLoader(open_tokens(small), batch_size=args.batch, seq_len=args.seq, seed=1)}
    times: dict[str, list[float]] = {k: [] for k in loaders}
    for i in range(args.repeats):
        for name in (list(loaders) if i % 2 == 0 else list(loaders)[::-1]):
            t0 = time.perf_counter()
            loaders[name].next_batch()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"{args.small_mb} MiB slice, median ms/batch: in memory {med['in memory']:.3f}, mapped "
          f"{med['mapped']:.3f}, mapped / in memory {med['mapped'] / med['in memory']:.2f}")


if __name__ == "__main__":
    main()
