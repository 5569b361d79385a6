"""A small gRPC client for the nodes, used by the e2e tests."""

from __future__ import annotations

import grpc

from pdserve.node_runtime.auth import cluster_metadata
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


async def generate(
    address: str,
    secret: str,
    request_id: str,
    prompt: list[int],
    params,
    prefill: list[str],
    timeout: float = 60.0,
    **fields,
) -> tuple[list[int], list[decode_pb2.GenerateEvent]]:
    """One Generate call to its end; `fields` are further GenerateRequest fields (e.g. cache_salt)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel)
        req = decode_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, params=params, prefill_addresses=prefill, **fields
        )
        events = [e async for e in stub.Generate(req, metadata=cluster_metadata(secret), timeout=timeout)]
    return [t for e in events for t in e.token_ids], events


async def load(address: str, secret: str, role: str = "decode", timeout: float = 10.0) -> common_pb2.LoadReport:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = decode_pb2_grpc.DecodeStub(channel) if role == "decode" else prefill_pb2_grpc.PrefillStub(channel)
        return await stub.GetLoad(common_pb2.LoadRequest(), metadata=cluster_metadata(secret), timeout=timeout)
