"""The body of `pdserve batch`: validate lines, run the valid ones, append results as they finish."""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from engine.tokenizer import Tokenizer
from tdpipe.runtime.batch_io import LineError, custom_id_of, error_line, make_server, parse_line, result_line
from tdpipe.pipeline import SimStats
from tdpipe.runtime.controller import PipeRequest
from tdpipe.runtime.local import run_local_pipeline
from tdpipe.runtime.stage_worker import StageConfig


class BatchJob:
    """One batch run: error lines are written at once, results as the pipeline retires requests."""

    def __init__(self, args: argparse.Namespace, model_dir: str, device: str, tokenizer: Tokenizer,
                 max_model_len: int, out: TextIO) -> None:
        self.args, self.model_dir, self.device, self.tokenizer, self.out = args, model_dir, device, tokenizer, out
        self.model_name = model_dir.rstrip("/").rsplit("/", 1)[-1]
        self.server = make_server(tokenizer, self.model_name, max_model_len)
        self.progress = None
        self.written = self.completed = self.errors = self.skipped = 0
        self._tokens = 0
        self._phase_name = ""

    def _write(self, obj: dict) -> None:
        self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.out.flush()  # a killed job keeps every finished line (--resume relies on it)
        self.written += 1
        if self.progress is not None:
            self.progress.update(1)

    def _phase(self, phase: str) -> None:
        self._phase_name = phase
        if self.progress is not None:
            self.progress.set_postfix_str(phase, refresh=False)

    def run(self, lines: list[str], done: set[str]) -> tuple[SimStats, list]:
        items, seen, capacity = {}, set(done), self.args.num_kv_blocks * self.args.block_size
        self._phase("validating")
        for line in lines:
            cid = custom_id_of(line)
            if cid is not None and cid in done:
                self.skipped += 1
                if self.progress is not None:
                    self.progress.update(1)
                continue
            try:
                if cid is not None and cid in seen:
                    raise LineError("duplicate_custom_id", f"custom_id {cid!r} appears more than once")
                item = parse_line(line, self.server)
                need = len(item.choice.prompt_ids) + item.choice.params.max_tokens
                if need > capacity:
                    raise LineError("prompt_too_long", f"prompt + max_tokens is {need} tokens; the pipeline's KV "
                                                       f"holds {capacity} (--num-kv-blocks x --block-size)")
            except LineError as e:
                if cid is not None:
                    seen.add(cid)
                self.errors += 1
                self._write(error_line(cid, e.code, str(e)))
                continue
            seen.add(item.custom_id)
            items[item.custom_id] = item
        stops = frozenset(self.tokenizer.eos_token_ids)
        reqs = [PipeRequest(cid, it.choice.prompt_ids, it.choice.params.max_tokens,
                            frozenset() if it.body.ignore_eos else stops) for cid, it in items.items()]
        if not reqs:
            return SimStats(self.args.policy), []
        self._phase(f"running {len(reqs)} on {self.args.stages} stages")

        def on_finish(req: PipeRequest) -> None:
            reason = "stop" if req.output_ids and req.output_ids[-1] in req.stop_token_ids else "length"
            self._tokens += len(req.output_ids)
            self._write(result_line(items[req.request_id], req.output_ids, reason, self.tokenizer, self.model_name))
            self.completed += 1
            if self.progress is not None:
                rate = self._tokens / max(self.progress.format_dict["elapsed"], 1e-9)
                self.progress.set_postfix_str(f"{self._phase_name} | {rate:.1f} out tok/s", refresh=False)

        cfg = StageConfig(self.model_dir, num_kv_blocks=self.args.num_kv_blocks, block_size=self.args.block_size,
                          device=self.device)
        return run_local_pipeline(cfg, self.args.stages, reqs, self.args.max_batch_tokens, on_finish,
                                  policy=self.args.policy)
