"""Page planning and WILLNEED prefetch against a real cold file and the real page cache."""

from __future__ import annotations

import mmap
import os
import time
from types import SimpleNamespace

import numpy as np
import pytest

from sparkple.errors import TableError
from sparkple.runtime import prefetch as prefetch_module
from sparkple.runtime.pagecache import evict, resident_fraction, resident_pages
from sparkple.runtime.prefetch import (
    MECHANISMS,
    Prefetcher,
    coalesce_pages,
    plan_page_numbers,
    plan_pages,
)

from .advice_log import AdviceLog

P = mmap.PAGESIZE
W = 90


def brute_force_pages(ids, width=W, page=P):
    pages = set()
    for r in np.asarray(ids).reshape(-1).tolist():
        for b in range(r * width, r * width + width):
            pages.add(b // page)
    return sorted(pages)


def test_a_row_across_a_page_boundary_touches_both_pages():
    straddler = P // W  # row 45: bytes 4050..4139
    assert plan_page_numbers(np.array([straddler]), W).tolist() == [0, 1]
    assert plan_page_numbers(np.array([0]), W).tolist() == [0]


@pytest.mark.parametrize("seed", range(5))
def test_planned_pages_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 5_000, (rng.integers(1, 60), 16))
    ids[0, :3] = ids[0, 3]  # duplicates
    pages = plan_page_numbers(ids, W)
    assert pages.tolist() == brute_force_pages(ids)
    starts, lengths = plan_pages(ids, W)
    covered = sorted(
        p
        for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)
        for p in range(s // P, (s + n) // P)
    )
    assert covered == pages.tolist()
    assert (starts % P == 0).all() and (lengths % P == 0).all()
    assert (starts[1:] > starts[:-1] + lengths[:-1]).all()  # coalesced: no adjacent runs left


def test_coalescing_and_empty_batches():
    starts, lengths = coalesce_pages(np.array([3, 4, 5, 9, 11, 12]))
    assert (starts // P).tolist() == [3, 9, 11]
    assert (lengths // P).tolist() == [3, 1, 2]
    s, n = plan_pages(np.zeros((0, 16), dtype=np.int64), W)
    assert s.size == 0 and n.size == 0


@pytest.fixture
def cold_table(tmp_path):
    """16 MiB of rows on the real disk, evicted from the page cache."""
    n = (16 << 20) // W
    data = np.random.default_rng(3).integers(0, 256, (n, W), dtype=np.uint8)
    path = tmp_path / "rows.bin"
    data.tofile(path)
    fd = os.open(path, os.O_RDONLY)
    rows = np.memmap(path, dtype=np.uint8, mode="r", shape=(n, W))
    # numpy's stubs omit memmap's private _mmap, the mapping madvise() advises
    rows._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]
    evict(rows, fd)
    assert resident_fraction(rows) == 0.0
    yield SimpleNamespace(rows=rows, fd=fd), data
    os.close(fd)


def wait_resident(rows, pages, advise_again, rounds=5, wait_s=2.0):
    """WILLNEED is a hint: the kernel may drop readahead (memory pressure, a busy disk), so
    pages still missing after a wait are advised again, a bounded number of times."""
    for _ in range(rounds):
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            res = resident_pages(rows.ctypes.data, rows.nbytes)
            if res[pages].all():
                return res
            time.sleep(0.01)
        advise_again()
    return resident_pages(rows.ctypes.data, rows.nbytes)


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_prefetch_brings_in_exactly_the_planned_pages(cold_table, mechanism, monkeypatch):
    table, _ = cold_table
    pf = Prefetcher(table, mechanism=mechanism, threads=2)
    log = AdviceLog(pf, monkeypatch)
    ids = np.random.default_rng(11).integers(0, table.rows.shape[0], (300, 16))
    stats = pf.prefetch(ids)
    pages = plan_page_numbers(ids, W)
    assert stats.mechanism == mechanism
    assert stats.pages == stats.issued_pages == pages.size
    # what the prefetcher guarantees: every planned page advised once, and no other page
    assert log.advised() == pages.tolist()
    assert log.calls >= 1 and stats.ranges == coalesce_pages(pages)[0].size
    # what the kernel does with the advice, given retries: the planned pages come in
    again = Prefetcher(table, mechanism=mechanism, threads=2, recent_s=0)
    res = wait_resident(table.rows, pages, lambda: again.prefetch(ids))
    assert res[pages].all(), f"{(~res[pages]).sum()} planned pages never arrived, 5 advices"
    # and WILLNEED reads exactly the advised range (no readahead window around it)
    assert res.sum() == pages.size, "prefetch read pages nobody asked for"
    again.close()
    pf.close()


def test_recently_advised_pages_are_skipped(cold_table):
    table, _ = cold_table
    pf = Prefetcher(table, recent_s=60)
    ids = np.random.default_rng(5).integers(0, table.rows.shape[0], (64, 16))
    first = pf.prefetch(ids)
    assert first.issued_pages == first.pages > 0
    again = pf.prefetch(ids)  # every page recent: found without planning the pages
    assert again.issued_pages == 0 and again.mechanism == "recent"
    one_new = pf.prefetch(np.concatenate([ids.reshape(-1), [table.rows.shape[0] - 1]]))
    assert one_new.pages == first.pages + 1 and one_new.issued_pages == 1
    pf.forget()
    assert pf.prefetch(ids).issued_pages == first.pages
    never_skip = Prefetcher(table, recent_s=0)
    assert never_skip.prefetch(ids).issued_pages == first.pages


def test_pages_stay_recent_for_one_period_after_they_were_last_touched(cold_table, monkeypatch):
    table, _ = cold_table
    now = [0.0]
    clock = SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter)
    monkeypatch.setattr(prefetch_module, "time", clock)
    pf = Prefetcher(table, recent_s=10)
    ids = np.random.default_rng(6).integers(0, table.rows.shape[0], (16, 16)).reshape(-1)
    assert not pf.all_recent(ids)
    first = pf.prefetch(ids)
    assert first.issued_pages > 0 and pf.all_recent(ids)
    for period in (10.0, 20.0):  # each period, found in the one before and touched again
        now[0] = period
        assert pf.prefetch(ids).mechanism == "recent"
    # a batch with a new row: its page is advised, the others count as touched now
    now[0] = 30.0
    assert pf.prefetch(np.concatenate([ids[:8], [table.rows.shape[0] - 1]])).issued_pages == 1
    now[0] = 40.0  # the rest was last touched two periods ago: advised again
    assert not pf.all_recent(ids) and pf.all_recent(ids[:8])
    again = np.setdiff1d(
        plan_page_numbers(ids, pf.row_width), plan_page_numbers(ids[:8], pf.row_width)
    )
    assert pf.prefetch(ids).issued_pages == again.size > 0
    assert not Prefetcher(table, recent_s=0).all_recent(ids)  # nothing remembered


def test_small_batches_below_min_rows_are_not_prefetched(cold_table, monkeypatch):
    table, _ = cold_table
    pf = Prefetcher(table, min_rows=1000)
    log = AdviceLog(pf, monkeypatch)
    stats = pf.prefetch(np.arange(16))
    assert stats.issued_pages == 0 and stats.mechanism == "skipped"
    assert log.calls == 0  # no advice at all, rather than a wait for reads that never come
    assert resident_fraction(table.rows) == 0.0


def test_bad_ids_and_mechanisms_are_refused(cold_table):
    table, _ = cold_table
    pf = Prefetcher(table)
    with pytest.raises(TableError, match="outside the table"):
        pf.prefetch(np.array([table.rows.shape[0]]))
    with pytest.raises(TableError, match="integers"):
        pf.prefetch(np.array([1.0]))
    with pytest.raises(ValueError, match="mechanism"):
        Prefetcher(table, mechanism="io_uring")


def test_auto_prefers_process_madvise_where_the_kernel_has_it(cold_table):
    table, _ = cold_table
    try:
        Prefetcher(table, mechanism="process_madvise")
        expected = "process_madvise"
    except OSError:  # the kernel or a seccomp filter refuses it: fadvise is the fallback
        expected = "fadvise"
    assert Prefetcher(table).mechanism == expected


def test_evict_drops_mapped_pages(cold_table):
    table, data = cold_table
    np.testing.assert_array_equal(table.rows[::97], data[::97])  # fault pages in through the map
    assert resident_fraction(table.rows) > 0
    evict(table.rows, table.fd)
    assert resident_fraction(table.rows) == 0.0
