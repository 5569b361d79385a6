"""Failover with real processes: a decode node SIGKILLed mid-stream (request migration) and a stopped
prefill node (requests go to the other one)."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from tests.e2e.cluster import stop
from tests.e2e.grpc_client import load
from tests.e2e.router_cluster import API_KEY, start_full

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {API_KEY}"}


LONG = 400
"""Tokens per stream: long enough that no decode node can finish its streams between the moment
the test sees them under way and the fault. Not much longer: a migrated stream's KV is recomputed
by a prefill, whose float32 sums differ from the decode steps' in the last bits, and over 800
tokens of the random tiny model one near-tied greedy pick flipped once (a fresh-clone run)."""


async def stream_text(
    client: httpx.AsyncClient,
    base: str,
    prompt: str,
    max_tokens: int,
    progress: list | None = None,
    ids: set[str] | None = None,
) -> tuple[str, str | None]:
    """The stream's (text, finish reason); its response id added to `ids` if given."""
    text, finish = "", None
    body = {
        "model": "pdserve-tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    async with client.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if ids is not None:
                ids.add(chunk["id"])
            for c in chunk["choices"]:
                text += c["text"]
                if progress is not None:
                    progress.append(1)
                finish = c["finish_reason"] or finish
    return text, finish


async def test_decode_killed_mid_stream_migrates_without_gap_or_duplicate(tiny_model_dir):
    cluster, router, base = start_full(str(tiny_model_dir), num_prefill=2, num_decode=2)
    try:
        prompts = [f"Story number {i}: the river" for i in range(20)]
        async with httpx.AsyncClient() as client:
            reference = await asyncio.gather(*[stream_text(client, base, p, LONG) for p in prompts])
            tasks, victim = await streams_under_way(client, base, cluster, prompts, reference)
            survivor = cluster.decodes[1 - victim]
            stop(cluster.decodes[victim], signal.SIGKILL)
            results = await asyncio.gather(*tasks)
        assert results == reference
        assert all(finish == "length" for _, finish in results)
        assert migrations(base) >= 1, "no stream was migrated: kill came too late"
        # then stop one prefill node: requests go to the other one
        stop(cluster.prefills[0], signal.SIGTERM)
        async with httpx.AsyncClient() as client:
            again = await asyncio.gather(*[stream_text(client, base, p, LONG) for p in prompts[:4]])
        assert again == reference[:4]
        await asyncio.sleep(0.5)
        for proc in (survivor, cluster.prefills[1]):
            report = await load(proc.address, cluster.secret, proc.role)
            assert report.num_free_blocks == report.num_total_blocks
    finally:
        stop(router)
        cluster.stop()


async def streams_under_way(client, base: str, cluster, prompts: list[str], reference: list) -> tuple[list, int]:
    """Start one stream per prompt; (the tasks, the index of the decode node to disturb) once a node
    holds some of them. A round whose streams all ended first (nothing left to migrate) is checked
    against `reference` and run again, at most three times."""
    for _ in range(3):
        progress: list = []
        tasks = [asyncio.create_task(stream_text(client, base, p, LONG, progress)) for p in prompts]
        index, running = await busiest_decode(cluster, progress)
        if running:
            break
        assert await asyncio.gather(*tasks) == reference  # too late to disturb: nothing runs
    return tasks, index


async def busiest_decode(cluster, progress: list) -> tuple[int, int]:
    """(index, requests it is generating) of the decode node to disturb, as soon as the streams are
    under way (the first chunk of one at the client). Waiting longer is a race the test can lose: a
    fast decode node finishes its streams into the router's buffers while the client is still
    reading them, and a node with no running stream migrates nothing (0: the caller tries again).
    Waiting for two chunks of every stream lost it once on a loaded 2-core machine (two test suites
    at once): when the node was killed it had no stream left to migrate.
    The node generating the most is chosen, because on a loaded machine the router may have sent
    every stream to one node; its count is read last thing before the caller acts (KV blocks held
    were read before: a node could hold them for streams that ended before the fault)."""
    for _ in range(3000):  # bounded: 30 s of polling, far more than the first tokens need
        if progress:
            break
        await asyncio.sleep(0.01)
    reports = [await load(d.address, cluster.secret, d.role) for d in cluster.decodes]
    running = [r.num_running for r in reports]
    return running.index(max(running)), max(running)


def migrations(base: str) -> float:
    """The router's count of streams it moved to another decode node."""
    metrics = httpx.get(f"{base}/metrics").text
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("pdserve_router_migrations_total"))


def node_usable(base: str, address: str) -> bool:
    nodes = httpx.get(f"{base}/v1/cluster", headers=AUTH).json()["nodes"]
    return bool(next(n for n in nodes if n["address"] == address)["usable"])


async def until_usable(base: str, address: str) -> None:
    """Until the router takes requests to the node at `address` again (bounded: 30 s)."""
    for _ in range(300):
        if node_usable(base, address):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the router did not take {address} back")


def admits(proc, ids: set[str]) -> int:
    """Requests the node admitted for the responses `ids` (a node runs choice i of response X as
    `X-i`, a migrated one with a further suffix)."""
    found = 0
    for line in list(proc.lines):
        if "event=admit" in line and "request_id=" in line:
            rid = line.split("request_id=", 1)[1].split(None, 1)[0]
            found += any(rid.startswith(f"{x}-") for x in ids)
    return found


async def test_paused_decode_node_streams_migrate_and_it_gets_no_new_requests(tiny_model_dir):
    """SIGSTOP a decode node mid-stream: its streams move on with exact text (token deadline), new requests
    avoid it (health deadline), and once it resumes it frees every block of the abandoned streams."""
    cluster, router, base = start_full(str(tiny_model_dir), num_prefill=1, num_decode=2)
    paused = cluster.decodes[0]
    try:
        prompts = [f"Paused story {i}: the mountain" for i in range(8)]
        async with httpx.AsyncClient() as client:
            reference = await asyncio.gather(*[stream_text(client, base, p, LONG) for p in prompts])
            try:
                for _ in range(3):
                    before_round = migrations(base)
                    tasks, index = await streams_under_way(client, base, cluster, prompts, reference)
                    paused = cluster.decodes[index]
                    paused.popen.send_signal(signal.SIGSTOP)
                    assert await asyncio.gather(*tasks) == reference
                    if migrations(base) > before_round:
                        break
                    # every stream on it had ended before the pause (nothing to migrate): resume it, run again
                    paused.popen.send_signal(signal.SIGCONT)
                    await until_usable(base, paused.address)
                else:
                    raise AssertionError("no stream was on the paused node, in three rounds")
                for _ in range(300):  # the router marks it unusable (health deadline)
                    if not node_usable(base, paused.address):
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("the router still considers the paused node usable")
                # only the new requests count: one the router sent before the pause may be admitted on resume
                new_ids: set[str] = set()
                again = await asyncio.gather(*[stream_text(client, base, p, LONG, ids=new_ids) for p in prompts[:6]])
                assert again == reference[:6] and len(new_ids) == 6
            finally:
                paused.popen.send_signal(signal.SIGCONT)
        await asyncio.sleep(1.0)  # let it read what queued up while it was stopped
        assert admits(paused, new_ids) == 0, "the paused node was sent new requests"
        assert sum(admits(d, new_ids) for d in cluster.decodes) >= 6, "the new requests' admissions not found"
        for _ in range(100):
            report = await load(paused.address, cluster.secret)
            if report.num_free_blocks == report.num_total_blocks:
                break
            await asyncio.sleep(0.2)
        assert report.num_free_blocks == report.num_total_blocks, "abandoned streams leaked blocks"
    finally:
        stop(router)
        cluster.stop()
