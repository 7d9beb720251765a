"""The step-time model against steps measured here: ``dtp.plan(...).time(hw)`` beside the
real ``dtp train`` step, for a fixed list of layouts on 4 and 8 local gloo ranks.

    python benchmarks/plan_vs_measured.py --steps 10 --warmup 3 --json pvm.json
    python benchmarks/plan_vs_measured.py --hardware cal4.toml cal8.toml --only 4

Method:

1. **Calibrate** this machine at each rank count used (:func:`dtp.planning.calibrate.calibrate`
   with ``ranks`` = 4 and 8): matmul FLOP/s by shape, a+b memory bandwidth and the gloo
   link's α / β. With more ranks than cores (8 or 4 ranks on a 2-core VM) every figure is
   measured with all the ranks running it at once, so each rank's share of the cores is in
   it. Calibration measures the machine only (matmuls, bandwidth, messages), never a
   training step; nothing in the model is fitted to the runs below. ``--hardware FILE``
   reads a calibration instead (its ``devices_per_node`` says the rank count it is for);
   ``--save-hardware DIR`` writes the TOMLs measured.
2. **The layouts** are :data:`LAYOUTS`, fixed here before any measurement: dp, ZeRO 1/2/3
   with and without the overlaps, tp + SP, async TP, CP ring / Ulysses, PP 1F1B /
   interleaved / ZBV, EP on an MoE model, 1 vs 4 microbatches, recompute none vs full, and
   pairs that differ in one option. Every run is ``--model small`` (4 blocks, dim 256, ffn
   768, 8 heads / 4 kv, vocab 256; the MoE rows add ``--num-experts 8 --top-k 2``),
   ``--batch 16 --seq 256 --dtype float32`` — a step is several hundred ms of matmuls,
   not only fixed cost.
3. **Measured**: ``dtp train --nproc N <layout> --steps S --log-every 1 --out DIR`` as a
   subprocess (``OMP_NUM_THREADS`` left to ``dtp train``: one thread a rank here), the
   per-step ``step_time`` of ``DIR/metrics.jsonl`` (rank 0's ``train_step`` wall time), the
   median of the steps after ``--warmup``.
4. **Predicted**: ``dtp.plan(run, backend="gloo").time(hw)``, ``run`` the
   :class:`dtp.RunConfig` ``dtp train`` builds from the same flags (``dtp.cli.flags.validate``),
   ``hw`` the calibration for that rank count.

Printed: each pair (layout, measured and predicted ms, predicted / measured, the model's
breakdown: compute, recompute, bubble, optimizer, exposed communication by axis), then per
rank count and overall the Spearman rank correlation (average ranks for ties), the median
and worst relative error ``|predicted − measured| / measured``, and the measured time of
the layout the model predicts fastest against the fastest measured. Targets: ρ ≥ 0.8,
median error ≤ 20 %, the predicted best within 10 % of the measured best.

Not a test: the 2-core VM is shared, its times move 10–25 % between runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["--model", "small", "--batch", "16", "--seq", "256", "--dtype", "float32"]
MOE = ["--num-experts", "8", "--top-k", "2"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]

# (name, rank count, flags): fixed before measuring. Pairs differing in one option sit
# next to each other (dp4 / dp4 mb4 / dp4 full; zero3 / zero3 overlap; sp / async; ring /
# ulysses; 1f1b / interleaved / zbv; MoE dp / ep).
LAYOUTS: list[tuple[str, int, list[str]]] = [
    ("dp4", 4, ["--dp", "4"]),
    ("dp4 mb4", 4, ["--dp", "4", "--microbatches", "4"]),
    ("dp4 full", 4, ["--dp", "4", "--recompute", "full"]),
    ("dp4 z1", 4, ["--dp", "4", "--zero", "1"]),
    ("dp4 z1 ovl", 4, ["--dp", "4", "--zero", "1", *OVERLAP]),
    ("dp4 z2 ovl", 4, ["--dp", "4", "--zero", "2", *OVERLAP]),
    ("dp4 z3", 4, ["--dp", "4", "--zero", "3"]),
    ("dp4 z3 ovl", 4, ["--dp", "4", "--zero", "3", *OVERLAP]),
    ("dp2 tp2 sp", 4, ["--dp", "2", "--tp", "2", "--sp"]),
    ("dp2 tp2 sp async", 4, ["--dp", "2", "--tp", "2", "--sp", "--async-tp"]),
    ("tp4 sp", 4, ["--tp", "4", "--sp"]),
    ("dp2 cp2 ring", 4, ["--dp", "2", "--cp", "2", "--cp-algo", "ring"]),
    ("dp2 cp2 ulysses", 4, ["--dp", "2", "--cp", "2", "--cp-algo", "ulysses"]),
    ("pp2 dp2 1f1b mb4", 4, ["--pp", "2", "--dp", "2", "--pp-schedule", "1f1b", "--microbatches", "4"]),
    ("pp2 dp2 interleaved mb4", 4, ["--pp", "2", "--dp", "2", "--pp-schedule", "interleaved",
                                    "--virtual-stages", "2", "--microbatches", "4"]),
    ("pp2 dp2 zbv mb4", 4, ["--pp", "2", "--dp", "2", "--pp-schedule", "zbv", "--microbatches", "4"]),
    ("moe dp4", 4, ["--dp", "4", *MOE]),
    ("moe ep4", 4, ["--ep", "4", *MOE]),
    ("dp8", 8, ["--dp", "8"]),
    ("dp8 full", 8, ["--dp", "8", "--recompute", "full"]),
    ("dp8 z1", 8, ["--dp", "8", "--zero", "1"]),
    ("dp8 z3", 8, ["--dp", "8", "--zero", "3"]),
    ("dp8 z3 ovl", 8, ["--dp", "8", "--zero", "3", *OVERLAP]),
    ("dp4 tp2 sp", 8, ["--dp", "4", "--tp", "2", "--sp"]),
    ("dp4 tp2 sp mb4", 8, ["--dp", "4", "--tp", "2", "--sp", "--microbatches", "4"]),
    ("dp2 tp4 sp", 8, ["--dp", "2", "--tp", "4", "--sp"]),
    ("dp2 tp4 sp async", 8, ["--dp", "2", "--tp", "4", "--sp", "--async-tp"]),
    ("dp2 cp4 ring", 8, ["--dp", "2", "--cp", "4", "--cp-algo", "ring"]),
    ("dp2 cp4 ulysses", 8, ["--dp", "2", "--cp", "4", "--cp-algo", "ulysses"]),
    ("pp2 dp4 1f1b mb4", 8, ["--pp", "2", "--dp", "4", "--pp-schedule", "1f1b", "--microbatches", "4"]),
    ("pp4 dp2 1f1b mb4", 8, ["--pp", "4", "--dp", "2", "--pp-schedule", "1f1b", "--microbatches", "4"]),
    ("pp2 dp4 zbv mb4", 8, ["--pp", "2", "--dp", "4", "--pp-schedule", "zbv", "--microbatches", "4"]),
    ("moe dp8", 8, ["--dp", "8", *MOE]),
    ("moe dp2 ep4", 8, ["--dp", "2", "--ep", "4", *MOE]),
]


def run_config(flags: list[str]):
    """The :class:`dtp.RunConfig` ``dtp train`` builds from ``flags`` (its own parser and checks)."""
    from dtp.cli import parse_args
    from dtp.cli.flags import validate

    return validate(parse_args(["train", *MODEL, *flags])).run_config


def predict(flags: list[str], hw):
    import dtp

    return dtp.plan(run_config(flags), backend="gloo").time(hw)


def _busy_jiffies() -> int:
    """The host's CPU time in processes so far (``/proc/stat``'s user, nice and system), in
    ticks: what processes' own rusage can be set against (irq, softirq and steal are not)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[0] + fields[1] + fields[2]


def others_share(seconds: float = 2.0) -> float:
    """The fraction of the host's CPU that other processes used over the next ``seconds``
    (this process sleeps meanwhile, and has no children running)."""
    busy, t0 = _busy_jiffies(), time.perf_counter()
    time.sleep(seconds)
    return (_busy_jiffies() - busy) / os.sysconf("SC_CLK_TCK") / ((time.perf_counter() - t0) * (os.cpu_count() or 1))


def wait_quiet(threshold: float, patience: float) -> float:
    """Wait until the other jobs on the host use under ``threshold`` of its CPU (2 s
    windows), at most ``patience`` seconds; return the last window's share."""
    deadline = time.perf_counter() + patience
    share = others_share()
    while share >= threshold and time.perf_counter() < deadline:
        share = others_share()
    return share


def measure(flags: list[str], nproc: int, steps: int, warmup: int, workdir: Path,
            timeout: float) -> tuple[list[float], float, float]:
    """One ``dtp train`` run: its per-step ``step_time`` (seconds), warm-up steps dropped;
    and the fractions of the host's CPU time over the run that its process tree used
    (``os.times``' children, every descendant waited for) and that other processes used
    (``/proc/stat``'s busy time less ours) — the other jobs sharing the cores."""
    out = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "dtp.cli", "train", "--nproc", str(nproc), *MODEL, *flags, "--steps", str(steps),
           "--log-every", "1", "--out", str(out), "--overwrite"]
    before, busy, t0 = os.times(), _busy_jiffies(), time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    after, busy, wall = os.times(), _busy_jiffies() - busy, time.perf_counter() - t0
    ours = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    host = wall * (os.cpu_count() or 1)
    others = max(0.0, busy / os.sysconf("SC_CLK_TCK") - ours)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [float(r["step_time"]) for r in rows if "step_time" in r]
    return times[warmup:], ours / host, others / host


def ranks_of(values: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank.

    >>> ranks_of([3.0, 1.0, 2.0, 1.0])
    [4.0, 1.5, 3.0, 1.5]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's ρ: Pearson's correlation of the ranks.

    >>> spearman([1, 2, 3, 4], [10, 20, 30, 40]), spearman([1, 2, 3], [3, 2, 1])
    (1.0, -1.0)
    """
    rx, ry = ranks_of(list(xs)), ranks_of(list(ys))
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx, vy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return cov / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else float("nan")


def summary(rows: list[dict]) -> dict:
    meas, pred = [r["measured"] for r in rows], [r["predicted"] for r in rows]
    errs = [abs(p - m) / m for m, p in zip(meas, pred)]
    best_pred = min(rows, key=lambda r: r["predicted"])
    best_meas = min(rows, key=lambda r: r["measured"])
    return {"n": len(rows), "spearman": spearman(meas, pred), "median_error": statistics.median(errs),
            "worst_error": max(errs), "worst": rows[errs.index(max(errs))]["layout"],
            "median_ratio": statistics.median(p / m for m, p in zip(meas, pred)),
            "predicted_best": best_pred["layout"], "predicted_best_measured": best_pred["measured"],
            "measured_best": best_meas["layout"], "measured_best_measured": best_meas["measured"],
            "best_gap": best_pred["measured"] / best_meas["measured"] - 1}


def print_summary(label: str, s: dict) -> None:
    ok = lambda c: "ok" if c else "MISSED"  # noqa: E731
    print(f"{label}: {s['n']} layouts; Spearman ρ {s['spearman']:.3f} ({ok(s['spearman'] >= 0.8)}, target ≥ 0.8); "
          f"relative error median {100 * s['median_error']:.1f} % ({ok(s['median_error'] <= 0.2)}, target ≤ 20 %), "
          f"worst {100 * s['worst_error']:.1f} % ({s['worst']}); median predicted / measured {s['median_ratio']:.2f}")
    print(f"  predicted best {s['predicted_best']!r} measured {1e3 * s['predicted_best_measured']:.0f} ms vs measured "
          f"best {s['measured_best']!r} {1e3 * s['measured_best_measured']:.0f} ms: +{100 * s['best_gap']:.1f} % "
          f"({ok(s['best_gap'] <= 0.1)}, target ≤ 10 %)")


def _hw_line(n: int, hw) -> str:
    fixed = hw.intra.fixed("all_reduce", n)
    return (f"{n} ranks on {os.cpu_count()} cores: float32 peak {hw.chip.flops['float32'] / 1e9:.1f} GFLOP/s a rank, "
            f"a+b {hw.chip.memory_bandwidth / 1e9:.2f} GB/s, link α {hw.intra.latency * 1e6:.0f} µs "
            f"β {hw.intra.bandwidth / 1e9:.2f} GB/s"
            + (f", all-reduce of {n} fixed {fixed * 1e3:.2f} ms" if fixed is not None else "")
            + f", attention {hw.chip.attention_fraction(256, 32):.2f} of peak at 256 × 32"
            + f", an op {hw.chip.op_overhead * 1e6:.1f} µs")


def print_table(rows: list[dict]) -> None:
    head = (f"{'layout':<24} {'N':>2} {'measured':>8} {'predicted':>9} {'pred/meas':>9}  {'compute':>7} "
            f"{'recomp':>6} {'bubble':>6} {'optim':>5}  {'cpu ours/others':>15}  exposed comm (ms)")
    print(head)
    print("-" * len(head))
    for r in rows:
        comm = ", ".join(f"{a} {1e3 * t:.0f}" for a, t in sorted(r["exposed"].items(), key=lambda kv: -kv[1])) or "-"
        print(f"{r['layout']:<24} {r['ranks']:>2} {1e3 * r['measured']:>8.0f} {1e3 * r['predicted']:>9.0f} "
              f"{r['predicted'] / r['measured']:>9.2f}  {1e3 * r['compute']:>7.0f} {1e3 * r['recompute']:>6.0f} "
              f"{1e3 * r['bubble']:>6.0f} {1e3 * r['optimizer']:>5.0f}  "
              f"{100 * r['cpu_ours']:>6.0f} / {100 * r['cpu_others']:>3.0f} %  {comm}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="dtp train --steps of each run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of a run dropped (≥ 5 left)")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs of each layout, in rounds over the whole list (each round calibrates again); "
                         "the measured figure is the median of every round's kept steps, the predicted one "
                         "the median of the rounds' predictions")
    ap.add_argument("--only", type=int, nargs="+", default=[4, 8], help="rank counts to run (4, 8)")
    ap.add_argument("--layouts", nargs="+", default=None, help="run only these layout names")
    ap.add_argument("--hardware", nargs="+", default=[], metavar="FILE",
                    help="calibrations to use (their devices_per_node: the rank count) instead of measuring")
    ap.add_argument("--save-hardware", default=None, metavar="DIR", help="write the calibrations measured here")
    ap.add_argument("--measured", default=None, metavar="JSON",
                    help="an earlier --json's measured steps (and, without --hardware, its calibrations): "
                         "predict again, run nothing")
    ap.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds allowed one dtp train run")
    ap.add_argument("--quiet", type=float, nargs=2, default=[0.25, 30.0], metavar=("SHARE", "SECONDS"),
                    help="before each run and calibration, wait until other processes use under SHARE of the "
                         "host's CPU, at most SECONDS (the VM is shared; the table reports what they used)")
    ap.add_argument("--budget-min", type=float, default=40.0,
                    help="start no further round after this many minutes")
    ap.add_argument("--json", default=None, metavar="OUT", help="write every pair, the calibrations and the summaries")
    args = ap.parse_args()
    if args.steps - args.warmup < 5:
        ap.error("--steps - --warmup must leave at least 5 measured steps")

    from dtp.planning.calibrate import calibrate
    from dtp.planning.hardware import from_toml, hardware
    from dtp.planning.hardware_toml import to_toml

    layouts = [row for row in LAYOUTS if row[1] in args.only and (args.layouts is None or row[0] in args.layouts)]
    for name, _, flags in layouts:  # every layout planned before anything is measured: a bad one fails here
        run_config(flags)
    counts = sorted({row[1] for row in layouts})
    given = {hw.devices_per_node: hw for hw in map(hardware, args.hardware)}
    earlier = json.loads(Path(args.measured).read_text()) if args.measured else None
    workdir = Path(tempfile.mkdtemp(prefix="plan-vs-measured-"))
    started = time.perf_counter()
    # calibrations[n]: one Hardware per round; runs[name]: (steps, cpu ours, cpu others) per round
    calibrations: dict[int, list] = {n: [] for n in counts}
    runs: dict[str, list[tuple[list[float], float, float]]] = {name: [] for name, _, _ in layouts}
    if earlier is not None:
        for n in counts:
            calibrations[n] = [given[n]] if n in given else [from_toml(t) for t in earlier["hardware"][str(n)]]
        for r in earlier["rows"]:
            if r["layout"] in runs:
                runs[r["layout"]] = [tuple(x) for x in r["runs"]]
    rounds = 0 if earlier is not None else (1 if args.predict_only else args.rounds)
    for k in range(rounds):
        if k and time.perf_counter() - started > 60 * args.budget_min:
            print(f"round {k + 1}: not started, past --budget-min {args.budget_min:g}", flush=True)
            break
        for n in counts:
            if n in given:
                hw = given[n]
            else:
                wait_quiet(*args.quiet)
                t0 = time.perf_counter()
                hw = calibrate(n)
                print(f"round {k + 1}: calibrated {n} ranks in {time.perf_counter() - t0:.0f} s: {hw.source}", flush=True)
                from dtp import testing

                testing.shutdown()  # the calibration's rank pool: not left running beside the runs
                if args.save_hardware:
                    Path(args.save_hardware).mkdir(parents=True, exist_ok=True)
                    (Path(args.save_hardware) / f"calibrated-{n}-round{k + 1}.toml").write_text(to_toml(hw))
            calibrations[n].append(hw)
            print(f"round {k + 1}: {_hw_line(n, hw)}", flush=True)
            if args.predict_only:
                continue
            for name, nproc, flags in (row for row in layouts if row[1] == n):
                wait_quiet(*args.quiet)
                got = measure(flags, nproc, args.steps, args.warmup, workdir, args.timeout)
                runs[name].append(got)
                print(f"round {k + 1}: {name:<24} {nproc} ranks: median {1e3 * statistics.median(got[0]):.0f} ms "
                      f"(steps {' '.join(f'{1e3 * t:.0f}' for t in got[0])}; cpu ours {100 * got[1]:.0f} %, "
                      f"others {100 * got[2]:.0f} %)", flush=True)
    rows: list[dict] = []
    for name, nproc, flags in layouts:
        preds = [predict(flags, hw) for hw in calibrations[nproc]]
        st = sorted(preds, key=lambda p: p.total)[(len(preds) - 1) // 2]  # the median prediction (lower middle)
        got = runs[name]
        steps = [t for g in got for t in g[0]]
        rows.append({"layout": name, "ranks": nproc, "flags": flags,
                     "measured": statistics.median(steps) if steps else float("nan"),
                     "run_medians": [statistics.median(g[0]) for g in got], "runs": got,
                     "cpu_ours": statistics.fmean(g[1] for g in got) if got else float("nan"),
                     "cpu_others": statistics.fmean(g[2] for g in got) if got else float("nan"),
                     "predicted": st.total, "predictions": [p.total for p in preds], "compute": st.compute,
                     "recompute": st.recompute, "bubble": st.bubble, "optimizer": st.optimizer,
                     "exposed": {a: t for a, t in st.exposed.items() if t > 0}})
    print()
    for n in counts:
        for k, hw in enumerate(calibrations[n]):
            print(f"calibration {k + 1}: {_hw_line(n, hw)}")
    print()
    print_table(rows)
    if args.predict_only:
        return 0
    print()
    summaries = {}
    for n in counts:
        summaries[str(n)] = summary([r for r in rows if r["ranks"] == n])
        print_summary(f"{n} ranks", summaries[str(n)])
    if len(counts) > 1:
        summaries["all"] = summary(rows)
        print_summary("all", summaries["all"])
    per_run = max((len(r["runs"]) for r in rows), default=0)
    print(f"\n({time.perf_counter() - started:.0f} s in all; {per_run} run(s) a layout of {args.steps} steps, "
          f"the first {args.warmup} of each dropped; measured = median of the kept steps of every run)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"rows": rows, "summary": summaries,
             "hardware": {str(n): [to_toml(hw) for hw in hws] for n, hws in calibrations.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
