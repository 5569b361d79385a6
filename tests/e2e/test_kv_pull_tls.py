"""D->P pull between node processes over tcp with mutual TLS: the prefill node that lacks the
prefix the decode node holds receives it through its own CacheStore listener (TLS, HMAC, fencing
as P->D), computes only the rest, and the answer equals the single-process engine's."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.node_runtime.auth import cluster_metadata
from pdserve.node_runtime.cluster_tls import ClusterTLS, make_throwaway
from pdserve.v1 import decode_pb2, decode_pb2_grpc
from tests.e2e.cluster import start_cluster
from tests.e2e.grpc_client import greedy
from tests.e2e.test_kv_reuse import NEW, TURN1

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def tls_generate(tls: ClusterTLS, address: str, secret: str, rid: str, prompt: list[int], prefill: list[str]):
    """One Generate call over the cluster's mutual TLS: (tokens, last event)."""
    async with tls.channel(address, []) as channel:
        req = decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, params=greedy(8, ignore_eos=True), prefill_addresses=prefill
        )
        events = [
            e
            async for e in decode_pb2_grpc.DecodeStub(channel).Generate(
                req, metadata=cluster_metadata(secret), timeout=120
            )
        ]
    return [t for e in events for t in e.token_ids], events[-1]


async def test_pull_between_processes_over_mutual_tls(tmp_path, tiny_model_dir):
    pytest.importorskip("cryptography")
    cert, key, ca = make_throwaway(tmp_path)
    flags = ["--cluster-tls-cert", str(cert), "--cluster-tls-key", str(key), "--cluster-tls-ca", str(ca)]
    cluster = start_cluster(2, 1, model=str(tiny_model_dir), extra=flags, decode_extra=["--kv-pull-min-blocks", "1"])
    try:
        tls = ClusterTLS.from_files(str(cert), str(key), str(ca))
        decode, (a, b) = cluster.decodes[0].address, [p.address for p in cluster.prefills]
        first, _ = await tls_generate(tls, decode, cluster.secret, "t1", TURN1, [a])
        turn2 = TURN1 + first + NEW
        tokens, last = await tls_generate(tls, decode, cluster.secret, "t2", turn2, [b])
        # b held nothing: its hit is the 6 blocks the decode node sent, not recomputed anywhere
        assert last.usage.cached_tokens == 96
        expected = LLM(tiny_model_dir, num_kv_blocks=64).generate(
            [turn2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        )
        assert tokens == expected[0].outputs[0].token_ids
    finally:
        cluster.stop()
