"""``--check`` and ``dtp check``: retrain a finished run on one process and compare losses
and gradient norms.

The reference is the same model (seed, data, dtype, optimizer, microbatches) trained on
one process with the plain data-parallel layout. The bar is a relative per-step loss
difference of 1e-9 in float64, 1e-4 in float32 and 5e-2 in bfloat16, over *every* step:
in low precision the two trajectories drift apart a little more each step (different
reduction orders round differently, and the optimizer feeds that back), so short runs
are the meaningful check there; float64 stays tight for hundreds of steps.

The gradient norm (before clipping) is held to the same bar: the loss alone can miss a
gradient that is wrong by a uniform factor (a missing 1/dp, a reduction done twice),
which AdamW's update all but cancels.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from .. import layouts
from ..core._rules import _STEP_TOLERANCE, RUN_RTOL
from ..config import RunConfig, master_weights
from .flags import UsageError
from .optimizer import OptimizerRules
from .resume import segments_mixed
from .loop import single_process_world, train_loop
from .report import plot_losses, write_json, read_metrics

__all__ = ["check_run", "run_of_record", "compare_losses", "tolerance_for", "first_step", "check_in_subprocess"]


def run_of_record(record: Mapping[str, Any]) -> tuple[RunConfig, OptimizerRules]:
    """The run a run directory's ``config.json`` records, and the optimizer rules it trained
    under: what its ``dtp check`` retrains. A record an older dtp wrote may lack fields: a
    missing ``max_skipped`` never aborted (0), a missing ``weight_decay`` or
    ``warmup_from_step_one`` is an older rule (:meth:`OptimizerRules.of_record`); the rest
    are :class:`dtp.RunConfig`'s defaults. The keys that are no field (the vocabulary, the
    mesh, the command, the segments) are the record's, not the run's.

    >>> run, rules = run_of_record({"lr": 0.01, "steps": 4, "dtype": "float64", "mesh": {"dp": 1}})
    >>> run.lr, run.max_skipped, run.weight_decay, rules
    (0.01, 0, 0.1, OptimizerRules(warmup_from_step_one=False, decay_matrices_only=False))
    >>> run_of_record({"steps": 4, "max_skipped": 3, "weight_decay": 0.0, "warmup_from_step_one": True})[1]
    OptimizerRules(warmup_from_step_one=True, decay_matrices_only=True)
    """
    return RunConfig.from_dict({"max_skipped": 0, **record}, strict=False), OptimizerRules.of_record(record)


def tolerance_for(dtype: str) -> float:
    """The relative per-step loss tolerance of ``--check`` for a dtype name.

    >>> tolerance_for("float64")
    1e-09
    """
    return RUN_RTOL[dtype]  # beside the one-step bar in dtp.core._rules; low precision drifts with the steps


def compare_losses(run: Sequence[float], reference: Sequence[float], rtol: float) -> dict[str, Any]:
    """Largest absolute and relative per-step difference; ``ok`` when every step is within ``rtol``.

    A NaN anywhere, or a different number of steps, fails.

    >>> r = compare_losses([5.0, 4.0], [5.0, 4.004], rtol=1e-4)
    >>> r["ok"], r["worst_step"], round(r["max_rel_diff"], 6)
    (False, 2, 0.000999)
    """
    result: dict[str, Any] = {"steps": len(run), "reference_steps": len(reference), "rtol": rtol,
                              "max_abs_diff": 0.0, "max_rel_diff": 0.0, "worst_step": None}
    if len(run) != len(reference) or not run:
        result.update(ok=False, reason=f"the run has {len(run)} steps, the reference {len(reference)}")
        return result
    for i, (a, b) in enumerate(zip(run, reference), start=1):
        diff = abs(float(a) - float(b))
        rel = diff / max(abs(float(b)), 1e-30)
        if not math.isfinite(rel):
            result.update(ok=False, worst_step=i, max_abs_diff=math.inf, max_rel_diff=math.inf,
                          reason=f"step {i}: non-finite loss (run {a}, reference {b})")
            return result
        result["max_abs_diff"] = max(result["max_abs_diff"], diff)
        if rel >= result["max_rel_diff"]:
            result["max_rel_diff"], result["worst_step"] = rel, i
    result["ok"] = result["max_rel_diff"] <= rtol
    return result


def first_step(result: dict[str, Any], dtype: str) -> str | None:
    """What step 1 says of a failed low-precision check (``result``: :func:`compare_losses`'
    with the run's and the reference's losses and, where recorded, gradient norms): within
    one step's bar (DESIGN §4) the two runs parted over the steps, as two summation orders
    in float32 or bf16 do; beyond it they differ from the start. None for a passed check,
    float64 (its bar holds for hundreds of steps) or an unknown dtype.

    >>> r = {"ok": False, "rtol": 1e-4, "run_losses": [5.0, 4.0], "reference_losses": [5.0, 4.001]}
    >>> first_step(r, "float32")[:31]
    'step 1 agrees (max rel 0.00e+00'
    """
    run, ref = result.get("run_losses") or [], result.get("reference_losses") or []
    if result.get("ok") or dtype not in _STEP_TOLERANCE or dtype == "float64":
        return None
    if len(run) != len(ref) or not all(math.isfinite(x) for x in (*run, *ref)):
        return None  # another step count, a NaN: the verdict's reason says what, not drift
    pairs = [(run, ref), (result.get("run_norms"), result.get("reference_norms"))]
    rels = [abs(a[0] - b[0]) / max(abs(b[0]), 1e-30) for a, b in pairs if a and b]
    if not rels or not all(math.isfinite(r) for r in rels):
        return None
    bar, first, rtol = _STEP_TOLERANCE[dtype][0], max(rels), result.get("rtol", 0.0)
    if first > bar:
        return (f"step 1 already differs (max rel {first:.2e} of loss and gradient norm, beyond one step's "
                f"rounding bar {bar:g} in {dtype}): not rounding drift")
    if first > rtol:
        return (f"step 1 differs by max rel {first:.2e} (loss and gradient norm), within one step's rounding bar "
                f"{bar:g} in {dtype} but past rtol {rtol:g}: a bar tighter than {dtype} rounds to; check the "
                f"layout with --dtype float64")
    # A layout error that only shows from step 2 (an optimizer state split wrongly) looks
    # the same from here: float64, whose bar holds for hundreds of steps, tells them apart.
    return (f"step 1 agrees (max rel {first:.2e} of loss and gradient norm, within one step's rounding bar "
            f"{bar:g}): the runs parted over the steps, as {dtype} rounding does in a long run; check the layout "
            f"with --dtype float64 or a shorter run, or give the whole run a looser rtol than {rtol:g} "
            f"(dtp check RUN_DIR --rtol R)")


def _read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise UsageError(f"{path} does not exist (did the run finish?)")
    return read_metrics(path)


def check_run(run_dir: str | os.PathLike[str], *, rtol: float | None = None,
              stream: TextIO | None = None) -> int:
    """Retrain a finished run on one process (plain data layout) and compare per-step losses.

    Prints the largest absolute and relative difference, writes ``check.json``, redraws
    ``loss.png`` with the reference, and returns 0 (within tolerance) or 1.

    Not run as a doctest: it needs a finished run directory (tests/test_cli.py makes one).

    >>> check_run("runs/20250101-120000")                        # doctest: +SKIP
    check: 50 steps vs 1-process reference: max |Δloss| 3.1e-15, max rel 7.2e-16 at step 41; gradient norm max rel 2.4e-15 (rtol 1e-09, float64): OK
    0
    """
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        raise UsageError(f"{cfg_path} does not exist: not a dtp run directory")
    cfg = json.loads(cfg_path.read_text())
    records = _read_metrics(run_dir)
    mixed = segments_mixed(cfg.get("segments") or [], len(records))  # a resume that changed the lr, …
    if mixed:
        raise UsageError(f"{run_dir}: {mixed}")
    run = [float(r["loss"]) for r in records]
    if not run:
        raise UsageError(f"{run_dir}: no step in metrics.jsonl: nothing to check")
    try:
        config, rules = run_of_record(cfg)
    except ValueError as e:  # a record no RunConfig holds (edited by hand, a dtp that allowed more)
        raise UsageError(f"{cfg_path}: {e}") from None
    rtol = tolerance_for(cfg["dtype"]) if rtol is None else rtol
    # A run stopped early (Ctrl-C, a stall) is checked on the steps it trained, under its
    # whole run's lr schedule: retraining all of --steps would take as long as the run
    # would have, then fail on the count.
    last = min(len(run), int(cfg["steps"]))
    of = f" of {cfg['steps']} (the run stopped after step {last})" if last < int(cfg["steps"]) else ""
    print(f"check: retraining {last} steps{of} on 1 process (layout data, recompute none) ...",
          file=stream, flush=True)
    with single_process_world() as mesh:
        # The run's precision too: mixed and pure bf16 are different computations. As the run
        # resolved it: an unset precision under ZeRO keeps fp32 master weights (the reference,
        # without ZeRO, would otherwise update bf16 parameters in place).
        mixed = master_weights(cfg.get("precision"), cfg.get("zero", 0), cfg["dtype"])
        layout = layouts.data() + (layouts.mixed_precision() if mixed else layouts.Layout())
        reference = train_loop(dataclasses.replace(config, compile=None), mesh, layout,  # eager
                               vocab_size=cfg["vocab_size"], recompute=None, last=last, rules=rules)
    ref = [r["loss"] for r in reference]
    result = compare_losses(run, ref, rtol)
    result.update(dtype=cfg["dtype"], run_losses=run, reference_losses=ref)
    if all("grad_norm" in r for r in records):  # a run directory from before has none
        run_norms, ref_norms = [r["grad_norm"] for r in records], [r["grad_norm"] for r in reference]
        norms = compare_losses(run_norms, ref_norms, rtol)
        result.update(run_norms=run_norms, reference_norms=ref_norms)
        result["grad_norm"] = {k: norms[k] for k in ("ok", "max_rel_diff", "worst_step", "max_abs_diff")}
        if result["ok"] and not norms["ok"]:
            result.update(ok=False, reason=(
                f"losses within rtol (max rel {result['max_rel_diff']:.2e}), but the gradient norm differs: "
                f"max rel {norms['max_rel_diff']:.2e} at step {norms['worst_step']}"
                + (f" ({norms['reason']})" if norms.get("reason") else "")))
    write_json(run_dir / "check.json", result)
    mesh_name = " ".join(f"{k}={v}" for k, v in cfg["mesh"].items())
    plot_losses(run_dir, {mesh_name: run, "1-process reference": ref}, cfg)
    verdict = "OK" if result["ok"] else "FAILED"
    detail = result.get("reason") or (
        f"max |Δloss| {result['max_abs_diff']:.2e}, max rel {result['max_rel_diff']:.2e} "
        f"at step {result['worst_step']}"
        + (f"; gradient norm max rel {result['grad_norm']['max_rel_diff']:.2e}" if "grad_norm" in result else ""))
    print(f"check: {len(run)} steps vs 1-process reference: {detail} (rtol {rtol:g}, {cfg['dtype']}): {verdict}",
          file=stream, flush=True)
    hint = first_step(result, cfg["dtype"])
    if hint:
        print(f"check: {hint}", file=stream, flush=True)
    return 0 if result["ok"] else 1


def check_in_subprocess(out: str) -> int:
    """Under an outside torchrun world, the reference needs a process of its own (this
    one's process group has WORLD_SIZE ranks): rank 0 runs ``dtp check`` without torchrun's
    variables, so it builds a world of one."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                        "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")}
    return subprocess.call([sys.executable, "-m", "dtp.cli", "check", out], env=env)
