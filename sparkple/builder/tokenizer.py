"""A byte-level tokenizer for the synthetic checkpoint, written without the `tokenizers` package.

Clients that count tokens (vLLM's `vllm bench serve`, which sizes its prompts and reads them
back) load a Hugging Face tokenizer from the model directory. The synthetic checkpoint has no
real vocabulary, so it carries the smallest one that encodes any text: one token per byte
(a byte-level BPE with the 256 byte symbols and no merges) and an end-of-text token. Its ids
are below any synthetic vocabulary's size (at least 256 + 1 rows).
"""

from __future__ import annotations

import json
from pathlib import Path

EOS = "<|endoftext|>"
BYTES = 256


def byte_symbols() -> list[str]:
    """The printable character that stands for each byte in a byte-level BPE vocabulary: the
    printable Latin-1 bytes stand for themselves, every other byte for the next code point
    from 256 up (so no symbol is whitespace or a control character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols, spare = {}, BYTES
    for byte in range(BYTES):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(spare)
            spare += 1
    return [symbols[b] for b in range(BYTES)]


def tokenizer_json() -> dict[str, object]:
    """tokenizer.json in the `tokenizers` library's format (version 1.0)."""
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": BYTES,
                "content": EOS,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }  # fmt: skip
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbol: i for i, symbol in enumerate(byte_symbols())},
            "merges": [],
        },
    }


def write_byte_tokenizer(model_dir: Path, max_length: int) -> None:
    """tokenizer.json and tokenizer_config.json into model_dir (what AutoTokenizer reads)."""
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
