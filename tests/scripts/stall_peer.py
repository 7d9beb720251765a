"""A user's loop on 2 ranks, launched by test_cli through dtp.launch.launch(module=
"stall_peer"): rank 1 stalls (sleeps far past the timeout) before its 4th collective.
Rank 0 must fail in that collective within the timeout (dtp.comm.CollectiveError, not
caught here: a traceback), and the launcher then names both ranks' last collectives."""
import sys
import time

import torch
import torch.distributed as dist

import dtp

mesh = dtp.make_mesh(dp=2, timeout=float(sys.argv[1]))
x = torch.ones(8)
for step in range(1000):
    if dist.get_rank() == 1 and step == 3:
        print(f"rank 1 stalls at {time.time():.3f}", flush=True)
        time.sleep(600)
    dtp.comm.all_reduce(x, mesh, "dp", tag=f"step {step}")
