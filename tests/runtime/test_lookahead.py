"""The lookahead: later prompt chunks' pages advised ahead of their steps, within a window,
on a real cold file (the advice recorded at the call that reaches the kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from sparkple.runtime.lookahead import Lookahead
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.pagecache import PAGE_SIZE
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
