"""What the last pipeline stage does after its layers: sample each sequence and end it on a stop string.

The last stage samples with the engine's own `Sampler` (so a batch job samples exactly as the
engine does) and watches the detokenized output of requests with stop strings with the engine's
own `StopStringChecker`: a request ends on the token that completes a stop string, as in
`engine.llm_engine` and the decode node, so no compute is spent past it and `completion_tokens`
equals what the HTTP API reports for the same request.

Structured-output requests sample through their grammar's matcher (`engine.grammar_cache`, the
engine's masks), and end on the token that completes the grammar, as the engine ends them.

It answers the controller with one `[2, num_seqs]` tensor: row `TOKEN_ROW` the sampled token
(`NO_TOKEN` where nothing is sampled, a non-final prompt chunk), row `STOP_ROW` 1 where that token
completed a stop string or the request's grammar. A held batch (`StageMessage.hold`) gets no answer
of its own: its sampled rows' columns come first in the next answer (`HeldRows`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.grammar_cache import GrammarCache
from pdserve.engine.sampler import Sampler, make_generator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer

NO_TOKEN = -1
"""What the last stage returns for a sequence that samples nothing (a non-final prompt chunk)."""
TOKEN_ROW, STOP_ROW = 0, 1


def needs_announcing(params: SamplingParams | None) -> bool:
    """Whether the last stage must be told a request's parameters: it samples anything but plain
    greedy argmax (a generator, penalties, a grammar), or it has stop strings to watch."""
    return params is not None and (params.needs_sampler_state or bool(params.stop))


@dataclass(frozen=True)
class StageMessage:
    """The per-batch control message every stage receives from the controller."""

    batch: ForwardBatch
    new_params: dict[str, tuple[SamplingParams, list[int]]] = field(default_factory=dict)
    """Sampling parameters and prompt ids of requests the last stage has not seen yet; requests
    absent from it, and never announced, are sampled greedily with no stop strings."""
    forget: tuple[str, ...] = ()
    """Requests that ended: the last stage drops their sampling and stop state."""
    hold: bool = False
    """The last stage answers nothing for this batch: it keeps its sampled rows' final hidden states
    and samples them with the next batch that is not held, in one pass of the LM head, whose answer
    carries their tokens first (`HeldRows`). TD-Pipe holds every prefill batch of a phase but the
    last: the decode phase needs all of the phase's first tokens anyway, and the head's weights are
    then read once a phase instead of once a batch (bench: 7.4 ms for one row, 17 ms for 36)."""


class _SampleState:
    """What `pdserve.engine.sampler.Sampler` reads of a request (params, token history, id, grammar)."""

    def __init__(self, request_id: str, params: SamplingParams, prompt_ids: list[int], matcher: Any = None) -> None:
        self.request_id, self.params = request_id, params
        self.prompt_token_ids = prompt_ids
        self.output_token_ids: list[int] = []
        self.matcher = matcher

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


class LastStageSampler:
    """Samples each sequence with its own parameters and seeded generator, and flags the token that
    completes a stop string or a grammar. `model_dir` gives the tokenizer, loaded on the first stop
    string; `grammars` compiles the grammars of structured-output requests (cached by spec: a batch
    file usually repeats one schema)."""

    def __init__(self, model_dir: str | None = None, grammars: GrammarCache | None = None) -> None:
        self.model_dir = model_dir
        self.grammars = grammars
        self.sampler = Sampler()
        self.states: dict[str, _SampleState] = {}
        self.generators: dict[str, torch.Generator] = {}
        self.stops: dict[str, tuple[StopStringChecker, frozenset[int]]] = {}
        """Per request with stop strings: its checker and the token ids that end it anyway (EOS,
        stop_token_ids), which the engine never feeds to the checker."""
        self._tokenizer: Tokenizer | None = grammars.tokenizer if grammars is not None else None
        """Loaded once: the grammar cache's, else from `model_dir` on the first stop string."""

    def _announce(self, rid: str, params: SamplingParams, prompt: list[int]) -> None:
        if params.needs_sampler_state:
            spec = params.structured_outputs
            if spec is not None and self.grammars is None:
                raise ValueError("structured outputs need the model's grammars: LastStageSampler(grammars=...)")
            matcher = None if spec is None or self.grammars is None else self.grammars.matcher(spec)
            self.states[rid] = _SampleState(rid, params, list(prompt), matcher)
            self.generators[rid] = make_generator(params.seed)
        if params.stop:
            if self.model_dir is None:
                raise ValueError("stop strings need the model's tokenizer: LastStageSampler(model_dir)")
            if self._tokenizer is None:
                self._tokenizer = Tokenizer(self.model_dir)
            tok = self._tokenizer
            detok = IncrementalDetokenizer(tok, prompt, params.skip_special_tokens)
            ends = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else frozenset(tok.eos_token_ids)
            )
            self.stops[rid] = (StopStringChecker(detok, params.stop, params.include_stop_str_in_output), ends)

    def accept(self, msg: StageMessage) -> None:
        """Take a message's news: drop the requests that ended, learn the new ones' parameters.
        Every message, in order, before any of its rows is sampled."""
        for rid in msg.forget:
            self.states.pop(rid, None)
            self.generators.pop(rid, None)
            self.stops.pop(rid, None)
        for rid, (params, prompt) in msg.new_params.items():
            self._announce(rid, params, prompt)

    def sample(self, request_ids: list[str], logits: torch.Tensor) -> torch.Tensor:
        """[2, len(request_ids)] tokens and stop flags, one per row of logits [len(request_ids), V]
        (the requests' messages already `accept`ed)."""
        out = torch.zeros((2, len(request_ids)), dtype=torch.long)
        if not request_ids:
            return out
        logits = logits.float().cpu()
        states = [self.states.get(rid) for rid in request_ids]
        if all(s is None for s in states):  # all greedy: one argmax
            out[TOKEN_ROW] = logits.argmax(dim=-1)
        else:
            greedy = _SampleState("", SamplingParams(temperature=0.0), [])
            picked = self.sampler(logits, [s or greedy for s in states], self.generators)  # type: ignore[misc]
            for i, (s, (token, _)) in enumerate(zip(states, picked)):
                out[TOKEN_ROW, i] = token
                if s is not None:
                    s.output_token_ids.append(token)
                    if s.matcher is not None and s.matcher.is_terminated():  # the grammar is complete
                        out[STOP_ROW, i] = 1
        for i, rid in enumerate(request_ids):
            watch = self.stops.get(rid)
            if watch is not None:
                checker, ends = watch
                token = int(out[TOKEN_ROW, i])
                # as engine.llm_engine._append_token: a token that ends the request anyway is not text
                if token not in ends and checker.check(token):
                    out[STOP_ROW, i] = 1
        return out


HEAD_ROWS = 256
"""The most rows one pass of the LM head takes when held rows are sampled: their logits are
[rows, vocab] (128 MB in float32 at a 128k vocabulary), and 256 rows already read the head's
weights ~256 times less often than a pass per row."""


class HeldRows:
    """The last stage's sampled rows of held batches (`StageMessage.hold`): their final hidden
    states wait here for the next batch that is not held, which samples them with its own rows in
    passes of the LM head of up to `HEAD_ROWS` rows. Bounded by what the controller holds: one
    prefill phase's prompts, one hidden row each."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.hidden: list[torch.Tensor] = []

    def step(
        self,
        msg: StageMessage,
        final_hidden: torch.Tensor,
        logits: Callable[[torch.Tensor], torch.Tensor],
        sampler: LastStageSampler,
    ) -> torch.Tensor | None:
        """One batch's final hidden states [num_sampled, H] (`ModelRunner.run(head=False)`): None
        for a held batch, else the answer [2, num_held + num_seqs], the held rows' tokens and stop
        flags first (in the order their batches came), then this batch's as `LastStageSampler`
        gives them. `logits` is the runner's head."""
        sampler.accept(msg)
        batch = msg.batch
        own = [i for i, sample in enumerate(batch.sample_mask) if sample]
        self.request_ids += [batch.request_ids[i] for i in own]
        self.hidden.append(final_hidden)
        if msg.hold:
            return None
        ids, rows = self.request_ids, torch.cat(self.hidden)
        self.request_ids, self.hidden = [], []
        held = len(ids) - len(own)
        out = torch.zeros((2, held + batch.num_seqs), dtype=torch.long)
        out[TOKEN_ROW] = NO_TOKEN
        if ids:  # in pieces of HEAD_ROWS: a phase of thousands of prompts must not make one huge logits
            sampled = torch.cat(
                [
                    sampler.sample(ids[i : i + HEAD_ROWS], logits(rows[i : i + HEAD_ROWS]))
                    for i in range(0, len(ids), HEAD_ROWS)
                ],
                dim=1,
            )
            out[:, :held] = sampled[:, :held]
            out[:, [held + i for i in own]] = sampled[:, held:]
        return out
