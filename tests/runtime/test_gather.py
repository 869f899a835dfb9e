"""gather_rows: rows land in the caller's staging buffer, checked against a direct read."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from sparkple.errors import TableError
from sparkple.runtime.gather import gather_rows

W = 90
H = 16


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """A real file of distinct 90-byte rows, mapped read-only like the product maps it."""
    n = 50_000  # 4.5 MB: rows straddle many page boundaries
    data = np.random.default_rng(7).integers(0, 256, (n, W), dtype=np.uint8)
    path = tmp_path_factory.mktemp("gather") / "rows.bin"
    data.tofile(path)
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(n, W)), data


def straddling_rows(n: int) -> np.ndarray:
    """Row ids whose 90 bytes cross a page boundary."""
    ids = np.arange(n)
    start = ids * W
    return ids[start // mmap.PAGESIZE != (start + W - 1) // mmap.PAGESIZE]


@pytest.mark.parametrize("tokens", [1, 2, 7, 2048])
def test_rows_land_in_the_callers_buffer(table, tokens):
    rows, data = table
    n = rows.shape[0]
    rng = np.random.default_rng(tokens)
    ids = rng.integers(0, n, (tokens, H))
    ids[0, 0] = n - 1  # the last row
    ids[-1, -1] = 0
    ids[0, 1:4] = straddling_rows(n)[:3]
    if tokens > 1:
        ids[1] = ids[0]  # duplicates across tokens
    # A staging buffer sized for many more tokens than this step: the caller hands in the
    # first `tokens` slots, and the rows must arrive in the caller's memory, not a temporary.
    max_tokens = 4096
    staging = np.full((max_tokens, H, W), 0xAB, dtype=np.uint8)
    result = gather_rows(rows, ids, staging[:tokens])
    assert np.shares_memory(result, staging)
    assert result.__array_interface__["data"][0] == staging.__array_interface__["data"][0]
    np.testing.assert_array_equal(staging[:tokens], data[ids])
    assert (staging[tokens:] == 0xAB).all()  # nothing written past the batch


def test_a_width_mismatched_staging_view_is_refused(table):
    """The reference's bug class: a buffer whose width differs from the row width.

    Slicing a 160-byte-wide buffer down to 90 bytes gives a strided view; reshaping it would
    silently copy, so the rows would go to a temporary. gather_rows refuses it instead.
    """
    rows, _ = table
    ids = np.zeros((3, H), dtype=np.int64)
    wide = np.zeros((8, H, 160), dtype=np.uint8)
    with pytest.raises(ValueError, match="C-contiguous"):
        gather_rows(rows, ids, wide[:3, :, :W])
    with pytest.raises(ValueError, match="shape"):
        gather_rows(rows, ids, wide[:3])
    flat = np.zeros((8, H * W), dtype=np.uint8)  # the right bytes, but not shaped per head
    with pytest.raises(ValueError, match="shape"):
        gather_rows(rows, ids, flat[:3])


def test_refuses_bad_buffers_and_ids(table):
    rows, _ = table
    ids = np.zeros((2, H), dtype=np.int64)
    with pytest.raises(ValueError, match="uint8"):
        gather_rows(rows, ids, np.zeros((2, H, W), dtype=np.int8))
    with pytest.raises(ValueError, match="C-contiguous"):
        gather_rows(rows, ids, np.zeros((2, H, W), dtype=np.uint8, order="F"))
    with pytest.raises(ValueError, match="C-contiguous"):
        gather_rows(rows, ids, np.zeros((4, H, W), dtype=np.uint8)[::2])
    ro = np.zeros((2, H, W), dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        gather_rows(rows, ids, ro)
    with pytest.raises(ValueError, match="integers"):
        gather_rows(rows, ids.astype(np.float64), np.zeros((2, H, W), np.uint8))
    with pytest.raises(ValueError, match=r"\[tokens, heads\]"):
        gather_rows(rows, ids.reshape(-1), np.zeros((2, H, W), np.uint8))
    with pytest.raises(TypeError):
        gather_rows(rows, ids, [[0]])  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 50_000, 2**40])
def test_ids_outside_the_table_are_refused(table, bad):
    rows, _ = table
    ids = np.zeros((2, H), dtype=np.int64)
    ids[1, 5] = bad
    out = np.full((2, H, W), 7, dtype=np.uint8)
    with pytest.raises(TableError, match=f"row id {bad} is outside"):
        gather_rows(rows, ids, out)


def test_empty_batch(table):
    rows, _ = table
    out = np.zeros((0, H, W), dtype=np.uint8)
    assert gather_rows(rows, np.zeros((0, H), dtype=np.int64), out) is out


def test_int32_ids(table):
    rows, data = table
    ids = np.random.default_rng(1).integers(0, rows.shape[0], (5, H)).astype(np.int32)
    out = np.empty((5, H, W), dtype=np.uint8)
    np.testing.assert_array_equal(gather_rows(rows, ids, out), data[ids])
