"""Writing a synthetic snapshot's files: the Tensor tuple, safetensors files streamed chunk by
chunk, the tensors split unevenly over several files, the index, config.json and the tokenizer."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .safetensors_io import DTYPES
from .tokenizer import write_byte_tokenizer

# A tensor to write: name, safetensors dtype, shape, and a writer of its bytes in chunks.
Tensor = tuple[str, str, tuple[int, ...], Callable[[], Iterator[bytes]]]


def write_safetensors(path: Path, tensors: list[Tensor]) -> None:
    """One safetensors file of `tensors`, in their order, written whole or not at all."""
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


def const_chunks(array: np.ndarray) -> Callable[[], Iterator[bytes]]:
    """The chunk writer of an array held in memory: its bytes in one chunk."""
    return lambda: iter([np.ascontiguousarray(array).tobytes()])


def split_uneven(names: list[str], files: int) -> list[list[str]]:
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


def write_snapshot(
    out: Path,
    cfg: dict[str, Any],
    tensors: dict[str, Tensor],
    files: int,
    progress: Callable[[str], None] | None,
) -> Path:
    """The tensors over `files` safetensors files, the index, config.json and the tokenizer."""
    names = sorted(tensors)  # the index lists keys lexically: shard_1, shard_10, shard_100, ...
    groups = split_uneven(names, files)
    k = len(groups)
    weight_map: dict[str, str] = {}
    total = 0
    for j, group in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{k:05d}.safetensors"
        if progress:
            progress(f"writing {fname} ({len(group)} tensors)")
        write_safetensors(out / fname, [tensors[n] for n in group])
        for n in group:
            weight_map[n] = fname
        total += (out / fname).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # what a client that counts tokens loads (vLLM's serving benchmark): one token per byte
    write_byte_tokenizer(out, max_length=int(cfg.get("max_position_embeddings", 32768)))
    return out
