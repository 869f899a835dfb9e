"""The on-disk format of a published packed table.

A table directory holds `table.json` (this metadata, published last by an atomic rename) and
the data file it names, `rows-<build_id>.bin`: row r at byte offset r * row_width, total_rows
rows including padding. A table is published iff table.json exists, parses, and names a data
file whose size equals data_bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..errors import TableError
from ..geometry import PLEGeometry

META_NAME = "table.json"
FORMAT_VERSION = 1
DATA_PREFIX = "rows-"
DATA_SUFFIX = ".bin"
# What a fingerprint leaves out: the names and times of one build (each node builds its own
# copy, with its own build id) and the builder's version (the format version fixes the bytes).
NOT_FINGERPRINTED = ("data_file", "built_at", "builder_version", "extra")


# The metadata fields that record the PLE geometry (tuples in PLEGeometry, lists in JSON).
GEOMETRY_FIELDS = (
    "total_rows",
    "rows_per_shard",
    "shards",
    "num_heads",
    "head_dim",
    "head_sizes",
    "head_offsets",
    "ngram_size",
    "heads_per_ngram",
    "eos_token_id",
    "vocab_size",
    "multipliers",
)


def data_name(build_id: str) -> str:
    return f"{DATA_PREFIX}{build_id}{DATA_SUFFIX}"


def geometry_fields(geometry: PLEGeometry) -> dict[str, Any]:
    """The TableMeta keyword arguments that record `geometry`."""
    values = {name: getattr(geometry, name) for name in GEOMETRY_FIELDS}
    return {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}


@dataclass
class SourceFingerprint:
    snapshot_id: str
    files: list[dict[str, Any]]  # [{"name": str, "size": int}], sorted by name
    index_sha256: str


@dataclass
class TableMeta:
    format_version: int
    data_file: str
    data_bytes: int
    quant: str
    ple_prefix: str
    vllm_param: str
    # geometry
    total_rows: int
    rows_per_shard: int
    shards: int
    num_heads: int
    head_dim: int
    head_sizes: list[int]
    head_offsets: list[int]
    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int
    vocab_size: int
    multipliers: list[int]
    # row format
    row_width: int
    codes_width: int
    scales_width: int
    codes_dtype: str
    scales_dtype: str | None
    global_scale: float
    source: SourceFingerprint
    builder_version: str
    built_at: str
    extra: dict[str, Any] = field(default_factory=dict)

    def data_path(self, table_dir: str | os.PathLike[str]) -> Path:
        return Path(table_dir) / self.data_file

    def geometry(self) -> PLEGeometry:
        """The PLE geometry this table was built for."""
        values = {name: getattr(self, name) for name in GEOMETRY_FIELDS}
        values = {name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}
        return PLEGeometry(**values)

    def fingerprinted(self) -> dict[str, Any]:
        """The metadata that fixes the table's bytes: format, geometry, row format, global
        scale and the checkpoint files it was built from."""
        values = asdict(self)
        return {k: v for k, v in sorted(values.items()) if k not in NOT_FINGERPRINTED}

    def fingerprint(self) -> str:
        """sha256 of `fingerprinted()`: equal for two tables built from the same checkpoint
        revision by the same format, wherever and whenever each was built."""
        text = json.dumps(self.fingerprinted(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, *, where: str = "table metadata") -> TableMeta:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TableError(f"{where} is not valid JSON ({exc}); rebuild the table") from exc
        if not isinstance(raw, dict):
            raise TableError(f"{where} must hold a JSON object; rebuild the table")
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise TableError(
                f"{where} has format_version {version!r}, this sparkple reads {FORMAT_VERSION}: "
                "rebuild the table with this version (build-table --force)"
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.name != "extra"}
        missing = sorted(required - raw.keys())
        if missing:
            raise TableError(f"{where} lacks {', '.join(missing)}; rebuild the table")
        src = raw["source"]
        if not isinstance(src, dict) or {"snapshot_id", "files", "index_sha256"} - src.keys():
            raise TableError(f"{where}: 'source' is not a fingerprint object; rebuild the table")
        kwargs = {k: v for k, v in raw.items() if k in names}
        kwargs["source"] = SourceFingerprint(
            snapshot_id=src["snapshot_id"], files=src["files"], index_sha256=src["index_sha256"]
        )
        meta = cls(**kwargs)
        meta._check(where)
        return meta

    def _check(self, where: str) -> None:
        ints = (
            "data_bytes",
            "total_rows",
            "rows_per_shard",
            "shards",
            "num_heads",
            "head_dim",
            "row_width",
            "codes_width",
            "scales_width",
        )
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TableError(f"{where}: {name} must be a non-negative integer, got {value!r}")
        if self.data_bytes != self.total_rows * self.row_width:
            raise TableError(
                f"{where}: data_bytes {self.data_bytes} != total_rows {self.total_rows} x "
                f"row_width {self.row_width}; rebuild the table"
            )
        if self.row_width != self.codes_width + self.scales_width:
            raise TableError(f"{where}: row_width is not codes_width + scales_width")
        if os.path.basename(self.data_file) != self.data_file or not self.data_file.startswith(
            DATA_PREFIX
        ):
            raise TableError(
                f"{where}: data_file {self.data_file!r} is not a plain rows-*.bin name"
            )
        if len(self.head_sizes) != self.num_heads or len(self.head_offsets) != self.num_heads:
            raise TableError(f"{where}: head_sizes/head_offsets do not have num_heads entries")


def read_meta(table_dir: str | os.PathLike[str]) -> TableMeta:
    """The metadata of the table published in `table_dir`; TableError if there is none."""
    path = Path(table_dir) / META_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TableError(
            f"{path} does not exist: no table is published in {table_dir}; "
            "run `sparkple build-table SNAPSHOT OUT_DIR`"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TableError(f"cannot read {path}: {exc}") from exc
    meta = TableMeta.from_json(text, where=str(path))
    data = meta.data_path(table_dir)
    try:
        size = data.stat().st_size
    except FileNotFoundError:
        raise TableError(
            f"{path} names {meta.data_file}, which is missing; rebuild with build-table --force"
        ) from None
    if size != meta.data_bytes:
        raise TableError(
            f"{data} is {size} bytes, {path} says {meta.data_bytes}; "
            "rebuild with build-table --force"
        )
    return meta
