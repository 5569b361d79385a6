"""The floors of the house, read from the imports (see docs/architecture.md, "Floors").

A room may import itself and rooms on lower floors; rooms on one floor do not import each other,
so each service stands on the shared layers alone. Files outside every room (tests, benchmarks,
scripts) may import anything.
"""

from __future__ import annotations

import pytest
from import_graph import ROOT, cycles, import_graph

# A room is one or more module prefixes; it is named by its first. The app is one room of three.
FLOORS: list[tuple[str, list[tuple[str, ...]]]] = [
    ("app", [("pdserve.cli", "pdserve.commands", "pdserve.__main__")]),  # the `pdserve` command
    ("tools", [("pdserve.planner",)]),  # `pdserve plan`'s library: it prices forwards with tdpipe's tables
    ("services", [("pdserve.router",), ("pdserve.prefill_node",), ("pdserve.decode_node",), ("pdserve.tdpipe",)]),
    ("shared layers", [("pdserve.openai_api",), ("pdserve.node_runtime",)]),
    # the generated wire code (proto/pdserve/v1) stands on the ground like the engine: it imports nothing
    ("ground", [("pdserve.engine",), ("pdserve.cachestore",), ("pdserve.v1",)]),
]
# The namespace package itself holds only the product version: every floor may read it.
NAMESPACE = "pdserve"
ROOM_OF_PREFIX = {prefix: room[0] for _, rooms in FLOORS for room in rooms for prefix in room}
ROOMS = {room[0]: level for level, (_, rooms) in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str | None:
    """The room a module belongs to (pdserve.v1.x is ground, pdserve.commands.up is the app's)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ROOM_OF_PREFIX:
            return ROOM_OF_PREFIX[".".join(parts[:n])]
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_package_is_in_a_room(graph) -> None:
    """One top-level package, and each of its modules on a floor (a new one is given one here and in
    docs/architecture.md)."""
    outside = {"tests", "benchmarks", "scripts"}
    packages = {m.split(".")[0] for m in graph if (ROOT / m.split(".")[0] / "__init__.py").exists()}
    assert packages - outside == {NAMESPACE}
    homeless = sorted(m for m in graph if m.startswith(NAMESPACE + ".") and room_of(m) is None)
    assert not homeless, "modules on no floor:\n" + "\n".join(homeless)


def test_the_namespace_imports_nothing(graph) -> None:
    """`pdserve` itself is read by every floor, so it may import none of them."""
    assert graph[NAMESPACE] == set()


def test_no_import_runs_up_or_across_a_floor(graph) -> None:
    bad = []
    for module, targets in graph.items():
        src = room_of(module)
        if src is None:
            continue
        for target in targets:
            dst = room_of(target)
            if dst is None or dst == src:  # the namespace's version, or within a room
                continue
            if ROOMS[dst] <= ROOMS[src]:
                bad.append(f"{module} ({FLOORS[ROOMS[src]][0]}) -> {target} ({FLOORS[ROOMS[dst]][0]})")
    assert not bad, "imports against the floor order:\n" + "\n".join(sorted(bad))


@pytest.mark.parametrize("room", [room[0] for room in FLOORS[-1][1]])
def test_the_ground_stands_alone(graph, room) -> None:
    """The engine, the CacheStore and the generated protos import nothing else from the repository
    (the namespace's version aside)."""
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if room_of(m) == room
        for t in targets
        if room_of(t) != room and t != NAMESPACE
    )
    assert not bad, f"{room} imports other rooms:\n" + "\n".join(bad)


def test_the_batch_job_does_not_import_the_router(graph) -> None:
    bad = sorted(
        f"{m} -> {t}"
        for m, ts in graph.items()
        if m.startswith("pdserve.tdpipe")
        for t in ts
        if room_of(t) == "pdserve.router"
    )
    assert not bad, "\n".join(bad)


def test_no_import_circles(graph) -> None:
    """Anywhere in the repository, every import included (also lazy ones inside functions)."""
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checker_sees_circles_and_upward_imports() -> None:
    """The two checks above would fail on a graph that breaks them."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert room_of("pdserve.v1.common_pb2") == "pdserve.v1" and room_of("pdserve.commands.up") == "pdserve.cli"
    assert ROOMS[room_of("pdserve.engine.llm")] > ROOMS[room_of("pdserve.router.app")]
