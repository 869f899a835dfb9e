"""The host/device split of a step: prompt rows before the sync, the rest after, same bytes.

Steps are built as the V2 runner lays them out (prompt chunks, decode tokens, MTP drafts,
padding requests); the rows staged from the two halves must equal the rows of the whole
batch's ids read straight from the file.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import gather_steps
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.stepsplit import (
    DeviceRows,
    device_rows,
    host_pieces,
    plan_device,
    split_step,
)
from sparkple.runtime.table import open_table
from sparkple.runtime.worker import GatherWorker

from .conftest import direct_rows


@pytest.fixture
def table(built_table):
    with open_table(built_table.table_dir) as t:
        yield t


def random_step(rng, geometry, num_reqs: int, with_drafts: bool):
    """Requests with a prompt and generated tokens, each scheduled at a random point."""
    eos, c = geometry.eos_token_id, geometry.ngram_size - 1
    seqs, prompts, computed, counts, drafts = [], [], [], [], []
    for _ in range(num_reqs):
        length = int(rng.integers(8, 120))
        seq = rng.integers(0, geometry.vocab_size, length)
        seq[rng.random(length) < 0.08] = eos
        prompt_len = int(rng.integers(1, length))
        done = int(rng.integers(0, length - 1))
        count = int(rng.integers(1, length - done + 1))
        draft = 0
        if with_drafts and done >= prompt_len and count > 1:
            draft = int(rng.integers(0, min(3, count - 1) + 1))
        seqs.append(seq)
        prompts.append(seq[:prompt_len])
        computed.append(done)
        counts.append(count)
        drafts.append(draft)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    input_ids = np.concatenate(
        [s[d : d + n] for s, d, n in zip(seqs, computed, counts, strict=True)]
    )
    ctx = np.full((num_reqs, c), eos, dtype=np.int64)
    for i, (s, d) in enumerate(zip(seqs, computed, strict=True)):
        take = s[max(0, d - c) : d]
        ctx[i, c - take.shape[0] :] = take
    prefill_len = np.array([p.shape[0] for p in prompts])
    done_prefill = np.minimum(np.array(computed), prefill_len)
    return {
        "input_ids": input_ids,
        "qsl": qsl,
        "ctx": ctx,
        "prompts": prompts,
        "computed": done_prefill,
        "prefill_len": prefill_len,
        "is_prefilling": done_prefill < prefill_len,
        "drafts": np.array(drafts, dtype=np.int32) if with_drafts else None,
    }


def staged(worker, seq, split, step, geometry, prepared=True):
    """The step through the worker as the host step runs it: prompt rows to the thread
    before the sync, and the device tokens' windows, id buffers and gather prepared then;
    after it, the device's values land in one int32 source laid out as the plan reads it
    (as the backend's pinned copy does), and their rows are gathered inline. Not prepared:
    device_rows and gather_inline from separate copies, after the sync."""
    worker.open_step(seq)
    worker.submit_pieces(seq, host_pieces(split, geometry))
    plan = plan_device(split, geometry)  # before the sync
    lo, hi = split.device_span()
    span = step["input_ids"][lo:hi]
    if plan is not None and prepared:
        rows = DeviceRows(plan, geometry)
        job = worker.prepare_inline(seq, rows.ids, plan.runs)
        source = np.full(plan.source_size + 5, -1, dtype=np.int32)[: plan.source_size]
        source[plan.host_base :] = plan.host_values
        source[: plan.span_base] = step["ctx"].reshape(-1)  # the sync: the device's values
        source[plan.span_base : plan.host_base] = span
        rows.compute(source)
        worker.gather_prepared(job)
    elif plan is not None:
        gather_steps.gather_inline(worker, seq, device_rows(plan, span, step["ctx"], geometry))
    rows = worker.wait(seq, 30, tokens=split.num_real).copy()
    worker.release(seq)
    return rows


@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize("with_drafts", [False, True])
def test_split_steps_stage_the_rows_of_the_whole_batch(table, built_table, with_drafts, prepared):
    geometry = built_table.geometry
    rng = np.random.default_rng(21 + with_drafts)
    with GatherWorker(table, geometry, max_tokens=2048, slots=3) as worker:
        for seq in range(1, 31):
            step = random_step(rng, geometry, int(rng.integers(1, 7)), with_drafts)
            split = split_step(
                step["qsl"],
                len(step["prompts"]),
                step["prompts"],
                step["computed"],
                step["prefill_len"],
                step["is_prefilling"],
                step["drafts"],
                geometry,
            )
            want = row_ids(step["input_ids"], step["qsl"], step["ctx"], geometry)
            assert split.num_real == want.shape[0]
            got = staged(worker, seq, split, step, geometry, prepared)
            np.testing.assert_array_equal(got, direct_rows(table.data_path, want, table.row_width))
            # prompt tokens are exactly the host's: positions below the prefill length that
            # are not draft slots
            assert split.host_tokens == sum(
                max(0, min(n - d, p - c)) if ip else 0
                for n, d, p, c, ip in zip(
                    np.diff(step["qsl"]),
                    step["drafts"] if with_drafts else [0] * len(step["prompts"]),
                    step["prefill_len"],
                    step["computed"],
                    step["is_prefilling"],
                    strict=True,
                )
            )


def test_a_step_of_prompt_tokens_needs_nothing_from_the_device(built_table):
    g = built_table.geometry
    prompts: list[np.ndarray | None] = [np.arange(100), np.arange(50) + 7]
    qsl = np.array([0, 40, 90, 90])  # and one padding request
    args = (qsl, 2, prompts, np.array([0, 0]), np.array([100, 50]), np.array([True, True]))
    split = split_step(*args, None, g)
    assert not split.needs_device and split.host_tokens == 90 and split.num_real == 90
    np.testing.assert_array_equal(split.host_ids[:40], np.arange(40))
    # drafts scheduled anywhere in the batch: the layout is checked against the device's
    assert split_step(*args, np.array([0, 0], dtype=np.int32), g).needs_device


def test_decode_tokens_drafts_and_unknown_prompts_come_from_the_device(built_table):
    g = built_table.geometry
    eos = g.eos_token_id
    # r0: prompt of 10, computed 8, 4 tokens: two prompt tokens, a sampled one, one draft
    # r1: decoding with 3 drafts; r2: a prompt the host was never handed
    qsl = np.array([0, 4, 8, 12])
    split = split_step(
        qsl,
        3,
        [np.arange(10), np.arange(20), None],
        np.array([8, 20, 0]),
        np.array([10, 20, 12]),
        np.array([True, False, True]),
        np.array([1, 3, 0], dtype=np.int32),
        g,
    )
    assert split.host_reqs.tolist() == [0]
    assert split.host_ids.tolist() == [8, 9]
    assert split.host_ctx.tolist() == [[6, 7]]
    assert list(zip(split.device_reqs, split.device_starts, split.device_ends, strict=True)) == [
        (0, 2, 4),
        (1, 4, 8),
        (2, 8, 12),
    ]
    assert split.device_span() == (2, 12)
    # a request's first token has EOS context
    first = split_step(
        np.array([0, 3]),
        1,
        [np.arange(5)],
        np.array([0]),
        np.array([5]),
        np.array([True]),
        None,
        g,
    )
    assert first.host_ctx.tolist() == [[eos] * (g.ngram_size - 1)]
