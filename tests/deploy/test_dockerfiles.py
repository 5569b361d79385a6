"""Both Dockerfiles take the same build arguments, label the version and run as non-root (fast, static).

The CPU Dockerfile is also built and run for real by the slow test_container_image.py; the GPU one is
never built here, so this shape check is all that guards it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pdserve.cli import build_parser

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"
BUILD_ARGS = ("BASE_IMAGE", "TORCH_SPEC", "TORCH_INDEX_URL", "PDSERVE_VERSION")


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_shape(name: str) -> None:
    text = (DOCKER / name).read_text()
    args = set(re.findall(r"^ARG (\w+)", text, re.M))
    assert set(BUILD_ARGS) <= args, f"{name} lacks build args {set(BUILD_ARGS) - args}"
    assert re.search(r"^ARG BASE_IMAGE=\S+\nFROM \$\{BASE_IMAGE\}", text, re.M), "FROM must use BASE_IMAGE"
    # torch comes from TORCH_SPEC/TORCH_INDEX_URL, and before the project (so nothing pulls another build)
    torch_line = text.index('pip install "${TORCH_SPEC}"')
    project_line = re.search(r'pip install (--no-deps )?"?\.', text)
    assert project_line and torch_line < project_line.start(), name
    assert 'org.opencontainers.image.version="${PDSERVE_VERSION}"' in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"{name} runs as {users}"
    assert re.search(r'^ENTRYPOINT \["pdserve"\]', text, re.M)


def test_cpu_image_default_command_publishes_the_router() -> None:
    """`docker run -p 8000:8000 IMAGE` must reach the router: its default command binds 0.0.0.0."""
    text = (DOCKER / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])", text, re.M)
    assert cmd and '"up", "--host", "0.0.0.0"' in cmd.group(1)
    args = build_parser().parse_args(["up", "--host", "0.0.0.0"])
    assert args.host == "0.0.0.0" and args.port == 8000
    assert build_parser().parse_args(["up"]).host == "127.0.0.1"  # outside a container: loopback only
