"""Copy table rows into a caller-owned staging buffer, in place.

The staging buffer is what the GPU copies from (pinned host memory in vLLM), so the rows must
land in it and nowhere else: the reference reshaped its buffer to a different width, got a
temporary back, filled that, and shipped stale staging rows on every multi-token forward.
Here the buffer's shape is checked against the batch, the flat view is made without a copy
(or refused), and np.take writes straight into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import TableError

if TYPE_CHECKING:
    from .rowshard import OwnedRows


def _flat_view(out: np.ndarray, rows: int, width: int) -> np.ndarray:
    """out as [rows, width], sharing its memory; never a copy."""
    flat = out.view()
    flat.shape = (rows, width)  # raises instead of copying when out's layout does not allow it
    return flat


def check_staging(out: np.ndarray, tokens: int, heads: int, row_width: int) -> None:
    """Refuse a staging buffer that the rows of this batch cannot be written into in place."""
    want = (tokens, heads, row_width)
    if not isinstance(out, np.ndarray):
        raise TypeError(f"staging buffer must be a numpy array, got {type(out).__name__}")
    if out.dtype != np.uint8:
        raise ValueError(f"staging buffer must be uint8, got {out.dtype}")
    if out.shape != want:
        raise ValueError(
            f"staging buffer has shape {out.shape}, this batch needs {want} "
            "(tokens x heads x row_width): pass a view of the first `tokens` token slots"
        )
    if not out.flags.c_contiguous:
        raise ValueError(
            "staging buffer must be C-contiguous (a slice over tokens of a contiguous buffer "
            "is; a slice over heads or bytes is not)"
        )
    if not out.flags.writeable:
        raise ValueError("staging buffer is read-only")


def check_row_range(ids: np.ndarray, total_rows: int) -> None:
    """Every id must name a row of the table (TableError otherwise)."""
    if ids.size == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= total_rows:
        bad = low if low < 0 else high
        raise TableError(
            f"row id {bad} is outside the table's {total_rows} rows: the table does not match "
            "the model's geometry (rebuild it for this checkpoint)"
        )


def gather_rows(
    rows: np.ndarray, row_ids: np.ndarray, out: np.ndarray, owned: OwnedRows | None = None
) -> np.ndarray:
    """Copy rows[row_ids] into out (uint8[T, H, row_width]) and return out.

    rows: the table's 2-D uint8 [total_rows, row_width] array (a read-only memmap).
    row_ids: integer [T, H]; duplicates are fine, every id must be inside the table.
    owned: a tensor-parallel rank's rows; ids outside them get zeros and are never read.
    The result is `out` itself (the same memory, the caller's buffer), never a new array.
    """
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError(f"rows must be a 2-D uint8 table, got {rows.dtype}{list(rows.shape)}")
    total_rows, row_width = rows.shape
    ids = np.asarray(row_ids)
    if ids.ndim != 2:
        raise ValueError(f"row ids must be [tokens, heads], got shape {ids.shape}")
    if ids.dtype.kind not in "iu":
        raise ValueError(f"row ids must be integers, got {ids.dtype}")
    tokens, heads = ids.shape
    check_staging(out, tokens, heads, row_width)
    if ids.size == 0:
        return out
    flat_ids = ids.reshape(-1)
    check_row_range(flat_ids, total_rows)
    if owned is not None:
        owned.gather(rows, flat_ids, _flat_view(out, tokens * heads, row_width))
        return out
    # mode="clip" (ids are checked above): with the default mode="raise", numpy buffers `out`
    # and copies the rows twice.
    np.take(rows, flat_ids, axis=0, out=_flat_view(out, tokens * heads, row_width), mode="clip")
    return out
