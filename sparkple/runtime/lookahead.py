"""Lookahead for a mapped packed table: a prompt's later chunks advised while earlier ones run.

All the pages a long prompt will touch are known when it arrives: a thread computes the row ids
of each added prompt and advises (WILLNEED, through the prefetcher of .prefetch) the pages of
its tokens beyond the chunk being gathered, within a window of page cache, in the order the
steps will need them: nearer tokens' pages first, and only a bounded amount ahead of the pages
known to be in. Advice for the whole window at once would put tens of thousands of reads in the
device's queue together: they would share the disk with the reads of the chunk being gathered,
and the I/O scheduler need not serve them in the order given (mq-deadline dispatches in disk
order), so the next chunk's pages would come in no sooner than the one after's.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .pagecache import PAGE_SIZE
from .prefetch import MappedTable, Prefetcher, plan_page_numbers
from .rowshard import OwnedRows


@dataclass
class _Planned:
    """One added prompt: its rows' ids (computed on the lookahead thread) and progress."""

    plan: Callable[[], np.ndarray] | None  # returns int64[T, H] for the prompt's tokens
    ids: np.ndarray | None = None
    advised_to: int = 0  # tokens whose pages were advised (a multiple of the granule)
    consumed_to: int = 0  # tokens a step has gathered
    waited_to: int = 0  # tokens whose pages the lookahead waited for (or before the start)
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

    Order: the tokens a step is gathering come first: before advising beyond them the thread
    waits until their pages are in (it reads a byte of each page: a fault on a page already
    being read waits for that read, and maps the page for the step's gather). Then granules
    are advised one after the other, a prompt's nearer tokens first, and of those advised, the
    ones whose pages are not yet known to be in stay within `inflight_bytes` (the thread waits
    for the oldest, the same way, before advising more). So a later chunk's reads join the
    device's queue only as the nearer chunk's come in, instead of sharing the disk with them.

    Counted (in the PLE stats): pages advised, pages used (their granule was reached by a
    step's gather) and pages wasted (advised for a request removed before reaching them).
    owned: a tensor-parallel rank's rows: only their pages are advised and counted.
    """

    def __init__(
        self,
        table: MappedTable,
        window_bytes: int,
        *,
        granule_tokens: int = 64,
        inflight_bytes: int = 8 * 2**20,
        stats: PLEStatsLike | None = None,
        mechanism: str = "auto",
        owned: OwnedRows | None = None,
    ) -> None:
        if window_bytes < 0 or granule_tokens < 1 or inflight_bytes < 0:
            raise ValueError(
                f"window_bytes ({window_bytes}) and inflight_bytes ({inflight_bytes}) must be "
                f">= 0 and granule_tokens ({granule_tokens}) >= 1"
            )
        self.window_pages = window_bytes // PAGE_SIZE
        self.inflight_pages = inflight_bytes // PAGE_SIZE
        self.granule = granule_tokens
        self.stats = stats
        # recent_s=0: every page of a granule is advised and counted (the window accounts
        # for it), whatever another prefetcher advised before
        self._prefetcher = Prefetcher(table, mechanism=mechanism, recent_s=0, owned=owned)
        self._owned = owned
        self._bytes = table.rows.reshape(-1)  # the mapping byte by byte (a view, no copy)
        # advised granules not yet known to be in, oldest first (lookahead thread only):
        # (request key, request, first token, pages)
        self._inflight: deque[tuple[str, _Planned, int, np.ndarray]] = deque()
        self._inflight_count = 0
        self.peak_inflight_pages = 0
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
            self._requests[key] = _Planned(
                plan, consumed_to=start, advised_to=start, waited_to=start
            )
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
            mine = ids if self._owned is None else self._owned.select(ids)
            planned = plan_page_numbers(mine, self._prefetcher.row_width)
            pages = planned.size
            with self._lock:
                ready = self._requests.get(key) is req and first >= req.consumed_to
                fits = self._outstanding + pages <= self.window_pages
            if ready and fits:  # outside the lock: reads may take a while
                self._await_gathered(key, req)
                self._await_inflight(pages)
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
            self._inflight.append((key, req, first, planned))
            self._inflight_count += pages
            self.peak_inflight_pages = max(self.peak_inflight_pages, self._inflight_count)
            self._count("lookahead_pages_advised", pages)

    def _await_gathered(self, key: str, req: _Planned) -> None:
        """Wait for the pages of the tokens a step is gathering (its own advice put them in
        flight), so that nothing advised beyond them shares the disk with them."""
        with self._lock:
            start, stop = req.waited_to, req.consumed_to
        if start >= stop:
            return
        assert req.ids is not None
        ids = req.ids[start:stop]
        mine = ids if self._owned is None else self._owned.select(ids)
        np.take(self._bytes, plan_page_numbers(mine, self._prefetcher.row_width) * PAGE_SIZE)
        with self._lock:
            if self._requests.get(key) is req:
                req.waited_to = max(req.waited_to, stop)

    def _await_inflight(self, pages: int) -> None:
        """Wait, oldest granule first, until `pages` more fit within inflight_pages (one
        granule always fits when nothing is in flight)."""
        while self._inflight and self._inflight_count + pages > self.inflight_pages:
            key, req, first, oldest = self._inflight.popleft()
            self._inflight_count -= oldest.size
            with self._lock:
                # a step gathers it (and waits for its pages itself), or its request is gone:
                # nothing to wait for (touching a gone request's pages would read them again
                # had they been evicted since)
                if req.consumed_to > first or self._requests.get(key) is not req:
                    continue
            # one byte of each page: np.take lets go of the GIL while its faults wait
            np.take(self._bytes, oldest * PAGE_SIZE)

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
