"""Deadlines for e2e tests that hold on a loaded 2-core CI machine.

A test states how long a step takes on an idle machine; `scaled` stretches that by the machine's
load (run queue per core) and by $PDSERVE_TEST_TIME_SCALE, so a busy machine gets more time and
no test asserts speed. `until` polls a condition up to such a deadline.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

MIN_FACTOR = 5.0
"""Even an idle machine gets 5x the nominal time: other processes can start at any moment."""


def scaled(seconds: float) -> float:
    load_per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * max(MIN_FACTOR, 2.0 * load_per_core) * float(os.environ.get("PDSERVE_TEST_TIME_SCALE", "1"))


async def until(condition: Callable[[], Awaitable[bool]], nominal: float, interval: float = 0.1) -> bool:
    """Poll the async `condition` until it holds or `scaled(nominal)` seconds have passed."""
    deadline = asyncio.get_running_loop().time() + scaled(nominal)
    while not await condition():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True
