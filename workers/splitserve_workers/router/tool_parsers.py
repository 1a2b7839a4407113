"""Tool calls found in a model's free text: tool_choice "auto".

A forced call (tool_choice "required" or a named function) is held to its schema by a grammar
(openai_api._tool_choice). With "auto" the model decides, in its own words, whether to call a
tool, and each model family writes a call its own way; a parser per family finds the calls.

`hermes` is the format of Qwen2.5, Qwen3, Hermes and many fine-tunes (their chat templates
render calls the same way, which is how `detect` recognises it): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any text.
Text before the first `<tool_call>` is the answer's content; from it on, the rest is calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def detect(chat_template: str | None) -> str | None:
    """The parser the model's chat template implies (None: calls cannot be recognised)."""
    if chat_template and OPEN in chat_template and CLOSE in chat_template:
        return "hermes"
    return None


def parse(text: str, tool_names: set[str]) -> tuple[str | None, list[dict[str, str]]] | None:
    """(content before the calls or None, [{"name", "arguments" (a JSON string)}]) when the
    text holds calls of the given tools, every one well-formed; None otherwise (the whole text
    is then the answer's content, as a model that mentions the tag is not calling anything)."""
    start = text.find(OPEN)
    if start < 0:
        return None
    rest = text[start:]
    calls = []
    end = 0
    for match in _CALL.finditer(rest):
        if rest[end : match.start()].strip():
            return None  # text between calls: not the format
        end = match.end()
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in tool_names:
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append({"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)})
    if not calls or rest[end:].strip():
        return None
    content = text[:start]
    return (content if content.strip() else None), calls


class StreamSplitter:
    """A streamed answer split as it comes: text that is surely content goes out at once; from
    `<tool_call>` on, text is held until the end, when parse() decides whether it was calls.
    A tail that could be the start of the tag is held back until the next text tells."""

    def __init__(self) -> None:
        self.pending = ""  # a possible beginning of OPEN
        self.held: list[str] | None = None  # from OPEN on

    def feed(self, text: str) -> str:
        """The content this text releases."""
        if self.held is not None:
            self.held.append(text)
            return ""
        text = self.pending + text
        at = text.find(OPEN)
        if at >= 0:
            self.pending, self.held = "", [text[at:]]
            return text[:at]
        keep = next(
            (n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])),
            0,
        )
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> tuple[str, str]:
        """At the end: (content still held back, the text from `<tool_call>` on or "")."""
        held = "".join(self.held) if self.held is not None else ""
        pending, self.pending, self.held = self.pending, "", None
        return pending, held


def calls_with_ids(calls: list[dict[str, str]], call_id: str) -> list[dict[str, Any]]:
    """OpenAI's tool_calls entries: the first call's id is call_id, the next ones suffixed."""
    return [
        {"id": f"{call_id}_{i}" if i else call_id, "type": "function", "function": call}
        for i, call in enumerate(calls)
    ]
