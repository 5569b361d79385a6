"""`--kv-cache-memory`, `--gpu-memory-utilization`, `--max-model-len` on the command line: parsed,
handed to `up`'s nodes, and an impossible `--max-model-len` refused at start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.cli import build_parser
from pdserve.commands.memory_args import kv_memory_flags, kv_memory_options

START_DEADLINE_S = 120
"""A refusal comes right after the weights load (seconds); this only bounds a hung process."""


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PDSERVE_CLUSTER_SECRET": "test-secret", "PDSERVE_NO_CPU_KERNEL": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=START_DEADLINE_S,
        env=env,
    )


@pytest.mark.parametrize("command", ["generate", "prefill", "decode", "up"])
def test_flags_parse_on_every_engine_command(command):
    args = build_parser().parse_args(
        [command, "--kv-cache-memory", "512MiB", "--gpu-memory-utilization", "0.5", "--max-model-len", "300"]
    )
    assert kv_memory_options(args) == {
        "kv_cache_bytes": 512 * 1024**2,
        "gpu_memory_utilization": 0.5,
        "max_model_len": 300,
    }


def test_up_hands_the_flags_to_its_nodes():
    args = build_parser().parse_args(["up", "--kv-cache-memory", "4GiB", "--max-model-len", "100"])
    assert kv_memory_flags(args) == ["--kv-cache-memory", str(4 * 1024**3), "--max-model-len", "100"]
    assert kv_memory_flags(build_parser().parse_args(["up"])) == []
    # and the node parser takes them back unchanged
    node = build_parser().parse_args(["decode", *kv_memory_flags(args)])
    assert node.kv_cache_bytes == 4 * 1024**3 and node.max_model_len == 100


@pytest.mark.parametrize(
    "argv", [["--kv-cache-memory", "lots"], ["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "x"]]
)
def test_bad_values_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", *argv])
    assert exit_.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "decode"])
def test_max_model_len_that_cannot_fit_is_refused_at_start(command):
    # the tiny model: 2 KiB of KV per token in float32, so 1 MiB holds 512 tokens
    argv = [command, "--kv-cache-memory", "1MiB", "--max-model-len", "4096"]
    if command != "generate":
        argv += ["--port", "0", "--transport", "tcp"]
    proc = _run(argv)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--max-model-len 4096 does not fit" in proc.stderr
    assert "--kv-cache-memory" in proc.stderr and "READY" not in proc.stdout


def test_flags_are_settable_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_CACHE_MEMORY", "2MiB")
    monkeypatch.setenv("PDSERVE_GPU_MEMORY_UTILIZATION", "0.4")
    args = build_parser().parse_args(["decode"])
    assert (args.kv_cache_bytes, args.gpu_memory_utilization) == (2 * 1024**2, 0.4)


def test_the_host_tier_flag_reaches_every_engine_and_up_hands_it_on():
    for command in ("generate", "prefill", "decode", "up"):
        args = build_parser().parse_args([command, "--kv-offloading-size", "0.25", "--kv-offloading-backend", "native"])
        assert kv_memory_options(args) == {"kv_offloading_bytes": 2**28}
    up = build_parser().parse_args(["up", "--kv-offloading-size", "1"])
    node = build_parser().parse_args(["decode", *kv_memory_flags(up)])  # bytes with their unit, not GiB
    assert node.kv_offloading_bytes == 2**30
    for argv in (["batch", "-i", "in", "-o", "out"], ["stage", "--model-dir", "m"]):  # a pipeline stage keeps no tier
        build_parser().parse_args(argv)
        with pytest.raises(SystemExit):
            build_parser().parse_args([*argv, "--kv-offloading-size", "1"])


def test_generate_runs_with_a_host_tier():
    out = _run(["generate", "--prompt", "hello", "--max-tokens", "4", "--kv-offloading-size", "64MiB"])
    assert out.returncode == 0, out.stderr


def test_the_shared_store_flag_reaches_every_engine_and_up_hands_it_on(tmp_path):
    url = f"file://{tmp_path}/kv?max=1GiB"
    for command in ("generate", "prefill", "decode", "up"):
        assert kv_memory_options(build_parser().parse_args([command, "--kv-store", url])) == {"kv_store": url}
    up = build_parser().parse_args(["up", "--kv-store", url])
    assert build_parser().parse_args(["decode", *kv_memory_flags(up)]).kv_store == url
    out = _run(["generate", "--prompt", "hello", "--max-tokens", "4", "--kv-store", "s3://bucket"])
    assert out.returncode != 0 and "--kv-store" in out.stderr
