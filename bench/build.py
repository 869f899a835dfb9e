"""Benchmark: packed-table build time and peak RSS against the sequential I/O floor.

Writes a synthetic snapshot (default 2 GiB table), then alternates, cold each time:
  A  `sparkple build-table --force` in a child process;
  B  the floor: a child that reads the same PLE shard bytes sequentially, file by file, and
     writes the same number of bytes sequentially to one file, then fsyncs.
"Cold" evicts the snapshot's pages with posix_fadvise(DONTNEED), checked with mincore.
Peak RSS and disk reads come from the child's rusage. The last line is the headline:
    build: 0.94x of sequential copy, peak RSS 61 MiB
(ratio = floor time / build time; 1.0 means the build runs at the floor's speed).
Run: python bench/build.py [--table-gib 2] [--reps 3] [--workdir DIR] [--min-ratio 0.8]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparkple.builder.plan import plan_build  # noqa: E402
from sparkple.builder.synth import synth_checkpoint, vocab_base_for_bytes  # noqa: E402
from sparkple.runtime.pagecache import resident_pages  # noqa: E402

# The floor: the same source bytes read in file order (8 MiB reads on a reader thread, as
# the builder does) and written sequentially to one file with the same write-behind, then
# fsynced. It is the builder minus row interleaving and verification.
FLOOR_CODE = r"""
import json, os, queue, sys, threading
ranges, out, chunk = json.loads(sys.argv[1]), sys.argv[2], 8 << 20
free, ready = queue.Queue(), queue.Queue()
for _ in range(3):
    free.put(bytearray(chunk))
def reader():
    for path, start, length in ranges:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        end = start + length
        while start < end:
            buf = free.get()
            n = os.preadv(fd, [memoryview(buf)[: min(chunk, end - start)]], start)
            os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
            ready.put((buf, n))
            start += n
        os.close(fd)
    ready.put(None)
threading.Thread(target=reader, daemon=True).start()
wfd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
written, behind = 0, []
while (item := ready.get()) is not None:
    buf, n = item
    os.write(wfd, memoryview(buf)[:n])
    free.put(buf)
    os.posix_fadvise(wfd, written, n, os.POSIX_FADV_DONTNEED)
    behind.append((written, n))
    if len(behind) > 4:
        os.posix_fadvise(wfd, *behind.pop(0), os.POSIX_FADV_DONTNEED)
    written += n
os.fsync(wfd)
os.close(wfd)
print(written)
"""

# The build child runs the CLI in-process and reports its own peak RSS: VmHWM belongs to the
# exec'd image alone, while rusage of a child also counts the parent's memory before exec.
HWM_LINE = (
    'print(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")), file=sys.stderr)\n'
)
BUILD_CODE = (
    "import sys\nfrom sparkple.cli import main\nrc = main(sys.argv[1:])\n"
    + HWM_LINE
    + "sys.exit(rc)\n"
)


def resident_bytes(path: Path) -> int:
    """Bytes of the file in the page cache (mincore over a read-only mapping)."""
    if path.stat().st_size == 0:
        return 0
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    return int(resident_pages(mapped.ctypes.data, mapped.nbytes).sum()) * mmap.PAGESIZE


def evict(paths: list[Path]) -> int:
    """Drop the files' pages from the page cache; returns the bytes still resident."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return sum(resident_bytes(p) for p in paths)


def run_child(cmd: list[str]) -> dict:
    """Run a child; wall time, peak RSS (MiB) and disk reads (MiB) from its rusage."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    assert proc.stdout is not None and proc.stderr is not None  # both piped above
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{err.decode()}")
    return {
        "wall_s": wall,
        "peak_rss_mib": _vm_hwm_kib(err.decode()) / 1024,
        "rusage_maxrss_mib": usage.ru_maxrss / 1024,
        "disk_read_mib": usage.ru_inblock * 512 / 2**20,
        "stdout": out.decode().strip(),
    }


def _vm_hwm_kib(stderr: str) -> int:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("VmHWM")]
    if not lines:
        raise SystemExit(f"the child did not report its peak RSS:\n{stderr}")
    line = lines[0]
    return int(line.split()[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table-gib", type=float, default=2.0)
    ap.add_argument("--quant", choices=["nvfp4", "fp8"], default="nvfp4")
    ap.add_argument("--shards", type=int, default=128, help="split_ngram_parts of the snapshot")
    ap.add_argument("--chunk-mib", type=float, default=None, help="passed to build-table")
    ap.add_argument("--reps", type=int, default=3, help="A/B pairs to run (>= 1)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the snapshot and table afterwards")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--min-ratio", type=float, default=None, help="exit 1 below this ratio")
    ap.add_argument("--max-rss-mib", type=float, default=None, help="exit 1 above this peak RSS")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    work = args.workdir or Path(tempfile.mkdtemp(prefix="sparkple-bench-build-"))
    work.mkdir(parents=True, exist_ok=True)
    snap, table, floor_out = work / "snap", work / "table", work / "floor.bin"
    try:
        width = 90 if args.quant == "nvfp4" else 160
        t0 = time.perf_counter()
        if not (snap / "model.safetensors.index.json").exists():
            synth_checkpoint(
                snap,
                quant=args.quant,
                files=4,
                vocab_base=vocab_base_for_bytes(int(args.table_gib * 2**30), width),
                shards=args.shards,
            )
        print(f"snapshot ready in {time.perf_counter() - t0:.1f} s: {snap}", flush=True)
        plan = plan_build(snap)
        ranges = sorted(
            (str(t.path), t.offset, t.nbytes)
            for s in plan.shards
            for t in (s.codes, s.scales)
            if t is not None
        )
        sources = sorted({Path(p) for p, _, _ in ranges})
        print(
            f"table: {plan.geometry.total_rows} rows x {plan.fmt.row_width} B = "
            f"{plan.data_bytes / 2**30:.2f} GiB in {len(sources)} files",
            flush=True,
        )
        build_cmd = [
            sys.executable,
            "-c",
            BUILD_CODE,
            "build-table",
            str(snap),
            str(table),
            "--force",
            "--quiet",
            *(["--chunk-mib", str(args.chunk_mib)] if args.chunk_mib else []),
        ]
        floor_cmd = [
            sys.executable,
            "-c",
            FLOOR_CODE + HWM_LINE,
            json.dumps(ranges),
            str(floor_out),
        ]
        results: dict[str, list[dict]] = {"build": [], "floor": []}
        for rep in range(args.reps):
            for name, cmd in (("build", build_cmd), ("floor", floor_cmd)):
                shutil.rmtree(table, ignore_errors=True)
                floor_out.unlink(missing_ok=True)
                left = evict(sources)
                r = run_child(cmd)
                r["resident_before_mib"] = left / 2**20
                results[name].append(r)
                print(
                    f"rep {rep + 1} {name:5s}: {r['wall_s']:6.2f} s  "
                    f"{plan.data_bytes / 2**20 / r['wall_s']:7.1f} MiB/s  "
                    f"peak RSS {r['peak_rss_mib']:6.1f} MiB  "
                    f"disk read {r['disk_read_mib']:7.1f} MiB  "
                    f"(resident before {r['resident_before_mib']:.1f} MiB)",
                    flush=True,
                )
                if name == "build":
                    print(f"            {r['stdout'].splitlines()[-1]}", flush=True)
        tb = statistics.median(r["wall_s"] for r in results["build"])
        tf = statistics.median(r["wall_s"] for r in results["floor"])
        rss = max(r["peak_rss_mib"] for r in results["build"])
        ratio = tf / tb
        paired = sorted(
            f["wall_s"] / b["wall_s"]
            for b, f in zip(results["build"], results["floor"], strict=True)
        )
        summary = {
            "table_bytes": plan.data_bytes,
            "build_median_s": tb,
            "floor_median_s": tf,
            "ratio": ratio,
            "paired_ratios": paired,
            "build_peak_rss_mib": rss,
            "runs": results,
        }
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2))
        print(
            f"median: build {tb:.2f} s ({plan.data_bytes / 2**20 / tb:.0f} MiB/s), "
            f"floor {tf:.2f} s ({plan.data_bytes / 2**20 / tf:.0f} MiB/s)"
        )
        print(f"per-rep ratios (floor/build): {', '.join(f'{x:.2f}' for x in paired)}")
        print(f"build: {ratio:.2f}x of sequential copy, peak RSS {rss:.0f} MiB")
        failed = (args.min_ratio is not None and ratio < args.min_ratio) or (
            args.max_rss_mib is not None and rss > args.max_rss_mib
        )
        return 1 if failed else 0
    finally:
        if not args.keep:
            shutil.rmtree(snap, ignore_errors=True)
            shutil.rmtree(table, ignore_errors=True)
            floor_out.unlink(missing_ok=True)
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
