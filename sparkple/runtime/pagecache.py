"""Page-cache residency and eviction of a mapped file (mincore, MADV_DONTNEED, fadvise).

Used to measure (how much of a table is resident) and to make cold measurements (evict a
table's pages); the prefetcher uses the mapping lookup to advise pages of the same map.
Importing it needs only the standard library (the host's metrics program measures a table file
by path with `file_resident_pages`); the functions on mapped arrays use numpy.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

PAGE_SIZE = mmap.PAGESIZE
MINCORE_WINDOW = 1 << 30  # a file is mapped and checked 1 GiB at a time


def underlying_mmap(rows: np.ndarray) -> mmap.mmap | None:
    """The mmap object behind a numpy.memmap (numpy keeps it as `_mmap`), if any."""
    base: object = rows
    while base is not None:
        mm = getattr(base, "_mmap", None)
        if isinstance(mm, mmap.mmap):
            return mm
        if isinstance(base, mmap.mmap):
            return base
        base = getattr(base, "base", None)
    return None


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.mincore.restype = ctypes.c_int
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_BIT0 = bytes(i & 1 for i in range(256))  # only bit 0 of each mincore byte is defined


def _mincore(address: int, length: int) -> bytes:
    """mincore(2) over [address, address + length): one byte per page, 1 when resident."""
    start = address - address % PAGE_SIZE
    npages = -(-(address + length - start) // PAGE_SIZE)
    vec = ctypes.create_string_buffer(npages)
    if npages and _libc.mincore(start, npages * PAGE_SIZE, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore: {os.strerror(err)}")
    return vec.raw[:npages].translate(_BIT0)


def resident_pages(address: int, length: int) -> np.ndarray:
    """mincore(2) over [address, address + length): one bool per page, True when resident."""
    import numpy as np  # here, not at the top: importing this module needs no numpy

    return np.frombuffer(_mincore(address, length), dtype=np.uint8).astype(bool)


def file_resident_pages(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(resident pages, total pages) of the file at `path` in the page cache.

    The file is mapped read-only a window at a time, never read: nothing is faulted in.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        resident = 0
        for offset in range(0, size, MINCORE_WINDOW):
            length = min(MINCORE_WINDOW, size - offset)
            addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
            if addr in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise OSError(err, f"mmap of {Path(path)}: {os.strerror(err)}")
            try:
                resident += _mincore(addr, length).count(1)
            finally:
                _libc.munmap(addr, length)
        return resident, -(-size // PAGE_SIZE)
    finally:
        os.close(fd)


def resident_fraction(rows: np.ndarray) -> float:
    """The fraction of a mapped table's pages that are in the page cache."""
    pages = resident_pages(rows.ctypes.data, rows.nbytes)
    return float(pages.mean()) if pages.size else 1.0


def evict(rows: np.ndarray, fd: int, settle_s: float = 2.0) -> float:
    """Drop a table's pages from the page cache (for cold measurements); returns the fraction
    still resident (0.0 when the table is cold).

    Pages mapped into a process are not dropped by fadvise, so this process's own mapping
    is zapped first (MADV_DONTNEED on a read-only file mapping only unmaps), and dirty pages
    of a freshly written file are flushed, as fadvise skips them. Pages still under read I/O
    (readahead an earlier pass started) cannot be dropped until it completes, so eviction is
    repeated for up to `settle_s`. Other processes that map the file keep their pages.
    """
    mm = underlying_mmap(rows)
    os.fsync(fd)
    deadline = time.monotonic() + settle_s
    while True:
        if mm is not None:
            mm.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        resident = resident_pages(rows.ctypes.data, rows.nbytes)
        if not resident.any() or time.monotonic() >= deadline:
            return float(resident.mean()) if resident.size else 0.0
        time.sleep(0.1)
