"""bench/disk_offload_compare.py's two arms inside the vLLM venv: vLLM 0.34's disk offload layer
and sparkple's packed-table layer, their model states, and how each step is timed and read back."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

from disk_offload_pagecache import evict_files, resident_bytes


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
