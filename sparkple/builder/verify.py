"""Verify and inspect a published table: rows compared byte for byte with the snapshot
(every row, or a sample), and the metadata and health of what is published.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ..runtime.tablemeta import (
    META_NAME,
    read_meta,
)
from .plan import Plan, plan_build
from .progress import Progress
from .stream import DEFAULT_CHUNK_MIB, ShardFiles, stream_rows

DEFAULT_VERIFY_ROWS = 1024


def verify_rows(plan: Plan, data_path: Path, rows: np.ndarray, threads: int = 8) -> list[int]:
    """Rows of the data file that differ from the snapshot (byte comparison).

    Sampled rows are random reads: several threads keep the disk's queue busy.
    """
    parts = [p for p in np.array_split(np.asarray(rows, dtype=np.int64), threads) if p.size]
    with ThreadPoolExecutor(max_workers=max(1, len(parts))) as pool:
        found = pool.map(lambda part: _verify_part(plan, data_path, part), parts)
        return sorted(r for bad in found for r in bad)


def _verify_part(plan: Plan, data_path: Path, rows: np.ndarray) -> list[int]:
    g, f = plan.geometry, plan.fmt
    src = ShardFiles(random_access=True)
    bad = []
    want = np.empty(f.row_width, dtype=np.uint8)
    codes, scales = want[: f.codes_width].data, want[f.codes_width :].data
    fd = os.open(data_path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        for r in rows.tolist():
            shard = plan.shards[r // g.rows_per_shard]
            local = r % g.rows_per_shard
            src.read(shard.codes, local * f.codes_width, codes, drop=False)
            if shard.scales is not None:
                src.read(shard.scales, local * f.scales_width, scales, drop=False)
            if os.pread(fd, f.row_width, r * f.row_width) != want.tobytes():
                bad.append(r)
    finally:
        os.close(fd)
        src.close()
    return bad


def sample_rows(plan: Plan, count: int, seed: int | None = None) -> np.ndarray:
    """`count` random rows plus the first and last row of every shard."""
    g = plan.geometry
    rng = np.random.default_rng(seed)
    edges = [s.index * g.rows_per_shard + e for s in plan.shards if s.rows for e in (0, s.rows - 1)]
    rnd = (
        rng.integers(0, g.total_rows, size=max(0, count)) if g.total_rows else np.empty(0, np.int64)
    )
    return np.unique(np.concatenate([np.asarray(edges, dtype=np.int64), rnd.astype(np.int64)]))


def verify_table(
    snapshot_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    full: bool = False,
    sample: int = DEFAULT_VERIFY_ROWS,
    chunk_mib: float = DEFAULT_CHUNK_MIB,
    log: TextIO | None = None,
    quiet: bool = False,
) -> list[str]:
    """Problems found comparing the published table with the snapshot ([] when it matches)."""
    plan = plan_build(snapshot_dir)
    meta = read_meta(out_dir)
    diff = plan.mismatch(meta)
    if diff:
        return [f"metadata differs from the snapshot in: {', '.join(diff)}"]
    data_path = meta.data_path(out_dir)
    if not full:
        bad = verify_rows(plan, data_path, sample_rows(plan, sample))
        return [f"{len(bad)} sampled rows differ (first {bad[:5]})"] if bad else []
    progress = Progress(plan.data_bytes, f"verify-table {out_dir}", log, quiet)
    problems: list[str] = []
    fd = os.open(data_path, os.O_RDONLY)
    try:
        done = 0
        for offset, data in stream_rows(plan, max(plan.fmt.row_width, int(chunk_mib * 2**20))):
            got = os.pread(fd, len(data), offset)
            os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
            if got != data:
                first = offset // plan.fmt.row_width
                problems.append(
                    f"rows from {first} ({len(data) // plan.fmt.row_width} rows) differ"
                )
                if len(problems) >= 10:
                    break
            done += len(data)
            progress.update(done)
    finally:
        os.close(fd)
        progress.finish()
    return problems


def inspect_table(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    meta = read_meta(out_dir)
    out = Path(out_dir).resolve()
    info: dict[str, Any] = json.loads(meta.to_json())
    info.update(
        data_path=str(meta.data_path(out)),
        meta_path=str(out / META_NAME),
        table_gib=round(meta.data_bytes / 2**30, 3),
        # what the ranks of a pair compare: equal for two builds of one checkpoint revision
        fingerprint=meta.fingerprint(),
        healthy=True,
    )
    return info
