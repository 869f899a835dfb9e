"""The lookahead: later prompt chunks' pages advised ahead of their steps, within a window,
on a real cold file (the advice recorded at the call that reaches the kernel)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from sparkple.runtime.lookahead import Lookahead
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.pagecache import PAGE_SIZE, resident_pages
from sparkple.runtime.prefetch import plan_page_numbers
from sparkple.runtime.stats import PLEStats
from sparkple.runtime.table import open_table

from .advice_log import AdviceLog

GRANULE = 16


@pytest.fixture
def table(built_table):
    with open_table(built_table.table_dir) as t:
        t.evict()
        yield t


def prompt_ids(built_table, length: int, seed: int) -> np.ndarray:
    g = built_table.geometry
    tokens = np.random.default_rng(seed).integers(0, g.vocab_size, length)
    context = np.full((1, g.ngram_size - 1), g.eos_token_id)
    return row_ids(tokens, np.array([0, length]), context, g)


def advised_share(log: AdviceLog, pages: np.ndarray) -> float:
    """The share of `pages` the lookahead has advised. The advice is what it controls; which
    pages WILLNEED has read in by some moment is the kernel's (best effort, may be dropped)."""
    return float(np.isin(pages, log.advised()).mean())


def test_pages_ahead_are_advised_within_the_window_and_move_with_the_steps(
    table, built_table, monkeypatch
):
    ids = prompt_ids(built_table, 400, seed=1)
    stats = PLEStats()
    window = 3 * GRANULE * 16 * PAGE_SIZE  # about three granules of pages
    look = Lookahead(table, window, granule_tokens=GRANULE, stats=stats)
    log = AdviceLog(look._prefetcher, monkeypatch)
    try:
        look.add("a", lambda: ids, start=0)
        look.consumed("a", 64)  # the first chunk is gathered by the step itself
        assert look.idle()
        counters = stats.snapshot()["counters"]
        advised = counters["lookahead_pages_advised"]
        assert 0 < advised <= window // PAGE_SIZE
        assert len(log.advised()) == advised  # the counter counts the advice given
        assert look.peak_outstanding_pages <= window // PAGE_SIZE
        ahead = plan_page_numbers(ids[64 : 64 + GRANULE], table.row_width)
        assert advised_share(log, ahead) == 1.0  # the next chunk's pages are advised
        beyond = plan_page_numbers(ids[300:], table.row_width)
        # far ahead: not yet (some of its pages hold rows of earlier chunks too)
        assert advised_share(log, beyond) < 0.5
        # a step gathers the next chunk: its pages count as used, the window moves on
        look.consumed("a", 64 + 3 * GRANULE)
        assert look.idle()
        counters = stats.snapshot()["counters"]
        assert counters["lookahead_pages_used"] > 0
        assert counters["lookahead_pages_advised"] > advised
        assert counters["lookahead_pages_wasted"] == 0
        # removed before its later chunks ran: what was advised and not reached is wasted,
        # and nothing more is advised for it
        look.remove("a")
        assert look.idle()
        counters = stats.snapshot()["counters"]
        assert counters["lookahead_pages_wasted"] > 0
        assert (
            counters["lookahead_pages_used"] + counters["lookahead_pages_wasted"]
            == counters["lookahead_pages_advised"]
        )
        assert look.outstanding_bytes == 0
        look.consumed("a", 200)
        assert look.idle()
        assert stats.snapshot()["counters"] == counters
    finally:
        look.close()


def test_prompts_share_one_window_first_come_first(table, built_table, monkeypatch):
    stats = PLEStats()
    window = 2 * GRANULE * 16 * PAGE_SIZE
    look = Lookahead(table, window, granule_tokens=GRANULE, stats=stats)
    log = AdviceLog(look._prefetcher, monkeypatch)
    try:
        first, second = prompt_ids(built_table, 300, 2), prompt_ids(built_table, 300, 3)
        look.add("first", lambda: first)
        look.add("second", lambda: second)
        assert look.idle()
        assert look.peak_outstanding_pages <= window // PAGE_SIZE
        later = plan_page_numbers(second[:GRANULE], table.row_width)
        assert advised_share(log, later) < 0.5  # the first prompt holds the window
        look.remove("first")  # its advice is counted wasted; the second gets the window
        assert look.idle()
        assert advised_share(log, later) == 1.0
    finally:
        look.close()


def test_a_zero_window_advises_nothing(table, built_table):
    stats = PLEStats()
    look = Lookahead(table, 0, stats=stats)
    try:
        look.add("a", lambda: prompt_ids(built_table, 100, 4))
        assert look.idle()
        assert stats.snapshot()["counters"]["lookahead_pages_advised"] == 0
    finally:
        look.close()


def granule_pages(ids: np.ndarray, table, start: int, stop: int) -> list[np.ndarray]:
    return [
        plan_page_numbers(ids[first : first + GRANULE], table.row_width)
        for first in range(start, stop, GRANULE)
    ]


def test_nearer_tokens_pages_are_advised_before_farther_ones(table, built_table, monkeypatch):
    """The advice reaches the kernel granule after granule in token order (each granule's
    pages in one sorted run), so a nearer chunk's pages are all asked for before a farther
    chunk's."""
    ids = prompt_ids(built_table, 320, seed=5)
    look = Lookahead(table, 64 * 2**20, granule_tokens=GRANULE, inflight_bytes=0)
    log = AdviceLog(look._prefetcher, monkeypatch)
    try:
        look.add("a", lambda: ids, start=32)
        assert look.idle()
        expected = np.concatenate(granule_pages(ids, table, 32, 320)).tolist()
        assert log.pages == expected
    finally:
        look.close()


def test_farther_pages_are_advised_only_as_nearer_ones_come_in(table, built_table, monkeypatch):
    """At most `inflight_bytes` of advised pages are not yet known to be in: before the
    lookahead advises a granule, the pages of the granules more than that bound behind it were
    read (the lookahead's own fault on each waited for its read), so they are resident then."""
    ids = prompt_ids(built_table, 320, seed=6)
    granules = granule_pages(ids, table, 0, 320)
    bound = 2 * max(p.size for p in granules)  # room for two granules in flight
    look = Lookahead(table, 64 * 2**20, granule_tokens=GRANULE, inflight_bytes=bound * PAGE_SIZE)
    log = AdviceLog(look._prefetcher, monkeypatch)
    rows = table.rows
    behind: list[float] = []  # at each advice: the resident share of the pages waited for
    add = log.add

    def checking(ranges):
        with log._lock:
            advised = len(log.pages)
        done = sum(1 for p in np.cumsum([p.size for p in granules]) if p <= advised)
        waited = granules[: max(0, done - 2)]  # all but the two granules still in flight
        if waited:
            pages = np.concatenate(waited)
            resident = resident_pages(rows.ctypes.data, rows.nbytes)
            behind.append(float(resident[pages].mean()))
        add(ranges)

    monkeypatch.setattr(log, "add", checking)
    try:
        look.add("a", lambda: ids, start=0)
        assert look.idle()
        assert log.pages == np.concatenate(granules).tolist()  # every granule, in order
        assert look.peak_inflight_pages <= bound
        assert len(behind) >= len(granules) - 3  # from the fourth granule on
        assert behind == [1.0] * len(behind)
    finally:
        look.close()


def test_the_tokens_a_step_gathers_come_in_before_anything_beyond(table, built_table, monkeypatch):
    """A step gathering tokens [0, 64) has their pages read (its own advice puts them in
    flight): the lookahead advises nothing beyond them until they are in, and never advises
    them itself."""
    ids = prompt_ids(built_table, 200, seed=7)
    planned = threading.Event()

    def plan() -> np.ndarray:
        planned.wait(10)  # the step's report comes first, as when planning takes a while
        return ids

    look = Lookahead(table, 64 * 2**20, granule_tokens=GRANULE)
    log = AdviceLog(look._prefetcher, monkeypatch)
    rows = table.rows
    gathered = plan_page_numbers(ids[:64], table.row_width)
    at_first_advice: list[float] = []
    add = log.add

    def checking(ranges):
        if not at_first_advice:
            resident = resident_pages(rows.ctypes.data, rows.nbytes)
            at_first_advice.append(float(resident[gathered].mean()))
        add(ranges)

    monkeypatch.setattr(log, "add", checking)
    try:
        look.add("a", plan, start=0)
        look.consumed("a", 64)
        planned.set()
        assert look.idle()
        assert log.pages == np.concatenate(granule_pages(ids, table, 64, 200)).tolist()
        assert at_first_advice == [1.0]
    finally:
        look.close()
