"""`pdserve simulate` prints the report, writes the plot and rejects bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.cli import main


def test_simulate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "kv.png"
    rc = main(["simulate", "--table", "analytic", "--requests", "80", "--capacity-blocks", "800", "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0
    for policy in ("td-pipe", "pp+sb", "pp+hb"):
        assert f"{policy}: " in out
    assert "phase switches" in out and "KV usage:" in out and "bubble" in out
    assert png.stat().st_size > 1000


def test_simulate_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--table", "no-such-table"]) == 2
    assert "unknown cost table" in capsys.readouterr().err
    assert main(["simulate", "--table", "analytic", "--stages", "0"]) == 2
    assert "num_stages" in capsys.readouterr().err
    assert main(["simulate", "--table", "analytic", "--policy", "vllm", "--requests", "5"]) == 2
    assert "unknown policy" in capsys.readouterr().err
