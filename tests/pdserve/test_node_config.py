"""One config object per process: NodeConfig / RouterConfig from the parsed flags, every EngineConfig
field reachable from the node CLI, and the dataclass default as the only default."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.cli import build_parser
from pdserve.commands.node_common import node_config
from pdserve.commands.router import router_config
from pdserve.node_runtime.discovery import DiscoveryConfig
from pdserve.node_runtime.node_config import NodeOptions, TransferOptions
from pdserve.router.config import ClusterOptions
from pdserve.router.deadlines import Deadlines

NOT_ON_NODES = {
    "layer_range": "a pipeline stage's slice of the layers (`pdserve stage`); a node runs them all",
    "rank_service": "set by the node from its role (a CacheStore sender or receiver on ranks 1..), not a flag",
}

SAMPLES: dict[str, tuple[list[str], object]] = {
    "model_dir": (["--model", "/models/m"], "/models/m"),
    "tokenizer": (["--tokenizer", "/models/t"], "/models/t"),
    "dtype": (["--dtype", "float16"], "float16"),
    "device": (["--device", "cuda:0"], "cuda:0"),
    "block_size": (["--block-size", "32"], 32),
    "num_kv_blocks": (["--num-kv-blocks", "99"], 99),
    "kv_cache_bytes": (["--kv-cache-memory", "1MiB"], 1048576),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"], 0.5),
    "max_num_seqs": (["--max-num-seqs", "3"], 3),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "512"], 512),
    "max_model_len": (["--max-model-len", "100"], 100),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], False),
    "preemption": (["--preemption", "never"], "never"),
    "attention_backend": (["--attention-backend", "torch"], "torch"),
    "seed": (["--seed", "7"], 7),
    "dist_timeout": (["--dist-timeout", "30"], 30.0),
    "num_threads": (["--num-threads", "2"], 2),
    "tensor_parallel_size": (["--tensor-parallel-size", "2"], 2),
    "enable_expert_parallel": (["--enable-expert-parallel"], True),
    "enforce_eager": (["--enforce-eager"], True),
    "kv_offloading_bytes": (["--kv-offloading-size", "0.5"], 2**29),
    "kv_store": (["--kv-store", "file:///tmp/pdserve-kv-store-sample"], "file:///tmp/pdserve-kv-store-sample"),
}
"""Per EngineConfig field: flags that set it to a value other than its default, and that value."""


@pytest.fixture
def fake_gpu(monkeypatch):
    """`--device cuda:0` resolves on a CPU host (the config is built, no engine is)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def _node(role: str, argv: list[str]):
    return node_config(build_parser().parse_args([role] + argv), role)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_engine_field_is_settable_from_the_node_cli(role, fake_gpu, tiny_model_dir):
    fields = [f for f in dataclasses.fields(EngineConfig) if f.name not in NOT_ON_NODES]
    assert {f.name for f in fields} == set(SAMPLES), "a new EngineConfig field needs a node flag (and a sample)"
    for f in fields:
        argv, value = SAMPLES[f.name]
        if f.name == "preemption" and role == "decode":
            argv, value = ["--preemption", "never"], "never"  # the only choice there (see below)
        if f.name == "device":  # the dtype decides flashinfer or torch on CUDA: read from a real checkpoint
            argv = argv + ["--model", str(tiny_model_dir)]
        engine = _node(role, argv).engine
        assert getattr(engine, f.name) == value, (role, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        assert value != default or (role, f.name) == ("decode", "preemption"), f"{f.name}: sample is the default"


def test_unset_flags_leave_the_dataclass_defaults_except_each_roles_own(monkeypatch):
    for var in ("PDSERVE_DEVICE", "PDSERVE_ATTENTION_BACKEND", "PDSERVE_CLUSTER_SECRET", "POD_IP"):
        monkeypatch.delenv(var, raising=False)
    prefill, decode = _node("prefill", []), _node("decode", [])
    for config, own in ((prefill, {"max_num_batched_tokens": 8192}), (decode, {"preemption": "never"})):
        for f in dataclasses.fields(EngineConfig):
            if f.name in ("model_dir", "attention_backend"):
                continue  # the built-in model; `auto` resolved to the CPU's backend (test_device_args)
            assert getattr(config.engine, f.name) == own.get(f.name, f.default), f.name
        assert config.transfer == TransferOptions() and config.discovery == DiscoveryConfig()
    assert (prefill.node.port, decode.node.port) == (50061, 50071)
    assert dataclasses.replace(decode.node, port=0, advertise_host=None) == NodeOptions()
    assert decode.node.advertise_host == "127.0.0.1"


def test_node_and_transfer_flags_reach_the_config(monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s3")
    config = _node(
        "decode",
        [
            "--host",
            "0.0.0.0",
            "--advertise-host",
            "node-a",
            "--metrics-port",
            "9",
            "--colocated",
            "--transport",
            "rdma",
            "--kv-timeout",
            "5",
            "--cachestore-port",
            "7000",
            "--rdma-qps",
            "3",
            "--discovery",
            "k8s",
            "--k8s-decode-service",
            "d:1",
        ],
    )
    assert config.node == NodeOptions(
        host="0.0.0.0", port=50071, metrics_port=9, cluster_secret="s3", advertise_host="node-a", colocated=True
    )
    assert config.transfer == TransferOptions(transport="rdma", kv_timeout=5.0, cachestore_port=7000, rdma_qps=3)
    assert config.discovery == DiscoveryConfig(discovery="k8s", k8s_decode_service="d:1")


def test_local_transport_is_for_the_python_api_only(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["prefill", "--transport", "local"])
    assert exit_.value.code == 2 and "invalid choice" in capsys.readouterr().err
    assert TransferOptions(transport="local").transport == "local"


def test_a_decode_node_refuses_preemption_and_bad_values_exit_2():
    with pytest.raises(SystemExit, match="decode node needs --preemption never"):
        _node("decode", ["--preemption", "recompute"])
    with pytest.raises(SystemExit, match="block_size must be positive"):
        _node("prefill", ["--block-size", "0"])


def test_router_config_from_flags_and_defaults(monkeypatch):
    for var in ("PDSERVE_CLUSTER_SECRET", "PDSERVE_API_KEY", "PDSERVE_API_KEYS"):
        monkeypatch.delenv(var, raising=False)
    config = router_config(build_parser().parse_args(["router"]))
    assert (config.host, config.port, config.api_keys, config.log_level) == ("127.0.0.1", 8000, (), "info")
    assert config.cluster == ClusterOptions() and config.discovery == DiscoveryConfig()
    config = router_config(
        build_parser().parse_args(
            [
                "router",
                "--port",
                "9",
                "--token-timeout",
                "3",
                "--cluster-secret",
                "s",
                "--decode",
                "h:1",
                "--api-key",
                "k",
                "--max-prompt-tokens",
                "50",
            ]
        )
    )
    assert config.cluster == ClusterOptions(cluster_secret="s", deadlines=Deadlines(token_timeout=3.0))
    assert (config.port, config.api_keys, config.max_prompt_tokens, config.discovery.decode) == (9, ("k",), 50, "h:1")
    with pytest.raises(SystemExit, match="hung_after must be > 0"):
        router_config(build_parser().parse_args(["router", "--hung-after", "0"]))


def test_router_prefill_saturated_tokens_flag():
    assert router_config(build_parser().parse_args(["router"])).cluster.prefill_saturated_tokens == 256
    args = build_parser().parse_args(["router", "--prefill-saturated-tokens", "0"])
    assert router_config(args).cluster.prefill_saturated_tokens == 0  # offload off
    with pytest.raises(SystemExit, match="prefill-saturated-tokens must be >= 0"):
        router_config(build_parser().parse_args(["router", "--prefill-saturated-tokens", "-1"]))


def test_kv_reuse_flags(capsys):
    decode = _node("decode", ["--kv-reuse", "off", "--local-prefill-max-tokens", "0"])
    assert decode.node.kv_reuse is False and decode.node.local_prefill_max_tokens == 0
    assert _node("prefill", []).node.kv_reuse is True
    with pytest.raises(SystemExit, match="local-prefill-max-tokens must be >= 0"):
        _node("decode", ["--local-prefill-max-tokens", "-1"])
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["prefill", "--kv-reuse", "maybe"])
    assert exit_.value.code == 2 and "expected on or off" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a prefill node has no local prefill
        build_parser().parse_args(["prefill", "--local-prefill-max-tokens", "8"])


def test_kv_pull_flags(capsys):
    assert _node("decode", []).node.kv_pull_min_blocks == 1  # docs/benchmark-log.md, "D->P pull vs recompute"
    assert _node("decode", ["--kv-pull-min-blocks", "0"]).node.kv_pull_min_blocks == 0
    assert _node("prefill", ["--cachestore-port", "50091"]).transfer.cachestore_port == 50091  # its pull receiver
    with pytest.raises(SystemExit, match="kv-pull-min-blocks must be >= 0"):
        _node("decode", ["--kv-pull-min-blocks", "-1"])
    with pytest.raises(SystemExit):  # the decode node decides; a prefill node only answers offers
        build_parser().parse_args(["prefill", "--kv-pull-min-blocks", "1"])
