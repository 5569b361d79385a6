"""A rank of a tensor-parallel decode node SIGKILLed mid-stream: the node dies whole (its rank 0 exits,
no rank is left), the router migrates its streams to the other decode node, and the text is exact."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.cluster import start_cluster, stop
from tests.e2e.router_cluster import start_router
from tests.e2e.test_failover import busiest_decode, migrations, stream_text

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
TOKENS = 200


def _children(pid: int) -> list[int]:
    """Child pids of `pid`, whichever of its threads started them (Linux lists a child under the
    thread that forked it: the main thread's list alone misses ranks a worker thread spawned)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    return kids


async def test_killed_rank_ends_its_node_and_streams_migrate_exactly(tiny_model_dir):
    cluster = start_cluster(1, 2, model=str(tiny_model_dir), decode_extra=["--tensor-parallel-size", "2"])
    router = None
    try:
        router, base = start_router(cluster, str(tiny_model_dir))
        prompts = [f"Story number {i}: the river" for i in range(8)]
        async with httpx.AsyncClient() as client:
            reference = await asyncio.gather(*[stream_text(client, base, p, TOKENS) for p in prompts])
            progress: list = []
            tasks = [asyncio.create_task(stream_text(client, base, p, TOKENS, progress)) for p in prompts]
            victim = cluster.decodes[(await busiest_decode(cluster, progress))[0]]
            rank0 = victim.popen.pid
            (rank1,) = _children(rank0)
            os.kill(rank1, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
        assert results == reference
        deadline = time.monotonic() + 30
        while victim.popen.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert victim.popen.poll() not in (None, 0), "rank 0 outlived its killed rank"
        assert migrations(base) >= 1, "no stream was migrated: the kill came too late"
    except BaseException:
        for proc in [router, *cluster.decodes]:
            if proc is not None:
                print(f"--- {proc.name}\n{proc.tail(60)}")
        raise
    finally:
        if router is not None:
            stop(router)
        cluster.stop()
