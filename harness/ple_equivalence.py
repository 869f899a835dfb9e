"""Run inside the vLLM test venv: stock vLLM PLE vs the patched packed-table backend.

Usage: python ple_equivalence.py DEVICE RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE_DIR [...]

Builds vLLM 0.33.0's own `Qwen4ExpNGramEmbedding` from a synthetic checkpoint twice, loading
its weights through vLLM's own safetensors iterator: with the stock device backend (rows loaded
into a tensor), and with the rendered patch files laid over the package (as the bind mounts do
in the serving container) and SPARKPLE_PLE_TABLE_DIR naming the table built from the same
checkpoint. Each step runs as vLLM's V2 runner runs it: vLLM's own (patched)
`Qwen4ExpModelState.prepare_inputs` builds the PLE inputs from the request state and runs the
host step, then the forward reads the layer's device buffer. Writes what it observed, per
checkpoint quantization, to RESULT_JSON; the pytest side asserts on it.

Its parts: harness.ple_layer (vLLM's set-up and the layer), harness.ple_steps (the runner's
steps and their schedule), harness.ple_faults (failures, the host step's checks, refusals).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from harness.ple_faults import failures, host_checks, refusals
from harness.ple_layer import (
    DEVICE,
    MAX_TOKENS,
    NGRAM_MODULE,
    PLE_DECODER_LAYER,
    as_tensors,
    build,
    counters,
    disk_offload_layer,
    disk_offload_step,
    forward,
    in_forward,
    kernel_order_step,
    model_state,
    patched_modules,
    resident_bytes,
    seed_loader_filter,
    vllm_context,
)
from harness.ple_steps import Runner, schedule


def compare(stock_module, patched, state_module, snapshot: Path, table_dir: Path) -> dict:
    from transformers import Qwen4ExpTextConfig

    from sparkple.geometry import PLEGeometry
    from sparkple.runtime.ngram import row_ids

    result: dict = {}
    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    geometry = PLEGeometry.from_config(raw)
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    eos, vocab = int(config.eos_token_id), int(config.vocab_size)
    nvfp4 = raw["text_config"]["ple_embedding_dtype"] == "nvfp4"
    result["quant"] = "nvfp4" if nvfp4 else "fp8"
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}

    def shard_reads(layer) -> int:
        return sum(".ngram_embedding.shard_" in name for name in layer.materialized)

    os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)
    stock_layers = {
        k: build(stock_module, config, snapshot, prefix, d)[0] for k, d in dtypes.items()
    }
    stock_layer = stock_layers["float32"]
    result["stock_backend"] = type(stock_layer.ngram_embedding).__name__
    # vLLM 0.34's own disk offload, a second reference (none in 0.33)
    disk_layers = {
        k: disk_offload_layer(stock_module, config, snapshot, prefix, d) for k, d in dtypes.items()
    }
    disk_layers = {k: layer for k, layer in disk_layers.items() if layer is not None}
    result["disk_offload"] = bool(disk_layers)
    result["stock_resident_bytes"] = resident_bytes(stock_layer)
    result["stock_load_rss_growth"] = stock_layer.load_rss_growth
    result["stock_shard_tensors_read"] = shard_reads(stock_layer)

    # sparkple.runtime.ngram against vLLM's own compute_ngram_ids, random batches
    rng = np.random.default_rng(3)
    mismatched = 0
    for _ in range(50):
        lengths = rng.integers(1, 40, size=rng.integers(1, 6))
        tokens = rng.integers(0, vocab, size=int(lengths.sum()))
        tokens[rng.random(tokens.shape[0]) < rng.random() * 0.3] = eos
        starts = np.concatenate([[0], np.cumsum(lengths)])
        context = rng.integers(0, vocab, size=(len(lengths), 2))
        context[rng.random(context.shape) < 0.3] = eos
        their_ids = stock_layer.compute_ngram_ids(*as_tensors(tokens, starts, context))
        our_ids = row_ids(tokens, starts, context, geometry)
        mismatched += int(not np.array_equal(their_ids.cpu().numpy(), our_ids))
    result["ngram_trials"] = 50
    result["ngram_mismatched"] = mismatched

    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    patched_built = {k: build(patched, config, snapshot, prefix, d) for k, d in dtypes.items()}
    patched_layers = {k: layer for k, (layer, _) in patched_built.items()}
    result["patched_module_file"] = patched.__file__
    layer, loaded = patched_built["float32"]
    embedding = layer.ngram_embedding
    result["patched_backend"] = type(embedding).__name__
    result["patched_loaded"] = sorted(loaded)
    result["patched_weight_devices"] = sorted(
        {embedding.weight.device.type} | ({embedding.weight_scale.device.type} if nvfp4 else set())
    )
    # the backend's own per-step buffers (rows of one step, decode tables) apart from the table
    step_buffers = sum(b.numel() * b.element_size() for b in embedding.buffers())
    result["patched_step_buffer_bytes"] = step_buffers
    result["patched_resident_bytes"] = resident_bytes(layer) - step_buffers
    result["patched_load_rss_growth"] = layer.load_rss_growth
    result["patched_shard_tensors_read"] = shard_reads(layer)
    result["patched_tensors_read"] = sorted(
        name[len(prefix) :] for name in layer.materialized if name.startswith(prefix)
    )
    result["table_bytes"] = int(embedding.table.meta.data_bytes)
    result["table_advice"] = embedding.table.advice
    scale = embedding.weight_scale_2 if nvfp4 else embedding.weight_scale
    result["global_scale_loaded"] = float(scale.reshape(-1)[0])
    result["global_scale_table"] = float(embedding.table.meta.global_scale)
    result["buffers_equal"] = all(
        torch.equal(getattr(layer, name), getattr(stock_layer, name))
        for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    )

    # constructed where vLLM would build it on another device: host buffers stay on the CPU
    with torch.device("meta"):
        meta_layer = patched.Qwen4ExpNGramEmbedding(
            config,
            int(config.ple_embed_dim),
            0,
            MAX_TOKENS,
            data_parallel_rank=0,
            prefix=prefix.rstrip("."),
            params_dtype=torch.float32,
        )
    meta = meta_layer.ngram_embedding
    result["meta_device_buffers"] = sorted({b.device.type for b in meta.buffers()})
    host = [*meta._inputs.all, torch.from_numpy(meta._worker.staging)]
    result["meta_host_buffers"] = sorted({t.device.type for t in host})
    meta.close()

    # every step through vLLM's model state: its prepare_inputs runs the host step
    state = model_state(state_module, torch.nn.ModuleList(patched_layers.values()), config)
    runner = Runner(state)
    steps: dict[str, list] = {k: [] for k in dtypes}
    disk_steps: dict[str, list] = {k: [] for k in disk_layers}
    result["compiled_steps"] = {}
    result["synced_steps"] = []
    for name, scheduled, padding in schedule(runner, vocab, eos):
        input_ids, qsl, ctx, real = runner.step(scheduled, **padding)
        # whether the host step waited for the device's copy of the inputs
        result["synced_steps"].append(state.model._sparkple_host_step.last_synced)
        # the device would run the step now: the lookahead advises meanwhile
        for layer in patched_layers.values():
            layer.ngram_embedding._lookahead.idle()
        for key, dtype in dtypes.items():
            ours = forward(patched_layers[key], input_ids, qsl, ctx)
            theirs = forward(stock_layers[key], input_ids, qsl, ctx)
            kernel = (
                kernel_order_step(stock_layers[key], input_ids, qsl, ctx).to(dtype)
                if nvfp4
                else theirs
            )
            steps[key].append((name, ours[:real], theirs[:real], kernel[:real], ours[real:]))
            if key in disk_layers:
                disk = disk_offload_step(stock_module, disk_layers[key], input_ids, qsl, ctx)
                # NVFP4: both decoded in the order of vLLM's CUDA kernel; FP8: as the layer reads
                disk_steps[key].append((name, ours[:real], disk[:real], kernel[:real]))
        if name in ("mixed prefill", "uniform decode"):
            # the in-forward path under torch.compile(fullgraph=True), on a prefill-shaped
            # and a decode-shaped step: any graph break or host synchronization raises
            torch._dynamo.reset()
            compiled_steps = result["compiled_steps"][name] = []
            for key in dtypes:
                emb = patched_layers[key].ngram_embedding
                compiled = torch.compile(in_forward, fullgraph=True, backend="eager")
                eager = in_forward(emb, input_ids.shape[0])
                compiled_steps.append(bool(torch.equal(compiled(emb, input_ids.shape[0]), eager)))
    for key in dtypes:
        done = steps[key]
        result[f"{key}_steps"] = len(done)
        result[f"{key}_identical"] = [bool(torch.equal(o, t)) for _, o, t, _, _ in done]
        result[f"{key}_identical_to_kernel_order"] = [
            bool(torch.equal(o, k)) for _, o, _, k, _ in done
        ]
        result[f"{key}_max_abs_diff"] = max(
            float((o.float() - t.float()).abs().max()) for _, o, t, _, _ in done
        )
        result[f"{key}_max_rel_diff"] = max(
            float(((o.float() - t.float()).abs() / t.float().abs().clamp_min(1e-30)).max())
            for _, o, t, _, _ in done
        )
        result[f"{key}_nonzero"] = all(bool(t.abs().sum() > 0) for _, _, t, _, _ in done)
        result[f"{key}_padding_rows_zero"] = all(
            bool((p.float() == 0).all()) for *_, p in done
        ) and any(p.shape[0] > 0 for *_, p in done)
        whole = [o for n, o, _, _, _ in done if n == "whole"]
        chunked = torch.cat([o for n, o, _, _, _ in done if n == "chunked"])
        stock_whole = [t for n, _, t, _, _ in done if n == "whole"]
        stock_chunked = torch.cat([t for n, _, t, _, _ in done if n == "chunked"])
        result[f"{key}_chunked_equals_whole"] = bool(
            torch.equal(whole[0], chunked) and torch.equal(stock_whole[0], stock_chunked)
        )
    for key, done in disk_steps.items():
        result[f"{key}_disk_identical"] = [bool(torch.equal(o, d)) for _, o, d, _ in done]
        result[f"{key}_disk_equals_stock"] = [bool(torch.equal(d, k)) for _, _, d, k in done]
        result[f"{key}_disk_nonzero"] = all(bool(d.abs().sum() > 0) for _, _, d, _ in done)
    result["step_names"] = [n for n, *_ in steps["float32"]]
    # the lookahead of both layers: what it advised, what steps used, what a removal wasted
    for layer in patched_layers.values():
        layer.ngram_embedding._lookahead.idle()
    emb = patched_layers["float32"].ngram_embedding
    done = emb._stats.snapshot()["counters"]
    result["lookahead"] = {
        "advised": done["lookahead_pages_advised"],
        "used": done["lookahead_pages_used"],
        "wasted": done["lookahead_pages_wasted"],
        "peak_pages": emb._lookahead.peak_outstanding_pages,
        "window_pages": emb._lookahead.window_pages,
        "prompts_held": sorted(state.model._sparkple_host_step.slots),
    }

    # dummy, profile and capture runs: zeros, no table row read, no wait
    emb = patched_layers["float32"].ngram_embedding
    before = counters(emb)
    dummy_inputs = state.prepare_dummy_inputs(4, 64)
    zeros = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    dummy_out = [
        forward(
            patched_layers["float32"],
            zeros,
            dummy_inputs["query_start_loc"],
            dummy_inputs["ngram_context"],
        )
    ]
    input_ids, qsl, ctx, _ = runner.step([("r0", 0, 16), ("r1", 0, 16)], dummy=True)
    dummy_out.append(forward(patched_layers["float32"], input_ids, qsl, ctx))
    result["dummy_outputs_zero"] = [bool((out == 0).all()) for out in dummy_out]
    result["dummy_counters_before_after"] = [before, counters(emb)]

    for layer in patched_layers.values():
        layer.ngram_embedding.close()

    # the patched files without the env var: vLLM's own backend, as before
    os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    unset, _ = build(patched, config, snapshot, prefix, torch.float32)
    result["patched_unset_backend"] = type(unset.ngram_embedding).__name__
    result["patched_unset_shard_tensors_read"] = shard_reads(unset)
    # a directory that holds no table: a clear error, no silent fallback
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(snapshot.parent / "no-table-here")
    try:
        build(patched, config, snapshot, prefix, torch.float32)
        result["missing_table_error"] = None
    except Exception as exc:
        result["missing_table_error"] = f"{type(exc).__name__}: {exc}"
    os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    result["device"] = DEVICE.type
    return result


def main() -> None:
    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    cases = [tuple(map(Path, arg.split("=", 1))) for arg in sys.argv[4:]]
    seed_loader_filter(rendered)
    results = {}
    with tempfile.TemporaryDirectory() as work, vllm_context(Path(work)):
        stock_module = importlib.import_module(NGRAM_MODULE)
        patched, state_module = patched_modules(rendered)
        for snapshot, table_dir in cases:
            result = compare(stock_module, patched, state_module, snapshot, table_dir)
            results[result["quant"]] = result
        snapshot, table_dir = cases[0]
        results["refusals"] = refusals(patched, snapshot, table_dir)
        results["failures"] = failures(patched, state_module, snapshot, table_dir)
        results["host_checks"] = host_checks(
            stock_module, patched, state_module, snapshot, table_dir
        )
    result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
