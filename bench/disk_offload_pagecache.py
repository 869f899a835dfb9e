"""The page cache of bench/disk_offload_compare.py's files: evicting their pages
(POSIX_FADV_DONTNEED) and counting the bytes still resident (mincore)."""

from __future__ import annotations

import os
import time


def evict_files(paths: list[str], settle_s: float = 5.0) -> int:
    """Drop the files' pages (POSIX_FADV_DONTNEED, repeated while reads settle); returns the
    pages still resident by mincore."""
    from sparkple.runtime.pagecache import file_resident_pages

    deadline = time.monotonic() + settle_s
    while True:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = sum(file_resident_pages(path)[0] for path in paths)
        if left == 0 or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def resident_bytes(paths: list[str]) -> int:
    from sparkple.runtime.pagecache import PAGE_SIZE, file_resident_pages

    return sum(file_resident_pages(path)[0] for path in paths) * PAGE_SIZE
