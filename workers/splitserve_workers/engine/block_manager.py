"""KV block allocator: fixed-size blocks, reference counts, and the prefix cache.

A full block is keyed by a chained hash (hash of the previous block's key and its own token
ids); a later request whose prompt starts with the same blocks shares them (ref count + 1).
Freed blocks keep their key and sit in an LRU free list until reallocated (blocks with no key,
which nothing can reuse, are reallocated first), so cached blocks count as free: after any mix
of requests the free count returns to the total. scheduler.py and llm_engine.py
(reservations) are the callers; the KV tensors themselves live in model_runner.py.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT


class NoFreeBlocksError(RuntimeError):
    pass


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


def chain_hash(prev: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks that hold nothing reusable (never published: a finished sequence's
        # partial last block, a refused speculative draft's): allocation takes these first.
        self._blank: dict[int, None] = dict.fromkeys(range(num_blocks))
        # Free blocks still published in the prefix cache, as an LRU (insertion-ordered dict):
        # allocation evicts the oldest only when no blank block is left.
        self._free: dict[int, None] = {}
        self._by_hash: dict[int, int] = {}
        self.prefix_cache_hits_total = 0  # blocks
        self.prefix_cache_queries_total = 0  # blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._blank) + len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take_free(self) -> int:
        pool = self._blank or self._free
        block_id = next(iter(pool))
        del pool[block_id]
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its prefix-cache entry
            if self._by_hash.get(block.hash) == block_id:
                del self._by_hash[block.hash]
            block.hash = None
            block.token_ids = None
        block.ref_count = 1
        return block_id

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} KV blocks, {self.num_free_blocks} free")
        return [self._take_free() for _ in range(n)]

    def free(self, block_ids: SequenceT[int]) -> None:
        # Release in reverse so a sequence's tail blocks are evicted before its shared head.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                (self._blank if block.hash is None else self._free)[block_id] = None

    def match_prefix(
        self, token_ids: SequenceT[int], max_blocks: int
    ) -> tuple[list[int], list[int]]:
        """Cached blocks holding the leading full blocks of token_ids (up to max_blocks).
        Returns (block ids, their chained hashes); takes no references."""
        if not self.enable_prefix_caching:
            return [], []
        ids: list[int] = []
        hashes: list[int] = []
        prev: int | None = None
        bs = self.block_size
        for b in range(max_blocks):
            toks = tuple(token_ids[b * bs : (b + 1) * bs])
            h = chain_hash(prev, toks)
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != toks:
                break
            ids.append(block_id)
            hashes.append(h)
            prev = h
        return ids, hashes

    def allocate_with_prefix(
        self,
        token_ids: SequenceT[int],
        num_tokens: int,
        reserve_free: int = 0,
        use_cache: bool = True,
    ) -> tuple[list[int], list[int]] | None:
        """Blocks for num_tokens tokens of token_ids, reusing cached full blocks of the prompt
        (never the block holding the last token: its logits must be computed). Returns
        (block table, hashes of the reused blocks), or None if fewer than the needed blocks
        plus reserve_free would be free. use_cache=False: no reuse (every prompt row computed)."""
        max_full = (len(token_ids) - 1) // self.block_size if use_cache else 0
        hits, hashes = self.match_prefix(token_ids, max_full)
        need = self.blocks_for(num_tokens) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if need + revived + reserve_free > self.num_free_blocks:
            return None
        for b in hits:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1
        if self.enable_prefix_caching:
            self.prefix_cache_queries_total += max_full
            self.prefix_cache_hits_total += len(hits)
        return hits + [self._take_free() for _ in range(need)], hashes

    def register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Publish a full, computed block under its chained hash for later prefix hits."""
        if not self.enable_prefix_caching:
            return
        block = self.blocks[block_id]
        block.hash = block_hash
        block.token_ids = token_ids
        current = self._by_hash.get(block_hash)
        if current is None or self.blocks[current].hash != block_hash:
            self._by_hash[block_hash] = block_id
