"""The access advice really limits disk reads: cold decodes measured through /proc/self/io.

read_bytes counts only what the block device delivered to this process, so the table must
live on a real disk (pytest's temp dir), and its pages must be evicted first (checked with
mincore) for the figure to mean anything.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from sparkple.runtime.gather import gather_rows
from sparkple.runtime.prefetch import Prefetcher, plan_page_numbers
from sparkple.runtime.table import open_table

H = 16


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


def device_readahead_kb(path) -> int | None:
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for candidate in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb"):
        try:
            with open(candidate) as f:
                return int(f.read())
        except OSError:
            continue
    return None


def cold_decode(table_dir, advice: str, tokens: int, seed: int, prefetch: bool):
    """Decode `tokens` tokens of 16 random rows each from a cold table; (bytes read, floor)."""
    with open_table(table_dir, advice=advice) as table:
        table.evict()
        assert table.resident_fraction() == 0.0, "the table did not leave the page cache"
        ids = np.random.default_rng(seed).integers(0, table.total_rows, (tokens, H))
        staging = np.empty((1, H, table.row_width), dtype=np.uint8)
        pf = Prefetcher(table, recent_s=0) if prefetch else None
        before = read_bytes()
        for token in ids:
            if pf is not None:
                pf.prefetch(token)
            gather_rows(table.rows, token[None], staging)
        used = read_bytes() - before
        if pf is not None:
            pf.close()
        floor = plan_page_numbers(ids, table.row_width).size * mmap.PAGESIZE
        np.testing.assert_array_equal(staging[0], table.rows[ids[-1]])
        return used, floor


@pytest.mark.parametrize("prefetch", [False, True], ids=["faults", "prefetch"])
def test_cold_decode_with_random_advice_reads_at_most_the_page_floor(built_table, prefetch):
    used, floor = cold_decode(built_table.table_dir, "random", 48, seed=1, prefetch=prefetch)
    if used == 0:
        pytest.skip(
            "read_bytes stayed 0: the temp dir's filesystem does not account block reads "
            "(tmpfs or a network/overlay filesystem); point TMPDIR at a real disk"
        )
    assert used >= 0.9 * floor, f"read {used} B, fewer than the {floor} B of distinct pages"
    assert used <= 1.15 * floor, f"read {used} B for a page floor of {floor} B"


def test_normal_advice_reads_far_more_than_random(built_table):
    ra = device_readahead_kb(built_table.table_dir)
    if not ra or ra * 1024 < 8 * mmap.PAGESIZE:
        pytest.skip(f"the disk's read_ahead_kb is {ra}: no readahead to contrast with")
    used_random, floor = cold_decode(built_table.table_dir, "random", 8, seed=2, prefetch=False)
    used_normal, _ = cold_decode(built_table.table_dir, "normal", 8, seed=2, prefetch=False)
    if used_random == 0:
        pytest.skip("read_bytes stayed 0: the temp dir's filesystem does not account block reads")
    assert used_random <= 1.15 * floor
    assert used_normal >= 4 * used_random, (used_normal, used_random)
