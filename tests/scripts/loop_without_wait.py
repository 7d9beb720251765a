"""A user's own training loop that ends without ``dtp.wait(state)``: run by
tests/test_state.py under ``torch.distributed.run`` (2 ranks). ZeRO-1 with
``overlap_param_gather`` returns from each step with the next step's all-gathers in flight;
the script then simply ends (``destroy`` as argv[1]: after ``destroy_process_group``)."""

import sys

import torch
import torch.distributed as dist

import dtp

g = torch.Generator().manual_seed(0)
params = {f"w{k}": torch.randn(512, 512, generator=g) * 0.04 for k in range(8)}
layout = dtp.layouts.data() + dtp.layouts.zero(1, bucket_mb=1, overlap_param_gather=True)
state = dtp.TrainState.create(params, dtp.optim.adamw(1e-2), mesh=dtp.make_mesh(dp=2), layout=layout,
                              axes={k: ("embed", "mlp") for k in params})


def loss_fn(p, batch):
    x = batch["x"]
    for k in range(8):
        x = torch.tanh(x @ p[f"w{k}"])
    return ((x - batch["y"]) ** 2).mean()


batch = {"x": torch.randn(4, 512, generator=g), "y": torch.randn(4, 512, generator=g)}
for _ in range(3):
    state, metrics = dtp.train_step(loss_fn, state, dtp.shard_batch(batch, state))
print(f"rank {dist.get_rank()} trained: loss {metrics['loss']:.6f}", flush=True)
if sys.argv[1:] == ["destroy"]:
    dist.destroy_process_group()
