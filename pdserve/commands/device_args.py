"""`--device` and `--attention-backend`: where the engine runs, shared by every command that loads a model.

Like every flag, each is also settable from the environment (PDSERVE_DEVICE, PDSERVE_ATTENTION_BACKEND:
see node_runtime/config.py), so a container image or a Kubernetes ConfigMap can select the GPU without
editing the command line. Unset, they take EngineConfig's defaults.
"""

from __future__ import annotations

import argparse
import re

from pdserve.commands.config_flags import config_flag
from pdserve.engine.config import EngineConfig

_DEFAULT_DEVICE = EngineConfig.device
_DEFAULT_BACKEND = EngineConfig.attention_backend
BACKENDS = ("auto", "torch", "cpu_paged", "flashinfer")
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """Add --device/--attention-backend (unset: EngineConfig's defaults; $PDSERVE_DEVICE and
    $PDSERVE_ATTENTION_BACKEND set them like any flag's variable)."""
    config_flag(p, EngineConfig, "device")
    config_flag(p, EngineConfig, "attention_backend", choices=BACKENDS)


def add_tensor_parallel_arg(p: argparse.ArgumentParser, expert_parallel: bool = True) -> None:
    """--tensor-parallel-size: the model split over N ranks, one process each (pdserve.engine.parallel);
    with `expert_parallel`, also --enable-expert-parallel (serving commands; a TD-Pipe stage splits
    experts the tensor-parallel way)."""
    config_flag(p, EngineConfig, "tensor_parallel_size")
    if expert_parallel:
        config_flag(p, EngineConfig, "enable_expert_parallel", action="store_true")


def add_enforce_eager_arg(p: argparse.ArgumentParser) -> None:
    """--enforce-eager of the commands that serve (generate, prefill, decode, up: `up` hands it on)."""
    config_flag(p, EngineConfig, "enforce_eager", action="store_true")


def resolve_device(requested: str | None) -> str:
    """The torch device string to run on; ValueError for a malformed name or a missing GPU."""
    device = (requested or _DEFAULT_DEVICE).strip()
    if not _DEVICE_RE.match(device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available on this host")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} requested but only {torch.cuda.device_count()} GPU(s) exist")
    return device


def resolve_backend(requested: str | None, device: str, dtype=None) -> str:
    """torch, cpu_paged or flashinfer. `auto` picks cpu_paged on CPU; on CUDA, torch where Triton imports
    (its decode is the Triton paged kernel, and decode steps replay CUDA graphs: engine.cuda_graphs, the
    path measured against the device's bandwidth), else flashinfer when it imports and the KV dtype is
    float16 or bfloat16 (its kernels have no float32 variant), else torch; an explicit flashinfer
    that cannot run is refused."""
    backend = (requested or _DEFAULT_BACKEND).strip()
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    on_gpu = device.startswith("cuda")
    half = dtype is None or str(dtype) in ("torch.float16", "torch.bfloat16")
    if backend == "auto":
        if not on_gpu:
            return "cpu_paged"
        from pdserve.engine.attention import triton_decode  # torch: imported once a device is chosen

        if triton_decode.available():
            return "torch"
        return "flashinfer" if half and flashinfer_available() else "torch"
    if backend == "cpu_paged" and on_gpu:
        raise ValueError("attention backend 'cpu_paged' runs on CPU only; use torch or flashinfer with --device cuda")
    if backend == "flashinfer" and not on_gpu:
        raise ValueError("attention backend 'flashinfer' needs --device cuda (it has no CPU path)")
    if backend == "flashinfer" and not half:
        raise ValueError(f"attention backend 'flashinfer' needs --dtype float16 or bfloat16, the model runs in {dtype}")
    return backend


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # ImportError, or a CUDA/ABI mismatch raised at import
        return False
    return True


def device_options(args: argparse.Namespace) -> dict[str, str]:
    """EngineConfig keyword arguments {device, attention_backend} from parsed flags."""
    device = resolve_device(getattr(args, "device", None))
    dtype = None
    if device.startswith("cuda"):  # the dtype decides whether flashinfer can run (cheap: reads config.json)
        import torch

        from pdserve.engine.builtin import default_model_dir
        from pdserve.engine.model_config import ModelConfig
        from pdserve.engine.weights import resolve_dtype

        model_dir = getattr(args, "model", None) or default_model_dir()
        dtype = resolve_dtype(
            getattr(args, "dtype", None) or EngineConfig.dtype, ModelConfig.from_dir(model_dir), torch.device(device)
        )
    backend = resolve_backend(getattr(args, "attention_backend", None), device, dtype)
    return {"device": device, "attention_backend": backend}


def device_flags(args: argparse.Namespace) -> list[str]:
    """The flags that hand the same choice to a child process (`pdserve up`); empty when unset."""
    flags = []
    if getattr(args, "device", None):
        flags += ["--device", args.device]
    if getattr(args, "attention_backend", None):
        flags += ["--attention-backend", args.attention_backend]
    return flags
