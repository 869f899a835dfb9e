"""The packed table's settings in vLLM: the environment it reads, its constants, and the vLLM
settings it cannot serve (each refused at the layer's construction with the setting to change;
what only one release refuses is in releases.py).
"""

from __future__ import annotations

import os
from typing import Any

from vllm.config import VllmConfig

from .releases import release_problems

TABLE_DIR_ENV = "SPARKPLE_PLE_TABLE_DIR"
STEP_TIMEOUT_ENV = "SPARKPLE_PLE_STEP_TIMEOUT"
# The serving unit always sets SPARKPLE_PLE_STEP_TIMEOUT (vllm_service_step_timeout_s, its one
# knob); a run outside it (a test, a benchmark) waits this long.
UNSET_STEP_TIMEOUT_S = 300.0
# Tokens the lookahead advises at a time: 16 tokens are at most 512 pages (2 MiB).
LOOKAHEAD_GRANULE = 16
# How often the PLE counters are rewritten for the metrics exporter.
STATS_INTERVAL_S = 5.0
# The tensor-parallel sizes the packed table serves: one Spark, or a pair.
TP_SIZES = (1, 2)
# Prompt tokens a syncing step brings back from the device beside its own, one per prompt
# segment (its last): the host checks its prompt bookkeeping against them (host_step.HostStep).
HOST_PROBES = 4
# Safetensors loading that reads the row shards: only the lazy strategy of vLLM's (0.33 and
# 0.34) safetensors iterator asks the per-name skip before it reads a tensor.
ROW_SHARD_READING_STRATEGIES = {
    None: "the default prefetches every file into the page cache on NFS and Lustre",
    "eager": "reads each whole file, then filters the names",
    "prefetch": "reads every file into the page cache",
    "torchao": "is for torchao checkpoints",
}


def step_timeout_s() -> float:
    """Seconds a step waits for its rows: SPARKPLE_PLE_STEP_TIMEOUT (UNSET_STEP_TIMEOUT_S unset)."""
    raw = os.environ.get(STEP_TIMEOUT_ENV, "").strip()
    if not raw:
        return UNSET_STEP_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{STEP_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{STEP_TIMEOUT_ENV} must be positive, got {raw!r}")
    return value


def unsupported_settings(config: VllmConfig) -> list[str]:
    """The vLLM settings a packed table cannot serve, each with the setting to change."""
    parallel = config.parallel_config
    engram = config.engram_config
    problems = release_problems(config)
    # vLLM 0.33's model state refuses it too; 0.34's no longer does
    if parallel.pipeline_parallel_size > 1:
        problems.append(
            f"--pipeline-parallel-size {parallel.pipeline_parallel_size}: the packed table "
            "splits its rows over the TP group and runs its host step where the PLE layer "
            "runs, on every rank; a pipeline puts the layers on different ranks (a pair is "
            "--tensor-parallel-size 2)"
        )
    if parallel.tensor_parallel_size not in TP_SIZES:
        problems.append(
            f"--tensor-parallel-size {parallel.tensor_parallel_size}: the packed table serves "
            "one rank or a pair (1 or 2)"
        )
    if engram is not None and engram.embedding_across_dp:
        problems.append(
            "--engram-config embedding_across_dp=true: its embedding group spans the "
            "data-parallel ranks; the packed table splits its rows over the TP group only"
        )
    if parallel.tensor_parallel_size > 1 and (
        parallel.enable_hc_sp or parallel.use_sequence_parallel_moe
    ):
        problems.append(
            "sequence-parallel PLE (--enable-hc-sp, or sequence-parallel MoE from "
            "--all2all-backend with expert and data parallelism): the packed table's forward "
            "all-reduces every token's rows instead of the reduce-scatter it needs"
        )
    if getattr(parallel, "use_ubatching", False):
        problems.append(
            "micro-batching (--enable-dbo / --ubatch-size): the rows are uploaded for the "
            "whole batch, not per micro-batch"
        )
    if getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        problems.append(
            f"--prefill-context-parallel-size {parallel.prefill_context_parallel_size}: "
            "tokens are split across ranks after the host step"
        )
    return problems + row_shard_loading(config.load_config)


def row_shard_loading(load: Any) -> list[str]:
    """The load settings whose loader would read the checkpoint's PLE row shards."""
    problems = []
    if load.load_format not in ("auto", "safetensors"):
        problems.append(
            f"--load-format {load.load_format}: only the safetensors loader skips the row "
            "shards before reading them; use --load-format=safetensors"
        )
    strategy = load.safetensors_load_strategy
    if strategy in ROW_SHARD_READING_STRATEGIES:
        problems.append(
            f"--safetensors-load-strategy {strategy or '(unset)'}: it "
            f"{ROW_SHARD_READING_STRATEGIES[strategy]}, row shards included; use "
            "--safetensors-load-strategy=lazy"
        )
    extra = load.model_loader_extra_config
    if isinstance(extra, dict) and extra.get("enable_multithread_load"):
        problems.append(
            "--model-loader-extra-config enable_multithread_load=true: the multi-thread "
            "iterator reads every tensor without the per-name skip; remove it"
        )
    return problems
