"""LLMEngine: the step-level API that offline generation and the node servers drive."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.grammar_cache import GrammarCache
from pdserve.engine.kv_connector import NO_CONNECTOR, KvConnector, KvConnectors, KvSource
from pdserve.engine.kv_events import KvEventLog
from pdserve.engine.kv_namespace import kv_compatibility, request_root
from pdserve.engine.kv_pool import KVPool
from pdserve.engine.kv_shared_store import SharedKvStore
from pdserve.engine.kv_tier import HostKvTier
from pdserve.engine.kv_tier_ranks import shard_suffix, tier_ranks
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.pool_blocks import PoolBlocks
from pdserve.engine.prompt_check import check_max_tokens, check_prompt
from pdserve.engine.request import AdmissionError, Request, RequestStatus, StepOutput, TokenLogprob
from pdserve.engine.sampler import Sampler, make_generator
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.tokenizer import IncrementalDetokenizer, StopStringChecker, Tokenizer


class EngineLoad(NamedTuple):
    """The engine's share of a node's load report: each field is the LoadReport field of its name."""

    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int


MAX_RESTORES = 2
"""Restores from below the pool per admission: one per tier (the host tier, then the shared store)."""


class LLMEngine:
    """One model, one KV pool, one scheduler. Not thread-safe: drive it from one thread.

    The loop: `batch = scheduler.schedule(); logits = runner.run(batch); update(batch, sample(logits))`.
    Everything that moves KV into or out of the pool goes through the one `connector` it is built
    with (`pdserve.engine.kv_connector`): on a prefill node, layer streaming to a decode node
    (`prefill_only` requests: compute the prompt, sample one token, keep the blocks until
    `release`) and D->P pulls (blocks a decode node fills with a prefix it holds); on a decode
    node, remote prefill (the prompt's blocks allocated up front and parked in
    WAITING_FOR_REMOTE_KV until `complete_remote_prefill`). Every request's blocks are keyed in
    the namespace of the engine's `kv_compatibility` and its `cache_salt`; `kv_events` records
    every key stored or evicted.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        connector: KvConnector = NO_CONNECTOR,
        on_scheduled: Callable[[], None] | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        self.config = config
        self.kv_events = KvEventLog()
        """Keys stored / evicted in this engine's prefix cache and the tiers below it, for the node's
        KvEvents stream."""
        self.tier: HostKvTier | None = None
        """The host KV tier below the pool (--kv-offloading-size), asked before the node's connector."""
        self.store: SharedKvStore | None = None
        """The shared KV store below the host tier (--kv-store), once the pool exists."""
        self.on_scheduled = on_scheduled
        """Called in every step after scheduling, before the model runs: the state vLLM's scheduler
        stats describe (the batch admitted, the rest waiting). A node publishes its load here."""
        torch.manual_seed(config.seed)
        if runner is None and config.tensor_parallel_size > 1:
            from pdserve.engine.parallel.launcher import TensorParallelRunner

            runner = TensorParallelRunner(config)
        self.runner = runner or ModelRunner(config.model_dir, **config.runner_options())
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        try:
            self.tokenizer = Tokenizer(config.tokenizer or config.model_dir)
        except BaseException:
            self.runner.close()  # stop the other tensor-parallel ranks, if any, with the failed start
            raise
        self.eos_token_ids = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        """Structured-output grammars: nodes compile a request's in a worker thread before admitting it."""
        pool = self.runner.kv_pool
        self.kv_compatibility = kv_compatibility(self.model_config, pool)
        """What the node reports as LoadReport.compatibility: the router roots its block keys on it."""
        ranks = tier_ranks(self.runner)  # tensor parallelism: the tiers' other shares
        if config.kv_offloading_bytes:
            self.tier = HostKvTier(config.kv_offloading_bytes, self.kv_events, ranks)
        if config.kv_store is not None:  # its files are checked against the compatibility string
            shard = shard_suffix(0, config.tensor_parallel_size)
            self.store = SharedKvStore(
                config.kv_store, self.kv_compatibility, events=self.kv_events, shard=shard, ranks=ranks
            )
        # the tiers below the pool are asked first (host, then the shared store), then the node's own
        parts = [c for c in (self.tier, self.store, connector) if c is not None and c is not NO_CONNECTOR]
        connector = NO_CONNECTOR if not parts else parts[0] if len(parts) == 1 else KvConnectors(*parts)
        self.connector = connector
        connector.register_kv_pool(pool)
        self.block_manager = BlockManager(
            pool.num_blocks,
            pool.block_size,
            config.enable_prefix_caching,
            events=self.kv_events,
            before_reuse=None if connector is NO_CONNECTOR else connector.before_reuse,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            preemption=config.preemption,
        )
        self.sampler = Sampler()
        self.requests: dict[str, Request] = {}
        """Every request the engine owns. Its status alone says who holds its blocks (`check_integrity`
        proves it): WAITING/PREEMPTED are queued in the scheduler (no blocks), RUNNING the scheduler
        runs; the other two are `parked`, holding blocks the scheduler neither runs nor frees:
        WAITING_FOR_REMOTE_KV (decode node: a prefill node is filling them, until
        `complete_remote_prefill`) and finished (prefill node: a prefill_only request whose blocks a
        KV transfer still reads, pinned until `release`). A request leaves when its blocks are freed."""
        self._blocks = PoolBlocks(self.block_manager, self.scheduler, self.holders, self.kv_compatibility)
        """Pool blocks held outside any request: a tier's restores here, and the connector's own (a
        D->P pull's), for which it is handed to the connector; nothing else reaches it."""
        connector.register_blocks(self._blocks)
        self.generators: dict[str, torch.Generator] = {}
        self._finished: list[StepOutput] = []

    # --- admission ----------------------------------------------------------------------
    def _validate(
        self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        root = request_root(self.kv_compatibility, cache_salt)
        check_prompt(prompt, self.model_config.vocab_size, self.max_model_len)
        if params.logit_bias and params.logit_bias[-1][0] >= self.model_config.vocab_size:  # sorted by id
            raise ValueError(
                f"invalid sampling parameter logit_bias: token id {params.logit_bias[-1][0]} is not below "
                f"the vocabulary size {self.model_config.vocab_size}"
            )
        room = self.max_model_len - len(prompt)
        if params.max_tokens is not None:
            check_max_tokens(len(prompt), params.max_tokens, self.max_model_len)
        max_tokens = params.max_tokens or room
        if self.block_manager.blocks_for(len(prompt) + max_tokens) > self.block_manager.num_blocks:
            raise ValueError(f"request needs more KV blocks than the pool has ({self.block_manager.num_blocks})")
        req = Request(request_id, list(prompt), params, max_tokens, kv_root=root)
        if params.structured_outputs is not None:  # compiled here only if the caller did not (offline use)
            req.matcher = self.grammars.matcher(params.structured_outputs)
        if params.stop:
            detok = IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens)
            req.stop_checker = StopStringChecker(detok, params.stop, params.include_stop_str_in_output)
        return req

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> KvSource:
        """Admit a request; ValueError (clear message) if it can never be served, AdmissionError if
        the connector's source needs blocks the pool cannot give now. `cache_salt` separates its
        prefix-cache namespace (tenants with different salts never share blocks);
        `kv_transfer_params` is what the connector reads about it. Returns where its prompt KV
        comes from: queued here ("local"), or parked until the connector's source fills it."""
        req = self._validate(request_id, prompt_token_ids, params, cache_salt)
        req.prefill_only = prefill_only
        req.kv_transfer_params = dict(kv_transfer_params or {})
        pool_tokens = 0
        if self.connector is not NO_CONNECTOR:
            bm = self.block_manager
            pool_tokens = len(bm.prefix_hits(req.prompt_token_ids, req.kv_root)) * bm.block_size
            external = self.connector.match(req, pool_tokens)
            for _ in range(MAX_RESTORES):  # held below the pool (host tier, then store): restored now
                if external is None or not external.load_tokens:
                    break
                restored = self._load_below(req, pool_tokens, external.load_tokens)
                progressed, pool_tokens = restored > pool_tokens, restored
                external = self.connector.match(req, pool_tokens)
                if not progressed:  # no room, or the tier failed: not asked twice, the rest is computed
                    break
            if external is not None and external.load_tokens:  # one restore per tier and admission
                self.connector.forget(req)
                external = None
            if external is not None:
                held = pool_tokens if external.share_pool else 0
                try:
                    block_ids = self._allocate_remote(req, held)
                except AdmissionError:
                    self.connector.forget(req)  # it keeps nothing for a refused request
                    raise
                self.connector.after_alloc(req, block_ids, held)
                self.connector.finish_loads()  # the node may send the held prefix (a D->P pull) right away
                return KvSource("remote", block_ids, held)
        self._register(req)
        self.scheduler.waiting.append(req)
        return KvSource("local", [], pool_tokens)

    def _load_below(self, req: Request, pool_tokens: int, load_tokens: int) -> int:
        """Restore `load_tokens` prompt tokens' KV that the connector holds below the pool into fresh
        blocks, key them into the prefix cache and free them (the scheduler then hits them like any
        cached prefix). Returns the pool's prefix hit afterwards (unchanged when there is no room
        beyond what admitted requests may need, or the load failed: those tokens are computed)."""
        upto = pool_tokens + load_tokens
        held = self._blocks.hold(req.prompt_token_ids, upto, req.kv_root)
        if held is None:
            self.connector.forget(req)
            return pool_tokens
        assert held.cached_tokens == pool_tokens, (held.cached_tokens, pool_tokens)
        loaded = self.connector.load(req, held.block_ids[pool_tokens // self._blocks.block_size :])
        self._blocks.release(req.prompt_token_ids, held.block_ids, upto, req.kv_root, keep=loaded)
        return upto if loaded else pool_tokens

    def _allocate_remote(self, req: Request, held_tokens: int) -> list[int]:
        """Allocate every prompt block now (the `held_tokens` prefix shared from the prefix cache,
        the rest fresh) and park the request in WAITING_FOR_REMOTE_KV. Returns the blocks."""
        reserve = self.scheduler.reserved_blocks(self.holders()) + self.scheduler.future_blocks_after_alloc(req)
        bm = self.block_manager
        if held_tokens:
            fits = bm.can_allocate(req.prompt_token_ids, reserve=reserve, root=req.kv_root)
        else:
            fits = bm.blocks_for(req.num_tokens) + reserve <= bm.num_free_blocks
        if not fits:
            raise AdmissionError(
                f"no KV room: request needs {bm.blocks_for(req.num_tokens + req.max_tokens)} "
                f"blocks, {bm.num_free_blocks} free, {reserve} reserved"
            )
        if held_tokens:
            req.block_ids, req.num_cached_tokens = bm.allocate(req.prompt_token_ids, root=req.kv_root)
        else:
            req.block_ids = [bm.append_block() for _ in range(bm.blocks_for(req.num_tokens))]
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._register(req)
        return list(req.block_ids)

    def _register(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if not req.params.greedy:
            self.generators[req.request_id] = make_generator(req.params.seed)

    # --- the step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Run one model step; return what changed (token deltas, finishes)."""
        scheduled, batch = self.scheduler.schedule(self.parked)
        if self.on_scheduled is not None:
            self.on_scheduled()
        if batch is not None:
            logits = self.runner.run(batch, connector=self.connector)
            sampled = iter(
                self.sampler(logits, [r for r, s in zip(scheduled, batch.sample_mask) if s], self.generators)
            )
            for req, q_len, sample in zip(scheduled, batch.query_lens, batch.sample_mask):
                req.num_computed_tokens += q_len
                self.block_manager.cache_full_blocks(
                    req.all_token_ids, req.block_ids, req.num_computed_tokens, req.kv_root
                )
                if sample:
                    self._append_token(req, *next(sampled))
        outputs, self._finished = self._finished, []
        for req in scheduled:
            if req.status.is_finished or req.num_emitted < len(req.output_token_ids):
                outputs.append(self._output(req))
        for req in list(self.scheduler.running):
            if req.status.is_finished:
                self._finish(req)
        return outputs

    def _append_token(self, req: Request, token: int, lp: TokenLogprob | None) -> None:
        req.output_token_ids.append(token)
        if lp is not None:
            req.output_logprobs.append(lp)
        p, n = req.params, len(req.output_token_ids)
        stop_ids = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
        if stop_ids and n > p.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
        elif req.matcher is not None and req.matcher.is_terminated():  # the grammar is complete
            req.status = RequestStatus.FINISHED_STOPPED
        elif req.stop_checker is not None and req.stop_checker.check(token):
            req.status = RequestStatus.FINISHED_STOPPED
        elif n >= req.max_tokens or req.num_tokens >= self.max_model_len or req.prefill_only:
            req.status = RequestStatus.FINISHED_LENGTH

    def _output(self, req: Request) -> StepOutput:
        new = req.output_token_ids[req.num_emitted :]
        lps = req.output_logprobs[req.num_emitted :] if req.params.logprobs is not None else None
        req.num_emitted = len(req.output_token_ids)
        return StepOutput(
            req.request_id,
            new,
            lps,
            req.status.is_finished,
            req.status.finish_reason,
            req.num_prompt_tokens,
            req.num_cached_tokens,
            len(req.output_token_ids),
            req.queue_seconds,
        )

    def _finish(self, req: Request) -> None:
        self.scheduler.remove(req)
        self.generators.pop(req.request_id, None)
        if req.status != RequestStatus.FINISHED_ABORTED:
            self.connector.request_finished(req)
            if req.prefill_only:
                return  # parked: a KV transfer still reads these blocks, until release()
        self.requests.pop(req.request_id, None)
        self.block_manager.free_blocks(req.block_ids)
        req.block_ids = []

    # --- lifecycle ----------------------------------------------------------------------------
    def complete_remote_prefill(
        self,
        request_id: str,
        first_token_id: int,
        first_logprobs: TokenLogprob | None = None,
        num_cached_tokens: int | None = None,
    ) -> None:
        """WAITING_FOR_REMOTE_KV -> RUNNING: the prompt's KV has landed, and the request runs with
        the first token the remote side sampled. `num_cached_tokens`: prompt tokens the remote
        side did not compute (its own prefix-cache hit), reported as the request's cached tokens
        (default: what this node held)."""
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
        """WAITING_FOR_REMOTE_KV -> WAITING: no remote source could fill the KV. The request's blocks
        are freed (the caller has made sure no writer can still touch them) and it queues here, to
        be prefilled from this node's cache."""
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

    def holders(self) -> list[Request]:
        """Every request that holds blocks or will: running, parked, then waiting (the order
        `Scheduler.reserved_blocks` promises room in)."""
        return self.scheduler.running + self.parked() + list(self.scheduler.waiting)

    def parked(self) -> list[Request]:
        """Requests holding blocks outside the scheduler: waiting for remote KV, or finished and
        pinned until `release` (see `requests`)."""
        return [
            r for r in self.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KV or r.status.is_finished
        ]

    def release(self, request_id: str) -> None:
        """Prefill node: the transfer is done (or failed); free (and keep cached) the blocks."""
        req = self.requests.get(request_id)
        if req is not None and req.status.is_finished:
            self.requests.pop(request_id)
            self.block_manager.free_blocks(req.block_ids)
            req.block_ids = []

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state and free its blocks. False if unknown."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.status.is_finished:  # pinned: its output was reported when it finished
            self.release(request_id)
            return True
        req.status = RequestStatus.FINISHED_ABORTED
        self._finish(req)
        self._finished.append(self._output(req))
        return True

    def check_ranks(self) -> None:
        """Raise RankFailure if a tensor-parallel rank of this engine died (a no-op without TP), so
        an idle node notices at once rather than at its next step."""
        self.runner.check()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (their processes exit), and the connector's threads."""
        self.connector.close()
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._finished)

    @property
    def kv_pool(self) -> KVPool:
        """The KV pool (rank 0's, on a tensor-parallel engine): what a node's CacheStore registers."""
        return self.runner.kv_pool

    @property
    def progress(self) -> int:
        """Decoder layers computed since start: grows while the engine works, also within one long
        step; safe to read from another thread (one int)."""
        return self.runner.progress

    def load(self) -> EngineLoad:
        """The load report. Free blocks exclude those `preemption="never"` reserves for the future
        tokens of admitted requests: they are free in the pool but promised, so the router's
        weighting must not count them."""
        s = self.scheduler
        num_remote = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KV for r in self.requests.values())
        num_free = max(0, self.block_manager.num_free_blocks - s.reserved_blocks(self.holders()))
        return EngineLoad(
            num_free,
            self.block_manager.num_blocks,
            len(s.running),
            len(s.waiting) + num_remote,
            s.num_queued_prefill_tokens(),
        )

    def check_integrity(self) -> None:
        """Blocks are owned exactly as the requests' statuses say, plus those the connector holds
        outside any request (between steps)."""
        running, waiting = {id(r) for r in self.scheduler.running}, {id(r) for r in self.scheduler.waiting}
        for rid, r in self.requests.items():
            where = "running" if id(r) in running else "waiting" if id(r) in waiting else "parked"
            expected = {
                RequestStatus.RUNNING: "running",
                RequestStatus.WAITING: "waiting",
                RequestStatus.PREEMPTED: "waiting",
            }.get(r.status, "parked")
            assert where == expected, f"request {rid!r} is {r.status.name} but {where}"
            assert not r.status.is_finished or r.prefill_only, f"finished request {rid!r} was not freed"
        assert len(running) + len(waiting) + len(self.parked()) == len(self.requests), "a request the engine lost"
        # blocks the connector holds outside any request (a pending D->P pull's) are owners too
        owners = {rid: r.block_ids for rid, r in self.requests.items()} | self.connector.owned_blocks()
        self.block_manager.check_integrity(owners)
