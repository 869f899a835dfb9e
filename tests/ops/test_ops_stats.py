"""sparkple.runtime.stats: the counters file the serving backend writes for the host's metrics."""

from __future__ import annotations

import json
import os
import time

import pytest

from sparkple.runtime.stats import (
    COUNTERS,
    WAIT_BOUNDS_S,
    PLEStats,
    StatsFile,
    StatsFormatError,
    parse,
)


def test_histogram_buckets_are_cumulative_and_bounds_inclusive():
    stats = PLEStats()
    stats.observe_wait(WAIT_BOUNDS_S[0])  # exactly on a bound: counted in that bucket
    stats.observe_wait(WAIT_BOUNDS_S[0] * 1.01)
    stats.observe_wait(WAIT_BOUNDS_S[-1] * 2)  # beyond the last bound: only in +Inf
    hist = stats.snapshot()["handshake_wait_seconds"]
    assert hist["le"] == list(WAIT_BOUNDS_S)
    assert hist["counts"][0] == 1 and hist["counts"][1] == 2 and hist["counts"][-1] == 2
    assert hist["count"] == 3
    assert hist["sum"] == pytest.approx(WAIT_BOUNDS_S[0] * 2.01 + WAIT_BOUNDS_S[-1] * 2)


def test_counters_only_grow_and_names_are_checked():
    stats = PLEStats()
    stats.add("rows_gathered", 5)
    with pytest.raises(KeyError, match="unknown PLE counter 'rows'"):
        stats.add("rows")
    with pytest.raises(ValueError, match="can only grow"):
        stats.add("rows_gathered", -1)
    snap = stats.snapshot()
    assert set(snap["counters"]) == set(COUNTERS) and snap["counters"]["rows_gathered"] == 5


def test_file_is_written_atomically_and_parses(tmp_path):
    stats = PLEStats()
    stats.add("pages_prefetched", 7)
    writer = StatsFile(tmp_path / "stats", stats)
    writer.write()
    assert writer.path.name == f"ple-stats-{os.getpid()}.json"
    doc = parse(writer.path.read_text())
    assert doc["counters"]["pages_prefetched"] == 7 and doc["pid"] == os.getpid()
    assert [p.name for p in (tmp_path / "stats").iterdir()] == [writer.path.name]


def test_background_writer_keeps_the_file_fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKPLE_STATS_DIR", str(tmp_path))
    stats = PLEStats()
    writer = StatsFile.from_env(stats)
    assert writer is not None
    writer.start(interval_s=0.05)
    first = json.loads(writer.path.read_text())["updated_at"]
    stats.add("staging_overruns")
    time.sleep(0.3)
    later = json.loads(writer.path.read_text())
    writer.close()
    assert later["updated_at"] > first and later["counters"]["staging_overruns"] == 1


def test_no_dir_means_no_writer(monkeypatch):
    monkeypatch.delenv("SPARKPLE_STATS_DIR", raising=False)
    assert StatsFile.from_env(PLEStats()) is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "not JSON"),
        ('{"format": "other"}', "not a PLE stats file"),
        ('{"format": "sparkple-ple-stats", "version": 9}', "version 9"),
        (
            '{"format": "sparkple-ple-stats", "version": 1, "counters": {"x": -1}}',
            "non-negative",
        ),
    ],
)
def test_bad_files_say_what_is_wrong(text, message):
    with pytest.raises(StatsFormatError, match=message):
        parse(text)
