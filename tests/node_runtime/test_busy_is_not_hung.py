"""A node answers its load probe while its engine thread is busy, and reports whether the engine
advances (issue 54).

What starved the probes: the router's probe is a gRPC health check plus GetLoad, and GetLoad asked
the engine thread for its load, queued behind whatever step it was running. A long prompt's
prefill step on a loaded machine outlasted the 1 s probe deadline step after step, and after
`hung_after` (10 s) of missed probes the router called a busy node hung. GetLoad now answers from
the load the engine thread publishes at every step, with the engine's layer count and how long it
has been stuck in one step without computing a layer.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.engine import SamplingParams
from tests.e2e.inproc import in_process_nodes

pytestmark = pytest.mark.e2e


async def test_the_load_probe_answers_while_the_engine_thread_is_busy(tiny_model_dir):
    async with in_process_nodes(tiny_model_dir) as nodes:
        rt = nodes.decode.rt
        before = await asyncio.wait_for(rt.load_report(), 1.0)
        release = threading.Event()
        busy = asyncio.ensure_future(rt.loop_thread.call(release.wait, 5.0))  # the engine thread is held
        await asyncio.sleep(1.2)
        start = time.monotonic()
        report = await asyncio.wait_for(rt.load_report(), 1.0)  # before: queued behind the held thread
        assert time.monotonic() - start < 0.5
        assert report.num_total_blocks == before.num_total_blocks
        # held in one command without computing a layer: the stall shows, and grows
        assert report.engine_stalled_seconds >= 1.0
        release.set()
        await busy
        idle = await asyncio.wait_for(rt.load_report(), 1.0)
        assert idle.engine_stalled_seconds == 0.0


async def test_a_working_engine_reports_progress_and_no_stall(tiny_model_dir):
    async with in_process_nodes(tiny_model_dir, local_max=10_000) as nodes:
        rt = nodes.decode.rt
        first = await rt.load_report()
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        done = asyncio.ensure_future(rt.loop_thread.call(rt.engine.add_request, "r1", list(range(5, 300)), params))
        await done
        reports = []
        for _ in range(10):
            await asyncio.sleep(0.05)
            reports.append(await rt.load_report())
        while rt.engine.has_unfinished_requests():
            await asyncio.sleep(0.05)
        last = await rt.load_report()
        assert last.progress > first.progress  # decoder layers computed
        assert all(r.engine_stalled_seconds < 1.0 for r in reports)
