"""benchmarks/agentic.py's workload: private contexts, revisited round robin, each visit the whole history."""

from __future__ import annotations

from benchmarks.agentic import workload


def test_sessions_share_nothing_and_each_visit_extends_its_history():
    requests = workload(sessions=3, context=40, visits=2, step=5)
    assert [s for s, _ in requests] == [0, 1, 2, 0, 1, 2]  # round robin
    first, second = requests[0][1], requests[3][1]
    assert len(first) == 45 and second[:45] == first and len(second) == 50  # the history grows by each step
    heads = {tuple(p[:8]) for _, p in requests[:3]}
    assert len(heads) == 3  # no prefix shared between sessions (random tokens: a collision is impossible here)
    assert requests == workload(sessions=3, context=40, visits=2, step=5)  # seeded: the same run every time
