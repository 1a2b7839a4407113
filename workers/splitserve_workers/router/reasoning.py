"""A thinking model's reasoning, split from its answer: `reasoning_content` (vLLM's field).

Qwen3 and DeepSeek-R1 (and their distills) think before they answer, between `<think>` and
`</think>`; clients show that part apart from the answer, or not at all. Two formats:

- `qwen3`: the model writes `<think>` itself; an answer that does not start with it has no
  reasoning (Qwen3 with `enable_thinking: false`, whose template writes an empty block into
  the prompt).
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the answer starts inside
  the reasoning and only `</think>` ends it.

`detect` tells them apart from the chat template. A request's own prompt can say more (`start`):
a template that opens `<think>` itself (QwQ, Qwen3's thinking-only models) starts the answer
inside the reasoning, one that closes it (Qwen3 with `enable_thinking: false`) past it, and a
prefilled answer (`continue_final_message`) goes on where its own text is. The whole answer and
a streamed one are split by the same `Splitter`, so the two always agree.
"""

from __future__ import annotations

from splitserve_workers.router.detok import held_tail

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def detect(chat_template: str | None) -> str | None:
    """The reasoning format the chat template implies; None: no reasoning to split."""
    if not chat_template or CLOSE not in chat_template:
        return None
    if "<｜Assistant｜>" in chat_template:  # noqa: RUF001 - DeepSeek's own token
        return "deepseek_r1"  # R1 (whose answers may skip <think>), its distills, V3.1
    return "qwen3"


def start(prompt: str, prefill: str | None = None) -> str | None:
    """Where a request's answer starts, from how its prompt ends: "reasoning" (the prompt opened
    a block the answer goes on in: QwQ's and Qwen3-Thinking's templates write `<think>`, or a
    prefilled answer left one open), "content" (the prompt closed it, as Qwen3's template with
    `enable_thinking: false`; or a prefilled answer past its reasoning or without any), None:
    the answer tells (the format's rule). `prefill`: the continued message's text."""
    tail = prompt.rstrip()
    if prefill is not None:
        opened, closed = prefill.rfind(OPEN), prefill.rfind(CLOSE)
        if opened != closed:  # one of them is there: the later one tells
            return "reasoning" if opened > closed else "content"
        body = prefill.strip()
        if body and tail.endswith(body):
            tail = tail[: -len(body)].rstrip()
        return "reasoning" if tail.endswith(OPEN) else "content"
    if tail.endswith(OPEN):
        return "reasoning"
    if tail.endswith(CLOSE):
        return "content"
    return None


class Splitter:
    """Feeds an answer's text as it comes and hands back (reasoning, content) pieces. A tail
    that could be the start of a tag is held until the next text tells."""

    def __init__(self, parser: str, begin: str | None = None) -> None:
        self.parser = parser
        # Does an answer that does not open with <think> start inside the reasoning? (deepseek_r1:
        # its prompt opened it; `begin`, from `start`: what this request's prompt says.)
        self.inside = parser == "deepseek_r1" if begin is None else begin == "reasoning"
        # "start": until the answer's first characters tell; then "reasoning" | "content"
        self.state = "content" if begin == "content" else "start"
        self.pending = ""
        self.after_close = False  # drop the newlines that follow </think>

    def feed(self, text: str) -> tuple[str, str]:
        text = self.pending + text
        self.pending = ""
        reasoning = ""
        if self.state == "start":
            stripped = text.lstrip()
            if len(stripped) < len(OPEN) and OPEN.startswith(stripped):
                self.pending = text  # "", whitespace or part of "<think>": not known yet
                return "", ""
            if stripped.startswith(OPEN):
                self.state, text = "reasoning", stripped[len(OPEN) :]
            else:  # deepseek_r1: the prompt opened it; qwen3: no reasoning at all
                self.state = "reasoning" if self.inside else "content"
        if self.state == "reasoning":
            at = text.find(CLOSE)
            if at < 0:
                keep = held_tail(text, (CLOSE,))
                self.pending = text[len(text) - keep :] if keep else ""
                return text[: len(text) - keep], ""
            reasoning, text = text[:at], text[at + len(CLOSE) :]
            self.state, self.after_close = "content", True
        if self.after_close:
            text = text.lstrip("\n")
            if not text:
                return reasoning, ""
            self.after_close = False
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """At the end: what was held back, as (reasoning, content)."""
        pending, self.pending = self.pending, ""
        if self.state == "reasoning" or (self.state == "start" and self.inside):
            return pending, ""
        return "", pending


def split(text: str, parser: str, begin: str | None = None) -> tuple[str | None, str]:
    """A whole answer as (its reasoning or None, its content); `begin` as `start` says."""
    splitter = Splitter(parser, begin)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning or None), content + more_content
