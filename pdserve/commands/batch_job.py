"""The body of `pdserve batch`: validate lines, run the valid ones, append results as they finish.

Also the job's watchdog: gloo cannot poll or cancel a receive, so the main thread can sit in a
blocking wait when a stage dies or a signal arrives. A second thread watches the stage processes
and the signals (through `signal.set_wakeup_fd`, written by the C-level handler even while the
main thread is blocked), stops the stages so that the blocked receive fails, and as a last resort
ends the process itself: every finished result is already flushed, so `--resume` loses nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import TextIO

from engine.tokenizer import Tokenizer
from tdpipe.runtime.batch_io import LineError, custom_id_of, error_line, make_server, parse_line, result_line
from pdserve.runtime.convert import params_from_pb
from tdpipe.cost_table import CostTable
from tdpipe.pipeline import SimStats
from tdpipe.runtime.controller import PipeRequest, StageExecutor
from tdpipe.runtime.local import run_controller, run_local_pipeline
from tdpipe.runtime.profile import plan_profile, profiled_table
from tdpipe.runtime.stage_worker import StageConfig

ResumeKey = tuple[str, object]
"""("id", custom_id) or ("line", 1-based input line number): see batch_io.resume_key."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STAGE_TERM_GRACE_S = 5.0
"""A stage that ignores SIGTERM this long is SIGKILLed."""
HARD_EXIT_GRACE_S = 20.0
"""After a stage died or a signal came, how long the main thread may stay blocked before the
watchdog ends the process (results are flushed line by line, so nothing is lost)."""


def describe_exit(rank: int, pid: int, code: int | None) -> str:
    """`stage rank 2 (pid 123) was killed by SIGKILL` / `... exited with code 1` (code as Popen's)."""
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"stage rank {rank} (pid {pid}) {how}"


def _wait_exit(proc: subprocess.Popen) -> int | None:
    """Block until `proc` exits, without reaping it (Popen still owns that); its Popen-style code."""
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:  # already reaped by Popen (in another thread): wait() returns its code
        return proc.wait()
    if info is None:
        return proc.poll()
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


class StageWatchdog:
    """Watches the local stage processes and SIGINT/SIGTERM on behalf of a blocked main thread.

    Use from the main thread: `install()` before the pipeline starts, `watch(procs)` once the
    stages exist, `close()` when the job returns (always, in a finally).
    """

    def __init__(self, progress=None) -> None:
        self.procs: list[subprocess.Popen] = []
        self.dead: list[str] = []
        """Stages seen exited before the job ended, in the order they were noticed."""
        self.signum: int | None = None
        self.executor: StageExecutor | None = None
        self.progress = progress
        self._done = threading.Event()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._old_wakeup = -1
        self._old_handlers: dict[int, object] = {}
        self._trouble_since: float | None = None
        self._lock = threading.Lock()
        self._last_refresh = 0.0
        self._thread = threading.Thread(target=self._loop, name="batch-watchdog", daemon=True)

    def install(self) -> None:
        self._old_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        self._thread.start()

    def watch(self, procs: list[subprocess.Popen]) -> None:
        """Record each stage's exit the moment it happens (one waiter thread per stage): the launcher
        kills the survivors right after a failure, and only the order of exits names the culprit."""
        self.procs = list(procs)
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._waiter, args=(rank, proc), name=f"stage-{rank}-exit", daemon=True).start()

    def _waiter(self, rank: int, proc: subprocess.Popen) -> None:
        code = _wait_exit(proc)
        if code != 0:  # 0 comes only after the controller's shutdown message: not a failure
            with self._lock:
                self.dead.append(describe_exit(rank, proc.pid, code))

    def _on_signal(self, signum: int, frame) -> None:
        # Runs in the main thread whenever it gets back to Python: unwinds the job from there.
        self.signum = self.signum or signum
        raise KeyboardInterrupt

    def close(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._refresh_progress(force=True)  # the bar's last line shows the final rate
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        os.close(self._rfd)
        os.close(self._wfd)

    def wait_for_dead(self, timeout: float) -> list[str]:
        """The dead stages, waiting up to `timeout` s for one to show: a stage's connection can
        close a moment before its process is reaped, so the first error may come before its exit."""
        deadline = time.monotonic() + timeout
        while not self.dead and self.procs and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            return list(self.dead)

    def _terminate_stages(self) -> None:
        live = [p for p in self.procs if p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.monotonic() + STAGE_TERM_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    def _loop(self) -> None:
        while not self._done.is_set():
            ready, _, _ = select.select([self._rfd], [], [], 0.25)
            if ready:
                for byte in os.read(self._rfd, 64):
                    if byte in STOP_SIGNALS and self.signum is None:
                        self.signum = byte
            if self._done.is_set():
                return
            if (self.signum is not None or self.dead) and self._trouble_since is None:
                self._trouble_since = time.monotonic()
                # A signal: stop the stages now, so a receive the main thread is blocked in fails
                # and the main thread gets back to Python (where the signal handler unwinds it).
                # A dead stage: the others are blocked on it; stopping them fails that receive too.
                self._terminate_stages()
            self._refresh_progress()
            if self._trouble_since is not None and time.monotonic() - self._trouble_since > HARD_EXIT_GRACE_S:
                self._hard_exit()

    def _refresh_progress(self, force: bool = False) -> None:
        """Phase and output tok/s even while no request finishes (a long decode phase); at most once
        per the bar's mininterval, which is long when stderr is a log rather than a terminal."""
        bar, ex, now = self.progress, self.executor, time.monotonic()
        if bar is None or ex is None or (now - self._last_refresh < bar.mininterval and not force):
            return
        self._last_refresh = now
        elapsed = max(bar.format_dict.get("elapsed", 0.0), 1e-9)
        decisions = ex.decisions  # the phase of the batch the policy submitted last
        phase = decisions[-1][0] if decisions else "starting"
        bar.set_postfix_str(f"{phase} | {ex.stats.output_tokens / elapsed:.1f} out tok/s", refresh=True)

    def _hard_exit(self) -> None:
        self._terminate_stages()
        if self.signum is not None:
            why, code = f"stopped by {signal.Signals(self.signum).name}", 128 + self.signum
        else:
            why, code = "; ".join(self.dead), 1
        os.write(
            2,
            f"\nerror: {why}, and the pipeline did not unwind within {HARD_EXIT_GRACE_S:.0f} s; "
            f"finished results are in the output file: rerun with --resume\n".encode(),
        )
        os._exit(code)


def table_choice(choice: str, device: str, external: bool) -> CostTable | str:
    """What `--cost-table` names: "profile", or a table loaded now (ValueError for an unknown name or
    an unreadable CSV). `auto` profiles local CPU stages; on a GPU, or with stages elsewhere whose
    hardware this process may not share, it takes the GPU-shaped analytic table."""
    choice = choice.strip()
    if choice == "auto":
        choice = "profile" if device == "cpu" and not external else "analytic"
    if choice == "profile":
        if external:
            raise ValueError(
                "--cost-table profile times the stages in this process, but with --external-stages "
                "they run elsewhere: pass a CSV profiled on their hardware, or analytic"
            )
        return choice
    if choice == "analytic":
        return CostTable.analytic()
    if choice.endswith(".csv") or "/" in choice:
        try:
            return CostTable.from_csv(choice)
        except (OSError, KeyError, ValueError) as e:
            raise ValueError(f"--cost-table {choice}: cannot read a `Total Length,Execute Time` table: {e}") from None
    return CostTable.builtin(choice)


class BatchJob:
    """One batch run: error lines are written at once, results as the pipeline retires requests."""

    def __init__(
        self,
        args: argparse.Namespace,
        model_dir: str,
        device: dict[str, str],
        tokenizer: Tokenizer,
        max_model_len: int,
        out: TextIO,
    ) -> None:
        self.args, self.model_dir, self.device, self.tokenizer, self.out = args, model_dir, device, tokenizer, out
        self.model_name = model_dir.rstrip("/").rsplit("/", 1)[-1]
        self.server = make_server(tokenizer, self.model_name, max_model_len)
        self.progress = None
        self.watchdog: StageWatchdog | None = None
        self.written = self.completed = self.errors = self.skipped = 0
        self.table_name: str | None = None
        """The cost table the policy planned on (set once the job starts)."""
        self.profile_seconds = 0.0
        """Time spent profiling the stages for the cost table (0 for a given table)."""

    def _write(self, obj: dict) -> None:
        self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.out.flush()  # a killed job keeps every finished line (--resume relies on it)
        self.written += 1
        if self.progress is not None:
            self.progress.update(1)

    def _phase(self, phase: str) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(phase, refresh=False)

    def plan(self, lines: list[tuple[int, str]], done: set[ResumeKey]) -> dict[str, tuple]:
        """Validate every (line number, text); write error lines; return custom_id -> BatchItem to run."""
        # PP's virtual engines each own 1/stages of the pool, and a request must fit one of them
        share = self.args.stages if getattr(self.args, "policy", "tdpipe").startswith("pp") else 1
        items, claimed = {}, set()
        capacity = self.args.num_kv_blocks // share * self.args.block_size
        for line_no, line in lines:
            cid = custom_id_of(line)
            first = cid is not None and cid not in claimed
            if ("line", line_no) in done or (first and ("id", cid) in done):
                claimed.add(cid)
                self.skipped += 1
                if self.progress is not None:
                    self.progress.update(1)
                continue
            try:
                if cid is not None and not first:
                    raise LineError(
                        "duplicate_custom_id", f"custom_id {cid!r} appears on an earlier line; this line is not run"
                    )
                item = parse_line(line, self.server)
                need = len(item.choice.prompt_ids) + item.choice.params.max_tokens
                if need > capacity:
                    raise LineError(
                        "prompt_too_long",
                        f"prompt + max_tokens is {need} tokens; the pipeline's KV "
                        f"holds {capacity}{' per virtual engine' if share > 1 else ''} "
                        f"(raise --num-kv-blocks or --block-size)",
                        status=400,
                        param="max_tokens",
                    )
            except LineError as e:
                if cid is not None:
                    claimed.add(cid)
                self.errors += 1
                self._write(error_line(cid, e, line_no))
                continue
            claimed.add(item.custom_id)
            items[item.custom_id] = item
        return items

    def run(self, lines: list[tuple[int, str]], done: set[ResumeKey]) -> tuple[SimStats, list]:
        """Run the job; exceptions from the pipeline propagate (finished lines stay written)."""
        self._phase("validating")
        items = self.plan(lines, done)
        eos = frozenset(self.tokenizer.eos_token_ids)
        reqs = []
        for cid, it in items.items():
            params = params_from_pb(it.choice.params)  # the router's wire params, as the nodes convert them
            stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos)
            reqs.append(PipeRequest(cid, it.choice.prompt_ids, it.choice.params.max_tokens, stops, params=params))
        if not reqs:
            return SimStats(self.args.policy), []
        self._phase("starting stages")

        def on_finish(req: PipeRequest) -> None:
            reason = "stop" if req.output_ids and req.output_ids[-1] in req.stop_token_ids else "length"
            self._write(result_line(items[req.request_id], req.output_ids, reason, self.tokenizer, self.model_name))
            self.completed += 1

        def on_executor(executor: StageExecutor) -> None:
            if self.watchdog is not None:
                self.watchdog.executor = executor

        cfg = StageConfig(
            self.model_dir,
            num_kv_blocks=self.args.num_kv_blocks,
            block_size=self.args.block_size,
            dtype=self.args.dtype,
            num_threads=self.args.num_threads,
            **self.device,
        )
        external = getattr(self.args, "external_stages", False)
        table = self.cost_table(cfg, reqs, external)
        if external:
            return run_controller(
                cfg,
                self.args.stages,
                reqs,
                self.args.max_batch_tokens,
                on_finish,
                policy=self.args.policy,
                table=table,
                on_executor=on_executor,
            )
        return run_local_pipeline(
            cfg,
            self.args.stages,
            reqs,
            self.args.max_batch_tokens,
            on_finish,
            policy=self.args.policy,
            table=table,
            on_spawn=self.watchdog.watch if self.watchdog else None,
            on_executor=on_executor,
        )

    def cost_table(self, cfg: StageConfig, reqs: list[PipeRequest], external: bool) -> CostTable:
        """The table the policy plans on (`--cost-table`); profiling times this job's stages here."""
        choice = table_choice(self.args.cost_table, cfg.device, external)
        if isinstance(choice, CostTable):
            self.table_name = choice.name
            return choice
        self._phase("profiling stages")
        t0 = time.perf_counter()
        plan = plan_profile(
            [len(r.prompt_ids) for r in reqs],
            [r.predicted_len for r in reqs],
            kv_tokens=cfg.num_kv_blocks * cfg.block_size,
            num_stages=self.args.stages,
            max_batch_tokens=self.args.max_batch_tokens,
        )
        table = profiled_table(
            cfg.model_dir,
            self.args.stages,
            plan,
            block_size=cfg.block_size,
            num_threads=cfg.num_threads,
            dtype=cfg.dtype,
            attention_backend=cfg.attention_backend,
            device=cfg.device,
            repeats=1,
            name="profiled",
        )
        self.profile_seconds = time.perf_counter() - t0
        print(
            f"cost table: profiled {self.args.stages} stage(s) at {len(plan.decode_batches)} decode and "
            f"{len(plan.prefill_tokens)} prefill points in {self.profile_seconds:.1f} s (--cost-table analytic "
            f"or a CSV skips this)",
            file=sys.stderr,
        )
        self.table_name = table.name
        return table


def external_world(stages: int | None) -> int:
    """For `--external-stages`: check the torch.distributed env names this process rank 0 and
    return the number of stages (WORLD_SIZE - 1); ValueError with what to set otherwise."""
    from pdserve.config import process_env

    env = process_env().rendezvous
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE") if not env.get(v)]
    if missing:
        raise ValueError(
            f"--external-stages needs {', '.join(missing)} in the environment (the rendezvous the "
            f"`pdserve stage` workers use)"
        )
    if env.get("RANK", "0") != "0":
        raise ValueError(
            f"--external-stages runs the controller, which is RANK 0; RANK is {env['RANK']} "
            f"(ranks 1..WORLD_SIZE-1 run `pdserve stage`)"
        )
    try:
        world = int(env["WORLD_SIZE"])
    except ValueError:
        raise ValueError(f"WORLD_SIZE must be an integer, got {env['WORLD_SIZE']!r}") from None
    if world < 2:
        raise ValueError(f"WORLD_SIZE is {world}: it counts the controller plus at least one stage")
    if stages is not None and stages != world - 1:
        raise ValueError(f"--stages {stages} disagrees with WORLD_SIZE {world} (= 1 controller + {world - 1} stages)")
    os.environ["RANK"] = "0"  # for torch.distributed, which this process joins as the controller
    print(
        f"external stages: waiting for {world - 1} `pdserve stage` ranks at {env['MASTER_ADDR']}:{env['MASTER_PORT']}",
        file=sys.stderr,
    )
    return world - 1
