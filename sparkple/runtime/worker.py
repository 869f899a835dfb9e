"""The gather worker: one thread that turns a step's row ids into staged PLE rows.

Producer side (the model runner, a layer ahead of the PLE layer):
    worker.open_step(seq)                      # reserve a staging slot
    worker.submit_pieces(seq, [(start, ids)])  # gathered by the thread, in the background
Consumer side (the PLE layer):
    rows = worker.wait(seq, tokens)  # uint8[T, H, row_width] view of the step's slot
    worker.upload(seq, rows, out)    # asynchronous copy into a device buffer
    worker.release(seq)              # the slot goes back; refilled once that copy completed

A step whose last rows depend on a device sync is prepared before it, so that after it the
gather and the upload are a few calls into views made before:
    job = worker.prepare_inline(seq, ids, runs)   # ids: a buffer filled after the sync
    upload = worker.prepare_upload(seq, tokens, out)
    ... the sync; ids filled ...
    worker.gather_prepared(job)                   # one range check, the advice, the takes
    worker.wait_for(seq); worker.upload_prepared(upload); worker.release(seq)

For each piece the thread prefetches the pages of its rows, gathers the rows into the step's
staging slot at the piece's token offset and then publishes the piece's ticket through the
handshake. A slot is handed out again only after the device copy that read it last has
completed (a CUDA event per slot), so a copy the stream has not run yet is never overwritten.
With asynchronous scheduling a runner has two steps in flight while it prepares a third: three
slots never wait. (The tests and benchmarks drive whole steps through harness/gather_steps.py,
made of this API.)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import HandshakeError
from ..geometry import PLEGeometry
from .gather import check_row_range, gather_rows
from .handshake import DEFAULT_TIMEOUT_S, Publisher, SeqFlag, Waiter
from .prefetch import Prefetcher
from .table import check_expect
from .tablemeta import geometry_fields

if TYPE_CHECKING:
    import torch

    from .rowshard import OwnedRows
    from .stats import PLEStats
    from .table import PackedTable


@dataclass
class _Step:
    seq: int
    slot: int
    tokens: int = 0  # staged token rows: the end of the furthest piece
    ticket: int = 0  # handshake ticket of the step's last background piece (0: none)


@dataclass
class _Job:
    step: _Step
    ticket: int
    pieces: list[tuple[int, np.ndarray]]  # (token offset, row ids [T, H])


@dataclass
class InlineGather:
    """A gather on the calling thread, prepared before the ids exist (prepare_inline)."""

    step: _Step
    ids: np.ndarray  # int64[N]: every run's ids, the caller's buffer (filled later)
    takes: list[tuple[np.ndarray, np.ndarray]]  # per run: its ids, the staging it lands in
    pieces: list[tuple[int, np.ndarray]]  # per run: (step offset, ids [T, H])
    end: int  # the end of the furthest run
    check: bool  # whether the ids' range is checked after they are in


@dataclass
class Upload:
    """A step's upload into a device buffer, its views made ahead (prepare_upload)."""

    step: _Step
    host: torch.Tensor  # the staging slot's first rows
    device: torch.Tensor  # as many rows of the device buffer
    cuda: bool


def host_tensor(shape: tuple[int, ...], dtype: str, *, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, pinned when asked and torch has CUDA.

    The device is named: vLLM builds models inside `with torch.device("cuda")`, where a bare
    `torch.empty(..., pin_memory=True)` would resolve to a pinned CUDA tensor and fail.
    """
    import torch

    pin = pin and torch.cuda.is_available()
    return torch.zeros(shape, dtype=getattr(torch, dtype), device="cpu", pin_memory=pin)


class GatherWorker:
    """A gather thread with `slots` staging buffers of max_tokens x heads x row_width bytes.

    prefetch: True (a Prefetcher with defaults), False or None (none), or a Prefetcher to use.
    pin_memory: allocate staging as pinned host memory when torch has CUDA, so the GPU copy
      can be asynchronous (plain host memory without CUDA). Always on the CPU, whatever
      device context the caller constructs the worker in.
    stats: counters and the handshake-wait histogram to record into (sparkple.runtime.stats), which
      the metrics exporter reads.
    owned: a tensor-parallel rank's rows: the others are staged as zeros, never read.
    """

    def __init__(
        self,
        table: PackedTable,
        geometry: PLEGeometry,
        max_tokens: int,
        *,
        slots: int = 2,
        prefetch: bool | Prefetcher | None = True,
        pin_memory: bool = False,
        spin_s: float | None = None,
        stats: PLEStats | None = None,
        owned: OwnedRows | None = None,
    ) -> None:
        if max_tokens < 1 or slots < 1:
            raise ValueError(f"max_tokens ({max_tokens}) and slots ({slots}) must be >= 1")
        # the table must be the one built for this model's PLE geometry (TableError otherwise)
        check_expect(table.meta, geometry_fields(geometry), table.table_dir)
        self.table = table
        self.geometry = geometry
        self.max_tokens = max_tokens
        self.slots = slots
        self.stats = stats
        self.owned = owned
        shape = (slots, max_tokens, geometry.num_heads, table.row_width)
        self._pinned: torch.Tensor | None = None
        self._staging_tensor: torch.Tensor | None = None  # torch's view of staging (uploads)
        if pin_memory:
            self._pinned = host_tensor(shape, "uint8", pin=True)
            self.staging = self._pinned.numpy()
        else:
            self.staging = np.empty(shape, dtype=np.uint8)
        self._own_prefetcher = prefetch is True
        if isinstance(prefetch, Prefetcher):
            self.prefetcher: Prefetcher | None = prefetch
        else:
            self.prefetcher = Prefetcher(table, owned=owned) if prefetch else None
        self._flag = SeqFlag.create()
        self._flag.unlink()  # used in this process only: nothing is left behind if it dies
        self._waiter = Waiter(self._flag, spin_s=spin_s)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._free = list(range(slots))
        self._held: dict[int, _Step] = {}  # seq -> step, from submit until release
        self._failed: dict[int, Exception] = {}  # seq -> the first error of its pieces
        # slot -> CUDA event of the last device copy that read it (None: nothing in flight)
        self._slot_events: list[Any] = [None] * slots
        self._prefetch_lock = threading.Lock()  # the prefetcher is used from two threads
        self._last_submitted = 0
        self._tickets = 0
        self._closed = False
        self._publisher: Publisher | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sparkple-gather", daemon=True)
        self._thread.start()
        self._ready.wait()

    # ---------------------------------------------------------------- producer side

    def _checked_ids(self, row_ids: Any) -> np.ndarray:
        ids = np.asarray(row_ids, dtype=np.int64)
        if ids.ndim != 2 or ids.shape[1] != self.geometry.num_heads:
            want = f"[tokens, {self.geometry.num_heads}]"
            raise ValueError(f"row ids must be {want}, got {list(ids.shape)}")
        return ids

    def open_step(self, seq: int, *, timeout_s: float = DEFAULT_TIMEOUT_S, tokens: int = 0) -> None:
        """Reserve a staging slot for step `seq` (its pieces follow); waits for a free slot,
        and for the device copy that read that slot last."""
        if tokens > self.max_tokens:
            self._count("staging_overruns")
            raise ValueError(
                f"step {seq} has {tokens} tokens, the staging holds {self.max_tokens}: "
                "raise max_tokens to the scheduler's max_num_batched_tokens"
            )
        with self._lock:
            if self._closed:
                raise HandshakeError("the gather worker is closed")
            if seq <= self._last_submitted:
                raise HandshakeError(
                    f"submit({seq}) after submit({self._last_submitted}): step numbers must "
                    "increase"
                )
            if not self._lock.wait_for(lambda: self._free or self._closed, timeout=timeout_s):
                raise HandshakeError(
                    f"no free staging slot for step {seq} after {timeout_s} s: steps "
                    f"{sorted(self._held)} were never released; call release(seq) after "
                    "consuming each step"
                )
            if self._closed:
                raise HandshakeError("the gather worker is closed")
            slot = self._free.pop(0)
            event, self._slot_events[slot] = self._slot_events[slot], None
            self._held[seq] = _Step(seq, slot)
            self._last_submitted = seq
        if event is not None:
            event.synchronize()  # the copy of an earlier step still reads this slot

    def submit_pieces(self, seq: int, pieces: list[tuple[int, Any]]) -> None:
        """Queue rows for the gather thread: each piece's row ids land at its token offset."""
        checked = [(int(start), self._checked_ids(ids)) for start, ids in pieces]
        end = max((start + ids.shape[0] for start, ids in checked), default=0)
        self._queue(seq, checked, end)

    def _queue(self, seq: int, pieces: list[tuple[int, np.ndarray]], end: int) -> None:
        if end > self.max_tokens:
            self._count("staging_overruns")
            raise ValueError(
                f"step {seq} needs {end} token rows, the staging holds {self.max_tokens}"
            )
        with self._lock:
            step = self._step(seq)
            self._tickets += 1
            step.ticket = self._tickets
            step.tokens = max(step.tokens, end)
            job = _Job(step, self._tickets, pieces)
        self._jobs.put(job)

    def prepare_inline(
        self,
        seq: int,
        ids: np.ndarray,
        runs: Sequence[tuple[int, int]],
        bounds: tuple[int, int] | None = None,
    ) -> InlineGather:
        """A gather of `ids` (int64[T, num_heads], filled later) into step `seq`'s slot, for
        gather_prepared: run k, `(step offset, tokens)`, takes the next `tokens` rows of ids.
        The shapes are checked here; the values there, unless `bounds` ([low, high) of every
        id the producer can write, a hash's) are checked against the table here instead."""
        # the buffer itself, never a converted copy: its values are written after this call
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 or not ids.flags.c_contiguous:
            raise ValueError("prepared row ids must be a C-contiguous int64 numpy buffer")
        ids = self._checked_ids(ids)
        heads, width = self.geometry.num_heads, self.table.row_width
        if sum(count for _, count in runs) != ids.shape[0]:
            raise ValueError(f"runs {list(runs)} do not cover the {ids.shape[0]} tokens of ids")
        end = max((start + count for start, count in runs), default=0)
        if end > self.max_tokens:
            self._count("staging_overruns")
            raise ValueError(
                f"step {seq} needs {end} token rows, the staging holds {self.max_tokens}"
            )
        if bounds is not None:
            low, high = bounds
            check_row_range(np.array([low, high - 1]), self.table.meta.total_rows)
        with self._lock:
            step = self._step(seq)
        staging = self.staging[step.slot]
        takes, pieces, taken = [], [], 0
        for start, count in runs:
            run = ids[taken : taken + count]
            pieces.append((int(start), run))
            staged = staging[start : start + count].reshape(count * heads, width)  # a view
            takes.append((run.reshape(-1), staged))
            taken += count
        return InlineGather(step, ids.reshape(-1), takes, pieces, end, bounds is None)

    def gather_prepared(self, job: InlineGather) -> None:
        """The prepared gather, now that its ids are in: one range check for the advice and
        the takes (none when their bounds were checked before), the pages advised (on a warm
        table a check of recently advised pages; on a cold one every read in flight before
        the first take waits), then one take per run. (Advice from a helper thread was
        measured slower warm, as fast cold: it contends for the GIL.)"""
        ids = job.ids
        if ids.size:
            if job.check:
                check_row_range(ids, self.table.meta.total_rows)
            if self.owned is not None:  # a rank's rows: zeros for the others
                self._gather(job.step.slot, job.pieces)
            else:
                issued = self._advise(ids)
                rows = self.table.rows
                for run, staged in job.takes:
                    # mode="clip" (ids are checked above): "raise" would buffer the output
                    np.take(rows, run, axis=0, out=staged, mode="clip")
                if self.stats is not None:
                    counts = {"gather_calls": 1, "rows_gathered": int(ids.size)}
                    if issued is not None:
                        counts.update(prefetch_calls=1, pages_prefetched=issued)
                    self.stats.add_all(counts)
        with self._lock:
            job.step.tokens = max(job.step.tokens, job.end)

    def _advise(self, ids: np.ndarray) -> int | None:
        """WILLNEED for checked ids: the pages issued, None without a prefetcher."""
        if self.prefetcher is None:
            return None
        with self._prefetch_lock:
            if self.prefetcher.all_recent(ids):
                return 0
            return self.prefetcher.prefetch(ids).issued_pages

    def _step(self, seq: int) -> _Step:
        step = self._held.get(seq)
        if step is None:
            raise HandshakeError(f"step {seq} was never submitted or is already released")
        return step

    def _prefetch(self, ids: np.ndarray) -> None:
        if self.prefetcher is None:
            return
        with self._prefetch_lock:
            stats = self.prefetcher.prefetch(ids)
        self._count("prefetch_calls")
        self._count("pages_prefetched", stats.issued_pages)

    def _gather(self, slot: int, pieces: list[tuple[int, np.ndarray]]) -> None:
        pieces = [(start, ids) for start, ids in pieces if ids.shape[0]]
        if not pieces:
            return
        self._prefetch(np.concatenate([ids.reshape(-1) for _, ids in pieces]))
        for start, ids in pieces:
            staged = self.staging[slot, start : start + ids.shape[0]]
            gather_rows(self.table.rows, ids, staged, self.owned)
            read = ids.size if self.owned is None else int(self.owned.mask(ids).sum())
            self._count("rows_gathered", read)  # a rank counts the rows it read, not its zeros
        self._count("gather_calls")

    def _run(self) -> None:
        self._publisher = Publisher(self._flag)  # this thread is the producer waiters watch
        self._ready.set()
        while (job := self._jobs.get()) is not None:
            try:
                self._gather(job.step.slot, job.pieces)
            except Exception as exc:  # handed to the consumer of this step
                with self._lock:
                    self._failed.setdefault(job.step.seq, exc)
            self._publisher.publish(job.ticket)
        self._publisher.close()

    def _count(self, name: str, amount: int = 1) -> None:
        if self.stats is not None:
            self.stats.add(name, amount)

    # ---------------------------------------------------------------- consumer side

    def wait(
        self, seq: int, timeout_s: float = DEFAULT_TIMEOUT_S, tokens: int | None = None
    ) -> np.ndarray:
        """The staged rows of step `seq` (uint8[T, H, row_width]) once every background piece
        of it is in; T is `tokens`, or the end of its furthest piece.

        Raises HandshakeTimeout, ProducerDied, or the error the worker hit on this step.
        """
        step = self.wait_for(seq, timeout_s)
        return self.staging[step.slot, : step.tokens if tokens is None else tokens]

    def wait_for(self, seq: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> _Step:
        """Wait until every background piece of step `seq` is in (raises as wait does)."""
        with self._lock:
            step = self._step(seq)
            ticket = step.ticket
        if ticket:
            started = time.monotonic()
            self._waiter.wait(ticket, timeout_s)
            if self.stats is not None:
                self.stats.observe_wait(time.monotonic() - started)
            with self._lock:
                # the thread runs jobs in order: every earlier ticket of this step is done too
                error = self._failed.get(seq)
            if error is not None:
                raise error
        return step

    def upload(self, seq: int, rows: np.ndarray, out: torch.Tensor) -> None:
        """Copy a waited step's rows into out[:T] (a device buffer), asynchronously from pinned
        staging; release(seq) waits for the copy before the slot can be refilled."""
        import torch

        host = torch.from_numpy(rows)
        target = out[: host.shape[0]]
        target.copy_(host.view(target.shape), non_blocking=self._pinned is not None)
        if target.device.type == "cuda":
            self._copied(seq)

    def prepare_upload(self, seq: int, tokens: int, out: torch.Tensor) -> Upload:
        """The views of step `seq`'s upload of its first `tokens` rows into out[:tokens] (a
        device buffer [max_tokens, heads, row_width]), for upload_prepared."""
        import torch

        if self._staging_tensor is None:
            pinned = self._pinned
            self._staging_tensor = torch.from_numpy(self.staging) if pinned is None else pinned
        with self._lock:
            step = self._step(seq)
        host = self._staging_tensor[step.slot, :tokens]
        device = out[:tokens].view(host.shape)
        return Upload(step, host, device, device.device.type == "cuda")

    def upload_prepared(self, upload: Upload) -> None:
        """The prepared upload, as upload does it: asynchronous from pinned staging, the slot
        refilled only after the copy completed."""
        upload.device.copy_(upload.host, non_blocking=self._pinned is not None)
        if upload.cuda:
            self._copied(upload.step.seq)

    def _copied(self, seq: int) -> None:
        """Mark the device copy just queued from step `seq`'s slot (an event on its stream)."""
        import torch

        # torch leaves Event.__new__ unannotated
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        with self._lock:
            self._slot_events[self._step(seq).slot] = event

    def release(self, seq: int) -> None:
        """Give step `seq`'s staging slot back, without waiting: the slot is handed out again
        only after the device copy that read it has completed."""
        with self._lock:
            step = self._held.pop(seq, None)
            if step is None:
                raise HandshakeError(f"release({seq}): step {seq} is not held")
            self._failed.pop(seq, None)
            self._free.append(step.slot)
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        self._jobs.put(None)
        self._thread.join()
        if self.prefetcher is not None and self._own_prefetcher:
            self.prefetcher.close()
        self._flag.close()

    def __enter__(self) -> GatherWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
