"""The whole data path: table + prefetch + gather + worker thread + handshake, on real files.

Every staged step is compared with a direct pread of the same rows from the data file, with
the row ids computed for the whole sequence at once (so chunk contexts and EOS boundaries
must be carried correctly for the bytes to match).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from skip_guard import skip_without_cuda

from harness import gather_steps
from sparkple.errors import HandshakeError, ProducerDied, TableError
from sparkple.runtime.ngram import row_ids
from sparkple.runtime.nvfp4 import dequantize_rows
from sparkple.runtime.prefetch import Prefetcher
from sparkple.runtime.stats import PLEStats, StatsFile, parse
from sparkple.runtime.table import open_table
from sparkple.runtime.worker import GatherWorker

from .conftest import direct_rows

H = 16


def table_rows(table, ids: np.ndarray) -> np.ndarray:
    return direct_rows(table.data_path, ids, table.row_width)


def random_request(rng, geometry, length: int) -> np.ndarray:
    tokens = rng.integers(0, geometry.vocab_size, length)
    eos_at = rng.random(length) < 0.05
    tokens[eos_at] = geometry.eos_token_id
    return tokens


def fresh_batch(requests: list[np.ndarray], geometry) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step where every request starts here (context = EOS)."""
    ids = np.concatenate(requests)
    qsl = np.concatenate(([0], np.cumsum([len(r) for r in requests])))
    ctx = np.full((len(requests), geometry.ngram_size - 1), geometry.eos_token_id)
    return ids, qsl, ctx


@pytest.fixture
def table(built_table):
    with open_table(built_table.table_dir) as t:
        t.evict()  # every test starts cold
        yield t


def test_double_buffered_steps_equal_direct_reads(table, built_table):
    g = built_table.geometry
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(6):
        reqs = [random_request(rng, g, int(n)) for n in rng.integers(1, 200, rng.integers(1, 5))]
        batch = fresh_batch(reqs, g)
        steps.append((batch, table_rows(table, row_ids(*batch, g))))
    stats = PLEStats()
    with GatherWorker(table, g, max_tokens=1024, slots=2, stats=stats) as worker:
        gather_steps.submit_tokens(worker, 1, *steps[0][0])
        gather_steps.submit_tokens(worker, 2, *steps[1][0])
        held = worker.wait(1, timeout_s=30)
        np.testing.assert_array_equal(held, steps[0][1])
        for seq in range(2, len(steps) + 1):
            # Step seq was gathered into the other slot while step seq-1 is still held.
            staged = worker.wait(seq, timeout_s=30)
            np.testing.assert_array_equal(staged, steps[seq - 1][1])
            np.testing.assert_array_equal(held, steps[seq - 2][1])  # not overwritten
            assert np.shares_memory(staged, worker.staging)
            assert not np.shares_memory(staged, held)
            worker.release(seq - 1)
            if seq + 1 <= len(steps):
                gather_steps.submit_tokens(worker, seq + 1, *steps[seq][0])
            held = staged
        worker.release(len(steps))
    counters = stats.snapshot()["counters"]  # the thread advised each step's pages
    assert counters["prefetch_calls"] == len(steps) and counters["pages_prefetched"] > 0


def test_chunked_prefill_with_contexts_equals_the_whole_sequence(table, built_table):
    g = built_table.geometry
    rng = np.random.default_rng(1)
    seq_a = random_request(rng, g, 400)
    seq_a[[0, 57, 58, 199]] = g.eos_token_id  # EOS at a chunk edge and twice in a row
    seq_b = random_request(rng, g, 90)
    whole = table_rows(table, row_ids(*fresh_batch([seq_a, seq_b], g), g))
    want_a, want_b = whole[:400], whole[400:]
    cuts_a = [0, 1, 58, 200, 201, 400]  # chunks of 1, 57, 142, 1, 199 tokens
    cuts_b = [0, 45, 46, 90, 90, 90]
    got_a, got_b = [], []
    with GatherWorker(table, g, max_tokens=512) as worker:
        for step in range(len(cuts_a) - 1):
            chunks, ctx = [], []
            for seq, cuts in ((seq_a, cuts_a), (seq_b, cuts_b)):
                lo, hi = cuts[step], cuts[step + 1]
                chunks.append(seq[lo:hi])
                before = np.concatenate(([g.eos_token_id] * 2, seq[:lo]))[-2:]
                ctx.append(before)
            ids = np.concatenate(chunks)
            qsl = np.array([0, len(chunks[0]), len(ids)])
            gather_steps.submit_tokens(worker, step + 1, ids, qsl, np.array(ctx))
            staged = worker.wait(step + 1, timeout_s=30)
            got_a.append(staged[: len(chunks[0])].copy())
            got_b.append(staged[len(chunks[0]) :].copy())
            worker.release(step + 1)
    np.testing.assert_array_equal(np.concatenate(got_a), want_a)
    np.testing.assert_array_equal(np.concatenate(got_b), want_b)


def test_decode_steps_one_token_per_request(table, built_table):
    """Decode: one new token per request, context = its two previous tokens."""
    g = built_table.geometry
    rng = np.random.default_rng(2)
    histories = [random_request(rng, g, 30) for _ in range(3)]
    whole = [table_rows(table, row_ids(*fresh_batch([h], g), g)) for h in histories]
    with GatherWorker(table, g, max_tokens=8) as worker:
        for pos in range(2, 30):
            ids = np.array([h[pos] for h in histories])
            ctx = np.array([h[pos - 2 : pos] for h in histories])
            gather_steps.submit_tokens(worker, pos, ids, np.arange(4), ctx)
            staged = worker.wait(pos, timeout_s=30)
            for r in range(3):
                np.testing.assert_array_equal(staged[r], whole[r][pos])
            worker.release(pos)


def test_row_ids_path_decode_and_errors(table, built_table):
    g = built_table.geometry
    rng = np.random.default_rng(3)
    ids = rng.integers(0, table.total_rows, (33, H))
    ids[0] = table.total_rows - 1
    with GatherWorker(table, g, max_tokens=64, prefetch=Prefetcher(table)) as worker:
        gather_steps.submit_row_ids(worker, 1, ids)
        staged = worker.wait(1)
        want = table_rows(table, ids)
        np.testing.assert_array_equal(staged, want)
        decoded = gather_steps.decode(worker, 1, staged, "cpu")
        np.testing.assert_array_equal(
            decoded.numpy(), dequantize_rows(want, table.meta.global_scale, table.meta.head_dim)
        )
        worker.release(1)
        bad = ids.copy()
        bad[5, 3] = table.total_rows
        gather_steps.submit_row_ids(worker, 2, bad)
        with pytest.raises(TableError, match="outside the table"):
            worker.wait(2)
        worker.release(2)
        gather_steps.submit_row_ids(worker, 3, ids[:1])  # the worker carries on after a bad step
        np.testing.assert_array_equal(worker.wait(3), want[:1])
        worker.release(3)
        with pytest.raises(HandshakeError, match="increase"):
            gather_steps.submit_row_ids(worker, 3, ids)
        with pytest.raises(ValueError, match="max_tokens"):
            gather_steps.submit_row_ids(worker, 4, np.zeros((65, H), dtype=np.int64))
        with pytest.raises(ValueError, match=r"\[tokens, 16\]"):
            gather_steps.submit_row_ids(worker, 4, np.zeros((2, 8), dtype=np.int64))
        with pytest.raises(HandshakeError, match="not held"):
            worker.release(3)


def test_unreleased_slots_block_then_fail_clearly(table, built_table):
    with GatherWorker(table, built_table.geometry, max_tokens=4, slots=2) as worker:
        one = np.zeros((1, H), dtype=np.int64)
        gather_steps.submit_row_ids(worker, 1, one)
        gather_steps.submit_row_ids(worker, 2, one)
        with pytest.raises(HandshakeError, match=r"no free staging slot.*\[1, 2\]"):
            gather_steps.submit_row_ids(worker, 3, one, timeout_s=0.2)
        worker.wait(1)
        worker.release(1)
        gather_steps.submit_row_ids(worker, 3, one + 7, timeout_s=1)
        np.testing.assert_array_equal(worker.wait(2)[0], table_rows(table, one)[0])
        np.testing.assert_array_equal(worker.wait(3)[0], table_rows(table, one + 7)[0])


def test_a_table_for_another_model_is_refused(table, built_table):
    other = built_table.geometry.__class__(
        **{**built_table.geometry.__dict__, "total_rows": table.total_rows * 2}
    )
    with pytest.raises(TableError, match="total_rows: table"):
        GatherWorker(table, other, max_tokens=4)


class _Crash(Prefetcher):
    """Ends the worker thread the way a fatal error would (SystemExit ends a thread quietly)."""

    def prefetch(self, row_ids):
        raise SystemExit


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_worker_thread_is_reported_long_before_the_timeout(table, built_table):
    worker = GatherWorker(table, built_table.geometry, max_tokens=4, prefetch=_Crash(table))
    try:
        gather_steps.submit_row_ids(worker, 1, np.zeros((1, H), dtype=np.int64))
        t0 = time.perf_counter()
        with pytest.raises(ProducerDied, match="is gone"):
            worker.wait(1, timeout_s=60)
        # a liveness check noticed, not the timeout (an absolute 1 s bound flaked under load)
        assert time.perf_counter() - t0 < 0.05 * 60
    finally:
        worker.close()


def test_staging_is_host_memory_inside_another_device_context(table, built_table):
    """vLLM builds models inside `with torch.device(...)`: pinned staging must still be host
    memory (a bare pin_memory=True there resolves to that device; under "meta" it has no data)."""
    torch = pytest.importorskip("torch")
    ids = np.random.default_rng(5).integers(0, table.total_rows, (8, H))
    with torch.device("meta"):
        worker = GatherWorker(table, built_table.geometry, max_tokens=8, pin_memory=True)
    with worker:
        assert worker.staging.ctypes.data != 0
        gather_steps.submit_row_ids(worker, 1, ids)
        staged = worker.wait(1)
        out = torch.zeros((8, H, table.row_width), dtype=torch.uint8)
        worker.upload(1, staged, out)
        worker.release(1)
        np.testing.assert_array_equal(out.numpy(), table_rows(table, ids))


def test_upload_fills_the_head_of_a_persistent_buffer(table, built_table):
    torch = pytest.importorskip("torch")
    ids = np.random.default_rng(6).integers(0, table.total_rows, (5, H))
    out = torch.full((16, H, table.row_width), 7, dtype=torch.uint8)
    address = out.data_ptr()
    with GatherWorker(table, built_table.geometry, max_tokens=16) as worker:
        gather_steps.submit_row_ids(worker, 1, ids)
        worker.upload(1, worker.wait(1), out)
        worker.release(1)
    assert out.data_ptr() == address  # written in place: a captured graph reads this address
    np.testing.assert_array_equal(out[:5].numpy(), table_rows(table, ids))
    assert (out[5:] == 7).all()  # the rest is the caller's (the backend zeroes padding rows)


def test_a_gather_prepared_before_its_ids_exist(table, built_table):
    """As the host step runs a decode step: the slot views are made before the device sync,
    the ids are written into the caller's buffer after it, then gathered and uploaded; the
    rows of two runs land at their offsets, next to a prompt piece from the thread."""
    torch = pytest.importorskip("torch")
    g = built_table.geometry
    rng = np.random.default_rng(8)
    stats = PLEStats()
    prompt = rng.integers(0, table.total_rows, (4, H))
    later = rng.integers(0, table.total_rows, (5, H))
    out = torch.zeros((16, H, table.row_width), dtype=torch.uint8)
    with GatherWorker(table, g, max_tokens=16, stats=stats) as worker:
        worker.open_step(1)
        worker.submit_pieces(1, [(2, prompt)])
        ids = np.zeros((5, H), dtype=np.int64)  # filled after the "sync"
        job = worker.prepare_inline(1, ids, [(0, 2), (6, 3)], bounds=(0, table.total_rows))
        upload = worker.prepare_upload(1, 9, out)
        ids[:] = later
        worker.gather_prepared(job)
        worker.wait_for(1, 30)
        worker.upload_prepared(upload)
        worker.release(1)
        refused: tuple[tuple[np.ndarray, list[tuple[int, int]], str], ...] = (
            (ids, [(0, 4)], "do not cover"),
            (ids.T, [(0, 5)], "row ids must be"),
            (np.zeros((5, H), np.int32), [(0, 5)], "C-contiguous int64"),
            (ids, [(12, 5)], "staging holds 16"),
        )
        for seq, (bad, runs, match) in enumerate(refused, start=2):
            worker.open_step(seq)
            with pytest.raises(ValueError, match=match):
                worker.prepare_inline(seq, bad, runs)
            worker.release(seq)
        worker.open_step(9)
        job = worker.prepare_inline(9, np.full((1, H), table.total_rows, np.int64), [(0, 1)])
        with pytest.raises(TableError, match="outside the table"):
            worker.gather_prepared(job)  # checked once the ids are in
        with pytest.raises(TableError, match="outside the table"):  # or before, as bounds
            worker.prepare_inline(9, ids, [(0, 5)], bounds=(0, table.total_rows + 1))
        worker.release(9)
    want = np.concatenate([later[:2], prompt, later[2:]])
    np.testing.assert_array_equal(out[:9].numpy(), table_rows(table, want))
    assert (out[9:] == 0).all()
    counters = stats.snapshot()["counters"]
    assert counters["rows_gathered"] == 9 * H and counters["gather_calls"] == 2
    assert counters["prefetch_calls"] == 2


@pytest.mark.gpu
def test_pinned_staging_and_cuda_decode(table, built_table):
    skip_without_cuda()
    ids = np.random.default_rng(4).integers(0, table.total_rows, (64, H))
    with GatherWorker(table, built_table.geometry, max_tokens=64, pin_memory=True) as worker:
        gather_steps.submit_row_ids(worker, 1, ids)
        staged = worker.wait(1)
        on_gpu = gather_steps.decode(worker, 1, staged, "cuda")
        want = dequantize_rows(table_rows(table, ids), table.meta.global_scale)
        worker.release(1)  # waits for the async copy before the slot can be reused
        np.testing.assert_array_equal(on_gpu.cpu().numpy(), want)


def test_worker_records_the_ple_counters_the_metrics_export(table, built_table, tmp_path):
    g = built_table.geometry
    rng = np.random.default_rng(7)
    stats = PLEStats()
    with GatherWorker(table, g, max_tokens=64, slots=2, stats=stats) as worker:
        tokens = 0
        for seq in (1, 2, 3):
            batch = fresh_batch([random_request(rng, g, 40)], g)
            gather_steps.submit_tokens(worker, seq, *batch)
            worker.wait(seq, timeout_s=30)
            worker.release(seq)
            tokens += 40
        with pytest.raises(ValueError, match="staging holds 64"):
            gather_steps.submit_tokens(worker, 4, *fresh_batch([random_request(rng, g, 65)], g))
    writer = StatsFile(tmp_path, stats)
    writer.write()
    written = parse(writer.path.read_text())
    counters = written["counters"]
    assert counters["rows_gathered"] == tokens * g.num_heads
    assert counters["gather_calls"] == 3
    assert counters["prefetch_calls"] == 3
    assert 0 < counters["pages_prefetched"] <= tokens * g.num_heads * 2
    assert counters["staging_overruns"] == 1
    wait = written["handshake_wait_seconds"]
    assert wait["count"] == 3 and wait["sum"] > 0


def test_a_decode_gather_advises_its_pages_in_one_batch_before_reading_them(
    table, built_table, monkeypatch
):
    """The decode rows' WILLNEED (kept: on a cold table it cut the decode host step's critical
    path to 0.2-0.4x of the gather alone, bench/disk_offload_compare.py): the inline gather
    advises every page of the step's rows, and no other, in one batched call while none of them
    is resident yet (the advice comes before the first row is read), then stages the rows."""
    from sparkple.runtime.pagecache import resident_pages
    from sparkple.runtime.prefetch import plan_page_numbers

    from .advice_log import AdviceLog

    g = built_table.geometry
    later = np.random.default_rng(21).integers(0, table.total_rows, (8, H))
    prefetcher = Prefetcher(table)
    log = AdviceLog(prefetcher, monkeypatch)
    resident_at_advice: list[int] = []
    issue = prefetcher._issue

    def issuing(starts, lengths):
        pages = resident_pages(table.rows.ctypes.data, table.rows.nbytes)
        resident_at_advice.append(int(pages[plan_page_numbers(later, table.row_width)].sum()))
        issue(starts, lengths)

    monkeypatch.setattr(prefetcher, "_issue", issuing)
    with GatherWorker(table, g, max_tokens=8, prefetch=prefetcher) as worker:
        worker.open_step(1)
        ids = np.zeros((8, H), dtype=np.int64)  # filled after the "sync"
        job = worker.prepare_inline(1, ids, [(0, 8)], bounds=(0, table.total_rows))
        ids[:] = later
        worker.gather_prepared(job)
        rows = worker.wait(1, 30)
        np.testing.assert_array_equal(rows, table_rows(table, later))
        worker.release(1)
    assert resident_at_advice == [0]  # one batch, before any of its pages was read
    assert log.advised() == plan_page_numbers(later, table.row_width).tolist()
    if prefetcher.mechanism == "process_madvise":
        assert log.calls == 1
    # the gather alone: the same rows, nothing advised
    table.evict()
    with GatherWorker(table, g, max_tokens=8, prefetch=False) as worker:
        assert worker.prefetcher is None
        worker.open_step(1)
        job = worker.prepare_inline(1, later.copy(), [(0, 8)])
        worker.gather_prepared(job)
        np.testing.assert_array_equal(worker.wait(1, 30), table_rows(table, later))
        worker.release(1)
    assert len(log.advised()) == plan_page_numbers(later, table.row_width).size
    prefetcher.close()
