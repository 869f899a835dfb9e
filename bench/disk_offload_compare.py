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
import glob
import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
from measure import log, median, read_bytes, run_inner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (kind, requests, tokens a request per step, drafts a request per step); the prompt stream's
# step kind is split into its first chunk and the later ones when reported
STREAMS = {
    "decode@1": (1, 1, 0),
    "decode@8": (8, 1, 0),
    "mtp 4x4": (4, 4, 3),
    "chunk": (1, 0, 0),
}
KINDS = ("decode@1", "decode@8", "mtp 4x4", "chunk first", "chunk later")
ARMS = ("0.34", "sparkple", "sparkple-noadvice")
DECODE_PROMPT = 3  # a decode request's prompt: its prefill runs before the measured steps
IO_SYSCALLS = {
    "pread64": "read",
    "preadv": "read",
    "preadv2": "read",
    "fadvise64": "advice",
    "madvise": "advice",
    "process_madvise": "advice",
}
# not the host step's: the modelled device's busy time between steps (time.sleep), and the
# polling of torch.distributed's gloo thread, which runs whatever the step does
NOT_COUNTED = {"clock_nanosleep", "nanosleep", "epoll_wait"}
GOALS = {"decode": 0.5, "chunk": 0.10, "disk": 0.6}


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


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians per (arm, temperature, kind) over every repetition's steps, and the ratios."""
    figures: dict[str, Any] = {}
    for arm, temps in result["runs"].items():
        for temp, kinds in temps.items():
            for kind, runs in kinds.items():
                crit = [c for run in runs for c in run["critical_s"]]
                tokens = sum(run["tokens"] for run in runs)
                # sparkple's steps without decode advice ran in sparkple's own streams: their
                # bytes are sparkple's
                counted = all("disk_bytes" in run for run in runs)
                figures.setdefault(arm, {}).setdefault(temp, {})[kind] = {
                    "critical_us": median(crit) * 1e6,
                    "disk_b_per_token": sum(run["disk_bytes"] for run in runs) / tokens
                    if counted
                    else None,
                    "cache_b_per_token": sum(run["cache_bytes"] for run in runs) / tokens
                    if counted
                    else None,
                    "steps": len(crit),
                }
    syscalls: dict[str, dict[str, dict[str, float]]] = {}
    for key, counted in result.get("syscalls", {}).items():
        arm, kind = key.split("|")
        syscalls.setdefault(arm, {})[kind] = counted
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    base, ours = figures.get("0.34", {}), figures.get("sparkple", {})
    for temp in ("cold", "warm"):
        for kind in KINDS:
            b, s = base.get(temp, {}).get(kind), ours.get(temp, {}).get(kind)
            if b is None or s is None:
                continue
            ratios.setdefault(temp, {})[kind] = {
                "critical": ratio(s["critical_us"], b["critical_us"]),
                "disk": ratio(s["disk_b_per_token"], b["disk_b_per_token"]),
                "cache": ratio(s["cache_b_per_token"], b["cache_b_per_token"]),
            }
    cold = ratios.get("cold", {})
    decode_worst = max(cold[k]["critical"] for k in ("decode@1", "decode@8", "mtp 4x4"))
    chunk = cold["chunk later"]["critical"]
    disk_worst = max(r["disk"] for r in cold.values())
    advice: dict[str, float] = {}
    noadv = figures.get("sparkple-noadvice", {}).get("cold", {})
    for kind in ("decode@1", "decode@8", "mtp 4x4"):
        if kind in noadv:
            advice[kind] = ratio(ours["cold"][kind]["critical_us"], noadv[kind]["critical_us"])
    return {
        "figures": figures,
        "syscalls": syscalls,
        "ratios": ratios,
        "decode_worst": decode_worst,
        "chunk_later": chunk,
        "chunk_first": cold["chunk first"]["critical"],
        "disk_worst": disk_worst,
        "advice_cold": advice,
        "identical": result["identical"],
        "goals_met": {
            "decode": decode_worst <= GOALS["decode"],
            "chunk": chunk <= GOALS["chunk"],
            "disk": disk_worst <= GOALS["disk"],
        },
    }


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (1.0 if a == 0 else float("inf"))


def syscall_cells(summary: dict[str, Any], arm: str, kind: str) -> tuple[str, str]:
    counted = summary["syscalls"].get(arm, {}).get(kind.split(" ")[0] if "chunk" in kind else kind)
    if not counted:
        return "-", "-"
    return f"{counted['io']:.1f}", f"{counted['all']:.1f}"


def report(result: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    lines = [
        f"table {result['table_gib']:g} GiB ({result['table_bytes'] / 2**30:.2f} GiB packed, "
        f"checkpoint {result['checkpoint_bytes'] / 2**30:.2f} GiB in "
        f"{result['checkpoint_files']} files); {result['reps']} repetitions, medians; "
        f"syscalls: {result['syscall_source']}",
        f"{'kind':<12} {'temp':<5} {'arm':<18} {'crit us':>10} {'io sys/step':>11} "
        f"{'all sys/step':>12} {'disk B/tok':>11} {'cache B/tok':>11} {'crit x':>7} "
        f"{'disk x':>7} {'cache x':>7}",
    ]
    figures = summary["figures"]
    for kind in KINDS:
        for temp in ("cold", "warm"):
            for arm in ARMS:
                fig = figures.get(arm, {}).get(temp, {}).get(kind)
                if fig is None:
                    continue
                io, every = syscall_cells(summary, arm, kind) if temp == "cold" else ("-", "-")
                base = figures["0.34"][temp][kind]
                disk, cache = fig["disk_b_per_token"], fig["cache_b_per_token"]
                cells = ["", "", ""]
                if arm != "0.34":
                    cells = [f"{ratio(fig['critical_us'], base['critical_us']):.3f}", "-", "-"]
                    if disk is not None:
                        cells[1] = f"{ratio(disk, base['disk_b_per_token']):.2f}"
                        cells[2] = f"{ratio(cache, base['cache_b_per_token']):.2f}"
                lines.append(
                    f"{kind:<12} {temp:<5} {arm:<18} {fig['critical_us']:>10.0f} {io:>11} "
                    f"{every:>12} {'-' if disk is None else f'{disk:.0f}':>11} "
                    f"{'-' if cache is None else f'{cache:.0f}':>11} {cells[0]:>7} {cells[1]:>7} "
                    f"{cells[2]:>7}"
                )
    identical = summary["identical"]
    lines.append(
        f"identical staged rows, sparkple vs 0.34: {identical['equal']} of {identical['steps']} "
        "steps"
    )
    advice = summary["advice_cold"]
    if advice:
        lines.append(
            "decode advice (WILLNEED before the decode gather), cold critical path with / "
            "without: " + ", ".join(f"{k} {v:.3f}x" for k, v in advice.items())
        )
    return lines


def headline(summary: dict[str, Any]) -> str:
    goals = summary["goals_met"]

    def mark(name: str) -> str:
        return "met" if goals[name] else "MISSED"

    return (
        f"disk-offload-compare: sparkple / vLLM 0.34 disk_offload, cold: decode critical path "
        f"{summary['decode_worst']:.3f}x at worst (goal <= {GOALS['decode']}: {mark('decode')}), "
        f"prompt chunk {summary['chunk_later']:.3f}x later chunks, {summary['chunk_first']:.3f}x "
        f"first (goal <= {GOALS['chunk']}: {mark('chunk')}), disk bytes per token "
        f"{summary['disk_worst']:.2f}x at worst (goal <= {GOALS['disk']}: {mark('disk')}); rows "
        f"identical in {summary['identical']['equal']}/{summary['identical']['steps']} steps"
    )


# ------------------------------------------------------------------------------ inner (vLLM venv)


def evict_files(paths: list[str], settle_s: float = 5.0) -> int:
    """Drop the files' pages (POSIX_FADV_DONTNEED, repeated while reads settle); returns the
    pages still resident by mincore."""
    from sparkple.runtime.pagecache import file_resident_pages

    deadline = time.monotonic() + settle_s
    while True:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = sum(file_resident_pages(path)[0] for path in paths)
        if left == 0 or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def resident_bytes(paths: list[str]) -> int:
    from sparkple.runtime.pagecache import PAGE_SIZE, file_resident_pages

    return sum(file_resident_pages(path)[0] for path in paths) * PAGE_SIZE


@contextmanager
def strace_counts(into: dict[str, int]) -> Iterator[None]:
    """Every syscall of this process (all threads) while the block runs: `strace -c -f -p`
    attached for its length, the block started only once each thread is traced."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts"
        proc = subprocess.Popen(
            ["strace", "-f", "-c", "-o", str(out), "-p", str(os.getpid())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while not all_traced():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("strace could not attach to this process")
            time.sleep(0.01)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait()
            for line in out.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 5 and parts[3].isdigit() and parts[-1] != "total":
                    into[parts[-1]] = into.get(parts[-1], 0) + int(parts[3])


def all_traced() -> bool:
    for status in glob.glob(f"/proc/{os.getpid()}/task/*/status"):
        try:
            text = Path(status).read_text()
        except OSError:
            continue  # a thread that ended meanwhile
        for line in text.splitlines():
            if line.startswith("TracerPid:") and line.split()[1] == "0":
                return False
    return True


class Arms:
    """Both layers, their model states and how each one's step is timed and read back."""

    def __init__(self, args: argparse.Namespace, max_tokens: int, max_model_len: int) -> None:
        import torch
        from transformers import Qwen4ExpTextConfig

        import harness.ple_layer as ple

        self.ple = ple
        raw = json.loads((Path(args.snapshot) / "config.json").read_text())
        self.config = Qwen4ExpTextConfig(**raw["text_config"])
        self.max_model_len = max_model_len
        prefix = f"model.language_model.layers.{ple.PLE_DECODER_LAYER}.ple.ple_embedding."
        # vLLM's own modules first, as the server imports them; then the patch laid over
        stock = importlib.import_module(ple.NGRAM_MODULE)
        self.stock_state_module = importlib.import_module(ple.STATE_MODULE)
        disk = ple.disk_offload_layer(
            stock, self.config, Path(args.snapshot), prefix, torch.bfloat16, max_tokens
        )
        if disk is None:
            raise RuntimeError("this vLLM has no disk offload backend (0.34.0 is needed)")
        self.disk_layer = disk
        self.disk = disk.ngram_embedding
        self.disk_paths = sorted(self.disk._fds)
        self.stage_times: list[float] = []
        stage_rows = self.disk.stage_rows

        def timed_stage_rows(num_tokens: int) -> None:
            t0 = time.perf_counter()
            stage_rows(num_tokens)
            self.stage_times.append(time.perf_counter() - t0)

        self.disk.stage_rows = timed_stage_rows  # what stage_checkpoint_rows calls, timed

        os.environ["SPARKPLE_PLE_TABLE_DIR"] = args.table
        patched, self.patched_state_module = ple.patched_modules(Path(args.rendered))
        with torch.device("cpu"):
            layer = patched.Qwen4ExpNGramEmbedding(
                self.config,
                int(self.config.ple_embed_dim),
                0,
                max_tokens,
                data_parallel_rank=0,
                prefix=prefix.rstrip("."),
                params_dtype=torch.bfloat16,
            )
        self.packed = layer.ngram_embedding
        # the row shards are the table's: the loader gives the layer the global scale only
        scale = torch.tensor([self.packed.table.meta.global_scale], dtype=torch.float32)
        layer.load_weights([("ngram_embedding.weight_scale_2", scale.reshape(-1))])
        self.packed_layer = layer
        self.table_path = str(self.packed.table.meta.data_path(Path(args.table)))
        from sparkple.vllm.host_step import host_step_of

        self.host = host_step_of(torch.nn.ModuleList([layer]))

    def paths(self, arm: str) -> list[str]:
        return self.disk_paths if arm == "0.34" else [self.table_path]

    def runner(self, arm: str) -> Any:
        import torch

        from harness.ple_steps import Runner

        if arm == "0.34":
            model = torch.nn.ModuleList([self.disk_layer])
            state = self.ple.model_state(self.stock_state_module, model, self.config)
            assert state.disk_offload_modules, "vLLM's model state found no disk offload layer"
        else:
            model = torch.nn.ModuleList([self.packed_layer])
            state = self.ple.model_state(self.patched_state_module, model, self.config)
            # the same HostStep object: host_step_of caches it on the model, made once here
            vars(model)["_sparkple_host_step"] = self.host
            self.host.wait_for_device = lambda: None  # the device's inputs are there
        return Runner(state, self.max_model_len)

    def set_advice(self, on: bool) -> None:
        """The decode gather's WILLNEED advice on (the runtime's own) or off (the gather
        alone)."""
        worker = self.packed._worker
        if on:
            vars(worker).pop("_advise", None)
        else:
            worker._advise = lambda ids: None

    def evict(self, arm: str) -> int:
        if arm == "0.34":
            return evict_files(self.disk_paths)
        left = self.packed.table.evict()
        self.packed._worker.prefetcher.forget()  # what it advised is gone
        return 0 if left == 0 else max(1, resident_bytes([self.table_path]) // 4096)

    def critical(self, arm: str) -> float:
        if arm == "0.34":
            return self.stage_times[-1]
        before, _, after = self.host.last_times
        return after if self.host.last_synced else before + after

    def staged(self, arm: str, tokens: int) -> bytes:
        """The step's staged packed rows as bytes, [tokens, heads, 90]: 0.34's two planes
        (E2M1 codes, E4M3 block scales) side by side, sparkple's device buffer."""
        import torch

        if arm == "0.34":
            planes = [staging[:tokens] for staging, _, _ in self.disk._planes.values()]
            rows = torch.cat([p.view(torch.uint8) for p in planes], dim=-1)
        else:
            rows = self.packed.packed_rows[:tokens]
        return rows.contiguous().numpy().tobytes()


# (step kind, scheduled (request, tokens computed before, tokens this step), drafts per request)
Step = tuple[str, list[tuple[str, int, int]], dict[str, int] | None]


def stream_steps(kind: str, args: argparse.Namespace, vocab: int, seed: int):
    """(requests: name -> (tokens, prompt_len), setup steps, measured steps, gap seconds)."""
    reqs, per_step, drafts = STREAMS[kind]
    rng = np.random.default_rng(seed)
    if kind == "chunk":
        prompt = args.chunks * args.chunk_tokens
        requests = {"p": (rng.integers(0, vocab, prompt + 8), prompt)}
        size = args.chunk_tokens
        chunks: list[Step] = [
            ("chunk first" if c == 0 else "chunk later", [("p", c * size, size)], None)
            for c in range(args.chunks)
        ]
        return requests, [], chunks, args.chunk_ms / 1e3
    count = args.mtp_steps if drafts else args.decode_steps
    length = DECODE_PROMPT + count * per_step + 8
    requests = {f"r{i}": (rng.integers(0, vocab, length), DECODE_PROMPT) for i in range(reqs)}
    setup = [[(name, 0, DECODE_PROMPT) for name in requests]]
    steps: list[Step] = []
    for n in range(count):
        done = DECODE_PROMPT + n * per_step
        steps.append(
            (
                kind,
                [(name, done, per_step) for name in requests],
                {name: drafts for name in requests} if drafts else None,
            )
        )
    return requests, setup, steps, args.decode_ms / 1e3


def run_lockstep(
    arms: Arms,
    lanes: tuple[str, ...],
    kind: str,
    args: argparse.Namespace,
    vocab: int,
    seed: int,
    temp: str,
    syscalls: dict[str, int] | None = None,
) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, list[str]]]:
    """One stream, its steps run by each arm in turn on the same tokens (the order alternating
    step by step), so that both arms' step n meet the same moment of the shared machine. In a
    decode stream sparkple's odd steps run with its decode advice off ("sparkple-noadvice").

    A prompt stream runs one arm after the other instead: sparkple's lookahead works in the
    background, and in lockstep it would also work (and compete for the disk) while 0.34's
    step runs, time the device's work between two steps does not give it.

    Returns ({label: {step kind: figures}}, {arm: each step's staged rows' digest}).
    Disk bytes: a 0.34 step's are its thread's (it issues all of its reads on the calling
    thread, inside the step), the rest of the stream's are sparkple's (its gather and
    lookahead threads read too); page cache: by files (mincore)."""
    if kind == "chunk" and len(lanes) > 1:
        out: dict[str, dict[str, dict[str, Any]]] = {}
        staged: dict[str, list[str]] = {}
        for arm in lanes:
            part, digests = run_lockstep(arms, (arm,), kind, args, vocab, seed, temp)
            out.update(part)
            staged.update(digests)
        return out, staged
    requests, setup, steps, gap = stream_steps(kind, args, vocab, seed)
    runners = {arm: arms.runner(arm) for arm in lanes}
    # A stream without setup steps (the prompt) arrives at a cold table: evicted before its
    # requests are added, as adding one starts sparkple's lookahead on its pages.
    evict_first = temp == "cold" and not setup
    for arm in lanes if evict_first else ():
        left = arms.evict(arm)
        if left:
            raise RuntimeError(f"{left} pages of {arm}'s files stayed resident after eviction")
    if evict_first:  # the stream's disk and page cache counted from the eviction on
        cache0 = {arm: resident_bytes(arms.paths(arm)) for arm in lanes}
        disk0 = read_bytes()
    for arm in lanes:
        for name, (tokens, prompt_len) in requests.items():
            runners[arm].add(name, tokens, prompt_len)
        for scheduled in setup:
            runners[arm].step(scheduled)
    if temp == "cold" and not evict_first:
        for arm in lanes:
            left = arms.evict(arm)
            if left:
                raise RuntimeError(f"{left} pages of {arm}'s files stayed resident after eviction")
    toggle = kind != "chunk" and syscalls is None
    out = {}
    staged = {arm: [] for arm in lanes}
    tokens_of = dict.fromkeys(lanes, 0)
    in_step = dict.fromkeys(lanes, 0)
    if not evict_first:
        cache0 = {arm: resident_bytes(arms.paths(arm)) for arm in lanes}
        disk0 = read_bytes()
    counting: AbstractContextManager[None] = (
        strace_counts(syscalls) if syscalls is not None else nullcontext()
    )
    with counting:
        for n, (step_kind, scheduled, drafts) in enumerate(steps):
            if n:
                time.sleep(gap)  # the device computes the step before
            tokens = sum(count for _, _, count in scheduled)
            for arm in lanes if (n + seed) % 2 == 0 else lanes[::-1]:
                label = arm
                if arm == "sparkple" and toggle and n % 2:
                    label = "sparkple-noadvice"
                arms.set_advice(label != "sparkple-noadvice")
                b0 = thread_read_bytes()
                runners[arm].step(scheduled, drafts=drafts)
                in_step[arm] += thread_read_bytes() - b0
                crit = arms.critical(arm)
                entry = out.setdefault(label, {}).setdefault(
                    step_kind, {"critical_s": [], "tokens": 0}
                )
                entry["critical_s"].append(crit)
                entry["tokens"] += tokens
                tokens_of[arm] += tokens
                staged[arm].append(hashlib.blake2b(arms.staged(arm, tokens)).hexdigest())
    arms.set_advice(True)
    disk_total = read_bytes() - disk0
    disk = {arm: in_step[arm] for arm in lanes}
    if "sparkple" in lanes:
        disk["sparkple"] = disk_total - sum(v for a, v in in_step.items() if a != "sparkple")
    elif len(lanes) == 1:
        disk[lanes[0]] = disk_total
    for arm in lanes:
        cache = resident_bytes(arms.paths(arm)) - cache0[arm]
        for entry in out[arm].values():  # the stream's bytes shared out by tokens
            share = entry["tokens"] / tokens_of[arm]
            entry["disk_bytes"], entry["cache_bytes"] = disk[arm] * share, cache * share
            entry["stream_tokens"] = tokens_of[arm]
    for arm in lanes:
        for name in requests:
            runners[arm].remove(name)
    return out, staged


def thread_read_bytes() -> int:
    """The bytes the calling thread made the disk read (/proc/thread-self/io read_bytes)."""
    with open("/proc/thread-self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/thread-self/io has no read_bytes")


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
