"""Stop strings with SentencePiece-style tokenizers, whose decoders drop the leading space of the
first token decoded: the engine decodes the output after the last few prompt tokens, so a stop
string " word" matches the first generated word (locally and on a decode worker), while text
that is partly the prompt's never matches."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from sentencepiece_tokenizers import SPECIALS
from sentencepiece_tokenizers import sp_tokenizer as make_sp_tokenizer
from splitserve_workers.engine import LLMEngine, SamplingParams
from tokenizers import Tokenizer


def sp_tokenizer(style: str, vocab_size: int) -> Tokenizer:
    """vocab_size pieces over a SentencePiece-style layout (sentencepiece_tokenizers): the
    layout's own, then "▁w0", "▁w1", ..."""
    fixed = len(SPECIALS) + (256 if style == "llama" else 0) + 1
    tok = make_sp_tokenizer(style, [(f"▁w{i}", -1.0) for i in range(vocab_size - fixed)])
    assert tok.get_vocab_size() == vocab_size
    return tok


@pytest.fixture(scope="module", params=["metaspace", "llama"])
def sp_model(
    request: pytest.FixtureRequest, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """tiny-llama's weights with a SentencePiece-style tokenizer filling its vocabulary."""
    style: str = request.param
    model = tmp_path_factory.mktemp(f"sp-{style}") / "model"
    shutil.copytree(tiny_llama, model)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    sp_tokenizer(style, vocab_size).save(str(model / "tokenizer.json"))
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg.update(bos_token="<s>", eos_token="</s>", chat_template=None)
    cfg_path.write_text(json.dumps(cfg))
    return model


def words_prompt(engine: LLMEngine, n: int, salt: int) -> list[int]:
    """n ids of "▁w..." pieces."""
    first = engine.tokenizer.token_to_id("▁w0")
    assert first is not None
    g = torch.Generator().manual_seed(2000 + salt)
    return torch.randint(first, engine.tokenizer.vocab_size, (n,), generator=g).tolist()


def first_word(engine: LLMEngine, max_tokens: int) -> tuple[list[int], list[int], str]:
    """A prompt whose greedy output starts with a "▁w..." piece: (prompt, output, that word)."""
    for salt in range(64):
        prompt = words_prompt(engine, 6, salt)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out = engine.generate([prompt], params)[0]
        piece = engine.tokenizer._tok.id_to_token(out[0])
        if piece and piece.startswith("▁w"):
            return prompt, out, piece[1:]
    raise AssertionError("no prompt's first generated token is a word")


def test_tokenizer_drops_the_first_tokens_space(
    sp_model: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    # The premise: decoding the output alone loses the space that the prompt context keeps.
    tok = make_engine(sp_model).tokenizer
    ids = tok.encode("w1 w2", add_special_tokens=False)
    assert [tok._tok.id_to_token(i) for i in ids] == ["▁w1", "▁w2"]
    assert tok.decode(ids) == "w1 w2"
    assert tok.decode([tok.token_to_id("▁w3"), *ids]) == "w3 w1 w2"


def test_stop_string_with_a_space_matches_the_first_token(
    sp_model: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(sp_model)
    prompt, out, word = first_word(engine, max_tokens=6)
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=6, ignore_eos=True, stop=[f" {word}"])
    )
    assert stopped == [out[:1]]
    # A stop string that only matches with the prompt's last word in front never matches.
    last = engine.tokenizer.decode(prompt[-1:])
    across = f"{last} {word}"
    assert across not in engine.tokenizer.decode(out)
    kept = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, stop=[across]))
    assert kept == [out]


def test_stop_string_later_in_the_output_still_matches(
    sp_model: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    # Past the first window the check decodes the output's tail alone, as before.
    engine = make_engine(sp_model)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for salt in range(16):
        prompt = words_prompt(engine, 6, 100 + salt)
        out = engine.generate([prompt], params)[0]
        for i, token in enumerate(out):
            piece = tok._tok.id_to_token(token)
            stop = " " + piece[1:]
            past_window = i + 1 > 4 * len(stop) + 1
            if past_window and piece.startswith("▁w") and stop not in " " + tok.decode(out[:i]):
                stopped = engine.generate([prompt], replace(params, stop=[stop]))
                assert stopped == [out[: i + 1]]
                return
    raise AssertionError("no output has a new word past the first window")


def test_decode_worker_first_token_matches_a_stop_string(
    sp_model: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    # A decode worker gets the prompt ids and the first token in start_decode: the check sees
    # the same context as a local run.
    b = make_engine(sp_model)
    mc = b.model_config
    prompt = words_prompt(b, 5, salt=0)
    first = b.tokenizer.token_to_id("▁w7")
    kv = torch.zeros(5, mc.num_kv_heads, mc.head_dim)
    for rid, stop in [("hit", " w7"), ("miss", " w8")]:
        assert b.reserve(rid, 5)
        for layer in range(mc.num_layers):
            b.import_kv(rid, layer, 0, kv, kv)
        b.start_decode(rid, prompt, first, SamplingParams(max_tokens=3, stop=[stop]))
        outs = b.step()
        if rid == "hit":
            assert [(o.token_id, o.finished, o.finish_reason) for o in outs] == [
                (None, True, "stop")
            ]
        else:
            assert outs[0].token_id is not None  # the first token did not end it: decoding went on
            b.abort(rid)
            while b.has_unfinished():
                b.step()
    assert b.stats().free_blocks == b.num_kv_blocks


def test_stop_strings_do_not_match_special_tokens_text(
    make_engine: Callable[..., LLMEngine], tiny_llama: Path
) -> None:
    # The router shows the output without special tokens' text (and finds stop strings in
    # that): the engine must not stop on a stop string only a special token's text holds,
    # which would end the answer with "stop" where the client's text has no stop string.
    from splitserve_workers.router.detok import IncrementalDetokenizer

    engine = make_engine(tiny_llama)
    tok = engine.tokenizer
    special = tok.token_to_id("<|im_start|>")  # not EOS
    assert special is not None and special not in engine.eos_token_ids
    prompt = tok.encode("hello", add_special_tokens=True)
    forced = SamplingParams(max_tokens=4, logit_bias={special: 100.0}, stop=["im_"])
    out = engine.generate([prompt], forced)[0]
    assert out == [special] * 4  # ran to max_tokens: "im_" is in no text the client sees
    detok = IncrementalDetokenizer(tok, ["im_"], [], prompt)
    assert detok.add(out) + detok.finish() == "" and not detok.stopped
    # A stop string in the text still ends it, special tokens or not around it.
    plain = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    text = tok.decode(plain)
    stop = next(text[i : i + 2] for i in range(len(text) - 1) if "\ufffd" not in text[i : i + 2])
    got = engine.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert stop in tok.decode(got) and stop not in tok.decode(got[:-1])
