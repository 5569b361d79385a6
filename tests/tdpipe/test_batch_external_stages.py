"""`pdserve batch --external-stages`: rank 0 of `pdserve stage` ranks started elsewhere (the
Kubernetes Indexed Job): same texts as engine.LLM, a remote stage's death, a bad rendezvous env.

Processes listen on 127.0.0.1 only; every test stops what it started and polls with deadlines
(generous: the CI machine has 2 loaded cores), never asserting speed.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.tdpipe.batch_helpers import (
    PROMPTS,
    START_TIMEOUT,
    STOP_TIMEOUT,
    batch_cmd,
    kill_job,
    read_results,
    request_line,
    start_stage_ranks,
    texts_by_id,
)


@pytest.mark.slow  # ~25 s: three processes load torch and the model
def test_batch_external_stages_runs_as_rank_0(tmp_path, tiny_model_dir, batch_expected) -> None:
    """`pdserve stage` ranks started separately (as the Kubernetes Indexed Job does) + `pdserve batch
    --external-stages` as rank 0: same texts as engine.LLM."""
    (tmp_path / "in.jsonl").write_text("\n".join(request_line(f"r{i}", p) for i, p in enumerate(PROMPTS)) + "\n")
    env, stages = start_stage_ranks(tiny_model_dir)
    try:
        proc = subprocess.run(
            batch_cmd(tmp_path, "--external-stages", "--model", str(tiny_model_dir)),
            env=dict(env, RANK="0"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert "stages=2" in proc.stderr  # from WORLD_SIZE
        for s in stages:
            assert s.wait(timeout=STOP_TIMEOUT) == 0  # the controller's shutdown ends them
    finally:
        for s in stages:
            if s.poll() is None:
                s.kill()
                s.wait()
    assert texts_by_id(read_results(tmp_path / "out.jsonl")) == batch_expected


@pytest.mark.slow  # ~30 s: as above, with long requests
def test_batch_external_stages_stops_when_a_remote_stage_dies(tmp_path, tiny_model_dir) -> None:
    """A stage the controller did not start dies mid-job: no hang, exit 1, what was written stays."""
    (tmp_path / "in.jsonl").write_text(
        "\n".join(request_line(f"r{i}", p, max_tokens=2 + 40 * i) for i, p in enumerate(PROMPTS)) + "\n"
    )
    env, stages = start_stage_ranks(tiny_model_dir)
    proc = subprocess.Popen(
        batch_cmd(tmp_path, "--external-stages", "--model", str(tiny_model_dir)),
        env=dict(env, RANK="0"),
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out = tmp_path / "out.jsonl"
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline and not (out.exists() and out.read_text()):
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before the stage could be killed"
        stages[0].kill()  # rank 1: the error reaches the controller through rank 2
        _, err = proc.communicate(timeout=STOP_TIMEOUT)
        assert proc.returncode == 1, err
        assert "check the logs of the `pdserve stage` ranks" in err and "--resume" in err, err
        assert stages[1].wait(timeout=STOP_TIMEOUT) != 0  # the survivor fails too, it does not hang
        assert 0 < len(read_results(out)) < len(PROMPTS)
    finally:
        kill_job(proc)
        for s in stages:
            if s.poll() is None:
                s.kill()
            s.wait()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"MASTER_PORT": "1", "WORLD_SIZE": "3"}, "needs MASTER_ADDR"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "3", "RANK": "1"}, "RANK 0"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "1"}, "at least one stage"),
        ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "3", "PDSERVE_STAGES": "4"}, "disagrees"),
    ],
)
def test_external_stages_refuses_a_bad_rendezvous_env(tmp_path, monkeypatch, capsys, env, message) -> None:
    from pdserve.cli import main

    (tmp_path / "in.jsonl").write_text(request_line("a", "x") + "\n")
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "PDSERVE_STAGES"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert main(batch_cmd(tmp_path, "--external-stages")[3:]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()  # refused before anything is written
