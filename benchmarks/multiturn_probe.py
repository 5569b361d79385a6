"""Per-turn accounting for benchmarks/multiturn.py: where each round's KV bytes came from.

Before and after each lockstep round it reads the counters that explain the wire bytes: KV bytes
the decode nodes received (CacheStore), the router's routing decisions by role and reason (a turn
placed by `balance` or `explore` may land away from its history) and the decode nodes' prefill
location (local: nothing crosses the wire). The round's line sets the bytes against the
block-aligned tokens the cluster had not seen (the bound's complement, rounded up to whole blocks,
as a transfer ships whole blocks).
"""

from __future__ import annotations

from collections import Counter

import httpx

WATCHED = (
    "pdserve_cachestore_bytes_total",
    "pdserve_router_routing_decisions",
    "pdserve_prefill_decisions",
    "pdserve_kv_pull_total",
)


def scrape(urls: list[str]) -> Counter[str]:
    """The watched counters of every /metrics at `urls`, summed per series (labels kept, node
    labels dropped for the router's, so that decisions add up over the cluster)."""
    out: Counter[str] = Counter()
    for url in urls:
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line.startswith(WATCHED) and "_created" not in line:  # a creation time, not a count
                series, value = line.rsplit(" ", 1)
                out[_short(series)] += float(value)
    return out


def _short(series: str) -> str:
    """`name{labels}` -> `name:label values that matter` (side, role/reason, location)."""
    name, _, labels = series.partition("{")
    keep = [kv.split("=", 1)[1].strip('"') for kv in labels.rstrip("}").split(",") if kv.split("=")[0] in LABELS]
    return ":".join([name.removeprefix("pdserve_"), *keep])


LABELS = {"side", "role", "reason", "location", "outcome"}


def round_line(turn: int, before: Counter[str], after: Counter[str], new_blocks: int, block_bytes: float) -> dict:
    """One round's accounting: bytes the decode nodes received (P->D) and sent (D->P pulls), as
    blocks, against the blocks of unseen tokens."""
    delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    received = delta.pop("cachestore_bytes_total:recv", 0.0)
    pulled = delta.pop("cachestore_bytes_total:send", 0.0)  # a decode node sends only D->P pulls
    return {
        "turn": turn + 1,
        "kv_bytes": received,
        "pulled_bytes": pulled,
        "blocks_received": round(received / block_bytes, 1) if block_bytes else None,
        "blocks_pulled": round(pulled / block_bytes, 1) if block_bytes else None,
        "new_blocks": new_blocks,
        **{k: int(v) for k, v in sorted(delta.items())},
    }
