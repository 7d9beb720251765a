"""pytest set-up shared by tests/ and the doctests of src/dtp (``--doctest-modules``).

Doctests see ``torch``, ``dtp``, ``P``, ``make_mesh``, ``llama``, ``simulate`` and
``rank_values`` without importing them, start from seed 0 in a temporary working
directory, and run with no process group: each may call ``make_mesh(dp=1)`` (a 1-rank
group) or ``dtp.testing.simulate(n)``, and the group it leaves is destroyed afterwards
so the next one (or a test) starts clean.
"""

from __future__ import annotations

import pytest

# Collected by --doctest-modules, these would run on import: __main__ calls the CLI, and
# tests/scripts are scripts that test_mesh runs in a fresh interpreter (one renames
# torch's privateuse1 backend).
collect_ignore = ["src/dtp/cli/__main__.py", "tests/scripts"]


def _no_process_group() -> None:
    import torch.distributed as dist

    from dtp import mesh

    if dist.is_initialized():
        dist.destroy_process_group()
    mesh._MESH_CACHE.clear()


@pytest.fixture(autouse=True)
def _doctest_env(request: pytest.FixtureRequest) -> object:
    if getattr(request.node, "dtest", None) is None:  # not a doctest item
        yield
        # A test that made a 1-rank mesh in this process (instead of under
        # dtp.testing.simulate or run) would leave its group to every later simulate().
        import torch.distributed as dist

        if dist.is_initialized():
            _no_process_group()
            pytest.fail("this test left a process group in the test process: make its mesh under "
                        "dtp.testing.simulate(n) or dtp.testing.run", pytrace=False)
        return
    import torch

    import dtp
    from dtp.models import llama
    from dtp.testing import rank_values, simulate

    # Requested here, not as arguments, so that plain tests pay for no tmp_path.
    request.getfixturevalue("doctest_namespace").update(
        torch=torch, dtp=dtp, P=dtp.P, make_mesh=dtp.make_mesh, llama=llama, simulate=simulate,
        rank_values=rank_values)
    torch.manual_seed(0)
    # Examples that write files (loss.png …) write them here.
    request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
    _no_process_group()
    yield
    _no_process_group()
