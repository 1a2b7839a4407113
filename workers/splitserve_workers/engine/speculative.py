"""Speculative decoding by n-gram lookup in the sequence itself (prompt lookup decoding).

When a sequence's last n tokens already occurred earlier in its prompt or output, the tokens
that followed that earlier occurrence are proposed as drafts. One forward pass then computes
the last token and all the drafts (a short chunk on top of the cached context, as a prefill
chunk is), and every row is sampled exactly as plain decoding would sample that position: with
the same sampler, the same per-position seed. The drafts are accepted while they equal what was
sampled; the first sampled token that differs is emitted as the correction, and when all are
accepted the last row gives one more token. So a sequence emits 1 to k + 1 tokens per pass, and
they are the tokens plain decoding emits (greedy and seeded sampling alike): for a draft that is
one fixed token, "accept it with probability p(draft), else sample from p without it" is the
same distribution as "sample from p and keep the draft if they match".

It pays where the output repeats its input (editing, extraction, code, quoting a document) and
costs one wider pass where it does not; nothing needs a second model. Penalties see each draft
row's history with the drafts before it. Under a grammar the drafts are what it forces next,
else the lookup's as far as it allows (scheduler.py), and each draft row gets the grammar's
mask after the drafts before it (llm_engine._grammar_masks).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceT


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of one growing token list last occurred, so a
    lookup costs O(new tokens) per step instead of a scan of the whole context. Kept on the
    sequence (a token list only grows; preemption keeps it)."""

    __slots__ = ("min_n", "max_n", "_last", "_indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # _last[n - min_n][ngram] = the index just past that n-gram's latest occurrence.
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        self._indexed = 0  # n-grams ending before this index are in _last

    def add(self, token_ids: SequenceT[int]) -> None:
        """Indexes the n-grams of token_ids not indexed yet, except those ending at its last
        token: a lookup's suffix must not find itself."""
        end = len(token_ids)
        for stop in range(max(self._indexed, 1), end):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self._last[n - self.min_n][tuple(token_ids[stop - n : stop])] = stop
        self._indexed = max(self._indexed, end)

    def propose(self, token_ids: SequenceT[int], k: int) -> list[int]:
        """k tokens that followed the latest earlier occurrence of the longest suffix of
        token_ids (max_n tokens down to min_n) seen before, the span between that occurrence
        and the end repeated if it is shorter than k; [] when there is none."""
        self.add(token_ids)
        end = len(token_ids)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            at = self._last[n - self.min_n].get(tuple(token_ids[end - n :]))
            if at is not None:
                # What followed the match up to the end, continued with the same period when
                # the match is that close (a loop: the text since `at` repeats).
                period = end - at
                return [token_ids[at + i % period] for i in range(k)]
        return []


# Drafted passes in a row with nothing accepted before a sequence stops drafting for a while.
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE = 64  # passes


class Drafter:
    """One sequence's drafts: its n-gram index, and how many tokens to draft, adapted to how
    its drafts fare. All accepted: two more next time (up to k); some refused: one fewer
    (down to 1). After MISSES_BEFORE_PAUSE drafted passes in a row with none accepted it
    stops drafting for 2, 4, ... up to MAX_PAUSE passes, then tries a single token again: text
    the lookup cannot predict costs about what plain decoding costs, not k wasted rows a
    pass."""

    __slots__ = ("index", "k", "length", "misses", "pause")

    def __init__(self, k: int, min_n: int, max_n: int) -> None:
        self.index = NgramIndex(min_n, max_n)
        self.k = k
        self.length = k
        self.misses = 0
        self.pause = 0

    def propose(self, token_ids: SequenceT[int], limit: int) -> list[int]:
        """Drafts for the next pass, at most `limit` (what the request may still emit)."""
        if self.pause:
            self.pause -= 1
            return []
        return self.index.propose(token_ids, min(self.length, limit)) if limit > 0 else []

    def update(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        if accepted == drafted:
            self.length = min(self.k, self.length + 2)
        else:
            self.length = max(1, self.length - 1)
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.pause = min(MAX_PAUSE, 2 ** (self.misses - MISSES_BEFORE_PAUSE + 1))
            self.length = 1
