"""A fake "npu" device that holds tensors, for tests that run on a CPU-only machine.

Imported first thing in a fresh interpreter (it renames PrivateUse1 for good): PrivateUse1
becomes "npu" with torch's Python-backend hooks and a device guard, a ``torch_npu``
module is importable, "hccl" is gloo, and a tensor on "npu" is a wrapper around a CPU
tensor that computes every op on CPU — so a run on it gives the CPU run's numbers (up to
kernels that choose by device, such as SDPA's), and a tensor anything forgot to move
shows up as a device mismatch.
"""
import sys
import types

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

_setup_privateuseone_for_python_backend("npu")
sys.modules["torch_npu"] = types.ModuleType("torch_npu")
NPU = torch.device("npu", 0)


class Fake(torch.Tensor):
    """A tensor on "npu": its data a CPU tensor, every op run on that."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=data.dtype,
                                                   device=NPU, storage_offset=data.storage_offset())

    def __init__(self, data: torch.Tensor):
        self.data_ = data

    def __repr__(self) -> str:
        return f"Fake({self.data_})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        to_cpu = func is torch.ops.aten._to_copy.default and device is not None and device.type == "cpu"

        def unwrap(x):
            if isinstance(x, Fake):
                return x.data_
            return torch.device("cpu") if isinstance(x, torch.device) and x.type == "npu" else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if to_cpu:
            return out
        return tree_map(lambda x: Fake(x) if isinstance(x, torch.Tensor) and not isinstance(x, Fake) else x, out)


_lib = torch.library.Library("aten", "IMPL")
_lib.impl("empty.memory_format", lambda size, dtype=None, layout=None, device=None, pin_memory=None,
          memory_format=None: Fake(torch.empty(size, dtype=dtype)), "PrivateUse1")
_lib.impl("empty_strided", lambda size, stride, dtype=None, layout=None, device=None, pin_memory=None:
          Fake(torch.empty_strided(size, stride, dtype=dtype)), "PrivateUse1")
dist.Backend.register_backend("hccl", lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size,
                                                                                                  timeout),
                              devices=["npu", "cpu"])
