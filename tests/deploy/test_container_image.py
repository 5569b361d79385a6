"""The CPU container image really builds and serves (slow; needs root, podman, runc and debootstrap).

It proves what a user of deploy/docker/Dockerfile relies on: `scripts/build_image.sh` builds the image
(offline here, from a debootstrapped Debian base and the local torch CPU wheel, through the same build
arguments a Docker Hub build uses), the image carries the project version and runs as non-root, and
`pdserve up` inside it answers a completion and a chat completion sent from the host.

What it does not prove: a build from Docker Hub's python:3.11-slim (no registry but Debian's and PyPI is
reachable here) or anything of deploy/docker/Dockerfile.gpu.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest

from tests.e2e.router_cluster import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
# Measured here: a first build (debootstrap + torch from the local wheel + the project's dependencies
# from PyPI) takes minutes; later builds reuse the base image and podman's layer cache.
BUILD_TIMEOUT = 1800.0
READY_TIMEOUT = 300.0
# crun refuses this sandbox's cgroups; runc fails to set the inherited NOFILE limit unless given explicit ones.
RUN_FLAGS = ["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def _tool(name: str) -> str | None:
    """`name` on PATH or in /usr/sbin (where debootstrap and runc live, off a non-root PATH)."""
    return shutil.which(name) or (f"/usr/sbin/{name}" if os.access(f"/usr/sbin/{name}", os.X_OK) else None)


def _requirements() -> str | None:
    """Why this machine cannot build and run the image, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (debootstrap makes the base image; rootless podman is not set up here)"
    missing = [t for t in ("podman", "runc", "debootstrap") if _tool(t) is None]
    if missing:
        return f"{', '.join(missing)} not installed (scripts/install_ops_tools.sh installs them)"
    return None


def _podman(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def _build() -> str:
    """Build with the checked-in script; returns the image reference (its last line of stdout)."""
    t0 = time.monotonic()
    r = subprocess.run(
        ["bash", "scripts/build_image.sh"], cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, f"scripts/build_image.sh exited {r.returncode} after {took:.0f}s:\n{r.stderr[-6000:]}"
    print(f"image built in {took:.0f}s")  # shown with -s, and in CI's log on failure
    return r.stdout.strip().splitlines()[-1]


def _wait_ready(base: str, container: str) -> None:
    """Poll the router's /v1/models until it lists the model; fail early if the container died."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{base}/v1/models", timeout=5)
            if r.status_code == 200 and r.json().get("data"):
                return
        except httpx.HTTPError:
            pass
        state = _podman("inspect", "--format", "{{.State.Running}}", container).stdout.strip()
        if state != "true":
            logs = _podman("logs", container, check=False)
            raise AssertionError(f"container stopped before the router was ready:\n{logs.stdout}\n{logs.stderr}")
        time.sleep(2)
    logs = _podman("logs", container, check=False)
    raise AssertionError(f"router not ready within {READY_TIMEOUT:.0f}s:\n{logs.stdout[-4000:]}\n{logs.stderr[-4000:]}")


@pytest.mark.timeout(BUILD_TIMEOUT + READY_TIMEOUT + 300)
def test_cpu_image_builds_and_serves_completions_from_the_host() -> None:
    reason = _requirements()
    if reason:
        pytest.skip(reason)
    image = _build()

    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert image.endswith(f":{version}"), image
    labels = _podman(
        "image", "inspect", "--format", '{{index .Labels "org.opencontainers.image.version"}}', image
    ).stdout.strip()
    assert labels == version
    user = _podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip()
    assert user and not user.startswith(("0", "root")), f"image runs as {user!r}"

    port = free_port()
    name = f"pdserve-test-{uuid.uuid4().hex[:8]}"
    base = f"http://127.0.0.1:{port}"
    try:
        # --network host: the router's port is the host's; --host 127.0.0.1 keeps it on loopback only.
        # --read-only: the image needs no writable root (the model is baked in; podman mounts a tmpfs on /tmp).
        _podman(
            "run",
            "-d",
            "--name",
            name,
            *RUN_FLAGS,
            "--network",
            "host",
            "--read-only",
            image,
            "up",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        )
        _wait_ready(base, name)
        with httpx.Client(base_url=base, timeout=120) as client:
            models = client.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == ["pdserve-tiny"], models

            r = client.post(
                "/v1/completions",
                json={"model": "pdserve-tiny", "prompt": "Once upon a time", "max_tokens": 8, "min_tokens": 2},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "text_completion", body
            assert body["choices"][0]["text"].strip(), body
            assert body["usage"]["completion_tokens"] >= 2, body

            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": "pdserve-tiny",
                    "max_tokens": 8,
                    "min_tokens": 2,
                    "messages": [{"role": "user", "content": "Tell me a story."}],
                },
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "chat.completion", body
            message = body["choices"][0]["message"]
            assert message["role"] == "assistant" and message["content"].strip(), body

        # `pdserve up` is the container's PID 1: SIGTERM (podman stop) must stop the cluster cleanly.
        _podman("stop", "--time", "30", name, timeout=60)
        code = _podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip()
        assert code == "0", f"pdserve up exited {code} on SIGTERM:\n{_podman('logs', name, check=False).stderr}"
    finally:
        _podman("rm", "--force", "--time", "5", name, check=False)
