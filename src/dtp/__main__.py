"""``python -m dtp``: the ``dtp`` command (the console script, and ``python -m dtp.cli``,
which the launcher runs in each rank)."""

from .cli import console

console()
