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
Pages advised within the last `recent_s` seconds are skipped: re-advising a resident page
costs a system call and gains nothing, and a page evicted since only costs a plain fault.
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

MECHANISMS = ("process_madvise", "fadvise", "madvise")
_IOV_MAX = 1024  # UIO_MAXIOV: the most ranges one process_madvise call accepts
_POOL_MIN_PAGES = 4096  # below this, one thread issues faster than it hands out work
_FAST_CHECK_ROWS = 4096  # batches up to this size first check whether all pages are recent
# Syscalls added since Linux 5.1 have one number on every architecture.
_SYS_PIDFD_OPEN = 434
_SYS_PROCESS_MADVISE = 440


class MappedTable(Protocol):
    """What the prefetcher needs from a table (sparkple.runtime.table.PackedTable has it)."""

    rows: np.ndarray  # read-only 2-D uint8 memmap [total_rows, row_width]
    fd: int  # a separate read-only fd of the data file, for posix_fadvise


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
    recent_s: skip pages advised within the last `recent_s` to `2 * recent_s` seconds (0: never).
    """

    def __init__(
        self,
        table: MappedTable,
        *,
        mechanism: str = "auto",
        threads: int = 2,
        min_rows: int = 0,
        recent_s: float = 10.0,
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
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        npages = -(-(self.total_rows * self.row_width) // PAGE_SIZE)
        self._recent = np.zeros(npages if recent_s > 0 else 0, dtype=bool)
        self._older = np.zeros_like(self._recent)
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
            self._recent, self._older = self._older, self._recent
            self._recent[:] = False
            self._rotated_at = now

    def _all_recent(self, ids: np.ndarray) -> bool:
        """Whether every page of these rows was advised recently (a decode step's few hundred
        rows on a warm table): a few vector operations instead of planning the pages."""
        first = ids * self.row_width
        last = (first + (self.row_width - 1)) // PAGE_SIZE
        first //= PAGE_SIZE
        return bool(
            (self._recent[first] | self._older[first]).all()
            and (self._recent[last] | self._older[last]).all()
        )

    def _fresh_pages(self, pages: np.ndarray) -> np.ndarray:
        if self.recent_s <= 0:
            return pages
        self._rotate()
        new = pages[~(self._recent[pages] | self._older[pages])]
        self._recent[new] = True
        return new

    def forget(self) -> None:
        """Forget which pages were advised (call after evicting the table's pages)."""
        self._recent[:] = False
        self._older[:] = False

    def prefetch(self, row_ids: np.ndarray) -> PrefetchStats:
        t0 = time.perf_counter()
        ids = _check_ids(row_ids, self.total_rows)
        if ids.size < self.min_rows or ids.size == 0:
            return PrefetchStats(ids.size, 0, 0, 0, time.perf_counter() - t0, "skipped")
        if self.recent_s > 0 and ids.size <= _FAST_CHECK_ROWS:
            self._rotate()
            if self._all_recent(ids):
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
            self._in_pool(
                pairs,
                lambda part: [mm.madvise(mmap.MADV_WILLNEED, s, n) for s, n in part.tolist()],
            )
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


POLICIES = ("always", "prefill", "never")


def prefetcher_for(
    table: MappedTable, policy: str, *, prefill_min_tokens: int, rows_per_token: int
) -> Prefetcher | None:
    """The prefetcher a prefetch policy asks for (the vLLM patch's `prefetch_policy`).

    always: every gather (decode steps gain too); prefill: only steps of at least
    `prefill_min_tokens` tokens; never: none (plain page faults).
    """
    if policy not in POLICIES:
        raise ValueError(f"prefetch policy must be one of {POLICIES}, got {policy!r}")
    if policy == "never":
        return None
    if policy == "prefill":
        return Prefetcher(table, min_rows=prefill_min_tokens * rows_per_token)
    return Prefetcher(table)


# --- lookahead: a prompt's later chunks advised while earlier ones run ---------------------


@dataclass
class _Planned:
    """One added prompt: its rows' ids (computed on the lookahead thread) and progress."""

    plan: Callable[[], np.ndarray] | None  # returns int64[T, H] for the prompt's tokens
    ids: np.ndarray | None = None
    advised_to: int = 0  # tokens whose pages were advised (a multiple of the granule)
    consumed_to: int = 0  # tokens a step has gathered
    pending: dict[int, int] | None = None  # granule start -> pages advised, not yet reached


class Lookahead:
    """Advises (WILLNEED) the pages of added prompts' rows before their chunks run.

    When a request is added, `add(key, plan, start)` hands over a function that returns the
    row ids of its whole prompt (int64[T, H]), of which tokens before `start` are computed
    already; the lookahead thread computes them and
    advises their pages in granules of `granule_tokens` tokens, in the order the prompts were
    added, while the pages advised and not yet gathered stay within `window_bytes` of page
    cache (on a GB10 page cache is GPU memory too). Each step reports how far a request's
    prompt was gathered (`consumed`), which moves the window on; `remove` stops a request.

    Counted (in the PLE stats): pages advised, pages used (their granule was reached by a
    step's gather) and pages wasted (advised for a request removed before reaching them).
    """

    def __init__(
        self,
        table: MappedTable,
        window_bytes: int,
        *,
        granule_tokens: int = 64,
        stats: PLEStatsLike | None = None,
        mechanism: str = "auto",
    ) -> None:
        if window_bytes < 0 or granule_tokens < 1:
            raise ValueError(
                f"window_bytes ({window_bytes}) must be >= 0 and granule_tokens "
                f"({granule_tokens}) >= 1"
            )
        self.window_pages = window_bytes // PAGE_SIZE
        self.granule = granule_tokens
        self.stats = stats
        # recent_s=0: every page of a granule is advised and counted (the window accounts
        # for it), whatever another prefetcher advised before
        self._prefetcher = Prefetcher(table, mechanism=mechanism, recent_s=0)
        self._requests: dict[str, _Planned] = {}  # insertion order = advice order
        self._outstanding = 0
        self.peak_outstanding_pages = 0
        self._lock = threading.Condition()
        self._dirty = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="sparkple-lookahead", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- model thread side

    def add(self, key: str, plan: Callable[[], np.ndarray], start: int = 0) -> None:
        """A prompt whose tokens from `start` on will be gathered by later steps."""
        with self._lock:
            self._drop(key)
            self._requests[key] = _Planned(plan, consumed_to=start, advised_to=start)
            self._wake()

    def consumed(self, key: str, upto: int) -> None:
        """Prompt tokens before `upto` are gathered now: their pages are used, and the
        window moves past them."""
        with self._lock:
            req = self._requests.get(key)
            if req is None or upto <= req.consumed_to:
                return
            req.consumed_to = upto
            if req.pending:
                reached = [g for g in req.pending if g < upto]
                used = sum(req.pending.pop(g) for g in reached)
                self._outstanding -= used
                self._count("lookahead_pages_used", used)
            if req.ids is not None and upto >= req.ids.shape[0]:
                self._drop(key)  # its whole prompt is gathered
            self._wake()

    def remove(self, key: str) -> None:
        """The request is gone: nothing more is advised for it; what was not reached is
        counted as wasted."""
        with self._lock:
            self._drop(key)
            self._wake()

    @property
    def outstanding_bytes(self) -> int:
        with self._lock:
            return self._outstanding * PAGE_SIZE

    def idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until the thread has nothing left to do within the window (for tests)."""
        with self._lock:
            return self._lock.wait_for(lambda: not self._dirty, timeout=timeout_s)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake()
        self._thread.join()
        self._prefetcher.close()

    # ---------------------------------------------------------------- lookahead thread

    def _wake(self) -> None:
        self._dirty = True
        self._lock.notify_all()

    def _drop(self, key: str) -> None:
        req = self._requests.pop(key, None)
        if req is not None and req.pending:
            wasted = sum(req.pending.values())
            self._outstanding -= wasted
            self._count("lookahead_pages_wasted", wasted)

    def _count(self, name: str, amount: int) -> None:
        if self.stats is not None and amount:
            self.stats.add(name, amount)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._dirty or self._closed)
                if self._closed:
                    return
                work = self._next()
                if work is None:
                    self._dirty = False
                    self._lock.notify_all()
                    continue
            key, req, first = work
            if req.ids is None:
                assert req.plan is not None
                try:
                    ids = req.plan()  # the prompt's row ids, off the model thread
                except Exception:  # advice is only a hint: the step's own gather still runs
                    ids = np.empty((0, 1), dtype=np.int64)
                with self._lock:
                    req.ids, req.plan = ids, None
                continue
            ids = req.ids[first : first + self.granule]
            pages = plan_page_numbers(ids, self._prefetcher.row_width).size
            with self._lock:
                if self._requests.get(key) is not req or first < req.consumed_to:
                    continue  # removed, or gathered meanwhile
                if self._outstanding + pages > self.window_pages:
                    self._dirty = False  # the window is full until a step moves it
                    self._lock.notify_all()
                    continue
                self._outstanding += pages
                self.peak_outstanding_pages = max(self.peak_outstanding_pages, self._outstanding)
                if req.pending is None:
                    req.pending = {}
                req.pending[first] = pages
                req.advised_to = first + ids.shape[0]
            self._prefetcher.prefetch(ids)  # outside the lock: the model thread never waits
            self._count("lookahead_pages_advised", pages)

    def _next(self) -> tuple[str, _Planned, int] | None:
        """The next granule to advise (first prompt first), or a plan to compute."""
        for key, req in self._requests.items():
            if req.ids is None:
                return key, req, 0
            first = max(req.advised_to, req.consumed_to)
            if first < req.ids.shape[0]:
                return key, req, first
        return None


class PLEStatsLike(Protocol):
    def add(self, name: str, amount: int = 1) -> None: ...
