"""`pdserve batch` end to end on the input/output side: http(s) input and output with Prometheus
scraped during the job, input order after SIGKILL + `--resume`, a second job on one output, and a
200k-line input through a bounded window (peak RSS reported).

Servers bind 127.0.0.1 on free ports; every test stops what it started and polls with deadlines.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import time
import urllib.request

import pytest

from tests.e2e.router_cluster import free_port
from tests.tdpipe.batch_helpers import (
    PROMPTS,
    START_TIMEOUT,
    batch_cmd,
    kill_job,
    read_results,
    request_line,
    texts_by_id,
)


class _Store(http.server.BaseHTTPRequestHandler):
    """GET serves `files`, PUT stores into it; the first PUT of each path fails with 503 (retried)."""

    files: dict[str, bytes] = {}
    refused: set[str] = set()

    def do_GET(self) -> None:  # noqa: N802
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def do_PUT(self) -> None:  # noqa: N802
        data = self.rfile.read(int(self.headers["Content-Length"]))
        first = self.path not in self.refused
        self.refused.add(self.path)
        if not first:
            self.files[self.path] = data
        self.send_response(503 if first else 201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def store():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    _Store.files, _Store.refused = {}, set()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Store.files
    server.shutdown()
    server.server_close()


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            return r.read().decode()
    except OSError:
        return None


def _value(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_url_input_and_output_with_metrics_during_the_job(tmp_path, store, batch_expected) -> None:
    base, files = store
    lines = [request_line(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    lines.insert(2, "[" * 10_000)  # a poison line in the middle: one error line, the job goes on
    files["/in.jsonl"] = ("\n".join(lines) + "\n").encode()
    port = free_port()
    cmd = batch_cmd(tmp_path, "--cost-table", "analytic", "--local-output-dir", str(tmp_path))
    cmd[cmd.index("-i") + 1], cmd[cmd.index("-o") + 1] = f"{base}/in.jsonl", f"{base}/results/out.jsonl"
    proc = subprocess.Popen(
        cmd + ["--enable-metrics", "--url", "127.0.0.1", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    scrapes = []
    deadline = time.monotonic() + START_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        text = _scrape(port)
        if text is not None and proc.poll() is None:
            scrapes.append(text)
        time.sleep(0.2)
    kill_job(proc)
    assert proc.returncode == 0, proc.stderr.read()
    rows = [json.loads(x) for x in files["/results/out.jsonl"].split(b"\n") if x]
    assert [r["custom_id"] for r in rows] == ["r0", "r1", None, "r2", "r3", "r4", "r5"]  # input order
    assert texts_by_id(rows) == batch_expected
    assert {r["response"]["body"]["model"] for r in rows if r["response"]} == {"pdserve-tiny"}
    assert not list(tmp_path.glob("pdserve-batch-*.jsonl")), "the local copy is removed once uploaded"
    assert scrapes, "no scrape answered while the job ran"
    lacking = [s for s in scrapes if "pdserve_batch_phase{" not in s or "pdserve_batch_bubble_fraction{" not in s]
    assert not lacking, (
        f"{len(lacking)} of {len(scrapes)} scrapes lack the phase or bubble series; one:\n{lacking[0][:4000]}"
    )
    done = [_value(s, "pdserve_batch_requests_done_total") for s in scrapes]
    assert done == sorted(done) and done[-1] <= len(PROMPTS)
    assert _value(scrapes[-1], "pdserve_batch_requests_failed_total") <= 1


def test_input_order_after_sigkill_and_resume_and_a_second_job_refused(tmp_path) -> None:
    # early lines long, later ones short: completion order differs from input order throughout; the
    # 300-token tail keeps the first job running while the second starts (on 2 loaded cores the
    # second's start-up took longer than the first six requests)
    lengths = [10, 2, 200, 2, 300, 2] + [300] * 24
    ids = [f"r{i}" for i in range(len(lengths))]
    lines = [request_line(c, PROMPTS[i % len(PROMPTS)], max_tokens=n) for i, (c, n) in enumerate(zip(ids, lengths))]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = batch_cmd(tmp_path, "--cost-table", "analytic", "--num-kv-blocks", "256")
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline and not out.exists():
            time.sleep(0.05)
        # the first job holds the output's lock from before its stages start
        second = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "another `pdserve batch` job" in second.stderr, second.stderr
        while proc.poll() is None and time.monotonic() < deadline and not out.read_bytes():
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
    finally:
        kill_job(proc)
    first = [r["custom_id"] for r in read_results(out)]
    assert 0 < len(first) < len(ids) and first == ids[: len(first)]
    resumed = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["custom_id"] for r in read_results(out)] == ids  # input order, each exactly once


@pytest.mark.slow  # 10-25 minutes on 2 loaded cores: 200,000 lines through the tiny model's 2-stage pipeline
@pytest.mark.timeout(3600)
def test_200k_lines_run_in_bounded_memory(tmp_path) -> None:
    psutil = pytest.importorskip("psutil")
    n = 200_000
    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(n):
            f.write(request_line(f"r{i}", PROMPTS[i % len(PROMPTS)], max_tokens=1) + "\n")
    out = tmp_path / "out.jsonl"
    cmd = batch_cmd(
        tmp_path, "--cost-table", "analytic", "--max-lines-in-flight", "1024", "--stats", str(tmp_path / "s.json")
    )
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, start_new_session=True)
    me, samples = psutil.Process(proc.pid), []  # (output bytes written, RSS of the controller)
    try:
        while proc.poll() is None:
            try:
                samples.append((out.stat().st_size if out.exists() else 0, me.memory_info().rss))
            except psutil.NoSuchProcess:
                break
            time.sleep(0.5)
    finally:
        kill_job(proc)
    assert proc.returncode == 0
    assert sum(1 for _ in open(out, "rb")) == n
    peak = max(rss for _, rss in samples)
    early = max(rss for written, rss in samples if written < out.stat().st_size // 10)
    print(f"\n200k lines: controller peak RSS {peak / 2**20:.0f} MiB, {early / 2**20:.0f} MiB in the first 10%")
    # memory does not grow with the lines read: the last 90% add little to the first 10%'s peak
    assert peak - early < 200 * 2**20


def test_url_errors_are_clear(tmp_path, store, capsys) -> None:
    from pdserve.cli import main
    from pdserve.tdpipe.runtime.batch_url import upload

    base, files = store
    cmd = batch_cmd(tmp_path)[3:]
    cmd[cmd.index("-i") + 1] = f"{base}/missing.jsonl"
    assert main(cmd) == 2
    assert f"GET {base}/missing.jsonl: HTTP 404" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()  # nothing locked or written for an unreadable input
    (tmp_path / "r.jsonl").write_text("{}\n")
    with pytest.raises(OSError, match=f"PUT {base}/o.jsonl: HTTP 503.*stay in"):
        upload(str(tmp_path / "r.jsonl"), f"{base}/o.jsonl", attempts=1)
    upload(str(tmp_path / "r.jsonl"), f"{base}/o.jsonl", attempts=2, backoff_s=0.01)  # the retry lands
    assert files["/o.jsonl"] == b"{}\n"
