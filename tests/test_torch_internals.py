"""Every private torch API behind dtp.core._torch still exists with the shape dtp calls it
with: a torch upgrade that moves one fails here, by name."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import dtp
from dtp.core import _torch
from dtp.testing import rank_values, simulate


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_strided_shard():
    from torch.distributed.tensor.placement_types import _StridedShard

    assert _torch.StridedShard is _StridedShard
    pl = _StridedShard(1, split_factor=2)
    assert (pl.dim, pl.split_factor) == (1, 2)


def test_local_tensor_attribute():
    with simulate(2):
        x = dtp.shard(torch.arange(4.0), dtp.make_mesh(dp=2), dtp.P("dp"))
        assert isinstance(x, DTensor)
        assert isinstance(x._local_tensor, torch.Tensor) and _torch.local_tensor(x) is x._local_tensor


def test_mesh_flatten_unflatten():
    assert callable(DeviceMesh._flatten) and _params(DeviceMesh._flatten)[:2] == ["self", "mesh_dim_name"]
    assert _params(DeviceMesh._unflatten)[:4] == ["self", "dim", "mesh_sizes", "mesh_dim_names"]
    with simulate(8):
        mesh = dtp.make_mesh(dp=2, cp=4)
        flat = _torch.flatten_mesh(mesh[("dp", "cp")], "dp_cp")
        assert (flat.mesh_dim_names, flat.size()) == (("dp_cp",), 8)
        view = _torch.unflatten_mesh(mesh, "cp", (2, 2), ("cp_a", "cp_b"))
        assert view.mesh_dim_names == ("dp", "cp_a", "cp_b") and view.mesh.shape == (2, 2, 2)


def test_dynamo_counters():
    from torch._dynamo.utils import counters

    assert _torch.dynamo_counters() is counters
    assert isinstance(counters["stats"].get("unique_graphs", 0), int) and hasattr(counters["graph_break"], "items")


def test_autograd_internals():
    assert torch._C._current_graph_task_id() == -1 and _torch.current_graph_task_id() == -1
    from torch._C._autograd import SavedTensor, _make_saved_tensor

    assert _torch.SavedTensor is SavedTensor
    t = torch.ones(3)
    saved = _make_saved_tensor(t, is_output=False)
    assert isinstance(saved, SavedTensor) and torch.equal(_torch.unpack_saved(_torch.make_saved_tensor(t)), t)


def test_cpu_flash_attention_ops():
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert [a.name for a in fwd._schema.arguments] == ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]
    assert [a.name for a in bwd._schema.arguments][:9] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal", "attn_mask"]
    q, k, v = torch.randn(3, 1, 2, 4, 8, dtype=torch.float64).unbind(0)
    out, lse = _torch.cpu_flash_attention(q, k, v, True, 0.5)
    assert out.shape == q.shape and lse.shape == (1, 2, 4)
    dq, dk, dv = _torch.cpu_flash_attention_backward(torch.ones_like(out), q, k, v, out, lse, True, 0.5)
    assert dq.shape == dk.shape == dv.shape == q.shape


def test_cuda_efficient_attention_schema():
    op = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert [a.name for a in op._schema.arguments][:6] == [
        "query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p"]
    assert [a.name for a in op._schema.arguments][6:8] == ["is_causal", "scale"]


def test_local_tensor_mode_and_fake_store():
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode, maybe_run_for_local_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert _torch.LocalTensorMode is LocalTensorMode and _torch.LocalTensor is LocalTensor
    assert _torch.maybe_run_for_local_tensor is maybe_run_for_local_tensor
    assert _params(LocalTensorMode.__init__)[:2] == ["self", "ranks"]
    assert isinstance(_torch.fake_store(), FakeStore)
    assert _torch.local_tensors(torch.ones(1)) is None and not _torch.is_local_tensor(torch.ones(1))


def test_simulated_ranks_expose_local_tensors():
    with simulate(2):
        mesh = dtp.make_mesh(dp=2)
        x = dtp.shard(torch.arange(4.0), mesh, dtp.P("dp")).to_local()
        assert _torch.is_local_tensor(x) and sorted(x._local_tensors) == [0, 1]
        assert [t.tolist() for t in rank_values(x)] == [[0.0, 1.0], [2.0, 3.0]]


def test_forget_meshes_clears_the_sharding_propagation_caches():
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    assert callable(_clear_sharding_prop_cache)
    with simulate(2):
        x = dtp.shard(torch.ones(4, 3), dtp.make_mesh(dp=2), dtp.P("dp"))
        x * 2, x * 2
        assert torch._C._get_DTensor_sharding_propagator_cache_stats() != (0, 0)  # the C++ fast path's
        _torch.forget_meshes()
        assert not _torch._SPECS
        assert DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize == 0
        assert torch._C._get_DTensor_sharding_propagator_cache_stats() == (0, 0)


def test_grouped_mm_exists_and_is_used_only_where_it_runs():
    assert callable(torch._grouped_mm)  # CUDA-only kernel; its numbers are checked on a GPU (benchmarks/moe_grouped_gemm.py)
    x, w = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(2, 8, 8, dtype=torch.bfloat16)
    assert not _torch.grouped_mm_usable(x, w)  # CPU: the padded bmm runs instead


def test_new_dtensor_constructor():
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    assert _params(TensorMeta)[:3] == ["shape", "stride", "dtype"] and callable(DTensorSpec)
    with simulate(2):
        mesh = dtp.make_mesh(dp=2)
        placements = dtp.spec.to_placements(dtp.P("dp"), mesh)
        local = torch.ones(2, 3)
        x = _torch.new_dtensor(local, mesh, placements, (4, 3), (3, 1))
        y = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size((4, 3)), stride=(3, 1))
        assert (x.shape, x.stride(), x.placements, x.dtype) == (y.shape, y.stride(), y.placements, y.dtype)
        assert x._spec is _torch.new_dtensor(local, mesh, placements, (4, 3), (3, 1))._spec  # one spec, shared
        assert _torch.local_tensor(x) is not local  # a fresh view of the same memory
        local.add_(1)
        assert torch.equal(x.to_local(), local)


def test_run_backward_is_autograd_grad_without_its_checks():
    from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge

    assert callable(_engine_run_backward)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    unused = torch.zeros(1, requires_grad=True)
    y = torch.tanh(x @ w)
    g = torch.randn(2, 3, dtype=torch.float64)
    want = torch.autograd.grad(y, [x, w, unused], g, retain_graph=True, allow_unused=True)
    got = _torch.run_backward([y], [g], [x, w, unused], retain_graph=True)
    assert got[2] is None and all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))
    # Edges as outputs and inputs (what the zero-bubble weight pass starts from and asks for)
    mm = y.grad_fn.next_functions[0][0]
    dy = torch.ops.aten.tanh_backward(g, y.detach())  # what reaches the mm node: tanh's own backward, same bits
    dw = _torch.run_backward([GradientEdge(mm, 0)], [dy], [get_gradient_edge(w)])
    assert torch.equal(dw[0], want[1])


def test_disable_dynamo_lazily():
    from torch._compile import _disable_dynamo

    assert _params(_disable_dynamo)[:2] == ["fn", "recursive"]
    wrapped = _torch.disable_dynamo_lazily(lambda x: x + 1)
    assert wrapped(1) == 2


def test_no_donated_buffers():
    import torch._functorch.config as functorch_config

    before = functorch_config.donated_buffer
    with _torch.no_donated_buffers():
        assert functorch_config.donated_buffer is False
    assert functorch_config.donated_buffer == before


def _timeouts() -> tuple:
    import datetime

    import torch.distributed as dist

    group = dist.new_group([0, 1])
    before = _torch.group_timeout(group)
    _torch.set_group_timeout(group, datetime.timedelta(seconds=7))
    return _torch.group_timeout(dist.group.WORLD), before, _torch.group_timeout(group)


def test_group_timeout_is_read_and_set_through_the_backend_options():
    """dtp.mesh.bounded gives a DeviceMesh's groups the world's timeout this way."""
    import datetime

    from dtp.testing import run

    world, before, after = run(_timeouts, world_size=2)[0]
    assert isinstance(world, datetime.timedelta) and isinstance(before, datetime.timedelta)
    assert after == datetime.timedelta(seconds=7)
