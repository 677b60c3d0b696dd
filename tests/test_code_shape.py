"""Code shape: no function outside tests takes more than 8 parameters, and the import graph of the package
(tandem/, tasks/, flows/, cli/) has no cycle, through lazy imports inside function bodies too."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("tandem", "tasks", "flows", "cli", "benchmarks", "scripts")
MAX_PARAMS = 8


def _sources(packages=PACKAGES) -> list[Path]:
    return [p for pkg in packages if (REPO / pkg).is_dir() for p in sorted((REPO / pkg).rglob("*.py"))]


def n_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters of a function as a caller sees them (`self` / `cls` of a method not counted)."""
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    first = (a.posonlyargs + a.args)[:1]
    return n - 1 if first and first[0].arg in ("self", "cls") else n


def over_limit(sources: list[Path]) -> list[tuple[str, str, int]]:
    out = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and n_params(node) > MAX_PARAMS:
                out.append((path.relative_to(REPO).as_posix(), node.name, n_params(node)))
    return out


def test_no_function_takes_more_than_eight_parameters():
    new = [f"{p}: {name} takes {n}" for p, name, n in over_limit(_sources())]
    assert not new, "group what travels together (a frozen dataclass, the stage config):\n" + "\n".join(new)


def test_the_parameter_count_sees_an_offender(tmp_path):
    code = "def f(a, b, c, d, e, f, g, h, i): pass\nclass C:\n    def m(self, a, b, c, d, e, f, g, h): pass\n"
    tree = ast.parse(code)
    counts = {n.name: n_params(n) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert counts == {"f": 9, "m": 8}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: list[Path], top_level_only: bool) -> dict[str, set[str]]:
    """module -> the package modules it imports (`from a import b` counts as a.b when that is a module)."""
    modules = {_module_name(p): p for p in sources}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        targets: set[str] = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                targets |= {resolve(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                    base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                targets |= {resolve(f"{base}.{a.name}") for a in node.names}
        graph[mod] = {t for t in targets if t and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_at_module_level():
    assert cycles(import_graph(_sources(("tandem", "tasks", "flows", "cli")), top_level_only=True)) == []


def test_no_import_cycle_through_lazy_imports_either():
    found = cycles(import_graph(_sources(("tandem", "tasks", "flows", "cli")), top_level_only=False))
    assert [sorted(c) for c in found] == []


def test_the_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset({"a", "b", "c"})]
