"""``dtp plan``: the plan of a training configuration (:func:`dtp.plan`) from ``dtp train``'s
own flags, and the memory check ``dtp train`` runs before it starts any rank.

::

    dtp plan --model llama3-70b --dp 8 --tp 8 --sp --pp 4 --microbatches 32 --zero 1 \\
             --recompute full --dtype bfloat16 --batch 256 --seq 8192 --memory-gb 80

Imports nothing heavy at module level: the parser is built without torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from .. import schedules
from ..models import config as model_config
from .flags import check_config, run_config
from .parser import (UsageError, _HelpFormatter, add_config_flag, add_nproc, add_print_schedule, add_run_flags,
                     positive_float)
from .shape import check_shape

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..layouts import Layout
    from ..models.config import LlamaConfig
    from ..planning import Plan, Target
    from ..planning.hardware import Hardware

__all__ = ["add_parser", "add_train_flags", "plan_from_args", "plan_of", "cmd_plan", "cmd_calibrate", "cmd_search",
           "preflight", "print_schedule",
           "train_refusal", "machine_memory_gb"]

# The sections of a run a plan reads (dtp.config.SECTIONS): not the checkpoints, not the run's output.
PLAN_SECTIONS = ("parallelism", "model", "training", "data", "moe")


def add_train_flags(train: argparse.ArgumentParser) -> None:
    """``dtp train``'s memory check: a budget and the override."""
    g = train.add_argument_group("memory check (dtp plan runs first)")
    _memory_flag(g, "memory per rank the run may use (default: this machine's: the accelerator's, or the host's RAM "
                    "shared by the local ranks)")
    g.add_argument("--ignore-memory-check", action="store_true",
                   help="train even when the plan's predicted peak exceeds --memory-gb")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``plan`` subcommand: the flags of :data:`PLAN_SECTIONS` of a run (made from
    :class:`dtp.RunConfig`'s fields, as ``dtp train``'s), ``--config`` (a whole run) and the verdict's."""

    # train's formatter: the flags are train's, their help already says where a default is derived
    p = sub.add_parser("plan", help="predict per-rank memory, bytes per mesh axis and the pipeline bubble "
                                    "of a train configuration, allocating nothing",
                       formatter_class=_HelpFormatter, allow_abbrev=False)
    groups = add_run_flags(p, PLAN_SECTIONS)
    add_nproc(groups["parallelism"])
    add_print_schedule(groups["parallelism"])
    add_config_flag(p.add_argument_group("run"))
    verdict = p.add_argument_group("verdict")
    _memory_flag(verdict, "memory per rank to check the peak against (no verdict without it)")
    verdict.add_argument("--backend", choices=("gloo", "nccl", "hccl"), default=None,
                         help="the collectives' backend to plan memory for (default: this machine's: nccl with "
                              "CUDA, hccl with an NPU, else gloo, whose ZeRO reduce-scatter holds whole-bucket "
                              "receive buffers)")
    step = p.add_argument_group("step time")
    step.add_argument("--hardware", dest="hardware_spec", type=_hardware, default=None, metavar="NAME|FILE",
                      help="the system to predict the step's time on: a preset (a100-80gb, h100-sxm, h200, b200, "
                           "ascend-910b, mi300x) or a TOML file such as --calibrate writes")
    step.add_argument("--calibrate", nargs="?", const="-", default=None, metavar="FILE",
                      help="measure this machine (matmul FLOP/s by shape and dtype, memory bandwidth, the gloo "
                           "link by message size; under a minute) and write it as hardware TOML to FILE (default: "
                           "print it), then exit")
    find = p.add_argument_group("search (the fastest layouts by the step-time model)")
    find.add_argument("--search", action="store_true",
                      help="rank every layout of --devices devices (mesh, ZeRO and its overlaps, SP and async TP, "
                           "cp algorithms, pipeline schedules and virtual stages, microbatches, recompute) that "
                           "fits --memory-gb (default: the chip's) by its predicted step on --hardware; layout "
                           "flags given beside it are held")
    find.add_argument("--devices", type=_positive_int, default=None, metavar="N",
                      help="with --search: the devices to lay the run out on")
    find.add_argument("--show", type=_positive_int, default=10, metavar="K",
                      help="with --search: how many of the fastest layouts to print (default 10)")
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def cmd_search(args: argparse.Namespace) -> int:
    """``dtp plan --search``: the ``--show`` fastest layouts (:func:`dtp.planning.search`)."""
    from ..config import RunConfig  # here: the run's fields, which the parser is built without
    from ..config.fields import flag_of  # here: as RunConfig

    if args.devices is None:
        raise UsageError("--search lays the run out on --devices N devices: give --devices")
    hw = args.hardware_spec
    if hw is None:
        from ..planning.hardware import PRESETS, preset_of_device  # here: dtp.planning imports torch

        name = _device_name()
        preset = preset_of_device(name) if name else None
        if preset is None:
            raise UsageError(f"--search ranks layouts by their step time: add --hardware NAME ({', '.join(PRESETS)})"
                             " or --hardware FILE (dtp plan --calibrate FILE measures this machine)")
        hw = PRESETS[preset]
    from ..planning.search import LAYOUT_FIELDS, search  # here: the plan imports torch

    run, default = run_config(args), RunConfig()
    # A field at its default is the search's (dtype: bfloat16); one given is held.
    given = {k: v for k, v in run.to_dict().items()
             if v is not None and v != getattr(default, k) and k not in ("model", "batch", "seq")}
    if given.get("microbatches") == 1 and run.pp == 1:
        given.pop("microbatches")
    held = [flag_of(k) for k in given if k in LAYOUT_FIELDS]
    if held:
        print(f"dtp plan --search: holding {', '.join(held)} as given", file=sys.stderr)
    try:
        found = search(run.model, devices=args.devices, batch=run.batch, seq=run.seq, hardware=hw,
                       memory_gb=args.memory_gb, show=args.show, backend=args.backend or "nccl",
                       preflight=preflight, **given)
    except ValueError as e:
        raise UsageError(str(e).removeprefix("dtp.planning.search: ")) from None
    print("\n".join(found.lines()))
    return 0 if found.top else 1


def preflight(run: "RunConfig", target: "Target", cfg: "LlamaConfig") -> None:
    """``dtp train``'s checks of a run's shape (:func:`~dtp.cli.shape.check_shape`, which
    need no data), raising ``ValueError`` with its line: :func:`dtp.planning.search.search`'s
    ``preflight``, so that a layout it returns is one ``dtp train`` starts."""
    from ..core.mesh.shape import MeshShape  # here: as check_shape, torch-free but only the search's

    try:
        check_shape(argparse.Namespace(**run.to_dict(), check=False), target.layout, cfg, MeshShape(target.axes))
    except UsageError as e:
        raise ValueError(str(e)) from None


def _hardware(text: str) -> "Hardware":
    """``--hardware``'s value as a :class:`~dtp.planning.hardware.Hardware` (argparse's
    type: a bad name or file is its one-line error)."""
    # here: dtp.planning's package imports torch, which the parser is built without
    from ..planning.hardware import hardware

    try:
        return hardware(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_calibrate(target: str) -> int:
    """``--calibrate [FILE]``: write this machine's hardware TOML to ``target`` (``-``: stdout)."""
    # here: calibration runs torch and a rank pool, which only --calibrate needs
    from ..planning.calibrate import calibrate
    from ..planning.hardware_toml import to_toml

    text = to_toml(calibrate())
    if target == "-":
        print(text, end="")
    else:
        with open(target, "w") as f:
            f.write(text)
        print(f"dtp plan: wrote {target}", file=sys.stderr)
    return 0


def _memory_flag(group: argparse._ArgumentGroup, help: str) -> None:
    """``--memory-gb``, the budget both commands check the plan's peak against."""
    group.add_argument("--memory-gb", type=positive_float, default=None, metavar="GIB", help=help)


def plan_from_args(args: argparse.Namespace) -> "Plan":
    """:func:`dtp.plan` of the run the flags describe (their :class:`dtp.RunConfig`: the plan
    sees the layout the run builds, every context and expert option included), on
    ``--backend`` (default: this machine's), of the model the checks built.

    >>> from dtp.cli import build_parser
    >>> plan_from_args(build_parser().parse_args(["plan", "--cp", "4", "--cp-algo", "double_ring",
    ...     "--cp-window", "2", "--seq", "128"])).target.context.window
    2
    """
    # The model the checks built (flags.check_config / preflight): its vocabulary grown to the
    # data's ids is the run's, and may be most of its parameters.
    return plan_of(run_config(args), model=getattr(args, "model_config", None), backend=getattr(args, "backend", None))


def plan_of(config: RunConfig, *, model: LlamaConfig | None = None, backend: str | None = None) -> "Plan":
    """:func:`dtp.plan` of the run ``config`` with the model ``model`` (default: the preset's,
    or ``--init-from``'s, with the run's MoE options; a run's vocabulary grown to its data's
    ids is not in ``config``) for the collectives' ``backend`` (default: this machine's).

    >>> from dtp import RunConfig
    >>> p = plan_of(RunConfig(dp=2, steps=4), backend="gloo")
    >>> p.target.name, p.run.dp
    ('tiny', 2)
    """
    from ..planning import Target, plan  # here: the plan imports torch, which dtp plan's checks run without

    return plan(Target.of(config, cfg=model, backend=backend or machine_backend()))


def cmd_plan(args: argparse.Namespace) -> int:
    """``dtp plan``: print the table; exit 1 when a given ``--memory-gb`` is exceeded. A shape
    ``dtp train`` refuses is refused here with the same line (:func:`~dtp.cli.flags.check_config`)."""
    if getattr(args, "calibrate", None) is not None:
        return cmd_calibrate(args.calibrate)
    if getattr(args, "search", False):
        return cmd_search(args)
    layout = check_config(args)  # before planning imports torch: a refusal takes a fraction of a second
    from ..planning import format_plan  # only now: the plan imports torch

    p = plan_from_args(args)
    print(format_plan(p, args.memory_gb, time=time_lines(p, args.hardware_spec)))
    if args.print_schedule:
        print_schedule(args, layout)
    return 0 if args.memory_gb is None or p.fits(args.memory_gb) else 1


def time_lines(p: "Plan", hw: "Hardware | None") -> list[str]:
    """The plan's step-time lines on ``hw``, else on the accelerator this machine has when it
    is a preset's; else one line saying how to get them."""
    from ..planning.hardware import PRESETS, preset_of_device  # here: dtp.planning imports torch

    if hw is None:
        name = _device_name()
        preset = preset_of_device(name) if name else None
        hw = PRESETS[preset] if preset else None
    if hw is None:
        return [f"step time: add --hardware NAME ({', '.join(PRESETS)}) or --hardware FILE "
                "(dtp plan --calibrate FILE measures this machine)"]
    try:
        return p.time(hw).lines()
    except ValueError as e:  # a dtype the chip lists no peak for: the plan stands without its time
        return [f"step time: {str(e).removeprefix('dtp.plan: ')}"]


def _device_name() -> str | None:
    """The name of this machine's first accelerator, if it has one."""
    import torch

    from ..core.mesh.devices import detect_device  # here: it imports torch, as this function does

    device, _ = detect_device()
    if device in ("cuda", "npu"):  # torch.npu once torch_npu is imported (detect_device did)
        try:
            return getattr(torch, device).get_device_name(0)
        except (AttributeError, RuntimeError):
            return None
    return None


def print_schedule(args: argparse.Namespace, layout: Layout) -> None:
    """``--print-schedule``: each pipeline rank's action list (``--pp > 1``, checked by
    :func:`~dtp.cli.flags.check_config`), for ``dtp train`` and ``dtp plan``."""
    n_layers = model_config.n_sequential_layers(args.model_config)  # check_config made it
    v = layout.pipeline.virtual_stages  # a V schedule's 2 chunks per rank
    table = schedules.format_schedule(schedules.make(args.pp_schedule, p=args.pp, v=v, m=args.microbatches),
                                      p=args.pp)
    print(f"{args.pp_schedule} schedule, pp={args.pp}, virtual stages {v}, "
          f"{args.microbatches} microbatches ({n_layers} layers; F forward, B backward, I/W its input/weight "
          f"halves, F&B a forward paired with a backward, chunk.microbatch):\n{table}")


def machine_backend() -> str:
    """The backend a run here would use (:func:`dtp.mesh.detect_device`): what ``dtp train``
    checks memory for, and ``dtp plan``'s default."""
    from ..core.mesh.devices import detect_device  # here: it imports torch, which the flags' checks run without

    return detect_device()[1]


def machine_memory_gb(nproc: int) -> float:
    """Memory one local rank may use: the accelerator's, else the host's RAM / ``nproc``."""
    import torch

    from ..core.mesh.devices import detect_device  # here: it imports torch, as this function does

    device, _ = detect_device()
    if device in ("cuda", "npu"):  # torch.npu once torch_npu is imported (detect_device did)
        try:
            return getattr(torch, device).get_device_properties(0).total_memory / 2**30
        except (AttributeError, RuntimeError):  # a device module without the call: the host's, below
            pass
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / max(1, nproc) / 2**30


def train_refusal(args: argparse.Namespace, *, local_ranks: int | None = None, quiet: bool = False) -> str | None:
    """What ``dtp train`` refuses with when the plan does not fit (``None``: go ahead).

    The budget is ``--memory-gb``, else :func:`machine_memory_gb` for ``local_ranks`` ranks
    on this machine (default ``--nproc``). A configuration the plan cannot predict is not
    refused: the plan is a guard against runs that cannot fit, not a list of what may run
    (the flags and the layouts have checked the run already). One line on stderr says the
    memory goes unchecked, unless ``quiet``.
    """
    from ..planning import check_fits  # here: the plan imports torch, which dtp train's checks run without

    try:
        p = plan_from_args(args)
    except Exception as e:  # noqa: BLE001 -- whatever the plan cannot do, the run still starts
        reason = " ".join(str(e).split()).removeprefix("dtp.plan: ")
        if not isinstance(e, ValueError):
            reason = f"{type(e).__name__}: {reason}"
        if not quiet:
            print(f"dtp train: the plan does not model this configuration ({reason}); not checking memory",
                  file=sys.stderr)
        return None
    budget = getattr(args, "memory_gb", None)
    if budget is None:
        budget = machine_memory_gb(args.nproc if local_ranks is None else local_ranks)
    return check_fits(p, budget, override=getattr(args, "ignore_memory_check", False))
