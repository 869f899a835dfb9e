"""The rows of the packed table one tensor-parallel rank owns.

Under tensor parallelism vLLM splits the PLE table by rows: each rank of the embedding group
owns one contiguous range of the padded table, and the lookup writes zeros for every row
another rank owns, so the group's sum is each row's owner's value. A node keeps the whole
table file; the rank gathers and prefetches only the rows of its own range, so only that
range's pages are ever read into its page cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import TableError


@dataclass(frozen=True)
class OwnedRows:
    """Rows [start, end) of the table: the range this rank reads."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"owned rows must be 0 <= start <= end, got {self.start}..{self.end}")

    def __len__(self) -> int:
        return self.end - self.start

    def mask(self, ids: np.ndarray) -> np.ndarray:
        """True where a row id is inside the range."""
        return (ids >= self.start) & (ids < self.end)

    def select(self, ids: np.ndarray) -> np.ndarray:
        """The ids inside the range, flattened (what the page advice may touch)."""
        flat = np.asarray(ids).reshape(-1)
        selected: np.ndarray = flat[self.mask(flat)]
        return selected

    def gather(self, rows: np.ndarray, flat_ids: np.ndarray, out: np.ndarray) -> None:
        """out[i] = rows[flat_ids[i]] for owned ids, zeros for the others.

        out: uint8 [len(flat_ids), row_width]. A row outside the range is never read: its
        slot is filled from the range's first row, then cleared.
        """
        owned = self.mask(flat_ids)
        if not owned.any():
            out[:] = 0
            return
        local = np.where(owned, flat_ids - self.start, 0)
        np.take(rows[self.start : self.end], local, axis=0, out=out, mode="clip")
        out[~owned] = 0

    def check_table(self, total_rows: int, where: object) -> None:
        """The range must lie inside the table (TableError naming both otherwise)."""
        if self.end > total_rows:
            raise TableError(
                f"this rank owns PLE rows {self.start}..{self.end}, the table in {where} holds "
                f"{total_rows}: it was not built for this model; rebuild it with "
                "`sparkple build-table --force`"
            )


def check_tiling(ranges: list[tuple[int, int]], total_rows: int) -> None:
    """The ranks' ranges, in rank order, must cover rows 0..total_rows once each: then every
    row has exactly one owner and the group's sum of the ranks' bytes is the owner's bytes."""
    expected = 0
    for rank, (start, end) in enumerate(ranges):
        if start != expected or end < start:
            raise TableError(
                f"the tensor-parallel ranks' PLE row ranges {ranges} do not cover the "
                f"table's {total_rows} rows once each in rank order (rank {rank} starts at "
                f"{start}, expected {expected})"
            )
        expected = end
    if expected != total_rows:
        raise TableError(
            f"the tensor-parallel ranks' PLE row ranges {ranges} end at row {expected}, the "
            f"table holds {total_rows}"
        )
