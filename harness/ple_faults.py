"""The patched PLE backend's failures and refusals, through vLLM's model state: a table I/O
error, a step timeout and a dead gather thread; the host step's checks of its own view against
the device's inputs; the settings the packed table cannot serve."""

from __future__ import annotations

import importlib
import json
import os
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from harness.ple_layer import (
    MAX_TOKENS,
    PLE_DECODER_LAYER,
    build,
    config_fields,
    forward,
    kernel_order_step,
    model_state,
)
from harness.ple_steps import Runner, request_tokens


class _FailingPrefetch:
    """Stands in for the page prefetch in the gather thread, to make a step fail."""

    def __init__(self, error: BaseException, delay_s: float = 0.0) -> None:
        self.error, self.delay_s = error, delay_s

    def prefetch(self, row_ids):
        time.sleep(self.delay_s)
        raise self.error


def failures(patched, state_module, snapshot: Path, table_dir: Path) -> dict:
    """A table I/O error, a step timeout and a dead gather thread end prepare_inputs with an
    exception (vLLM's engine then dies and is relaunched), each within its bound."""
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    cases = {
        "io_error": (_FailingPrefetch(OSError(5, "Input/output error")), 60.0),
        "timeout": (_FailingPrefetch(OSError(5, "late"), delay_s=2.0), 0.2),
        "dead_thread": (_FailingPrefetch(SystemExit()), 60.0),
    }
    seen: dict[str, dict | None] = {}
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    # these layers' counters stay out of the stats file the real steps' layer wrote
    stats_dir = os.environ.pop("SPARKPLE_STATS_DIR", None)
    try:
        for case, (prefetch, timeout_s) in cases.items():
            layer, _ = build(patched, config, snapshot, prefix, torch.float32)
            embedding = layer.ngram_embedding
            embedding._worker.prefetcher = prefetch
            embedding._timeout_s = timeout_s
            runner = Runner(model_state(state_module, torch.nn.ModuleList([layer]), config))
            runner.add("r0", request_tokens(int(config.vocab_size), int(config.eos_token_id), 1))
            started = time.monotonic()
            try:
                runner.step([("r0", 0, 16)])
                seen[case] = None
            except BaseException as exc:  # what vLLM's execute_model would see
                seen[case] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "seconds": round(time.monotonic() - started, 3),
                }
            embedding.close()
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
        if stats_dir is not None:
            os.environ["SPARKPLE_STATS_DIR"] = stats_dir
    return seen


# where the host step reads HOST_PROBES at each step
SETTINGS_MODULE = "sparkple.vllm.settings"


def host_checks(stock_module, patched, state_module, snapshot: Path, table_dir: Path) -> dict:
    """The host step's checks of its own view against the device's inputs, step by step: its
    rows (against the stock layer on the device's inputs, in vLLM's kernel order), whether it
    waited for the device, and the mismatches it counted.

    shifted_N: the host's computed-prefill count of prompt p is N tokens ahead of the device's
    from the second step on (a bookkeeping fault), beside a decoding request d0, then alone;
    unprobed: the same shift with the probes off (HOST_PROBES 0), the check this adds.
    moved: the device verifies fewer drafts of r0 than the host scheduled (its request
    boundaries moved), which the host sees in the boundaries it copies.
    """
    from transformers import Qwen4ExpTextConfig

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    prefix = f"model.language_model.layers.{PLE_DECODER_LAYER}.ple.ple_embedding."
    eos, vocab = int(config.eos_token_id), int(config.vocab_size)
    os.environ.pop("SPARKPLE_PLE_TABLE_DIR", None)
    stock, _ = build(stock_module, config, snapshot, prefix, torch.float32)
    backend: Any = importlib.import_module(SETTINGS_MODULE)  # its HOST_PROBES is set below
    probes = backend.HOST_PROBES

    def run(steps, requests, probes_on: bool = True) -> dict:
        layer, _ = build(patched, config, snapshot, prefix, torch.float32)
        state = model_state(state_module, torch.nn.ModuleList([layer]), config)
        runner = Runner(state)
        for req_id, seed, prompt_len, length in requests:
            runner.add(req_id, request_tokens(vocab, eos, seed=seed, length=length), prompt_len)
        backend.HOST_PROBES = probes if probes_on else 0
        out: dict = {"rows_right": [], "synced": [], "mismatches": []}
        try:
            for scheduled, kwargs in steps:
                input_ids, qsl, ctx, real = runner.step(scheduled, **kwargs)
                ours = forward(layer, input_ids, qsl, ctx)[:real]
                theirs = kernel_order_step(stock, input_ids, qsl, ctx)[:real]
                out["rows_right"].append(bool(torch.equal(ours, theirs)))
                out["synced"].append(state.model._sparkple_host_step.last_synced)
                counted = layer.ngram_embedding._stats.snapshot()["counters"]
                out["mismatches"].append(counted["host_device_mismatch"])
        finally:
            backend.HOST_PROBES = probes
            layer.ngram_embedding.close()
        return out

    def shifted(by: int) -> list:
        shift = {"host_shift": {"p": by}}
        return [
            ([("d0", 0, 32), ("p", 0, 64)], {}),
            ([("d0", 32, 1), ("p", 64, 64)], shift),
            ([("d0", 33, 1), ("p", 128, 64)], shift),
            ([("p", 192, 64)], shift),
        ]

    prompts = [("d0", 3, 32, 200), ("p", 4, 400, 400)]
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    stats_dir = os.environ.pop("SPARKPLE_STATS_DIR", None)  # out of the real steps' file
    try:
        result = {f"shifted_{by}": run(shifted(by), prompts) for by in (1, 4)}
        result["unprobed"] = run(shifted(1), prompts, probes_on=False)
        drafts = {"drafts": {"r0": 3, "r1": 3}}
        result["moved"] = run(
            [
                ([("r0", 0, 40), ("r1", 0, 50)], {}),
                ([("r0", 40, 1), ("r1", 50, 1)], {}),
                ([("r0", 41, 4), ("r1", 51, 4)], {**drafts, "device_counts": {"r0": 2}}),
                ([("r0", 43, 4), ("r1", 55, 4)], drafts),
            ],
            [("r0", 5, 40, 200), ("r1", 6, 50, 200)],
        )
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
        if stats_dir is not None:
            os.environ["SPARKPLE_STATS_DIR"] = stats_dir
    return result


def refusals(patched, snapshot: Path, table_dir: Path) -> dict:
    """Settings the packed table cannot serve are refused at construction, by name."""
    from transformers import Qwen4ExpTextConfig
    from vllm.config import get_current_vllm_config

    raw = json.loads((snapshot / "config.json").read_text())
    config = Qwen4ExpTextConfig(**raw["text_config"])
    current = get_current_vllm_config()
    parallel = current.parallel_config

    from vllm.config import EngramConfig

    across_dp = EngramConfig(cpu_offload=False, embedding_across_dp=True)
    cases: dict[str, AbstractContextManager] = {
        "pipeline": config_fields(parallel, pipeline_parallel_size=2),
        "prefill_context_parallel": config_fields(parallel, prefill_context_parallel_size=2),
        "tensor_parallel_4": config_fields(parallel, tensor_parallel_size=4),
        "sequence_parallel": config_fields(parallel, tensor_parallel_size=2, enable_hc_sp=True),
        "embedding_across_dp": config_fields(current, engram_config=across_dp),
    }
    if "disk_offload" in EngramConfig.__dataclass_fields__:
        # vLLM 0.34: its own disk offload beside the packed table (set after construction:
        # EngramConfig refuses it off CUDA)
        disk = EngramConfig(cpu_offload=False)
        object.__setattr__(disk, "disk_offload", True)
        cases["disk_offload"] = config_fields(current, engram_config=disk)
    else:
        # vLLM 0.33: its V1 runner never calls the model state's hooks (0.34 has no V1 runner)
        cases["v1_runner"] = mock.patch.dict(os.environ, {"VLLM_USE_V2_MODEL_RUNNER": "0"})
    messages: dict[str, str | None] = {}
    os.environ["SPARKPLE_PLE_TABLE_DIR"] = str(table_dir)
    try:
        for case, context in cases.items():
            with context:
                try:
                    patched.Qwen4ExpNGramEmbedding(
                        config,
                        int(config.ple_embed_dim),
                        0,
                        MAX_TOKENS,
                        data_parallel_rank=0,
                        prefix="ple",
                        params_dtype=torch.float32,
                    )
                    messages[case] = None
                except ValueError as exc:
                    messages[case] = str(exc)
    finally:
        os.environ.pop("SPARKPLE_PLE_TABLE_DIR")
    return messages
