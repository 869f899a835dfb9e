"""Open a published packed table read-only, checked against what the model expects.

The rows stay on disk: the data file is mapped with numpy.memmap and read through the page
cache, with MADV_RANDOM by default so a 90-byte lookup reads one page, not a readahead
window. A table that does not match its metadata or the caller's expectations is a
TableError naming both sides; nothing ever falls back to loading rows into RAM.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import warnings
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TableError
from ..geometry import PLEGeometry
from .pagecache import evict, resident_fraction, underlying_mmap
from .tablemeta import TableMeta, read_meta

if TYPE_CHECKING:
    import torch

ADVICE = {
    "random": (mmap.MADV_RANDOM, os.POSIX_FADV_RANDOM),
    "normal": (mmap.MADV_NORMAL, os.POSIX_FADV_NORMAL),
    "sequential": (mmap.MADV_SEQUENTIAL, os.POSIX_FADV_SEQUENTIAL),
}
# VmFlags in /proc/self/smaps: "rr" random read, "sr" sequential read, neither: normal.
_VMFLAG_ADVICE = {"rr": "random", "sr": "sequential"}
_META_FIELDS = {f.name for f in fields(TableMeta)}


def check_expect(meta: TableMeta, expect: dict[str, Any], where: Path) -> None:
    unknown = sorted(set(expect) - _META_FIELDS)
    if unknown:
        raise ValueError(f"expect has keys that are not table metadata: {', '.join(unknown)}")
    wrong = []
    for key, want in expect.items():
        have = getattr(meta, key)
        if isinstance(want, float) or isinstance(have, float):
            same = math.isclose(float(have), float(want), rel_tol=1e-6, abs_tol=0.0)
        elif isinstance(want, tuple | list):
            same = list(have) == list(want)
        else:
            same = have == want
        if not same:
            wrong.append(f"{key}: table {have!r}, model expects {want!r}")
    if wrong:
        raise TableError(
            f"the table in {where} does not match the model ({'; '.join(wrong)}): rebuild it "
            "from this model's checkpoint with `sparkple build-table SNAPSHOT OUT_DIR --force`"
        )


def mapping_advice(address: int) -> str | None:
    """The access advice the kernel holds for the mapping containing `address` (from smaps)."""
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("VmFlags:"):
                    flags = line.split()[1:]
                    return next((_VMFLAG_ADVICE[f] for f in flags if f in _VMFLAG_ADVICE), "normal")
    except OSError:
        return None
    return None


class PackedTable:
    """A published table, mapped read-only. Use `open_table()` to make one."""

    def __init__(self, table_dir: Path, meta: TableMeta, fd: int, rows: np.memmap, advice: str):
        self.table_dir = table_dir
        self.meta = meta
        self.fd = fd  # separate from the mapping, for posix_fadvise
        self.rows = rows
        self.advice = advice
        self.data_path = meta.data_path(table_dir)

    @property
    def total_rows(self) -> int:
        return self.meta.total_rows

    @property
    def row_width(self) -> int:
        return self.meta.row_width

    def geometry(self) -> PLEGeometry:
        """The PLE geometry this table was built for (as recorded in its metadata)."""
        return self.meta.geometry()

    def torch_view(self) -> torch.Tensor:
        """The rows as a torch.uint8 [total_rows, row_width] tensor sharing the mapping.

        The mapping is read-only: the tensor must never be written (torch cannot mark it so).
        """
        import torch

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")
            return torch.from_numpy(self.rows)

    def resident_fraction(self) -> float:
        return resident_fraction(self.rows)

    def evict(self) -> float:
        """Drop the table's pages from the page cache (cold measurements, tests); returns the
        fraction still resident."""
        return evict(self.rows, self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        mm = underlying_mmap(self.rows)
        if mm is not None:
            # While views of the rows are alive the mapping stays; it goes with the last one.
            with contextlib.suppress(BufferError):
                mm.close()

    def __enter__(self) -> PackedTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PackedTable({str(self.data_path)!r}, rows={self.total_rows}, "
            f"row_width={self.row_width}, quant={self.meta.quant!r}, advice={self.advice!r})"
        )


def open_table(
    table_dir: str | os.PathLike[str],
    *,
    expect: dict[str, Any] | None = None,
    advice: str = "random",
) -> PackedTable:
    """Open the table published in `table_dir`.

    expect: metadata the model needs (any of total_rows, row_width, quant, format_version,
      num_heads, head_dim, global_scale, or other TableMeta fields); a mismatch is a TableError.
    advice: "random" (serving), "normal" or "sequential" (for measurement).
    """
    if advice not in ADVICE:
        raise ValueError(f"advice must be one of {sorted(ADVICE)}, got {advice!r}")
    where = Path(table_dir)
    meta = read_meta(where)
    if expect:
        check_expect(meta, expect, where)
    if meta.total_rows == 0 or meta.row_width == 0:
        raise TableError(f"the table in {where} has no rows; rebuild it")
    path = meta.data_path(where)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size  # the file we map, not the one read_meta looked at
        if size != meta.data_bytes:
            raise TableError(
                f"{path} is {size} bytes but its metadata says {meta.data_bytes} "
                f"({meta.total_rows} rows x {meta.row_width} B): the file is truncated or was "
                "replaced; rebuild with `sparkple build-table --force`"
            )
        rows = np.memmap(path, dtype=np.uint8, mode="r", shape=(meta.total_rows, meta.row_width))
        madv, fadv = ADVICE[advice]
        mm = underlying_mmap(rows)
        applied = "normal"
        if mm is not None:
            try:
                mm.madvise(madv)
                applied = advice
            except OSError as exc:
                warnings.warn(f"madvise({advice}) on {path} failed: {exc}", stacklevel=2)
        os.posix_fadvise(fd, 0, 0, fadv)  # reads through the fd follow the same advice
        seen = mapping_advice(rows.ctypes.data)
        return PackedTable(where, meta, fd, rows, seen if seen is not None else applied)
    except BaseException:
        os.close(fd)
        raise
