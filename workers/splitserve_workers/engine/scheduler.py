"""Scheduler: picks each iteration's batch. Prefill first: waiting prompts (interactive before
background, then FIFO) are admitted while their KV blocks fit and packed under the
max_batch_tokens budget, the last one chunked if it does not fit whole. Otherwise one decode
token for up to max_batch_size running sequences (with enable_mixed_batches, both in one pass:
decodes first, prompt chunks in the rest of the budget); when a sequence needs a block and none is
free, the lowest-priority, newest holder of blocks (a running sequence or a part-prefilled
prompt) is preempted (its KV dropped, recomputed later); and an interactive prompt that cannot
be admitted preempts background holders of blocks or batch slots rather than wait for them.
Blocks come from block_manager.py; llm_engine.py drives schedule() and the results.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from splitserve_workers.engine.block_manager import BlockManager, chain_hash
from splitserve_workers.engine.config import EngineConfig
from splitserve_workers.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    is_prefill: bool  # run as a prefill pass (varlen); also true for mixed batches
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: tokens whose KV this pass computes
    num_decode: int = 0  # the first num_decode sequences are decode steps (1 token each)
    # Speculative decode pass: per sequence, the draft tokens verified after its last token
    # (num_new_tokens is then 1 + len(draft)); None for a plain pass.
    drafts: list[list[int]] | None = None


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, max_model_len: int
    ) -> None:
        self.max_batch_size = config.max_batch_size
        self.max_batch_tokens = config.max_batch_tokens
        self.max_model_len = max_model_len
        self.mixed = config.enable_mixed_batches
        self.speculative_tokens = config.speculative_tokens
        self.bm = block_manager
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival)
        self.running: list[Sequence] = []
        self.preemptions_total = 0

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        keys = [s.sort_key for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.sort_key), seq)

    def add_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def queued_prefill_tokens(self) -> int:
        return sum(s.num_tokens - s.num_computed_tokens for s in self.waiting)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and free its blocks (finish, abort, error)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.block_table:
            self.bm.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> tuple[ScheduledBatch | None, list[Sequence]]:
        """The next batch, and sequences that can never fit the KV cache (to finish)."""
        # A sequence preempted once it held more tokens than the whole cache can (its last
        # token was emitted after the cache's last slot) can never be admitted again: finish it
        # rather than block the queue behind it forever.
        grown = [
            s
            for s in self.waiting
            if not s.block_table and self.bm.blocks_for(s.num_tokens) > self.bm.num_blocks
        ]
        for seq in grown:
            self.waiting.remove(seq)
        if self.mixed and self.waiting and self.running:
            batch, too_long = self._schedule_mixed()
            return batch, grown + too_long
        batch = self._schedule_prefill(self.max_batch_tokens)
        if batch is not None:
            return batch, grown
        batch, too_long = self._schedule_decode()
        if batch is not None and self.speculative_tokens:
            self._draft(batch)
        return batch, grown + too_long

    def _schedule_mixed(self) -> tuple[ScheduledBatch | None, list[Sequence]]:
        # Running sequences decode first (one token of the budget each); prompt chunks fill
        # the rest, so a long prompt no longer pauses everyone's next token.
        decode, too_long = self._schedule_decode()
        seqs = list(decode.seqs) if decode else []
        budget = self.max_batch_tokens - len(seqs)
        prefill = self._schedule_prefill(budget) if budget > 0 else None
        # An interactive prompt may have preempted background decodes of this pass.
        seqs = [s for s in seqs if s.status is SequenceStatus.RUNNING]
        counts = [1] * len(seqs)
        num_decode = len(seqs)
        if prefill is not None:
            seqs += prefill.seqs
            counts += prefill.num_new_tokens
        if not seqs:
            return None, too_long
        return ScheduledBatch(True, seqs, counts, num_decode), too_long

    def _schedule_prefill(self, budget: int) -> ScheduledBatch | None:
        active = len(self.running) + sum(1 for s in self.waiting if s.block_table)
        # Keep one block spare while sequences decode, so admitting a prompt does not force
        # an immediate preemption of a running sequence (recompute ping-pong).
        watermark = 1 if self.running else 0
        admitting = True
        seqs: list[Sequence] = []
        counts: list[int] = []
        for seq in list(self.waiting):
            if budget <= 0:
                break
            if not seq.block_table:
                if not admitting:
                    continue
                result = self._allocate(seq, active, watermark)
                if result is None:
                    # An interactive prompt does not wait behind background work holding the
                    # cache or the batch slots: lower-priority holders are preempted, newest
                    # first, but only when that lets it in.
                    keep = set(seqs)
                    for victim in self._victims(seq, keep, active, watermark):
                        self.preempt(victim)
                        active -= 1
                        result = self._allocate(seq, active, watermark)
                        if result is not None:
                            break
                if result is None:
                    admitting = False  # strict order: nothing behind the head jumps ahead
                    continue
                seq.block_table, seq.block_hashes = result
                seq.num_computed_tokens = len(seq.block_hashes) * self.bm.block_size
                if not seq.admitted and seq.num_output_tokens == 0:
                    # Hits at a later admission (after a preemption) are mostly its own blocks.
                    seq.num_cached_tokens = seq.num_computed_tokens
                seq.admitted = True
                active += 1
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(True, seqs, counts) if seqs else None

    def _schedule_decode(self) -> tuple[ScheduledBatch | None, list[Sequence]]:
        batch: list[Sequence] = []
        too_long: list[Sequence] = []
        for seq in sorted(self.running, key=lambda s: s.sort_key):
            if len(batch) >= self.max_batch_size:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            need = self.bm.blocks_for(seq.num_tokens) - len(seq.block_table)
            if self.bm.blocks_for(seq.num_tokens) > self.bm.num_blocks:
                too_long.append(seq)  # the whole cache cannot hold it: finish as "length"
                continue
            while need > self.bm.num_free_blocks:
                # The lowest-priority, newest holder of blocks: a running sequence, or a
                # prompt part-way through a chunked prefill (else an interactive sequence would
                # preempt itself while a background prefill keeps its blocks).
                holders = [s for s in self.running if s not in too_long] + [
                    s for s in self.waiting if s.block_table and not s.prefill_only
                ]
                victim = max(holders, key=lambda s: s.sort_key)
                self.preempt(victim)
                if victim in batch:
                    batch.remove(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                seq.block_table.extend(self.bm.allocate(need))
                batch.append(seq)
        if not batch:
            return None, too_long
        return ScheduledBatch(False, batch, [1] * len(batch), num_decode=len(batch)), too_long

    def _draft(self, batch: ScheduledBatch) -> None:
        """Draft tokens (speculative.py) for a decode batch's sequences, with the blocks they
        need, as far as free blocks and the token budget go: a draft never preempts anyone.
        Never more than the request may still emit (max_tokens, the model's length) minus the
        token the pass emits anyway."""
        budget = self.max_batch_tokens - len(batch.seqs)
        bs = self.bm.block_size
        drafts: list[list[int]] = []
        for seq in batch.seqs:
            limit = min(
                budget,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            draft: list[int] = []
            if seq.drafter is not None and limit > 0:
                draft = self._propose(seq, limit)
                room = (len(seq.block_table) + self.bm.num_free_blocks) * bs - seq.num_tokens
                draft = draft[: max(0, room)]
                need = self.bm.blocks_for(seq.num_tokens + len(draft)) - len(seq.block_table)
                if need > 0:
                    seq.block_table.extend(self.bm.allocate(need))
                budget -= len(draft)
            drafts.append(draft)
        if any(drafts):
            batch.drafts = drafts
            batch.num_new_tokens = [1 + len(d) for d in drafts]

    def _propose(self, seq: Sequence, limit: int) -> list[int]:
        assert seq.drafter is not None
        if seq.matcher is None:
            return seq.drafter.propose(seq.token_ids, limit)
        if seq.matcher.is_error() or seq.matcher.is_stopped():
            return []
        # Under a grammar: what it forces next (a JSON key, say) is as good as certain, else
        # the lookup's draft as far as the grammar allows it.
        forced = seq.matcher.compute_ff_tokens()
        if forced:
            return list(forced[: min(limit, self.speculative_tokens)])
        draft = seq.drafter.propose(seq.token_ids, limit)
        return draft[: seq.matcher.validate_tokens(draft)] if draft else []

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks past the one holding the sequence's last token (a speculative pass
        allocated them for drafts that were not accepted)."""
        keep = self.bm.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            self.bm.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _allocate(
        self, seq: Sequence, active: int, watermark: int
    ) -> tuple[list[int], list[int]] | None:
        if active >= self.max_batch_size:
            return None
        return self.bm.allocate_with_prefix(
            seq.token_ids, seq.num_tokens, watermark, use_cache=not seq.wants_prompt_logprobs
        )

    def _victims(
        self, seq: Sequence, keep: set[Sequence], active: int, watermark: int
    ) -> list[Sequence]:
        """Holders of blocks with a lower priority than `seq`, newest first, as many as it
        takes to admit `seq` (a batch slot and its blocks without counting prefix hits); none
        when all of them would not do, since preempting them would gain nothing. Never a
        prefill-only sequence part-way through its prompt: its KV already streamed to a decode
        worker, and recomputing it would send those chunks twice."""
        holders = sorted(
            (
                s
                for s in [*self.running, *(w for w in self.waiting if w.block_table)]
                if s.priority > seq.priority and s not in keep and not s.prefill_only
            ),
            key=lambda s: s.sort_key,
            reverse=True,
        )
        need = self.bm.blocks_for(seq.num_tokens) + watermark
        free = self.bm.num_free_blocks
        for n, victim in enumerate(holders, 1):
            # Blocks another sequence shares (a prefix) stay allocated when the victim goes.
            free += sum(1 for b in victim.block_table if self.bm.blocks[b].ref_count == 1)
            if free >= need and active - n < self.max_batch_size:
                return holders[:n]
        return []

    def preempt(self, seq: Sequence) -> None:
        """Drop a running sequence's KV (or a partly prefilled prompt's) and queue it again;
        its prompt + output so far is recomputed when it is admitted again."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        self.preemptions_total += 1
        self.add_waiting(seq)

    def mark_computed(self, seq: Sequence, n: int) -> None:
        """n more tokens of seq have KV in the cache; publish newly full blocks for reuse."""
        seq.num_computed_tokens += n
        if not self.bm.enable_prefix_caching:
            return
        bs = self.bm.block_size
        while len(seq.block_hashes) < seq.num_computed_tokens // bs:
            b = len(seq.block_hashes)
            toks = tuple(seq.token_ids[b * bs : (b + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else None, toks)
            self.bm.register(seq.block_table[b], h, toks)
            seq.block_hashes.append(h)
