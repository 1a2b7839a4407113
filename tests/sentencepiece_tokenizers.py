"""Hand-written SentencePiece-style tokenizers (the `tokenizers` library's own types) for the
tests that need a decoder which drops the leading space of the first token it decodes."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

SPECIALS = ["<unk>", "<s>", "</s>"]


def sp_tokenizer(style: str, pieces: list[tuple[str, float]]) -> Tokenizer:
    """A Unigram vocabulary: SPECIALS, (for "llama") the 256 byte pieces, "▁", then `pieces`.
    "metaspace" has a Metaspace pre-tokenizer and decoder; "llama" is Llama-2/Mistral's layout
    (normalizer prepends "▁", byte fallback, decoder Replace/ByteFallback/Fuse/Strip)."""
    vocab = [(s, 0.0) for s in SPECIALS]
    if style == "llama":
        vocab += [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [("▁", -5.0), *pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=style == "llama"))
    if style == "llama":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens(SPECIALS)
    return tok
