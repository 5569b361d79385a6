"""The decode node's half of disaggregation: where a prompt's KV comes from, and receiving it.

Mixed into LLMEngine (it uses the engine's admission, scheduler and block manager). A decode
node holds the KV of every conversation it served, keyed in its prefix cache, so a new turn
usually finds most of its prompt there. `plan_prefill` decides per request:

- local: the part of the prompt this node lacks is short (or no prefill node is usable), so the
  request simply queues here and the scheduler prefills it from the cached prefix;
- remote: the cached prefix blocks are shared (ref counted, never written: they are keyed and so
  immutable), only the missing blocks are allocated, and a prefill node fills just those.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pdserve.engine.request import AdmissionError, Request, RequestStatus, StepOutput, TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.engine.scheduler import Scheduler


class PrefillPlan(NamedTuple):
    """Where one decode-node request gets its prompt KV."""

    location: str
    """"local" (queued here) or "remote" (blocks allocated, a prefill node fills them)."""
    block_ids: list[int]
    """Remote: every block of the prompt, the held ones first. Local: empty."""
    held_tokens: int
    """Block-aligned prompt tokens whose KV this node already holds (remote: never transferred)."""


class RemotePrefill:
    """Decode-side admission of requests whose prompt a prefill node may compute."""

    if TYPE_CHECKING:
        block_manager: BlockManager
        scheduler: Scheduler
        requests: dict[str, Request]
        _finished: list[StepOutput]

        def _validate(
            self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None = None
        ) -> Request: ...
        def _register(self, req: Request) -> None: ...
        def parked(self) -> list[Request]: ...
        def _append_token(self, req: Request, token: int, lp: TokenLogprob | None) -> None: ...
        def _finish(self, req: Request) -> None: ...
        def _output(self, req: Request) -> StepOutput: ...

    def plan_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        reuse: bool = True,
        local_max_tokens: int | None = None,
    ) -> PrefillPlan:
        """Admit a decode-node request: local when no prefill node is usable (`local_max_tokens`
        None) or, with `reuse`, when the prompt tokens this node lacks are at most
        `local_max_tokens` (0: never by length); else remote, as `add_remote_prefill_request`.
        Without `reuse` this is the path from before cache-aware disaggregation: every block
        fresh, the whole prompt filled remotely."""
        req = self._validate(request_id, prompt_token_ids, params, cache_salt)
        bm = self.block_manager
        held = len(bm.prefix_hits(req.prompt_token_ids, req.kv_root)) * bm.block_size if reuse else 0
        lacking = req.num_prompt_tokens - held
        if local_max_tokens is None or (reuse and 0 < local_max_tokens and lacking <= local_max_tokens):
            self._register(req)
            self.scheduler.waiting.append(req)
            return PrefillPlan("local", [], held)
        return PrefillPlan("remote", self._allocate_remote(req, reuse), held)

    def add_remote_prefill_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        reuse: bool = True,
    ) -> list[int]:
        """Allocate the prompt's blocks now (with `reuse`, the cached prefix blocks are shared and
        only the rest is fresh); a prefill node fills the fresh ones. Returns every block, held first."""
        return self._allocate_remote(self._validate(request_id, prompt_token_ids, params, cache_salt), reuse)

    def _allocate_remote(self, req: Request, reuse: bool) -> list[int]:
        holders = self.scheduler.running + self.parked() + list(self.scheduler.waiting)
        reserve = self.scheduler.reserved_blocks(holders) + self.scheduler.future_blocks_after_alloc(req)
        bm = self.block_manager
        if reuse:
            fits = bm.can_allocate(req.prompt_token_ids, reserve=reserve, root=req.kv_root)
        else:
            fits = bm.blocks_for(req.num_tokens) + reserve <= bm.num_free_blocks
        if not fits:
            raise AdmissionError(
                f"no KV room: request needs {bm.blocks_for(req.num_tokens + req.max_tokens)} "
                f"blocks, {bm.num_free_blocks} free, {reserve} reserved"
            )
        if reuse:
            req.block_ids, req.num_cached_tokens = bm.allocate(req.prompt_token_ids, root=req.kv_root)
        else:
            req.block_ids = [bm.append_block() for _ in range(bm.blocks_for(req.num_tokens))]
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._register(req)
        return list(req.block_ids)

    def complete_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        first_logprobs: TokenLogprob | None = None,
        num_cached_tokens: int | None = None,
    ) -> None:
        """The prompt's KV has landed: the request runs with its first token already sampled.
        `num_cached_tokens`: prompt tokens the prefill node did not compute (its own prefix-cache
        hit), reported as the request's cached tokens (default: what this node held)."""
        req = self._remote(request_id)
        # the prefill node sampled the first token under the same grammar: replay it into ours
        if req.matcher is not None and not req.matcher.accept_token(first_token_id):
            raise ValueError(f"the prefill node's first token {first_token_id} breaks the request's grammar")
        if num_cached_tokens is not None:
            req.num_cached_tokens = max(0, min(num_cached_tokens, req.num_prompt_tokens - 1))
        req.num_computed_tokens = req.num_prompt_tokens
        self.block_manager.cache_full_blocks(req.all_token_ids, req.block_ids, req.num_computed_tokens, req.kv_root)
        req.start_running()
        self.scheduler.running.append(req)
        self._append_token(req, first_token_id, first_logprobs)
        req.num_emitted = 1  # the node streams the first token itself, straight from the prefill reply
        if req.status.is_finished:  # eos / stop string / max_tokens=1: reported by the next step()
            self._finish(req)
            self._finished.append(self._output(req))

    def prefill_locally(self, request_id: str) -> None:
        """No prefill node could fill the KV: free the request's blocks (the caller has made sure no
        writer can still touch them) and queue it here, to be prefilled from this node's cache."""
        req = self._remote(request_id)
        self.block_manager.free_blocks(req.block_ids)
        req.block_ids = []
        req.num_cached_tokens = 0
        req.status = RequestStatus.WAITING
        self.scheduler.waiting.append(req)

    def _remote(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            raise KeyError(f"request {request_id!r} is not waiting for remote KV")
        return req
