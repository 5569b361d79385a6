"""Tokenizer (tokenizers + the checkpoint's jinja chat template) and incremental detokenization.

Imports neither torch nor transformers, so the router can use it cheaply.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.exceptions import TemplateError

from tokenizers import Tokenizer as HFTokenizer

from pdserve.engine.chat_template import compile_template


LONG_TEXT_CHARS = 16384
"""Texts at least this long are encoded without holding the GIL."""


def _token_text(value: object) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """encode/decode and chat templating of a Hugging Face checkpoint directory; `chat_template`
    replaces the checkpoint's own (`--chat-template`)."""

    def __init__(self, model_dir: str | Path, chat_template: str | None = None) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{path} has no tokenizer.json (a fast tokenizer is required)")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = chat_template or template
        self._compiled = compile_template(self.chat_template) if self.chat_template else None
        eos_ids = [self._tok.token_to_id(self.eos_token)] if self.eos_token else []
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen_eos = json.loads(gen_file.read_text()).get("eos_token_id")
            eos_ids += gen_eos if isinstance(gen_eos, list) else ([gen_eos] if gen_eos is not None else [])
        self.eos_token_ids: list[int] = sorted({int(e) for e in eos_ids if e is not None})

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object (the grammar engine reads the vocabulary from it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) < LONG_TEXT_CHARS:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        # encode_batch releases the GIL (encode does not): a long prompt tokenized in a worker
        # thread then leaves the caller's event loop running. It costs more on short texts.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """Render `messages` the way transformers' apply_chat_template(tokenize=False) does: the same
        variables (tools, documents, the special tokens) and the same environment (engine.chat_template)."""
        if self._compiled is None:
            raise ValueError(
                "this model has no chat template (tokenizer_config.json lacks chat_template; pass --chat-template)"
            )
        try:
            return self._compiled.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except TemplateError as e:  # raise_exception, a sandbox violation: the conversation's fault
            raise ValueError(str(e)) from None

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # the template already writes any BOS, so no special tokens are added on top
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas, safe for multi-byte characters.

    Decodes a small window (prefix_offset..end) and emits only what extends the
    already-read part; while the tail decodes to U+FFFD (an incomplete UTF-8
    sequence split across byte-level tokens) nothing is emitted.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids or [])[-6:]  # a little left context for correct spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens, return the new text (possibly empty)."""
        delta = ""
        for tid in token_ids:
            self.ids.append(tid)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], self.skip)
            full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                delta += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
        self.text += delta
        return delta


def cut_at_stop(text: str, stop: tuple[str, ...], include: bool, start: int = 0) -> str | None:
    """`text` cut at its earliest stop string found at or after `start` (the stop string kept when
    `include`), or None when there is none. Ties at one position go to the first in `stop`."""
    best: int | None = None
    for s in stop:
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best):
            best, match = idx, s
    if best is None:
        return None
    return text[: best + len(match)] if include else text[:best]


class StopStringChecker:
    """Watches a request's detokenized output for stop strings."""

    def __init__(self, detok: IncrementalDetokenizer, stop: tuple[str, ...], include_stop: bool) -> None:
        self.detok = detok
        self.stop = stop
        self.include = include_stop
        self.max_len = max(len(s) for s in stop)
        self.truncated_text: str | None = None

    def check(self, token_id: int) -> bool:
        """Feed one token; True if the text now contains a stop string (text is then truncated)."""
        delta = self.detok.add([token_id])
        if not delta:
            return False
        text = self.detok.text
        # only a match that ends in the new text can be new: search from max_len - 1 characters before it
        cut = cut_at_stop(text, self.stop, self.include, start=max(0, len(text) - len(delta) - self.max_len + 1))
        if cut is None:
            return False
        self.truncated_text = cut
        return True
