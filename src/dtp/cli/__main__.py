"""``python -m dtp.cli``: what torchrun and the launcher run in each rank."""

import os
import signal
import sys

from ..launch import in_torchrun
from . import main

code = main()
if in_torchrun():
    # A rank leaves without interpreter finalization. Measured on torch 2.13 / gloo: even
    # after dtp.wait, comm.drain, a barrier and destroy_process_group, a dp=4 ZeRO-1 run with
    # both overlap flags on a loaded machine (the test suite beside it) still aborted with
    # "terminate called without an active exception": a gloo thread meeting Python's shutdown.
    # By now every file is written (atomically) and the group is gone: nothing is lost.
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 128 + signal.SIGTERM:
        # Stopped by SIGTERM, files written on the way (dtp.cli.process.Terminated): end by
        # that signal as well, so torchrun's agent and the launcher see "stopped", not a crash.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    os._exit(code)
sys.exit(code)
