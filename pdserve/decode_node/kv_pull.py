"""PullSender: the decode node's end of a D->P pull (it sends the prefix blocks it holds).

When this node holds at least `--kv-pull-min-blocks` prompt blocks, it asks the chosen prefill
node (`Prefill.PreparePull`) which of them it lacks. If at least that many are missing, the
prefill node answers with a CacheStore session over fresh blocks in its own pool, and this node
writes its held blocks into it (every layer, same transports, HMAC handshake, TLS and fencing as
the P->D direction, through `CacheStoreClient`). The Prefill call that follows says whether every
write was acknowledged (`kv_pulled`); only then does the prefill node key the blocks.

The blocks sent are the request's own shared prefix blocks: keyed (so never written) and held
by the request's reference until it ends, which is after the transfer in every path but a
cancel. A cancel aborts the transfer; a sender thread still reading may then read a block the
engine reuses, but the prefill node never keys an unclaimed pull, so those bytes are discarded.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from prometheus_client import CollectorRegistry, Counter

from pdserve.cachestore import CacheStoreClient, SessionCredentials, TransferError
from pdserve.decode_node.prefill_client import PrefillClients
from pdserve.v1 import prefill_pb2

log = logging.getLogger("pdserve.decode")
OUTCOMES = ("pulled", "declined", "failed", "skipped")


class PullSender:
    """Sends held prefix blocks to prefill nodes that lack them (`min_blocks` 0: never)."""

    def __init__(
        self,
        client: CacheStoreClient,
        prefills: PrefillClients,
        block_size: int,
        min_blocks: int,
        registry: CollectorRegistry,
        model_name: str = "unknown",
    ) -> None:
        self.client = client
        self.block_size = block_size
        self.prefills = prefills
        self.min_blocks = min_blocks
        self.pulls = Counter(
            "pdserve_kv_pull",
            "D->P pulls by outcome: pulled (the prefill node received the held blocks it lacked), "
            "declined (it lacked too few to pay), failed (it recomputes them), skipped (the router's "
            "index says it holds them: no offer made)",
            ["role", "model_name", "outcome"],
            registry=registry,
        )
        self.blocks = Counter(
            "pdserve_kv_pull_blocks",
            "Prompt blocks sent to prefill nodes by D->P pulls",
            ["role", "model_name"],
            registry=registry,
        ).labels("decode", model_name)
        self._labels = ("decode", model_name)
        for outcome in OUTCOMES:
            self.pulls.labels(*self._labels, outcome)

    def wanted(self, held_tokens: int, prefill_cached_tokens: int | None = None) -> bool:
        """Whether to offer a prefix of `held_tokens` (block aligned) at all. `prefill_cached_tokens`:
        the router's estimate of what the prefill node holds (None: unknown); an offer needs at least
        `min_blocks` held blocks beyond it, else the PreparePull round trip would come back empty."""
        if self.min_blocks <= 0 or held_tokens // self.block_size < self.min_blocks:
            return False
        if prefill_cached_tokens is not None:
            beyond = held_tokens // self.block_size - min(prefill_cached_tokens, held_tokens) // self.block_size
            if beyond < self.min_blocks:
                self._count("skipped")
                return False
        return True

    async def pull(
        self, address: str, request: prefill_pb2.PrefillRequest, block_ids: list[int], timeout: float
    ) -> bool:
        """Offer `request`'s held blocks (`block_ids`: the prompt's blocks, held first) to the prefill
        node at `address`; True once it has received every block it lacked. A failed transfer is
        False (that node recomputes them); a failed PreparePull call raises like Prefill would."""
        offer_request = prefill_pb2.PrefillRequest()
        offer_request.CopyFrom(request)
        offer_request.kv_pull_min_blocks = self.min_blocks
        offer_request.ClearField("kv_destination")
        try:
            offer = await self.prefills.prepare_pull(address, offer_request, timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            return self._count("declined")  # a prefill node from before D->P pulls: it recomputes
        if not offer.kv_destination:
            return self._count("declined")
        rid = request.request_id
        held_blocks = request.decode_cached_tokens // self.block_size
        creds = SessionCredentials.from_bytes(offer.kv_destination)
        src = block_ids[offer.first_block : held_blocks]
        if creds.num_layers != self.client.geometry.num_layers or not src or len(creds.block_ids) != len(src):
            log.warning("request_id=%s event=pull_refused reason=offer does not match the held blocks", rid)
            return self._count("failed")
        tx = self.client.open_transfer(creds)
        try:
            for layer in range(creds.num_layers):
                tx.write_layer(layer, src)
            await tx.finish(timeout=timeout)
        except TransferError as e:
            log.warning("request_id=%s event=pull_failed prefill=%s error=%s", rid, address, e)
            return self._count("failed")
        except asyncio.CancelledError:
            tx.abort("request cancelled")
            raise
        self.blocks.inc(len(src))
        return self._count("pulled")

    def _count(self, outcome: str) -> bool:
        self.pulls.labels(*self._labels, outcome).inc()
        return outcome == "pulled"
