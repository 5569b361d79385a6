"""A CacheStore tcp receiver in its own process under an address-space cap (RLIMIT_AS), for the
input-bounds fuzz tests: a header that made it allocate what the peer asks for fails there with a
MemoryError (a dropped connection, no refusal), not by taking the test machine down.

    python -m tests.cachestore.capped_receiver CAP_BYTES [TRANSPORT]   (tcp, or rdma on the emulated device)

It opens two sessions, prints one JSON line (port, the attacker's credentials, the victim's), then
answers each line read from stdin ("check") with one JSON line: the victim session's state, landed
blocks and pool digest, the sessions open, and the process's peak and current resident memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import resource
import sys
import threading

from pdserve.cachestore import CacheStoreServer, MemoryRegion, PoolGeometry
from tests.cachestore.helpers import SECRET

GEO = PoolGeometry(num_layers=2, num_blocks=32, block_bytes=256)
ATTACKER_BLOCKS = [0, 1, 2, 3, 10, 11]
VICTIM_BLOCKS = [4, 5, 6, 7, 8]


def memory_kib() -> dict[str, int]:
    """VmHWM (peak resident) and VmRSS of this process, in KiB."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0])
    return fields


def main() -> None:
    cap = int(sys.argv[1])
    transport = sys.argv[2] if len(sys.argv) > 2 else "tcp"
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    pool = bytearray(GEO.total_bytes)
    loop = asyncio.new_event_loop()
    server = CacheStoreServer(MemoryRegion.from_buffer(pool), GEO, transport=transport, secret=SECRET)
    loop.run_until_complete(server.start())
    attacker = server.open_session("attacker", ATTACKER_BLOCKS, timeout=3600)
    victim = server.open_session("victim", VICTIM_BLOCKS, timeout=3600)
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def victim_digest() -> str:
        spans = [GEO.offset(layer, b) for layer in range(GEO.num_layers) for b in VICTIM_BLOCKS]
        return hashlib.sha256(b"".join(bytes(pool[s : s + GEO.block_bytes]) for s in spans)).hexdigest()

    creds = {"attacker": attacker.to_bytes().decode(), "victim": victim.to_bytes().decode()}
    print(json.dumps({"endpoint": server.endpoint, "digest": victim_digest(), **creds}), flush=True)
    for _ in sys.stdin:
        session = server.get_session("victim")
        state = {
            "victim_state": session.state.value if session else None,
            "victim_landed": len(session.landed) if session else -1,
            "victim_digest": victim_digest(),
            "sessions": server.num_sessions,
            **memory_kib(),
        }
        print(json.dumps(state), flush=True)


if __name__ == "__main__":
    main()
