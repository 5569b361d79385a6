"""PrefillNode: gRPC `Prefill` service around the engine and a CacheStore sender."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pdserve.cachestore import SessionCredentials, Transfer, Transport
from pdserve.engine.block_manager import blocks_for
from pdserve.engine.kv_connector import KvConnectors
from pdserve.engine.kv_pull import PullConnector
from pdserve.engine.prompt_check import check_prompt
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_runtime import convert, kv_store
from pdserve.node_runtime.grpc_errors import IncompatiblePeer, RequestAborted
from pdserve.node_runtime.kv_events_service import KvEventsServicer
from pdserve.node_runtime.node import NodeRuntime
from pdserve.node_runtime.node_request import NodeRequest
from pdserve.node_runtime.node_config import NodeConfig
from pdserve.node_runtime.rank_kv import LayerStreamer, pool_geometry
from pdserve.node_runtime.rank_kv_driver import SENDER, RankEndpoints, endpoint_options, with_rank_service
from pdserve.prefill_node.kv_pull import PullReceiver
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger("pdserve.prefill")
MAX_TP = 64
"""Most decode ranks one request's KV may be written to (EngineConfig bounds tensor_parallel_size alike)."""


class PrefillNode(KvEventsServicer, prefill_pb2_grpc.PrefillServicer):
    """Runs prompts with `prefill_only` requests; after each layer the engine's KV connector (a
    `LayerStreamer`) hands that layer's blocks to the request's CacheStore transfer, so the transfer
    of layer i overlaps the compute of layer i+1. The first token is returned only once every layer
    is acknowledged. The engine's other connector (a `PullConnector`) holds the blocks of D->P pulls."""

    def __init__(self, config: NodeConfig) -> None:
        if config.engine.tensor_parallel_size > 1 and config.transfer.transport == Transport.LOCAL:  # before loading
            raise ValueError("a tensor-parallel prefill node needs a network transport: ranks 1.. are other processes")
        if not config.node.kv_reuse:  # the no-reuse baseline: every prompt token is computed
            config = replace(config, engine=replace(config.engine, enable_prefix_caching=False))
        pull = PullConnector()  # D->P pulls (TP=1 only: PreparePull declines on a tensor-parallel node)
        connector = KvConnectors(LayerStreamer(self._transfers_of), pull)
        self.rt = NodeRuntime("prefill", with_rank_service(config, SENDER), connector)
        self.geometry = pool_geometry(self.rt.engine.runner)  # rank 0's KV heads; ranks 1.. send theirs
        self.client = kv_store.sender(self.rt, config)
        self.advertise_host = config.node.advertise_host
        self.pulls = PullReceiver(
            self.rt,
            pull,
            kv_store.receiver(
                self.rt, config, self.client.metrics, kv_store.pull_transport(self.rt, self.client.active_transport)
            ),
            config.transfer.kv_timeout,
        )
        """D->P pulls: this node receives held prefix blocks from decode nodes (`kv_pull`); TP=1 only."""
        self.ranks = RankEndpoints(self.rt.engine.runner)
        """The CacheStore senders of tensor-parallel ranks 1.. (none with TP=1)."""

    async def start(self) -> str:
        if self.ranks.ranks:
            await self.ranks.start_senders(**endpoint_options(self.rt.config, self.client.active_transport))
        await kv_store.start_receiver(self.pulls.cachestore, self.advertise_host)
        return await self.rt.start(lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(self, server))

    def discovery_meta(self) -> dict[str, str]:
        return {}

    async def stop(self, drain: bool = False) -> None:
        await self.pulls.close()  # while the engine thread still runs; later offers are declined
        await self.rt.stop(drain)
        await self.pulls.cachestore.stop()
        await self.client.close()

    @property
    def geometry_block_size(self) -> int:
        return self.rt.engine.kv_pool.block_size

    async def GetLoad(self, request, context) -> common_pb2.LoadReport:
        return await self.rt.load_report()

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        rt = self.rt
        # a pull offered for this request is settled first: its blocks keyed (then hit below) or freed
        await self.pulls.claim(request.request_id, request.kv_pulled)
        rid, prompt, params, dests, salt = self._parse(request)
        await rt.compile_grammar(params)
        held_blocks = request.decode_cached_tokens // self.geometry_block_size
        txs = [self.client.open_transfer(c) for c in dests if self.client.writes_to(c)]
        async with rt.request(
            rid,
            self._end,
            event="prefill",
            prompt_tokens=len(prompt),
            max_tokens=params.max_tokens,
            destination=dests[0].endpoint,
        ) as scope:
            if self.ranks.ranks:  # before the prompt runs: every rank's hook must know its transfers
                await self.ranks.open_transfers(rid, [c.to_bytes() for c in dests], held_blocks)
            scope.transfers, scope.first_block = txs, held_blocks  # the streamer finds them from now on
            await rt.admit(scope, prompt, params, prefill_only=True, cache_salt=salt)
            out = await scope.next_output()
            while not out.finished:
                out = await scope.next_output()
            if out.finish_reason == "abort" or not out.new_token_ids:
                raise RequestAborted(f"prefill of {rid} was aborted")
            prefill_seconds = time.monotonic() - scope.started
            timeout = rt.config.transfer.kv_timeout
            transfer_seconds = max([await tx.finish(timeout=timeout) for tx in txs], default=0.0)  # TransferError
            if self.ranks.ranks:
                transfer_seconds = max(transfer_seconds, await self.ranks.finish(rid, timeout))
            scope.finished = True
            response = prefill_pb2.PrefillResponse(
                first_token_id=out.new_token_ids[0],
                num_cached_tokens=out.num_cached_tokens,
                prefill_seconds=prefill_seconds,
                transfer_seconds=transfer_seconds,
            )
            if out.new_logprobs:
                response.first_logprob.CopyFrom(convert.logprob_to_pb(out.new_logprobs[0]))
            return response

    async def PreparePull(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PullOffer:
        """D->P pull, step 1 (see `prefill_node.kv_pull`): where the decode node may write the held
        prefix blocks this node lacks; an empty offer when fewer than kv_pull_min_blocks are missing."""
        rid, prompt, salt = self._parse_prompt(request)
        if self.ranks.ranks:  # a pull would have to land head slices on every rank: not built
            return prefill_pb2.PullOffer()
        if request.decode_cached_tokens == 0:
            raise ValueError("PreparePull needs decode_cached_tokens > 0: the prefix the decode node holds")
        return await self.pulls.offer(
            rid, prompt, request.decode_cached_tokens, max(1, request.kv_pull_min_blocks), salt
        )

    def _parse_prompt(self, request: prefill_pb2.PrefillRequest) -> tuple[str, list[int], str | None]:
        """Id, prompt and cache salt, checked with the peer's compatibility and decode_cached_tokens;
        IncompatiblePeer or ValueError when they cannot be served."""
        rt = self.rt
        if request.compatibility != rt.compatibility:
            raise IncompatiblePeer(
                f"incompatible peer: decode has {request.compatibility!r}, prefill has {rt.compatibility!r}"
            )
        rid = convert.check_request_id(request.request_id)
        prompt = check_prompt(request.prompt_token_ids, rt.engine.model_config.vocab_size, rt.engine.max_model_len)
        held, bs = request.decode_cached_tokens, self.geometry_block_size
        if held % bs or held >= len(prompt):
            raise ValueError(f"decode_cached_tokens must be a multiple of {bs} below the prompt length, got {held}")
        return rid, prompt, convert.cache_salt_from_pb(request)

    def _parse(
        self, request: prefill_pb2.PrefillRequest
    ) -> tuple[str, list[int], SamplingParams, list[SessionCredentials], str | None]:
        """`_parse_prompt`, plus params and the KV destinations (one per decode rank; they hold the
        blocks after decode_cached_tokens)."""
        rid, prompt, salt = self._parse_prompt(request)
        params = convert.params_from_pb(request.params)
        held, bs = request.decode_cached_tokens, self.geometry_block_size
        dests = [SessionCredentials.from_bytes(request.kv_destination)]
        if len(request.kv_rank_destinations) >= MAX_TP:
            raise ValueError(f"at most {MAX_TP - 1} kv_rank_destinations")
        dests += [SessionCredentials.from_bytes(c) for c in request.kv_rank_destinations]
        for creds in dests:
            if (
                creds.num_layers != self.geometry.num_layers
                or len(creds.block_ids) < blocks_for(len(prompt), bs) - held // bs
            ):
                raise ValueError("kv_destination does not cover the prompt's layers and missing blocks")
            self.client.heads_for(creds)  # the handshake's check: ValueError if our KV heads cannot map
        if [(c.tp_rank, c.tp_size) for c in dests] != [(r, len(dests)) for r in range(len(dests))]:
            raise ValueError("kv_destination and kv_rank_destinations must name the decode ranks 0..b-1 in order")
        return rid, prompt, params, dests, salt

    def _transfers_of(self, rid: str) -> tuple[list[Transfer], int] | None:
        """Engine thread (`LayerStreamer.save_layer`): a request's transfers, from its record."""
        record = self.rt.requests.get(rid)
        return None if record is None or record.ending else (record.transfers, record.first_block)

    async def _end(self, scope: NodeRequest) -> None:
        """Success: release keeps the blocks prefix-cached; failure or cancel: the transfers (on every
        rank) are aborted and abort frees the blocks too."""
        if not scope.finished:
            for tx in scope.transfers:
                tx.abort("prefill cancelled or failed")
            await self.ranks.abort(scope.request_id)
        engine = self.rt.engine
        await self.rt.loop_thread.call(engine.release if scope.finished else engine.abort, scope.request_id)
