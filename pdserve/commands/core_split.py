"""`pdserve up --num-threads auto|N`: how the machine's cores are split between the node processes.

The rule of `auto` (`split_cores`), over the CPUs this process may run on (`os.sched_getaffinity`):

- Every node gets at least one core per tensor-parallel rank, and the node threads never add up to
  more than the cores: oversubscribed OpenMP pools spin in barriers while their peers hold the cores
  (the issue-27 profile measured >= 6.5% in libgomp barriers with one thread per process already).
- The cores left over go one at a time to the node with the fewest cores per unit of weight; a
  prefill node weighs 2, a decode node 1. Prefill runs GEMMs over whole prompts, which are compute
  bound and scale with threads, and its queue is what sets TTFT; a decode step is a small batch that
  is bound by memory bandwidth, where extra threads mostly wait at barriers.
- Each node is pinned to its own contiguous CPU set, so that no two pools share a core. When there
  are fewer cores than ranks, no split exists: every rank gets one thread and no pinning (the
  kernel balances them), which is what `up` did before.

`--num-threads N` overrides it: N threads per rank and no pinning.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

WEIGHTS = {"prefill": 2, "decode": 1}
"""Cores per unit of weight are evened out between nodes: a prefill node gets twice a decode node's."""


@dataclass(frozen=True)
class Share:
    """One node's part of the machine: torch threads per rank and the CPUs it is pinned to (None: not pinned)."""

    threads: int
    cpus: frozenset[int] | None


def num_threads_arg(text: str) -> int | None:
    """argparse type of `--num-threads`: `auto` (None) or a whole number >= 1."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a whole number >= 1, got {text!r}")
    return value


def add_num_threads_arg(p: argparse.ArgumentParser) -> None:
    """`up`'s `--num-threads auto|N` (default auto), with the rule in its help."""
    p.add_argument(
        "--num-threads",
        type=num_threads_arg,
        default="auto",  # a string default goes through `type` too: unset reads as None, like `auto`
        metavar="auto|N",
        help="torch threads per node process (per rank with TP). auto (default): split the usable cores "
        "between the nodes, a prefill node weighing twice a decode node (prefill GEMMs scale with threads, "
        "decode steps are memory bound), at least one core per rank, never more threads than cores, each "
        "node pinned to its own CPUs; with fewer cores than ranks, one thread each and no pinning. "
        "N: N threads per rank, no pinning",
    )


def split_cores(cpus: list[int], nodes: list[tuple[str, int]]) -> list[Share]:
    """The share of each node, in order, given as (role, tensor-parallel ranks); see the module doc."""
    if not nodes:
        return []
    ranks = [max(1, r) for _, r in nodes]
    if len(cpus) < sum(ranks):
        return [Share(1, None) for _ in nodes]
    cores = list(ranks)
    for _ in range(len(cpus) - sum(ranks)):
        # fewest cores per unit of weight (per rank) first; ties go to prefill, then to the earlier node
        k = min(
            range(len(nodes)),
            key=lambda i: (cores[i] / (WEIGHTS[nodes[i][0]] * ranks[i]), -WEIGHTS[nodes[i][0]], i),
        )
        cores[k] += 1
    ordered = sorted(cpus)
    shares, start = [], 0
    for n, r in zip(cores, ranks):
        shares.append(Share(n // r, frozenset(ordered[start : start + n])))
        start += n
    return shares


def node_shares(num_threads: int | None, nodes: list[tuple[str, int]]) -> list[Share]:
    """`--num-threads`'s value (None: auto) for these nodes on this machine's usable CPUs."""
    if num_threads is not None:
        return [Share(num_threads, None) for _ in nodes]
    return split_cores(sorted(os.sched_getaffinity(0)), nodes)


def sharing_note(shares: list[Share], cores: int) -> str | None:
    """What `up` says when `auto` found fewer cores than node processes (no share pinned): they
    time-share the cores. Measured on 2 cores (BENCHMARKS.md, the default shape at depth), 3 nodes
    sharing them served 0.84x vLLM's goodput where 2 nodes served 1.19x."""
    if not shares or any(s.cpus is not None for s in shares):
        return None
    return (
        f"{len(shares)} nodes share {cores} cores (one thread each, unpinned); fewer nodes may serve more: "
        f"`pdserve plan --cores {cores}` picks a shape for a workload"
    )


def describe(roles: list[str], shares: list[Share]) -> str:
    """`prefill 2 (CPUs 0-1), decode 1 (CPU 2), ...` for `up`'s start-up lines."""

    def where(cpus: frozenset[int] | None) -> str:
        if not cpus:
            return " (unpinned)"
        lo, hi = min(cpus), max(cpus)
        return (
            f" (CPU {lo})"
            if lo == hi
            else f" (CPUs {lo}-{hi})"
            if len(cpus) == hi - lo + 1
            else f" (CPUs {sorted(cpus)})"
        )

    return ", ".join(f"{role} {share.threads}{where(share.cpus)}" for role, share in zip(roles, shares))
