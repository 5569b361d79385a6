"""cachestore/ has no import circles: every import counts, also the ones inside functions and under
TYPE_CHECKING (a lazy import hides a circle from the interpreter, not from the reader)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path("pdserve") / "cachestore"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the cachestore modules it imports (a package's __init__ is not counted as a target:
    importing `cachestore.wire` runs it, but no arrow of the design goes through it)."""
    files = {module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                if t in files and t != mod and not files[t].name == "__init__.py":
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cachestore_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 20 and "pdserve.cachestore.client" in graph  # the checker reads the package
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


TRANSPORT_PREFIXES = (
    "pdserve.cachestore.local",
    "pdserve.cachestore.tcp",
    "pdserve.cachestore.rdma",
    "pdserve.cachestore.verbs_emu",
)


def test_transports_import_the_leaf_never_the_client_or_the_server():
    """The client and the server pick a transport; a transport reaches them only through the
    `channel` leaf's protocols (`Sender`, `Receiver`)."""
    for mod, deps in import_graph().items():
        if mod.startswith(TRANSPORT_PREFIXES):
            assert not deps & {"pdserve.cachestore.client", "pdserve.cachestore.server"}, f"{mod} imports {deps}"


def test_cachestore_imports_no_other_pdserve_package():
    for mod, path in ((module_name(p), p) for p in (ROOT / PACKAGE).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:  # only itself (and the namespace's version) from the repository
                inside = name.startswith("pdserve.cachestore") or name == "pdserve"
                assert inside or not name.startswith("pdserve"), f"{mod} imports {name}"


if __name__ == "__main__":  # list every circle's edges while untangling
    g = import_graph()
    while (c := find_cycle(g)) is not None:
        print(" -> ".join(c))
        g[c[-2]].discard(c[-1])
