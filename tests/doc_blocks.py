"""The code blocks of the docs (``docs/**/*.md``, ``README.md``), as the tests run them.

A page is read into :class:`Block`\\ s: fenced blocks with the marker, if any, written on the
line just before the fence as an HTML comment (invisible on the site and on GitHub):

- a ```` ```python ```` block runs by default, in the test's process, the blocks of a page in
  order and in one namespace (as a doctest file runs);
- ``<!-- doc-run: ranks=4 -->``: the block runs as a whole on 4 gloo ranks of
  :mod:`dtp.testing`'s pool, in the page's directory (it imports what it needs);
- ``<!-- doc-run: raises -->``: the block must raise; its output is ``Type: message``;
- ``<!-- doc-run: skip: REASON -->``: not run; the reason is required;
- ``<!-- doc-run: slow -->``: runs only under ``pytest -m slow``;
- a ```` ```bash ````, ```` ```sh ```` or ```` ```console ```` block runs each of its
  lines that begins with ``dtp `` (``\\`` continuations joined, a trailing ``# comment``
  dropped): ``dtp train`` with pooled ranks (:mod:`cli_pool`), the other commands in this
  process. It must exit 0, unless an output block follows;
- ``<!-- doc-run: output -->`` before a ```` ```text ```` block right after a runnable one:
  each of its non-empty lines must appear in that block's output (stdout and stderr), a
  ``…`` standing for any text.

A page's blocks run in one temporary directory, so ``--out runs/a`` and a later
``--resume runs/a`` meet.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)[^\n]*$")
MARKER = re.compile(r"^<!-- doc-run: (.+?) -->$")
SHELLS = {"bash", "sh", "console", "shell"}
RUNNABLE = {"python", *SHELLS}


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, text, first line (1-based) and marker."""

    lang: str
    text: str
    line: int
    marker: str = ""

    @property
    def skip_reason(self) -> str | None:
        return self.marker.split(":", 1)[1].strip() if self.marker.startswith("skip") else None

    @property
    def ranks(self) -> int:
        m = re.fullmatch(r"ranks=(\d+)", self.marker)
        return int(m.group(1)) if m else 0

    @property
    def runnable(self) -> bool:
        return self.lang in RUNNABLE and self.skip_reason is None and self.marker != "output"


def pages() -> list[Path]:
    """Every Markdown page whose blocks run: the site's and the README."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, each with the marker on the line before it."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(ticks):
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j])
        prev = lines[i - 1].strip() if i > 0 else ""
        marker = MARKER.match(prev)
        out.append(Block(lang.lower(), body + "\n", i + 1, marker.group(1).strip() if marker else ""))
        i = j + 1
    return out


def check_markers(path: Path) -> list[str]:
    """What is wrong with the page's markers (an unknown one, a skip without its reason, an
    output block that follows nothing runnable), as readable lines."""
    known = re.compile(r"ranks=\d+|raises|slow|output|skip: .+")
    problems = []
    text = path.read_text().splitlines()
    bs = blocks(path)
    marked_lines = {b.line - 1 for b in bs if b.marker}
    for n, line in enumerate(text, 1):
        m = MARKER.match(line.strip())
        if m and not known.fullmatch(m.group(1).strip()):
            problems.append(f"{path.name}:{n}: unknown marker {m.group(1)!r}")
        elif m and n not in marked_lines:
            problems.append(f"{path.name}:{n}: a marker must be on the line just before a fence")
    for prev, b in zip([None, *bs], bs):
        if b.marker == "output" and (prev is None or not prev.runnable):
            problems.append(f"{path.name}:{b.line}: an output block must follow a runnable block")
    return problems


def commands(block: Block) -> list[list[str]]:
    """The ``dtp ...`` command lines of a shell block, as argv lists without ``dtp``."""
    joined, cur = [], ""
    for line in block.text.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        joined.append(cur + line)
        cur = ""
    out = []
    for line in joined:
        line = re.sub(r"\s+#.*$", "", line.strip().removeprefix("$ "))
        if line.startswith("dtp "):
            out.append(shlex.split(line)[1:])
    return out


def exec_python(source: str, namespace: dict[str, object], raises: bool = False) -> str:
    """Run ``source`` in ``namespace``; return what it printed (and, with ``raises``, the
    exception as ``Type: message``, which it must raise)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, namespace.get("__file__", "<doc>"), "exec"), namespace)  # noqa: S102
    except Exception as e:
        if not raises:
            raise
        return out.getvalue() + f"{type(e).__name__}: {e}\n"
    if raises:
        raise AssertionError("the block was marked raises but raised nothing")
    return out.getvalue()


def on_ranks(source: str, name: str, cwd: str) -> str:
    """A rank's run of a ``ranks=N`` block, in the page's directory ``cwd`` (module level: it
    travels to the pool's workers, which outlive it, so their directory is put back)."""
    here = os.getcwd()
    os.chdir(cwd)
    try:
        return exec_python(source, {"__name__": "__doc__", "__file__": name})
    finally:
        os.chdir(here)


def missing_lines(expected: str, output: str) -> list[str]:
    """The non-empty lines of ``expected`` that ``output`` does not contain; a ``…`` in a
    line stands for any text (a temporary directory's path)."""
    def found(line: str) -> bool:
        pattern = ".*?".join(re.escape(part) for part in line.split("…"))
        return re.search(pattern, output) is not None
    return [line.strip() for line in expected.splitlines() if line.strip() and not found(line.strip())]
