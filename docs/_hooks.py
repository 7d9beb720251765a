"""MkDocs hooks: the parts of the site that are generated, so that nothing is written twice.

A page holds a marker line ``<!-- generated: NAME -->``; the build replaces it with
:data:`GENERATORS`'s ``NAME`` output (tests/test_docs.py runs the same generators):

- ``flags-train`` / ``flags-plan``: the flag reference, read from the real parser (whose
  run flags are made from :class:`dtp.RunConfig`'s fields), one table per argument group;
- ``modules``: the package tree, each module with its docstring's first sentence;
- ``benchmarks``: the results table of ``benchmarks/README.md``;
- ``changelog``: ``CHANGELOG.md``.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flags(command: str) -> str:
    """``dtp <command>``'s flags: a table per argument group, as ``--help`` has them."""
    from dtp.cli.commands import build_parser  # torch-free, like the CLI's parsing

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmd = sub.choices[command]
    formatter = cmd._get_formatter()
    out = []
    for group in cmd._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        out += [f"### {group.title[0].upper()}{group.title[1:]}", "", "| flag | value | what it does |", "|---|---|---|"]
        for a in actions:
            names = " ".join(f"`{s}`" for s in a.option_strings)
            if a.nargs == 0:
                value = "switch"
            elif a.choices:
                value = " ".join(f"`{c}`" for c in a.choices)
            else:
                value = f"`{a.metavar or a.dest.upper()}`"
            help_text = formatter._expand_help(a) if a.help else ""
            out.append(f"| {names} | {value} | {_cell(help_text)} |")
        out.append("")
    return "\n".join(out)


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence, its reST roles and literals as Markdown code."""
    para = doc.strip().split("\n\n", 1)[0]
    para = " ".join(para.split())
    m = re.search(r"(?<![.\w]\.\w)(?<!e\.g)(?<!i\.e)\.(\s|$)", para)
    sentence = para[: m.start() + 1] if m else para
    sentence = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", sentence)
    return _cell(sentence.replace("``", "`"))


def _modules() -> str:
    """``src/dtp``'s packages and modules, each with its docstring's first sentence."""
    src = ROOT / "src"
    rows = ["| module | what it holds |", "|---|---|"]
    for path in sorted((src / "dtp").rglob("*.py")):
        rel = path.relative_to(src).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        if any(p.startswith("_") and p != "__init__" for p in rel.parts) or "__pycache__" in parts:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        depth = len(parts) - 1
        name = ".".join(parts) + ("/" if rel.name == "__init__" else "")
        rows.append(f"| {'&nbsp;' * 4 * depth}`{name}` | {_first_sentence(doc)} |")
    return "\n".join(rows)


def _benchmarks() -> str:
    """The table of ``benchmarks/README.md`` (between its table markers), its links made the site's."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    m = re.search(r"<!-- table: start -->\n(.*?)<!-- table: end -->", text, re.S)
    if m is None:
        raise ValueError("benchmarks/README.md has no '<!-- table: start -->' ... '<!-- table: end -->'")
    return m.group(1).replace("](../docs/benchmarks/", "](")


def _changelog() -> str:
    """CHANGELOG.md, its first heading dropped (the page has its own)."""
    text = (ROOT / "CHANGELOG.md").read_text().split("\n", 1)[1]
    return text.replace("](docs/", "](")


GENERATORS = {"flags-train": lambda: _flags("train"), "flags-plan": lambda: _flags("plan"),
              "modules": _modules, "benchmarks": _benchmarks, "changelog": _changelog}


def expand(markdown: str) -> str:
    """``markdown`` with every marker replaced by its generator's output."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise KeyError(f"docs: no generator {name!r} (known: {', '.join(sorted(GENERATORS))})")
        return GENERATORS[name]()
    return MARKER.sub(one, markdown)


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    return expand(markdown)


ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj|const):(<code>)~?")


def on_page_content(html: str, **kwargs: object) -> str:
    """The docstrings are reST-flavoured (``:func:`x` ``, read by Python's help and by
    doctest); mkdocstrings renders the role's name as text before the code: drop it."""
    return ROLE.sub(r"\1", html)
