"""Tokenizer: tokenizer.json through the `tokenizers` library, the chat template
(chat_template.jinja, else tokenizer_config.json) rendered with jinja2 the way transformers
renders it, and the EOS ids from generation_config.json.

Used by LLMEngine (stop strings, EOS) and by the router (prompts in, text out). No transformers.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter, not jinja's: jinja's escapes <, >, & and ' as \u003c etc., turns
    # non-ASCII into \uXXXX and sorts keys, so tool calls and tool results would render (and
    # tokenize) differently from the prompt the model was trained on.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_environment() -> Any:
    """The jinja environment transformers compiles chat templates in: sandboxed, trim_blocks and
    lstrip_blocks, loop controls ({% break %}, {% continue %}), its {% generation %} tag (which
    marks assistant text for training masks; here it renders its body unchanged), its tojson,
    raise_exception and strftime_now."""
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _gpt2_byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's bytes_to_unicode), inverted."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_OF_CHAR = _gpt2_byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Prompt tokens decoded in front of the output, as vLLM does: SentencePiece-style (Metaspace)
# decoders drop the leading space of a sequence's first token, which is right for a prompt but
# not for the first generated token.
PROMPT_CONTEXT_TOKENS = 5

# continue_final_message: marks where the continued content ends in the rendered text
# (transformers' own marker, so both cut alike).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def prompt_context(
    decode: Callable[[list[int]], str], prompt_ids: Sequence[int]
) -> tuple[list[int], str]:
    """The last few prompt ids and their text, to decode the output after (the router's
    streamed text, the engine's stop strings). Ids that end in an incomplete UTF-8 character (a
    prompt given as ids may) are dropped: the character's rest in the output would change the
    context's text, so its length would no longer mark where the output's text begins."""
    ids = [int(i) for i in prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS) :]]
    while ids:
        text = decode(ids)
        if not text.endswith("\ufffd"):
            return ids, text
        ids.pop()
    return [], ""


class NoChatTemplate(ValueError):
    """The model ships no chat template: a property of the model, not of the messages."""


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        # Imported here so the model code imports on a box that has torch only (GPU bench).
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model directory {str(model_dir)!r} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").is_file():
            cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        # transformers >= 4.43 saves the template as chat_template.jinja (and, since 5, no longer
        # in tokenizer_config.json); when both exist the file wins, as in transformers.
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            self.chat_template: str | None = template_file.read_text()
        else:
            self.chat_template = self._pick_template(cfg.get("chat_template"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        # EOS ids: generation_config.json is what generate() uses; config.json and the
        # tokenizer's eos_token add to it (models disagree about which file is complete).
        eos: list[int] = []
        for name in ("generation_config.json", "config.json"):
            if (model_dir / name).is_file():
                value = json.loads((model_dir / name).read_text()).get("eos_token_id")
                if isinstance(value, int):
                    eos.append(value)
                elif isinstance(value, list):
                    eos.extend(int(v) for v in value)
        if self.eos_token is not None:
            tid = self._tok.token_to_id(self.eos_token)
            if tid is not None:
                eos.append(tid)
        self.eos_token_ids: list[int] = list(dict.fromkeys(eos))

        # For token_bytes: byte-level BPE (GPT-2's byte alphabet) or SentencePiece-style pieces
        # (▁ for a space, <0xHH> byte fallback); added tokens stand for their own text.
        spec = json.loads(path.read_text())
        decoder = spec.get("decoder") or {}
        parts = decoder.get("decoders") or [decoder]
        self._byte_level = any(d.get("type") == "ByteLevel" for d in parts if isinstance(d, dict))
        added = [t for t in spec.get("added_tokens") or [] if "id" in t]
        self._added_ids = {int(t["id"]) for t in added}
        # decode() leaves these out of the text (skip_special_tokens).
        self._special_ids = {int(t["id"]) for t in added if t.get("special")}
        self._token_bytes: dict[int, bytes] = {}

        env = _template_environment()
        self._template = env.from_string(self.chat_template) if self.chat_template else None

    @staticmethod
    def _pick_template(value: Any) -> str | None:
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            by_name = {t.get("name"): t.get("template") for t in value}
            return by_name.get("default") or next(iter(by_name.values()), None)
        return value if isinstance(value, str) else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: only the batch call releases the GIL while the Rust code
        # runs, so a long prompt tokenized on a thread does not stall the caller's event loop.
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Model vocabularies are often padded past the tokenizer's; such ids have no text.
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    @property
    def spells_every_byte(self) -> bool:
        """Whether every input byte ends up in some token (byte-level BPE, or SentencePiece
        byte fallback): then no token stands for more text than its own bytes. Without it an
        unknown run may fold into one <unk>, however long."""
        return self._byte_level or self._tok.token_to_id("<0x00>") is not None

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text any one token stands for (>= 1)."""
        return max([1, *(len(self.token_bytes(i)) for i in range(self.vocab_size))])

    def to_json(self) -> str:
        """The tokenizer.json this tokenizer was loaded from, re-serialized."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (logprobs' `bytes`): exact for byte-level BPE and for
        SentencePiece-style vocabularies (▁ is a space, <0xHH> one byte); a token may hold part
        of a UTF-8 character. b"" for an id outside the tokenizer's vocabulary."""
        raw = self._token_bytes.get(token_id)
        if raw is not None:
            return raw
        piece = self._tok.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None
        if piece is None:
            raw = b""
        elif token_id in self._added_ids:
            raw = piece.encode()
        elif self._byte_level:
            raw = bytes(_BYTE_OF_CHAR.get(c, 0x3F) for c in piece)
        elif (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = piece.replace("\u2581", " ").encode()
        self._token_bytes[token_id] = raw
        return raw

    def shown_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to decoded text: its token_bytes, none for a special token
        (decode skips those: a prompt's BOS, an end-of-turn token)."""
        return b"" if token_id in self._special_ids else self.token_bytes(token_id)

    def token_text(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token as OpenAI's logprobs show it: the text, or for a token
        that is only part of a UTF-8 character, `bytes:` and its bytes escaped (`bytes:\\xe2`)."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render messages to prompt text. Encode the result with add_special_tokens=False:
        templates write their own BOS. continue_final_message: the text ends with the last
        message's content, without what the template closes a turn with, so the model goes on
        writing that message (transformers' rule: cut after the content's last occurrence)."""
        if self._template is None:
            raise NoChatTemplate(
                "the model has no chat template (neither chat_template.jinja nor "
                "tokenizer_config.json's chat_template); use /v1/completions"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError(f"messages[{i}]: expected an object with 'role' and 'content'")
        final: Any = ""
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError(
                    "continue_final_message: cannot be used with add_generation_prompt"
                )
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise ValueError("continue_final_message: the last message has no text content")
            # As transformers: a marker after the content shows where the template put it (a
            # search for the content itself can find a later copy: "<" in "<|im_end|>").
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **kwargs,
        )
        if not continue_final_message:
            return text
        at = text.rfind(_CONTINUE_TAG.strip())
        if at < 0 or final.strip() not in text:
            raise ValueError(
                "continue_final_message: the chat template does not render the last message's "
                "content as given"
            )
        # The template trimmed the content (the marker's space is gone): so is its end here.
        return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()
