"""The body of `pdserve batch`: validate lines, run the valid ones, append results as they finish.

The watchdog that unblocks the job when a stage dies or a signal comes is `batch_watchdog`.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from pdserve.engine.tokenizer import Tokenizer
from pdserve.node_runtime.node_metrics import served_model_name
from pdserve.openai_api.choices import ChoiceBuilder
from pdserve.tdpipe.cost_table import CostTable
from pdserve.tdpipe.feed import RequestFeed
from pdserve.tdpipe.pipeline import SimStats
from pdserve.tdpipe.runtime.batch_config import BatchConfig
from pdserve.tdpipe.runtime.batch_input import RawLine
from pdserve.tdpipe.runtime.batch_io import result_line
from pdserve.tdpipe.runtime.batch_lengths import LengthPlanner, fit_line
from pdserve.tdpipe.runtime.batch_output import OrderedWriter, ResumeKey
from pdserve.tdpipe.runtime.batch_stream import LineSource
from pdserve.tdpipe.runtime.batch_watchdog import StageWatchdog
from pdserve.tdpipe.runtime.controller import PipeRequest, StageExecutor
from pdserve.tdpipe.runtime.local import run_controller, run_local_pipeline
from pdserve.tdpipe.runtime.profile import build_cost_table, plan_profile
from pdserve.tdpipe.runtime.profile_cache import cached_profiles, default_cache_dir
from pdserve.tdpipe.runtime.stage_worker import StageConfig

if TYPE_CHECKING:
    from tqdm import tqdm


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
    """One batch run: lines are read as the policy pulls them (batch_stream), and every output
    line goes through the ordered writer (batch_output) as soon as its order allows."""

    def __init__(
        self,
        args: BatchConfig,
        model_dir: str,
        device: dict[str, str],
        tokenizer: Tokenizer,
        max_model_len: int,
        writer: OrderedWriter,
    ) -> None:
        self.args, self.model_dir, self.device, self.tokenizer, self.writer = args, model_dir, device, tokenizer, writer
        if args.num_kv_blocks is None:
            raise ValueError("a batch job runs on a resolved --num-kv-blocks (batch_main resolves it)")
        self.num_kv_blocks: int = args.num_kv_blocks
        self.model_name = args.served_model_name or served_model_name(model_dir)
        self.builder = ChoiceBuilder(tokenizer, lambda: max_model_len, defaults=args.sampling_defaults)
        self.progress: tqdm | None = None
        self.watchdog: StageWatchdog | None = None
        self.executor: StageExecutor | None = None
        """The running pipeline's executor, once it exists; `executor.gauge` is its live view."""
        self.source: LineSource | None = None
        self.completed = 0
        self.table_name: str | None = None
        """The cost table the policy planned on (set once the job starts)."""
        self.profile_seconds = 0.0
        """Time spent profiling the stages for the cost table (0 for a given table)."""
        self.profile_reused = False
        """The profile came from the cache (`profile_cache`): profile_seconds is only its loading."""
        self.lengths = LengthPlanner()
        """The planner's output-length predictions (`--length-predictor`; batch_main sets it)."""

    @property
    def written(self) -> int:
        return self.writer.written

    @property
    def errors(self) -> int:
        return self.source.errors if self.source else 0

    @property
    def skipped(self) -> int:
        return self.source.skipped if self.source else 0

    def _write(self, row: dict) -> None:
        assert self.source is not None
        self.writer.put(self.source.release(row["custom_id"]), row)

    def _phase(self, phase: str) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(phase, refresh=False)

    def _source(self, lines: Iterator[RawLine], done: set[ResumeKey]) -> LineSource:
        # PP's virtual engines each own 1/stages of the pool, and a request must fit one of them
        share = self.args.stages if self.args.policy.startswith("pp") else 1
        bar = self.progress
        return LineSource(
            lines,
            self.builder,
            self.tokenizer,
            self.model_name,
            self.writer,
            done,
            window=self.args.max_lines_in_flight,
            capacity=self.num_kv_blocks // share * self.args.block_size,
            kv_hint=" per virtual engine" if share > 1 else "",
            on_skip=(lambda: bar.update(1)) if bar is not None else None,
            fit=fit_line,
            predict=lambda item: self.lengths.predict([item], self.tokenizer)[0],
        )

    def run(self, lines: Iterator[RawLine], done: set[ResumeKey]) -> tuple[SimStats, list]:
        """Run the job; exceptions from the pipeline propagate (finished lines stay written)."""
        self._phase("validating")
        self.source = self._source(lines, done)
        items = self.source.items
        reqs = RequestFeed(self.source.pull, self.args.max_lines_in_flight)
        if not reqs:  # reads lines until one can run: a job of error lines starts no stage
            return SimStats(self.args.policy), []
        self._phase("starting stages")

        def on_finish(req: PipeRequest) -> None:
            stop = req.stopped or (req.output_ids and req.output_ids[-1] in req.stop_token_ids)
            reason = "stop" if stop else "length"
            self._write(
                result_line(items[str(req.request_id)], req.output_ids, reason, self.tokenizer, self.model_name)
            )
            self.completed += 1

        def on_executor(executor: StageExecutor) -> None:
            executor.decisions = deque(maxlen=64)  # type: ignore[assignment]  # the log is per batch: unbounded
            self.executor = executor  # metrics read executor.gauge (phase, tokens, bubble) and .stats
            if self.watchdog is not None:
                self.watchdog.executor = executor

        cfg = StageConfig(
            self.model_dir,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.args.block_size,
            dtype=self.args.dtype,
            num_threads=self.args.num_threads,
            init_timeout=self.args.init_timeout,
            tensor_parallel_size=self.args.tensor_parallel_size,
            phase_split=self.args.split_by_phase,
            device=self.device["device"],
            attention_backend=self.device["attention_backend"],
        )
        external = self.args.external_stages
        table = self.cost_table(cfg, list(reqs), external)  # planned on the first window of lines
        # external stages join on their own; local ones are started (and watched) by the launcher
        on_spawn = self.watchdog.watch if self.watchdog else None
        run = run_controller if external else functools.partial(run_local_pipeline, on_spawn=on_spawn)
        stats, timelines = run(
            cfg,
            self.args.stages,
            reqs,
            self.args.max_batch_tokens,
            on_finish,
            policy=self.args.policy,
            table=table,
            on_executor=on_executor,
            on_stall=self.watchdog.stage_stalled if self.watchdog else None,
            heartbeat_timeout=self.args.heartbeat_timeout,
        )
        if items:  # read and never answered: a job that lost lines must not end as a success
            lost = ", ".join(sorted(items)[:5])
            raise RuntimeError(
                f"the {self.args.policy} policy ended with {len(items)} line(s) read but never run ({lost}"
                f"{', ...' if len(items) > 5 else ''}): a bug; rerun with --resume to answer them"
            )
        return stats, timelines

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
        cache = None if self.args.profile_cache == "off" else Path(self.args.profile_cache or default_cache_dir())
        profiles, cached = cached_profiles(
            cfg.model_dir,
            self.args.stages,
            plan,
            cache,
            block_size=cfg.block_size,
            num_threads=cfg.num_threads,
            dtype=cfg.dtype,
            attention_backend=cfg.attention_backend,
            device=cfg.device,
            repeats=1,
            phase_split=cfg.phase_split,
        )
        table = build_cost_table(profiles, "profiled", decode_max=plan.decode_max)
        self.profile_seconds = time.perf_counter() - t0
        self.profile_reused = cached is not None
        if cached is not None:
            print(
                f"cost table: reused the stage profile cached in {cached} (--profile-cache off re-profiles)",
                file=sys.stderr,
            )
        else:
            print(
                f"cost table: profiled {self.args.stages} stage(s) at {len(plan.decode_batches)} decode and "
                f"{len(plan.prefill_tokens)} prefill points in {self.profile_seconds:.1f} s (cached for reruns; "
                f"--cost-table analytic or a CSV skips this)",
                file=sys.stderr,
            )
        self.table_name = table.name
        return table


def external_world(stages: int | None) -> int:
    """For `--external-stages`: check the torch.distributed env names this process rank 0 and
    return the number of stages (WORLD_SIZE - 1); ValueError with what to set otherwise."""
    from pdserve.node_runtime.config import process_env

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
