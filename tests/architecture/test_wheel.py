"""`pip install pdserve` puts one package at the top of site-packages, and the wheel carries what the
code reads at run time (kernel sources, the corpus of the built-in model, templates, the protos)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from import_graph import ROOT


def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    # built from a copy, so that setuptools' build/ and egg-info stay out of the checkout
    src = tmp_path / "src"
    shutil.copytree(ROOT / "pdserve", src / "pdserve", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        check=True,
        cwd=tmp_path,
        timeout=240,
    )
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"pdserve"}
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:  # setuptools writes it; it must name the one package
        assert zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["pdserve"]
    # every source file the tree holds under pdserve/ that the code reads is in the wheel
    wanted = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "pdserve").rglob("*")
        if p.is_file() and p.suffix in {".py", ".cpp", ".h", ".txt", ".jinja"} and "__pycache__" not in p.parts
    ]
    missing = sorted(set(wanted) - set(names))
    assert not missing, f"left out of the wheel: {missing[:10]}"
    assert "pdserve/v1/decode_pb2.py" in names and "pdserve/engine/kernels/csrc/cpu_paged_attention.cpp" in names
