"""The repository's import graph, read with `ast` (nothing is imported): module -> modules it imports.

Every `import` and `from ... import` counts, wherever it stands (module level, inside a function,
under `if TYPE_CHECKING:`): a lazy import is still a dependency. An import names the most specific
repository module it reaches (`from pdserve.engine import llm` -> pdserve.engine.llm;
`from pdserve.engine.llm import LLM` -> pdserve.engine.llm); third-party and standard-library
imports are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"build", "dist", "__pycache__"}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the repository."""
    mods = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts) or any(p.startswith(".") or p.endswith(".egg-info") for p in rel.parts):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts:
            mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is a repository module."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names += [f"{target}.{alias.name}" for alias in node.names]  # a submodule, or a name in target
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the repository modules it imports (never itself)."""
    mods = module_files(root)
    graph: dict[str, set[str]] = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = {_resolve(n, mods) for n in _imported_names(tree, module, path.name == "__init__.py")}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        # iterative DFS: the graph is deep enough to matter for Python's recursion limit
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)
