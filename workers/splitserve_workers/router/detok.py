"""Incremental detokenization for streaming: turns token ids arriving one event at a time into
text deltas that never split a multi-byte character, and trims stop strings (text that might be
the start of a stop string is held back until it is known not to be). Used by flow.py's callers
in app.py; the tokenizer is anything with `decode(ids) -> str`."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from typing import Protocol

from splitserve_workers.engine.tokenizer import prompt_context


def held_tail(text: str, tags: Iterable[str], start: int = 0) -> int:
    """Length of the longest tail of text[start:] that could still grow into one of `tags`:
    what a stream holds back until the next piece tells (stop strings here, the tags of tool
    calls and reasoning in tool_parsers.py and reasoning.py)."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text) - start), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Feed token ids, get the new text. Decoding a short window of tokens rather than the whole
    output keeps each step O(window); the window restarts where the last complete text ended, so
    tokenizers that merge spaces or bytes across tokens still come out right. The first window
    starts with the last few `prompt_ids` (only their text's continuation is output), so the
    first generated token comes out as it does after the prompt, leading space included."""

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Iterable[str] = (),
        skip_ids: Iterable[int] = (),
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._ids, _ = prompt_context(tokenizer.decode, prompt_ids)
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids up to here have been turned into text
        self._stop = [s for s in stop if s]
        self._skip = set(skip_ids)
        self._text = ""  # all text decoded so far
        self._emitted = 0  # chars of _text already returned to the caller
        self.stopped = False  # a stop string was found; nothing more will be emitted

    def _decode_new(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self._ids[self._prefix_offset :])
        # An incomplete UTF-8 sequence decodes to U+FFFD: wait for the next token.
        if len(full) > len(prefix) and not (full.endswith("\ufffd") and self._char_pending()):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def _char_pending(self) -> bool:
        """The text ends in U+FFFD: whether that may be a character the next tokens complete,
        rather than bytes no later token can make valid (a stray continuation byte). Waiting on
        those would grow the decode window with every token, each step decoding the whole run
        again: quadratic in a long run of invalid bytes (a model can be biased into one). A
        tokenizer that cannot tell its tokens' bytes always waits."""
        shown_bytes = getattr(self._tok, "shown_bytes", None)
        if shown_bytes is None:
            return True
        # An incomplete character is at most 3 bytes, all after the text already complete.
        tail = b""
        for token_id in reversed(self._ids[self._read_offset :]):
            tail = shown_bytes(token_id) + tail
            if len(tail) >= 4:
                break
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(tail[-4:])
        return bool(decoder.getstate()[0])

    def add(self, token_ids: Iterable[int]) -> str:
        """Returns the text that is safe to show now (may be empty)."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            if token_id in self._skip:
                continue
            self._text += self._decode_new(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The generation ended: returns whatever was held back (minus a stop string)."""
        if self.stopped:
            return ""
        # Flush a trailing incomplete character as the tokenizer renders it.
        if self._read_offset < len(self._ids):
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
            full = self._tok.decode(self._ids[self._prefix_offset :])
            self._text += full[len(prefix) :]
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop:
            # A stop string can only start in text not yet shown: any tail that could begin
            # one is held back until it is resolved.
            hits = [i for s in self._stop if (i := self._text.find(s, self._emitted)) >= 0]
            if hits:
                cut = min(hits)
                out = self._text[self._emitted : cut]
                self._emitted = cut
                self.stopped = True
                return out
        end = len(self._text)
        if not final and self._stop:
            end -= self._held_back()
        out = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        return held_tail(self._text, self._stop, self._emitted)

    @property
    def text(self) -> str:
        """All text shown so far."""
        return self._text[: self._emitted]
