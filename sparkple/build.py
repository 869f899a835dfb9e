"""Build, verify and inspect the packed PLE table (build-table, verify-table, inspect-table).

The build streams the checkpoint's row shards in bounded chunks into one file of packed rows
(codes then block scales), row r of shard i at global row i x rows_per_shard + r, and publishes
it atomically: data and metadata are written under temporary names, fsynced and checked, then
the data file and finally table.json are renamed into place. Only the standard library and
numpy are imported on this path, so it runs with the serving image's Python.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import hashlib
import json
import os
import queue
import re
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .errors import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    BuildError,
    CheckpointError,
    SparkpleError,
    TableError,
)
from .geometry import PLEGeometry, RowFormat, text_config
from .safetensors_io import Snapshot, TensorInfo, describe_oserror, open_regular
from .tablemeta import (
    DATA_PREFIX,
    DATA_SUFFIX,
    FORMAT_VERSION,
    META_NAME,
    SourceFingerprint,
    TableMeta,
    data_name,
    geometry_fields,
    read_meta,
)

BUILDER_VERSION = "sparkple-build-1"
DEFAULT_CHUNK_MIB = 8
MAX_CHUNK_MIB = 64  # three chunks of buffers: peak RSS stays under 256 MiB
DEFAULT_VERIFY_ROWS = 1024
LOCK_NAME = ".build.lock"
TMP_PREFIX = ".tmp-"
# Metadata fields that do not depend on the snapshot's content.
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


# ---------------------------------------------------------------------------- streaming


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            raise CheckpointError(
                f"unexpected end of file at offset {offset + done}; the snapshot changed"
            )
        done += n


class _Sources:
    """Open source files. Streaming drops the pages it has used so the page cache stays small."""

    def __init__(self, random_access: bool = False) -> None:
        self.fds: dict[tuple[Path, bool], int] = {}
        # Sampled reads must not pull in readahead around every row.
        self.advice = os.POSIX_FADV_RANDOM if random_access else os.POSIX_FADV_SEQUENTIAL

    def _fd(self, info: TensorInfo) -> int:
        # One fd per file and tensor kind, so codes and scales keep separate readahead state.
        key = (info.path, info.name.endswith("_scale"))
        fd = self.fds.get(key)
        if fd is None:
            fd = self.fds[key] = open_regular(info.path, "safetensors file")[0]
            os.posix_fadvise(fd, 0, 0, self.advice)
        return fd

    def read(self, info: TensorInfo, byte_start: int, buf: memoryview, drop: bool = False) -> None:
        fd = self._fd(info)
        offset = info.offset + byte_start
        _pread_into(fd, buf, offset)
        if drop:
            os.posix_fadvise(fd, offset, len(buf), os.POSIX_FADV_DONTNEED)

    def drop(self, info: TensorInfo) -> None:
        """Drop a whole tensor's pages (once nothing reads near it any more)."""
        os.posix_fadvise(self._fd(info), info.offset, info.nbytes, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _chunks(plan: Plan, chunk_bytes: int) -> Iterator[tuple[Shard, int, int]]:
    """(shard, first row, row count) of each chunk.

    Shards go in the order their rows lie on disk (the index's lexical order, not numeric):
    readahead past the end of one tensor then fetches the next one read, not one already done.
    """
    step = max(1, chunk_bytes // plan.fmt.row_width)
    for shard in sorted(plan.shards, key=lambda s: (str(s.codes.path), s.codes.offset)):
        for start in range(0, shard.rows, step):
            yield shard, start, min(step, shard.rows - start)


class _Staging:
    """The reader thread's buffers for one chunk of NVFP4 codes and scales.

    A whole chunk is read at once: on the disks measured, 2 MiB reads ran at half the speed
    of 8 MiB ones.
    """

    def __init__(self, fmt: RowFormat, rows: int) -> None:
        self.rows = rows
        self.codes = np.empty((self.rows, fmt.codes_width), dtype=np.uint8)
        self.scales = np.empty((self.rows, fmt.scales_width), dtype=np.uint8)


def _fill(
    plan: Plan, src: _Sources, stage: _Staging, out: np.ndarray, shard: Shard, start: int, n: int
) -> memoryview:
    """Packed rows [start, start+n) of a shard, into out[:n]; returns their bytes."""
    f = plan.fmt
    if shard.scales is None:  # FP8: rows are already packed
        view = memoryview(out[:n]).cast("B")
        src.read(shard.codes, start * f.codes_width, view, drop=True)
        return view
    for first in range(0, n, stage.rows):
        k = min(stage.rows, n - first)
        row = start + first
        src.read(shard.codes, row * f.codes_width, memoryview(stage.codes[:k]).cast("B"), True)
        src.read(shard.scales, row * f.scales_width, memoryview(stage.scales[:k]).cast("B"))
        _copy_columns(out[first : first + k], 0, stage.codes, k)
        _copy_columns(out[first : first + k], f.codes_width, stage.scales, k)
    # Scales pages stay until the shard is done: the codes' readahead runs into them (they
    # follow the codes in the file), and dropping them early would read them twice.
    if start + n == shard.rows:
        src.drop(shard.scales)
    return memoryview(out[:n]).cast("B")


def _copy_columns(dst: np.ndarray, col: int, src: np.ndarray, n: int) -> None:
    """dst[:n, col:col+w] = src[:n], moving 8/4/2/1-byte words instead of single bytes.

    Rows are 90 B, so the words are unaligned; numpy still copies them about twice as fast
    as a byte-wise strided copy, which matters at NVMe speeds.
    """
    width = src.shape[1]
    pos = 0
    for size in (8, 4, 2, 1):
        count = (width - pos) // size
        if count == 0:
            continue
        dtype = np.dtype(f"<u{size}")
        d = np.ndarray((n, count), dtype, dst, col + pos, (dst.strides[0], size))
        d[...] = np.ndarray((n, count), dtype, src, pos, (src.strides[0], size))
        pos += count * size


def stream_rows(plan: Plan, chunk_bytes: int, depth: int = 2) -> Iterator[tuple[int, memoryview]]:
    """(table byte offset, packed bytes) for the whole table, read ahead on a thread.

    Memory: `depth` output chunks and one staging chunk, whatever the table size.
    """
    step = max(1, chunk_bytes // plan.fmt.row_width)
    free: queue.Queue[np.ndarray | None] = queue.Queue()
    for _ in range(depth):
        free.put(np.empty((step, plan.fmt.row_width), dtype=np.uint8))
    ready: queue.Queue[Any] = queue.Queue()
    src = _Sources()

    def produce() -> None:
        try:
            stage = _Staging(plan.fmt, step)
            for shard, start, n in _chunks(plan, chunk_bytes):
                out = free.get()
                if out is None:  # the consumer stopped early
                    return
                offset = (shard.index * plan.geometry.rows_per_shard + start) * plan.fmt.row_width
                ready.put((offset, _fill(plan, src, stage, out, shard, start, n), out))
            ready.put(None)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            ready.put(exc)

    thread = threading.Thread(target=produce, name="sparkple-build-reader", daemon=True)
    thread.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            offset, data, out = item
            yield offset, data
            free.put(out)
    finally:
        free.put(None)  # wakes the reader if it waits for a buffer
        thread.join()
        src.close()


# ---------------------------------------------------------------------------- progress


class Progress:
    """A bar on a terminal, plain periodic lines otherwise (for logs)."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None, quiet: bool = False):
        self.total, self.label, self.quiet = max(1, total), label, quiet
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.next_pct = 10

    def update(self, done: int) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        pct = 100 * done / self.total
        rate = done / max(now - self.start, 1e-6) / 2**20
        if self.tty:
            if now - self.last >= 0.2 or done >= self.total:
                bar = "#" * int(pct / 4)
                self.stream.write(f"\r{self.label} [{bar:<25}] {pct:5.1f}% {rate:7.1f} MiB/s")
                self.stream.flush()
                self.last = now
        elif pct >= self.next_pct or now - self.last >= 30:
            self.stream.write(
                f"{self.label}: {done / 2**20:.0f}/{self.total / 2**20:.0f} MiB "
                f"({pct:.0f}%), {rate:.0f} MiB/s\n"
            )
            self.stream.flush()
            self.last = now
            while self.next_pct <= pct:
                self.next_pct += 10

    def finish(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------- build


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock(out: Path) -> int:
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BuildError(f"another build holds {out / LOCK_NAME}; wait for it to finish") from None
    return fd


def _clean_leftovers(out: Path, keep: str | None) -> list[str]:
    """Remove what killed builds left behind: temp files and data files no table.json names."""
    removed = []
    for entry in out.iterdir():
        name = entry.name
        orphan = name.startswith(DATA_PREFIX) and name.endswith(DATA_SUFFIX) and name != keep
        if name.startswith(TMP_PREFIX) or orphan:
            entry.unlink(missing_ok=True)
            removed.append(name)
    return removed


def _current(out: Path) -> tuple[TableMeta | None, str | None]:
    """The published table's metadata, or (None, why not) when table.json is there but bad."""
    if not (out / META_NAME).exists():
        return None, None
    try:
        return read_meta(out), None
    except TableError as exc:
        return None, str(exc)


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
    src = _Sources(random_access=True)
    bad = []
    want = np.empty(f.row_width, dtype=np.uint8)
    codes, scales = memoryview(want[: f.codes_width]), memoryview(want[f.codes_width :])
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


def build_table(
    snapshot_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    force: bool = False,
    chunk_mib: float = DEFAULT_CHUNK_MIB,
    verify_count: int = DEFAULT_VERIFY_ROWS,
    log: TextIO | None = None,
    quiet: bool = False,
) -> tuple[str, TableMeta]:
    """Build (or confirm) the packed table; returns ("built"|"up-to-date", metadata)."""
    log = log or sys.stderr
    plan = plan_build(snapshot_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        meta, broken = _current(out)
        if meta is not None:
            diff = plan.mismatch(meta)
            if not diff:
                _clean_leftovers(out, keep=meta.data_file)
                return "up-to-date", meta
            if not force:
                raise BuildError(
                    f"{out / META_NAME} was built from a different snapshot or geometry "
                    f"(differs in: {', '.join(diff)}); "
                    f"rerun with --force to rebuild it from {plan.snapshot.dir}"
                )
        elif broken is not None and not force:
            raise BuildError(f"{broken}\nrerun with --force to replace it")
        old = meta.data_file if meta is not None else None
        removed = _clean_leftovers(out, keep=old)
        if removed and not quiet:
            print(
                f"removed leftovers of an interrupted build: {', '.join(sorted(removed))}", file=log
            )
        new_meta = _write_and_publish(plan, out, chunk_mib, verify_count, log, quiet)
        if old and old != new_meta.data_file:
            (out / old).unlink(missing_ok=True)
            _fsync_dir(out)
        return "built", new_meta
    finally:
        os.close(lock)


def _write_and_publish(
    plan: Plan, out: Path, chunk_mib: float, verify_count: int, log: TextIO, quiet: bool
) -> TableMeta:
    build_id = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(4)
    tmp_data = out / f"{TMP_PREFIX}{data_name(build_id)}"
    tmp_meta = out / f"{TMP_PREFIX}{build_id}-{META_NAME}"
    try:
        return _write_verify_rename(
            plan, out, build_id, tmp_data, tmp_meta, chunk_mib, verify_count, log, quiet
        )
    except BaseException as exc:
        # A failed build removes its temporary files; a killed one leaves them to the next run.
        tmp_data.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise BuildError(
                f"cannot write the table in {out}: {exc}; free some space or choose another OUT_DIR"
                if exc.errno == errno.ENOSPC
                else f"cannot write the table in {out}: {exc}"
            ) from exc
        raise


def _write_verify_rename(
    plan: Plan,
    out: Path,
    build_id: str,
    tmp_data: Path,
    tmp_meta: Path,
    chunk_mib: float,
    verify_count: int,
    log: TextIO,
    quiet: bool,
) -> TableMeta:
    final_data = data_name(build_id)
    total = plan.data_bytes
    chunk = max(plan.fmt.row_width, int(chunk_mib * 2**20))
    progress = Progress(total, f"build-table {out}", log, quiet)
    t0 = time.monotonic()
    fd = os.open(tmp_data, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        if total:
            os.posix_fallocate(fd, 0, total)
        done = 0
        written: deque[tuple[int, int]] = deque()
        for offset, data in stream_rows(plan, chunk):
            n = os.pwrite(fd, data, offset)
            while n < len(data):
                n += os.pwrite(fd, data[n:], offset + n)
            done += len(data)
            # DONTNEED on dirty pages starts their writeback without waiting; a second one a
            # few chunks later drops them once clean. The page cache stays small, nothing stalls.
            os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
            written.append((offset, len(data)))
            if len(written) > 4:
                os.posix_fadvise(fd, *written.popleft(), os.POSIX_FADV_DONTNEED)
            progress.update(done)
        t1 = time.monotonic()
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        progress.finish()
    t2 = time.monotonic()
    if done != total or tmp_data.stat().st_size != total:
        raise BuildError(
            f"{tmp_data}: wrote {done} of {total} bytes; the snapshot changed during the build"
        )
    sampled = sample_rows(plan, verify_count)
    bad = verify_rows(plan, tmp_data, sampled)
    if bad:
        raise BuildError(
            f"{tmp_data}: {len(bad)} sampled rows differ from the snapshot (first {bad[:5]})"
        )
    meta = plan.meta(final_data)
    meta.extra["build"] = {
        "copy_s": round(t1 - t0, 3),
        "fsync_s": round(t2 - t1, 3),
        "verify_s": round(time.monotonic() - t2, 3),
        "verified_rows": int(sampled.size),
        "chunk_bytes": chunk,
    }
    with open(tmp_meta, "w", encoding="utf-8") as f:
        f.write(meta.to_json())
        f.flush()
        os.fsync(f.fileno())
    # Data first, then the metadata that names it: a reader sees both or neither.
    os.rename(tmp_data, out / final_data)
    _fsync_dir(out)
    os.rename(tmp_meta, out / META_NAME)
    _fsync_dir(out)
    return meta


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
    info = json.loads(meta.to_json())
    info.update(
        data_path=str(meta.data_path(out)),
        meta_path=str(out / META_NAME),
        table_gib=round(meta.data_bytes / 2**30, 3),
        healthy=True,
    )
    return info


# ---------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any, name: str) -> None:
    if name == "build-table":
        p = subparsers.add_parser(name, help="pack a snapshot's PLE shards into one row file")
        p.add_argument("snapshot", type=Path, help="HF snapshot directory (with the index)")
        p.add_argument("out_dir", type=Path, help="table directory (table.json + rows-*.bin)")
        p.add_argument(
            "--force", action="store_true", help="rebuild a table whose metadata does not match"
        )
        p.add_argument(
            "--chunk-mib", type=float, default=DEFAULT_CHUNK_MIB, help="rows copied per chunk (MiB)"
        )
        p.add_argument(
            "--verify-rows",
            type=int,
            default=DEFAULT_VERIFY_ROWS,
            help="random rows compared with the source before publishing",
        )
        p.add_argument("--quiet", action="store_true", help="no progress output")
        p.set_defaults(func=_run_build)
    elif name == "verify-table":
        p = subparsers.add_parser(name, help="compare a published table with its snapshot")
        p.add_argument("snapshot", type=Path)
        p.add_argument("out_dir", type=Path)
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--full", action="store_true", help="compare every byte")
        mode.add_argument(
            "--sample", type=int, default=DEFAULT_VERIFY_ROWS, help="random rows to compare"
        )
        p.add_argument("--quiet", action="store_true")
        p.set_defaults(func=_run_verify)
    elif name == "inspect-table":
        p = subparsers.add_parser(name, help="print a published table's metadata and health")
        p.add_argument("out_dir", type=Path)
        p.add_argument("--json", action="store_true", help="one JSON object on stdout")
        p.set_defaults(func=_run_inspect)
    else:
        raise ValueError(f"sparkple.build has no subcommand {name!r}")


def _usage(msg: str) -> int:
    print(msg, file=sys.stderr)
    return EXIT_USAGE


def _run_build(args: argparse.Namespace) -> int:
    if not args.snapshot.is_dir():
        return _usage(f"build-table: {args.snapshot} is not a directory (expected a HF snapshot)")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        return _usage(f"build-table: {args.out_dir} exists and is not a directory")
    if args.chunk_mib <= 0 or args.chunk_mib > MAX_CHUNK_MIB or args.verify_rows < 0:
        return _usage(
            f"build-table: --chunk-mib must be in (0, {MAX_CHUNK_MIB}] and --verify-rows >= 0"
        )
    t0 = time.monotonic()
    try:
        status, meta = build_table(
            args.snapshot,
            args.out_dir,
            force=args.force,
            chunk_mib=args.chunk_mib,
            verify_count=args.verify_rows,
            quiet=args.quiet,
        )
    except SparkpleError as exc:
        print(f"build-table: {exc}\nnothing new was published in {args.out_dir}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except OSError as exc:
        print(
            f"build-table: {describe_oserror(exc)}\nnothing new was published in {args.out_dir}",
            file=sys.stderr,
        )
        return EXIT_CHECK_FAILED
    where = meta.data_path(args.out_dir)
    if status == "up-to-date":
        print(f"build-table: {where} is up to date with {args.snapshot}; nothing to do")
    else:
        dt = time.monotonic() - t0
        print(
            f"build-table: published {where} ({meta.total_rows} rows x {meta.row_width} B = "
            f"{meta.data_bytes / 2**30:.2f} GiB) in {dt:.1f} s ({_phases(meta)})"
        )
    return EXIT_OK


def _phases(meta: TableMeta) -> str:
    b = meta.extra.get("build", {})
    return (
        f"copy {b.get('copy_s', 0):.1f} s, fsync {b.get('fsync_s', 0):.1f} s, "
        f"verify {b.get('verified_rows', 0)} rows {b.get('verify_s', 0):.1f} s"
    )


def _run_verify(args: argparse.Namespace) -> int:
    if not args.snapshot.is_dir():
        return _usage(f"verify-table: {args.snapshot} is not a directory (expected a HF snapshot)")
    try:
        problems = verify_table(
            args.snapshot, args.out_dir, full=args.full, sample=args.sample, quiet=args.quiet
        )
    except SparkpleError as exc:
        print(f"verify-table: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    except OSError as exc:
        print(f"verify-table: {describe_oserror(exc)}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    for p in problems:
        print(f"verify-table: {p}", file=sys.stderr)
    if problems:
        print(
            f"verify-table: {args.out_dir} does not match {args.snapshot}; "
            "rebuild with build-table --force",
            file=sys.stderr,
        )
        return EXIT_CHECK_FAILED
    print(
        f"verify-table: {args.out_dir} matches {args.snapshot} "
        f"({'every byte' if args.full else 'sampled rows'})"
    )
    return EXIT_OK


def _run_inspect(args: argparse.Namespace) -> int:
    try:
        info = inspect_table(args.out_dir)
    except SparkpleError as exc:
        if args.json:
            print(json.dumps({"healthy": False, "error": str(exc)}))
        print(f"inspect-table: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    if args.json:
        print(json.dumps(info, sort_keys=True))
        return EXIT_OK
    src = info["source"]
    lines = [
        f"table       {info['meta_path']}",
        f"data        {info['data_path']} ({info['data_bytes']} B, {info['table_gib']} GiB)",
        f"format      v{info['format_version']} {info['quant']}, row {info['row_width']} B = "
        f"{info['codes_width']} codes + {info['scales_width']} scales, "
        f"global scale {info['global_scale']:.6g}",
        f"geometry    {info['total_rows']} rows, "
        f"{info['shards']} shards x {info['rows_per_shard']}, "
        f"{info['num_heads']} heads x {info['head_dim']}",
        f"parameter   {info['vllm_param']}",
        f"source      snapshot {src['snapshot_id']}, {len(src['files'])} files, "
        f"index sha256 {src['index_sha256'][:16]}",
        f"built       {info['built_at']} by {info['builder_version']}",
        "health      ok (published, data file size matches)",
    ]
    print("\n".join(lines))
    return EXIT_OK
