"""Page prefetch for a mapped packed table: plan the pages a batch touches, advise WILLNEED.

With MADV_RANDOM every cold row is one synchronous page fault, served one at a time. Telling
the kernel about all of a batch's pages first puts their reads in flight together, so the
gather that follows waits for the device at depth instead of for each fault in turn.

Mechanisms, fastest first (measured side by side in bench/ple_io.py):
- `process_madvise`: MADV_WILLNEED for up to 1,024 scattered pages per system call (Linux
  5.10+), split over a small thread pool for prefill-sized batches. Cheapest per page.
- `fadvise`: one posix_fadvise(WILLNEED) per coalesced range on the table's own fd: works on
  any Linux, the fallback when process_madvise is missing or refused.
- `madvise`: one madvise(WILLNEED) per range on the mapping (what the reference did per page).
Pages a batch touched within the last `recent_s` seconds (advised, or skipped as recent) are
skipped: re-advising a resident page costs a system call and gains nothing, and a page
evicted since only costs a plain fault. A page in use stays known however long ago it was
advised: a decode step's rows, most of them on pages some earlier batch advised, would
otherwise be advised again every `recent_s` or two (hundreds of system calls on a warm table).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import TableError
from .gather import check_row_range
from .pagecache import PAGE_SIZE, underlying_mmap
from .rowshard import OwnedRows

MECHANISMS = ("process_madvise", "fadvise", "madvise")
_IOV_MAX = 1024  # UIO_MAXIOV: the most ranges one process_madvise call accepts
_POOL_MIN_PAGES = 4096  # below this, one thread issues faster than it hands out work
_FAST_CHECK_ROWS = 4096  # batches up to this size first check whether all pages are recent
_TOUCHED_NOW = 1  # Prefetcher._advised: touched in this period (2: in the one before)
# Syscalls added since Linux 5.1 have one number on every architecture.
_SYS_PIDFD_OPEN = 434
_SYS_PROCESS_MADVISE = 440


class MappedTable(Protocol):
    """What the prefetcher needs from a table (sparkple.runtime.table.PackedTable has it)."""

    @property
    def rows(self) -> np.ndarray:
        """The read-only 2-D uint8 memmap [total_rows, row_width]."""

    @property
    def fd(self) -> int:
        """A separate read-only fd of the data file, for posix_fadvise."""


def _check_ids(row_ids: np.ndarray, total_rows: int) -> np.ndarray:
    ids = np.asarray(row_ids)
    if ids.dtype.kind not in "iu":
        raise TableError(f"row ids must be integers, got dtype {ids.dtype}")
    ids = ids.reshape(-1).astype(np.int64, copy=False)
    check_row_range(ids, total_rows)
    return ids


def plan_page_numbers(
    row_ids: np.ndarray, row_width: int, page_size: int = PAGE_SIZE
) -> np.ndarray:
    """Sorted, distinct page numbers the rows touch (a row may straddle two pages)."""
    ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        return np.empty(0, dtype=np.int64)
    first_byte = ids * row_width
    first = first_byte // page_size
    last = (first_byte + (row_width - 1)) // page_size
    straddle = last != first
    # sort and drop repeats: np.unique does the same about 4x slower on these arrays
    pages = np.sort(np.concatenate((first, last[straddle])))
    keep = np.empty(pages.size, dtype=bool)
    keep[0] = True
    np.not_equal(pages[1:], pages[:-1], out=keep[1:])
    return pages[keep]


def coalesce_pages(pages: np.ndarray, page_size: int = PAGE_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct page numbers -> (start, length) byte ranges of adjacent runs."""
    if pages.size == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty.copy()
    breaks = np.flatnonzero(np.diff(pages) != 1) + 1
    run_first = pages[np.concatenate(([0], breaks))]
    run_last = pages[np.concatenate((breaks - 1, [pages.size - 1]))]
    return run_first * page_size, (run_last - run_first + 1) * page_size


def plan_pages(
    row_ids: np.ndarray, row_width: int, page_size: int = PAGE_SIZE
) -> tuple[np.ndarray, np.ndarray]:
    """The coalesced byte ranges (starts, lengths) covering every page the rows touch."""
    return coalesce_pages(plan_page_numbers(row_ids, row_width, page_size), page_size)


# --- process_madvise through ctypes (no compiled extension needed) -------------------------


class _ProcessMadvise:
    """MADV_WILLNEED over many ranges per call, on this process's own mappings."""

    def __init__(self) -> None:
        if os.uname().sysname != "Linux":
            raise OSError(errno.ENOSYS, "process_madvise is Linux-only")
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self._nr = _SYS_PROCESS_MADVISE
        self._nr_pidfd = _SYS_PIDFD_OPEN
        self._pid = -1
        self._pidfd = -1
        self._lock = threading.Lock()

    def _own_pidfd(self) -> int:
        with self._lock:
            if self._pid != os.getpid():  # first use, or we are a forked child
                pidfd = self._libc.syscall(self._nr_pidfd, os.getpid(), 0)
                if pidfd < 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"pidfd_open: {os.strerror(err)}")
                self._pid, self._pidfd = os.getpid(), pidfd
            return self._pidfd

    def willneed(self, iov: np.ndarray) -> None:
        """iov: uint64[n, 2] of (address, length); issued in batches of 1,024."""
        pidfd = self._own_pidfd()
        base = iov.ctypes.data
        for first in range(0, len(iov), _IOV_MAX):
            count = min(_IOV_MAX, len(iov) - first)
            done = self._libc.syscall(
                self._nr,
                pidfd,
                ctypes.c_void_p(base + first * 16),
                ctypes.c_size_t(count),
                mmap.MADV_WILLNEED,
                0,
            )
            if done < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_madvise(MADV_WILLNEED): {os.strerror(err)}")

    def close(self) -> None:
        with self._lock:
            if self._pidfd >= 0 and self._pid == os.getpid():
                os.close(self._pidfd)
            self._pid, self._pidfd = -1, -1


@dataclass
class PrefetchStats:
    rows: int
    pages: int  # distinct pages the batch touches (0 when not planned: "recent", "skipped")
    issued_pages: int  # pages advised (the rest were advised recently)
    ranges: int  # coalesced ranges advised
    seconds: float
    mechanism: str  # the one used; "recent": all pages advised recently; "skipped": too few


class Prefetcher:
    """Issues WILLNEED for the pages of each batch of row ids before they are gathered.

    mechanism: "auto" (process_madvise, else fadvise), or one of MECHANISMS.
    threads: pool size for prefill-sized batches (process_madvise and madvise).
    min_rows: batches smaller than this are not prefetched (0: prefetch every batch; the
      benchmark shows even one decode token's 16 rows gain from overlapping their faults).
    recent_s: skip pages touched within the last `recent_s` to `2 * recent_s` seconds (0: never).
    owned: a tensor-parallel rank's rows: ids outside them are not advised (the rank never
      reads them).
    """

    def __init__(
        self,
        table: MappedTable,
        *,
        mechanism: str = "auto",
        threads: int = 2,
        min_rows: int = 0,
        recent_s: float = 10.0,
        owned: OwnedRows | None = None,
    ) -> None:
        if mechanism != "auto" and mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be 'auto' or one of {MECHANISMS}, got {mechanism!r}")
        self.rows = table.rows
        self.fd = table.fd
        self.total_rows, self.row_width = self.rows.shape
        self._base = self.rows.ctypes.data
        self._mmap = underlying_mmap(self.rows)
        self.min_rows = min_rows
        self.recent_s = recent_s
        self.owned = owned
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        npages = -(-(self.total_rows * self.row_width) // PAGE_SIZE)
        # per page: bit 1 if touched in this period of recent_s, bit 2 if in the one before
        # (one array: checking that pages are recent is one lookup)
        self._advised = np.zeros(npages if recent_s > 0 else 0, dtype=np.uint8)
        # the first and last byte of a row, from its first byte
        self._row_ends = np.array([0, self.row_width - 1], dtype=np.int64)
        self._rotated_at = time.monotonic()
        self._pm: _ProcessMadvise | None = None
        self.mechanism = self._choose(mechanism)

    def _choose(self, wanted: str) -> str:
        if wanted in ("auto", "process_madvise"):
            try:
                pm = _ProcessMadvise()
                # Probe with an empty range: kernels before 5.10, seccomp filters and some
                # container runtimes refuse the call itself, and that is all we ask here.
                pm.willneed(np.array([[self._base, 0]], dtype=np.uint64))
                self._pm = pm
                return "process_madvise"
            except OSError:
                if wanted == "process_madvise":
                    raise
        if wanted == "madvise" and self._mmap is None:
            raise TableError("madvise prefetch needs a numpy.memmap table (no mmap object found)")
        return "fadvise" if wanted == "auto" else wanted

    def _rotate(self) -> None:
        now = time.monotonic()
        if now - self._rotated_at >= self.recent_s:
            self._advised &= _TOUCHED_NOW  # this period's pages become the period before's
            self._advised <<= 1
            self._rotated_at = now

    def all_recent(self, ids: np.ndarray) -> bool:
        """Whether every page of these rows (int64 ids inside the table) was touched recently
        (then they count as touched now): a decode step's few hundred rows on a warm table,
        checked with a few vector operations instead of planning the pages. False for batches
        over _FAST_CHECK_ROWS rows (planning is cheaper than checking first) and when nothing
        is remembered (recent_s 0)."""
        if self.recent_s <= 0 or ids.size > _FAST_CHECK_ROWS:
            return False
        self._rotate()
        ends = ids.reshape(-1, 1) * self.row_width + self._row_ends
        ends //= PAGE_SIZE
        marks = self._advised[ends]
        if not marks.all():
            return False
        marks |= _TOUCHED_NOW
        self._advised[ends] = marks
        return True

    def _fresh_pages(self, pages: np.ndarray) -> np.ndarray:
        if self.recent_s <= 0:
            return pages
        self._rotate()
        new: np.ndarray = pages[self._advised[pages] == 0]
        self._advised[pages] |= _TOUCHED_NOW  # the recent ones are in use again too
        return new

    def forget(self) -> None:
        """Forget which pages were advised (call after evicting the table's pages)."""
        self._advised[:] = 0

    def prefetch(self, row_ids: np.ndarray) -> PrefetchStats:
        t0 = time.perf_counter()
        ids = _check_ids(row_ids, self.total_rows)
        if self.owned is not None:
            ids = self.owned.select(ids)
        if ids.size < self.min_rows or ids.size == 0:
            return PrefetchStats(ids.size, 0, 0, 0, time.perf_counter() - t0, "skipped")
        if self.all_recent(ids):
            return PrefetchStats(ids.size, 0, 0, 0, time.perf_counter() - t0, "recent")
        pages = plan_page_numbers(ids, self.row_width)
        fresh = self._fresh_pages(pages)
        starts, lengths = coalesce_pages(fresh)
        if starts.size:
            self._issue(starts, lengths)
        return PrefetchStats(
            rows=ids.size,
            pages=pages.size,
            issued_pages=fresh.size,
            ranges=starts.size,
            seconds=time.perf_counter() - t0,
            mechanism=self.mechanism,
        )

    def _issue(self, starts: np.ndarray, lengths: np.ndarray) -> None:
        # Whole pages of checked rows: every range ends within the mapping's last page.
        if self.mechanism == "process_madvise":
            assert self._pm is not None
            iov = np.empty((starts.size, 2), dtype=np.uint64)
            iov[:, 0] = starts.astype(np.uint64) + np.uint64(self._base)
            iov[:, 1] = lengths
            self._in_pool(iov, self._pm.willneed)
        elif self.mechanism == "madvise":
            mm = self._mmap
            assert mm is not None
            pairs = np.stack((starts, lengths), axis=1)

            def advise(part: np.ndarray) -> None:
                for s, n in part.tolist():
                    mm.madvise(mmap.MADV_WILLNEED, s, n)

            self._in_pool(pairs, advise)
        else:
            fd = self.fd
            for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
                os.posix_fadvise(fd, s, n, os.POSIX_FADV_WILLNEED)

    def _in_pool(self, work: np.ndarray, issue: Callable[[np.ndarray], object]) -> None:
        if self.threads == 1 or len(work) < _POOL_MIN_PAGES:
            issue(work)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sparkple-prefetch")
        parts = np.array_split(work, self.threads)
        for future in [self._pool.submit(issue, part) for part in parts]:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        if self._pm is not None:
            self._pm.close()
