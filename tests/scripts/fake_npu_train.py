"""Run in a fresh interpreter by test_precision: ``dtp`` on a fake npu (a world of one):
parameters, optimizer state, master weights and batches all live on the mesh's device,
before and after steps, and the losses are the CPU run's (to the rounding of another
attention kernel)."""
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fake_npu_device import NPU  # noqa: E402  (first: it renames the PrivateUse1 device)

import optree  # noqa: E402
import torch  # noqa: E402

import dtp  # noqa: E402
from dtp.models import llama  # noqa: E402

cfg = llama.config("tiny", n_layers=1)
tok = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
batch = {"tokens": tok[:, :-1].contiguous(), "targets": tok[:, 1:].contiguous()}
layout = dtp.layouts.data() + dtp.layouts.mixed_precision()


def train(device: str) -> tuple[list[float], dtp.TrainState, dict]:
    mesh = dtp.make_mesh(dp=1, device=device)
    assert dtp.mesh.mesh_device(mesh).type == device, dtp.mesh.mesh_device(mesh)
    state = dtp.TrainState.create(llama.init(cfg, seed=0, dtype=torch.bfloat16), dtp.optim.adamw(3e-3), mesh=mesh,
                                  layout=layout, axes=llama.param_axes(cfg))
    losses, placed = [], None
    for _ in range(2):
        placed = dtp.shard_batch(batch, state)
        state, m = dtp.train_step(partial(llama.loss, cfg=cfg), state, placed, microbatches=2)
        losses.append(m["loss"])
    return losses, state, placed


npu_losses, state, placed = train("npu")
# The optimizer's update count is the one host tensor, on purpose: the lr schedule reads it
# with int() every step, which on a device would wait for the device (torch.optim keeps
# its non-capturable `step` on the CPU for the same reason).
moments = [x for x in optree.tree_leaves(state.opt_state) if x.dim() > 0]
assert all(x.device.type == "cpu" for x in optree.tree_leaves(state.opt_state) if x.dim() == 0)
tensors = {"params": optree.tree_leaves(state.params), "opt_state": moments,
           "master": optree.tree_leaves(state.strategy.master), "batch": list(placed.values())}
for what, leaves in tensors.items():
    wrong = {str(x.device) for x in leaves if x.device != NPU}
    assert leaves and not wrong, f"{what}: on {wrong}, not {NPU}"
dtp.mesh.clear_mesh_cache()
torch.distributed.destroy_process_group()
cpu_losses, _, _ = train("cpu")
# Not bit for bit: on a device other than the CPU, attention takes SDPA's math path, not the
# CPU's fused kernel (bf16 rounding differs: measured 6e-6 relative).
assert all(abs(a - b) <= 1e-4 * abs(b) for a, b in zip(npu_losses, cpu_losses)), (npu_losses, cpu_losses)
print("fake npu train ok", npu_losses)
