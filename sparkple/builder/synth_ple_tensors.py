"""The PLE layer's synthetic tensors: a pool of rows quantized from random floats (NVFP4, FP8 or
BF16) and the row shards, global scale and hash buffers drawn from it in bounded chunks."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..geometry import PLEGeometry, RowFormat
from ..runtime.nvfp4 import E4M3_MAX, float32_to_e4m3, global_scale_for, quantize_rows
from .synth_snapshot_writer import Tensor, const_chunks

POOL_ROWS = 65_536
CHUNK_ROWS = 262_144


def ple_module_prefix(decoder_layer: int) -> str:
    return f"model.language_model.layers.{decoder_layer}.ple.ple_embedding"


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


class _RowSource:
    """A pool of rows quantized from random floats; table rows are drawn from it."""

    def __init__(
        self, quant: str, head_dim: int, pool_rows: int, seed: int, amax: float | None = None
    ) -> None:
        rng = np.random.default_rng(seed)
        values = rng.standard_normal((pool_rows, head_dim), dtype=np.float32)
        # Vary the block magnitudes so scales span normal and subnormal E4M3 values.
        exponents = rng.integers(-12, 3, size=(pool_rows, head_dim // 16, 1))
        values.reshape(pool_rows, head_dim // 16, 16)[...] *= np.exp2(exponents, dtype=np.float32)
        if amax is not None:  # one largest magnitude (so one global scale) for every seed
            values *= np.float32(amax / float(np.max(np.abs(values))))
        amax = float(np.max(np.abs(values)))
        if quant == "bf16":  # unquantized rows (the whole model's BF16 table): bf16 bytes
            self.global_scale = 1.0
            self.pool = float32_to_bf16(values).view(np.uint8).reshape(pool_rows, 2 * head_dim)
            return
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


def ple_tensors(
    cfg: dict[str, Any], quant: str, seed: int, amax: float | None = None
) -> dict[str, Tensor]:
    """The PLE layer's tensors of config `cfg`: the row shards (NVFP4 codes and block scales,
    FP8 codes, or BF16 rows), the global scale (not for BF16) and the hash buffers. The rows
    are scaled to the largest magnitude `amax` if given."""
    geo = PLEGeometry.from_config(cfg)
    if quant == "bf16":
        codes_width, scales_width = 2 * geo.head_dim, 0
    else:
        fmt = RowFormat.for_quant(quant, geo.head_dim)
        codes_width, scales_width = fmt.codes_width, fmt.scales_width
    source = _RowSource(quant, geo.head_dim, min(POOL_ROWS, max(1, geo.total_rows)), seed, amax)
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
                    block[:, :codes_width] if part == "weight" else block[:, codes_width:]
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

    codes_dtype = {"nvfp4": "U8", "fp8": "F8_E4M3", "bf16": "BF16"}[quant]
    # BF16 rows: the shape counts elements (head_dim), the chunks are their bytes
    codes_cols = geo.head_dim if quant == "bf16" else codes_width
    for i in range(geo.shards):
        rows = geo.shard_rows(i)
        add(
            f"{emb}.shard_{i}.weight",
            codes_dtype,
            (rows, codes_cols),
            shard_chunks(i, "weight"),
        )
        if quant == "nvfp4":
            add(
                f"{emb}.shard_{i}.weight_scale",
                "F8_E4M3",
                (rows, scales_width),
                shard_chunks(i, "weight_scale"),
            )
    scale = np.array([source.global_scale], dtype=np.float32)
    if quant != "bf16":
        add(
            f"{emb}.weight_scale_2" if quant == "nvfp4" else f"{emb}.weight_scale",
            "F32",
            (1,),
            const_chunks(scale),
        )
    add(
        f"{module}.layer_multipliers",
        "I64",
        (geo.ngram_size,),
        const_chunks(np.array(geo.multipliers, np.int64)),
    )
    add(
        f"{module}.ngram_heads_vocab_sizes",
        "I64",
        (geo.num_heads,),
        const_chunks(np.array(geo.head_sizes, np.int64)),
    )
    add(
        f"{module}.ngram_heads_offsets",
        "I64",
        (geo.num_heads,),
        const_chunks(np.array(geo.head_offsets, np.int64)),
    )
    return tensors
