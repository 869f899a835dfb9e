"""Run inside a CUDA venv with vLLM 0.33.0: the patched PLE layer under a captured CUDA graph.

Usage: python gpu_graph_check.py cuda RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE_DIR

With the rendered patch files laid over the package and a packed table built from SNAPSHOT:
1. builds the patched n-gram embedding (inside `with torch.device("cuda")`, as vLLM does) and
   stock vLLM's pinned-host one (`--engram-config cpu_offload=true`) from the same checkpoint;
2. runs vLLM's own Qwen4ExpModelState.prepare_dummy_inputs, then captures one FULL CUDA graph
   of the PLE lookup and decode for a padded decode batch, as vLLM captures its decode graphs;
3. replays it for several steps, each prepared by vLLM's prepare_inputs (which runs the host
   step: inputs to the host, row ids, gather, upload), and compares every replay with the
   stock pinned-host lookup of the same step;
4. times the host critical path before the forward (prepare_inputs, of which the gather wait)
   for 1, 8 and 2,048 tokens, cold (table pages evicted) and warm.
Writes the figures to RESULT_JSON and prints them; exit 1 when a replay differs.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from ple_equivalence import (
    DEVICE,
    MAX_REQS,
    NGRAM_MODULE,
    PLE_DECODER_LAYER,
    Runner,
    build,
    forward,
    model_state,
    patched_modules,
    seed_loader_filter,
    vllm_context,
)

MAX_TOKENS = 2048
MAX_MODEL_LEN = 8192
GRAPH_TOKENS = 8  # a padded decode batch: 5 requests, 3 padding tokens
REPLAYS = 6
REPEATS = 5


def step_timing(runner: Runner, embedding, scheduled, *, cold: bool) -> dict:
    """Median host critical path of prepare_inputs for one step shape."""
    totals, waits = [], []
    for _ in range(REPEATS):
        if cold:
            embedding.table.evict()
        before = embedding._stats.snapshot()["handshake_wait_seconds"]["sum"]
        torch.cuda.synchronize()
        started = time.perf_counter()
        runner.step(scheduled)
        totals.append(time.perf_counter() - started)
        waits.append(embedding._stats.snapshot()["handshake_wait_seconds"]["sum"] - before)
        torch.cuda.synchronize()  # the upload, then the next repetition
    return {
        "prepare_inputs_ms": round(statistics.median(totals) * 1e3, 3),
        "gather_wait_ms": round(statistics.median(waits) * 1e3, 3),
    }


def main() -> int:
    from transformers import Qwen4ExpTextConfig

    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    snapshot, table_dir = map(Path, sys.argv[4].split("=", 1))
    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    vocab, eos = int(config.vocab_size), int(config.eos_token_id)
    dtype = torch.bfloat16
    seed_loader_filter(rendered)
    result: dict = {"device": torch.cuda.get_device_name()}
    with (
        tempfile.TemporaryDirectory() as work,
        vllm_context(Path(work), MAX_TOKENS, MAX_MODEL_LEN, cpu_offload=True),
    ):
        stock_module = importlib.import_module(NGRAM_MODULE)
        patched, state_module = patched_modules(rendered)
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)
        stock, _ = build(stock_module, config, snapshot, prefix, dtype, MAX_TOKENS)
        result["stock_backend"] = type(stock.ngram_embedding).__name__
        os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
        layer, _ = build(patched, config, snapshot, prefix, dtype, MAX_TOKENS)
        embedding = layer.ngram_embedding
        result["patched_backend"] = type(embedding).__name__
        result["staging_pinned"] = bool(embedding._worker._pinned is not None)
        result["host_inputs_pinned"] = all(t.is_pinned() for t in embedding._host_inputs)
        state = model_state(state_module, torch.nn.ModuleList([layer]), config)
        runner = Runner(state, MAX_MODEL_LEN)
        rng = np.random.default_rng(5)
        for r in range(MAX_REQS):
            tokens = rng.integers(0, vocab, size=MAX_MODEL_LEN)
            tokens[rng.random(MAX_MODEL_LEN) < 0.05] = eos
            runner.add(f"r{r}", tokens)

        # capture, as vLLM does: dummy inputs first, then one FULL graph of the forward's part
        dummy = state.prepare_dummy_inputs(GRAPH_TOKENS, GRAPH_TOKENS)
        static_ids = torch.zeros(GRAPH_TOKENS, dtype=torch.int32, device=DEVICE)
        static_qsl, static_ctx = dummy["query_start_loc"], dummy["ngram_context"]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward(layer, static_ids, static_qsl, static_ctx)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = forward(layer, static_ids, static_qsl, static_ctx)
        result["captured_output_zero"] = bool((static_out == 0).all())

        replays = []
        previous: torch.Tensor | None = None
        for step in range(REPLAYS):
            scheduled = [(f"r{r}", 100 * step + r, 1) for r in range(5)]
            input_ids, qsl, ctx, real = runner.step(scheduled, pad_tokens=GRAPH_TOKENS - 5)
            # the runner's prepare_inputs fills the graph's input buffers in place
            static_ids.copy_(input_ids)
            assert (
                qsl.data_ptr() == static_qsl.data_ptr() and ctx.data_ptr() == static_ctx.data_ptr()
            )
            graph.replay()
            torch.cuda.synchronize()
            theirs = forward(stock, input_ids, qsl, ctx)
            replays.append(
                {
                    "identical": bool(torch.equal(static_out[:real], theirs[:real])),
                    "padding_zero": bool((static_out[real:] == 0).all()),
                    "rows_differ_from_previous": previous is None
                    or not torch.equal(static_out[:real], previous),
                }
            )
            previous = static_out[:real].clone()
        result["replays"] = replays

        timings = {}
        shapes = {
            1: [("r0", 4000, 1)],
            8: [(f"r{r}", 4000, 1) for r in range(8)],
            2048: [("r1", 0, 2048)],
        }
        for tokens, scheduled in shapes.items():
            timings[str(tokens)] = {
                "cold": step_timing(runner, embedding, scheduled, cold=True),
                "warm": step_timing(runner, embedding, scheduled, cold=False),
            }
        result["host_critical_path"] = timings
        embedding.close()
    result_path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    ok = all(
        r["identical"] and r["padding_zero"] and r["rows_differ_from_previous"] for r in replays
    )
    print("graph replays: " + ("all equal stock vLLM's pinned-host lookup" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
