"""The package's shape, read from its source with ``ast``: no import circle between dtp's
modules (every import counts, at the top or inside a function, except under
``TYPE_CHECKING``), every import inside a function says why it is there, no module past
600 lines, and the old flat tree's module names still import as the modules they are now."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dtp"
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ["dtp", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(sub) for sub in ast.walk(node))
    return skip


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The dtp modules ``name`` imports: ``from . import x`` of a submodule is that submodule,
    any other ``from M import y`` is ``M`` (the module holding ``y``)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs + ([base] if len(subs) < len(node.names) else [])
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith("dtp") and target != name:
                found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    circles = _circles(graph)
    # Each circle with the arrows inside it, to say which import to move.
    said = [{m: sorted(graph[m] & set(c)) for m in c} for c in circles]
    assert said == [], said


def _function_imports(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each import inside a function, not under TYPE_CHECKING."""
    text = path.read_text()
    tree = ast.parse(text)
    skip = _type_checking_nodes(tree)
    out = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                    out.append((node.lineno, node.end_lineno or node.lineno))
    lines = text.splitlines()
    return [(first, "\n".join(lines[first - 1:last])) for first, last in sorted(set(out))]


def test_every_import_inside_a_function_says_why() -> None:
    """An import inside a function is a cost moved to first use (torch, a Hugging Face
    reader, the elastic agent) or an optional package (torch_npu, transformers,
    tensorboard, ...): the reason is a comment on its line, or on the line above it or
    above the group of imports it is in, or the function's docstring names it. Of dtp's
    own modules only the cold start's reason remains (the circles are gone)."""
    unsaid = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for first, text in _function_imports(path):
            if not any(s in text for s in ("from .", "import dtp", "from dtp")):
                continue  # a third-party or standard package: its own reasons (optional, heavy)
            i = first - 1
            said = "#" in lines[i]
            while not said and i > 0:
                above = lines[i - 1].strip()
                if above.startswith("#"):
                    said = True
                elif above.startswith(("from ", "import ")):
                    i -= 1  # the group of imports this one is in: its first line's reason
                    said = "#" in lines[i]
                    continue
                break
            if not said:
                unsaid.append(f"{path.relative_to(SRC)}:{first}: {text.strip()}")
    assert unsaid == [], "\n".join(unsaid)


def test_no_module_past_600_lines() -> None:
    long = {str(p.relative_to(SRC)): n for p in SRC.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, long


def test_the_top_level_shows_the_layers() -> None:
    entries = sorted(p.name for p in SRC.iterdir() if p.name != "__pycache__" and not p.name.endswith(".egg-info"))
    assert entries == ["__init__.py", "__main__.py", "checkpoint", "cli", "config", "core", "data", "layouts",
                       "models", "ops", "planning", "schedules", "strategies", "testing", "training"]


@pytest.mark.parametrize("old", ["dtp.mesh", "dtp.step", "dtp.state", "dtp.comm", "dtp.comm.link", "dtp.optim",
                                 "dtp.spec", "dtp.redistribute", "dtp.launch", "dtp.guard", "dtp.buffers",
                                 "dtp.models.hf_config", "dtp.hf_state", "dtp.plot"])
def test_an_old_module_name_imports_the_module_itself(old: str) -> None:
    import dtp

    module = importlib.import_module(old)
    assert module is sys.modules[dtp.moved_to(old)]
    assert module.__spec__.name == module.__name__ == dtp.moved_to(old)  # its own spec: reload and -m see one module
