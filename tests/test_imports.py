"""The package's shape, read from its source with ``ast``: no import circle between dtp's
modules (every import counts, at the top or inside a function, except under
``TYPE_CHECKING``), every import inside a function says why it is there, no module past
600 lines, and the old flat tree's module names still import as the modules they are now."""

from __future__ import annotations

import ast
import importlib
import importlib.util
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


def _lazy(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """What the lazy packages (PEP 562) import on first use: ``{package: {name: module}}``,
    ``"*"`` for a package that hands every name to one module (``dtp.checkpoint`` to
    ``.store``). Read from their ``_SOURCES`` tables and ``import_module`` calls."""
    out: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        tree = ast.parse(path.read_text())
        table: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys if k is not None):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and str(v.value).startswith("."):
                        table[str(k.value)] = name + str(v.value)
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("names_of"):  # core.lazy
                table["*"] = name + str(node.args[1].value)  # type: ignore[attr-defined]
        if table:
            out[name] = table
    return out


def _imports(name: str, path: Path, modules: dict[str, Path], lazy: dict[str, dict[str, str]]) -> set[str]:
    """The dtp modules ``name`` imports: ``from . import x`` of a submodule is that submodule,
    ``from P import y`` of a lazy package the module it takes ``y`` from (:func:`_lazy`), any
    other ``from M import y`` is ``M`` (the module holding ``y``)."""
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
            targets = []
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    targets.append(f"{base}.{a.name}")
                elif base in lazy:
                    targets.append(lazy[base].get(a.name, lazy[base].get("*", base)))
                else:
                    targets.append(base)
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
    lazy = _lazy(modules)
    graph = {name: _imports(name, path, modules, lazy) for name, path in modules.items()}
    circles = _circles(graph)
    # Each circle with the arrows inside it, to say which import to move.
    said = [{m: sorted(graph[m] & set(c)) for m in c} for c in circles]
    assert said == [], said


# The one call back up between the packages: async TP's constrain (layouts.megatron) reaches
# ops.collective_matmul when it reshards, at call time (the CLI reads the layouts before torch).
UPWARD = {("dtp.layouts", "dtp.ops")}


def test_the_packages_form_layers() -> None:
    """Between the top-level packages the imports point one way (a circle of packages is
    one of modules waiting to happen), but for :data:`UPWARD`."""
    modules = _modules()
    lazy = _lazy(modules)

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = {top(m): set() for m in modules}
    for name, path in modules.items():
        for target in _imports(name, path, modules, lazy):
            if top(target) != top(name) and target != "dtp" and (top(name), top(target)) not in UPWARD:
                graph[top(name)].add(top(target))
    graph.pop("dtp", None)
    for targets in graph.values():
        targets.discard("dtp")
    circles = _circles(graph)
    assert [{p: sorted(graph[p] & set(c)) for p in c} for c in circles] == []


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
    above the group of imports it is in (not a bare ``# noqa``). Of dtp's own modules only
    the cold start's reason remains (the circles are gone)."""
    unsaid = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text().splitlines()
        for first, text in _function_imports(path):
            if not any(s in text for s in ("from .", "import dtp", "from dtp")):
                continue  # a third-party or standard package: its own reasons (optional, heavy)
            def reason(line: str) -> bool:
                comment = line.partition("#")[2].strip()
                return bool(comment) and not comment.startswith("noqa")

            i = first - 1
            said = reason(lines[i])
            while not said and i > 0:
                above = lines[i - 1].strip()
                if above.startswith("#"):
                    said = reason(above)
                elif above.startswith(("from ", "import ")):
                    i -= 1  # the group of imports this one is in: its first line's reason
                    said = reason(lines[i])
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
                       "models", "ops", "planning", "schedules", "testing", "training"]


def _old_names() -> list[str]:
    import dtp

    return [*dtp.MOVED, "dtp.comm.link", "dtp.strategies.zero", "dtp.optim.transform"]


@pytest.mark.parametrize("old", _old_names())
def test_an_old_module_name_imports_the_module_itself(old: str) -> None:
    import dtp

    module = importlib.import_module(old)
    assert module is sys.modules[dtp.moved_to(old)]
    assert module.__spec__.name == module.__name__ == dtp.moved_to(old)  # its own spec: reload sees one module
    assert importlib.util.find_spec(old + ".nothing_here") is None if hasattr(module, "__path__") else True


def test_python_m_runs_a_module_under_its_old_name(tmp_path: Path) -> None:
    import subprocess

    # runpy (what -m runs) finds the module's code through the old name's alias.
    code = "import runpy, sys; sys.argv = ['x']; runpy.run_module('dtp.launch', run_name='not_main')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    done = subprocess.run([sys.executable, "-m", "dtp.cli", "plan", "--dp", "2"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("tiny (106.8k params)")
