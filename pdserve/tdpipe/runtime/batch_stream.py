"""Input lines to pipeline requests, on demand: the `pull` behind the policy's RequestFeed.

Each line is read, validated and tokenized only when the policy wants work and fewer than
`window` lines are in flight (read, but their output line not yet written). A line that cannot
run gets its error line at once (through the ordered writer, so in its input position); a line
the output already answers (`--resume`) is skipped. Memory is one window of requests plus one
custom_id per line for the duplicate check.
"""

from __future__ import annotations

from typing import Callable, Iterator

from pdserve.engine.tokenizer import Tokenizer
from pdserve.node_runtime.convert import params_from_pb
from pdserve.openai_api.choices import ChoiceBuilder
from pdserve.tdpipe.runtime.batch_input import RawLine, scan_custom_id
from pdserve.tdpipe.runtime.batch_io import BatchItem, LineError, custom_id_in, error_line, load_line, parse_request
from pdserve.tdpipe.runtime.batch_output import OrderedWriter, ResumeKey
from pdserve.tdpipe.runtime.controller import PipeRequest


def fit_capacity(item: BatchItem, capacity: int, where: str = "") -> None:
    """LineError `prompt_too_long` when prompt + max_tokens exceeds the KV one request can hold."""
    request = item.choice.request
    need = len(request.prompt_token_ids) + request.params.max_tokens
    if need > capacity:
        raise LineError(
            "prompt_too_long",
            f"prompt + max_tokens is {need} tokens; the pipeline's KV holds {capacity}{where} "
            f"(raise --num-kv-blocks or --block-size)",
            status=400,
            param="max_tokens",
        )


class LineSource:
    """Validates lines from `lines` into PipeRequests as the policy pulls them (see module doc).

    `capacity` is the KV tokens one request may hold (the pipeline's pool, or a PP virtual
    engine's share); `fit(item, capacity, kv_hint)` refuses (LineError) or adapts a line that does
    not fit it. `predict(item)`, when given, is the output length the planner admits the line on
    (default: its max_tokens).
    """

    def __init__(
        self,
        lines: Iterator[RawLine],
        builder: ChoiceBuilder,
        tokenizer: Tokenizer,
        model_name: str,
        writer: OrderedWriter,
        done: set[ResumeKey],
        *,
        window: int,
        capacity: int,
        kv_hint: str = "",
        on_skip: Callable[[], object] | None = None,
        fit: Callable[[BatchItem, int, str], None] = fit_capacity,
        predict: Callable[[BatchItem], int] | None = None,
    ) -> None:
        self.lines, self.builder, self.model_name, self.writer, self.done = lines, builder, model_name, writer, done
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.window, self.capacity, self.kv_hint, self.on_skip = max(1, window), capacity, kv_hint, on_skip
        self.fit, self.predict = fit, predict
        self.items: dict[str, BatchItem] = {}
        """The lines running now, by custom_id (removed when their result is written)."""
        self._tickets: dict[str, int] = {}
        self._claimed: set[str] = set()
        self.read = self.skipped = self.errors = 0
        self.exhausted = False

    def pull(self) -> PipeRequest | None:
        """The next request to run, or None: the window is full, or the input is done."""
        while not self.exhausted and self.writer.in_flight < self.window:
            raw = next(self.lines, None)
            if raw is None:
                self.exhausted = True
                return None
            self.read += 1
            req = self._accept(raw)
            if req is not None:
                return req
        return None

    def release(self, custom_id: str) -> int:
        """A running line's result is ready: forget it; its output ticket."""
        del self.items[custom_id]
        return self._tickets.pop(custom_id)

    def _accept(self, raw: RawLine) -> PipeRequest | None:
        obj: dict | None = None
        err = raw.error
        cid = raw.custom_id
        if err is None:
            try:
                obj = load_line(raw.text or "")
                cid = custom_id_in(obj)
            except LineError as e:
                err, cid = e, scan_custom_id((raw.text or "").encode("utf-8", "replace"))
        first = cid is not None and cid not in self._claimed
        if ("line", raw.line_no) in self.done or (first and ("id", cid) in self.done):
            self._claimed.add(cid)  # type: ignore[arg-type]
            self.skipped += 1
            if self.on_skip is not None:
                self.on_skip()
            return None
        if cid is not None:
            self._claimed.add(cid)
        try:
            if err is not None:
                raise err
            if cid is not None and not first:
                raise LineError(
                    "duplicate_custom_id", f"custom_id {cid!r} appears on an earlier line; this line is not run"
                )
            assert obj is not None
            item = parse_request(obj, self.builder, self.model_name)
            return self._request(item)
        except LineError as e:
            self.errors += 1
            self.writer.put(self.writer.ticket(), error_line(cid, e, raw.line_no))
            return None

    def _request(self, item: BatchItem) -> PipeRequest:
        self.fit(item, self.capacity, self.kv_hint)
        request = item.choice.request
        params = params_from_pb(request.params)  # the router's wire params, as the nodes convert them
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos)
        max_tokens = request.params.max_tokens
        guess = self.predict(item) if self.predict is not None else None
        prompt = list(request.prompt_token_ids)
        req = PipeRequest(item.custom_id, prompt, max_tokens, stops, predicted_len=guess, params=params)
        self.items[item.custom_id] = item
        self._tickets[item.custom_id] = self.writer.ticket()
        return req
