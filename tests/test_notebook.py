"""notebooks/quickstart.ipynb is committed with its outputs, and a real Jupyter kernel
re-running it reproduces them: the deterministic ones exactly (layouts, comm summaries),
the rest loosely (the loss falls, and stays near the committed curve; the loss plot and
the comm timeline come out as PNG images). The kernel shuts down without a traceback
from the worker ranks on its stderr.
"""

from __future__ import annotations

import base64
import json
import os
import re
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import dtp
from dtp.plot import png_size

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def _tagged(nb: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    (cell,) = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    return cell


def _result(cell: nbformat.NotebookNode) -> str:
    (out,) = [o for o in cell.outputs if o.output_type == "execute_result"]
    return out.data["text/plain"]


def _stream(cell: nbformat.NotebookNode) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream")


def _shape(cell: nbformat.NotebookNode) -> list[tuple[str, tuple[str, ...]]]:
    """What a cell showed, not the values: output types and mime types. (stdout as one
    stream however the kernel split it; stderr, where a library's warning may land on one
    machine and not another, is left to the traceback check.)"""
    shape = [("stdout", ())] if any(o.get("name") == "stdout" for o in cell.outputs) else []
    return shape + [(o.output_type, tuple(sorted(o.get("data", {})))) for o in cell.outputs
                    if o.output_type != "stream"]


def _losses(cell: nbformat.NotebookNode) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"step\s+(\d+)\s+loss\s+([\d.]+)", _stream(cell))}


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory: pytest.TempPathFactory) -> tuple[nbformat.NotebookNode, nbformat.NotebookNode, str]:
    """(committed, re-executed, the kernel's stderr)."""
    committed = nbformat.read(NOTEBOOK, as_version=4)
    fresh = nbformat.read(NOTEBOOK, as_version=4)
    work = tmp_path_factory.mktemp("notebook")
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, which turns figures into PNG outputs
    # The kernel (and the ranks it starts) import the dtp under test.
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(dtp.__file__).parents[1]), env.get("PYTHONPATH")] if p)
    # A kernel of this interpreter, under a name no user's own "python3" kernelspec shadows.
    spec = work / "kernels" / "dtp-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dtp test", "language": "python"}))
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in [str(work), saved] if p)
    try:
        with open(work / "kernel.stderr", "w") as err:
            NotebookClient(fresh, timeout=300, kernel_name="dtp-test", resources={"metadata": {"path": str(work)}},
                           coalesce_streams=True).execute(env=env, stderr=err)
    finally:
        if saved is None:
            del os.environ["JUPYTER_PATH"]
        else:
            os.environ["JUPYTER_PATH"] = saved
    # execute() returns once the kernel has shut down (interrupt, then shutdown request: what
    # Jupyter does), and the kernel stops its ranks at exit: anything they printed is in.
    return committed, fresh, (work / "kernel.stderr").read_text()


def test_notebook_is_committed_with_its_outputs(notebooks):
    committed, _, _ = notebooks
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "run top to bottom in one kernel"
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    for tag in ("loss-plot", "timeline"):
        assert any("image/png" in o.get("data", {}) for o in _tagged(committed, tag).outputs), tag


def test_rerun_shows_what_was_committed(notebooks):
    committed, fresh, _ = notebooks
    for i, (old, new) in enumerate(zip(committed.cells, fresh.cells)):
        if old.cell_type == "code":
            assert _shape(new) == _shape(old), f"cell {i} ({old.metadata.get('tags')}): outputs differ in kind"
    assert _stream(_tagged(fresh, "simulate")) == _stream(_tagged(committed, "simulate"))
    for tag in ("tour", "pending", "train"):  # comm summaries: bytes per axis and kind are exact
        assert _result(_tagged(fresh, tag)) == _result(_tagged(committed, tag)), tag
    assert _result(_tagged(fresh, "tour")) == "{'tp': {'all_to_all': 128, 'all_gather': 256}}"  # (4,16) fp32: half leaves


def test_the_model_trains(notebooks):
    committed, fresh, _ = notebooks
    losses, before = _losses(_tagged(fresh, "train")), _losses(_tagged(committed, "train"))
    assert sorted(losses) == sorted(before) and min(losses) == 1 and max(losses) == 20
    assert losses[20] < losses[1] - 1.5, losses  # 5.6 nats (byte-level) down by more than 1.5 in 20 steps
    for step, loss in losses.items():  # same seed, same data: the committed curve, up to float noise
        assert loss == pytest.approx(before[step], rel=0.02), (step, loss, before[step])
    pipeline = eval(_result(_tagged(fresh, "pipeline")))  # noqa: S307 (our own notebook's list of floats)
    assert len(pipeline) == 5 and pipeline[-1] < pipeline[0]
    assert pipeline == pytest.approx(eval(_result(_tagged(committed, "pipeline"))), rel=1e-3)  # noqa: S307


def test_loss_plot_and_timeline_are_small_pngs(notebooks):
    committed, fresh, _ = notebooks
    for nb in (committed, fresh):
        for tag in ("loss-plot", "timeline"):
            (png,) = [base64.b64decode(o.data["image/png"]) for o in _tagged(nb, tag).outputs if "image/png" in o.get("data", {})]
            width, height = png_size(png)
            assert 200 <= width <= 1000 and 100 <= height <= 600 and len(png) < 100_000, (tag, width, height, len(png))


def test_kernel_shuts_down_without_tracebacks(notebooks):
    _, fresh, stderr = notebooks
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    cells = "".join(o.text for c in fresh.cells if c.cell_type == "code" for o in c.outputs if o.get("name") == "stderr")
    assert "Traceback" not in cells, cells
