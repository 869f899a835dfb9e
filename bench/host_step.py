#!/usr/bin/env python3
"""The PLE host step's critical path, against the wait-before-forward design, in one run.

    python bench/host_step.py --json bench/out/host_step.json

Drives the real host step: the rendered patch's packed-table backend under vLLM 0.33.0's own
Qwen4ExpModelState.prepare_inputs (and add_request/remove_request), with steps built from
vLLM's RequestState and InputBatch as the equivalence tests build them (it runs in the vLLM
test venv of the machine's cache, harness/wheel_cache.py). The workload is a Spark's: four
requests, one a 16,384-token prompt in 2,048-token chunks, three decoding with MTP 3 (4 tokens
a step), then all four decoding. The GPU is modelled as busy for a set time per step (--decode-ms,
--chunk-ms; defaults from the Spark's published rates), asynchronous scheduling as vLLM runs
it: the host prepares step N+1 while step N is on the device, and the host step's wait for the
device's inputs ends when step N's modelled work ends.

Critical path of a step: from the moment the previous step's device work ends to the moment
the forward could launch (the host step returned), 0 when the host was ready first. Compared:
- split: this patch's order (prompt rows before the sync, lookahead, lean decode step);
- split_thread: the same, with the decode rows handed to the gather thread (no spin) instead
  of gathered on the model thread (the other option the waiter's rule allows);
- wait-before-forward: everything after the sync, no lookahead, the gather thread with its
  50 us spin (the reference's order and the previous one of this patch).
Each runs on a cold table (evicted, checked with mincore; disk bytes from /proc/self/io) and
then warm. The table is synthetic, 4 GiB, built once into --work and reused. Writes JSON and a
PNG plot of the per-step critical path next to it; the headline is the last line printed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from measure import log, read_bytes, run_inner

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT_TOKENS = 16_384
CHUNK = 2_048
DECODERS = 3
MTP = 3
MAX_TOKENS = CHUNK + (DECODERS + 1) * (MTP + 1)
MAX_MODEL_LEN = PROMPT_TOKENS + 512
OLD_SPIN_S = 0.00005  # what the previous rendered module passed to the handshake waiter


# ------------------------------------------------------------------------------ driver


def driver(args: argparse.Namespace) -> int:
    from harness import wheel_cache
    from sparkple import patch

    # the vLLM test venv and the wheel's sources from the machine's cache (built when missing)
    venv_python, originals = wheel_cache.vllm_venv(), wheel_cache.vllm_originals()
    args.work.mkdir(parents=True, exist_ok=True)
    from synthtable import ensure_table

    table_dir, config, _ = ensure_table(args.work, args.table_gib)
    with tempfile.TemporaryDirectory() as tmp:
        rendered = Path(tmp) / "rendered"
        patch.render(patch.DEFAULT_PROFILE, originals, rendered)
        inner = Path(tmp) / "inner.json"
        cmd = [
            str(venv_python),
            __file__,
            "--inner",
            str(inner),
            "--rendered",
            str(rendered),
            "--table",
            str(table_dir),
            "--config",
            str(config),
            "--decode-ms",
            str(args.decode_ms),
            "--chunk-ms",
            str(args.chunk_ms),
            "--decode-steps",
            str(args.decode_steps),
            "--warm-rounds",
            str(args.warm_rounds),
        ]
        result = run_inner(cmd, inner, tmp)
        if isinstance(result, int):
            return result
    result["table_gib"] = args.table_gib
    summary = summarize(result)
    result["summary"] = summary
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    plot = write_plot(result, args.json)
    for design in ("split", "split_thread", "wait_before_forward"):
        for temp in ("cold", "warm"):
            med = summary["medians_ms"][design][temp]
            print(
                f"{design} {temp}: critical path ms (median) decode {med['decode']:.3f}, "
                f"chunk 1 {med['chunk1']:.3f}, later chunks {med['later']:.3f}; "
                f"disk {result['runs'][design][temp]['disk_mib']:.0f} MiB"
            )
    print(f"json: {args.json}")
    if plot:
        print(f"plot: {plot}")
    s = summary
    print(
        f"decode rows on the gather thread instead of inline: RD {s['RD_thread']:.3f} x warm "
        f"(RC {s['RC_thread']:.3f} x cold)"
    )
    print(
        f"host-step: prefill critical path RP {s['RP']:.3f} x (chunks after the first), first "
        f"chunk R1 {s['R1']:.3f} x, decode critical path RD {s['RD']:.3f} x warm (RC "
        f"{s['RC']:.3f} x cold) of wait-before-forward; lookahead page cache "
        f"{s['W_mib']:.0f} MiB"
    )
    if args.check and not (s["RP"] <= 0.10 and s["RD"] <= 0.5):
        return 1
    return 0


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for design, temps in result["runs"].items():
        medians[design] = {}
        for temp, run in temps.items():
            by_kind: dict[str, list[float]] = {"decode": [], "chunk1": [], "later": []}
            for kind, crit in zip(run["kinds"], run["critical_s"], strict=True):
                by_kind[kind].append(crit * 1e3)
            medians[design][temp] = {k: float(statistics.median(v)) for k, v in by_kind.items()}

    def ratio(kind: str, temp: str, design: str = "split") -> float:
        base = medians["wait_before_forward"][temp][kind]
        return medians[design][temp][kind] / base if base > 0 else float("inf")

    return {
        "medians_ms": medians,
        # the decode rows handed to the gather thread instead (no spin): the other option
        "RD_thread": ratio("decode", "warm", "split_thread"),
        "RC_thread": ratio("decode", "cold", "split_thread"),
        "RP": ratio("later", "cold"),
        "R1": ratio("chunk1", "cold"),
        "RD": ratio("decode", "warm"),
        "RC": ratio("decode", "cold"),
        "W_mib": result["lookahead_peak_bytes"] / 2**20,
        "W_window_mib": result["lookahead_window_bytes"] / 2**20,
    }


def write_plot(result: dict[str, Any], json_path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, temp in zip(axes, ("cold", "warm"), strict=True):
        for design, style in (("wait_before_forward", "o-"), ("split", "s-")):  # the headline
            crit = np.asarray(result["runs"][design][temp]["critical_s"]) * 1e3
            ax.plot(np.arange(crit.size), np.maximum(crit, 1e-3), style, ms=3, label=design)
        ax.set_yscale("log")
        ax.set_title(f"{temp} table")
        rounds = "" if temp == "cold" else "each warm round: "
        ax.set_xlabel(f"step ({rounds}8 prompt chunks, then decode steps)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("host critical path, ms (log)")
    axes[0].legend()
    fig.tight_layout()
    path = str(json_path.with_suffix(".png"))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ inner (vLLM venv)


class ModelledDevice:
    """The device as a timer: each launched step keeps it busy for its set time."""

    def __init__(self) -> None:
        self.free_at = time.perf_counter()

    def wait(self) -> None:
        """The host's wait for the device's copy of the inputs: until the step before ends."""
        left = self.free_at - time.perf_counter()
        if left > 0.002:
            time.sleep(left - 0.002)
        while time.perf_counter() < self.free_at:
            pass

    def launch(self, busy_s: float) -> float:
        """The forward launches now (or when the device is free); returns the critical path."""
        now = time.perf_counter()
        critical = max(0.0, now - self.free_at)
        self.free_at = max(now, self.free_at) + busy_s
        return critical


def workload(vocab: int, eos: int, decode_steps: int, seed: int):
    """(requests to add, steps): steps are (kind, scheduled, drafts)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab, PROMPT_TOKENS + 64 * (MTP + 1) + decode_steps * (MTP + 1))
    requests = {"long": (prompt, PROMPT_TOKENS)}
    for d in range(DECODERS):
        tokens = rng.integers(0, vocab, 64 + (CHUNK // CHUNK + 8 + decode_steps) * (MTP + 1) + 64)
        requests[f"dec{d}"] = (tokens, 64)
    steps = []
    done = {name: length for name, (_, length) in requests.items()}
    done["long"] = 0
    for chunk in range(PROMPT_TOKENS // CHUNK):
        scheduled = [(f"dec{d}", done[f"dec{d}"], MTP + 1) for d in range(DECODERS)]
        scheduled.append(("long", done["long"], CHUNK))
        steps.append(
            ("chunk1" if chunk == 0 else "later", scheduled, {n: MTP for n, *_ in scheduled[:-1]})
        )
        for name, start, count in scheduled:
            done[name] = start + count
    for _ in range(decode_steps):
        scheduled = [(name, done[name], MTP + 1) for name in requests]
        steps.append(("decode", scheduled, {name: MTP for name in requests}))
        for name, start, count in scheduled:
            done[name] = start + count
    return requests, steps


def inner(args: argparse.Namespace) -> int:
    # harness.ple_layer reads its device from argv[1] when imported
    sys.argv[1:] = ["cpu"]
    import torch
    from transformers import Qwen4ExpTextConfig

    import harness.ple_layer as ple
    from harness.ple_steps import Runner

    # The modelled device's uploads are CPU copies here: one torch thread keeps each from
    # waking a thread pool on the shared cores (on a GPU they are asynchronous H2D copies).
    torch.set_num_threads(1)

    raw = json.loads(Path(args.config).read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    ple.MAX_TOKENS = MAX_TOKENS
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = args.table
    ple.seed_loader_filter(Path(args.rendered))
    result: dict[str, Any] = {"runs": {}, "decode_ms": args.decode_ms, "chunk_ms": args.chunk_ms}
    with (
        tempfile.TemporaryDirectory() as work,
        ple.vllm_context(Path(work), max_tokens=MAX_TOKENS, max_model_len=MAX_MODEL_LEN),
    ):
        importlib.import_module(ple.NGRAM_MODULE)  # vLLM's own, as the server imports it first
        patched, state_module = ple.patched_modules(Path(args.rendered))
        prefix = f"model.language_model.layers.{ple.PLE_DECODER_LAYER}.ple.ple_embedding"
        with torch.device("cpu"):
            layer = patched.Qwen4ExpNGramEmbedding(
                config,
                int(config.ple_embed_dim),
                0,
                MAX_TOKENS,
                data_parallel_rank=0,
                prefix=prefix,
                params_dtype=torch.bfloat16,
            )
        embedding = layer.ngram_embedding
        # the loader reads only the global scale and the hash buffers (the row shards are the
        # table's); the hash buffers are what vLLM derives from the config, as the checkpoint's
        scale = torch.tensor([embedding.table.meta.global_scale], dtype=torch.float32)
        layer.load_weights([("ngram_embedding.weight_scale_2", scale.reshape(-1))])
        model = torch.nn.ModuleList([layer])
        vocab, eos = int(config.vocab_size), int(config.eos_token_id)
        requests, steps = workload(vocab, eos, args.decode_steps, seed=5)
        table = embedding.table  # the layer's own mapping: evicting zaps its pages
        peak = 0
        # cold then warm per design; then more warm rounds, alternating, so that a burst of
        # other work on the shared cores does not land on one design only
        designs = ("wait_before_forward", "split", "split_thread")
        order = [(d, t) for d in designs for t in ("cold", "warm")]
        order += [(d, "warm") for _ in range(args.warm_rounds - 1) for d in designs]
        for design, temp in order:
            if temp == "cold":
                os.sync()  # a freshly built table's dirty pages cannot be dropped
                left = table.evict()
                if left > 0:
                    raise RuntimeError(f"{left:.1%} of the table stayed resident")
                embedding._worker.prefetcher.forget()  # what it advised was evicted
            state = ple.model_state(state_module, model, config)
            runner = Runner(state, MAX_MODEL_LEN)
            host = patched_host_step(state)
            host.wait_before_forward = design == "wait_before_forward"
            host.decode_rows_inline = design != "split_thread"
            embedding._worker._waiter.spin_s = OLD_SPIN_S if host.wait_before_forward else None
            device = ModelledDevice()
            host.wait_for_device = device.wait
            if embedding._lookahead is not None:
                embedding._lookahead.peak_outstanding_pages = 0
            for name, (tokens, prompt_len) in requests.items():
                runner.add(name, tokens, prompt_len)
            kinds, critical, times = [], [], []
            b0 = read_bytes()
            device.free_at = time.perf_counter()
            for kind, scheduled, drafts in steps:
                runner.step(scheduled, drafts=drafts)
                busy = args.decode_ms if kind == "decode" else args.chunk_ms
                critical.append(device.launch(busy / 1e3))
                kinds.append(kind)
                times.append(list(host.last_times))
            disk = read_bytes() - b0
            for name in requests:
                runner.remove(name)
            if embedding._lookahead is not None:
                peak = max(peak, embedding._lookahead.peak_outstanding_pages * 4096)
            run = (
                result["runs"]
                .setdefault(design, {})
                .setdefault(
                    temp, {"kinds": [], "critical_s": [], "host_times_s": [], "disk_mib": 0.0}
                )
            )
            run["kinds"] += kinds
            run["critical_s"] += critical
            run["host_times_s"] += times
            run["disk_mib"] = max(run["disk_mib"], disk / 2**20)
            log(f"{design} {temp}: done, disk {disk / 2**20:.0f} MiB")
        result["lookahead_peak_bytes"] = peak
        window = embedding._lookahead.window_pages * 4096 if embedding._lookahead else 0
        result["lookahead_window_bytes"] = window
        embedding.close()
    Path(args.inner).write_text(json.dumps(result))
    return 0


def patched_host_step(state) -> Any:
    from sparkple.vllm.host_step import host_step_of  # imports vLLM: only in the inner run

    return host_step_of(state.model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "host_step.json")
    p.add_argument("--table-gib", type=float, default=4.0, help="synthetic table size (GiB)")
    p.add_argument("--work", type=Path, default=ROOT / "bench" / "out" / "host-step")
    p.add_argument("--decode-ms", type=float, default=45.0, help="device time of a decode step")
    p.add_argument(
        "--chunk-ms", type=float, default=900.0, help="device time of a 2,048-token chunk step"
    )
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--warm-rounds", type=int, default=3, help="warm runs of each design")
    p.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    p.add_argument("--inner", help=argparse.SUPPRESS)
    p.add_argument("--rendered", help=argparse.SUPPRESS)
    p.add_argument("--table", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return inner(args) if args.inner else driver(args)


if __name__ == "__main__":
    sys.exit(main())
