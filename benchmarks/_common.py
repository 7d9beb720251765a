"""What the Llama step benchmarks share (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import argparse


def llama_step_parser(doc: str | None, *, repeats: int, profile_help: str) -> argparse.ArgumentParser:
    """Flags of a benchmark timing Llama training steps: configs, shapes, repeats, profiling."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"], help="llama.config names")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS", help=profile_help)
    return ap
