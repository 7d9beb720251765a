"""``python -m dtp.cli``: what torchrun and the launcher run in each rank (and the same as
the ``dtp`` console script)."""

from . import console

console()
