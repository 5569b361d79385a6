"""GrammarCache: structured-output specs compiled against one vocabulary, and their token masks.

Compiling a JSON schema into token masks takes milliseconds to seconds, far longer than a decode
step, so it must not run in the step loop: a node compiles a request's grammar in a worker thread
before the request enters the engine (`compile`), and the engine's admission then finds it here
(`matcher`). Specs repeat (one schema for a whole workload), so compiled grammars are kept in a
bounded LRU keyed by the spec.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable

import torch

from pdserve.engine.grammar import GrammarSpec, build_grammar, xgrammar_module
from pdserve.engine.kernels import cpu_build

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import Tokenizer

log = logging.getLogger("pdserve.grammar")
MAX_COMPILED = 256
"""Compiled grammars kept; a complex schema's masks take up to a few MB."""


class GrammarCache:
    """Compiles GrammarSpecs for one tokenizer and model vocabulary; thread-safe.

    The tokenizer's xgrammar description (its decoded vocabulary) is built on first use, so a node
    that never serves structured output never pays for it, nor needs xgrammar installed."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_compiled: int = MAX_COMPILED
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        """The model's vocabulary (the logits' width), which may exceed the tokenizer's."""
        self.stop_token_ids = sorted(set(stop_token_ids))
        """Tokens that end a finished grammar: the engine's EOS ids."""
        self.max_compiled = max_compiled
        self._compiler: Any = None
        self._compiled: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.last_compile_seconds = 0.0
        """How long the last compilation that missed the cache took (reported by tests and benchmarks)."""

    def _grammar_compiler(self) -> Any:
        if self._compiler is None:
            xgr = xgrammar_module()
            from transformers import PreTrainedTokenizerFast  # xgrammar depends on transformers

            fast = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            info = xgr.TokenizerInfo.from_huggingface(
                fast, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            # our own LRU bounds the memory; xgrammar's cache would grow without limit
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """The spec's CompiledGrammar (cached); ValueError when the spec is invalid."""
        spec = spec.key
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
            compiler = self._grammar_compiler()
        # outside the lock: compiling one big schema must not hold up lookups of cached ones
        start = time.perf_counter()
        compiled = compiler.compile_grammar(build_grammar(spec))
        self.last_compile_seconds = time.perf_counter() - start
        log.info("compiled a %s grammar in %.1f ms", spec.kind, self.last_compile_seconds * 1000)
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > self.max_compiled:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> Any:
        """An xgrammar GrammarMatcher for one request (the spec compiled if it is not cached), past
        the spec's already generated tokens; ValueError if the grammar refuses one of those."""
        matcher = xgrammar_module().GrammarMatcher(self.compile(spec))
        for token in spec.generated_token_ids:
            if not matcher.accept_token(token):
                raise ValueError(f"the tokens generated so far break the request's grammar (at token {token})")
        return matcher


def apply_grammar_masks(logits: torch.Tensor, matchers: list[Any]) -> None:
    """In place on float32 CPU logits [S, V]: tokens row i's grammar forbids get -inf (rows whose
    matcher is None are left alone). A terminated grammar (which only a request that goes on past
    EOS, e.g. with ignore_eos in a batch job, can reach) allows only its stop tokens again.

    Masks are filled one row after another on this thread: xgrammar's BatchGrammarMatcher, on the
    engine's 2 torch threads, made a structured decode step slower, not faster (structured /
    unconstrained tok/s 0.66 against 0.92 on `tiny`, 0.90 against 0.98 on `bench`, 2-core Xeon): its
    threads wait on the cores torch's threads still hold after the forward."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    xgr = xgrammar_module()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])  # [S, ceil(V / 32)] int32
    needed = []
    for i in rows:
        if matchers[i].is_terminated():
            stops = torch.tensor(matchers[i].stop_token_ids, dtype=torch.long)
            kept = logits[i, stops].clone()
            logits[i].fill_(float("-inf"))
            logits[i, stops] = kept
        elif matchers[i].fill_next_token_bitmask(bitmask, i):  # False: every token is allowed
            needed.append(i)
    if not needed:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_build.current_op() is not None:
        torch.ops.pdserve_cpu.apply_token_bitmask(logits, bitmask, torch.tensor(needed, dtype=torch.long))
    else:  # the ops still building (or not buildable here), or logits on a GPU
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=needed)


def accept_tokens(matchers: list[Any], tokens: list[int]) -> None:
    """Advance each request's grammar by the token sampled for it under its mask."""
    for m, token in zip(matchers, tokens):
        if m is not None and not m.is_terminated():
            accepted = m.accept_token(token)
            assert accepted, f"the grammar rejected token {token} sampled under its own mask"
