"""RankTiers: a tensor-parallel rank's share of the KV tiers below the pool (ranks other than 0).

It holds this rank's heads' share of the host tier's slots and writes and reads this rank's store
records, copying only when rank 0 says so (`pdserve.engine.kv_tier_ranks` says how rank 0 decides).
The rank's `RankService` hands it every command named in `ops`; a command is answered once its copy
is done, so rank 0 knows when a block may be reused or a restore keyed.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Callable

import torch

from pdserve.engine.kv_tier_ranks import OPS, shard_suffix

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_runner import ModelRunner

MAX_STASHED = 64
"""Checked store payloads a rank keeps waiting for rank 0's apply or drop, at most."""


class RankTiers:
    """A rank other than 0: its share of the host tier's slots and of the shared store's records,
    copied only when rank 0 says so (see the module docstring)."""

    ops = OPS

    def __init__(self, config: EngineConfig, runner: ModelRunner, rank: int) -> None:
        self.pool = pool = runner.kv_pool
        self.slots: torch.Tensor | None = None
        if config.kv_offloading_bytes:
            slots = config.kv_offloading_bytes // (pool.block_bytes * pool.num_layers)
            t = pool.tensor
            self.slots = torch.empty((slots, t.shape[0], *t.shape[2:]), dtype=t.dtype, pin_memory=t.is_cuda)
        self.store = None
        if config.kv_store is not None:
            from pdserve.engine.kv_namespace import kv_compatibility
            from pdserve.engine.kv_shared_store import SharedKvStore

            self.store = SharedKvStore(
                config.kv_store,
                kv_compatibility(runner.model_config, pool),
                shard=shard_suffix(rank, config.tensor_parallel_size),
            )
            self.store.register_kv_pool(pool)
        self._io = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-store-rank")
        """Store reads and writes: off the command thread, which also serves the KV transfers."""
        self._stash: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._writes = 0

    def handle(self, msg: dict, reply: Callable[[dict], None]) -> None:
        op = msg.get("op")
        if op == "tier_store":
            self._copy([self._slot(msg["slot"])], [self._block(msg["block"])])
            reply({"ok": True})
        elif op == "tier_load":
            self._copy([self._block(b) for b in msg["blocks"]], [self._slot(s) for s in msg["slots"]])
            reply({"ok": True})
        elif op in ("store_offload", "store_read"):
            if self.store is None:
                raise ValueError("this rank has no KV store")
            if op == "store_offload":
                self._offload(msg, reply)
            else:
                self._io.submit(self._read, msg, reply)
        elif op == "store_apply":
            with self._lock:
                payloads = self._stash.pop(int(msg["token"]), None)
            if payloads is None:
                reply({"error": f"no checked payloads for restore {msg['token']}"})
                return
            self._copy([self._block(b) for b in msg["blocks"]], payloads)
            reply({"ok": True})
        elif op == "store_drop":
            with self._lock:
                self._stash.pop(int(msg["token"]), None)
            reply({"ok": True})
        elif op == "store_drain":
            if self.store is None:
                raise ValueError("this rank has no KV store")
            self._io.submit(reply, {"ok": True})  # one worker, in order: after every write queued before
        else:
            raise ValueError(f"unknown KV tier command {op!r}")

    # --- internals ------------------------------------------------------------------------------
    def _slot(self, slot: int) -> torch.Tensor:
        if self.slots is None:
            raise ValueError("this rank has no host KV tier")
        return self.slots[int(slot)]

    def _block(self, block: int) -> torch.Tensor:
        return self.pool.tensor[:, int(block)]

    def _copy(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        if len(dst) != len(src):
            raise ValueError(f"{len(dst)} destinations for {len(src)} sources")
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=d.is_cuda or s.is_cuda)
        if self.pool.tensor.is_cuda:  # done before we answer: rank 0 then lets the block or slot be reused
            torch.cuda.current_stream(self.pool.tensor.device).synchronize()

    def _offload(self, msg: dict, reply: Callable[[dict], None]) -> None:
        assert self.store is not None
        payload = self._block(msg["block"]).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        reply({"ok": True})  # copied out: rank 0 may let the block be reused
        key, parent, tokens = int(msg["key"]), int(msg["parent"]), list(msg["tokens"])
        with self._lock:
            if self._writes >= MAX_STASHED * 64:  # the writer is that far behind: dropped, as rank 0's queue would
                self.store.stats.dropped_blocks += 1
                return
            self._writes += 1
        self._io.submit(self._write, key, parent, tokens, payload)

    def _write(self, key: int, parent: int, tokens: list[int], payload: bytes) -> None:
        assert self.store is not None
        try:
            self.store.write_record(key, parent, tokens, payload)
        finally:
            with self._lock:
                self._writes -= 1

    def _read(self, msg: dict, reply: Callable[[dict], None]) -> None:
        assert self.store is not None
        wanted = [(int(k), int(p), list(t)) for k, p, t in msg["wanted"]]
        try:
            payloads = self.store.read_checked(wanted)
        except Exception as e:  # answered as a miss: the request recomputes
            reply({"error": f"{type(e).__name__}: {e}"})
            return
        if payloads is None:
            reply({"ok": False})
            return
        with self._lock:
            while len(self._stash) >= MAX_STASHED:  # rank 0 gave up on the oldest long ago
                self._stash.pop(next(iter(self._stash)))
            self._stash[int(msg["token"])] = payloads
        reply({"ok": True})
