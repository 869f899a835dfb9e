"""Synthetic HF snapshots with the real PLE layout, scaled down by the n-gram vocabulary base.

The table's rows are quantized from random floats (so decoding means something), written with
the real tensor names, 128 shards spread unevenly over several safetensors files in the
index's lexical order. Large tables are written in bounded chunks by drawing rows from a
quantized pool, so a multi-GiB snapshot takes seconds and little memory.

`synth_whole_model` (`sparkple synth-checkpoint --whole-model`) writes a whole tiny model
instead: every weight vLLM's `Qwen4ExpForConditionalGeneration` loader and transformers' load
(random, seeded), a config both accept, and an NVFP4, FP8 or BF16 PLE table; a real engine
generates tokens from it (tests/engine/). The weight names and shapes are written here as code
generates tokens from it (tests/engine/). The weight names and shapes are written as code in
synth_whole_layout.py (`whole_model_weights`); tests/pkg/test_synth.py checks them against
transformers' own model.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..geometry import RowFormat
from .synth_ple_tensors import ple_tensors
from .synth_snapshot_writer import const_chunks, write_snapshot
from .synth_whole_layout import (
    CHAT_TEMPLATE_FILE,
    WHOLE_MODEL_CHAT_TEMPLATE,
    WHOLE_MODEL_EOS,
    WHOLE_MODEL_QUANTS,
    WHOLE_MODEL_ROW_AMAX,
    WHOLE_MODEL_TEXT,
    WHOLE_MODEL_VISION,
    WHOLE_MODEL_VOCAB,
    random_weight,
    whole_model_weights,
)

REAL_VOCAB_SIZE = 248_320
REAL_EOS = 248_044


def make_config(
    *,
    quant: str = "nvfp4",
    vocab_base: int = 1000,
    shards: int = 128,
    divisible_by: int = 128,
    vocab_size: int = REAL_VOCAB_SIZE,
    eos_token_id: int = REAL_EOS,
    ngram_size: int = 3,
    heads_per_ngram: int = 8,
    head_dim: int = 160,
    hash_seed: int = 1234,
) -> dict[str, Any]:
    """A config.json in the shape of Qwen3.8-Flash-Next's, with the PLE keys vLLM reads."""
    text = {
        "model_type": "qwen4_exp_text",
        "vocab_size": vocab_size,
        "eos_token_id": eos_token_id,
        "hidden_size": 256,
        "num_hidden_layers": 4,
        # the real model's native context (vLLM derives its max_model_len bound from it)
        "max_position_embeddings": 262_144,
        "ple_layer_ids": [2],
        "ple_embed_dim": head_dim * (ngram_size - 1) * heads_per_ngram,
        "ple_embedding_dtype": "nvfp4" if quant == "nvfp4" else "float8_e4m3fn",
        "ngram_size": ngram_size,
        "heads_per_ngram": heads_per_ngram,
        "ngram_vocab_size_base": vocab_base,
        "make_ngram_vocab_size_divisible_by": divisible_by,
        "split_ngram_parts": shards,
        "seed": hash_seed,
    }
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "eos_token_id": eos_token_id,
        "text_config": text,
    }


def vocab_base_for_bytes(target_bytes: int, row_width: int = 90, heads: int = 16) -> int:
    """The n-gram vocabulary base whose table is about `target_bytes` big."""
    return max(2, target_bytes // (row_width * heads))


def synth_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    quant: str = "nvfp4",
    vocab_base: int = 1000,
    files: int = 3,
    seed: int = 0,
    shards: int = 128,
    divisible_by: int = 128,
    progress: Callable[[str], None] | None = None,
    **config_kwargs: Any,
) -> Path:
    """Write a synthetic snapshot into out_dir (created) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(
        quant=quant,
        vocab_base=vocab_base,
        shards=shards,
        divisible_by=divisible_by,
        **config_kwargs,
    )
    tensors = ple_tensors(cfg, quant, seed)
    # A few ordinary weights, so readers must pick the PLE tensors out of a real-looking index.
    rng = np.random.default_rng(seed + 2)
    for name, shape in (
        ("model.language_model.embed_tokens.weight", (64, 256)),
        ("model.language_model.norm.weight", (256,)),
        ("lm_head.weight", (64, 256)),
    ):
        tensors[name] = (
            name,
            "BF16",
            shape,
            const_chunks(rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)),
        )
    return write_snapshot(out, cfg, tensors, files, progress)


def whole_model_config(
    *, quant: str = "bf16", vocab_base: int = 300, shards: int = 4, hash_seed: int = 1234
) -> dict[str, Any]:
    """config.json of the whole tiny model: make_config's PLE keys (the real geometry's 16
    heads of 160) over WHOLE_MODEL_TEXT; a BF16 table names no `ple_embedding_dtype`."""
    if quant not in WHOLE_MODEL_QUANTS:
        raise ValueError(f"unknown PLE table type {quant!r}: expected one of {WHOLE_MODEL_QUANTS}")
    cfg = make_config(
        quant="nvfp4" if quant == "bf16" else quant,
        vocab_base=vocab_base,
        shards=shards,
        vocab_size=WHOLE_MODEL_VOCAB,
        eos_token_id=WHOLE_MODEL_EOS,
        hash_seed=hash_seed,
    )
    text = {**cfg["text_config"], **WHOLE_MODEL_TEXT}
    if quant == "bf16":
        del text["ple_embedding_dtype"]
    cfg["text_config"] = text
    cfg["vision_config"] = dict(WHOLE_MODEL_VISION)
    cfg["tie_word_embeddings"] = False
    return cfg


def synth_whole_model(
    out_dir: str | os.PathLike[str],
    *,
    quant: str = "bf16",
    vocab_base: int = 300,
    files: int = 2,
    seed: int = 0,
    shards: int = 4,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write the whole tiny model into out_dir (created) and return its path: the weights of
    `whole_model_weights` drawn from `seed`, and the PLE table (`quant`: "bf16", "nvfp4" or
    "fp8") with rows drawn from `seed` as synth_checkpoint draws them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = whole_model_config(quant=quant, vocab_base=vocab_base, shards=shards)
    tensors = ple_tensors(cfg, quant, seed, WHOLE_MODEL_ROW_AMAX)
    rng = np.random.default_rng([seed, 0x5EED])
    for name, shape, init in whole_model_weights(cfg):
        tensors[name] = (name, "BF16", shape, const_chunks(random_weight(rng, shape, init)))
    snapshot = write_snapshot(out, cfg, tensors, files, progress)
    (snapshot / CHAT_TEMPLATE_FILE).write_text(WHOLE_MODEL_CHAT_TEMPLATE)
    return snapshot


def add_parser(subparsers: Any, name: str) -> None:
    p = subparsers.add_parser(
        name,
        help="write a synthetic HF snapshot with the real PLE layout",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("out", type=Path, help="directory to write the snapshot into")
    p.add_argument(
        "--quant",
        choices=["nvfp4", "fp8", "bf16"],
        default=None,
        help="the PLE table's type (default nvfp4; bf16 only with --whole-model, its default)",
    )
    p.add_argument(
        "--whole-model",
        action="store_true",
        help="a whole tiny model (every weight vLLM and transformers load, random) instead of "
        "the PLE tensors alone; default vocab base 300, 4 shards, 2 files",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--vocab-base",
        type=int,
        default=None,
        help="ngram_vocab_size_base (head sizes are the primes above it; default 1000)",
    )
    size.add_argument(
        "--table-gib",
        type=float,
        default=None,
        help="pick the vocab base so the packed table is about this many GiB",
    )
    p.add_argument(
        "--files", type=int, default=None, help="number of safetensors files (default 3)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed of the row values")
    p.add_argument("--shards", type=int, default=None, help="split_ngram_parts (default 128)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    whole = bool(args.whole_model)
    files = args.files if args.files is not None else (2 if whole else 3)
    shards = args.shards if args.shards is not None else (4 if whole else 128)
    quant = args.quant or ("bf16" if whole else "nvfp4")
    if files < 1 or shards < 1 or (args.vocab_base is not None and args.vocab_base < 2):
        print(
            "synth-checkpoint: --files and --shards must be >= 1, --vocab-base >= 2",
            file=sys.stderr,
        )
        return 2
    if quant == "bf16" and not whole:
        print("synth-checkpoint: --quant bf16 needs --whole-model", file=sys.stderr)
        return 2
    if whole and args.table_gib is not None:
        print(
            "synth-checkpoint: --whole-model takes --vocab-base, not --table-gib", file=sys.stderr
        )
        return 2
    if whole:
        make, base = synth_whole_model, args.vocab_base or 300
    else:
        width = RowFormat.for_quant(quant, 160).row_width  # make_config's head_dim
        make, base = synth_checkpoint, args.vocab_base or 1000
        if args.table_gib is not None:
            base = vocab_base_for_bytes(int(args.table_gib * 2**30), width)
    path = make(
        args.out,
        quant=quant,
        vocab_base=base,
        files=files,
        seed=args.seed,
        shards=shards,
        progress=lambda line: print(line, flush=True),
    )
    if whole:
        print(f"wrote a whole tiny model with a {quant} PLE table to {path}")
    else:
        print(f"wrote synthetic {quant} snapshot to {path} (ngram_vocab_size_base {base})")
    return 0
