"""``python -m dtp.cli``: what torchrun and the launcher run in each rank."""

import sys

from . import main

sys.exit(main())
