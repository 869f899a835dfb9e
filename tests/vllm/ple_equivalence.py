"""Run inside the vLLM test venv: stock vLLM PLE vs the patched packed-table backend.

Usage: python ple_equivalence.py DEVICE RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE_DIR [...]

Builds vLLM 0.33.0's own `Qwen4ExpNGramEmbedding` from a synthetic checkpoint twice: with the
stock device backend (rows loaded into a tensor), and with the rendered patch files laid over
the package (as the bind mounts do in the serving container) and VLLM_PLE_PACKED_TABLE_DIR
naming the table built from the same checkpoint. Writes what it observed, per checkpoint
quantization, to RESULT_JSON; the pytest side asserts on it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

MAX_TOKENS = 512
PLE_DECODER_LAYER = 1  # ple_layer_ids [2] is one-based
# "cpu" (CI) or "cuda" (where vLLM's Triton kernels and the pinned-staging copy run)
DEVICE = torch.device(sys.argv[1])
NGRAM_MODULE = "vllm.models.qwen4_exp.nvidia.ngram_embedding"


@contextmanager
def vllm_context(workdir: Path) -> Iterator[None]:
    """The least of vLLM's setup these modules need: a config and world-size-1 groups (gloo)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=DEVICE.type))):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{workdir / 'dist-init'}",
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        yield


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def checkpoint_weights(snapshot: Path, prefix: str, peak: dict):
    """(name relative to the PLE module, tensor) pairs, read lazily like vLLM's loader.

    safetensors maps each file; a tensor's pages enter RSS only when something reads them.
    peak["rss"] records the most RSS grew while the loader held a tensor.
    """
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    by_file: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        if name.startswith(prefix):
            by_file.setdefault(file, []).append(name)
    base = rss_bytes()
    peak["rss"] = 0
    for file, names in sorted(by_file.items()):
        with safe_open(str(snapshot / file), framework="pt") as handle:
            for name in names:
                yield name[len(prefix) :], handle.get_tensor(name)
                # the consumer is done with this tensor; it is still referenced here
                peak["rss"] = max(peak["rss"], rss_bytes() - base)


def build(module, config, snapshot: Path, prefix: str, dtype: torch.dtype):
    with DEVICE:
        layer = module.Qwen4ExpNGramEmbedding(
            config,
            int(config.ple_embed_dim),
            0,  # ple_dense_layer_id: the model's first (and only) PLE layer
            MAX_TOKENS,
            data_parallel_rank=0,
            prefix=prefix.rstrip("."),
            params_dtype=dtype,
        )
    peak: dict = {}
    loaded = layer.load_weights(checkpoint_weights(snapshot, prefix, peak))
    embedding = layer.ngram_embedding
    embedding.embedding_method.process_weights_after_loading(embedding)
    layer.load_rss_growth = peak["rss"]
    return layer, loaded


def run(layer, input_ids, query_start_loc, ngram_context) -> torch.Tensor:
    """One forward step of the PLE module, as the model runs it (prefetch one layer early)."""
    hidden = torch.empty(input_ids.shape[0], 0, device=DEVICE)
    layer.start_prefetch(input_ids, query_start_loc, ngram_context)
    rows = layer(hidden, input_ids, query_start_loc, ngram_context)
    # what vLLM's PLE layer does next: FP8 rows get their scale, NVFP4 rows are decoded already
    return layer.ngram_embedding.dequantize(rows, layer.ngram_embedding.params_dtype)


def make_batches(vocab: int, eos: int, seed: int):
    """Multi-request batches with EOS inside requests and contexts from earlier chunks."""
    rng = np.random.default_rng(seed)
    batches = []
    for lengths in ([1, 7, 30, 50], [1, 1, 1, 1, 1], [120], [3, 64, 2]):
        tokens = rng.integers(0, vocab, size=sum(lengths))
        tokens[rng.random(tokens.shape[0]) < 0.1] = eos
        starts = np.concatenate([[0], np.cumsum(lengths)])
        context = rng.integers(0, vocab, size=(len(lengths), 2))
        context[rng.random(context.shape) < 0.3] = eos
        batches.append((tokens, starts, context))
    return batches


def chunked_sequence(vocab: int, eos: int, seed: int, length: int = 300):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, size=length)
    tokens[rng.random(length) < 0.05] = eos
    tokens[[40, 41, 128]] = eos  # back-to-back EOS and one at a chunk boundary
    return tokens


def as_step(tokens, starts, context):
    return tuple(
        torch.as_tensor(np.asarray(x), dtype=torch.int64, device=DEVICE)
        for x in (tokens, starts, context)
    )


def outputs_for(layer, batches, sequence, eos: int) -> list[torch.Tensor]:
    results = [run(layer, *as_step(*batch)) for batch in batches]
    # one request in chunks (prefill 128, 128, then decode steps of one token)
    whole = run(layer, *as_step(sequence, [0, len(sequence)], [[eos, eos]]))
    pieces, position = [], 0
    for size in [128, 128] + [1] * (len(sequence) - 256):
        chunk = sequence[position : position + size]
        before = [eos, eos] + list(sequence[:position])
        pieces.append(run(layer, *as_step(chunk, [0, size], [before[-2:]])))
        position += size
    results.append(whole)
    results.append(torch.cat(pieces))
    return results


def kernel_order_step(layer, input_ids, query_start_loc, ngram_context) -> torch.Tensor:
    """The stock layer's rows decoded in the order of vLLM's CUDA lookup kernel.

    vLLM 0.33 multiplies (E2M1 x block scale) x global scale in its CUDA kernel but
    E2M1 x (block scale x global scale) on CPU; in float32 the two can differ in the last bit.
    This applies the kernel's order to the stock layer's own rows, with vLLM's nibble decoder.
    """
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import (
        break_fp4_bytes,
    )

    ids = layer.compute_ngram_ids(input_ids, query_start_loc, ngram_context).reshape(-1)
    table = layer.ngram_embedding
    e2m1 = break_fp4_bytes(table.weight[ids], torch.float32)
    blocks = e2m1.reshape(ids.shape[0], -1, 16) * table.weight_scale[ids].float().unsqueeze(-1)
    rows = blocks * table.weight_scale_2.float().reshape(())
    return rows.reshape(input_ids.shape[0], -1)


def resident_bytes(layer) -> int:
    tensors = list(layer.parameters()) + list(layer.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")


def patched_module(rendered: Path):
    """The patched files laid over the package, as the container's bind mounts do."""
    for package in ("vllm.models.qwen4_exp.nvidia", "vllm.models.qwen4_exp.common"):
        sub = package.split(".", 1)[1].replace(".", "/")
        importlib.import_module(package).__path__.insert(0, str(rendered / sub))
    sys.modules.pop(NGRAM_MODULE)
    return importlib.import_module(NGRAM_MODULE)


def compare(stock_module, patched, snapshot: Path, table_dir: Path, work: Path) -> dict:
    from transformers import Qwen4ExpTextConfig

    from sparkple.geometry import PLEGeometry
    from sparkple.ngram import row_ids

    result: dict = {}
    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    geometry = PLEGeometry.from_config(raw)
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    eos, vocab = int(config.eos_token_id), int(config.vocab_size)
    nvfp4 = raw["text_config"]["ple_embedding_dtype"] == "nvfp4"
    result["quant"] = "nvfp4" if nvfp4 else "fp8"
    batches = make_batches(vocab, eos, seed=1)
    sequence = chunked_sequence(vocab, eos, seed=2)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}

    os.environ.pop("VLLM_PLE_PACKED_TABLE_DIR", None)
    stock_layers = {k: build(stock_module, config, snapshot, prefix, d) for k, d in dtypes.items()}
    stock = {
        k: outputs_for(layer, batches, sequence, eos) for k, (layer, _) in stock_layers.items()
    }
    stock_layer = stock_layers["float32"][0]
    result["stock_backend"] = type(stock_layer.ngram_embedding).__name__
    result["stock_resident_bytes"] = resident_bytes(stock_layer)
    result["stock_load_rss_growth"] = stock_layer.load_rss_growth

    # sparkple.ngram against vLLM's own compute_ngram_ids, random batches
    rng = np.random.default_rng(3)
    mismatched = 0
    for _ in range(50):
        lengths = rng.integers(1, 40, size=rng.integers(1, 6))
        tokens = rng.integers(0, vocab, size=int(lengths.sum()))
        tokens[rng.random(tokens.shape[0]) < rng.random() * 0.3] = eos
        starts = np.concatenate([[0], np.cumsum(lengths)])
        context = rng.integers(0, vocab, size=(len(lengths), 2))
        context[rng.random(context.shape) < 0.3] = eos
        theirs = stock_layer.compute_ngram_ids(*as_step(tokens, starts, context)).cpu().numpy()
        ours = row_ids(tokens, starts, context, geometry)
        mismatched += int(not np.array_equal(theirs, ours))
    result["ngram_trials"] = 50
    result["ngram_mismatched"] = mismatched

    os.environ["VLLM_PLE_PACKED_TABLE_DIR"] = str(table_dir)
    patched_layers = {k: build(patched, config, snapshot, prefix, d) for k, d in dtypes.items()}
    result["patched_module_file"] = patched.__file__
    layer, loaded = patched_layers["float32"]
    embedding = layer.ngram_embedding
    result["patched_backend"] = type(embedding).__name__
    result["patched_loaded"] = sorted(loaded)
    result["patched_weight_devices"] = sorted(
        {embedding.weight.device.type} | ({embedding.weight_scale.device.type} if nvfp4 else set())
    )
    result["patched_resident_bytes"] = resident_bytes(layer)
    result["patched_load_rss_growth"] = layer.load_rss_growth
    result["table_bytes"] = int(embedding.table.meta.data_bytes)
    result["table_advice"] = embedding.table.advice
    scale = embedding.weight_scale_2 if nvfp4 else embedding.weight_scale
    result["global_scale_loaded"] = float(scale.reshape(-1)[0])
    result["global_scale_table"] = float(embedding.table.meta.global_scale)
    result["buffers_equal"] = all(
        torch.equal(getattr(layer, name), getattr(stock_layer, name))
        for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
    )
    patched_out = {
        k: outputs_for(layer, batches, sequence, eos) for k, (layer, _) in patched_layers.items()
    }
    for name in dtypes:
        pairs = list(zip(stock[name], patched_out[name], strict=True))
        result[f"{name}_steps"] = len(pairs)
        result[f"{name}_identical"] = [bool(torch.equal(a, b)) for a, b in pairs]
        result[f"{name}_max_abs_diff"] = max(
            float((a.float() - b.float()).abs().max()) for a, b in pairs
        )
        result[f"{name}_shapes_equal"] = all(a.shape == b.shape for a, b in pairs)
        result[f"{name}_nonzero"] = all(bool(a.abs().sum() > 0) for a, _ in pairs)
    if nvfp4:
        # float32: bit-exact with vLLM's CUDA kernel order, one rounding from its CPU path
        reference = [kernel_order_step(stock_layer, *as_step(*batch)) for batch in batches]
        pairs = list(zip(reference, patched_out["float32"][: len(reference)], strict=True))
        result["float32_identical_to_kernel_order"] = [bool(torch.equal(a, b)) for a, b in pairs]
    result["float32_max_rel_diff_to_cpu_path"] = max(
        float(((a - b).abs() / a.abs().clamp_min(1e-30)).max())
        for a, b in zip(stock["float32"], patched_out["float32"], strict=True)
    )
    # chunked == whole, within each path
    result["chunked_equals_whole"] = bool(
        torch.equal(patched_out["float32"][-1], patched_out["float32"][-2])
        and torch.equal(stock["float32"][-1], stock["float32"][-2])
    )
    for layer, _ in patched_layers.values():
        layer.ngram_embedding.close()

    # the patched files without the env var: vLLM's own backend, as before
    os.environ.pop("VLLM_PLE_PACKED_TABLE_DIR")
    unset, _ = build(patched, config, snapshot, prefix, torch.float32)
    result["patched_unset_backend"] = type(unset.ngram_embedding).__name__
    # a directory that holds no table: a clear error, no silent fallback
    os.environ["VLLM_PLE_PACKED_TABLE_DIR"] = str(work / "no-table-here")
    try:
        build(patched, config, snapshot, prefix, torch.float32)
        result["missing_table_error"] = None
    except Exception as exc:
        result["missing_table_error"] = f"{type(exc).__name__}: {exc}"
    os.environ.pop("VLLM_PLE_PACKED_TABLE_DIR")
    result["device"] = DEVICE.type
    return result


def main() -> None:
    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    cases = [tuple(map(Path, arg.split("=", 1))) for arg in sys.argv[4:]]
    results = {}
    with tempfile.TemporaryDirectory() as work, vllm_context(Path(work)):
        stock_module = importlib.import_module(NGRAM_MODULE)
        patched = patched_module(rendered)
        for snapshot, table_dir in cases:
            result = compare(stock_module, patched, snapshot, table_dir, Path(work))
            results[result["quant"]] = result
    result_path.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
