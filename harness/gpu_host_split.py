"""The host step's split timed on a GPU, and the fused decode against the torch decode.

Usage: python gpu_host_split.py {cuda|cpu|--cpu-smoke} RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE_DIR

Runs in the vLLM venv with the rendered patch laid over the package, as ple_equivalence.py does.
On a GPU (DEVICE cuda): per step shape (a prompt chunk alone, decode steps with MTP drafts, a
chunk beside decoding requests), once on a device kept busy long enough to see whether the host
step waited for it (the stream is idle when it returns, or still busy) and with its rows
against stock vLLM's, then the host step's seconds before the device sync, waiting for it and
after it (the patch's HostStep.last_times), median of repeats, each on a device kept busy for
a forward's worth from its start (BUSY_MS); then the forward's fused
Triton decode against the torch decode of the same device buffer, every byte value drawn (sign
bits and NaN scales too; median microseconds, and whether every value is the same, NaN as NaN).
Writes one JSON object, with `ok` and the `summary` lines that gpu/gpu-check.sh reports, and
exits 1 when `ok` is false.

cpu (or --cpu-smoke) builds everything up to the first CUDA call (the patched layer, vLLM's
model state, the runner's request state, the step shapes, one host step each on CPU, its wait
observed through the host step's wait hook, its rows against stock's) and writes what it
built: make test runs it, so the GPU run cannot fail on set-up code nobody ran.
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMOKE = sys.argv[1] in ("cpu", "--cpu-smoke")
if SMOKE:
    sys.argv[1] = "cpu"  # harness.ple_layer reads its device from argv[1]

import torch  # noqa: E402

import harness.ple_layer as ple  # noqa: E402
from harness.ple_steps import Runner, request_tokens  # noqa: E402

REPEATS = 1 if SMOKE else 20


DECODE = [(f"d{r}", 32, 4) for r in range(3)]
DRAFTS = {f"d{r}": 3 for r in range(3)}
# (name, scheduled, drafts): requests added by add_requests
SHAPES = [
    ("prompt chunk", [("p", 0, 256)], None),
    ("decode, MTP 3", DECODE, DRAFTS),
    ("chunk beside decodes", [*DECODE, ("p", 256, 256)], DRAFTS),
]


def add_requests(runner: Runner, vocab: int, eos: int) -> None:
    """Three requests decoding after a 32-token prompt, and a 900-token prompt."""
    for r in range(3):
        runner.add(f"d{r}", request_tokens(vocab, eos, seed=r, length=900), 32)
    runner.add("p", request_tokens(vocab, eos, seed=9, length=900), 900)


# How long the device stays busy from the start of a timed host step (a forward's worth), and
# of the one whose sync is observed (long enough that a host step that does not wait returns
# first).
BUSY_MS, OBSERVE_BUSY_MS = 5.0, 200.0


class DeviceWait:
    """Whether a host step waited for the device, seen from outside the host step.

    On CUDA the stream is kept busy (a sleep kernel) from the start of the host step: a step
    that synced returns to an idle stream, one that did not returns while the kernel still
    runs. The kernel is launched as the host step starts, not before the runner builds the
    step: the runner's own copies of its inputs to the device (from pageable memory) wait for
    the stream, which would read as a wait of the host step's. On the CPU, where nothing runs
    on a stream, the host step's wait is a hook that counts its calls.
    """

    def __init__(self, host) -> None:
        self.host = host
        self.cycles_per_ms = calibrate() if ple.DEVICE.type == "cuda" else 0.0
        self.calls = 0
        if ple.DEVICE.type != "cuda":
            host.wait_for_device = self._count

    def _count(self) -> None:
        self.calls += 1

    def busy(self, ms: float) -> None:
        if self.cycles_per_ms:
            torch.cuda._sleep(int(ms * self.cycles_per_ms))

    def step(self, run, busy_ms: float) -> tuple[Any, bool]:
        """run() with the device busy from the host step's start; (its result, whether the
        host step waited for the device)."""
        calls = self.calls
        if not self.cycles_per_ms:
            return run(), self.calls > calls
        host_run = self.host.run

        def on_a_busy_device(*args, **kwargs):
            self.busy(busy_ms)
            return host_run(*args, **kwargs)

        self.host.run = on_a_busy_device
        try:
            out = run()
        finally:
            del self.host.run  # the class's own again
        waited = torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        return out, waited


def calibrate() -> float:
    """Sleep-kernel cycles per millisecond on this GPU."""
    torch.cuda._sleep(1_000_000)  # the kernel loaded before it is timed
    torch.cuda.synchronize()
    started = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize()
    return 10_000_000 / ((time.perf_counter() - started) * 1e3)


def main() -> int:
    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    snapshot, table_dir = (Path(p) for p in sys.argv[4].split("=", 1))
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    vocab, eos = int(config.vocab_size), int(config.eos_token_id)
    prefix = f"model.language_model.layers.{ple.PLE_DECODER_LAYER}.ple.ple_embedding."
    dtype = torch.bfloat16
    ple.seed_loader_filter(rendered)
    result: dict = {"device": ple.DEVICE.type, "steps": {}}
    with tempfile.TemporaryDirectory() as work, ple.vllm_context(Path(work)):
        stock_module = importlib.import_module(ple.NGRAM_MODULE)
        patched, state_module = ple.patched_modules(rendered)
        import os

        os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)  # stock vLLM's own backend
        stock, _ = ple.build(stock_module, config, snapshot, prefix, dtype)
        result["stock_backend"] = type(stock.ngram_embedding).__name__
        os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
        layer, _ = ple.build(patched, config, snapshot, prefix, dtype)
        model = torch.nn.ModuleList([layer])
        state = ple.model_state(state_module, model, config)
        host = importlib.import_module("sparkple.vllm.host_step").host_step_of(model)
        device = DeviceWait(host)
        for name, scheduled, drafts in SHAPES:
            times, waited, right = [], [], []
            for repeat in range(REPEATS + 1):
                runner = Runner(state)
                add_requests(runner, vocab, eos)
                observe = repeat == 0  # the first on a long-busy device, then the timed ones
                (input_ids, qsl, ctx, real), synced = device.step(
                    lambda: runner.step(scheduled, drafts=drafts),  # noqa: B023
                    OBSERVE_BUSY_MS if observe else BUSY_MS,
                )
                if observe:
                    waited.append(synced)
                    ours = ple.forward(layer, input_ids, qsl, ctx)[:real]
                    theirs = ple.stock_rows(stock, input_ids, qsl, ctx, dtype)[:real]
                    right.append(bool(torch.equal(ours, theirs) and ours.abs().sum() > 0))
                else:
                    times.append(host.last_times)
                for req_id in list(runner.req_id_to_index):
                    runner.remove(req_id)
            result["steps"][name] = {
                "before_sync_us": statistics.median(t[0] for t in times) * 1e6,
                "sync_wait_us": statistics.median(t[1] for t in times) * 1e6,
                "after_sync_us": statistics.median(t[2] for t in times) * 1e6,
                "waited_for_the_device": waited[0],
                "rows_equal_stock": right[0],
                "device_busy_ms": BUSY_MS if ple.DEVICE.type == "cuda" else 0.0,
            }
        emb = layer.ngram_embedding
        if not SMOKE:
            result["decode"] = time_decodes(emb)
        emb.close()
    result["ok"], result["summary"] = verdict(result)
    result_path.write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


# Whether each shape must wait for the device: a prompt chunk alone never; a step with
# decode tokens or drafts once.
WAITS = {"prompt chunk": False, "decode, MTP 3": True, "chunk beside decodes": True}


def verdict(result: dict) -> tuple[bool, list[str]]:
    """Each shape waits for the device as WAITS says (as observed) and its rows equal stock's;
    the fused decode equals the torch decode."""
    steps = result["steps"]
    ok = all(
        s["waited_for_the_device"] == WAITS[name] and s["rows_equal_stock"]
        for name, s in steps.items()
    )
    lines = [
        f"host split, {name}: {s['before_sync_us']:.0f} us before the sync, "
        f"{s['sync_wait_us']:.0f} us waiting, {s['after_sync_us']:.0f} us after"
        + ("" if s["waited_for_the_device"] else " (no sync)")
        + ("" if s["waited_for_the_device"] == WAITS[name] else " WRONG WAIT")
        + ("" if s["rows_equal_stock"] else " WRONG ROWS")
        for name, s in steps.items()
    ]
    decode = result.get("decode")
    if decode is not None:
        ok = ok and decode["identical"]
        lines.append(
            f"fused decode, {decode['tokens']} tokens: {decode['fused_us']:.0f} us against "
            f"{decode['torch_us']:.0f} us for the torch decode, identical: {decode['identical']}"
        )
    return ok, lines


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN (their payloads may differ)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def time_decodes(emb) -> dict:
    """The fused decode against the torch decode of the same device buffer, 2,048 tokens."""
    from sparkple.runtime.nvfp4 import dequantize_rows_torch
    from sparkple.runtime.nvfp4_triton import decode_packed_rows

    tokens = min(2048, emb.packed_rows.shape[0])
    # every byte value: sign bits in the codes, and NaN scales (E4M3 0x7F and 0xFF)
    emb.packed_rows.copy_(torch.randint(0, 256, emb.packed_rows.shape, dtype=torch.uint8))
    packed = emb.packed_rows[:tokens]
    tables = (emb.nvfp4_pairs, emb.nvfp4_e4m3)

    def fused():
        return decode_packed_rows(
            packed, "nvfp4", emb.embedding_dim, emb._global_scale, tables, emb.params_dtype
        )

    def reference():
        return dequantize_rows_torch(
            packed, emb._global_scale, emb.embedding_dim, dtype=emb.params_dtype, tables=tables
        )

    out = {"tokens": tokens, "identical": same_values(fused(), reference())}
    for name, fn in (("fused_us", fused), ("torch_us", reference)):
        samples = []
        for _ in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e6)
        out[name] = statistics.median(samples)
    return out


if __name__ == "__main__":
    sys.exit(main())
