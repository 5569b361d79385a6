"""The floors of the house, read from the imports (see docs/architecture.md, "Floors").

A room may import itself and rooms on lower floors; rooms on one floor do not import each other,
so each service stands on the shared layers alone. Files outside every room (tests, benchmarks,
scripts) may import anything.
"""

from __future__ import annotations

import pytest
from import_graph import ROOT, cycles, import_graph

FLOORS: list[tuple[str, set[str]]] = [
    ("app", {"pdserve"}),  # the CLI: pdserve.cli, pdserve.commands
    ("services", {"router", "prefill_node", "decode_node", "tdpipe"}),
    ("shared layers", {"openai_api", "node_runtime"}),
    ("protos", {"pdserve.v1"}),  # generated from proto/pdserve/v1 (the wire package names the path)
    ("ground", {"engine", "cachestore"}),
]
ROOMS = {room: level for level, (_, rooms) in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str | None:
    """The most specific room a module belongs to (pdserve.v1.x is protos, pdserve.cli is app)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ROOMS:
            return ".".join(parts[:n])
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_every_package_is_in_a_room(graph) -> None:
    """A new top-level package must be given a floor here (and in docs/architecture.md)."""
    outside = {"tests", "benchmarks", "scripts"}
    packages = {m.split(".")[0] for m in graph if (ROOT / m.split(".")[0] / "__init__.py").exists()}
    assert packages - outside <= {room.split(".")[0] for room in ROOMS}


def test_no_import_runs_up_or_across_a_floor(graph) -> None:
    bad = []
    for module, targets in graph.items():
        src = room_of(module)
        if src is None:
            continue
        for target in targets:
            dst = room_of(target)
            if dst is None or dst == src:
                continue
            if ROOMS[dst] <= ROOMS[src]:
                bad.append(f"{module} ({FLOORS[ROOMS[src]][0]}) -> {target} ({FLOORS[ROOMS[dst]][0]})")
    assert not bad, "imports against the floor order:\n" + "\n".join(sorted(bad))


@pytest.mark.parametrize("room", ["engine", "cachestore", "pdserve.v1"])
def test_ground_and_protos_stand_alone(graph, room) -> None:
    """engine/, cachestore/ and the generated protos import nothing else from the repository."""
    bad = sorted(
        f"{m} -> {t}" for m, targets in graph.items() if room_of(m) == room for t in targets if room_of(t) != room
    )
    assert not bad, f"{room} imports other rooms:\n" + "\n".join(bad)


def test_the_batch_job_does_not_import_the_router(graph) -> None:
    bad = sorted(
        f"{m} -> {t}" for m, ts in graph.items() if m.startswith("tdpipe") for t in ts if room_of(t) == "router"
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
    assert room_of("pdserve.v1.common_pb2") == "pdserve.v1" and room_of("pdserve.commands.up") == "pdserve"
    assert ROOMS[room_of("engine.llm")] > ROOMS[room_of("router.app")]
