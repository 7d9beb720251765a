"""One device, a ~1B Llama in bf16 mixed precision: ``dtp train`` vs a plain PyTorch
``nn.Module`` of the same model, eager and compiled — tokens/s and MFU (issue 22 item 5).

    PYTHONPATH=src python benchmarks/gpu_step.py --out "$OUT"                 # on a GPU
    python benchmarks/gpu_step.py --model tiny --device cpu --dtype float32 --batch 2 --seq 32 \
        --steps 3 --compile none                                              # the CPU smoke run

Prepared for the lent device machine (torch 2.11 there, no network, ~15 min of device time a
session, all of it counted): one command, every figure in one JSON file under ``--out``.

* **dtp**: ``python -m dtp.cli train --model 1b --dtype bfloat16 --precision mixed`` (bf16
  parameters for compute, fp32 master weights and gradient accumulation: Megatron's recipe)
  on one process, so one device: the CLI as a user runs it, its own corpus and AdamW, and
  ``--compile inductor`` for the compiled run (dtp's regions are the blocks on one device,
  :mod:`dtp.compiled`). Figures from its ``metrics.jsonl``.
* **torch**: ``benchmarks/tp_vs_torch.TorchLlama`` (SDPA, the same shapes and
  ``llama.init`` weights, embedding tied as the preset's) with PyTorch's own mixed precision,
  ``torch.autocast(bfloat16)`` over fp32 parameters, ``torch.optim.AdamW`` (fused on a GPU),
  the same learning rate, weight decay 0.1 and clip 1.0 as ``dtp train``; compiled as
  torchtitan does, each block by ``torch.compile``. Random tokens of the same shape.

Both report the median over the steps after ``--skip`` (the first ones compile or warm the
allocator): step time, tokens/s and MFU = tokens/s × ``llama.flops_per_token`` (6 × matmul
parameters + causal attention) / peak, where the peak is the datasheet's dense bf16 figure
for a known device (``--peak-tflops`` to name it) and, beside it, a measured bf16 matmul
rate. Peak device memory per side. Not a test: a benchmark to run where a GPU is lent;
``tests/test_gpu_step.py`` runs the smoke command above on the CPU so it does not rot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_vs_torch import TorchLlama  # noqa: E402  (benchmarks/ is not a package)

from dtp.models import llama  # noqa: E402
from dtp.planning.report import format_count  # noqa: E402

# Dense bf16 tensor-core peaks from the vendors' datasheets (SXM parts), TFLOP/s.
DATASHEET_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "B200": 2250.0}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.1, 1.0


def datasheet_peak(device: torch.device, override: float | None) -> float | None:
    """FLOP/s of the device's datasheet (dense bf16), or ``--peak-tflops``; ``None`` unknown."""
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((t * 1e12 for key, t in DATASHEET_TFLOPS.items() if key in name), None)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Best of 5 square ``n`` matmuls, FLOP/s: what this device really gives a GEMM."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def run_dtp(args: argparse.Namespace, backend: str | None) -> dict:
    """``dtp train`` on one process (so one device), as a user runs it."""
    out = Path(args.out) / f"dtp-{backend or 'eager'}"
    cmd = [sys.executable, "-m", "dtp.cli", "train", "--model", args.model, "--dtype", args.dtype,
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--lr", str(LR),
           "--clip", str(CLIP), "--log-every", str(args.steps), "--out", str(out), "--overwrite"]
    if args.dtype != "float32":
        cmd += ["--precision", "mixed"]
    if backend:
        cmd += ["--compile", backend]
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the smoke run: dtp picks its device itself
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"dtp train failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = records[args.skip:] or records
    return {"step_time": statistics.median(r["step_time"] for r in kept),
            "first_step_time": records[0]["step_time"], "wall": wall,
            "loss": [records[0]["loss"], records[-1]["loss"]],
            "mfu_dtp_reported": statistics.median(r["mfu"] for r in kept) if kept[0].get("mfu") else None,
            "peak_memory": _peak_from(proc.stdout)}


def _peak_from(stdout: str) -> str | None:
    # dtp train's header names the plan's predicted peak per rank (its line 2).
    return next((line.split("plan: ", 1)[1] for line in stdout.splitlines() if "plan: peak" in line), None)


def run_torch(args: argparse.Namespace, backend: str | None) -> dict:
    """The same model as a plain ``nn.Module``: autocast mixed precision, torch's AdamW."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    cfg = llama.config(args.model)
    model = TorchLlama(cfg).load_dtp(llama.init(cfg, seed=0)).to(device)  # fp32 parameters (AMP's)
    if backend:
        for i, block in enumerate(model.layers):  # torchtitan's regions: each block
            model.layers[i] = torch.compile(block, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        with autocast:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # dtp reads its loss each step too
        _sync(device)
        times.append(time.perf_counter() - t0)
    kept = times[args.skip:] or times
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_time": statistics.median(kept), "first_step_time": times[0], "loss": [losses[0], losses[-1]],
            "peak_memory": f"{peak / 2**30:.2f} GiB allocated" if peak else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="1b", help="a dtp preset (1b: Llama 3.2 1B's shapes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    ap.add_argument("--compile", default="both", choices=["none", "only", "both"],
                    help="eager only, compiled (inductor) only, or both")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's dense peak (default: datasheet)")
    ap.add_argument("--out", default="gpu_step_out")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cfg = llama.config(args.model)
    flops_per_token = llama.flops_per_token(cfg, args.seq)
    tokens = args.batch * args.seq
    peak = datasheet_peak(device, args.peak_tflops)
    measured = matmul_rate(device, DTYPES[args.dtype], 8192 if device.type == "cuda" else 256)
    backends = {"none": [None], "only": [args.backend], "both": [None, args.backend]}[args.compile]
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "model": args.model, "params": llama.param_count(cfg),
            "batch": args.batch, "seq": args.seq, "dtype": args.dtype, "flops_per_token": flops_per_token,
            "datasheet_flops": peak, "measured_matmul_flops": measured, "runs": {}}
    print(f"{info['device']}, torch {torch.__version__}: {args.model} ({format_count(info['params'])} parameters), "
          f"batch {args.batch} x seq {args.seq}, {args.dtype}; matmul {measured / 1e12:.1f} TFLOP/s measured, "
          f"datasheet {peak / 1e12 if peak else float('nan'):.1f}")
    print(f"{'side':<16}{'step ms':>9}{'tok/s':>10}{'MFU sheet':>11}{'MFU matmul':>12}{'1st step s':>12}  peak memory (dtp: its plan's)")
    for backend in backends:
        for side, fn in (("dtp", run_dtp), ("torch", run_torch)):
            r = fn(args, backend)
            r["tokens_per_s"] = tokens / r["step_time"]
            r["mfu_datasheet"] = r["tokens_per_s"] * flops_per_token / peak if peak else None
            r["mfu_matmul"] = r["tokens_per_s"] * flops_per_token / measured
            name = f"{side} {backend or 'eager'}"
            info["runs"][name] = r
            sheet = f"{r['mfu_datasheet']:.3f}" if r["mfu_datasheet"] else "-"
            print(f"{name:<16}{1e3 * r['step_time']:>9.1f}{r['tokens_per_s']:>10.0f}{sheet:>11}"
                  f"{r['mfu_matmul']:>12.3f}{r['first_step_time']:>12.1f}  {r['peak_memory']}", flush=True)
        dtp_r, torch_r = info["runs"][f"dtp {backend or 'eager'}"], info["runs"][f"torch {backend or 'eager'}"]
        print(f"  dtp / torch step time ({backend or 'eager'}): {dtp_r['step_time'] / torch_r['step_time']:.3f}")
    (Path(args.out) / "gpu_step.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
