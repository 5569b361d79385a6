"""PrefillNode: gRPC `Prefill` service around the engine and a CacheStore sender."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from functools import partial

from cachestore import SessionCredentials, Transfer
from engine.block_manager import blocks_for
from engine.forward_batch import ForwardBatch
from engine.prompt_check import check_prompt
from engine.sampling_params import SamplingParams
from node_runtime import convert
from node_runtime import kv_store
from node_runtime.kv_events_service import KvEventsServicer
from node_runtime.grpc_errors import IncompatiblePeer, RequestAborted
from node_runtime.node import NodeRuntime
from node_runtime.node_config import NodeConfig
from pdserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from prefill_node.kv_pull import PullReceiver

log = logging.getLogger("pdserve.prefill")


class PrefillNode(KvEventsServicer, prefill_pb2_grpc.PrefillServicer):
    """Runs prompts with `prefill_only` requests; after each layer the engine's hook hands that
    layer's blocks to the request's CacheStore transfer, so the transfer of layer i overlaps the
    compute of layer i+1. The first token is returned only once every layer is acknowledged."""

    def __init__(self, config: NodeConfig) -> None:
        if config.engine.tensor_parallel_size > 1:  # see DecodeNode.Generate: KV is split over ranks
            raise ValueError("a prefill node ships KV from one pool: --tensor-parallel-size > 1 is not supported yet")
        if not config.node.kv_reuse:  # the no-reuse baseline: every prompt token is computed
            config = replace(config, engine=replace(config.engine, enable_prefix_caching=False))
        self.rt = NodeRuntime("prefill", config)
        self.rt.engine.layer_hook = self._layer_hook
        self.geometry = kv_store.pool_geometry(self.rt)
        self.client = kv_store.sender(self.rt, config)
        self.advertise_host = config.node.advertise_host
        self.pulls = PullReceiver(
            self.rt, kv_store.receiver(self.rt, config, self.client.metrics), config.transfer.kv_timeout
        )
        """D->P pulls: this node receives held prefix blocks from decode nodes (`kv_pull`)."""
        self.transfers: dict[str, tuple[Transfer, int]] = {}
        """request id -> (Transfer, index of the first block it writes: the decode node holds the ones
        before); read by the engine thread in the layer hook."""

    async def start(self) -> str:
        await kv_store.start_receiver(self.pulls.cachestore, self.advertise_host)
        return await self.rt.start(lambda server: prefill_pb2_grpc.add_PrefillServicer_to_server(self, server))

    def discovery_meta(self) -> dict[str, str]:
        return {}

    async def stop(self, drain: bool = False) -> None:
        await self.pulls.close()  # while the engine thread still runs; later offers are declined
        await self.rt.stop(drain)
        await self.pulls.cachestore.stop()
        await self.client.close()

    def _layer_hook(self, layer: int, batch: ForwardBatch) -> None:
        """Engine thread, after `layer` wrote its KV: ship it for every request whose prompt
        completes in this step (earlier chunks' layers are final by then too)."""
        ready = None
        for rid, ctx, table, last in zip(batch.request_ids, batch.context_lens, batch.block_tables, batch.sample_mask):
            entry = self.transfers.get(rid)
            if entry is not None and last:
                if ready is None:
                    ready = self._ready_event()
                tx, first = entry
                tx.write_layer(layer, table[first : blocks_for(ctx, self.geometry_block_size)], ready_event=ready)

    def _ready_event(self):
        """On a CUDA pool: an event recorded now on the engine's stream, after this layer's KV writes.
        The sender thread waits on it (never the engine thread), so the copy cannot read a layer its
        kernels are still writing. None on CPU, where the writes are done when the hook runs."""
        pool = self.rt.engine.runner.kv_pool.tensor
        if not pool.is_cuda:
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(pool.device))
        return event

    @property
    def geometry_block_size(self) -> int:
        return self.rt.engine.runner.kv_pool.block_size

    async def GetLoad(self, request, context) -> common_pb2.LoadReport:
        return await self.rt.load_report()

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        rt, engine = self.rt, self.rt.engine
        # a pull offered for this request is settled first: its blocks keyed (then hit below) or freed
        await self.pulls.claim(request.request_id, request.kv_pulled)
        rid, prompt, params, creds, salt = self._parse(request)
        await rt.compile_grammar(params)
        skip = request.decode_cached_tokens // self.geometry_block_size
        tx = self.client.open_transfer(creds)
        async with rt.request(
            rid,
            partial(self._end, rid, tx),
            event="prefill",
            prompt_tokens=len(prompt),
            max_tokens=params.max_tokens,
            destination=creds.endpoint,
        ) as scope:
            self.transfers[rid] = (tx, skip)
            await rt.loop_thread.call(engine.add_request, rid, prompt, params, prefill_only=True, cache_salt=salt)
            out = await scope.next_output()
            while not out.finished:
                out = await scope.next_output()
            if out.finish_reason == "abort" or not out.new_token_ids:
                raise RequestAborted(f"prefill of {rid} was aborted")
            prefill_seconds = time.monotonic() - scope.started
            transfer_seconds = await tx.finish(timeout=rt.config.transfer.kv_timeout)  # TransferError: UNAVAILABLE
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
    ) -> tuple[str, list[int], SamplingParams, SessionCredentials, str | None]:
        """`_parse_prompt`, plus params and the KV destination (the blocks after decode_cached_tokens)."""
        rid, prompt, salt = self._parse_prompt(request)
        params = convert.params_from_pb(request.params)
        bs = self.geometry_block_size
        creds = SessionCredentials.from_bytes(request.kv_destination)
        if (
            creds.num_layers != self.geometry.num_layers
            or len(creds.block_ids) < blocks_for(len(prompt), bs) - request.decode_cached_tokens // bs
        ):
            raise ValueError("kv_destination does not cover the prompt's layers and missing blocks")
        return rid, prompt, params, creds, salt

    async def _end(self, rid: str, tx: Transfer, finished: bool) -> None:
        """Success: release keeps the blocks prefix-cached; failure or cancel: the transfer is aborted
        and abort frees the blocks too."""
        self.transfers.pop(rid, None)
        if not finished:
            tx.abort("prefill cancelled or failed")
        await self.rt.loop_thread.call(self.rt.engine.release if finished else self.rt.engine.abort, rid)
