"""The packed-table PLE layer in vLLM: a Qwen4Exp PLE storage backend whose rows stay in
the packed table on NVMe, read through a read-only mmap with MADV_RANDOM (evictable page cache,
never a copy in RAM), gathered on the host before each forward and uploaded into one device
buffer the forward reads and decodes.

The step order it keeps, and tensor parallelism: sparkple/vllm/__init__.py. The host step that
drives it each step: sparkple/vllm/host_step.py.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, cast

import numpy as np
import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.models.qwen4_exp.common.ngram_embedding import (
    Qwen4ExpPLEEmbedding,
    Qwen4ExpPLEEmbeddingMethod,
    Qwen4ExpPLEFp8EmbeddingMethod,
    Qwen4ExpPLENvFp4EmbeddingMethod,
)

from sparkple.geometry import PLEGeometry, RowFormat
from sparkple.runtime.lookahead import Lookahead
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.nvfp4 import dequantize_rows_torch, torch_tables
from sparkple.runtime.prefetch import Prefetcher
from sparkple.runtime.rowshard import OwnedRows
from sparkple.runtime.stats import PLEStats, StatsFile
from sparkple.runtime.stepsplit import DevicePlan, DeviceRows, StepSplit, host_pieces
from sparkple.runtime.table import open_table
from sparkple.runtime.worker import GatherWorker, InlineGather, Upload

from .host_inputs import HostInputs
from .load_check import checked_geometry
from .settings import (
    HOST_PROBES,
    LOOKAHEAD_GRANULE,
    STATS_INTERVAL_S,
    TABLE_DIR_ENV,
    step_timeout_s,
    unsupported_settings,
)

# Triton comes with CUDA builds of torch; without it the torch decode runs
decode_packed_rows: Callable[..., torch.Tensor] | None
try:
    from sparkple.runtime.nvfp4_triton import decode_packed_rows
except ImportError:
    decode_packed_rows = None

# under vLLM's own logger, whose handler and level vLLM sets up: logged like its modules
logger = init_logger("vllm.sparkple.packed_table")


def _table_quant(method: Qwen4ExpPLEEmbeddingMethod) -> str:
    if isinstance(method, Qwen4ExpPLENvFp4EmbeddingMethod):
        return "nvfp4"
    if isinstance(method, Qwen4ExpPLEFp8EmbeddingMethod):
        return "fp8"
    raise ValueError(
        f"a packed PLE table needs an NVFP4 or FP8 checkpoint, got {type(method).__name__}; "
        f"unset {TABLE_DIR_ENV} to use vLLM's own backends"
    )


class PackedTableEmbedding(Qwen4ExpPLEEmbedding):
    """PLE rows read through a read-only mmap of the packed table; nothing resident.

    The profile's rendered module subclasses it with its template variables (staging_slots,
    lookahead_bytes) under the name vLLM's edits import."""

    supports_prefetch: ClassVar[bool] = True
    # The patched load_weights skips the checkpoint's row shards for this backend.
    rows_from_packed_table: ClassVar[bool] = True
    # The profile's template variables (the profiles' defaults; the rendered subclass sets them).
    staging_slots: ClassVar[int] = 3
    lookahead_bytes: ClassVar[int] = 256 * 2**20

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        params_dtype: torch.dtype,
        padding_size: int,
        prefix: str,
        embedding_method: Qwen4ExpPLEEmbeddingMethod,
        num_ngram_heads: int = 1,
        max_total_tokens: int = 0,
        data_parallel_rank: int = 0,
        reduce_results: bool = True,
    ) -> None:
        table_dir = os.environ.get(TABLE_DIR_ENV, "").strip()
        if not table_dir:
            raise ValueError(f"{TABLE_DIR_ENV} must name a packed table directory")
        problems = unsupported_settings(get_current_vllm_config())
        if problems:
            raise ValueError(
                f"the packed PLE table ({TABLE_DIR_ENV}) cannot serve "
                + "; ".join(problems)
                + f". Change those settings, or unset {TABLE_DIR_ENV} to use vLLM's own backends"
            )
        quant = _table_quant(embedding_method)
        super().__init__(
            num_embeddings,
            embedding_dim,
            params_dtype=params_dtype,
            padding_size=padding_size,
            prefix=prefix,
            embedding_method=embedding_method,
            num_ngram_heads=num_ngram_heads,
            max_total_tokens=max_total_tokens,
            data_parallel_rank=data_parallel_rank,
            reduce_results=reduce_results,
        )
        if self.tp_size > 1 and (self.etp_data_parallel_size != 1 or not reduce_results):
            raise ValueError(
                f"the packed PLE table ({TABLE_DIR_ENV}) splits its rows over the TP group "
                "and all-reduces them; this layer's embedding group is not the TP group or "
                f"does not reduce. Unset {TABLE_DIR_ENV} to use vLLM's own backends"
            )
        # The rows this rank reads (vLLM's shard indices); one rank reads them all.
        self.owned = OwnedRows(
            self.shard_indices.org_vocab_start_index, self.shard_indices.org_vocab_end_index
        )
        row_format = RowFormat.for_quant(quant, embedding_dim)
        # Validated against this layer's geometry; a mismatch raises TableError.
        self.table = open_table(
            table_dir,
            expect={
                "total_rows": num_embeddings,
                "row_width": row_format.row_width,
                "quant": quant,
                "num_heads": num_ngram_heads,
                "head_dim": embedding_dim,
            },
            advice="random",
        )
        self.owned.check_table(self.table.meta.total_rows, table_dir)
        owned = self.owned if self.tp_size > 1 else None
        self.quant = quant
        self._table_dir = table_dir
        self._num_ngram_heads = num_ngram_heads
        self._max_tokens = max(1, max_total_tokens)
        self._timeout_s = step_timeout_s()
        self._stats = PLEStats()
        # vLLM builds the model inside `with torch.device(<model device>)`: the device
        # buffers go there; every host buffer names the CPU explicitly.
        device = torch.get_default_device()
        self._pin = device.type == "cuda"
        self._worker = GatherWorker(
            self.table,
            self.table.geometry(),
            self._max_tokens,
            slots=self.staging_slots,
            # WILLNEED before every gather: one decode token's rows gain too (bench/ple_io.py)
            prefetch=Prefetcher(self.table, owned=owned),
            pin_memory=self._pin,
            stats=self._stats,  # the waiter's own rule: no spin for a thread of this process
            owned=owned,
        )
        self._lookahead = None
        if self.lookahead_bytes:
            self._lookahead = Lookahead(
                self.table,
                self.lookahead_bytes,
                granule_tokens=LOOKAHEAD_GRANULE,
                stats=self._stats,
                owned=owned,
            )
        # The persistent device buffer the forward reads: fixed address, so captured CUDA
        # graphs read whatever the host step uploaded for the step being replayed.
        self.register_buffer(
            "packed_rows",
            torch.zeros(
                (self._max_tokens, num_ngram_heads, row_format.row_width),
                dtype=torch.uint8,
                device=device,
            ),
            persistent=False,
        )
        # the decode tables (made before any capture), read by the torch and the fused decode
        pairs, e4m3 = torch_tables(device)
        if quant == "nvfp4":
            self.register_buffer("nvfp4_pairs", pairs, persistent=False)
        self.register_buffer("nvfp4_e4m3", e4m3, persistent=False)
        # A Python number in the forward: reading weight_scale_2 there would sync the host.
        # check_against_checkpoint (right after the load) compares it with the checkpoint's.
        self._global_scale = float(self.table.meta.global_scale)
        self._geometry: PLEGeometry | None = None
        # The n-gram module's multipliers, head sizes and offsets (bind_hash).
        self._hash_buffers: tuple[torch.Tensor, ...] | None = None
        # Where each step's inputs land on the host (pinned on CUDA): the host step's copies.
        max_reqs = get_current_vllm_config().scheduler_config.max_num_seqs
        context = self._worker.geometry.ngram_size - 1
        self._inputs = HostInputs(self._max_tokens, max_reqs, context, HOST_PROBES, self._pin)
        # Written only when the service mounts a stats directory (SPARKPLE_STATS_DIR).
        self._stats_file = StatsFile.from_env(self._stats)
        if self._stats_file is not None:
            self._stats_file.start(STATS_INTERVAL_S)
        self._lock = threading.Lock()
        self._seq = 0
        logger.info(
            "PLE rows come from the packed table %s (%s, %d rows, advice %s; TP rank %d of %d "
            "reads rows %d..%d)",
            self.table.meta.data_path(table_dir),
            quant,
            self.table.meta.total_rows,
            self.table.advice,
            self.tp_rank,
            self.tp_size,
            self.owned.start,
            self.owned.end,
        )

    def allocate_embedding_weight(
        self,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """Shape only: the rows live in the table file, so no storage is allocated."""
        return torch.empty(num_embeddings, embedding_dim, dtype=dtype, device="meta")

    # ------------------------------------------------------------------ host step

    def bind_hash(self, ngram_module: nn.Module) -> None:
        """Use the hash buffers of the n-gram module that owns this table (as loaded)."""
        buffers = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
        self._hash_buffers = tuple(cast(torch.Tensor, getattr(ngram_module, b)) for b in buffers)

    def check_against_checkpoint(self) -> PLEGeometry:
        """Right after the weights load (before profiling): the checkpoint's global scale,
        hash buffers and addressed rows against the table, and on a pair every rank's release,
        table and rows (load_check.py). A mismatch stops the start."""
        self._geometry = checked_geometry(self)
        return self._geometry

    def _loaded_geometry(self) -> PLEGeometry:
        """The hash as the checkpoint loaded it (checked right after the load)."""
        if self._geometry is None:
            return self.check_against_checkpoint()
        return self._geometry

    def load_step(
        self,
        input_ids: np.ndarray,
        query_start_loc: np.ndarray,
        ngram_context: np.ndarray,
        num_tokens: int,
    ) -> None:
        """Every row of the step from inputs copied from the device (the wait-before-forward
        order: the fallback when the device's layout differs from the host's)."""
        num_real = int(query_start_loc[-1])
        seq = self.open_step(num_tokens)
        if num_real:
            geometry = self._loaded_geometry()
            ids = row_ids(input_ids[:num_real], query_start_loc, ngram_context, geometry)
            self._worker.submit_pieces(seq, [(0, ids)])
        self.finish_step(seq, num_real, num_tokens)

    def open_step(self, num_tokens: int) -> int:
        """A staging slot for the next step (waits only while its last upload is queued)."""
        if num_tokens > self._max_tokens:
            raise ValueError(
                f"the step has {num_tokens} tokens, the PLE buffers hold {self._max_tokens}"
            )
        with self._lock:
            self._seq += 1
            seq = self._seq
        self._worker.open_step(seq, timeout_s=self._timeout_s)
        return seq

    def submit_prompt_rows(self, seq: int, split: StepSplit) -> None:
        """The rows of the step's prompt tokens, to the gather thread (before the sync)."""
        pieces = host_pieces(split, self._loaded_geometry())
        if pieces:
            self._worker.submit_pieces(seq, pieces)

    def prepare_step(
        self, seq: int, split: StepSplit, plan: DevicePlan | None, num_tokens: int, inline: bool
    ) -> PreparedStep:
        """Before the sync, all the rest of the step that does not need the device: the
        buffers of the device tokens' row ids, their gather into the staging slot (inline:
        on the model thread, else by the gather thread), the upload's views, and the padding
        rows zeroed (the stream runs that before this step's forward)."""
        rows = gather = upload = None
        if plan is not None:
            rows = DeviceRows(plan, self._loaded_geometry(), self._inputs.device_source_np.dtype)
            if inline:
                # the hash's ids are checked against the table now, as bounds
                gather = self._worker.prepare_inline(seq, rows.ids, plan.runs, rows.bounds)
        if split.num_real:
            upload = self._worker.prepare_upload(seq, split.num_real, self.packed_rows)
        if num_tokens > split.num_real:
            self.packed_rows[split.num_real : num_tokens].zero_()
        return PreparedStep(seq, rows, gather, upload)

    def gather_device_rows(self, step: PreparedStep, source: np.ndarray | None) -> None:
        """The rows of the tokens the device made, from its copy of them: their ids, then
        their gather (a few hundred rows take less time than a hand-off to the thread)."""
        if step.rows is None or source is None:
            return
        pieces = step.rows.compute(source)
        if step.gather is not None:
            self._worker.gather_prepared(step.gather)
        else:
            self._worker.submit_pieces(step.seq, pieces)

    def finish_prepared(self, step: PreparedStep) -> None:
        """Wait for the gather thread's rows of the step, upload, give the slot back."""
        try:
            if step.upload is not None:
                # Raises the gather's error, a timeout, or a dead gather thread.
                self._worker.wait_for(step.seq, self._timeout_s)
                self._worker.upload_prepared(step.upload)
        finally:
            self._worker.release(step.seq)

    def finish_step(self, seq: int, num_real: int, num_tokens: int) -> None:
        """Wait for the step's rows, upload them, zero the padding rows; the slot goes back
        (reused once this upload completed)."""
        try:
            if num_real:
                # Raises the gather's error, a timeout, or a dead gather thread.
                rows = self._worker.wait(seq, self._timeout_s, tokens=num_real)
                self._worker.upload(seq, rows, self.packed_rows)
        finally:
            self._worker.release(seq)
        if num_tokens > num_real:
            self.packed_rows[num_real:num_tokens].zero_()

    def abandon_step(self, seq: int) -> None:
        """Let the step's queued pieces finish, then give its slot back unused."""
        try:
            self._worker.wait(seq, self._timeout_s)
        finally:
            self._worker.release(seq)

    def plan_prompt(self, prompt: np.ndarray) -> Callable[[], np.ndarray]:
        """The row ids of a whole prompt, computed when called (on the lookahead thread)."""
        geometry = self._loaded_geometry()
        context = np.full((1, geometry.ngram_size - 1), geometry.eos_token_id, dtype=np.int64)
        bounds = np.array([0, prompt.shape[0]], dtype=np.int64)
        return lambda: row_ids(prompt, bounds, context, geometry)

    def load_dummy(self, num_tokens: int) -> None:
        """Dummy, profile and capture runs: zero rows, no table read, no wait."""
        self.packed_rows[: min(num_tokens, self._max_tokens)].zero_()

    # ------------------------------------------------------------------ in the forward

    def start_prefetch(self, ngram_ids: torch.Tensor) -> None:
        """Nothing to start: the host step uploaded this step's rows before the forward."""
        return None

    def finalize_prefetch(self, total_tokens: int) -> torch.Tensor:
        """This step's rows from the device buffer, [tokens, heads * head_dim]; device work only.

        NVFP4 rows are decoded to the model dtype; FP8 rows stay FP8 as vLLM's lookup returns
        them on CPU, and are converted exactly to the model dtype by the fused decode on CUDA
        (the PLE layer applies their scale either way).
        """
        packed = self.packed_rows[:total_tokens]
        if self.tp_size > 1:
            packed = self._combine_ranks(packed)
        if packed.is_cuda and decode_packed_rows is not None:
            # one Triton pass to the model dtype, bit-identical to the torch decode; FP8 values
            # are converted exactly (what the PLE layer's dequantize does first)
            pairs = self.nvfp4_pairs if self.quant == "nvfp4" else self.nvfp4_e4m3
            rows = decode_packed_rows(
                packed,
                self.quant,
                self.embedding_dim,
                self._global_scale,
                (pairs, self.nvfp4_e4m3),
                self.params_dtype,
            )
        elif self.quant == "nvfp4":
            rows = dequantize_rows_torch(
                packed,
                self._global_scale,
                self.embedding_dim,
                dtype=self.params_dtype,
                tables=(self.nvfp4_pairs, self.nvfp4_e4m3),
            )
        else:
            rows = packed.view(torch.float8_e4m3fn)
        return rows.reshape(total_tokens, self._num_ngram_heads * self.embedding_dim)

    def _combine_ranks(self, packed: torch.Tensor) -> torch.Tensor:
        """Each row's owner's bytes on every rank: the others staged zeros for it, so the
        int8 sum over the group is exact. vLLM's all-reduce is its own op, legal in every
        cudagraph mode; its CPU communicator reduces in place, so it gets a copy there (the
        buffer stays what the host step uploaded)."""
        mine = packed.view(torch.int8)
        if not mine.is_cuda:
            mine = mine.clone()
        reduced: torch.Tensor = self.parallel_group.all_reduce(mine)
        return reduced.view(torch.uint8)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            "packed-table PLE embedding requires start_prefetch() and finalize_prefetch()"
        )

    def close(self) -> None:
        """Stop the gather and lookahead threads and unmap the table."""
        if self._lookahead is not None:
            self._lookahead.close()
        self._worker.close()
        if self._stats_file is not None:
            self._stats_file.close()
        self.table.close()


@dataclass
class PreparedStep:
    """One layer's share of a split step, made before the device sync (prepare_step)."""

    seq: int
    rows: DeviceRows | None  # the device tokens' row ids (None: the step has none)
    gather: InlineGather | None  # their gather on the model thread (None: the thread's)
    upload: Upload | None  # None: the step has no real token
