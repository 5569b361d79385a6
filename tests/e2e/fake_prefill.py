"""A prefill node that stalls halfway through each layer's payload (a hung or partitioned host).

It speaks the real gRPC `Prefill` service and the real CacheStore wire, but after sending half of
every layer's payload it waits for `resume` before sending the rest, as a host back from a long
pause would. `outcomes` records what the decode node answered to each late write.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import grpc

from pdserve.cachestore import SessionCredentials, wire
from pdserve.v1 import common_pb2, prefill_pb2_grpc
from tests.cachestore.helpers import read_ack, write_header

LATE_BYTE = 0x77


class StallingPrefill(prefill_pb2_grpc.PrefillServicer):
    """Stalls every Prefill call; never returns a first token."""

    def __init__(self, compatibility: str, secret: str) -> None:
        self.compatibility = compatibility
        self.secret = secret.encode()
        self.resume = threading.Event()
        self.stalled = threading.Event()
        """Set once half of every layer's payload is inside the decode node."""
        self.outcomes: list[str] = []
        self.threads: list[threading.Thread] = []
        self.server: grpc.aio.Server | None = None

    async def start(self) -> str:
        self.server = grpc.aio.server()
        prefill_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    async def stop(self) -> None:
        self.resume.set()
        for t in self.threads:
            await asyncio.get_running_loop().run_in_executor(None, t.join, 30)
        await self.server.stop(grace=0)

    async def GetLoad(self, request, context) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(
            role="prefill", compatibility=self.compatibility, num_free_blocks=1, num_total_blocks=1
        )

    async def Prefill(self, request, context):
        creds = SessionCredentials.from_bytes(request.kv_destination)
        t = threading.Thread(target=self._write_stalled, args=(creds,), daemon=True)
        self.threads.append(t)
        t.start()
        await asyncio.sleep(3600)  # the decode node's deadline ends this call

    def _write_stalled(self, creds: SessionCredentials) -> None:
        ids = list(creds.block_ids)
        assert ids == list(range(ids[0], ids[0] + len(ids))), "expects a fresh pool's consecutive blocks"
        payload = len(ids) * creds.block_bytes
        socks = []
        for layer in range(creds.num_layers):  # one connection per layer: every layer has a stalled writer
            host, port = creds.endpoint.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=60)
            sock.sendall(wire.auth_tag(self.secret, sock.recv(wire.NONCE_BYTES, socket.MSG_WAITALL)))
            sock.sendall(write_header(creds, layer, ids[0], len(ids)) + bytes([LATE_BYTE]) * (payload // 2))
            socks.append(sock)
        self.stalled.set()
        self.resume.wait(120)
        for sock in socks:
            try:
                sock.sendall(bytes([LATE_BYTE]) * (payload - payload // 2))
                ack = read_ack(sock)
                self.outcomes.append("no ack" if ack is None else wire.REASONS.get(ack.status, "ok"))
            except OSError as e:
                self.outcomes.append(f"refused: {e.__class__.__name__}")
            finally:
                sock.close()
