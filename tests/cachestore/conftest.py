"""A server/client pair over each transport that runs here, on the test module's GEO."""

from __future__ import annotations

import pytest

from pdserve.cachestore import CacheStoreClient, CacheStoreServer, MemoryRegion
from tests.cachestore.helpers import SECRET, pools


@pytest.fixture(params=["tcp", "local"])
async def pair(request):
    """(server, client, source pool, destination pool); the registry must be empty afterwards."""
    geo = request.module.GEO
    src, dst = pools(geo)
    server = CacheStoreServer(MemoryRegion.from_buffer(dst), geo, transport=request.param, secret=SECRET)
    await server.start()
    client = CacheStoreClient(MemoryRegion.from_buffer(src), geo, transport=request.param, secret=SECRET)
    try:
        yield server, client, src, dst
    finally:
        await client.close()
        await server.stop()
    assert server.num_sessions == 0
