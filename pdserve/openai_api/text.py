"""Per-choice text assembly: incremental detokenization, stop strings, logprob entries."""

from __future__ import annotations

from pdserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer, cut_at_stop


class ChoiceText:
    """Turns a choice's token stream into text deltas that never pass a stop string.

    While streaming it holds back the last len(longest stop) - 1 characters,
    since they could be the start of a stop string that the next token completes.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str],
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self.stop = tuple(stop)
        self.include_stop = include_stop
        """Keep the matched stop string in the text (include_stop_str_in_output)."""
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.text += self.detok.add(token_ids)
        # a stop string not found before cannot start earlier than the longest one before `emitted`
        cut = cut_at_stop(self.text, self.stop, include=self.include_stop, start=max(0, self.emitted - self.hold - 1))
        if cut is not None:
            self.text = cut
            self.stopped = True
            return self._emit(len(self.text))
        return self._emit(max(self.emitted, len(self.text) - self.hold))

    def finish(self) -> str:
        """Everything not yet emitted (the held-back tail)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        delta = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return delta


def chat_logprob_entry(tokenizer: Tokenizer, lp) -> dict:
    """One OpenAI chat `logprobs.content` entry from a pb TokenLogprob."""
    token = tokenizer.decode([lp.token_id], skip_special_tokens=False)
    return {
        "token": token,
        "logprob": lp.logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [
            {
                "token": (t := tokenizer.decode([x.token_id], skip_special_tokens=False)),
                "logprob": x.logprob,
                "bytes": list(t.encode()),
            }
            for x in lp.top
        ],
    }


def completion_logprobs(tokenizer: Tokenizer, lps: list, offset: int) -> dict:
    """OpenAI completions `logprobs` object for the given pb TokenLogprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok = tokenizer.decode([lp.token_id], skip_special_tokens=False)
        tokens.append(tok)
        token_lps.append(lp.logprob)
        tops.append({tokenizer.decode([x.token_id], skip_special_tokens=False): x.logprob for x in lp.top})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
