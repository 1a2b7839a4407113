"""The router's detokenizer with prompt context: SentencePiece-style decoders (Metaspace, or
Llama-2/Mistral's Replace/ByteFallback/Fuse/Strip) drop the leading space of the first token
decoded, so the stream decodes the output after the last few prompt ids and yields exactly
decode(prompt + output) minus decode(prompt), stop strings with a leading space included."""

from __future__ import annotations

from pathlib import Path

import pytest
from sentencepiece_tokenizers import sp_tokenizer as make_sp_tokenizer
from splitserve_workers.engine.tokenizer import PROMPT_CONTEXT_TOKENS, Tokenizer
from splitserve_workers.router.detok import IncrementalDetokenizer
from tokenizers import Tokenizer as HFTokenizer

WORDS = ["▁is", "▁tomato", "▁a", "▁red", "▁fruit", "▁the", "▁日本", "▁not"]


def sp_tokenizer(style: str) -> HFTokenizer:
    """WORDS and the letters over the SentencePiece-style layouts (sentencepiece_tokenizers)."""
    pieces = [(w, -1.0) for w in WORDS] + [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    return make_sp_tokenizer(style, pieces)


@pytest.fixture(scope="module", params=["metaspace", "llama"])
def sp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The router's tokenizer class over a SentencePiece-style tokenizer.json."""
    model_dir = tmp_path_factory.mktemp(f"sp-{request.param}")
    sp_tokenizer(request.param).save(str(model_dir / "tokenizer.json"))
    return Tokenizer(Path(model_dir))


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], per_event: int = 1) -> list[str]:
    deltas = [detok.add(ids[i : i + per_event]) for i in range(0, len(ids), per_event)]
    return [*deltas, detok.finish()]


def test_output_alone_loses_its_leading_space(sp: Tokenizer) -> None:
    # The premise: without context the first word's space is gone.
    out = encode(sp, "is tomato")
    assert [sp._tok.id_to_token(i) for i in out] == ["▁is", "▁tomato"]
    assert sp.decode(out) == "is tomato"
    assert "".join(stream(IncrementalDetokenizer(sp), out)) == "is tomato"


@pytest.mark.parametrize("per_event", [1, 3])
@pytest.mark.parametrize("prompt", ["the tomato", "a red fruit is not the tomato", "a"])
def test_stream_equals_decode_with_the_prompt(sp: Tokenizer, prompt: str, per_event: int) -> None:
    bos = sp.token_to_id("<s>")
    assert bos is not None
    prompt_ids = [bos, *encode(sp, prompt)]
    text = "is a red fruit, the 日本 tomato" if sp.token_to_id("<0x41>") else "is a red fruit"
    out = encode(sp, text)
    expected = sp.decode(prompt_ids + out)[len(sp.decode(prompt_ids)) :]
    assert expected == " " + text
    deltas = stream(IncrementalDetokenizer(sp, prompt_ids=prompt_ids), out, per_event)
    assert "".join(deltas) == expected
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize(
    ("stop", "shown"),
    [
        (" is", ""),  # the first token's own space
        (" red", " is a"),
        ("red fruit", " is a "),
        ("tomato is", " is a red fruit"),  # spans the prompt and the output: never matches
    ],
)
def test_stop_string_with_prompt_context(sp: Tokenizer, stop: str, shown: str) -> None:
    prompt_ids = encode(sp, "a red fruit is not the tomato")
    assert len(prompt_ids) > PROMPT_CONTEXT_TOKENS  # only the last few are decoded
    detok = IncrementalDetokenizer(sp, [stop], prompt_ids=prompt_ids)
    deltas = stream(detok, encode(sp, "is a red fruit"))
    assert "".join(deltas) == shown
    assert detok.text == shown
    assert detok.stopped == (stop != "tomato is")


def test_skip_ids_and_special_prompt_tokens(sp: Tokenizer) -> None:
    eos = sp.token_to_id("</s>")
    bos = sp.token_to_id("<s>")
    assert eos is not None and bos is not None
    detok = IncrementalDetokenizer(sp, [], [eos], prompt_ids=[bos])
    # A prompt of special tokens only decodes to "": as decode(prompt + output) would, the
    # first word then has no space in front.
    assert "".join(stream(detok, [*encode(sp, "is tomato"), eos])) == "is tomato"


def test_prompt_ending_inside_a_character_keeps_the_output(tmp_path: Path) -> None:
    # A prompt given as ids may end in the middle of a byte-fallback character: those ids are
    # left out of the context, so the output's text is not shifted by the character's
    # completion (one U+FFFD per byte in the prompt's text would otherwise eat output text).
    sp_tokenizer("llama").save(str(tmp_path / "tokenizer.json"))
    sp = Tokenizer(tmp_path)
    ids = encode(sp, "the 語 is red")
    assert [sp._tok.id_to_token(i) for i in ids] == [
        "▁the", "▁", "<0xE8>", "<0xAA>", "<0x9E>", "▁is", "▁red",
    ]  # fmt: skip
    detok = IncrementalDetokenizer(sp, prompt_ids=ids[:4])
    assert "".join(stream(detok, ids[4:])) == "\ufffd is red"


class ByteDecoder:
    """Token i is byte i, like byte-level BPE: context changes nothing."""

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_byte_level_output_is_unchanged_by_context() -> None:
    text = "é ✓ 你好 STOP x"
    for prompt in [b"", b"a", "prompt ✓".encode(), "ends mid ✓".encode()[:-1]]:
        detok = IncrementalDetokenizer(ByteDecoder(), ["STOP"], prompt_ids=list(prompt))
        deltas = stream(detok, list(text.encode()))
        assert "".join(deltas) == "é ✓ 你好 "
        assert all("\ufffd" not in d for d in deltas)


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny models' byte-level BPE, with their special tokens."""
    from splitserve_workers.engine.make_model import build_tokenizer

    model_dir = tmp_path_factory.mktemp("byte-level")
    build_tokenizer(512, add_bos=False).save(str(model_dir / "tokenizer.json"))
    return Tokenizer(Path(model_dir))


def test_invalid_bytes_go_out_at_once(byte_level: Tokenizer) -> None:
    # Stray continuation bytes (a model biased to one writes a run of them) are U+FFFD
    # whatever follows: they go out at once. Held like an unfinished character, the window
    # grew with the run and every token decoded all of it again (quadratic on the event loop).
    tok = byte_level
    byte = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    decoded: list[int] = []

    class Counting:
        shown_bytes = staticmethod(tok.shown_bytes)

        def decode(self, ids: list[int]) -> str:
            decoded.append(len(ids))
            return tok.decode(ids)

    detok = IncrementalDetokenizer(Counting())
    run = 2000
    assert [detok.add([byte[b"\x8f"]]) for _ in range(run)] == ["\ufffd"] * run
    assert sum(decoded) < 10 * run
    # A character begun after them still waits for the rest of its bytes, across a special
    # token (decoded as nothing) in between.
    im_start = tok.token_to_id("<|im_start|>")
    assert im_start is not None
    assert detok.add([byte[b"\xe4"]]) == ""
    assert detok.add([byte[b"\xbd"], im_start]) == ""
    assert detok.add([byte[b"\xa0"], byte[b"\x8f"]]) == "你\ufffd"
    assert detok.add([byte[b"\xe4"], byte[b"a"]]) == "\ufffda"
    assert detok.finish() == ""
