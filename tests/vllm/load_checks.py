"""Run inside the vLLM test venv: what the patched loader reads and checks at start.

Usage: python load_checks.py cpu RENDERED_DIR RESULT_JSON SNAPSHOT=TABLE [SNAPSHOT=TABLE ...]

1. The table against the checkpoint at load: each SNAPSHOT=TABLE pair is loaded through
   vLLM's own load_weights and process_weights_after_loading (what vLLM's loader runs before
   it profiles), with every rendered file laid over the package; records whether the start
   stopped there and with which message.
2. Load settings: the patched layer is constructed under each load setting vLLM (0.33, 0.34) offers
   (format, safetensors strategy, multi-thread loading), recording what it refuses.
3. Row-shard bytes per strategy: the first snapshot's files are evicted from the page cache,
   vLLM's own safetensors iterator (the loader's path for safetensors) runs with the patched
   per-name skip, and the pages of the row-shard tensors that are then cached are counted
   (mincore), with the row-shard tensors the iterator handed out and the bytes the process
   read with read() calls.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.ple_layer import (
    LOADER_FILTER,
    MAX_TOKENS,
    NGRAM_MODULE,
    PLE_DECODER_LAYER,
    build,
    config_fields,
    seed_loader_filter,
    vllm_context,
)
from sparkple.runtime.pagecache import PAGE_SIZE, evict, resident_pages

ROW_SHARD = ".ple.ple_embedding.ngram_embedding.shard_"
PACKAGES = ("vllm.models.qwen4_exp.nvidia", "vllm.models.qwen4_exp.common")
PATCHED = (NGRAM_MODULE, "vllm.models.qwen4_exp.common.ngram_embedding")


def patched_ngram_module(rendered: Path):
    """vLLM's n-gram module with every rendered file over the package, none imported before."""
    for name in PATCHED:
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the patch was laid over it")
    for package in PACKAGES:
        sub = package.split(".", 1)[1].replace(".", "/")
        importlib.import_module(package).__path__.insert(0, str(rendered / sub))
    return importlib.import_module(NGRAM_MODULE)


def text_config(snapshot: Path):
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    return Qwen4ExpTextConfig(**raw["text_config"])


def load_with_table(module, snapshot: Path, table: Path) -> dict:
    """Load SNAPSHOT with TABLE as vLLM's loader does; where the start stops, and why."""
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table)
    try:
        layer, _ = build(module, text_config(snapshot), snapshot, prefix, torch.float32)
    except ValueError as exc:
        return {"stopped_at": "load", "error": str(exc)}
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    embedding = layer.ngram_embedding
    # checked at load: the host step finds the geometry already checked
    checked = embedding._geometry is not None
    embedding.close()
    return {"stopped_at": None, "checked_at_load": checked}


def load_setting(**fields):
    from vllm.config import get_current_vllm_config

    return config_fields(get_current_vllm_config().load_config, **fields)


LOAD_SETTINGS: dict[str, dict[str, Any]] = {
    "safetensors lazy": {"load_format": "safetensors", "safetensors_load_strategy": "lazy"},
    "auto lazy": {"load_format": "auto", "safetensors_load_strategy": "lazy"},
    "eager": {"safetensors_load_strategy": "eager"},
    "prefetch": {"safetensors_load_strategy": "prefetch"},
    "unset strategy": {"safetensors_load_strategy": None},
    "multithread": {"model_loader_extra_config": {"enable_multithread_load": True}},
    "fastsafetensors": {"load_format": "fastsafetensors"},
    "instanttensor": {"load_format": "instanttensor"},
    "pt": {"load_format": "pt"},
    "dummy": {"load_format": "dummy"},
}


def refusals(module, snapshot: Path, table: Path) -> dict:
    """The message each load setting gets at construction (None: accepted)."""
    config = text_config(snapshot)
    seen: dict[str, str | None] = {}
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table)
    try:
        for name, fields in LOAD_SETTINGS.items():
            with load_setting(**fields):
                try:
                    layer = module.Qwen4ExpNGramEmbedding(
                        config,
                        int(config.ple_embed_dim),
                        0,
                        MAX_TOKENS,
                        data_parallel_rank=0,
                        prefix="ple",
                        params_dtype=torch.float32,
                    )
                    layer.ngram_embedding.close()
                    seen[name] = None
                except ValueError as exc:
                    seen[name] = str(exc)
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    return seen


def tensor_ranges(path: Path) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """[start, end) in the file of what a lazy loader reads (the header and every tensor but
    the row shards), and of the row shards."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    read: list[tuple[int, int]] = [(0, base)]
    shards: list[tuple[int, int]] = []
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = entry["data_offsets"]
            (shards if ROW_SHARD in name else read).append((base + start, base + end))
    return read, shards


def read_ahead_bytes(path: Path) -> int:
    """The kernel's readahead window for the file's device (the largest one when unknown)."""
    dev = os.stat(path).st_dev
    bdi = Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")
    known = [bdi] if bdi.is_file() else sorted(Path("/sys/block").glob("*/queue/read_ahead_kb"))
    return max(int(p.read_text()) for p in known) * 1024


def page_mask(npages: int, ranges: list[tuple[int, int]], reach: int = 0) -> np.ndarray:
    mask = np.zeros(npages, dtype=bool)
    for start, end in ranges:
        mask[max(0, start - reach) // PAGE_SIZE : -(-(end + reach) // PAGE_SIZE)] = True
    return mask


def row_shard_bytes_read(snapshot: Path, table: Path, strategy: str) -> dict:
    """Row-shard bytes in the page cache after vLLM's iterator loaded a cold snapshot.

    The kernel reads ahead around whatever is read: row-shard pages within two readahead
    windows of the header or of another tensor are counted apart (near_read); the pages
    beyond them are cached only if the loader itself read the row shards.
    """
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(snapshot.glob("*.safetensors"))
    maps = []
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        if evict(mapped, fd) > 0:
            raise RuntimeError(f"{path} stays in the page cache; cannot measure cold")
        maps.append((path, fd, mapped))
    threads = set(threading.enumerate())
    handed_out = 0
    read_before = read_call_bytes()
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table)
    try:
        for name, tensor in safetensors_weights_iterator([str(p) for p in files], False, strategy):
            if ROW_SHARD in name:
                handed_out += tensor.numel() * tensor.element_size()
            del tensor
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    for thread in set(threading.enumerate()) - threads:
        # the prefetch strategy reads the files in a background thread; enumerate() also lists
        # a thread whose start() has not finished (on a loaded machine), which join() refuses
        while True:
            try:
                thread.join(60)
                break
            except RuntimeError:
                time.sleep(0.01)
    read_calls = read_call_bytes() - read_before
    figures = dict.fromkeys(("row_shard", "cached", "beyond_readahead", "cached_beyond"), 0)
    reach = 2 * max(read_ahead_bytes(path) for path in files)
    for path, fd, mapped in maps:
        read, shards = tensor_ranges(path)
        npages = -(-mapped.size // PAGE_SIZE)
        resident = resident_pages(mapped.ctypes.data, mapped.size)[:npages]
        shard = page_mask(npages, shards) & ~page_mask(npages, read)
        beyond = shard & ~page_mask(npages, read, reach)
        for key, mask in (
            ("row_shard", shard),
            ("cached", shard & resident),
            ("beyond_readahead", beyond),
            ("cached_beyond", beyond & resident),
        ):
            figures[key] += int(mask.sum()) * PAGE_SIZE
        os.close(fd)
    return {
        "read_ahead_bytes": reach // 2,
        **{f"{key}_bytes": value for key, value in figures.items()},
        "handed_out_bytes": handed_out,
        "read_call_bytes": read_calls,
        "file_bytes": sum(path.stat().st_size for path in files),
    }


def read_call_bytes() -> int:
    """Bytes this process (all its threads) has read with read() calls (/proc/self/io rchar):
    the kernel's own accounting, whatever the page cache keeps afterwards."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def main() -> None:
    rendered, result_path = Path(sys.argv[2]), Path(sys.argv[3])
    cases = [tuple(map(Path, arg.split("=", 1))) for arg in sys.argv[4:]]
    seed_loader_filter(rendered)
    if LOADER_FILTER not in sys.modules:
        raise RuntimeError("the patched loader filter is not in place")
    result: dict = {}
    with tempfile.TemporaryDirectory() as work, vllm_context(Path(work)):
        module = patched_ngram_module(rendered)
        result["at_load"] = [load_with_table(module, s, t) for s, t in cases]
        snapshot, table = cases[0]
        result["refusals"] = refusals(module, snapshot, table)
        result["bytes"] = {
            strategy: row_shard_bytes_read(snapshot, table, strategy)
            for strategy in ("lazy", "eager", "prefetch")
        }
    result_path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
