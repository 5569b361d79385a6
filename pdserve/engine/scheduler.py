"""Scheduler: continuous batching with a token budget, chunked prefill and preemption policy."""

from __future__ import annotations

from collections import deque
from typing import Callable

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import Preemption
from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.request import Request, RequestStatus


class Scheduler:
    """Chooses which tokens of which requests run in the next step.

    Running requests go first (one decode token each, or their next prefill
    chunk), then waiting requests are admitted FIFO while the token budget,
    `max_num_seqs` and free blocks allow. Under KV pressure the `recompute`
    policy preempts the newest running request; the `never` policy instead
    reserves, at admission, every block a request can ever need, so running
    requests never lose their KV and new ones wait (or are refused) instead.
    """

    def __init__(
        self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int, preemption: str
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.never_preempt = preemption == Preemption.NEVER
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        """Requests preempted since start (vllm:num_preemptions; read from other threads, only ever grows)."""

    # --- reservation (never-preempt policy) -------------------------------------------------
    def future_blocks(self, req: Request) -> int:
        """Blocks `req` may still need beyond those it holds."""
        return max(0, self.bm.blocks_for(req.num_prompt_tokens + req.max_tokens) - len(req.block_ids))

    def reserved_blocks(self, holders: list[Request]) -> int:
        return sum(self.future_blocks(r) for r in holders) if self.never_preempt else 0

    def can_admit(self, req: Request, holders: list[Request]) -> bool:
        """Whether `req`'s blocks (for never-preempt: all it can ever need) fit now."""
        extra = self.future_blocks_after_alloc(req) if self.never_preempt else 0
        return self.bm.can_allocate(req.all_token_ids, reserve=self.reserved_blocks(holders) + extra, root=req.kv_root)

    def future_blocks_after_alloc(self, req: Request) -> int:
        return max(0, self.bm.blocks_for(req.num_prompt_tokens + req.max_tokens) - self.bm.blocks_for(req.num_tokens))

    # --- the step ------------------------------------------------------------------------
    def schedule(self, parked: Callable[[], list[Request]]) -> tuple[list[Request], ForwardBatch | None]:
        """Pick this step's requests. `parked()` lists the other block holders (waiting for remote KV,
        pinned after a prefill); asked only under never-preempt, the one policy that reserves for them,
        so that an offline queue of thousands is not walked every step."""
        holders = parked() if self.never_preempt else []
        scheduled: list[tuple[Request, int]] = []
        budget = self.budget
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted by an earlier iteration
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._ensure_blocks(req, req.num_computed_tokens + num_new):
                continue
            scheduled.append((req, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.can_admit(req, self.running + holders):
                break
            req.block_ids, cached = self.bm.allocate(req.all_token_ids, root=req.kv_root)
            req.num_computed_tokens = req.num_cached_tokens = cached
            self.waiting.popleft()
            req.start_running()
            self.running.append(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            scheduled.append((req, num_new))
            budget -= num_new
        if not scheduled:
            return [], None
        return [r for r, _ in scheduled], self._build(scheduled)

    def _ensure_blocks(self, req: Request, num_tokens: int) -> bool:
        """Grow req's blocks to cover `num_tokens`, preempting newer requests if allowed."""
        while len(req.block_ids) < self.bm.blocks_for(num_tokens):
            if self.bm.num_free_blocks == 0:
                assert not self.never_preempt, "never-preempt reservation violated"
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    return False
                continue
            req.block_ids.append(self.bm.append_block())
        return True

    def preempt(self, req: Request) -> None:
        """Drop req's KV and put it back at the head of the queue (recomputed later)."""
        self.running.remove(req)
        self.num_preemptions += 1
        self.bm.free_blocks(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    @staticmethod
    def _build(scheduled: list[tuple[Request, int]]) -> ForwardBatch:
        input_ids: list[int] = []
        for req, num_new in scheduled:
            start = req.num_computed_tokens
            input_ids += req.all_token_ids[start : start + num_new]
        return ForwardBatch(
            request_ids=[r.request_id for r, _ in scheduled],
            input_ids=input_ids,
            query_lens=[n for _, n in scheduled],
            context_lens=[r.num_computed_tokens + n for r, n in scheduled],
            block_tables=[list(r.block_ids) for r, _ in scheduled],
            sample_mask=[r.num_computed_tokens + n == r.num_tokens for r, n in scheduled],
        )

    def remove(self, req: Request) -> None:
        """Forget a request (finished or aborted); the caller frees its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def num_queued_prefill_tokens(self) -> int:
        pending = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return pending + sum(
            r.num_tokens - r.num_computed_tokens - 1 for r in self.running if r.num_tokens - r.num_computed_tokens > 1
        )
