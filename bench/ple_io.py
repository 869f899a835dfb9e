#!/usr/bin/env python3
"""PLE I/O benchmarks, each compared side by side with its baseline in the same run.

    python bench/ple_io.py --table-gib 4 --json bench/out/ple_io.json

- decode I/O: disk bytes per decoded token (16 random rows, cold table) with advice random
  and normal, against the page floor (distinct 4 KiB pages touched x 4 KiB).
- cold decode latency per token: serial page faults vs the gather worker (prefetch overlaps
  the 16 reads, then gather and handshake).
- prefill gather: a cold 32,768-row gather without prefetch, with sparkple's prefetch, and
  with each prefetch mechanism, against the device's random-read rate at queue depth 32
  (O_DIRECT 4 KiB preads from 32 threads over the same file).
- warm gather: gather_rows into staging vs a numpy fancy-index copy.
- handshake: publish-to-observe latency across processes vs a pipe, and CPU used waiting.

Cold means evicted with POSIX_FADV_DONTNEED and checked with mincore; disk bytes come from
/proc/self/io (read_bytes), faults from getrusage. The table is synthetic (sparkple.builder.synth +
sparkple.builder.build), built once into --work and reused. Writes one JSON object and PNG plots
next to it (when matplotlib is installed: pip install -e '.[bench]'); the headline is the
last line printed.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from measure import log, median, pct, read_bytes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from device_io import PreadPool, device_random_reads, device_random_reads_aio  # noqa: E402
from handshake_bench import bench_handshake  # noqa: E402
from ple_io_plots import write_plots  # noqa: E402
from synthtable import ensure_table  # noqa: E402

from harness import gather_steps  # noqa: E402
from sparkple.runtime.gather import gather_rows  # noqa: E402
from sparkple.runtime.prefetch import MECHANISMS, Prefetcher, plan_page_numbers  # noqa: E402
from sparkple.runtime.table import PackedTable, open_table  # noqa: E402
from sparkple.runtime.tablemeta import read_meta  # noqa: E402
from sparkple.runtime.worker import GatherWorker  # noqa: E402

PAGE = mmap.PAGESIZE
HEADS = 16
PREFILL_ROWS = 32_768  # one 2,048-token prefill chunk x 16 heads


def major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


# ------------------------------------------------------------------------------ the table


def make_cold(table: PackedTable) -> None:
    left = table.evict()
    if left > 0:
        raise RuntimeError(f"{left:.1%} of the table stayed resident after eviction")


def make_warm(table: PackedTable, ids: np.ndarray) -> None:
    out = np.empty((*ids.shape, table.row_width), dtype=np.uint8)
    gather_rows(table.rows, ids, out)


# ------------------------------------------------------------------------------ decode I/O


def decode_io(table_dir: Path, advice: str, ids: np.ndarray) -> dict[str, float]:
    """Decode ids[T, 16] token by token from a cold table; disk bytes and faults per token."""
    with open_table(table_dir, advice=advice) as table:
        if table.advice != advice:
            raise RuntimeError(f"advice {advice} did not take effect ({table.advice})")
        make_cold(table)
        staging = np.empty((1, HEADS, table.row_width), dtype=np.uint8)
        b0, f0 = read_bytes(), major_faults()
        for token in ids:
            gather_rows(table.rows, token[None], staging)
        used, faults = read_bytes() - b0, major_faults() - f0
    tokens = len(ids)
    floor = plan_page_numbers(ids, table.row_width).size * PAGE
    return {
        "bytes_per_token": used / tokens,
        "page_floor_bytes_per_token": floor / tokens,
        "major_faults_per_token": faults / tokens,
    }


def bench_decode_io(table_dir: Path, total_rows: int, reps: int, rng) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"random": [], "normal": []}
    for rep in range(reps):
        ids = rng.integers(0, total_rows, (256, HEADS))
        runs["random"].append(decode_io(table_dir, "random", ids))
        # normal reads a readahead window per fault: fewer tokens keep the run short
        runs["normal"].append(decode_io(table_dir, "normal", ids[:8]))
        log(f"decode io rep {rep}: random {runs['random'][-1]}, normal {runs['normal'][-1]}")
    out = {advice: {k: median([r[k] for r in rs]) for k in rs[0]} for advice, rs in runs.items()}
    return out


# ------------------------------------------------------------------------------ cold decode latency


def bench_decode_latency(table: PackedTable, tokens: int, reps: int, rng) -> dict[str, Any]:
    """Per-token latency from a cold table, 16 rows a token.

    serial_faults: plain gather, one page fault after the other.
    sparkple: prefetch then gather in the calling thread (the 16 reads overlapped).
    sparkple_worker: the same through the gather worker, submit to staged rows (the thread
      handoff and handshake included; in serving, submit runs a layer ahead and hides them).
    sparkple_warm: the worker again over the same tokens, now cached.
    """
    prefetcher = Prefetcher(table)
    modes = ("serial_faults", "sparkple", "sparkple_worker")
    lat: dict[str, list[float]] = {m: [] for m in (*modes, "sparkple_warm")}
    staging = np.empty((1, HEADS, table.row_width), dtype=np.uint8)
    seq = 0
    with GatherWorker(table, table.geometry(), max_tokens=1, prefetch=prefetcher) as worker:
        for _ in range(reps):
            for mode in modes:
                ids = rng.integers(0, table.total_rows, (tokens, HEADS))
                make_cold(table)
                prefetcher.forget()
                for token in ids:
                    t0 = time.perf_counter()
                    if mode == "sparkple_worker":
                        seq += 1
                        gather_steps.submit_row_ids(worker, seq, token[None])
                        worker.wait(seq)
                        lat[mode].append(time.perf_counter() - t0)
                        worker.release(seq)
                        continue
                    if mode == "sparkple":
                        prefetcher.prefetch(token)
                    gather_rows(table.rows, token[None], staging)
                    lat[mode].append(time.perf_counter() - t0)
            prefetcher.forget()
            for token in ids:
                seq += 1
                t0 = time.perf_counter()
                gather_steps.submit_row_ids(worker, seq, token[None])
                worker.wait(seq)
                lat["sparkple_warm"].append(time.perf_counter() - t0)
                worker.release(seq)
    prefetcher.close()
    return {
        "ms_per_token": {k: median(v) * 1e3 for k, v in lat.items()},
        "p99_ms": {k: pct(v, 99) * 1e3 for k, v in lat.items()},
        "samples_ms": {k: (np.asarray(v) * 1e3).round(4).tolist() for k, v in lat.items()},
    }


# ------------------------------------------------------------------------------ prefill gather


def prefill_once(table: PackedTable, ids: np.ndarray, prefetcher: Any):
    make_cold(table)
    if prefetcher is not None:
        prefetcher.forget()
    out = np.empty((*ids.shape, table.row_width), dtype=np.uint8)
    b0 = read_bytes()
    t0 = time.perf_counter()
    if prefetcher is not None:
        prefetcher.prefetch(ids)
    gather_rows(table.rows, ids, out)
    return time.perf_counter() - t0, read_bytes() - b0


def bench_prefill(table: PackedTable, reps: int, rng) -> dict[str, Any]:
    modes: dict[str, Any] = {
        "none": None,
        "sparkple": Prefetcher(table),  # the default: auto mechanism, 2 threads
    }
    for mech, threads in [(m, 1) for m in MECHANISMS] + [("process_madvise", 4)]:
        try:
            modes[f"{mech}_{threads}thread"] = Prefetcher(table, mechanism=mech, threads=threads)
        except OSError as exc:
            log(f"prefetch mechanism {mech} unavailable here: {exc}")
    modes["pread_pool_32thread"] = PreadPool(table)
    seconds: dict[str, list[float]] = {k: [] for k in modes}
    read: dict[str, list[float]] = {k: [] for k in modes}
    pages: list[int] = []
    qd32: list[float] = []
    qd32_aio: list[float] = []
    qd1: list[float] = []
    path, size = table.data_path, table.meta.data_bytes
    for rep in range(reps):
        qd32.append(device_random_reads(path, size, 32_768, 32, rng))
        aio = device_random_reads_aio(path, size, 32_768, 32, rng)
        if aio is not None:
            qd32_aio.append(aio)
        qd1.append(device_random_reads(path, size, 2_000, 1, rng))
        for name, pf in modes.items():
            ids = rng.integers(0, table.total_rows, (PREFILL_ROWS // HEADS, HEADS))
            pages.append(plan_page_numbers(ids, table.row_width).size)
            s, b = prefill_once(table, ids, pf)
            seconds[name].append(s)
            read[name].append(b)
        log(
            f"prefill rep {rep}: qd32 threads {qd32[-1]:.0f}/s "
            f"aio {qd32_aio[-1] if qd32_aio else 0:.0f}/s "
            f"qd1 {qd1[-1]:.0f}/s " + " ".join(f"{k} {v[-1]:.3f}s" for k, v in seconds.items())
        )
    mechanism = modes["sparkple"].mechanism if modes["sparkple"] else None
    for pf in modes.values():
        if pf is not None:
            pf.close()
    page_count = median(pages)
    gather_s = {k: median(v) for k, v in seconds.items()}
    return {
        "prefill_rows": PREFILL_ROWS,
        "prefill_pages": page_count,
        "prefill_gather_s": gather_s,
        "prefill_pages_per_s": {k: page_count / v for k, v in gather_s.items()},
        "prefill_read_bytes": {k: median(v) for k, v in read.items()},
        "prefetch_mechanism": mechanism,
        # the faster of the two depth-32 passes: the device's rate, not Python's overhead
        "device_qd32_iops": max(median(qd32), median(qd32_aio) if qd32_aio else 0.0),
        "device_qd32_iops_threads": median(qd32),
        "device_qd32_iops_aio": median(qd32_aio) if qd32_aio else None,
        "device_qd1_iops": median(qd1),
    }


def bench_batch_sizes(table: PackedTable, reps: int, rng) -> dict[str, Any]:
    """When to prefetch: cold gather time with and without it, from one token to a chunk,
    and what prefetching costs when the rows are already cached."""
    sizes = (16, 256, 4096)  # one decode token, a 16-sequence decode step, a small prefill
    pf = Prefetcher(table)
    cold: dict[str, dict[str, list[float]]] = {str(n): {"none": [], "sparkple": []} for n in sizes}
    warm: dict[str, dict[str, list[float]]] = {
        str(n): {"gather": [], "prefetch": [], "prefetch_recent_skip": []} for n in sizes
    }
    for _ in range(reps):
        for n in sizes:
            make_cold(table)
            pf.forget()
            # fresh random rows each time: in a 4 GiB table they are almost surely still cold
            for _sample in range(max(1, 1024 // n)):
                for mode in ("none", "sparkple"):
                    ids = rng.integers(0, table.total_rows, (max(1, n // HEADS), HEADS))
                    out = np.empty((*ids.shape, table.row_width), dtype=np.uint8)
                    t0 = time.perf_counter()
                    if mode == "sparkple":
                        pf.prefetch(ids)
                    gather_rows(table.rows, ids, out)
                    cold[str(n)][mode].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            gather_rows(table.rows, ids, out)  # resident now
            warm[str(n)]["gather"].append(time.perf_counter() - t0)
            pf.forget()
            warm[str(n)]["prefetch"].append(pf.prefetch(ids).seconds)
            warm[str(n)]["prefetch_recent_skip"].append(pf.prefetch(ids).seconds)
    pf.close()
    return {
        "cold_ms": {n: {k: median(v) * 1e3 for k, v in m.items()} for n, m in cold.items()},
        "warm_ms": {n: {k: median(v) * 1e3 for k, v in m.items()} for n, m in warm.items()},
    }


# ------------------------------------------------------------------------------ warm gather


def bench_warm(table: PackedTable, reps: int, rng) -> dict[str, float]:
    ids = rng.integers(0, table.total_rows, (PREFILL_ROWS // HEADS, HEADS))
    make_warm(table, ids)
    out = np.empty((*ids.shape, table.row_width), dtype=np.uint8)
    flat = ids.reshape(-1)
    t_gather, t_fancy = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        gather_rows(table.rows, ids, out)
        t_gather.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        copy = table.rows[flat]
        t_fancy.append(time.perf_counter() - t0)
        del copy
    return {
        "rows": PREFILL_ROWS,
        "gather_rows_per_s": PREFILL_ROWS / median(t_gather),
        "numpy_fancy_rows_per_s": PREFILL_ROWS / median(t_fancy),
    }


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--table-gib", type=float, default=4.0, help="synthetic table size (GiB)")
    p.add_argument("--json", type=Path, required=True, help="result file (plots go next to it)")
    p.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "ple-io",
                   help="where the synthetic table is built and kept for reuse")  # fmt: skip
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--keep-snapshot", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    args.work.mkdir(parents=True, exist_ok=True)
    table_dir, _, reused = ensure_table(args.work, args.table_gib, args.keep_snapshot)
    meta = read_meta(table_dir)
    log(f"table {table_dir} ({meta.data_bytes / 2**30:.2f} GiB, reused={reused})")

    result: dict[str, Any] = {
        "table_bytes": meta.data_bytes,
        "table_rows": meta.total_rows,
        "row_width": meta.row_width,
        "table_reused": reused,
        "kernel": os.uname().release,
    }
    io = bench_decode_io(table_dir, meta.total_rows, args.reps, rng)
    result["decode_bytes_per_token"] = {k: v["bytes_per_token"] for k, v in io.items()}
    result["decode_major_faults_per_token"] = {
        k: v["major_faults_per_token"] for k, v in io.items()
    }
    result["page_floor_bytes_per_token"] = io["random"]["page_floor_bytes_per_token"]
    with open_table(table_dir) as table:
        result["advice"] = table.advice
        lat = bench_decode_latency(table, 64, args.reps, rng)
        result["decode_cold_ms_per_token"] = {
            "serial_faults": lat["ms_per_token"]["serial_faults"],
            "sparkple": lat["ms_per_token"]["sparkple"],
            "sparkple_worker": lat["ms_per_token"]["sparkple_worker"],
        }
        result["decode_warm_ms_per_token"] = lat["ms_per_token"]["sparkple_warm"]
        result["decode_latency"] = lat
        result.update(bench_prefill(table, args.reps, rng))
        result["batch_sizes"] = bench_batch_sizes(table, args.reps, rng)
        result["warm_gather"] = bench_warm(table, 10 * args.reps, rng)
    result["handshake"] = bench_handshake(2000, rng)
    result["handshake_p99_us"] = result["handshake"]["handshake_p99_us"]

    dec = result["decode_bytes_per_token"]
    floor = result["page_floor_bytes_per_token"]
    cold = result["decode_cold_ms_per_token"]
    qd32 = result["device_qd32_iops"]
    pps = result["prefill_pages_per_s"]
    warm = result["warm_gather"]
    hs = result["handshake"]
    ratios = {
        "random_vs_page_floor": dec["random"] / floor,
        "normal_vs_random": dec["normal"] / dec["random"],
        "prefill_vs_qd32": pps["sparkple"] / qd32,
        "prefill_speedup_vs_none": result["prefill_gather_s"]["none"]
        / result["prefill_gather_s"]["sparkple"],
        "cold_decode_speedup_vs_serial": cold["serial_faults"] / cold["sparkple"],
        "cold_decode_worker_speedup_vs_serial": cold["serial_faults"] / cold["sparkple_worker"],
        "warm_gather_vs_numpy_fancy": warm["gather_rows_per_s"] / warm["numpy_fancy_rows_per_s"],
        "handshake_p99_vs_pipe_p99": hs["handshake_p99_us"] / hs["pipe_p99_us"],
    }
    result["ratios"] = ratios
    targets = {
        "random <= 1.15x page floor": ratios["random_vs_page_floor"] <= 1.15,
        "normal >= 10x random": ratios["normal_vs_random"] >= 10,
        "prefill >= 80% of qd32": ratios["prefill_vs_qd32"] >= 0.8,
        "cold decode well under serial faults": ratios["cold_decode_speedup_vs_serial"] >= 2,
        "handshake p99 < 100 us": result["handshake_p99_us"] < 100,
    }
    result["targets_met"] = targets
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result["plots"] = write_plots(result, args.json)
    args.json.write_text(json.dumps(result, indent=1) + "\n")

    print(f"decode bytes/token: random {dec['random'] / 1024:.1f} KiB, normal "
          f"{dec['normal'] / 1024:.0f} KiB, page floor {floor / 1024:.1f} KiB")  # fmt: skip
    print(f"cold decode ms/token: serial faults {cold['serial_faults']:.3f}, sparkple "
          f"{cold['sparkple']:.3f}, through the worker {cold['sparkple_worker']:.3f} "
          f"(warm {result['decode_warm_ms_per_token']:.3f})")  # fmt: skip
    print("prefill gather s: " + ", ".join(f"{k} {v:.3f}" for k, v in
          result["prefill_gather_s"].items()) + f"; device qd32 {qd32:.0f}/s, "
          f"qd1 {result['device_qd1_iops']:.0f}/s")  # fmt: skip
    for n, c in result["batch_sizes"]["cold_ms"].items():
        w = result["batch_sizes"]["warm_ms"][n]
        print(f"{n} rows: cold {c['none']:.2f} ms without prefetch, {c['sparkple']:.2f} ms with; "
              f"warm gather {w['gather']:.3f} ms, prefetch {w['prefetch']:.3f} ms "
              f"({w['prefetch_recent_skip']:.3f} ms when recently advised)")  # fmt: skip
    print(f"warm gather: {warm['gather_rows_per_s'] / 1e6:.1f} M rows/s vs numpy fancy "
          f"{warm['numpy_fancy_rows_per_s'] / 1e6:.1f} M rows/s")  # fmt: skip
    print(f"handshake p50/p99 {hs['handshake_p50_us']:.1f}/{hs['handshake_p99_us']:.1f} us, "
          f"pipe {hs['pipe_p50_us']:.1f}/{hs['pipe_p99_us']:.1f} us, after 20 ms "
          f"{hs['handshake_after_20ms_p99_us']:.0f} us p99 (pipe "
          f"{hs['pipe_after_20ms_p99_us']:.0f}); SCHED_FIFO p99 "
          f"{hs['handshake_rt_p99_us'] or float('nan'):.1f} us (pipe "
          f"{hs['pipe_rt_p99_us'] or float('nan'):.1f}); idle CPU "
          f"{hs['handshake_idle_cpu_fraction']:.1%}")  # fmt: skip
    for path in result["plots"]:
        print(f"plot: {path}")
    missed = [k for k, ok in targets.items() if not ok]
    print(
        f"ple_io: random {ratios['random_vs_page_floor']:.2f}x page floor, "
        f"{ratios['normal_vs_random']:.0f}x less than normal; prefill "
        f"{ratios['prefill_vs_qd32']:.2f}x of qd32 ({ratios['prefill_speedup_vs_none']:.1f}x "
        f"faster than no prefetch); cold decode {ratios['cold_decode_speedup_vs_serial']:.1f}x "
        f"faster than serial faults ({ratios['cold_decode_worker_speedup_vs_serial']:.1f}x "
        f"through the worker); warm gather {ratios['warm_gather_vs_numpy_fancy']:.2f}x "
        f"numpy; handshake p99 {result['handshake_p99_us']:.0f} us"
        + (f"; MISSED: {', '.join(missed)}" if missed else "")
    )
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
