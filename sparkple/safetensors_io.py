"""Strict, zero-copy reading of a HF safetensors snapshot (index + shard files).

Headers are parsed once; tensor data is never loaded: callers get read-only numpy memmaps or
absolute byte ranges to stream from. Anything malformed raises CheckpointError naming the
file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # real headers are a few MiB at most

# safetensors dtype -> (bytes per element, numpy dtype used to view the raw bytes)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E4M3": (1, "uint8"),
    "F8_E5M2": (1, "uint8"),
    "I16": (2, "<i2"),
    "U16": (2, "<u2"),
    "F16": (2, "<f2"),
    "BF16": (2, "<u2"),
    "I32": (4, "<i4"),
    "U32": (4, "<u4"),
    "F32": (4, "<f4"),
    "I64": (8, "<i8"),
    "U64": (8, "<u8"),
    "F64": (8, "<f8"),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    def memmap(self) -> np.ndarray:
        """A read-only view of the tensor's bytes (nothing is read until touched)."""
        np_dtype = np.dtype(DTYPES[self.dtype][1])
        if self.nbytes == 0:
            return np.empty(self.shape, dtype=np_dtype)
        return np.memmap(self.path, dtype=np_dtype, mode="r", offset=self.offset, shape=self.shape)

    def read(self) -> np.ndarray:
        """A small tensor's values, read into memory (for scalars and hash buffers)."""
        return np.array(self.memmap())


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors file's header."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: {size} bytes is too short for a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{path}: header length {header_len} is absurdly large (limit "
                    f"{MAX_HEADER_BYTES}); the file is corrupt or not safetensors"
                )
            if 8 + header_len > size:
                raise CheckpointError(
                    f"{path}: header length {header_len} runs past the end of the {size}-byte "
                    "file; the file is truncated or corrupt, download it again"
                )
            raw = f.read(header_len)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; the snapshot is incomplete") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path} is a directory, not a safetensors file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header must be a JSON object of tensors")
    data_start = 8 + header_len
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_entry(path, name, entry, data_start, data_size)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, end_a, name_a), (begin_b, _, name_b) in zip(spans, spans[1:], strict=False):
        if begin_b < end_a:
            raise CheckpointError(
                f"{path}: tensors {name_a!r} and {name_b!r} overlap; the file is corrupt"
            )
    return tensors


def _tensor_entry(
    path: Path, name: str, entry: object, data_start: int, data_size: int
) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{where}: header entry needs dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    if begin > end or end > data_size:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] lie outside the file's {data_size} data "
            "bytes; the file is truncated or corrupt"
        )
    expected = math.prod(shape) * DTYPES[dtype][0]
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: spans {end - begin} bytes but shape {shape} x {dtype} needs {expected}"
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class Snapshot:
    """A HF snapshot directory: its index and the headers of the files it names."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.index_path = self.dir / INDEX_NAME
        try:
            self.index_bytes = self.index_path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(
                f"{self.index_path} is missing: {self.dir} is not a sharded HF snapshot "
                "(or the download is incomplete)"
            ) from None
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.index_path}: {exc}") from exc
        try:
            index = json.loads(self.index_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.index_path} is not valid JSON ({exc})") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(
                f"{self.index_path}: needs a 'weight_map' object of tensor name -> file name"
            )
        for name, file in weight_map.items():
            if os.path.basename(file) != file or file in ("", ".", ".."):
                raise CheckpointError(
                    f"{self.index_path}: tensor {name!r} maps to bad file {file!r}"
                )
        self.weight_map: dict[str, str] = weight_map
        self._headers: dict[str, dict[str, TensorInfo]] = {}

    @property
    def file_names(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def header(self, file: str) -> dict[str, TensorInfo]:
        if file not in self._headers:
            self._headers[file] = read_header(self.dir / file)
        return self._headers[file]

    def tensor(self, name: str) -> TensorInfo:
        file = self.weight_map.get(name)
        if file is None:
            raise CheckpointError(f"{self.index_path}: no tensor {name!r} in the weight_map")
        info = self.header(file).get(name)
        if info is None:
            raise CheckpointError(
                f"{self.dir / file}: tensor {name!r} is listed in the index but not in this "
                "file's header; the snapshot is inconsistent"
            )
        return info

    def config(self) -> dict:
        path = self.dir / "config.json"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; the snapshot is incomplete") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path} is not readable JSON ({exc})") from exc
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{path} must hold a JSON object")
        return cfg
