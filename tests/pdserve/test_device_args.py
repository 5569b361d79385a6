"""--device/--attention-backend, also set by PDSERVE_DEVICE/PDSERVE_ATTENTION_BACKEND (CPU host: CUDA is refused)."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.cli import build_parser
from pdserve.commands.device_args import device_flags, device_options, resolve_backend


def _parse(argv: list[str]) -> argparse.Namespace:
    """`pdserve generate ARGV`: the environment reaches the flags through node_runtime/config.py."""
    return build_parser().parse_args(["generate"] + argv)


def test_defaults_and_environment(monkeypatch):
    monkeypatch.delenv("PDSERVE_DEVICE", raising=False)
    monkeypatch.delenv("PDSERVE_ATTENTION_BACKEND", raising=False)
    assert device_options(_parse([])) == {"device": "cpu", "attention_backend": "cpu_paged"}
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "torch")
    monkeypatch.setenv("PDSERVE_DEVICE", "cpu")
    assert device_options(_parse([])) == {"device": "cpu", "attention_backend": "torch"}
    assert device_flags(_parse(["--device", "cuda:1", "--attention-backend", "flashinfer"])) == [
        "--device",
        "cuda:1",
        "--attention-backend",
        "flashinfer",
    ]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--device", "gpu0"], "cpu, cuda or cuda:N"),
        (["--attention-backend", "flashinfer"], "needs --device cuda"),
    ],
)
def test_bad_choices_are_refused_with_the_reason(argv, match, monkeypatch):
    monkeypatch.delenv("PDSERVE_DEVICE", raising=False)
    with pytest.raises(ValueError, match=match):
        device_options(_parse(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setenv("PDSERVE_DEVICE", "cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        device_options(_parse([]))


def test_flashinfer_is_never_chosen_for_float32():
    assert resolve_backend("auto", "cuda", torch.float32) == "torch"
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        resolve_backend("flashinfer", "cuda", torch.float32)


def test_node_exits_2_with_the_reason(capsys):
    from pdserve.cli import main

    with pytest.raises(SystemExit, match="needs --device cuda"):
        main(["prefill", "--attention-backend", "flashinfer", "--port", "0"])
