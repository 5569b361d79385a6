"""The scheduler -> model runner contract: one model step over a flat token batch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardBatch:
    """Everything the model runner needs for one forward step.

    Sequences are laid out back to back: sequence ``i`` contributes
    ``query_lens[i]`` new tokens to ``input_ids`` (a prefill chunk or one decode
    token). Its KV after this step covers positions ``[0, context_lens[i])``; the
    new tokens sit at positions ``context_lens[i] - query_lens[i] ...
    context_lens[i] - 1`` and their KV is written into the slots given by
    ``block_tables[i]`` (position ``p`` -> block ``block_tables[i][p // block_size]``,
    offset ``p % block_size``).
    """

    request_ids: list[str]
    """Request id of each sequence (the layer hook maps them to transfers)."""
    input_ids: list[int]
    """New token ids of all sequences, concatenated: length ``sum(query_lens)``."""
    query_lens: list[int]
    """Number of new tokens of each sequence in this step (>= 1)."""
    context_lens: list[int]
    """KV length of each sequence after this step (cached prefix + new tokens)."""
    block_tables: list[list[int]]
    """Block ids of each sequence, covering at least ``context_lens[i]`` positions."""
    sample_mask: list[bool]
    """Whether the last new token of each sequence needs logits (False for a
    non-final prefill chunk)."""

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        assert len(self.query_lens) == n and len(self.context_lens) == n, "ragged batch metadata"
        assert len(self.block_tables) == n and len(self.sample_mask) == n, "ragged batch metadata"
        assert sum(self.query_lens) == len(self.input_ids), "input_ids length != sum(query_lens)"
