"""make_mesh: detection (cpu / npu), process-group set-up, sub-meshes and flattened views."""

import datetime
import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dtp
from dtp import mesh as mesh_mod
from dtp.testing import run


@pytest.mark.parametrize("exc", [ImportError, OSError, RuntimeError])
def test_failing_torch_npu_import_means_no_npu(monkeypatch, exc):
    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "torch_npu":
            raise exc("libascendcl.so: cannot open shared object file")
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mesh_mod.detect_device() == ("cpu", "gloo")


def test_package_import_does_not_import_torch_npu():
    code = "import sys, dtp; assert 'torch_npu' not in sys.modules; print('clean')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "clean", out.stderr


def test_fake_npu_device_gets_hccl_mesh():
    script = Path(__file__).parent / "scripts" / "fake_npu_mesh.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "fake npu ok" in out.stdout, out.stdout + out.stderr


def test_bad_axes_are_rejected():
    with pytest.raises(ValueError, match="at least one named axis"):
        dtp.make_mesh()
    with pytest.raises(ValueError, match=r"axis 'tp' has size 0"):
        dtp.make_mesh(dp=1, tp=0)
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        dtp.make_mesh(dp=1, device="tpu")


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf"), "5", True, datetime.timedelta(0)])
def test_bad_timeout_is_rejected(timeout):
    # Checked before the process group is touched (the stall itself: test_cli's stalled peer).
    with pytest.raises(ValueError, match=r"make_mesh: timeout must be a number of seconds > 0 \(or a timedelta\)"):
        dtp.make_mesh(dp=1, timeout=timeout)


def _submeshes():
    mesh = dtp.make_mesh(dp=2, cp=2, tp=2)
    assert dtp.make_mesh(dp=2, cp=2, tp=2) is mesh  # idempotent: no new process groups
    ep = dtp.flatten_axes(mesh, ("dp", "cp"))
    with dtp.comm_log() as log:
        total = dtp.comm.all_reduce(torch.ones(1), ep, "dp_cp")
    return (mesh["tp"].size(), ep.mesh_dim_names, ep.size(), float(total), [r.axis for r in log.records],
            mesh_mod.axis_coordinate(mesh, "tp"))


@pytest.mark.slow  # a world of 8
def test_submesh_and_flattened_ep_view():
    res = run(_submeshes, world_size=8)
    assert all(r[:5] == (2, ("dp_cp",), 4, 4.0, ["dp_cp"]) for r in res)
    assert [r[5] for r in res] == [0, 1] * 4


def test_axis_helpers_and_block_index():
    with dtp.testing.simulate(8):
        mesh = dtp.make_mesh(dp=2, tp=4)
        assert dtp.mesh.axis_names(mesh) == ("dp", "tp")
        assert dtp.mesh.axis_sizes(mesh) == {"dp": 2, "tp": 4}
        assert dtp.mesh.block_index(mesh, ("dp", "tp"), {"dp": 1, "tp": 2}) == 1 * 4 + 2
        assert dtp.mesh.block_index(mesh, ("tp", "dp"), {"dp": 1, "tp": 2}) == 2 * 2 + 1
        assert dtp.mesh.block_index(mesh, (), {"dp": 1, "tp": 2}) == 0
        assert set(dtp.mesh.coordinates(mesh)) == {"dp", "tp"}


def test_twins_and_sub_meshes_are_cached_per_mesh_object():
    # twin(mesh) == mesh (DeviceMesh equality ignores process groups): cached by equality,
    # twin(twin(mesh)) was the twin itself, sub_mesh(twin(mesh), names) mesh's sub-mesh,
    # and a DTensor wrapped on the twin landed on mesh.
    from dtp.core.mesh.devices import sub_mesh, twin

    with dtp.testing.simulate(4):
        mesh = dtp.make_mesh(dp=2, tp=2)
        other = twin(mesh)
        assert other == mesh and other is not mesh and twin(mesh) is other
        assert twin(other) is not other
        assert sub_mesh(other, ("tp",)) is not sub_mesh(mesh, ("tp",))
        assert sub_mesh(other, ("tp",)) is sub_mesh(other, ("tp",))
        x = dtp.shard(torch.zeros(4, 2), mesh, dtp.P("dp"))
        assert dtp.spec.wrap_like(x.to_local(), x).device_mesh is mesh
        assert dtp.spec.wrap_local(x.to_local(), other, dtp.P("dp"), (4, 2)).device_mesh is other
