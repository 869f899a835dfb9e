"""Synthetic HF snapshots with the real PLE layout, scaled down by the n-gram vocabulary base.

The table's rows are quantized from random floats (so decoding means something), written with
the real tensor names, 128 shards spread unevenly over several safetensors files in the
index's lexical order. Large tables are written in bounded chunks by drawing rows from a
quantized pool, so a multi-GiB snapshot takes seconds and little memory.

`synth_whole_model` (`sparkple synth-checkpoint --whole-model`) writes a whole tiny model
instead: every weight vLLM's `Qwen4ExpForConditionalGeneration` loader and transformers' load
(random, seeded), a config both accept, and an NVFP4, FP8 or BF16 PLE table; a real engine
generates tokens from it (tests/engine/). The weight names and shapes are written here as code
(`whole_model_weights`); tests/pkg/test_synth.py checks them against transformers' own model.
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
    tensors = _ple_tensors(cfg, quant, seed)
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
            _const(rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)),
        )
    return _write_snapshot(out, cfg, tensors, files, progress)


def _ple_tensors(
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
    return tensors


def _write_snapshot(
    out: Path,
    cfg: dict[str, Any],
    tensors: dict[str, Tensor],
    files: int,
    progress: Callable[[str], None] | None,
) -> Path:
    """The tensors over `files` safetensors files, the index, config.json and the tokenizer."""
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


# The whole tiny model (`synth_whole_model`): sizes both vLLM 0.34's CPU path and transformers
# accept. Every decoder layer is a linear-attention (GatedDeltaNet) layer: transformers builds a
# full-attention layer only with QSA, which vLLM does not run on a CPU. The linear-attention
# head dims are 128 (vLLM's CPU GDN kernel refuses 32). hc_lowrank 12 with hc_count 4: vLLM
# merges the hyper-connection's down projection (12 rows) and its injection (4 rows) into one
# 16-row weight with no pad rows, which 0.34's loader would find never initialised.
WHOLE_MODEL_TEXT: dict[str, Any] = {
    "model_type": "qwen4_exp_text",
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention"] * 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 2,
    "output_gate_type": "sigmoid",
    "hidden_act": "silu",
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "norm_topk_prob": True,
    "hc_count": 4,
    "hc_lowrank": 12,
    "ple_conv_kernel_size": 4,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
    },
}
# A vision tower as small as transformers builds (vLLM skips it: language_model_only).
WHOLE_MODEL_VISION: dict[str, Any] = {
    "model_type": "qwen4_exp_vision",
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 128,
    "num_position_embeddings": 16,
}
# What `vllm serve` renders a chat into (vLLM refuses a chat completion for a tokenizer without a
# template): the real model's ChatML turns, written byte by byte by the byte-level tokenizer.
# transformers reads it from the model directory beside the tokenizer files.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
WHOLE_MODEL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The byte-level tokenizer's 256 bytes and its end-of-text token (id 256), padded to 320 rows.
WHOLE_MODEL_VOCAB = 320
WHOLE_MODEL_EOS = 256
WHOLE_MODEL_QUANTS = ("bf16", "nvfp4", "fp8")
# The whole model's PLE rows are scaled to this largest magnitude whatever the seed: every seed's
# table has the same global scale (and hash), so a table built from another seed's checkpoint
# passes the packed table's load checks and differs only in its rows.
WHOLE_MODEL_ROW_AMAX = 16.0


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


# How a weight's random values are drawn: "linear" normal / sqrt(fan_in) (the last dim, or all
# but the first), "embed" unit normal, "head" 4 / sqrt(fan_in) (logits of a few units: the top
# token mostly stands clear of BF16 rounding), "norm0" 0.1 x normal (RMSNorms applied as
# 1 + weight), "norm1" 1 + 0.1 x normal (RMSNorms applied as weight), "bias" 0.02 x normal,
# "a_log" log U(1, 16), "zeros".
# The PLE layer's dilated short convolution is zeros, as vLLM and transformers initialise it:
# with random weights vLLM 0.34's PLE short-conv kernel (models/qwen4_exp/common/ops/ple.py,
# under the Triton interpreter on a CPU) gives NaN logits from the first prefill, where
# transformers' are finite. The PLE rows still reach the output through the gated value.
INITS = ("linear", "embed", "head", "norm0", "norm1", "bias", "a_log", "zeros")


def whole_model_weights(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(checkpoint name, shape, init) of every weight of the whole model but the PLE table and
    its hash buffers (`_ple_tensors`), as transformers saves them (experts one by one)."""
    t, v = cfg["text_config"], cfg["vision_config"]
    hidden, vocab = int(t["hidden_size"]), int(t["vocab_size"])
    hc = int(t["hc_count"]) * hidden
    rank = int(t["hc_lowrank"])
    nk, nv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
    dk, dv = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"])
    conv_dim = 2 * nk * dk + nv * dv
    inter, shared = int(t["moe_intermediate_size"]), int(t["shared_expert_intermediate_size"])
    ple_dim = int(t["ple_embed_dim"])
    out: list[tuple[str, tuple[int, ...], str]] = []

    vh, vi = int(v["hidden_size"]), int(v["intermediate_size"])
    merged = vh * int(v["spatial_merge_size"]) ** 2
    patch = int(v["patch_size"])
    vis = "model.visual"
    out += [
        (
            f"{vis}.patch_embed.proj.weight",
            (vh, int(v["in_channels"]), int(v["temporal_patch_size"]), patch, patch),
            "linear",
        ),
        (f"{vis}.patch_embed.proj.bias", (vh,), "bias"),
        (f"{vis}.pos_embed.weight", (int(v["num_position_embeddings"]), vh), "embed"),
    ]
    for i in range(int(v["depth"])):
        block = f"{vis}.blocks.{i}"
        out += [
            (f"{block}.norm1.weight", (vh,), "norm1"),
            (f"{block}.norm1.bias", (vh,), "bias"),
            (f"{block}.norm2.weight", (vh,), "norm1"),
            (f"{block}.norm2.bias", (vh,), "bias"),
            (f"{block}.attn.qkv.weight", (3 * vh, vh), "linear"),
            (f"{block}.attn.qkv.bias", (3 * vh,), "bias"),
            (f"{block}.attn.proj.weight", (vh, vh), "linear"),
            (f"{block}.attn.proj.bias", (vh,), "bias"),
            (f"{block}.mlp.linear_fc1.weight", (vi, vh), "linear"),
            (f"{block}.mlp.linear_fc1.bias", (vi,), "bias"),
            (f"{block}.mlp.linear_fc2.weight", (vh, vi), "linear"),
            (f"{block}.mlp.linear_fc2.bias", (vh,), "bias"),
        ]
    out += [
        (f"{vis}.merger.norm.weight", (vh,), "norm1"),
        (f"{vis}.merger.norm.bias", (vh,), "bias"),
        (f"{vis}.merger.linear_fc1.weight", (merged, merged), "linear"),
        (f"{vis}.merger.linear_fc1.bias", (merged,), "bias"),
        (f"{vis}.merger.linear_fc2.weight", (int(v["out_hidden_size"]), merged), "linear"),
        (f"{vis}.merger.linear_fc2.bias", (int(v["out_hidden_size"]),), "bias"),
    ]

    def mixer(prefix: str, inject: bool) -> list[tuple[str, tuple[int, ...], str]]:
        parts = [
            (f"{prefix}.hc_norm.weight", (hc,), "norm0"),
            (f"{prefix}.input_mix_weight_down.weight", (rank, hc), "linear"),
            (f"{prefix}.input_mix_weight_up.weight", (hc, rank), "linear"),
        ]
        if inject:
            parts.append(
                (f"{prefix}.block_inject_weight.weight", (int(t["hc_count"]), hc), "linear")
            )
        return parts

    lm = "model.language_model"
    out.append((f"{lm}.embed_tokens.weight", (vocab, hidden), "embed"))
    ple_layers = {layer - 1 for layer in t["ple_layer_ids"]}
    for i in range(int(t["num_hidden_layers"])):
        layer = f"{lm}.layers.{i}"
        gdn = f"{layer}.linear_attn"
        out += [
            (f"{gdn}.dt_bias", (nv,), "norm1"),
            (f"{gdn}.A_log", (nv,), "a_log"),
            (f"{gdn}.conv1d.weight", (conv_dim, 1, int(t["linear_conv_kernel_dim"])), "linear"),
            (f"{gdn}.norm.weight", (dv,), "norm1"),
            (f"{gdn}.out_proj.weight", (hidden, nv * dv), "linear"),
            (f"{gdn}.in_proj_qkv.weight", (conv_dim, hidden), "linear"),
            (f"{gdn}.in_proj_z.weight", (nv * dv, hidden), "linear"),
            (f"{gdn}.in_proj_b.weight", (nv, hidden), "linear"),
            (f"{gdn}.in_proj_a.weight", (nv, hidden), "linear"),
        ]
        mlp = f"{layer}.mlp"
        out.append((f"{mlp}.gate.weight", (int(t["num_experts"]), hidden), "linear"))
        for e in range(int(t["num_experts"])):
            out += [
                (f"{mlp}.experts.{e}.gate_proj.weight", (inter, hidden), "linear"),
                (f"{mlp}.experts.{e}.up_proj.weight", (inter, hidden), "linear"),
                (f"{mlp}.experts.{e}.down_proj.weight", (hidden, inter), "linear"),
            ]
        out += [
            (f"{mlp}.shared_expert.gate_proj.weight", (shared, hidden), "linear"),
            (f"{mlp}.shared_expert.up_proj.weight", (shared, hidden), "linear"),
            (f"{mlp}.shared_expert.down_proj.weight", (hidden, shared), "linear"),
            (f"{mlp}.shared_expert_gate.weight", (1, hidden), "linear"),
        ]
        if i in ple_layers:
            ple = f"{layer}.ple"
            out += [
                (f"{ple}.conv1d.weight", (hc, 1, int(t["ple_conv_kernel_size"])), "zeros"),
                (f"{ple}.key_proj.weight", (hc, ple_dim), "linear"),
                (f"{ple}.value_proj.weight", (hidden, ple_dim), "linear"),
                (f"{ple}.norm_key.weight", (hc,), "norm0"),
                (f"{ple}.norm_query.weight", (hc,), "norm0"),
                (f"{ple}.norm_conv.weight", (hc,), "norm0"),
            ]
        out += mixer(f"{layer}.attn_hyper_connection", inject=True)
        out += mixer(f"{layer}.mlp_hyper_connection", inject=True)
    out += mixer(f"{lm}.hyper_connection_mixer", inject=False)
    out.append(("lm_head.weight", (vocab, hidden), "head"))
    return out


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) of float32 values, rounded to nearest even."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _random_weight(rng: np.random.Generator, shape: tuple[int, ...], init: str) -> np.ndarray:
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else 1
    normal = rng.standard_normal(shape, dtype=np.float32)
    if init == "linear":
        values = normal / np.float32(math.sqrt(fan_in))
    elif init == "embed":
        values = normal
    elif init == "head":
        values = normal * np.float32(4 / math.sqrt(fan_in))
    elif init == "norm0":
        values = normal * np.float32(0.1)
    elif init == "norm1":
        values = 1 + normal * np.float32(0.1)
    elif init == "bias":
        values = normal * np.float32(0.02)
    elif init == "a_log":
        values = np.log(rng.uniform(1, 16, size=shape)).astype(np.float32)
    elif init == "zeros":
        values = np.zeros(shape, np.float32)
    else:
        raise ValueError(f"unknown init {init!r}: expected one of {INITS}")
    return float32_to_bf16(values)


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
    tensors = _ple_tensors(cfg, quant, seed, WHOLE_MODEL_ROW_AMAX)
    rng = np.random.default_rng([seed, 0x5EED])
    for name, shape, init in whole_model_weights(cfg):
        tensors[name] = (name, "BF16", shape, _const(_random_weight(rng, shape, init)))
    snapshot = _write_snapshot(out, cfg, tensors, files, progress)
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
