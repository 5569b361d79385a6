"""SharedKvStore: KV blocks in a store that several nodes share (`--kv-store`).

A connector (`pdserve.engine.kv_connector`) below the pool and the host tier. Its blocks live in a
backend (`pdserve.engine.kv_store_backends`): a directory on local NVMe or a shared volume (NFS,
Lustre, a PVC: `file:///PATH`, as llm-d's filesystem backend) or a Mooncake Store
(`mooncake://MASTER`). A prefix computed on any node serves every node that reaches the store.

- **Keys.** A block's record is named by its stable block key (`engine.block_keys`: the model
  namespace, dtype, geometry and block size through the root, the cache salt, every token before
  it). Its header repeats the node's KV compatibility string, the parent key and the block's own
  token ids, and a blake2b digest of the payload: a load checks all of them, so neither a 64-bit
  key collision, another model's block nor a torn or corrupt record is ever used. A salted block
  is unreachable without its salt (the salt is in every key of its chain).
- **Writes** run on a writer thread: it copies a finished request's full blocks out of the pool
  (the pool waits for that copy before reusing a block: `before_reuse`), then writes each record.
  The queue is bounded; a full queue or a failed write drops the block (counted), never blocks
  serving. The backend keeps itself within its bound (a directory's `max`, Mooncake's eviction).
- **Reads** happen at admission (engine thread), for the consecutive prompt blocks after what the
  pool (and the host tier) hold, on a reader thread bounded by `READ_TIMEOUT_S`: a store that is
  slow, gone or corrupt costs a recompute (identical output) and a counter, never a hang. A
  record is one block over every layer and its digest covers all of it, so the read and the
  checks finish before `load` may say True; only the copy of the checked payloads into the pool
  runs later, layer by layer and overlapped with the forward, as the host tier's
  (`pdserve.engine.kv_restore`: the payloads stay in memory until it lands, so a failed copy is
  redone synchronously).

With tensor parallelism every rank writes and reads records of its own heads' share, rank 0
deciding what and when (`pdserve.engine.kv_tier_ranks`).

Not exercised on hardware: on a CUDA pool the copies go through host memory; only the CPU path
runs in the tests.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from pdserve.engine.block_keys import BlockKey, prompt_block_keys
from pdserve.engine.kv_connector import ExternalKv
from pdserve.engine.kv_store_backends import BlockBackend, open_backend
from pdserve.engine.kv_events import KvEventLog, Medium
from pdserve.engine.kv_restore import LayerRestores, RestoringConnector
from pdserve.engine.kv_tier import TierStats
from pdserve.engine.kv_tier_ranks import TierRanks, next_token

if TYPE_CHECKING:
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.request import Request

log = logging.getLogger("pdserve.engine")
MAGIC = b"PDKVBLK1"
MAX_PENDING_BLOCKS = 4096
"""Blocks queued for the writer at most; offloads beyond are dropped (and counted)."""
READ_TIMEOUT_S = 5.0
"""Longest a lookup or a restore may take before the request recomputes instead."""
DOWN_BACKOFF_S = 30.0
"""After a timeout, how long admissions do not ask the store at all."""
CLOSE_DRAIN_S = 5.0
"""Longest `close` waits for queued writes."""


@dataclass
class StoreStats(TierStats):
    """The host tier's counters (`dropped_blocks` also counts failed writes, `restore_failures`
    missing, corrupt or unreadable records and timeouts), plus the store's own."""

    corrupt_blocks: int = 0
    """Records refused on load (digest, key, tokens or compatibility mismatch): the request recomputed."""
    timeouts: int = 0
    """Lookups or reads that took over READ_TIMEOUT_S (the store is then skipped for DOWN_BACKOFF_S)."""


class SharedKvStore(RestoringConnector):
    """Blocks of one model's KV in the store `url` names (shared by every node that reaches it)."""

    def __init__(
        self,
        url: str,
        compatibility: str,
        backend: BlockBackend | None = None,
        events: KvEventLog | None = None,
        *,
        shard: str = "",
        ranks: TierRanks | None = None,
    ) -> None:
        self.backend = backend if backend is not None else open_backend(url)
        self.shard = shard
        """Appended to record names and to the compatibility string: a tensor-parallel rank's
        records hold its heads' share only (`kv_tier_ranks.shard_suffix`; "" with TP=1)."""
        self.compatibility = compatibility + shard
        self.ranks = ranks
        """Rank 0 of a tensor-parallel engine: the other ranks, which keep their own shares."""
        self.events = events
        """The node's KV event log: blocks this node wrote to the store, and ones it found gone
        (medium "store"; other nodes' writes reach a router through their own logs)."""
        self.stats = StoreStats()
        self.pool: KVPool | None = None
        self.restores: LayerRestores | None = None
        """Checked payloads waiting to be copied into the pool, layer by layer in the forward."""
        self._queue: deque[tuple[int, BlockKey, BlockKey, list[int], threading.Event]] = deque()
        self._pending: dict[int, threading.Event] = {}
        self._wake = threading.Condition()
        self._matched: dict[str, list[tuple[BlockKey, BlockKey, list[int]]]] = {}
        self._stopped = False
        self._writing = False
        self._down_until = 0.0
        self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-store-read")
        self._thread = threading.Thread(target=self._write_loop, name="kv-store-write", daemon=True)

    def _name(self, key: BlockKey) -> str:
        return f"{key:016x}{self.shard}"

    # --- worker side -------------------------------------------------------------------------
    def register_kv_pool(self, pool: KVPool) -> None:
        self.pool = pool
        self.restores = LayerRestores(pool, self.stats, "KV store")
        self._thread.start()
        log.info("KV store: %s", self.backend.describe())

    # --- scheduler side ----------------------------------------------------------------------
    def request_finished(self, request: Request) -> None:
        pool = self.pool
        if pool is None:
            return
        bs = pool.block_size
        full = request.num_computed_tokens // bs
        tokens = request.all_token_ids
        keys = prompt_block_keys(request.kv_root, tokens, bs, full)
        parents = [request.kv_root, *keys]
        queued = 0
        for i, (block, key) in enumerate(zip(request.block_ids, keys)):
            if block in self._pending:
                continue
            if len(self._queue) + queued >= MAX_PENDING_BLOCKS:
                self.stats.dropped_blocks += 1
                continue
            done = threading.Event()
            self._pending[block] = done
            self._queue.append((block, key, parents[i], tokens[i * bs : (i + 1) * bs], done))
            queued += 1
        if queued:
            with self._wake:
                self._wake.notify_all()

    def before_reuse(self, block_id: int) -> None:
        super().before_reuse(block_id)
        done = self._pending.get(block_id)
        if done is not None:
            done.wait()

    def match(self, request: Request, pool_tokens: int) -> ExternalKv | None:
        if self.pool is None:
            return None
        bs = self.pool.block_size
        limit = (request.num_prompt_tokens - 1) // bs  # the last token's block is always computed
        first = pool_tokens // bs
        if first >= limit:
            return None
        if time.monotonic() < self._down_until:  # timed out lately: not asked until the back-off ends
            return None
        keys = prompt_block_keys(request.kv_root, request.prompt_token_ids, bs, limit)
        names = [self._name(k) for k in keys[first:limit]]
        count = self._bounded(self._held, names)
        if not count:
            return None
        parents = [request.kv_root, *keys]
        held = [
            (keys[i], parents[i], request.prompt_token_ids[i * bs : (i + 1) * bs]) for i in range(first, first + count)
        ]
        self._matched[request.request_id] = held
        return ExternalKv(load_tokens=len(held) * bs)

    def load(self, request: Request, block_ids: list[int]) -> bool:
        """Read and check every record now (bounded); the copies into the pool are recorded and
        run layer by layer in the next forward (`pdserve.engine.kv_restore`)."""
        wanted = self._matched.pop(request.request_id, [])
        pool, restores = self.pool, self.restores
        if pool is None or restores is None or len(wanted) != len(block_ids):
            return False
        started = time.perf_counter()
        token = next_token()
        # the other ranks read and check their shares while we read ours, within the same bound
        asked = self.ranks.send({"op": "store_read", "token": token, "wanted": wanted}) if self.ranks else []
        sources = self._bounded(self.read_checked, wanted)
        if asked:
            assert self.ranks is not None
            left = max(0.0, READ_TIMEOUT_S - (time.perf_counter() - started))
            if sources is None or not TierRanks.settled(asked, left):
                self.ranks.send({"op": "store_drop", "token": token})  # a late answer is thrown away
                sources = None
            elif not self.ranks.all({"op": "store_apply", "token": token, "blocks": block_ids}):
                sources = None  # a rank could not copy: those tokens are recomputed (on every rank)
        if sources is None:
            self.stats.restore_failures += 1
            return False
        restores.add(block_ids, sources, len(sources) * pool.block_bytes * pool.num_layers, started, lambda: None)
        return True

    def forget(self, request: Request) -> None:
        self._matched.pop(request.request_id, None)

    def _bounded(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """`fn(arg)` on the reader thread, at most READ_TIMEOUT_S (the engine thread never waits on
        a slow store longer); None on a timeout, after which the store is left alone for
        DOWN_BACKOFF_S (a hung store would otherwise cost every admission the whole timeout)."""
        try:
            return self._reader.submit(fn, arg).result(timeout=READ_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            log.warning(
                "KV store: no answer in %.2g s: recomputing, store skipped for %.0f s", READ_TIMEOUT_S, DOWN_BACKOFF_S
            )
            self._down_until = time.monotonic() + DOWN_BACKOFF_S
            self.stats.timeouts += 1
            return None

    def _held(self, names: list[str]) -> int:
        """How many of `names`, from the first, the store holds."""
        count = 0
        for name in names:
            try:
                if not self.backend.exists(name):
                    break
            except Exception as e:  # the backend's own error: a miss
                log.warning("KV store: looking up block %s failed (%r)", name, e)
                break
            count += 1
        return count

    # --- files -------------------------------------------------------------------------------
    def _header(self, key: BlockKey, parent: BlockKey, tokens: list[int], digest: str) -> bytes:
        meta = {"key": key, "parent": parent, "tokens": tokens, "compat": self.compatibility, "digest": digest}
        return json.dumps(meta, separators=(",", ":")).encode()

    def read_checked(self, wanted: list[tuple[BlockKey, BlockKey, list[int]]]) -> list[torch.Tensor] | None:
        """Every wanted block's KV ([layers, ...], as `pool.tensor[:, block]`), checked; None if
        any record is missing, unreadable or wrong."""
        assert self.pool is not None
        payloads = self._read_all(wanted)
        if payloads is None:
            return None
        shape, dtype = self.pool.tensor[:, 0].shape, self.pool.tensor.dtype
        return [torch.frombuffer(bytearray(p), dtype=dtype).view(shape) for p in payloads]

    def _read_all(self, wanted: list[tuple[BlockKey, BlockKey, list[int]]]) -> list[bytes] | None:
        """Every wanted block's payload, checked; None if any is missing, unreadable or wrong."""
        out = []
        for key, parent, tokens in wanted:
            name = self._name(key)
            try:
                data = self.backend.read(name)
            except Exception as e:  # the backend's own error: the request recomputes
                log.warning("KV store: reading block %s failed (%r)", name, e)
                data = None
            if data is None:  # gone since match (evicted), or the store is down
                self._gone(key)
                return None
            payload = self._check(data, key, parent, tokens)
            if payload is None:
                self.stats.corrupt_blocks += 1
                log.warning("KV store: block %s failed its checks: removed, recomputing", name)
                self.backend.remove(name)
                self._gone(key)
                return None
            out.append(payload)
        return out

    def _gone(self, key: BlockKey) -> None:
        if self.events is not None:
            self.events.removed([key], Medium.STORE)

    def _check(self, data: bytes, key: BlockKey, parent: BlockKey, tokens: list[int]) -> bytes | None:
        head = len(MAGIC) + 4
        if len(data) < head or data[: len(MAGIC)] != MAGIC:
            return None
        (size,) = struct.unpack("<I", data[len(MAGIC) : head])
        try:
            meta = json.loads(data[head : head + size])
        except ValueError:
            return None
        payload = data[head + size :]
        expected = self.pool.block_bytes * self.pool.num_layers if self.pool is not None else -1
        ok = (
            isinstance(meta, dict)
            and meta.get("key") == key
            and meta.get("parent") == parent
            and meta.get("tokens") == tokens
            and meta.get("compat") == self.compatibility
            and len(payload) == expected
            and meta.get("digest") == hashlib.blake2b(payload, digest_size=16).hexdigest()
        )
        return payload if ok else None

    def drain(self, timeout: float) -> bool:
        """Wait until every queued block is written (or dropped), by every tensor-parallel rank too;
        False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._queue or self._writing:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
        if self.ranks is None:
            return True
        # each rank writes its shares after answering our `store_offload`: its records may still be queued
        return self.ranks.all({"op": "store_drain"}, max(0.0, deadline - time.monotonic()))

    def _write_loop(self) -> None:
        while True:
            with self._wake:
                self._writing = False
                self._wake.notify_all()  # a `drain` may be waiting for the writer to be idle
                while not self._queue and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                block, key, parent, tokens, done = self._queue.popleft()
                self._writing = True
            try:
                assert self.pool is not None
                payload = self.pool.tensor[:, block].contiguous().cpu().view(torch.uint8).numpy().tobytes()
            except Exception:
                log.exception("KV store: copying block %d out of the pool failed", block)
                payload = None
            if payload is not None and self.ranks is not None:  # each rank copies its share out before reuse
                offload = {"op": "store_offload", "block": block, "key": key, "parent": parent, "tokens": tokens}
                if not self.ranks.all(offload):  # a share is missing: ours alone would only fail a restore
                    self.stats.dropped_blocks += 1
                    payload = None
            self._pending.pop(block, None)
            done.set()  # the pool may reuse the block: its bytes are copied
            if payload is not None:
                self.write_record(key, parent, tokens, payload)

    def write_record(self, key: BlockKey, parent: BlockKey, tokens: list[int], payload: bytes) -> None:
        """Write one block's record (a dropped block, counted, if the backend fails)."""
        header = self._header(key, parent, tokens, hashlib.blake2b(payload, digest_size=16).hexdigest())
        record = MAGIC + struct.pack("<I", len(header)) + header + payload
        try:
            ok = self.backend.write(self._name(key), record)
        except Exception as e:  # a backend error is a dropped block, never the writer's death
            log.warning("KV store: writing block %s failed (%r)", self._name(key), e)
            ok = False
        if ok:
            self.stats.stored(len(record))
            if self.events is not None:
                self.events.stored([key], parent, Medium.STORE)
        else:
            self.stats.dropped_blocks += 1
        self.stats.evicted_blocks = self.backend.evicted()

    def close(self, drain_s: float = CLOSE_DRAIN_S) -> None:
        """Let the writer finish what is queued for up to `drain_s` (a node stopping, a `generate`
        run ending: what they computed is worth keeping), then stop it (the rest is dropped) and
        the reader."""
        self.drain(drain_s)
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        for *_, done in list(self._queue):
            done.set()
        self._pending.clear()
        self._reader.shutdown(wait=False, cancel_futures=True)
        if self.restores is not None:
            self.restores.close()
        self.backend.close()
