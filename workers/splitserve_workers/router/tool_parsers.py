"""Tool calls found in a model's free text: tool_choice "auto".

A forced call (tool_choice "required" or a named function) is held to its schema by a grammar
(openai_api._tool_choice). With "auto" the model decides, in its own words, whether to call a
tool, and each model family writes a call its own way; a parser per family finds the calls.

`hermes` is the format of Qwen2.5, Qwen3, Hermes and many fine-tunes (their chat templates
render calls the same way, which is how `detect` recognises it): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after any text.
Text before the first `<tool_call>` is the answer's content; from it on, the rest is calls.

`llama3_json` is Llama 3.1-3.3's JSON format: the whole answer is the call(s),
`{"name": ..., "parameters": {...}}`, several separated by `;` (after the `<|python_tag|>`
special token, which detokenizing drops). `detect` knows it by `<|python_tag|>` in the template
(3.1, 3.3) or, as Llama 3.2 1B/3B's template has no built-in tools and so no such token, by an
earlier call rendered as `"parameters": ` in a `<|eot_id|>` turn. An answer that does not start
with `{` is plain content.
"""

from __future__ import annotations

import json
import re
from typing import Any

from splitserve_workers.router.detok import held_tail

PARSERS = ("hermes", "llama3_json")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def detect(chat_template: str | None) -> str | None:
    """The parser the model's chat template implies (None: calls cannot be recognised)."""
    if chat_template and OPEN in chat_template and CLOSE in chat_template:
        return "hermes"
    if chat_template and (
        "<|python_tag|>" in chat_template
        or ('"parameters": ' in chat_template and "<|eot_id|>" in chat_template)
    ):
        return "llama3_json"
    return None


def _call(value: Any, tool_names: set[str], key: str) -> dict[str, str] | None:
    """{"name", "arguments" as a JSON string} of one written call, None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if value["name"] not in tool_names:
        return None
    arguments = value.get(key, {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}


def parse(
    text: str, tool_names: set[str], parser: str = "hermes"
) -> tuple[str | None, list[dict[str, str]]] | None:
    """(content before the calls or None, [{"name", "arguments" (a JSON string)}]) when the
    text holds calls of the given tools, every one well-formed; None otherwise (the whole text
    is then the answer's content, as a model that mentions the tag is not calling anything)."""
    if parser == "llama3_json":
        return _parse_llama3(text, tool_names)
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
            call = _call(json.loads(match.group(1)), tool_names, "arguments")
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    tail = rest[end:].strip()
    if tail.startswith(OPEN) and CLOSE not in tail:
        # The last call unclosed: a stop string "</tool_call>" (or EOS right after the JSON)
        # ends the text there, and the call is whole all the same.
        try:
            call = _call(json.loads(tail[len(OPEN) :]), tool_names, "arguments")
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
        tail = ""
    if not calls or tail:
        return None
    content = text[:start]
    return (content if content.strip() else None), calls


def _parse_llama3(text: str, tool_names: set[str]) -> tuple[None, list[dict[str, str]]] | None:
    text = text.strip()
    if not text.startswith("{"):
        return None
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        key = "parameters" if isinstance(value, dict) and "parameters" in value else "arguments"
        call = _call(value, tool_names, key)
        if call is None:
            return None
        calls.append(call)
        rest = text[at:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        elif rest:
            return None
        at = len(text) - len(rest)
    return None, calls


class StreamSplitter:
    """A streamed answer split as it comes: text that is surely content goes out at once; from
    `<tool_call>` on (hermes), or from the start if it begins with `{` (llama3_json), text is
    held until the end, when parse() decides whether it was calls. A tail that could be the
    start of the tag (or leading whitespace) is held back until the next text tells."""

    def __init__(self, parser: str = "hermes") -> None:
        self.parser = parser
        self.pending = ""  # a possible beginning of OPEN / the whitespace before the first char
        self.held: list[str] | None = None  # from OPEN on
        self.decided = False  # llama3_json: the answer's first character has been seen

    def feed(self, text: str) -> str:
        """The content this text releases."""
        if self.held is not None:
            self.held.append(text)
            return ""
        text = self.pending + text
        if self.parser == "llama3_json":
            if self.decided:
                self.pending = ""
                return text
            if not text.strip():
                self.pending = text
                return ""
            self.pending, self.decided = "", True
            if text.lstrip().startswith("{"):
                self.held = [text]
                return ""
            return text
        at = text.find(OPEN)
        if at >= 0:
            self.pending, self.held = "", [text[at:]]
            return text[:at]
        keep = held_tail(text, (OPEN,))
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
