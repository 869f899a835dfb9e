"""Build the packed PLE table from a planned snapshot (sparkple.builder.plan).

The build streams the checkpoint's row shards in bounded chunks into one file of packed rows
(codes then block scales), row r of shard i at global row i x rows_per_shard + r, and publishes
it atomically: data and metadata are written under temporary names, fsynced and checked, then
the data file and finally table.json are renamed into place. Only the standard library and
numpy are imported on this path, so it runs with the serving image's Python.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import sys
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from ..errors import (
    BuildError,
    TableError,
)
from ..runtime.tablemeta import (
    DATA_PREFIX,
    DATA_SUFFIX,
    META_NAME,
    TableMeta,
    data_name,
    read_meta,
)
from .plan import Plan, plan_build
from .progress import Progress
from .stream import DEFAULT_CHUNK_MIB, stream_rows
from .verify import DEFAULT_VERIFY_ROWS, sample_rows, verify_rows

LOCK_NAME = ".build.lock"
TMP_PREFIX = ".tmp-"


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


def build_table(
    snapshot_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    force: bool = False,
    rebuild: bool = False,
    chunk_mib: float = DEFAULT_CHUNK_MIB,
    verify_count: int = DEFAULT_VERIFY_ROWS,
    log: TextIO | None = None,
    quiet: bool = False,
) -> tuple[str, TableMeta]:
    """Build (or confirm) the packed table; returns ("built"|"up-to-date", metadata).

    force: replace a table built from another snapshot or geometry (the source fingerprint:
    snapshot id, shard files and sizes, the index's sha256). rebuild: build and publish anew
    even when the table is up to date (the new one replaces it only once it is complete).
    """
    log = log or sys.stderr
    plan = plan_build(snapshot_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        meta, broken = _current(out)
        if meta is not None:
            diff = plan.mismatch(meta)
            if not diff and not rebuild:
                _clean_leftovers(out, keep=meta.data_file)
                return "up-to-date", meta
            if diff and not force:
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
