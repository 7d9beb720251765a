"""The docs run: every code block of ``docs/`` and ``README.md`` (the rules are
:mod:`doc_blocks`'), the site builds with ``mkdocs build --strict``, and no relative link of
a Markdown file in the repository is dead."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed

import cli_pool
from doc_blocks import ROOT, Block, blocks, check_markers, commands, exec_python, missing_lines, on_ranks, pages
from dtp import cli, testing
from dtp.core.mesh.devices import clear_mesh_cache

# Set by .ci/run: there a missing docs toolchain fails the build instead of skipping it.
REQUIRED_ENV = "DTP_DOCS_REQUIRED"


def _runs(path: Path, slow: bool) -> bool:
    return any(b.runnable and (slow or b.marker != "slow") for b in blocks(path))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


FAST = [pytest.param(p, id=_rel(p)) for p in pages() if _runs(p, slow=False)]
SLOW = [pytest.param(p, id=_rel(p)) for p in pages() if any(b.marker == "slow" and b.runnable for b in blocks(p))]


def _cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """``dtp <argv>``: ``train`` on pooled ranks, the rest in this process."""
    if argv and argv[0] == "train":
        r = cli_pool.train(monkeypatch, *argv[1:])
        return r.returncode, r.stdout + r.stderr
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue() + err.getvalue()


def _run_block(b: Block, where: str, namespace: dict[str, object], expect_output: bool,
               monkeypatch: pytest.MonkeyPatch) -> str:
    if b.lang == "python":
        # Padded so a traceback's line numbers are the page's.
        source = "\n" * b.line + b.text
        if b.ranks:
            return testing.run(on_ranks, source, where, os.getcwd(), world_size=b.ranks)[0]
        return exec_python(source, namespace, raises=b.marker == "raises")
    out = ""
    for argv in commands(b):
        code, text = _cli(argv, monkeypatch)
        out += text
        assert expect_output or code == 0, f"{where}: `dtp {' '.join(argv)}` exited {code}:\n{text}"
    return out


def run_page(path: Path, slow: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Run the page's blocks in order in ``tmp_path``; check each output block."""
    monkeypatch.chdir(tmp_path)
    had_group = torch.distributed.is_initialized()
    try:
        _run_blocks(path, slow, monkeypatch)
    finally:
        # A page is a script: a mesh of one it made (dtp.make_mesh(dp=1) starts a group of
        # one) ends with it, as its process would.
        if torch.distributed.is_initialized() and not had_group:
            torch.distributed.destroy_process_group()
            clear_mesh_cache()


def _run_blocks(path: Path, slow: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    namespace: dict[str, object] = {"__name__": "__doc__", "__file__": _rel(path)}
    bs = blocks(path)
    output: str | None = None
    for i, b in enumerate(bs):
        where = f"{_rel(path)}:{b.line}"
        if b.marker == "output":
            if output is None:   # the block it shows is slow, and this run is not
                continue
            missing = missing_lines(b.text, output)
            assert not missing, f"{where}: not in the output: {missing}\n--- output:\n{output}"
            continue
        output = None
        if not b.runnable or (b.marker == "slow" and not slow):
            continue
        expect_output = i + 1 < len(bs) and bs[i + 1].marker == "output"
        output = _run_block(b, where, namespace, expect_output, monkeypatch)


@pytest.mark.parametrize("path", FAST)
def test_page_blocks_run(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    run_page(path, False, monkeypatch, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("path", SLOW)
def test_page_blocks_run_with_the_slow_ones(path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    run_page(path, True, monkeypatch, tmp_path)


def test_markers_are_known_and_placed() -> None:
    problems = [p for page in pages() for p in check_markers(page)]
    assert not problems, "\n".join(problems)


def test_every_python_and_shell_block_runs_or_says_why_not() -> None:
    """A block of a runnable language is run, or marked skip with its reason; the README's
    set-up commands (pip into a new venv) are the one kind of shell line not run."""
    unmarked = [f"{_rel(p)}:{b.line}" for p in pages() for b in blocks(p)
                if b.lang in ("py", "python3", "shell-session", "pycon")]
    assert not unmarked, f"use ```python / ```bash fences so the runner sees these blocks: {unmarked}"


def _markdown_files() -> list[Path]:
    skip = {".venv", ".git", "node_modules", ".cache", ".pytest_cache"}
    return [p for p in sorted(ROOT.rglob("*.md")) if not skip & set(p.relative_to(ROOT).parts)]


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_no_relative_link_is_dead() -> None:
    dead = []
    for md in _markdown_files():
        text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)   # links inside code are code
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            if not (md.parent / file).exists():
                dead.append(f"{_rel(md)}: {target}")
    assert not dead, "dead relative links:\n" + "\n".join(dead)


def _hooks():
    spec = importlib.util.spec_from_file_location("dtp_docs_hooks", ROOT / "docs" / "_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_section_has_its_generator() -> None:
    hooks = _hooks()
    for md in (ROOT / "docs").rglob("*.md"):
        assert hooks.expand(md.read_text()) is not None   # raises on an unknown marker


def test_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: no broken link, anchor, nav entry or API reference."""
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(f"{REQUIRED_ENV} is set but mkdocs is not installed (pip install -e '.[docs]')")
        pytest.skip("the docs site needs its extra: pip install -e '.[docs]'")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_readmes_benchmark_figures_are_the_benchmark_tables() -> None:
    """The README's headline figures are a copy of ``benchmarks/README.md``'s current ones:
    each must stand in that table's row of the same benchmark, so a new figure there that
    is not carried to the README fails here rather than leaving two figures apart."""
    readme = (ROOT / "README.md").read_text()
    table = (ROOT / "benchmarks" / "README.md").read_text().splitlines()
    rows = re.findall(r"^\| \[[^]]+\]\(docs/benchmarks/(\w+)\.md\) \| ([^|]+) \|", readme, re.M)
    assert len(rows) >= 5, rows
    for name, figure in rows:
        mine = [line for line in table if f"](../docs/benchmarks/{name}.md)" in line]
        assert mine, f"README links docs/benchmarks/{name}.md, which benchmarks/README.md's table has no row for"
        assert figure.strip() in mine[0], f"README's {name} figure {figure.strip()!r} is not the table's:\n{mine[0]}"
