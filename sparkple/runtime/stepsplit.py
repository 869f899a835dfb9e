"""Which of a step's PLE rows the host can compute before the device sync, and which it cannot.

A V2-runner step lays its requests' tokens out by `query_start_loc`. A request still in its
prefill schedules prompt tokens at positions `computed .. computed + n`; the runner fills them
from the prompt it was handed when the request was added (`prefill_token_ids`), and their
n-gram context (the ngram_size - 1 tokens before `computed`) lies inside that prompt too. So
every token at a position below the request's prefill length, other than a draft slot, is known
on the host before the step's device work has run. The rest (the sampled token and MTP drafts
of decoding requests, a prompt's tail slots past its prefill length) exist only on the device.

`split_step` plans the step from the host's own batch description; `host_pieces` (before the
sync) and `plan_device` with `DeviceRows` (made before it, computed after it) turn each half
into row-id pieces `(token offset, int64[T, num_heads])` that the gather writes at that
offset of the step's staging slot. Row ids are computed on a compact layout (each segment
with its own context), which hashes a token exactly as the whole batch would: a token's ids
depend only on itself and the ngram_size - 1 tokens before it in its request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..geometry import PLEGeometry
from .ngram import WindowHash, row_ids


@dataclass(frozen=True)
class StepSplit:
    """A step's tokens by where their ids come from.

    host_*: one segment per request with prompt tokens this step (its first tokens): the
      tokens, their compact boundaries, each segment's context and its offset in the step.
    device_*: per request with tokens only the device has: its batch index and the
      [start, end) offsets of those tokens (always the request's last ones).
    """

    num_reqs: int
    num_real: int  # query_start_loc[num_reqs]: tokens past it are padding
    query_start_loc: np.ndarray  # int64[num_reqs + 1], the host's layout
    host_ids: np.ndarray
    host_qsl: np.ndarray
    host_ctx: np.ndarray
    host_starts: np.ndarray
    host_reqs: np.ndarray  # batch index of each host segment
    device_reqs: np.ndarray
    device_starts: np.ndarray
    device_ends: np.ndarray
    # The host's layout may differ from the device's (adaptive draft verification moves
    # request boundaries on the device): True when drafts were scheduled this step.
    layout_from_device: bool

    @property
    def needs_device(self) -> bool:
        """Whether any token id (or the layout) has to come from the device."""
        return self.device_reqs.size > 0 or self.layout_from_device

    @property
    def host_tokens(self) -> int:
        return int(self.host_ids.shape[0])

    def device_span(self) -> tuple[int, int]:
        """The smallest [lo, hi) of the step's tokens that holds every device token."""
        if not self.device_reqs.size:
            return 0, 0
        return int(self.device_starts.min()), int(self.device_ends.max())


def _context(prompt: np.ndarray, end: int, context: int, eos: int) -> np.ndarray:
    """The `context` prompt tokens before position `end`, EOS where none exists (as vLLM)."""
    out = np.full(context, eos, dtype=np.int64)
    first = end - context
    take = prompt[max(first, 0) : end]
    out[context - take.shape[0] :] = take
    return out


def split_step(
    query_start_loc: np.ndarray,
    num_reqs: int,
    prompts: list[np.ndarray | None],
    computed: np.ndarray,
    prefill_len: np.ndarray,
    is_prefilling: np.ndarray,
    num_draft_tokens: np.ndarray | None,
    geometry: PLEGeometry,
) -> StepSplit:
    """Plan a step from the runner's host-side batch (all arrays in batch order).

    prompts[i]: request i's prefill tokens as the runner was handed them, or None when
    unknown (all of its tokens then come from the device). computed: the prefill tokens
    computed before this step (the runner's num_computed_prefill_tokens).
    """
    qsl = np.asarray(query_start_loc[: num_reqs + 1], dtype=np.int64)
    context = geometry.ngram_size - 1
    eos = geometry.eos_token_id
    ids, bounds, ctxs, starts, host_reqs = [], [0], [], [], []
    dev_reqs, dev_starts, dev_ends = [], [], []
    for i in range(num_reqs):
        start, end = int(qsl[i]), int(qsl[i + 1])
        count = end - start
        if count <= 0:
            continue
        host = 0
        prompt = prompts[i]
        if prompt is not None and bool(is_prefilling[i]):
            done = int(computed[i])
            drafts = 0 if num_draft_tokens is None else int(num_draft_tokens[i])
            length = min(int(prefill_len[i]), prompt.shape[0])
            host = max(0, min(count - drafts, length - done))
            if host:
                ids.append(prompt[done : done + host])
                bounds.append(bounds[-1] + host)
                ctxs.append(_context(prompt, done, context, eos))
                starts.append(start)
                host_reqs.append(i)
        if host < count:
            dev_reqs.append(i)
            dev_starts.append(start + host)
            dev_ends.append(end)

    def array(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    return StepSplit(
        num_reqs=num_reqs,
        num_real=int(qsl[-1]),
        query_start_loc=qsl,
        host_ids=np.concatenate(ids).astype(np.int64) if ids else np.empty(0, np.int64),
        host_qsl=array(bounds),
        host_ctx=np.stack(ctxs) if ctxs else np.empty((0, context), np.int64),
        host_starts=array(starts),
        host_reqs=array(host_reqs),
        device_reqs=array(dev_reqs),
        device_starts=array(dev_starts),
        device_ends=array(dev_ends),
        layout_from_device=num_draft_tokens is not None,
    )


def _pieces(
    ids: np.ndarray, qsl: np.ndarray, ctx: np.ndarray, starts: np.ndarray, geometry: PLEGeometry
) -> list[tuple[int, np.ndarray]]:
    if not ids.shape[0]:
        return []
    rows = row_ids(ids, qsl, ctx, geometry)
    return [(int(start), rows[qsl[j] : qsl[j + 1]]) for j, start in enumerate(starts.tolist())]


def host_pieces(split: StepSplit, geometry: PLEGeometry) -> list[tuple[int, np.ndarray]]:
    """Row ids of the step's prompt tokens, one piece per request, at their step offsets."""
    return _pieces(split.host_ids, split.host_qsl, split.host_ctx, split.host_starts, geometry)


@dataclass(frozen=True)
class DevicePlan:
    """Where the n-gram window of each device token comes from, fixed before the sync.

    Each device token's window (itself and the ngram_size - 1 tokens before it) is read from
    one source laid out as [ngram_context.ravel(), span, host_values]: the device's context
    rows and its copy of the step's tokens, then the prompt tokens of this step that some
    window reaches back into (known on the host). Which entry each window slot reads is known
    from the host's layout, so after the sync the windows are one take and the hash a few
    calls (DeviceRows); the host step copies the device's values straight into such a source.
    """

    windows_from: np.ndarray  # int64[ngram_size, T]: index into the source per window slot
    host_values: np.ndarray  # int64: the prompt tokens windows read
    runs: tuple[tuple[int, int], ...]  # (step offset, tokens): adjacent segments as one gather
    span_start: int  # the step offset the device's copy of the tokens starts at
    span_base: int  # where that copy starts in the source (after the context rows)
    host_base: int  # where host_values start in the source (after the copy)

    @property
    def tokens(self) -> int:
        return int(self.windows_from.shape[1])

    @property
    def source_size(self) -> int:
        return self.host_base + int(self.host_values.shape[0])

    def source(self, ngram_context: np.ndarray, span: np.ndarray) -> np.ndarray:
        """The source from separate copies of the context and the tokens."""
        return np.concatenate([ngram_context.reshape(-1), span, self.host_values])


def plan_device(split: StepSplit, geometry: PLEGeometry) -> DevicePlan | None:
    """The windows of the step's device tokens (None when the step has none)."""
    if not split.device_reqs.size:
        return None
    context = geometry.ngram_size - 1
    span_start, span_end = split.device_span()
    span_base = split.num_reqs * context  # the span follows the context rows in the source
    host_base = span_base + span_end - span_start  # the host values follow the span
    host_of = {int(r): j for j, r in enumerate(split.host_reqs.tolist())}
    layout: list[np.ndarray] = []  # per request, its window then its tokens
    host_values: list[np.ndarray] = []
    runs: list[list[int]] = []
    positions, flat_len, host_len = [], 0, 0
    for i, start, end in zip(
        split.device_reqs.tolist(),
        split.device_starts.tolist(),
        split.device_ends.tolist(),
        strict=True,
    ):
        # before the device tokens: the device's context of the request, extended by the
        # request's prompt tokens of this step when it has some (they come first)
        before = np.arange(i * context, (i + 1) * context, dtype=np.int64)
        j = host_of.get(i)
        if j is not None:
            prompt_part = split.host_ids[split.host_qsl[j] : split.host_qsl[j + 1]][-context:]
            host_index = host_base + host_len + np.arange(prompt_part.shape[0], dtype=np.int64)
            host_values.append(prompt_part)
            host_len += prompt_part.shape[0]
            before = np.concatenate([before, host_index])[-context:]
        count = end - start
        layout += [before, span_base + start - span_start + np.arange(count, dtype=np.int64)]
        positions.append(np.arange(flat_len + context, flat_len + context + count))
        flat_len += context + count
        if runs and runs[-1][0] + runs[-1][1] == start:  # adjacent to the previous segment
            runs[-1][1] += count
        else:
            runs.append([start, count])
    back = np.arange(geometry.ngram_size, dtype=np.int64)[:, None]
    return DevicePlan(
        windows_from=np.concatenate(layout)[np.concatenate(positions)[None, :] - back],
        host_values=(
            np.concatenate(host_values).astype(np.int64) if host_values else np.empty(0, np.int64)
        ),
        runs=tuple((int(a), int(b)) for a, b in runs),
        span_start=span_start,
        span_base=span_base,
        host_base=host_base,
    )


class DeviceRows:
    """The row ids of a step's device tokens, into buffers made before the sync.

    After it, `compute(source)` is one take of the windows from the source and the hash
    (sparkple.runtime.ngram.WindowHash): a fixed handful of numpy calls, no allocation.
    `ids` holds the plan's runs one after another: run k's rows land at its step offset;
    `bounds` is [low, high) of every id the hash can write there.
    """

    def __init__(
        self, plan: DevicePlan, geometry: PLEGeometry, dtype: npt.DTypeLike = np.int32
    ) -> None:
        n, tokens = plan.windows_from.shape
        self.plan = plan
        self._hash = WindowHash.of(geometry)
        self.bounds = self._hash.bounds
        self._windows = np.empty((n, tokens), dtype=dtype)  # the source's dtype (take's rule)
        self._mixed = np.empty((n, tokens), dtype=np.int64)
        self._seen = np.empty((max(n - 2, 0), tokens), dtype=bool)
        self.ids = np.empty((tokens, geometry.num_heads), dtype=np.int64)
        self.pieces: list[tuple[int, np.ndarray]] = []
        taken = 0
        for start, count in plan.runs:
            self.pieces.append((start, self.ids[taken : taken + count]))
            taken += count

    def compute(self, source: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """Fill `ids` from the source (laid out as the plan says); returns the pieces
        `(step offset, ids of the run)`, views of `ids`."""
        np.take(source, self.plan.windows_from, out=self._windows, mode="clip")
        self._hash.rows_into(self._windows, self.ids, self._mixed, self._seen)
        return self.pieces


def device_rows(
    plan: DevicePlan, span: np.ndarray, ngram_context: np.ndarray, geometry: PLEGeometry
) -> list[tuple[int, np.ndarray]]:
    """Row-id pieces of the device tokens, from the device's copy of them.

    span: the step's token ids from plan.span_start on, as copied from the device;
    ngram_context: the device's per-request context [num_reqs, ngram_size - 1].
    """
    source = plan.source(ngram_context, span)
    return DeviceRows(plan, geometry, source.dtype).compute(source)
