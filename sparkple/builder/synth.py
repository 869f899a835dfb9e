"""Synthetic HF snapshots with the real PLE layout, scaled down by the n-gram vocabulary base.

The table's rows are quantized from random floats (so decoding means something), written with
the real tensor names, 128 shards spread unevenly over several safetensors files in the
index's lexical order. Large tables are written in bounded chunks by drawing rows from a
quantized pool, so a multi-GiB snapshot takes seconds and little memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..geometry import PLEGeometry, RowFormat
from ..runtime.nvfp4 import E4M3_MAX, float32_to_e4m3, global_scale_for, quantize_rows
from .safetensors_io import DTYPES
from .tokenizer import write_byte_tokenizer

REAL_VOCAB_SIZE = 248_320
REAL_EOS = 248_044
POOL_ROWS = 65_536
CHUNK_ROWS = 262_144


def ple_module_prefix(decoder_layer: int) -> str:
    return f"model.language_model.layers.{decoder_layer}.ple.ple_embedding"


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


class _RowSource:
    """A pool of rows quantized from random floats; table rows are drawn from it."""

    def __init__(self, quant: str, head_dim: int, pool_rows: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        values = rng.standard_normal((pool_rows, head_dim), dtype=np.float32)
        # Vary the block magnitudes so scales span normal and subnormal E4M3 values.
        exponents = rng.integers(-12, 3, size=(pool_rows, head_dim // 16, 1))
        values.reshape(pool_rows, head_dim // 16, 16)[...] *= np.exp2(exponents, dtype=np.float32)
        amax = float(np.max(np.abs(values)))
        width = RowFormat.for_quant(quant, head_dim).row_width
        self.pool = np.empty((pool_rows, width), dtype=np.uint8)
        if quant == "nvfp4":
            self.global_scale = global_scale_for(amax)
        else:
            self.global_scale = float(np.float32(amax / E4M3_MAX))
        for start in range(0, pool_rows, 4096):  # batches keep the temporaries small
            part = values[start : start + 4096]
            if quant == "nvfp4":
                codes, scales, _ = quantize_rows(part, self.global_scale)
                self.pool[start : start + len(part)] = np.concatenate([codes, scales], axis=1)
            else:
                self.pool[start : start + len(part)] = float32_to_e4m3(
                    part / np.float32(self.global_scale)
                )


# A tensor to write: name, safetensors dtype, shape, and a writer of its bytes in chunks.
Tensor = tuple[str, str, tuple[int, ...], Callable[[], Iterator[bytes]]]


def _write_safetensors(path: Path, tensors: list[Tensor]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, _ in tensors:
        size = math.prod(shape) * DTYPES[dtype][0]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, _, chunks in tensors:
            for chunk in chunks():
                f.write(chunk)
    os.replace(tmp, path)


def _const(array: np.ndarray) -> Callable[[], Iterator[bytes]]:
    return lambda: iter([np.ascontiguousarray(array).tobytes()])


def _split_uneven(names: list[str], files: int) -> list[list[str]]:
    """Contiguous groups of growing size (1, 2, 3, ... parts), so files hold unequal counts."""
    files = max(1, min(files, len(names)))
    weights = np.arange(1, files + 1, dtype=np.float64)
    cuts = np.round(np.cumsum(weights) / weights.sum() * len(names)).astype(int)
    groups, start = [], 0
    for i, end in enumerate(cuts):
        end = max(end, start + 1) if i < files - 1 else len(names)
        groups.append(names[start:end])
        start = end
    return [g for g in groups if g]


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
    geo = PLEGeometry.from_config(cfg)
    fmt = RowFormat.for_quant(quant, geo.head_dim)
    source = _RowSource(quant, geo.head_dim, min(POOL_ROWS, max(1, geo.total_rows)), seed)
    module = ple_module_prefix(geo.decoder_layer)
    emb = f"{module}.ngram_embedding"

    tensors: dict[str, Tensor] = {}

    def add(
        name: str, dtype: str, shape: tuple[int, ...], chunks: Callable[[], Iterator[bytes]]
    ) -> None:
        tensors[name] = (name, dtype, shape, chunks)

    # NVFP4 codes and scales live in separate tensors (often in different files): both draw
    # the same rows because a chunk's pool indices depend only on (seed, shard, start).
    def shard_chunks(shard: int, part: str) -> Callable[[], Iterator[bytes]]:
        def gen() -> Iterator[bytes]:
            rows = geo.shard_rows(shard)
            for start in range(0, rows, CHUNK_ROWS):
                n = min(CHUNK_ROWS, rows - start)
                block = _shard_block(shard, start, n)
                yield (
                    block[:, : fmt.codes_width] if part == "weight" else block[:, fmt.codes_width :]
                ).tobytes()

        return gen

    def _shard_block(shard: int, start: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([seed, shard, start])
        pool = source.pool
        pick = rng.integers(0, pool.shape[0], size=n)
        if geo.total_rows <= pool.shape[0]:  # small tables: every row distinct
            base = shard * geo.rows_per_shard + start
            pick = (np.arange(base, base + n) * 7919 + seed) % pool.shape[0]
        return pool[pick]

    codes_dtype = "U8" if quant == "nvfp4" else "F8_E4M3"
    for i in range(geo.shards):
        rows = geo.shard_rows(i)
        add(
            f"{emb}.shard_{i}.weight",
            codes_dtype,
            (rows, fmt.codes_width),
            shard_chunks(i, "weight"),
        )
        if quant == "nvfp4":
            add(
                f"{emb}.shard_{i}.weight_scale",
                "F8_E4M3",
                (rows, fmt.scales_width),
                shard_chunks(i, "weight_scale"),
            )
    scale = np.array([source.global_scale], dtype=np.float32)
    add(
        f"{emb}.weight_scale_2" if quant == "nvfp4" else f"{emb}.weight_scale",
        "F32",
        (1,),
        _const(scale),
    )
    add(
        f"{module}.layer_multipliers",
        "I64",
        (geo.ngram_size,),
        _const(np.array(geo.multipliers, np.int64)),
    )
    add(
        f"{module}.ngram_heads_vocab_sizes",
        "I64",
        (geo.num_heads,),
        _const(np.array(geo.head_sizes, np.int64)),
    )
    add(
        f"{module}.ngram_heads_offsets",
        "I64",
        (geo.num_heads,),
        _const(np.array(geo.head_offsets, np.int64)),
    )
    # A few ordinary weights, so readers must pick the PLE tensors out of a real-looking index.
    rng = np.random.default_rng(seed + 2)
    for name, shape in (
        ("model.language_model.embed_tokens.weight", (64, 256)),
        ("model.language_model.norm.weight", (256,)),
        ("lm_head.weight", (64, 256)),
    ):
        add(name, "BF16", shape, _const(rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)))

    names = sorted(tensors)  # the index lists keys lexically: shard_1, shard_10, shard_100, ...
    groups = _split_uneven(names, files)
    k = len(groups)
    weight_map: dict[str, str] = {}
    total = 0
    for j, group in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{k:05d}.safetensors"
        if progress:
            progress(f"writing {fname} ({len(group)} tensors)")
        _write_safetensors(out / fname, [tensors[n] for n in group])
        for n in group:
            weight_map[n] = fname
        total += (out / fname).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # what a client that counts tokens loads (vLLM's serving benchmark): one token per byte
    write_byte_tokenizer(out, max_length=int(cfg.get("max_position_embeddings", 32768)))
    return out


def add_parser(subparsers: Any, name: str) -> None:
    p = subparsers.add_parser(
        name,
        help="write a synthetic HF snapshot with the real PLE layout",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("out", type=Path, help="directory to write the snapshot into")
    p.add_argument("--quant", choices=["nvfp4", "fp8"], default="nvfp4")
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
    p.add_argument("--files", type=int, default=3, help="number of safetensors files (default 3)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the row values")
    p.add_argument("--shards", type=int, default=128, help="split_ngram_parts (default 128)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.files < 1 or args.shards < 1 or (args.vocab_base is not None and args.vocab_base < 2):
        print(
            "synth-checkpoint: --files and --shards must be >= 1, --vocab-base >= 2",
            file=sys.stderr,
        )
        return 2
    width = RowFormat.for_quant(args.quant, 160).row_width  # make_config's head_dim
    base = args.vocab_base or 1000
    if args.table_gib is not None:
        base = vocab_base_for_bytes(int(args.table_gib * 2**30), width)
    path = synth_checkpoint(
        args.out,
        quant=args.quant,
        vocab_base=base,
        files=args.files,
        seed=args.seed,
        shards=args.shards,
        progress=lambda line: print(line, flush=True),
    )
    print(f"wrote synthetic {args.quant} snapshot to {path} (ngram_vocab_size_base {base})")
    return 0
