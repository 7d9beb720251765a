"""The ``dtp`` command (``dtp train``, ``dtp check``); the code lives in :mod:`dtp.cli.flags`
while the package is being split."""

from .flags import (  # noqa: F401  (the public surface of dtp.cli, plus what tests reach)
    UsageError, _Progress, build_layout, build_parser, check_run, compare_losses, format_bytes,
    format_step, main, mesh_axes, parse_args, progress_bar, summarize, tolerance_for, train_argv,
    validate,
)
