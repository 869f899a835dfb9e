"""A gather worker's steps as the tests and benchmarks drive them: a whole step from tokens or
from row ids, an inline gather of pieces, and a step's rows decoded on a device.

The served backend fills its steps with open_step, submit_pieces and the prepared calls of
sparkple.runtime.worker; these helpers are made of that API alone, so what they exercise is
what the backend runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sparkple.runtime.handshake import DEFAULT_TIMEOUT_S
from sparkple.runtime.ngram import row_ids as compute_row_ids
from sparkple.runtime.nvfp4 import dequantize_rows_torch
from sparkple.runtime.worker import GatherWorker


def submit_row_ids(
    worker: GatherWorker, seq: int, row_ids: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> None:
    """Step `seq` with precomputed row ids int64[T, num_heads], gathered by the thread."""
    ids = np.asarray(row_ids, dtype=np.int64)
    worker.open_step(seq, timeout_s=timeout_s, tokens=len(ids))
    try:
        worker.submit_pieces(seq, [(0, ids)])
    except BaseException:
        worker.release(seq)  # a refused step holds no slot
        raise


def submit_tokens(
    worker: GatherWorker,
    seq: int,
    input_ids: Any,
    query_start_loc: Any,
    ngram_context: Any,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Step `seq` from its tokens, their requests' boundaries and two context tokens per
    request: the row ids computed here (sparkple.runtime.ngram), the rows by the thread."""
    ids = compute_row_ids(
        np.asarray(input_ids, dtype=np.int64).reshape(-1),
        np.asarray(query_start_loc, dtype=np.int64).reshape(-1),
        np.asarray(ngram_context, dtype=np.int64),
        worker.geometry,
    )
    submit_row_ids(worker, seq, ids, timeout_s=timeout_s)


def gather_inline(worker: GatherWorker, seq: int, pieces: list[tuple[int, Any]]) -> None:
    """Gather each piece's rows (row ids int64[T, num_heads]) at its token offset of step
    `seq`'s slot now, on the calling thread: prepare_inline and gather_prepared at once."""
    arrays = [(int(start), np.asarray(ids, dtype=np.int64)) for start, ids in pieces]
    arrays = [(start, ids) for start, ids in arrays if len(ids)]
    heads = worker.geometry.num_heads
    ids = np.concatenate([a for _, a in arrays]) if arrays else np.empty((0, heads), np.int64)
    runs = [(start, len(a)) for start, a in arrays]
    worker.gather_prepared(worker.prepare_inline(seq, ids, runs))


def decode(
    worker: GatherWorker,
    seq: int,
    rows: np.ndarray,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A waited step's rows uploaded to `device` (worker.upload) and decoded there, as the
    backend does after its copy: float[T, H, head_dim]."""
    packed = torch.empty(rows.shape, dtype=torch.uint8, device=device)
    worker.upload(seq, rows, packed)
    meta = worker.table.meta
    if meta.quant == "nvfp4":
        return dequantize_rows_torch(packed, meta.global_scale, meta.head_dim, dtype=dtype)
    return (packed.view(torch.float8_e4m3fn).float() * meta.global_scale).to(dtype)
