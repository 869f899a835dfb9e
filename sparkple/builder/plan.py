"""Plan a table build: the snapshot's PLE row shards found, checked tensor by tensor against
the model's geometry, and their order, sizes and source fingerprint recorded.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, fields
from datetime import UTC, datetime

import numpy as np

from ..errors import (
    CheckpointError,
)
from ..geometry import PLEGeometry, RowFormat, text_config
from ..runtime.tablemeta import (
    FORMAT_VERSION,
    SourceFingerprint,
    TableMeta,
    geometry_fields,
)
from .safetensors_io import Snapshot, TensorInfo

BUILDER_VERSION = "sparkple-build-1"
NOT_COMPARED = {"data_file", "built_at", "builder_version", "extra"}
SHARD_RE = re.compile(r"^(?P<emb>.+\.ngram_embedding)\.shard_(?P<i>\d+)\.weight$")


@dataclass
class Shard:
    index: int
    rows: int
    codes: TensorInfo
    scales: TensorInfo | None  # NVFP4 block scales; None for FP8


@dataclass
class Plan:
    """What a snapshot's packed table must contain, checked against the snapshot's headers."""

    snapshot: Snapshot
    emb_prefix: str
    geometry: PLEGeometry
    fmt: RowFormat
    shards: list[Shard]
    global_scale: float
    fingerprint: SourceFingerprint

    @property
    def data_bytes(self) -> int:
        return self.geometry.total_rows * self.fmt.row_width

    def meta(self, data_file: str) -> TableMeta:
        g, f = self.geometry, self.fmt
        return TableMeta(
            format_version=FORMAT_VERSION,
            data_file=data_file,
            data_bytes=self.data_bytes,
            quant=f.quant,
            ple_prefix=self.emb_prefix,
            vllm_param=f"{self.emb_prefix}.weight",
            **geometry_fields(g),
            row_width=f.row_width,
            codes_width=f.codes_width,
            scales_width=f.scales_width,
            codes_dtype=self.shards[0].codes.dtype,
            scales_dtype=self.shards[0].scales.dtype if self.shards[0].scales else None,
            global_scale=self.global_scale,
            source=self.fingerprint,
            builder_version=BUILDER_VERSION,
            built_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )

    def mismatch(self, meta: TableMeta) -> list[str]:
        """How a published table differs from what this snapshot would produce."""
        want = self.meta(meta.data_file)
        return [
            f.name
            for f in fields(TableMeta)
            if f.name not in NOT_COMPARED and getattr(want, f.name) != getattr(meta, f.name)
        ]


def _stored_ints(snap: Snapshot, name: str) -> list[int] | None:
    if name not in snap.weight_map:
        return None
    info = snap.tensor(name)
    if info.dtype != "I64" or len(info.shape) != 1:
        raise CheckpointError(
            f"{info.path}: tensor {name!r} must be I64 [n], got {info.dtype} {list(info.shape)}"
        )
    return [int(v) for v in info.read()]


def _scalar_scale(snap: Snapshot, name: str) -> float:
    info = snap.tensor(name)
    if info.dtype != "F32" or info.shape not in ((1,), ()):
        raise CheckpointError(
            f"{info.path}: tensor {name!r} must be F32 [1], got {info.dtype} {list(info.shape)}"
        )
    value = float(info.read().reshape(-1)[0])
    if not np.isfinite(value) or value <= 0:
        raise CheckpointError(f"{info.path}: tensor {name!r} holds {value}, not a positive scale")
    return value


def plan_build(snapshot_dir: str | os.PathLike[str]) -> Plan:
    """Read a snapshot's index, config and headers and check the PLE shards tensor by tensor."""
    snap = Snapshot(snapshot_dir)
    snap.check_all()
    found: dict[str, list[int]] = {}
    for name in snap.weight_map:
        m = SHARD_RE.match(name)
        if m:
            found.setdefault(m["emb"], []).append(int(m["i"]))
    if not found:
        raise CheckpointError(
            f"{snap.index_path}: no '...ngram_embedding.shard_0.weight' tensor: this snapshot has "
            "no PLE table to pack"
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{snap.index_path}: several PLE tables ({', '.join(sorted(found))}); expected one"
        )
    ((emb, indices),) = found.items()
    indices.sort()
    if indices != list(range(len(indices))):
        missing = sorted(set(range(indices[-1] + 1)) - set(indices))
        raise CheckpointError(
            f"{snap.index_path}: PLE shard indices must be exactly 0..N-1; missing {missing[:10]}"
            + (" ..." if len(missing) > 10 else "")
        )
    module = emb.rsplit(".", 1)[0]
    cfg = snap.config()
    geo = PLEGeometry.from_config(
        cfg,
        stored_multipliers=_stored_ints(snap, f"{module}.layer_multipliers"),
        stored_head_sizes=_stored_ints(snap, f"{module}.ngram_heads_vocab_sizes"),
        stored_head_offsets=_stored_ints(snap, f"{module}.ngram_heads_offsets"),
    )
    if len(indices) != geo.shards:
        raise CheckpointError(
            f"{snap.index_path}: {len(indices)} PLE shards, but config.json split_ngram_parts is "
            f"{geo.shards}; the snapshot and its config do not belong together"
        )
    first = snap.tensor(f"{emb}.shard_0.weight")
    quant = {"U8": "nvfp4", "F8_E4M3": "fp8"}.get(first.dtype)
    if quant is None:
        raise CheckpointError(
            f"{first.path}: tensor {first.name!r} is {first.dtype}; expected U8 (NVFP4 codes) "
            "or F8_E4M3 (FP8 rows)"
        )
    declared = text_config(cfg).get("ple_embedding_dtype")
    if declared is not None and declared != {"nvfp4": "nvfp4", "fp8": "float8_e4m3fn"}[quant]:
        raise CheckpointError(
            f"config.json ple_embedding_dtype is {declared!r} but the shards are {first.dtype}"
        )
    fmt = RowFormat.for_quant(quant, geo.head_dim)
    shards = []
    for i in indices:
        rows = geo.shard_rows(i)
        codes = _checked(snap, f"{emb}.shard_{i}.weight", first.dtype, (rows, fmt.codes_width))
        scales = None
        if quant == "nvfp4":
            scales = _checked(
                snap, f"{emb}.shard_{i}.weight_scale", "F8_E4M3", (rows, fmt.scales_width)
            )
        shards.append(Shard(i, rows, codes, scales))
    scale_name = f"{emb}.weight_scale_2" if quant == "nvfp4" else f"{emb}.weight_scale"
    global_scale = _scalar_scale(snap, scale_name)
    files = [{"name": n, "size": snap.file_size(n)} for n in snap.file_names]
    fingerprint = SourceFingerprint(
        snapshot_id=snap.dir.resolve().name,
        files=files,
        index_sha256=hashlib.sha256(snap.index_bytes).hexdigest(),
    )
    return Plan(snap, emb, geo, fmt, shards, global_scale, fingerprint)


def _checked(snap: Snapshot, name: str, dtype: str, shape: tuple[int, int]) -> TensorInfo:
    info = snap.tensor(name)
    if info.dtype != dtype or info.shape != shape:
        raise CheckpointError(
            f"{info.path}: tensor {name!r} is {info.dtype} {list(info.shape)}, expected {dtype} "
            f"{list(shape)} for this geometry; the snapshot does not match its config.json"
        )
    return info
