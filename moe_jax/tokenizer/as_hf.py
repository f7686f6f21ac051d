"""A tokenizer as the files a Hugging Face model directory holds, for export: a file tokenizer's
own files, and for the built-in `byte` and `char` tokenizers a `tokenizer.json` (the
`tokenizers` library's format, which `AutoTokenizer` / `PreTrainedTokenizerFast` load) that
encodes and decodes exactly as they do, with a tokenizer_config.json holding their chat
template. So the default model, byte-tokenized, leaves moe_jax with a tokenizer.

    byte: a byte-level BPE without merges: token i is byte i (GPT-2's byte-to-character map
          makes every byte a vocabulary entry), decoded through the same map, so a cut
          multi-byte character decodes to U+FFFD as ByteTokenizer.decode gives it;
    char: one vocabulary entry per character of the alphabet, the text split into characters,
          decoded by concatenation.
"""

from __future__ import annotations

import json

from moe_jax.tokenizer.simple import ByteTokenizer, CharTokenizer


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes onto printable characters (the ByteLevel pre-tokenizer's
    and decoder's): printable Latin-1 bytes stand for themselves, the rest for 256 + n."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    chars, n = {b: chr(b) for b in kept}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _byte_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # no regex split: the whole text is one word of bytes (no merges, so nothing differs)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def _char_json(chars: str) -> str:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok.to_str()


def hf_files(tokenizer) -> dict[str, bytes]:
    """{file name: bytes} for an HF model directory: what `AutoTokenizer.from_pretrained`
    loads to encode, decode and render chats as `tokenizer` does."""
    if tokenizer.files:
        return dict(tokenizer.files)
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer_json = _byte_json()
    elif isinstance(tokenizer, CharTokenizer):
        tokenizer_json = _char_json(tokenizer.chars)
    else:  # a kind this module does not know: export the weights alone
        return {}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tokenizer.chat_template,
        "clean_up_tokenization_spaces": False,
    }
    return {
        "tokenizer.json": tokenizer_json.encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8"),
    }
