"""The package's import graph (read with ``ast``, function-local imports included): no cycle, and
the engine imports nothing above it (no public module, nothing of ``fsdptk._files``). The
``benchmarks`` package is held to the same no-cycle rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "fsdptk"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(package: str = "fsdptk") -> dict[str, Path]:
    return {_module_name(p): p for p in (REPO / package).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str], package: str = "fsdptk") -> set[str]:
    """Modules of ``package`` that ``name`` imports anywhere in its body (module level or inside functions).

    ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``; parent
    packages imported implicitly are not edges (a package's ``__init__`` importing its parts is
    not a cycle)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith(package):
                continue
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out.update(subs)
            if len(subs) < len(node.names) and mod in known:
                out.add(mod)
    out.discard(name)
    return out


def _graph(package: str = "fsdptk") -> dict[str, set[str]]:
    mods = _modules(package)
    known = set(mods)
    return {m: _imports(m, p, known, package) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _is_public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split(".")[1:])


def test_graph_sees_function_local_imports():
    """The parser is not blind to imports inside functions (the way cycles used to hide)."""
    graph = _graph()
    assert "fsdptk._engine.agree" in graph["fsdptk._engine.scatter"]
    assert graph["fsdptk"] == set()  # lazy (PEP 562): importlib, not import statements


@pytest.mark.parametrize("package", ["fsdptk", "benchmarks"])
def test_no_import_cycle(package):
    cycles = _cycles(_graph(package))
    assert cycles == [], f"import cycles between {package} modules: {cycles}"


def test_graph_sees_the_benchmarks_package():
    """The benchmarks graph is read (relative imports resolved), so its no-cycle check can fail."""
    graph = _graph("benchmarks")
    assert "benchmarks.hf_report" in graph["benchmarks.report"]


def test_engine_imports_nothing_above_it():
    bad = sorted(
        (m, dep)
        for m, deps in _graph().items()
        if m.startswith("fsdptk._engine")
        for dep in deps
        if _is_public(dep) or dep.startswith("fsdptk._files") or dep.startswith("fsdptk._plans")
    )
    assert bad == [], f"the engine imports a public module, _files or _plans: {bad}"


@pytest.mark.parametrize("pkg", ["fsdptk._core"])
def test_core_imports_only_core(pkg):
    """``_core`` is the bottom layer: it imports no other fsdptk module."""
    bad = sorted((m, d) for m, deps in _graph().items() if m.startswith(pkg)
                 for d in deps if not d.startswith(pkg))
    assert bad == [], f"{pkg} imports modules above it: {bad}"
