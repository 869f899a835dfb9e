#!/usr/bin/env python3
"""sparkple's PLE host step beside vLLM 0.34.0's own disk offload, on the CPU, in one run.

    python bench/disk_offload_compare.py --table-gib 2 --json bench/out/disk_offload.json

One synthetic checkpoint (real geometry: 90 B NVFP4 rows, 128 row shards, 16 heads) and the
packed table built from it, in a temporary directory deleted afterwards (--work keeps them).
Both arms run inside the vLLM 0.34.0 test venv (harness/wheel_cache.py), on the same step
streams, driven through vLLM's own RequestState, InputBatch and Qwen4ExpModelState
(harness/ple_steps.Runner):

- 0.34: vLLM's `Qwen4ExpPLEDiskOffloadEmbedding` from the wheel, loaded as vLLM loads it (its
  file offsets from the loader's mmap views of the checkpoint's shard files), staged by its
  model state's `stage_checkpoint_rows`; on a CPU there is no stream to synchronize and no
  pinned memory: what runs is its host half, `stage_rows` and `_read_rows` (unique ids,
  posix_fadvise(WILLNEED) per page run, one preadv per distinct row and plane, serially);
- sparkple: the rendered vllm-0.34 patch's packed-table layer under the patched model state's
  host step (prompt rows before the sync, lookahead, decode rows gathered after it);
- sparkple-noadvice (decode and MTP streams): sparkple's odd steps, run with the WILLNEED
  advice of its decode gather switched off (the gather alone), each step's rows fresh.

Step streams: decode at 1 and at 8 requests, MTP 4 requests x 4 tokens (3 drafts), and one
prompt in --chunk-tokens chunks (the first chunk and the later ones reported apart). Between
steps the device is modelled as busy (--decode-ms, --chunk-ms: what the lookahead can use). Each
repetition runs every stream cold (the table's and the checkpoint's pages evicted with
POSIX_FADV_DONTNEED, checked with mincore) and then warm (the same tokens again). The two arms
run a decode stream in lockstep, step n of one right after step n of the other (their order
alternating), so that a burst of other work on the shared machine meets both; a prompt stream
one arm after the other (sparkple's lookahead works in the background, and would otherwise also
work during 0.34's steps), the order alternating between repetitions.

Per step kind and arm: the host critical path (0.34: its stage_rows, which runs after the
stream sync that makes the device's ids visible on the host; sparkple: from the moment its copy
of the device's tokens is in (or from the step's start where the step needs none) to the rows
staged); disk bytes per token (read_bytes: a 0.34 step's from /proc/thread-self/io, as it
reads on the calling thread; the rest of the process's /proc/self/io is sparkple's, whose
gather and lookahead threads read too); page-cache bytes added per token
(mincore over the arm's files before and after); syscalls per step, counted by strace -c -f
attached to this process for one extra cold pass per stream (ptrace slows every syscall, so that
pass is not timed); and whether both arms staged identical rows. Ratios are sparkple / 0.34; the
goals are reported, not asserted (--check exits 1 when one is missed). Headline: last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from disk_offload_arms import Arms
from disk_offload_streams import DECODE_PROMPT, STREAMS, run_lockstep, stream_steps
from disk_offload_summary import headline, report, summarize
from disk_offload_syscalls import IO_SYSCALLS, NOT_COUNTED, strace_counts
from measure import log, run_inner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------ driver


def build_inputs(work: Path, gib: float) -> tuple[Path, Path]:
    """(checkpoint snapshot, packed table dir) of a synthetic checkpoint of about `gib` GiB of
    PLE rows, reused when both are in `work` already."""
    from sparkple.builder.build import build_table
    from sparkple.builder.synth import synth_checkpoint, vocab_base_for_bytes
    from sparkple.errors import TableError
    from sparkple.runtime.tablemeta import read_meta

    target = int(gib * 2**30)
    snap, table = work / f"snapshot-{gib:g}gib", work / f"table-{gib:g}gib"
    try:
        meta = read_meta(table)
        if abs(meta.data_bytes - target) <= 0.1 * target and (snap / "config.json").is_file():
            return snap, table
    except TableError:
        pass
    shutil.rmtree(snap, ignore_errors=True)
    log(f"building a {gib:g} GiB synthetic checkpoint and its packed table in {work} ...")
    t0 = time.perf_counter()
    synth_checkpoint(snap, vocab_base=vocab_base_for_bytes(target), files=max(2, int(gib) + 1))
    build_table(snap, table, force=True, quiet=True)
    os.sync()  # freshly written pages are dirty: fadvise cannot drop them until written back
    log(f"built in {time.perf_counter() - t0:.0f} s")
    return snap, table


def driver(args: argparse.Namespace) -> int:
    from harness import wheel_cache
    from sparkple import patch

    venv_python = wheel_cache.vllm_venv("0.34.0")
    originals = wheel_cache.vllm_originals("0.34.0")
    with tempfile.TemporaryDirectory(prefix="disk-offload-compare-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        snap, table = build_inputs(work, args.table_gib)
        rendered = Path(tmp) / "rendered"
        patch.render("vllm-0.34", originals, rendered)
        inner_json = Path(tmp) / "inner.json"
        cmd = [
            str(venv_python),
            __file__,
            "--inner",
            str(inner_json),
            "--rendered",
            str(rendered),
            "--table",
            str(table),
            "--snapshot",
            str(snap),
            *forwarded(args),
        ]
        result = run_inner(cmd, inner_json, tmp)
        if isinstance(result, int):
            return result
    result["table_gib"] = args.table_gib
    summary = summarize(result)
    result["summary"] = summary
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    for line in report(result, summary):
        print(line)
    print(f"json: {args.json}")
    print(headline(summary))
    if args.check and not all(summary["goals_met"].values()):
        return 1
    return 0


def forwarded(args: argparse.Namespace) -> list[str]:
    out = []
    for name in (
        "reps",
        "decode_steps",
        "mtp_steps",
        "chunks",
        "chunk_tokens",
        "decode_ms",
        "chunk_ms",
    ):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out + (["--no-strace"] if args.no_strace else [])


# ------------------------------------------------------------------------------ inner (vLLM venv)


def inner(args: argparse.Namespace) -> int:
    sys.argv[1:] = ["cpu"]  # harness.ple_layer reads its device from argv[1] when imported
    import torch

    import harness.ple_layer as ple

    # CPU copies stand in for the uploads: one torch thread keeps each from waking a pool
    torch.set_num_threads(1)
    max_tokens = max(args.chunk_tokens, 8 * 4)
    max_model_len = args.chunks * args.chunk_tokens + DECODE_PROMPT + 4 * args.mtp_steps + 64
    max_model_len = max(max_model_len, DECODE_PROMPT + args.decode_steps + 64)
    ple.MAX_TOKENS = max_tokens
    ple.seed_loader_filter(Path(args.rendered))
    result: dict[str, Any] = {"runs": {}, "reps": args.reps, "args": vars(args).copy()}
    with (
        tempfile.TemporaryDirectory() as work,
        ple.vllm_context(Path(work), max_tokens=max_tokens, max_model_len=max_model_len),
    ):
        arms = Arms(args, max_tokens, max_model_len)
        vocab = int(arms.config.vocab_size)
        result["table_bytes"] = os.path.getsize(arms.table_path)
        result["checkpoint_bytes"] = sum(os.path.getsize(path) for path in arms.disk_paths)
        result["checkpoint_files"] = len(arms.disk_paths)
        equal = compared = 0
        for rep in range(args.reps):
            for k, kind in enumerate(STREAMS):
                seed = 1000 * rep + k
                lanes = ("0.34", "sparkple") if (rep + k) % 2 == 0 else ("sparkple", "0.34")
                for temp in ("cold", "warm"):
                    per_label, staged = run_lockstep(arms, lanes, kind, args, vocab, seed, temp)
                    ours, theirs = staged["sparkple"], staged["0.34"]
                    compared += len(theirs)
                    equal += sum(a == b for a, b in zip(ours, theirs, strict=True))
                    for label, kinds in per_label.items():
                        for step_kind, entry in kinds.items():
                            runs = result["runs"].setdefault(label, {}).setdefault(temp, {})
                            runs.setdefault(step_kind, []).append(entry)
                log(f"rep {rep + 1}/{args.reps}: {kind} done")
        result["identical"] = {"equal": equal, "steps": compared}
        result["syscalls"] = {}
        result["syscall_source"] = "not counted (--no-strace)"
        if not args.no_strace and shutil.which("strace"):
            result["syscall_source"] = (
                "strace -c -f attached to the process for one extra cold pass per arm (not "
                "timed); io = preadv/pread + fadvise/madvise/process_madvise, all = every "
                "syscall but sleeps and gloo's epoll_wait, net of an idle window's"
            )
            for k, kind in enumerate(STREAMS):
                _, _, steps_list, gap = stream_steps(kind, args, vocab, 99_000 + k)
                n = len(steps_list)
                # the same window without the steps: strace's own attach probe, the modelled
                # device's sleeps and what the process's other threads do meanwhile (gloo)
                idle: dict[str, int] = {}
                with strace_counts(idle):
                    for _ in range(n - 1):
                        time.sleep(gap)
                for arm in ("0.34", "sparkple"):
                    counts: dict[str, int] = {}
                    run_lockstep(arms, (arm,), kind, args, vocab, 99_000 + k, "cold", counts)
                    io = sum(c for name, c in counts.items() if name in IO_SYSCALLS)
                    net = {name: c - idle.get(name, 0) for name, c in counts.items()}
                    every = sum(max(0, c) for name, c in net.items() if name not in NOT_COUNTED)
                    result["syscalls"][f"{arm}|{kind}"] = {
                        "io": io / n,
                        "all": every / n,
                        "by_name": counts,
                        "idle_window": idle,
                    }
                log(f"syscalls counted: {kind}")
        elif not args.no_strace:
            result["syscall_source"] = "not counted: strace is not installed"
        arms.packed.close()
    Path(args.inner).write_text(json.dumps(result, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "disk_offload.json")
    p.add_argument("--table-gib", type=float, default=2.0, help="synthetic table size (GiB)")
    p.add_argument("--work", type=Path, help="keep the checkpoint and table here (reused)")
    p.add_argument("--reps", type=int, default=3, help="repetitions (cold and warm each)")
    p.add_argument("--decode-steps", type=int, default=24, help="steps of each decode stream")
    p.add_argument("--mtp-steps", type=int, default=16, help="steps of the MTP stream")
    p.add_argument("--chunks", type=int, default=3, help="chunks of the prompt stream")
    p.add_argument("--chunk-tokens", type=int, default=2048, help="tokens of a prompt chunk")
    p.add_argument("--decode-ms", type=float, default=45.0, help="device time of a decode step")
    p.add_argument("--chunk-ms", type=float, default=900.0, help="device time of a chunk step")
    p.add_argument("--no-strace", action="store_true", help="do not count syscalls")
    p.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    p.add_argument("--inner", help=argparse.SUPPRESS)
    p.add_argument("--rendered", help=argparse.SUPPRESS)
    p.add_argument("--table", help=argparse.SUPPRESS)
    p.add_argument("--snapshot", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return inner(args) if args.inner else driver(args)


if __name__ == "__main__":
    sys.exit(main())
