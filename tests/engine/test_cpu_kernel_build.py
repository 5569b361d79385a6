"""The CPU ops' build: once per cache directory however many processes start at once (a file lock),
never half-written (a private directory renamed into place), and it survives a build killed half
way (the debris of torch's builder, including its lock file, must never stall later builds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.kernels import cpu_build

BUILD = "from pdserve.engine.kernels.cpu_build import load_paged_attention_op as b; print('op', b() is not None)"


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on this machine")
def test_build_after_a_killed_build_neither_stalls_nor_keeps_debris(tmp_path: Path):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)}
    env.pop("PDSERVE_NO_CPU_KERNEL", None)
    out = cpu_build.build_dir().relative_to(cpu_build.build_dir().parents[1])  # kernels/<name>
    debris = tmp_path / out
    debris.mkdir(parents=True)
    (debris / "lock").touch()  # what torch's builder leaves when its process is SIGKILLed
    dead = debris.parent / f"{debris.name}.tmp-999999999"  # a private build dir of a dead process
    dead.mkdir()
    done = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "op True" in done.stdout
    assert (debris / "pdserve_cpu_paged.so").exists() and not dead.exists()
    again = subprocess.run([sys.executable, "-c", BUILD], env=env, capture_output=True, text=True, timeout=120)
    assert "op True" in again.stdout, again.stderr[-2000:]


def test_a_compile_leaves_the_cache_key_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """torch's builder appends its libraries to the linker flags it is handed (seen with torch 2.11
    and 2.13; the C flags are mutated here too, in case a version does); the flags are part of
    `build_dir()`'s key, so a process that compiled once must still name the same directory
    afterwards (it named another one, and a second load compiled everything again)."""
    import torch.utils.cpp_extension as cpp_extension

    def load(**kwargs: object) -> None:  # what torch's `load` does to its arguments, without compiling
        kwargs["extra_ldflags"].append("-ltorch")  # type: ignore[attr-defined]
        kwargs["extra_cflags"].append("-DTORCH_EXTENSION_NAME=x")  # type: ignore[attr-defined]

    monkeypatch.setattr(cpp_extension, "load", load)
    before = cpu_build.build_dir()
    cpu_build._compile(tmp_path)
    assert cpu_build.build_dir() == before


def _fake_build(out: str, log: str, delay: float) -> None:
    """One process's `build_once` with a compile that takes `delay` seconds and logs itself."""
    import time

    def compile_into(tmp: Path) -> None:
        with open(log, "a") as f:
            f.write(f"compile {os.getpid()}\n")
        time.sleep(delay)
        (tmp / cpu_build.LIBRARY).write_bytes(b"whole")

    built = cpu_build.build_once(Path(out), compile_into)
    with open(log, "a") as f:
        f.write(f"{'built' if built else 'found'} {(Path(out) / cpu_build.LIBRARY).read_bytes().decode()}\n")


def test_concurrent_build_once_compiles_once_and_never_shows_half_a_build(tmp_path: Path):
    import multiprocessing

    out, log = tmp_path / "kernels" / "ops-abc", tmp_path / "log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_fake_build, args=(str(out), str(log), 0.5)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    lines = log.read_text().splitlines()
    assert sum(line.startswith("compile") for line in lines) == 1, lines
    assert sorted(line for line in lines if not line.startswith("compile")) == ["built whole"] + ["found whole"] * 2
    assert [p.name for p in out.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_failed_build_leaves_nothing_and_the_next_one_compiles(tmp_path: Path):
    out = tmp_path / "kernels" / "ops-abc"

    def broken(tmp: Path) -> None:
        (tmp / "half.o").write_bytes(b"x")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cpu_build.build_once(out, broken)
    assert not out.exists() and not any(".tmp-" in p.name for p in out.parent.iterdir())
    assert cpu_build.build_once(out, lambda tmp: (tmp / cpu_build.LIBRARY).write_bytes(b"ok")) is True
    assert cpu_build.build_once(out, broken) is False  # found: no second compile


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler on this machine")
def test_two_processes_on_an_empty_cache_compile_once(tmp_path: Path):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path)}
    env.pop("PDSERVE_NO_CPU_KERNEL", None)
    code = (
        "import torch; from pdserve.engine.kernels import cpu_build as c; op = c.load_paged_attention_op(); "
        "q = torch.randn(1, 2, 8); kv = torch.randn(1, 2, 2, 4, 8); i = lambda *x: torch.tensor(x, dtype=torch.int32); "
        "out = op(q, kv, i(0).reshape(1, 1), i(0, 1), i(3), 0.35); "
        "print('built', c.built_in_this_process, 'works', bool(torch.isfinite(out).all()))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0 and "works True" in stdout, stderr[-2000:]
    assert sorted(stdout.split()[1] for stdout, _ in outs) == ["False", "True"]


def _static_libstdcxx() -> str | None:
    """libstdc++.a of the C++ compiler, if it has one (an absolute path), else None."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        return None
    found = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) else None


@pytest.mark.slow
@pytest.mark.skipif(_static_libstdcxx() is None, reason="no static libstdc++ for this compiler")
def test_ops_linked_with_a_static_libstdcxx_still_format_their_errors(tmp_path: Path):
    """A toolchain whose g++ links libstdc++ statically into shared objects (a GPU image had one):
    the op's refusals, whose messages hold numbers, must come out whole, not crash the process or
    lose the numbers (the copies' locales mixed while the static copy's symbols were exported)."""
    real = shutil.which(os.environ.get("CXX", "c++"))
    wrapper = tmp_path / "g++"
    wrapper.write_text(
        f'#!/bin/sh\ncase " $* " in *" -shared "*) exec {real} "$@" -static-libstdc++ ;; esac\nexec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(wrapper)}
    env.pop("PDSERVE_NO_CPU_KERNEL", None)
    code = (
        "import torch; from pdserve.engine.kernels import cpu_build as c; op = c.load_paged_attention_op(); "
        "i = lambda *x: torch.tensor(x, dtype=torch.int32)\n"
        "try: op(torch.randn(1, 4, 16), torch.randn(4, 2, 2, 8, 16), i(0, 1).reshape(1, 2), i(0, 1), i(40), 1.0)\n"
        "except RuntimeError as e: print(str(e).splitlines()[0])"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 query tokens and 40 context tokens do not fit its 2 pages of 8" in done.stdout, done.stdout
    library = next((tmp_path / "cache" / "kernels").glob("*/pdserve_cpu_paged.so"))
    needed = subprocess.run(["ldd", str(library)], capture_output=True, text=True).stdout
    assert "libstdc++" not in needed  # the wrapper did link it statically: the case this test is about
