"""open_table against real published tables: validation, mapping, advice, torch view."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from sparkple.errors import TableError
from sparkple.runtime.table import open_table
from sparkple.runtime.tablemeta import META_NAME, read_meta

from .conftest import direct_rows


def test_open_maps_rows_read_only_and_matches_the_file(built_table):
    with open_table(built_table.table_dir) as table:
        meta = read_meta(built_table.table_dir)
        assert table.rows.shape == (meta.total_rows, meta.row_width)
        assert table.rows.dtype == np.uint8 and not table.rows.flags.writeable
        assert isinstance(table.rows, np.memmap)
        ids = np.random.default_rng(0).integers(0, meta.total_rows, 200)
        ids[:2] = [0, meta.total_rows - 1]
        np.testing.assert_array_equal(
            table.rows[ids], direct_rows(table.data_path, ids, meta.row_width)
        )
        with pytest.raises(ValueError):
            table.rows[0, 0] = 1
        assert os.fstat(table.fd).st_size == meta.data_bytes


@pytest.mark.parametrize("advice", ["random", "normal", "sequential"])
def test_the_advice_that_took_effect_is_reported_from_the_kernel(built_table, advice):
    with open_table(built_table.table_dir, advice=advice) as table:
        assert table.advice == advice  # read back from /proc/self/smaps VmFlags


def test_unknown_advice_is_refused(built_table):
    with pytest.raises(ValueError, match="advice"):
        open_table(built_table.table_dir, advice="willneed")


def test_expectations_that_match_are_accepted(built_table):
    g = built_table.geometry
    expect = {
        "total_rows": g.total_rows,
        "row_width": 90,
        "quant": "nvfp4",
        "format_version": 1,
        "num_heads": g.num_heads,
        "head_dim": g.head_dim,
        "head_sizes": g.head_sizes,
        "global_scale": read_meta(built_table.table_dir).global_scale,
    }
    with open_table(built_table.table_dir, expect=expect) as table:
        assert table.total_rows == g.total_rows


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("total_rows", 320_001_536),
        ("row_width", 160),
        ("quant", "fp8"),
        ("num_heads", 32),
        ("head_dim", 128),
        ("global_scale", 0.5),
    ],
)
def test_a_mismatch_names_both_sides(built_table, key, value):
    have = getattr(read_meta(built_table.table_dir), key)
    with pytest.raises(TableError) as info:
        open_table(built_table.table_dir, expect={key: value})
    msg = str(info.value)
    assert f"{key}: table {have!r}, model expects {value!r}" in msg
    assert "build-table" in msg


def test_unknown_expectation_is_a_caller_error(built_table):
    with pytest.raises(ValueError, match="rows_count"):
        open_table(built_table.table_dir, expect={"rows_count": 1})


def test_truncated_data_file_is_refused(built_table, tmp_path):
    table_dir = built_table.copy_to(tmp_path / "t")
    data = read_meta(table_dir).data_path(table_dir)
    size = data.stat().st_size
    os.truncate(data, size - 90)
    with pytest.raises(TableError, match=rf"{size - 90} bytes.*says {size}"):
        open_table(table_dir)


def test_missing_or_damaged_metadata_is_refused(built_table, tmp_path):
    table_dir = built_table.copy_to(tmp_path / "t")
    meta_path = table_dir / META_NAME
    raw = json.loads(meta_path.read_text())
    raw["format_version"] = 99
    meta_path.write_text(json.dumps(raw))
    with pytest.raises(TableError, match="format_version 99"):
        open_table(table_dir)
    raw["format_version"] = 1
    raw["data_bytes"] += 90
    raw["total_rows"] += 1
    meta_path.write_text(json.dumps(raw))
    with pytest.raises(TableError, match="bytes"):
        open_table(table_dir)
    meta_path.unlink()
    with pytest.raises(TableError, match="no table is published"):
        open_table(table_dir)


def test_torch_view_shares_the_mapping(built_table):
    torch = pytest.importorskip("torch")
    with open_table(built_table.table_dir) as table:
        view = table.torch_view()
        assert view.dtype == torch.uint8
        assert tuple(view.shape) == table.rows.shape
        assert view.data_ptr() == table.rows.ctypes.data  # zero copy
        ids = np.array([5, 0, table.total_rows - 1])
        np.testing.assert_array_equal(view[torch.from_numpy(ids)].numpy(), table.rows[ids])


def test_geometry_recorded_in_the_table_matches_the_checkpoints(built_table):
    with open_table(built_table.table_dir) as table:
        recorded = table.geometry()
    g = built_table.geometry
    for key in ("total_rows", "num_heads", "head_sizes", "head_offsets", "multipliers"):
        assert getattr(recorded, key) == getattr(g, key)
    assert recorded.addressed_rows == g.addressed_rows
