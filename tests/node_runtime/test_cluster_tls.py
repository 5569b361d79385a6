"""Mutual TLS on a gRPC server and channel from pdserve.node_runtime.cluster_tls (no model, no nodes)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.node_runtime import cluster_tls
from pdserve.node_runtime.cluster_tls import TLS_SERVER_NAME, ClusterTLS, make_throwaway

pytest.importorskip("cryptography")


async def test_only_a_peer_with_a_certificate_of_the_cluster_ca_gets_in(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ours = ClusterTLS.from_files(*map(str, make_throwaway(tmp_path / "a")))
    theirs = ClusterTLS.from_files(*map(str, make_throwaway(tmp_path / "b")))  # another CA
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = cluster_tls.add_port(server, "127.0.0.1:0", ours)
    await server.start()
    address, request = f"127.0.0.1:{port}", health_pb2.HealthCheckRequest()
    try:
        async with cluster_tls.channel(address, ours, []) as ch:
            status = await health_pb2_grpc.HealthStub(ch).Check(request, timeout=10)
            assert status.status == health_pb2.HealthCheckResponse.SERVING
        no_cert = grpc.ssl_channel_credentials(root_certificates=ours.ca)
        options = [("grpc.ssl_target_name_override", TLS_SERVER_NAME)]
        for ch in (
            cluster_tls.channel(address, None, []),  # plaintext
            grpc.aio.secure_channel(address, no_cert, options=options),  # TLS without a client certificate
            cluster_tls.channel(address, theirs, []),  # a certificate of another CA
        ):
            async with ch:
                with pytest.raises(grpc.aio.AioRpcError):
                    await health_pb2_grpc.HealthStub(ch).Check(request, timeout=5)
    finally:
        await server.stop(None)


def test_tls_files_go_together(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        ClusterTLS.from_files(str(tmp_path / "c"), None, None)
    with pytest.raises(ValueError, match="cannot read"):
        ClusterTLS.from_files(*(str(tmp_path / x) for x in "abc"))
    assert ClusterTLS.from_files(None, None, None) is None
