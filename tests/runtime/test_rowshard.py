"""A tensor-parallel rank's rows: gathered, prefetched and advised ahead only inside its range,
on a real cold table (residency read with mincore), and the checks the ranks make at load."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from harness import gather_steps
from sparkple.builder.build import build_table
from sparkple.errors import ReleaseError, TableError
from sparkple.runtime.gather import gather_rows
from sparkple.runtime.lookahead import Lookahead
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.pagecache import PAGE_SIZE, resident_pages
from sparkple.runtime.prefetch import Prefetcher, plan_page_numbers
from sparkple.runtime.rankcheck import Release, check_ranks, describe
from sparkple.runtime.rowshard import OwnedRows, check_tiling
from sparkple.runtime.stats import PLEStats
from sparkple.runtime.table import open_table
from sparkple.runtime.worker import GatherWorker

from .advice_log import AdviceLog


@pytest.fixture
def table(built_table):
    with open_table(built_table.table_dir) as t:
        t.evict()
        yield t


def halves(table) -> list[OwnedRows]:
    half = table.total_rows // 2
    return [OwnedRows(0, half), OwnedRows(half, table.total_rows)]


def pages_of(owned: OwnedRows, width: int) -> tuple[int, int]:
    """[first, last) pages holding the range's bytes."""
    return owned.start * width // PAGE_SIZE, -(-owned.end * width // PAGE_SIZE)


def resident_outside(table, owned: OwnedRows) -> tuple[int, int]:
    flags = resident_pages(table.rows.ctypes.data, table.rows.nbytes)
    first, last = pages_of(owned, table.row_width)
    return int(flags[:first].sum() + flags[last:].sum()), int(flags[first:last].sum())


def step_ids(table, tokens: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, table.total_rows, (tokens, 16))


def test_each_rank_stages_its_rows_and_zeros_and_the_sum_is_the_whole_row(table):
    ids = step_ids(table, 300, seed=1)
    full = gather_rows(table.rows, ids, np.empty((300, 16, table.row_width), np.uint8))
    staged = []
    for owned in halves(table):
        out = np.full((300, 16, table.row_width), 0xAB, dtype=np.uint8)
        gather_rows(table.rows, ids, out, owned)
        mine = owned.mask(ids)
        np.testing.assert_array_equal(out[mine], full[mine])
        assert (out[~mine] == 0).all()
        staged.append(out)
    # what the forward's int8 all-reduce computes: one owner per row, so the sum is exact
    total = staged[0].view(np.int8).astype(np.int16) + staged[1].view(np.int8)
    np.testing.assert_array_equal(total.astype(np.int8).view(np.uint8), full)


def test_a_rank_reads_no_page_of_the_other_ranks_rows(table):
    owned = halves(table)[1]
    ids = step_ids(table, 500, seed=2)
    out = np.empty((500, 16, table.row_width), dtype=np.uint8)
    gather_rows(table.rows, ids, out, owned)
    outside, inside = resident_outside(table, owned)
    assert outside == 0 and inside > 0


def test_a_ranks_prefetch_and_worker_advise_only_its_own_pages(table, built_table, monkeypatch):
    owned = halves(table)[0]
    ids = step_ids(table, 400, seed=3)
    pf = Prefetcher(table, owned=owned)
    log = AdviceLog(pf, monkeypatch)
    stats = pf.prefetch(ids)
    assert 0 < stats.rows < ids.size  # only the owned ids
    # exactly the pages of the owned ids were advised (what WILLNEED reads is the kernel's)
    assert log.advised() == plan_page_numbers(owned.select(ids), table.row_width).tolist()
    with GatherWorker(table, built_table.geometry, 512, owned=owned) as worker:
        gather_steps.submit_row_ids(worker, 1, step_ids(table, 400, seed=4))
        rows = worker.wait(1)
        assert (rows[~owned.mask(step_ids(table, 400, seed=4))] == 0).all()
        worker.release(1)
    # the gather read the rank's pages itself; nothing read in may lie outside its range
    outside, inside = resident_outside(table, owned)
    assert outside == 0 and inside > 0
    pf.close()


def test_the_lookahead_advises_only_the_ranks_pages(table, built_table, monkeypatch):
    g = built_table.geometry
    tokens = np.random.default_rng(5).integers(0, g.vocab_size, 400)
    context = np.full((1, g.ngram_size - 1), g.eos_token_id)
    ids = row_ids(tokens, np.array([0, 400]), context, g)
    owned = halves(table)[1]
    stats = PLEStats()
    look = Lookahead(table, 64 << 20, granule_tokens=16, stats=stats, owned=owned)
    log = AdviceLog(look._prefetcher, monkeypatch)
    try:
        look.add("a", lambda: ids)
        assert look.idle()
        # each granule's pages, counted as the window counts them: the rank's rows only
        want = sum(
            plan_page_numbers(owned.select(ids[g : g + 16]), table.row_width).size
            for g in range(0, 400, 16)
        )
        assert 0 < stats.snapshot()["counters"]["lookahead_pages_advised"] == want
        # and the advice itself: all of it inside the rank's pages, as many as counted
        first, last = pages_of(owned, table.row_width)
        advised = log.advised()
        assert len(advised) == want and first <= advised[0] and advised[-1] < last
        # WILLNEED reads in the background and may be dropped: give it time to land (no
        # deadline to miss), then no page outside the rank's range may have come in
        deadline = time.monotonic() + 5
        while resident_outside(table, owned)[1] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert resident_outside(table, owned)[0] == 0
    finally:
        look.close()


def test_ranges_must_give_every_row_one_owner():
    check_tiling([(0, 5), (5, 10)], 10)
    for ranges, total in (([(0, 5), (6, 10)], 10), ([(0, 6), (5, 10)], 10), ([(0, 5)], 10)):
        with pytest.raises(TableError, match="ranges"):
            check_tiling(ranges, total)
    with pytest.raises(TableError, match="holds 10"):
        OwnedRows(5, 11).check_table(10, "/t")
    with pytest.raises(ValueError):
        OwnedRows(6, 5)


def test_two_builds_of_one_checkpoint_share_a_fingerprint(built_table, tmp_path):
    again = tmp_path / "again"
    build_table(built_table.snapshot, again, quiet=True)
    first, second = (open_table(d) for d in (built_table.table_dir, again))
    try:
        assert first.meta.data_file != second.meta.data_file  # built apart
        assert first.meta.fingerprint() == second.meta.fingerprint()
        changed = replace(first.meta, global_scale=first.meta.global_scale * 2)
        assert changed.fingerprint() != first.meta.fingerprint()
        owned = halves(first)
        entries = [
            describe(r, d.table_dir, d.meta, owned[r], release=Release())
            for r, d in enumerate((first, second))
        ]
        check_ranks(entries[::-1])  # agreeing ranks pass, in any order
        entries[1]["owned"] = (0, first.total_rows)
        with pytest.raises(TableError, match="once each"):
            check_ranks(entries)
        entries[1] = describe(1, "/other/table", changed, owned[1], release=Release())
        with pytest.raises(TableError) as refused:
            check_ranks(entries)
        message = str(refused.value)
        assert "rank 0 on" in message and "rank 1 on" in message
        assert str(built_table.table_dir) in message and "/other/table" in message
        assert "differ in global_scale" in message
        # a rank whose own checks failed: its peer stops with it, naming it
        entries[1] = describe(
            1, "/other/table", second.meta, owned[1], ["global scale 2.0"], release=Release()
        )
        with pytest.raises(TableError, match="rank 1 on .* refused its PLE table: global scale"):
            check_ranks(entries)
    finally:
        first.close()
        second.close()


RELEASE_A = Release("1f0c2a9be47d3e55", "a" * 64)


@pytest.mark.parametrize(
    ("other", "differ", "says"),
    [
        (Release("7b3e90d1c2f4a685", "a" * 64), "release id",
         "rank 1 on spark-b runs release 7b3e90d1c2f4a685, patch manifest sha256 " + "a" * 64),
        (Release("1f0c2a9be47d3e55", "b" * 64), "patch manifest",
         "rank 1 on spark-b runs release 1f0c2a9be47d3e55, patch manifest sha256 " + "b" * 64),
        # a node the unit names no release for is not taken to run rank 0's
        (Release(), "release id and patch manifest",
         "rank 1 on spark-b runs release (not set), patch manifest sha256 (not set)"),
    ],
    ids=["release-id", "manifest", "unset"],
)  # fmt: skip
def test_ranks_of_different_releases_refuse_naming_both(built_table, other, differ, says):
    """Both tables agree (one build): the ranks differ only in what they run, as a pair does
    with one node rolled back and the other not."""
    with open_table(built_table.table_dir) as t:
        owned = halves(t)
        entries = [
            describe(r, t.table_dir, t.meta, owned[r], release=release)
            for r, release in enumerate((RELEASE_A, other))
        ]
    entries[0]["host"], entries[1]["host"] = "spark-a", "spark-b"
    for order in (entries, entries[::-1]):
        with pytest.raises(ReleaseError) as refused:
            check_ranks(order)
        message = str(refused.value)
        assert message.startswith("the tensor-parallel ranks run different releases: rank 0 on "
                                  "spark-a runs release 1f0c2a9be47d3e55, patch manifest sha256 "
                                  + "a" * 64 + " and " + says)  # fmt: skip
        assert f"(they differ in {differ})" in message
        assert "roll both nodes out to the same release" in message


def test_ranks_of_one_release_pass_and_the_unit_names_it_in_the_environment(
    built_table, monkeypatch
):
    monkeypatch.setenv("SPARKPLE_RELEASE_ID", " 1f0c2a9be47d3e55\n")
    monkeypatch.setenv("SPARKPLE_PATCH_MANIFEST_SHA256", "a" * 64)
    assert Release.from_env() == RELEASE_A
    with open_table(built_table.table_dir) as t:
        owned = halves(t)
        check_ranks(
            [describe(r, t.table_dir, t.meta, owned[r], release=Release.from_env()) for r in (0, 1)]
        )
        # neither set (a run outside the serving unit): the ranks agree, the tables decide
        monkeypatch.delenv("SPARKPLE_RELEASE_ID")
        monkeypatch.delenv("SPARKPLE_PATCH_MANIFEST_SHA256")
        assert Release.from_env() == Release()
        check_ranks(
            [describe(r, t.table_dir, t.meta, owned[r], release=Release.from_env()) for r in (0, 1)]
        )
