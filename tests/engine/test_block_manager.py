"""The block allocator alone: reference counts, chained prefix hashes, LRU eviction."""

from __future__ import annotations

import pytest
from splitserve_workers.engine.block_manager import BlockManager, NoFreeBlocksError, chain_hash


def test_allocate_free_and_double_free() -> None:
    bm = BlockManager(4, block_size=2, enable_prefix_caching=False)
    blocks = bm.allocate(3)
    assert len(set(blocks)) == 3 and bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    bm.free(blocks)
    assert bm.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(blocks[:1])


def test_prefix_sharing_counts_references() -> None:
    bm = BlockManager(8, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    table, hashes = bm.allocate_with_prefix(tokens, 5) or ([], [])
    assert len(table) == 3 and hashes == []
    # Publish the two full blocks as the scheduler does once their KV is computed.
    h0 = chain_hash(None, (1, 2))
    h1 = chain_hash(h0, (3, 4))
    bm.register(table[0], h0, (1, 2))
    bm.register(table[1], h1, (3, 4))
    other = bm.allocate_with_prefix([1, 2, 3, 4, 9, 9], 6)
    assert other is not None
    shared, other_hashes = other
    assert shared[:2] == table[:2] and other_hashes == [h0, h1]
    assert bm.blocks[table[0]].ref_count == 2
    assert (bm.prefix_cache_hits_total, bm.prefix_cache_queries_total) == (2, 4)
    # A different first block breaks the chain even if the second block's tokens match.
    miss = bm.allocate_with_prefix([7, 7, 3, 4, 5], 5)
    assert miss is not None and miss[1] == []
    bm.free(table)
    bm.free(shared)
    bm.free(miss[0])
    assert bm.num_free_blocks == 8
    # Cached blocks stay reusable while free, until allocation evicts them.
    again = bm.allocate_with_prefix([1, 2, 3, 4, 5], 5)
    assert again is not None and again[1] == [h0, h1]
    bm.free(again[0])
    bm.allocate(8)  # takes every block, evicting the cache
    assert bm.match_prefix([1, 2, 3, 4], 2) == ([], [])


def test_capacity_check_counts_revived_cached_blocks() -> None:
    bm = BlockManager(3, block_size=2, enable_prefix_caching=True)
    table, _ = bm.allocate_with_prefix([1, 2, 3], 3) or ([], [])
    bm.register(table[0], chain_hash(None, (1, 2)), (1, 2))
    bm.free(table)
    held = bm.allocate(1)  # the oldest free block: the one never used
    assert held[0] not in table and bm.match_prefix([1, 2], 1)[0] == [table[0]]
    # 5 tokens need 3 blocks: the cached hit (itself one of the 2 free blocks) + 2 new = 3 > 2.
    assert bm.allocate_with_prefix([1, 2, 3, 4, 5], 5) is None
    assert bm.num_free_blocks == 2
    got = bm.allocate_with_prefix([1, 2, 3, 4], 4)  # the hit + 1 new block fit
    assert got is not None and got[0][0] == table[0] and bm.num_free_blocks == 0
