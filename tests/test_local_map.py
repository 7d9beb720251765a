"""dtp.local_map (shard_map on DTensor) on 4 gloo ranks, fp64.

Values and gradients against the single-device computation (the gradient of an input
replicated over an axis its outputs vary over arrives as a pending sum and is summed),
in-specs resharding their inputs, pytrees in and out, the collectives it issues (the
shape check's all-gathers only), and a local-shape mismatch raising the same ValueError
on every rank. All cases run in one call to the rank pool.
"""

from __future__ import annotations

import pytest
import torch

import dtp
from dtp import P
from dtp.testing import run

F64 = torch.float64


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, dtype=F64, generator=g)
    w = torch.randn(6, 4, dtype=F64, generator=g)
    up = torch.randn(8, 4, dtype=F64, generator=g)  # d loss / d out, non-uniform
    return x, w, up


def _reference():
    """The single-device run of every case: values and gradients."""
    x, w, up = _data()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = xr @ wr
    (out * up).sum().backward()
    xs = x.clone().requires_grad_()
    s = torch.sin(xs)
    (s * x).sum().backward()
    return {"matmul": (out.detach(), xr.grad, wr.grad), "reshard": (s.detach(), xs.grad)}


def _rank_side() -> dict:
    x, w, up = _data()
    mesh = dtp.make_mesh(dp=2, tp=2)
    res: dict = {}

    # Row-parallel matmul: x split (dp, tp), w split over tp and replicated over dp, the
    # result a pending sum over tp. w's local gradient is a pending sum over dp.
    xd = dtp.shard(x, mesh, P("dp", "tp")).requires_grad_()
    wd = dtp.shard(w, mesh, P("tp", None)).requires_grad_()
    mm = dtp.local_map(lambda a, b: a @ b, (P("dp", "tp"), P("tp", None)), P("dp", partial="tp"),
                       check_shapes=False)
    with dtp.comm_log() as log:
        out = mm(xd, wd)
    res["matmul_records"] = len(log.records)
    res["matmul_spec"] = dtp.spec_of(out)
    full = dtp.reshard(out, P("dp")).full_tensor()
    (full * up).sum().backward()
    res["matmul"] = (full.detach(), xd.grad.full_tensor(), wd.grad.full_tensor())

    # In-specs reshard: a replicated input is sliced to P("dp") before fn sees it.
    xr = dtp.shard(x, mesh, P()).requires_grad_()
    seen: list = []

    def sin(t):
        seen.append(tuple(t.shape))
        return torch.sin(t)

    with dtp.comm_log() as log:
        s = dtp.local_map(sin, (P("dp"),), P("dp"))(xr)
    res["reshard_local_shape"] = seen[0]
    res["reshard_records"] = [(r.kind, r.axis, r.tag) for r in log.records]
    (s.full_tensor() * x).sum().backward()
    res["reshard"] = (s.full_tensor().detach(), xr.grad.full_tensor())

    # Pytrees: a dict in, a tuple out (one out spec per leaf, or one P for a subtree).
    a, b = dtp.shard(x, mesh, P("dp")), dtp.shard(2 * x, mesh, P("dp"))
    tree = dtp.local_map(lambda d: (d["a"] + d["b"], (d["a"] * 2, d["b"].sum())),
                         ({"a": P("dp"), "b": P("dp")},), (P("dp"), (P("dp"), None)), check_shapes=False)
    t0, (t1, t2) = tree({"a": a, "b": b})
    res["tree"] = (dtp.spec_of(t0), t0.full_tensor(), t1.full_tensor(), type(t2).__name__)

    # A local-shape mismatch: rank 0 drops a row. Every rank must raise the same error.
    cut = dtp.local_map(lambda t: t[:-1] if dist_rank() == 0 else t, (P("dp"),), P("dp"))
    with dtp.comm_log() as log:
        try:
            cut(a)
            res["mismatch"] = None
        except ValueError as e:
            res["mismatch"] = str(e)
    res["mismatch_records"] = [(r.kind, r.axis, r.tag) for r in log.records]

    # A plain tensor given a spec next to DTensors is a TypeError (before any collective).
    try:
        dtp.local_map(lambda t, u: t, (P("dp"), P("dp")), P("dp"))(a, x)
        res["plain"] = None
    except TypeError as e:
        res["plain"] = str(e)
    return res


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@pytest.fixture(scope="module")
def results():
    return run(_rank_side, world_size=4)


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_values_and_gradients_match_one_device(results, reference):
    out, gx, gw = reference["matmul"]
    for rank, res in enumerate(results):
        got_out, got_gx, got_gw = res["matmul"]
        torch.testing.assert_close(got_out, out, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} out: {m}")
        torch.testing.assert_close(got_gx, gx, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} dx: {m}")
        # w is replicated over dp: its gradient is the sum of the dp ranks' pending terms
        torch.testing.assert_close(got_gw, gw, rtol=1e-10, atol=1e-12, msg=lambda m: f"rank {rank} dw: {m}")
        assert res["matmul_spec"] == P("dp", partial="tp")
        assert res["matmul_records"] == 0  # specs agree, no shape check: nothing moves


def test_in_specs_reshard_inputs_first(results, reference):
    s, gx = reference["reshard"]
    for res in results:
        assert res["reshard_local_shape"] == (4, 6)  # fn saw the dp shard of a replicated input
        torch.testing.assert_close(res["reshard"][0], s, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(res["reshard"][1], gx, rtol=1e-10, atol=1e-12)
        # replicated -> P("dp") is a free slice; the only collectives are the shape check's
        assert res["reshard_records"] == [("all_gather", "tp", "local_map shapes"),
                                          ("all_gather", "dp", "local_map shapes")]


def test_pytrees_in_and_out(results):
    x, _, _ = _data()
    for res in results:
        spec, t0, t1, t2 = res["tree"]
        assert spec == P("dp")
        torch.testing.assert_close(t0, 3 * x)
        torch.testing.assert_close(t1, 2 * x)
        assert t2 == "Tensor"  # out spec None: returned as fn gave it


def test_local_shape_mismatch_is_a_value_error_on_every_rank(results):
    for rank, res in enumerate(results):
        msg = res["mismatch"]
        assert msg is not None, f"rank {rank} did not raise"
        assert "different local shapes" in msg and "(3, 6) on flat mesh indices [0]" in msg, msg
        assert "(4, 6) on flat mesh indices [1, 2, 3]" in msg, msg
        assert res["mismatch_records"] == [("all_gather", "tp", "local_map shapes"),
                                           ("all_gather", "dp", "local_map shapes")]
    assert len({res["mismatch"] for res in results}) == 1  # the same message everywhere


def test_plain_tensor_with_a_spec_next_to_dtensors_is_a_type_error(results):
    for res in results:
        assert res["plain"] is not None and "plain tensor" in res["plain"]


def test_plain_inputs_on_one_device_pass_through():
    x = torch.randn(3, 4, dtype=F64, requires_grad=True)
    y = dtp.local_map(lambda t: t * 2, (P("dp"),), P("dp"))(x)
    assert type(y) is torch.Tensor
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
