"""LLM: offline batch generation on top of LLMEngine."""

from __future__ import annotations

import itertools
from typing import cast
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import CompletionOutput, RequestOutput
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import cut_at_stop


class LLM:
    """`LLM(model_dir).generate(prompts, SamplingParams(...))` -> list[RequestOutput], in input order.

    `model_dir=None` uses the built-in tiny model. Extra keyword arguments go to EngineConfig.
    """

    def __init__(self, model_dir: str | Path | None = None, **engine_kwargs) -> None:
        if model_dir is None:
            from pdserve.engine.builtin import default_model_dir

            model_dir = default_model_dir()
        self.engine = LLMEngine(EngineConfig(model_dir=model_dir, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks, if any (the object is unusable after)."""
        self.engine.close()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt (text or token ids)
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, [p if isinstance(p, str) else None for p in prompts], params, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        conversations = cast("list[list[dict]]", [messages] if messages and isinstance(messages[0], dict) else messages)
        token_lists = [self.tokenizer.encode_chat(c, add_generation_prompt) for c in conversations]
        return self._run(token_lists, [None] * len(token_lists), sampling_params or SamplingParams(), False)

    def _run(
        self, token_lists: list[list[int]], texts: list[str | None], params: SamplingParams, use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.engine
        seqs: dict[str, tuple[int, int]] = {}
        added: list[str] = []
        try:
            for i, ids in enumerate(token_lists):
                for j in range(params.n):
                    rid = f"llm-{next(self._ids)}"
                    # n > 1 with a seed: give each sample its own stream
                    p = params if params.seed is None or j == 0 else _with_seed(params, params.seed + j)
                    engine.add_request(rid, ids, p)
                    added.append(rid)
                    seqs[rid] = (i, j)
        except ValueError:
            for rid in added:
                engine.abort(rid)
            engine.step()  # flush the abort notices
            raise
        want_lp = params.logprobs is not None
        results = {rid: CompletionOutput(j, "", [], [] if want_lp else None, None) for rid, (_, j) in seqs.items()}
        cached = [0] * len(token_lists)
        progress = _progress(len(seqs), use_tqdm)
        pending = len(seqs)
        while pending:
            assert engine.has_unfinished_requests(), "engine idle with unfinished requests"
            for out in engine.step():
                comp = results[out.request_id]
                comp.token_ids += out.new_token_ids
                if comp.logprobs is not None and out.new_logprobs:  # a list exactly when logprobs are wanted
                    comp.logprobs += out.new_logprobs
                if out.finished:
                    comp.finish_reason = out.finish_reason
                    comp.text = self._text(comp.token_ids, params)
                    i = seqs[out.request_id][0]
                    cached[i] = max(cached[i], out.num_cached_tokens)
                    progress.update(1)
                    pending -= 1
        progress.close()
        outputs = []
        for i, ids in enumerate(token_lists):
            comps = sorted((c for rid, c in results.items() if seqs[rid][0] == i), key=lambda c: c.index)
            outputs.append(RequestOutput(f"{i}", texts[i], ids, comps, cached[i]))
        return outputs

    def _text(self, token_ids: list[int], params: SamplingParams) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
        cut = cut_at_stop(text, params.stop, params.include_stop_str_in_output)
        return text if cut is None else cut


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


class _NoProgress:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total, desc="generate")
