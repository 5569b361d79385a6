"""The KV tiers of a tensor-parallel engine: each rank keeps its own heads' share of every block.

With tensor parallelism a pool block is split by KV heads across the ranks, so a block kept below
the pool is too: rank `r` of `n` keeps only its share, in its own process. Rank 0 makes every
decision, as it does for the pool (which block goes down, which host slot it takes, which slot is
evicted, what a request restores) and tells the other ranks over their command pipes
(`pdserve.engine.parallel.rank_commands`), which carry no decision of their own:

- **Host tier** (`--kv-offloading-size`): every rank has the same number of slots (the ranks'
  blocks are the same size). Rank 0's writer, having chosen slot S for block B, has each rank copy
  its share of B into its slot S (`tier_store`) and waits for them all before it marks S as
  holding the key, and before B may be reused. A restore (`load`) has each rank copy its slots
  into the fresh blocks (`tier_load`) and waits for them before it says True; only rank 0's own
  copy runs layer by layer in the next forward. So a rank never reads a slot rank 0 may rewrite:
  rank 0 rewrites only a slot it no longer pins, and pins a slot until its own copy landed, after
  every other rank's.
- **Shared store** (`--kv-store`): each rank writes its own records, named by the block's key and
  the rank (`shard_suffix`), so no other shape ever reads them. Rank 0's writer has each rank copy
  its share of B out (`store_offload`, answered once the bytes are copied, written after) before
  B may be reused. A restore asks every rank to read and check its records (`store_read`) while
  rank 0 reads its own, all within the store's read timeout; only when every rank holds its
  checked payloads does rank 0 have them copied into the pool (`store_apply`), else it drops them
  (`store_drop`) and the request recomputes: a late answer can never write a block the engine
  has given to another request. Rank 0's `drain` (a node stopping) waits for the ranks' writers too
  (`store_drain`, answered once every record queued before it is written).

What the other ranks copy, they copy at once (on their command thread, between the forwards that
rank 0 starts; a request's blocks are written by no forward until rank 0 admitted it), so only
rank 0's copies overlap compute. Not exercised on hardware: on CUDA the ranks' copies go through
the same pinned host memory, synchronised before they answer.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from pdserve.engine.parallel.rank_commands import RankCommands

log = logging.getLogger("pdserve.engine")
OPS = ("tier_store", "tier_load", "store_offload", "store_read", "store_apply", "store_drop", "store_drain")
"""The commands a rank's `kv_tier_rank_service.RankTiers` answers (its `RankService` hands over
every command whose op that object lists in its `ops`)."""
ANSWER_TIMEOUT_S = 60.0
"""Longest rank 0 waits for a rank's copy (a memcpy of a few blocks: only a dead or hung rank
takes this long, and then the engine is failing anyway)."""


def shard_suffix(rank: int, size: int) -> str:
    """What a tensor-parallel rank appends to a store record's name and compatibility string: its
    share of a block is not the block (and with TP=1 nothing is appended, so records stay the
    whole blocks other nodes read)."""
    return "" if size == 1 else f".tp{size}r{rank}"


class TierRanks:
    """Rank 0's end: send one command to every other rank and wait for all of their answers."""

    def __init__(self, commands: RankCommands) -> None:
        self.commands = commands
        self.ranks = commands.ranks

    def send(self, msg: dict) -> list[concurrent.futures.Future]:
        return [self.commands.call(rank, msg) for rank in self.ranks]

    @staticmethod
    def settled(futures: list[concurrent.futures.Future], timeout_s: float = ANSWER_TIMEOUT_S) -> bool:
        """True when every rank answered without an error within `timeout_s` (all ranks together)."""
        done, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        ok = not pending
        for fut in done:
            try:
                answer = fut.result()
            except Exception as e:  # RankFailure: the rank is gone
                log.warning("KV tier: a tensor-parallel rank failed (%s)", e)
                ok = False
                continue
            if answer.get("error") or not answer.get("ok", False):
                if answer.get("error"):
                    log.warning("KV tier: a tensor-parallel rank refused: %s", answer["error"])
                ok = False
        if pending:
            log.warning("KV tier: %d tensor-parallel rank(s) did not answer in %.0f s", len(pending), timeout_s)
        return ok

    def all(self, msg: dict, timeout_s: float = ANSWER_TIMEOUT_S) -> bool:
        return self.settled(self.send(msg), timeout_s)


def tier_ranks(runner: Any) -> TierRanks | None:
    """The other ranks of `runner`'s engine (None with TP=1: the tiers then talk to no one)."""
    ranks = getattr(runner, "ranks", None)
    return TierRanks(ranks.commands) if ranks is not None and ranks.commands.ranks else None


_tokens = itertools.count(1)


def next_token() -> int:
    """A restore's id, to match a rank's checked payloads with rank 0's apply or drop."""
    return next(_tokens)
