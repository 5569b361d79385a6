"""--rdma-device/--rdma-port/--rdma-gid-index/--rdma-qps reach CacheStore's RDMA setup (emulated device)."""

from __future__ import annotations

import os

import pytest

from pdserve.cachestore import rdma
from pdserve.cli import build_parser
from pdserve.commands.node_common import node_config
from pdserve.node_runtime.node_config import RDMA_ENV


def _export(argv: list[str]) -> None:
    """What `pdserve decode ARGV` hands CacheStore before the node starts."""
    node_config(build_parser().parse_args(["decode"] + argv), "decode").transfer.export_env()


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.setenv(rdma.EMULATOR_ENV, "1")
    for env in RDMA_ENV.values():
        monkeypatch.delenv(env, raising=False)
    yield monkeypatch


def test_flags_choose_device_port_and_gid(clean_env):
    assert rdma.device_choice() == ("emu_rdma0", 1, 0)  # defaults: first device, port 1, GID 0
    _export(["--rdma-device", "emu_rdma0", "--rdma-port", "1", "--rdma-gid-index", "3", "--rdma-qps", "4"])
    assert rdma.device_choice() == ("emu_rdma0", 1, 3)
    assert os.environ[rdma.QPS_ENV] == "4"


def test_flags_override_the_environment_and_a_missing_nic_is_named(clean_env):
    clean_env.setenv("PDSERVE_RDMA_DEVICE", "emu_rdma0")
    _export(["--rdma-device", "mlx5_9"])
    with pytest.raises(OSError, match="'mlx5_9' not found"):
        rdma.device_choice()


@pytest.mark.parametrize("argv", [["--rdma-port", "0"], ["--rdma-gid-index", "-1"], ["--rdma-qps", "0"]])
def test_bad_numbers_are_refused(clean_env, argv):
    with pytest.raises(SystemExit, match="must be >="):
        _export(argv)
