"""The host step in vLLM: what the patched model state calls, each step before the forward
(host_step), when it adds and removes a request (add_request, remove_request) and before graph
capture (dummy_step), driving every packed-table PLE layer of the model in the step order that
sparkple/vllm/__init__.py describes.

settings.HOST_PROBES is read at each step (a test turns the probes off by setting it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.logger import init_logger

from sparkple.runtime.stepsplit import StepSplit, plan_device, split_step

from . import settings
from .packed_table import PackedTableEmbedding

# under vLLM's own logger, whose handler and level vLLM sets up: logged like its modules
logger = init_logger("vllm.sparkple.host_step")


def packed_tables(model: nn.Module) -> list[PackedTableEmbedding]:
    """The model's packed-table PLE layers (found once, then cached on the model)."""
    found = getattr(model, "_sparkple_packed_tables", None)
    if found is None:
        found = []
        for module in model.modules():
            embedding = getattr(module, "ngram_embedding", None)
            if isinstance(embedding, PackedTableEmbedding):
                # The n-gram module holds the hash buffers the checkpoint loaded.
                embedding.bind_hash(module)
                found.append(embedding)
        vars(model)["_sparkple_packed_tables"] = found  # a plain attribute, not a submodule
    return found


def _is_dummy(input_batch: Any, req_states: Any) -> bool:
    """Profile, warm-up and DP-idle batches name requests the runner never added."""
    known = req_states.req_id_to_index
    return not all(req_id in known for req_id in input_batch.req_ids)


class HostStep:
    """The model's packed PLE layers, the prompts of its requests, and the step order.

    wait_before_forward: the reference's order (everything after the device sync, no
    lookahead), kept for the benchmark that compares the two.
    decode_rows_inline: gather the device's tokens' rows on the model thread (the default,
    measured faster) or hand them to the gather thread (the benchmark measures both).
    wait_for_device: how the host waits for the device's copy of the step's inputs (an event
    on the current stream; the benchmark models the device's busy time instead).
    """

    def __init__(self, tables: list[PackedTableEmbedding]) -> None:
        self.tables = tables
        self.prompts: dict[int, np.ndarray] = {}  # request slot -> prefill token ids
        self.slots: dict[str, int] = {}  # request id -> slot
        self.wait_before_forward = False
        self.decode_rows_inline = True
        self.wait_for_device: Callable[[], None] | None = None
        # the last step: seconds before the sync, waiting for it, after it; whether it synced
        self.last_times: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self.last_synced = False

    def add_request(self, req_index: int, req_id: str, prompt: Any, computed: int) -> None:
        self.remove_request(req_id)
        tokens = np.asarray(prompt, dtype=np.int64).reshape(-1)
        self.prompts[req_index] = tokens
        self.slots[req_id] = req_index
        if self.wait_before_forward:
            return
        for table in self.tables:
            if table._lookahead is not None:
                table._lookahead.add(req_id, table.plan_prompt(tokens), start=computed)

    def remove_request(self, req_id: str) -> None:
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.prompts.pop(slot, None)
        for table in self.tables:
            if table._lookahead is not None:
                table._lookahead.remove(req_id)

    def run(
        self, input_batch: Any, query_start_loc: torch.Tensor, ngram_context: torch.Tensor
    ) -> None:
        tables = self.tables
        num_tokens = input_batch.num_tokens_after_padding
        num_reqs = input_batch.num_reqs
        started = time.perf_counter()
        if self.wait_before_forward:
            inputs = tables[0]._inputs.copy_all(
                input_batch.input_ids[:num_tokens],
                query_start_loc[: num_reqs + 1],
                ngram_context[:num_reqs],
                self.wait_for_device,
            )
            synced = time.perf_counter()
            self.last_synced = True
            for table in tables:
                table.load_step(*inputs, num_tokens)
            self.last_times = (0.0, synced - started, time.perf_counter() - synced)
            return
        # (a) before any device sync: the prompt tokens' rows, every layer
        slots = input_batch.idx_mapping_np[:num_reqs].tolist()
        split = split_step(
            input_batch.query_start_loc_np,
            num_reqs,
            [self.prompts.get(int(slot)) for slot in slots],
            input_batch.num_computed_prefill_tokens_np,
            input_batch.prefill_len_np,
            input_batch.is_prefilling_np,
            input_batch.num_draft_tokens_per_req,
            tables[0]._loaded_geometry(),
        )
        seqs = [table.open_step(num_tokens) for table in tables]
        for table, seq in zip(tables, seqs, strict=True):
            table.submit_prompt_rows(seq, split)
        self._advance_lookahead(input_batch, split)
        # the rest of the step made now: the device tokens' windows (which values will come
        # from the device's copy), the buffers and views their rows and the upload go through
        plan = plan_device(split, tables[0]._loaded_geometry())
        steps = [
            table.prepare_step(seq, split, plan, num_tokens, self.decode_rows_inline)
            for table, seq in zip(tables, seqs, strict=True)
        ]
        expected_layout = split.query_start_loc.astype(np.int32).tobytes()
        before = time.perf_counter()
        synced = before
        self.last_synced = split.needs_device
        # (b) only for tokens the device made: their copy, one wait, their rows
        if split.needs_device:
            lo, hi = split.device_span()
            offsets, expected = prompt_probes(split)
            source, device_qsl, probed = tables[0]._inputs.copy_device(
                plan,
                input_ids=input_batch.input_ids[lo:hi],
                query_start_loc=query_start_loc[: num_reqs + 1],
                ngram_context=ngram_context[:num_reqs],
                wait=self.wait_for_device,
                probes=(input_batch.input_ids, offsets),
            )
            synced = time.perf_counter()
            # the device moved request boundaries (adaptive draft verification), or the host's
            # prompt tokens are not the device's: every row from the device's own inputs
            moved = device_qsl.tobytes() != expected_layout
            if moved or self._distrusted(input_batch, split, offsets, expected, probed):
                inputs = tables[0]._inputs.copy_all(
                    input_batch.input_ids[:num_tokens],
                    query_start_loc[: num_reqs + 1],
                    ngram_context[:num_reqs],
                    self.wait_for_device,
                )
                for table, seq in zip(tables, seqs, strict=True):
                    table.abandon_step(seq)
                    table.load_step(*inputs, num_tokens)
                self.last_times = (before - started, synced - before, time.perf_counter() - synced)
                return
            for table, step in zip(tables, steps, strict=True):
                table.gather_device_rows(step, source)
        # (c) the rows in, one upload per layer
        for table, step in zip(tables, steps, strict=True):
            table.finish_prepared(step)
        self.last_times = (before - started, synced - before, time.perf_counter() - synced)

    def _distrusted(
        self,
        input_batch: Any,
        split: StepSplit,
        offsets: list[int],
        expected: list[int],
        probed: np.ndarray,
    ) -> bool:
        """Whether a probed prompt token differs from the device's. Each request whose does is
        counted (sparkple_ple_host_device_mismatch_total), logged, and its prompt dropped:
        from then on all of its tokens' rows come from the device's inputs."""
        wrong = [k for k, value in enumerate(probed.tolist()) if value != expected[k]]
        for k in wrong:
            index = int(split.host_reqs[k])
            req_id = input_batch.req_ids[index]
            logger.warning(
                "PLE: the host's prompt token at step position %d of request %s is %d, the "
                "device's is %d: this step's rows, and all of this request's rows from now "
                "on, come from the device's inputs",
                offsets[k],
                req_id,
                expected[k],
                int(probed[k]),
            )
            self.tables[0]._stats.add("host_device_mismatch")
            self.prompts.pop(int(input_batch.idx_mapping_np[index]), None)
            for table in self.tables:
                if table._lookahead is not None:
                    table._lookahead.remove(req_id)
        return bool(wrong)

    def _advance_lookahead(self, input_batch: Any, split: StepSplit) -> None:
        lookaheads = [t._lookahead for t in self.tables if t._lookahead is not None]
        if not lookaheads:
            return
        computed = input_batch.num_computed_prefill_tokens_np
        for j, i in enumerate(split.host_reqs.tolist()):
            upto = int(computed[i]) + int(split.host_qsl[j + 1] - split.host_qsl[j])
            for lookahead in lookaheads:
                lookahead.consumed(input_batch.req_ids[i], upto)


def prompt_probes(split: StepSplit) -> tuple[list[int], list[int]]:
    """The step offsets and the host's token ids of the last prompt token of the step's first
    HOST_PROBES prompt segments (probe k belongs to segment k, request split.host_reqs[k])."""
    ends = split.host_qsl[1 : settings.HOST_PROBES + 1]
    starts = split.host_starts[: settings.HOST_PROBES]
    offsets = (starts + ends - split.host_qsl[: ends.shape[0]] - 1).tolist()
    return offsets, split.host_ids[ends - 1].tolist()


def host_step_of(model: nn.Module) -> HostStep:
    """The model's HostStep (made once, then cached on the model)."""
    found = getattr(model, "_sparkple_host_step", None)
    if found is None:
        found = HostStep(packed_tables(model))
        vars(model)["_sparkple_host_step"] = found  # a plain attribute, not a submodule
    return found


def add_request(model: nn.Module, req_index: int, new_req_data: Any) -> None:
    """Called by the model state's add_request: keep the request's prefill tokens."""
    step = host_step_of(model)
    if step.tables:
        step.add_request(
            req_index,
            new_req_data.req_id,
            new_req_data.prefill_token_ids,
            int(new_req_data.num_computed_tokens),
        )


def remove_request(model: nn.Module, req_id: str) -> None:
    """Called by the model state's remove_request: drop its prompt, stop its lookahead."""
    step = host_step_of(model)
    if step.tables:
        step.remove_request(req_id)


def host_step(
    model: nn.Module,
    input_batch: Any,
    req_states: Any,
    query_start_loc: torch.Tensor,
    ngram_context: torch.Tensor,
) -> None:
    """Called by the model state's prepare_inputs every step, before the forward."""
    step = host_step_of(model)
    if not step.tables:
        return
    if _is_dummy(input_batch, req_states):
        for table in step.tables:
            table.load_dummy(input_batch.num_tokens_after_padding)
        return
    step.run(input_batch, query_start_loc, ngram_context)


def dummy_step(model: nn.Module, num_tokens: int) -> None:
    """Called by the model state's prepare_dummy_inputs, before graph capture."""
    for table in packed_tables(model):
        table.load_dummy(num_tokens)
