"""The generated protobuf code in pdserve/v1 must match proto/ (run `make proto`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_proto_field_has_a_comment() -> None:
    """The wire contract documents every field (a comment line right above it)."""
    for proto in sorted((ROOT / "proto" / "pdserve" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = (
                stripped.endswith(";") and "=" in stripped and not stripped.startswith(("syntax", "option", "//"))
            )
            if is_field:
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {stripped}"
