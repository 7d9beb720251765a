"""Run in a fresh interpreter by test_mesh: a fake "npu" privateuse1 device whose
"hccl" backend is gloo; dtp must detect it and build an npu/hccl mesh."""
import sys, types, os, torch, torch.distributed as dist
torch.utils.rename_privateuse1_backend("npu")
fake = types.ModuleType("torch_npu")
npu_mod = types.ModuleType("torch.npu")
npu_mod.is_available = lambda: True
npu_mod.device_count = lambda: 1
npu_mod.current_device = lambda: 0
npu_mod.set_device = lambda d: None
npu_mod.is_initialized = lambda: True
torch._register_device_module("npu", npu_mod)
sys.modules["torch_npu"] = fake
def _hccl(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)
dist.Backend.register_backend("hccl", _hccl, devices=["npu", "cpu"])
import dtp
assert dtp.detect_device() == ("npu", "hccl"), dtp.detect_device()
m = dtp.make_mesh(dp=1)
assert m.device_type == "npu" and dist.get_backend() == "hccl", (m.device_type, dist.get_backend())
assert torch.equal(dtp.comm.all_reduce(torch.arange(4.0), m, "dp"), torch.arange(4.0))
print("fake npu ok")
