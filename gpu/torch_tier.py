"""The GPU check's first tier: the project's own device code, with torch, triton and numpy only.

Usage: python torch_tier.py {cuda|cpu} RESULT_JSON

No vLLM: it runs before anything of vLLM is imported, and writes its figures even when the
vLLM tier after it cannot run. On the device:
1. the fused NVFP4 decode kernel (sparkple.runtime.nvfp4_triton) against the torch decode
   (sparkple.runtime.nvfp4), in float32, bfloat16 and float16, over rows in which every code
   byte and every block-scale byte occurs (sign bits, subnormal, zero and NaN scales
   included), and in float32 against the numpy decode too; a NaN equals a NaN;
2. the FP8 kernel against torch's own E4M3 conversion, over all 256 byte values;
3. the row ids on the device (row_ids_torch) against numpy's (row_ids);
4. the step's device half as the backend runs it: rows into pinned staging, an event, the
   upload into a persistent device buffer on the stream, and the decode captured once in a
   CUDA graph and replayed with new rows, each replay's values checked;
5. timings (medians): the decode of 256 tokens' rows (16 each), their upload, one replay.
`cpu` (the smoke mode) runs the same on the CPU, the kernels under Triton's interpreter
(TRITON_INTERPRET=1, set by gpu-check.sh) and the graph's steps eagerly.
Prints its summary lines; exit 1 when a check fails.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from sparkple.builder.synth import make_config
from sparkple.geometry import PLEGeometry
from sparkple.runtime.ngram import row_ids, row_ids_torch
from sparkple.runtime.nvfp4 import dequantize_rows, dequantize_rows_torch, torch_tables
from sparkple.runtime.nvfp4_triton import decode_packed_rows

HEADS, HEAD_DIM = 16, 160
ROW_BYTES = HEAD_DIM // 2 + HEAD_DIM // 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GLOBAL_SCALE = 0.0123
REPLAYS = 4
Decode = Callable[..., torch.Tensor]


def every_byte_rows(tokens: int, seed: int) -> np.ndarray:
    """Packed NVFP4 rows [tokens, HEADS, ROW_BYTES] in which every byte value occurs as a code
    byte and as a block-scale byte (in order first, then at random)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, size=(tokens, HEADS, ROW_BYTES), dtype=np.uint8)
    flat = rows.reshape(-1, ROW_BYTES)
    flat[:256, 0] = np.arange(256)  # every code byte
    flat[:256, HEAD_DIM // 2] = np.arange(256)  # every scale byte: 0x7F and 0xFF are NaN
    return rows


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element (and in shape), a NaN equal to a NaN."""
    if a.shape != b.shape:
        return False
    a, b = a.float().cpu(), b.float().cpu()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def check_nvfp4(device: torch.device, decode: Decode = decode_packed_rows) -> dict[str, bool]:
    """decode (the fused kernel) against the torch decode per dtype, and the numpy decode."""
    tables = torch_tables(device)
    packed_np = every_byte_rows(64, seed=1)
    packed = torch.from_numpy(packed_np).to(device)
    seen = {}
    for name, dtype in DTYPES.items():
        want = dequantize_rows_torch(packed, GLOBAL_SCALE, HEAD_DIM, dtype=dtype, tables=tables)
        got = decode(packed, "nvfp4", HEAD_DIM, GLOBAL_SCALE, tables, dtype)
        seen[f"nvfp4 {name}"] = same(got, want)
    numpy_rows = torch.from_numpy(dequantize_rows(packed_np, GLOBAL_SCALE, HEAD_DIM))
    got = decode(packed, "nvfp4", HEAD_DIM, GLOBAL_SCALE, tables, torch.float32)
    seen["nvfp4 float32 = numpy"] = same(got, numpy_rows)
    return seen


def check_fp8(device: torch.device, decode: Decode = decode_packed_rows) -> dict[str, bool]:
    tables = torch_tables(device)
    codes = np.resize(np.arange(256, dtype=np.uint8), (8, HEADS, HEAD_DIM))
    packed = torch.from_numpy(np.ascontiguousarray(codes)).to(device)
    seen = {}
    for name, dtype in DTYPES.items():
        want = packed.view(torch.float8_e4m3fn).to(dtype)
        seen[f"fp8 {name}"] = same(decode(packed, "fp8", HEAD_DIM, 1.0, tables, dtype), want)
    return seen


def check_row_ids(device: torch.device) -> dict[str, bool]:
    """row_ids_torch on the device against numpy's row_ids: 32,768 tokens of the real
    geometry in four requests, 200 of them EOS (tests/pkg/test_gpu.py runs it as a test)."""
    geometry = PLEGeometry.from_config(make_config(vocab_base=20_000_000))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, geometry.vocab_size, size=32_768)
    ids[rng.integers(0, ids.size, size=200)] = geometry.eos_token_id
    qsl = np.array([0, 5, 2048, 30_000, 32_768])
    ctx = rng.integers(0, geometry.vocab_size, size=(4, 2))
    ids_t, qsl_t, ctx_t = (torch.from_numpy(a).to(device) for a in (ids, qsl, ctx))
    got = row_ids_torch(ids_t, qsl_t, ctx_t, geometry)
    want = row_ids(ids, qsl, ctx, geometry)
    return {"row ids": got.device.type == device.type and np.array_equal(got.cpu().numpy(), want)}


def median_us(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) * 1e6)
    return round(statistics.median(samples), 1)


def check_step(device: torch.device, tokens: int) -> tuple[dict[str, bool], dict]:
    """Staging, event, upload into the persistent buffer, and the decode as one captured graph
    replayed with new rows (eagerly on the CPU); each replay's values against the torch decode
    of what was staged."""
    cuda = device.type == "cuda"
    tables = torch_tables(device)
    staging = torch.zeros((tokens, HEADS, ROW_BYTES), dtype=torch.uint8, pin_memory=cuda)
    persistent = torch.zeros((tokens, HEADS, ROW_BYTES), dtype=torch.uint8, device=device)

    def device_half() -> torch.Tensor:
        return decode_packed_rows(
            persistent, "nvfp4", HEAD_DIM, GLOBAL_SCALE, tables, torch.bfloat16
        )

    def upload() -> None:
        persistent.copy_(staging, non_blocking=cuda)
        if cuda:  # the backend hands a staging slot out again only after this event
            done = torch.cuda.Event()
            done.record()

    replay: Callable[[], torch.Tensor] = device_half
    if cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            device_half()  # warm-up: the kernel compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = device_half()

        def replay() -> torch.Tensor:
            graph.replay()
            return captured

    seen, previous = [], None
    for step in range(REPLAYS):
        staging.copy_(torch.from_numpy(every_byte_rows(tokens, seed=10 + step)))
        upload()
        out = replay()
        if cuda:
            torch.cuda.synchronize()
        want = dequantize_rows_torch(
            staging.to(device), GLOBAL_SCALE, HEAD_DIM, dtype=torch.bfloat16, tables=tables
        )
        fresh = previous is None or not same(out, previous)
        seen.append(same(out, want) and fresh)
        previous = out.clone()
    repeats = 50 if cuda else 1
    figures = {
        "tokens": tokens,
        "decode_us": median_us(device_half, device, repeats),
        "upload_us": median_us(upload, device, repeats),
        "replay_us": median_us(replay, device, repeats),
    }
    return {f"replay {i} with new rows": ok for i, ok in enumerate(seen)}, figures


def main() -> int:
    device = torch.device(sys.argv[1])
    result_path = Path(sys.argv[2])
    checks: dict[str, bool] = {}
    checks.update(check_nvfp4(device))
    checks.update(check_fp8(device))
    checks.update(check_row_ids(device))
    # 256 tokens on the device; fewer under the CPU's interpreter (every byte still occurs)
    step_checks, figures = check_step(device, 256 if device.type == "cuda" else 16)
    checks.update(step_checks)
    failed = [name for name, ok in checks.items() if not ok]
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke mode)"
    graph = "a CUDA graph" if device.type == "cuda" else "eagerly (no CUDA graph on the CPU)"
    summary = [
        f"torch tier ({where}, torch {torch.__version__}): "
        + (f"all {len(checks)} checks passed" if not failed else "FAILED: " + ", ".join(failed)),
        f"  {figures['tokens']} tokens: fused decode {figures['decode_us']} us, upload "
        f"{figures['upload_us']} us, replay {figures['replay_us']} us ({graph})",
    ]
    result = {"ok": not failed, "failed": failed, "checks": checks, "figures": figures}
    result_path.write_text(json.dumps({**result, "summary": summary}, indent=2) + "\n")
    print("\n".join(summary))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
