"""Pure planning arithmetic for paged attention (shared by both backends; CPU-tested).

flashinfer's paged wrappers take CSR-style page tables: `indptr[i]..indptr[i+1]`
indexes sequence i's pages in `indices`, and `last_page_len[i]` is how many
slots of its last page are used. These functions compute them from a
ForwardBatch's plain lists so they can be unit-tested without a GPU.
"""

from __future__ import annotations

from typing import NamedTuple


class PagedPlan(NamedTuple):
    qo_indptr: list[int]
    """[S+1] prefix sums of query lengths."""
    kv_indptr: list[int]
    """[S+1] prefix sums of the number of pages of each sequence."""
    kv_indices: list[int]
    """Page ids of all sequences, concatenated."""
    kv_last_page_len: list[int]
    """[S] used slots of each sequence's last page (1..page_size)."""


def num_pages(context_len: int, page_size: int) -> int:
    return (context_len + page_size - 1) // page_size


def paged_plan(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], page_size: int
) -> PagedPlan:
    """CSR page tables for flashinfer's BatchPrefill/BatchDecode wrappers."""
    qo_indptr, kv_indptr, indices, last = [0], [0], [], []
    for q, ctx, table in zip(query_lens, context_lens, block_tables):
        n = num_pages(ctx, page_size)
        assert len(table) >= n, f"block table has {len(table)} pages, context {ctx} needs {n}"
        qo_indptr.append(qo_indptr[-1] + q)
        kv_indptr.append(kv_indptr[-1] + n)
        indices.extend(table[:n])
        last.append(ctx - (n - 1) * page_size)
    return PagedPlan(qo_indptr, kv_indptr, indices, last)


def slot_mapping(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int
) -> tuple[list[int], list[int], list[int]]:
    """(block id, offset in block, position) of every new token, in batch order."""
    blocks, offsets, positions = [], [], []
    for q, ctx, table in zip(query_lens, context_lens, block_tables):
        for pos in range(ctx - q, ctx):
            blocks.append(table[pos // block_size])
            offsets.append(pos % block_size)
            positions.append(pos)
    return blocks, offsets, positions
