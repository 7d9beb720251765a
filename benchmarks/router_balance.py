"""Load balance of aux-loss-free balancing vs the aux loss: ``dtp train --model tiny-moe`` on
the bundled corpus, one process, 100 steps per configuration; the expert
imbalance (max / mean tokens per expert, worst MoE block, from ``metrics.jsonl``) averaged
over the last 10 steps and at the last step, with the LM loss reached.

Configurations (every run: same seed, data and steps):
- aux loss: Megatron's softmax router with the switch loss (coeff 1e-2, the preset's);
- none: the sigmoid router, no aux loss, no bias (what balancing has to beat);
- aux-free RATE: the sigmoid router, no aux loss, the bias moved by RATE·sign(mean − load)
  after each step (DeepSeek-V3: 1e-3).

    python benchmarks/router_balance.py --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIGS = {
    "aux loss 1e-2 (softmax)": [],
    "none (sigmoid, no aux)": ["--router-score", "sigmoid", "--aux-loss-coeff", "0"],
    "aux-free 1e-3 (sigmoid)": ["--router-score", "sigmoid", "--aux-loss-coeff", "0", "--router-bias-update", "1e-3"],
    "aux-free 1e-2 (sigmoid)": ["--router-score", "sigmoid", "--aux-loss-coeff", "0", "--router-bias-update", "1e-2"],
}


def _run(flags: list[str], steps: int, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dtp.cli", "train", "--model", "tiny-moe", "--steps", str(steps), "--out", str(out),
           "--log-every", str(steps), *flags]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    print(f"tiny-moe (4 experts, top-2, 2 MoE blocks), {args.steps} steps, batch 8 × seq 64, bundled corpus")
    print(f"{'configuration':28s} {'imbalance last 10':>18s} {'at last step':>13s} {'lm loss':>8s}")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, flags) in enumerate(CONFIGS.items()):
            records = _run(flags, args.steps, Path(tmp) / str(i))
            tail = [r["expert_imbalance"] for r in records[-10:]]
            print(f"{name:28s} {sum(tail) / len(tail):18.3f} {records[-1]['expert_imbalance']:13.3f} "
                  f"{records[-1]['lm_loss']:8.4f}")


if __name__ == "__main__":
    main()
