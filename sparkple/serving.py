"""The serving plan of one Spark: vLLM's arguments from the recipe, and the memory budget.

One place computes what `vllm_service` renders into its unit:
  - the snapshot's sizes, read from its safetensors headers (weight files, the PLE row shards,
    the MTP weights), following the HF cache's symlinks;
  - the budget (docs/reference-deployment.md#memory-budget):
        weights = snapshot - table (- MTP weights when MTP is off)
        fixed   = weights + overhead (+ MTP runtime when MTP is on)
        KV need = max_model_len x 29,482 B/token (BF16 KV; x 0.58 with fp8)
        wish    = fixed + max(KV need, KV target)
        budget  = min(wish, MemTotal - reserve)
    GPU memory utilization = budget / MemTotal (floored to 3 decimals); refused when the KV
    cache left cannot hold max_model_len, or when the container memory (budget + slack) is
    above MemTotal - host floor;
  - vLLM's argv (the recipe's flags plus free extra arguments, checked against the flags the
    recipe owns and against settings that break the PLE path);
  - the launch gate: MemAvailable >= container memory + margin, right before each start.

Standard library only: the role runs it with the host's python3 (`sparkple serving-plan`,
`sparkple launch-gate`).
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import EXIT_CHECK_FAILED, EXIT_OK, SparkpleError

GIB = 1024**3
MIB = 1024**2
# BF16 KV bytes per context token and the fp8 factor (docs/reference-deployment.md#memory-budget).
KV_BYTES_PER_TOKEN_BF16 = 29_482
FP8_KV_FACTOR = 0.58
# The model's native context and the longest YaRN context the recipe allows.
NATIVE_MAX_MODEL_LEN = 262_144
YARN_MAX_MODEL_LEN = 524_288
KV_CACHE_DTYPES = ("auto", "fp8")
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM 0.33's CUDAGraphMode names.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
SAFETENSORS_LOAD_STRATEGIES = ("lazy", "eager", "prefetch")
# The strategies vLLM 0.33's loader reads the PLE row shards with (only lazy asks its per-name
# skip before it reads a tensor), and why; the vLLM patch refuses them at start as well.
ROW_SHARD_READING_STRATEGIES = {
    "eager": "reads each whole file, then filters the names",
    "prefetch": "reads every file into the page cache",
}
MAX_MTP_DEPTH = 8
# Names of the PLE row-shard tensors (their bytes are the table, read from NVMe instead).
PLE_SHARD_MARK = ".ple.ple_embedding.ngram_embedding.shard_"

# Flags the recipe sets itself; extra arguments may not repeat them (the last one would win
# silently). Each maps to the variable that owns it.
OWNED_FLAGS: dict[str, str] = {
    "--model": "the model path (model_checkpoint)",
    "--served-model-name": "sparkple_served_model_name",
    "--host": "sparkple_api_host",
    "--port": "sparkple_api_port",
    "--max-model-len": "vllm_service_max_model_len",
    "--max-num-seqs": "vllm_service_max_num_seqs",
    "--max-num-batched-tokens": "vllm_service_max_num_batched_tokens",
    "--kv-cache-dtype": "vllm_service_kv_cache_dtype",
    "--mamba-ssm-cache-dtype": "vllm_service_mamba_ssm_cache_dtype",
    "--speculative-config": "vllm_service_mtp_depth",
    "--reasoning-parser": "vllm_service_reasoning_parser",
    "--tool-call-parser": "vllm_service_tool_call_parser",
    "--enable-auto-tool-choice": "vllm_service_tool_call_parser",
    "--enable-chunked-prefill": "vllm_service_chunked_prefill",
    "--disable-chunked-prefill": "vllm_service_chunked_prefill",
    "--load-format": "vllm_service_safetensors_load_strategy",
    "--safetensors-load-strategy": "vllm_service_safetensors_load_strategy",
    "--compilation-config": "vllm_service_cudagraph_mode",
    "--hf-overrides": "vllm_service_max_model_len (YaRN above 262144)",
    "--distributed-executor-backend": "the recipe (mp)",
    "--gpu-memory-utilization": "the budget (vllm_service_memtotal_reserve_gib and friends)",
    "--kv-cache-memory-bytes": "the budget (vllm_service_memtotal_reserve_gib and friends)",
}
# What the packed-table PLE path cannot serve (the vLLM patch refuses them at start as well):
# a flag, its short form, and why. Sizes are refused above 1, switches whenever given.
PLE_UNSERVABLE: dict[str, tuple[str, str]] = {
    "--pipeline-parallel-size": ("-pp", "later pipeline ranks do not see the token ids"),
    "--tensor-parallel-size": ("-tp", "the packed table serves one rank"),
    "--prefill-context-parallel-size": ("-pcp", "tokens are split across ranks after the PLE step"),
    "--enable-dbo": ("", "the PLE rows are uploaded per batch, not per micro-batch"),
    "--ubatch-size": ("", "the PLE rows are uploaded per batch, not per micro-batch"),
}


def _turns_on(arg: str, following: list[str], key: str) -> bool:
    """Whether a dict-valued argument (--engram-config, --model-loader-extra-config) turns
    `key` on: JSON or dotted; the value inline after `=` or as the next argument; dashes or
    underscores in the key."""
    name, eq, value = arg.partition("=")
    if not eq and following and not following[0].startswith("-"):
        value = following[0]
    _, _, dotted = name.partition(".")
    if dotted:
        on = value.strip().lower() in ("", "true", "1")
        return dotted.replace("-", "_") == key and on
    try:
        config = json.loads(value)
    except ValueError:
        return False
    if not isinstance(config, dict):
        return False
    return True in (config.get(key), config.get(key.replace("_", "-")))


class ServingError(SparkpleError):
    """The recipe or the budget cannot work on this host; the message names the knob."""


# --- the snapshot's sizes ------------------------------------------------------------------


@dataclass(frozen=True)
class SnapshotSizes:
    """Bytes of a snapshot's weight files, of its PLE row shards and of its MTP weights."""

    weight_files_bytes: int
    table_bytes: int
    mtp_bytes: int
    files: int
    mtp_layers: int | None  # mtp_num_hidden_layers (or num_nextn_predict_layers) of config.json
    rope_parameters: dict[str, Any] | None  # text_config.rope_parameters of config.json


def _is_mtp(name: str) -> bool:
    for prefix in ("model.language_model.", "language_model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return name.startswith(("mtp.", "model.mtp."))


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ServingError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * MIB:
            raise ServingError(f"{path}: header length {length} is implausible")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ServingError(f"{path}: the safetensors header is not a JSON object")
    return header


def snapshot_sizes(snapshot: Path) -> SnapshotSizes:
    """Read the sizes from the index, the safetensors headers and config.json (no tensor data)."""
    index = snapshot / "model.safetensors.index.json"
    config_path = snapshot / "config.json"
    for required in (index, config_path):
        if not required.is_file():
            raise ServingError(
                f"{required} is missing (or a dangling symlink): the snapshot is incomplete; "
                "run model_checkpoint first"
            )
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    if not isinstance(weight_map, dict) or not weight_map:
        raise ServingError(f"{index} has no weight_map")
    total = table = mtp = 0
    names = sorted(set(weight_map.values()))
    for name in names:
        path = snapshot / name
        total += path.stat().st_size  # follows the HF cache's symlink into blobs/
        for tensor, info in _header(path).items():
            if tensor == "__metadata__":
                continue
            start, end = info["data_offsets"]
            size = int(end) - int(start)
            if PLE_SHARD_MARK in tensor:
                table += size
            elif _is_mtp(tensor):
                mtp += size
    config = json.loads(config_path.read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    layers = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers"))
    rope = text.get("rope_parameters")
    return SnapshotSizes(
        weight_files_bytes=total,
        table_bytes=table,
        mtp_bytes=mtp,
        files=len(names),
        mtp_layers=int(layers) if layers is not None else None,
        rope_parameters=dict(rope) if isinstance(rope, dict) else None,
    )


# --- the recipe -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """The serving recipe: what `vllm serve` gets besides the memory utilization."""

    model: str
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int = NATIVE_MAX_MODEL_LEN
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 2048
    kv_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "bfloat16"
    mtp_depth: int = 3
    reasoning_parser: str = "qwen3"
    tool_call_parser: str = "qwen3_coder"
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    safetensors_load_strategy: str = "lazy"
    chunked_prefill: bool = True
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def check(self, mtp_layers: int | None = None) -> None:
        """Refuse values vLLM or the PLE path cannot take, naming the variable to change."""

        def bad(var: str, value: Any, want: str) -> ServingError:
            return ServingError(f"vllm_service_{var} is {value!r}: {want}")

        if not self.served_model_name:
            raise bad("served_model_name", self.served_model_name, "set a model name")
        if not 1 <= self.port <= 65535:
            raise bad("port", self.port, "use a TCP port in 1..65535")
        if not 1 <= self.max_model_len <= YARN_MAX_MODEL_LEN:
            raise bad(
                "max_model_len",
                self.max_model_len,
                f"use 1..{NATIVE_MAX_MODEL_LEN} (native) or up to {YARN_MAX_MODEL_LEN} (YaRN)",
            )
        if self.max_model_len > NATIVE_MAX_MODEL_LEN and self.max_model_len % NATIVE_MAX_MODEL_LEN:
            raise bad(
                "max_model_len",
                self.max_model_len,
                f"above the native {NATIVE_MAX_MODEL_LEN} YaRN scales by a whole factor: "
                f"use {YARN_MAX_MODEL_LEN}",
            )
        if not 1 <= self.max_num_seqs <= 256:
            raise bad("max_num_seqs", self.max_num_seqs, "use 1..256 (the recipe: 4, or 8)")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise bad(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be at least vllm_service_max_num_seqs ({self.max_num_seqs})",
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise bad(
                "chunked_prefill",
                self.chunked_prefill,
                "without chunked prefill vLLM needs max_num_batched_tokens >= max_model_len: "
                "keep it true",
            )
        choices = (
            ("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
            ("mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype, MAMBA_SSM_CACHE_DTYPES),
            ("cudagraph_mode", self.cudagraph_mode, CUDAGRAPH_MODES),
            (
                "safetensors_load_strategy",
                self.safetensors_load_strategy,
                SAFETENSORS_LOAD_STRATEGIES,
            ),
        )
        for var, value, allowed in choices:
            if value not in allowed:
                raise bad(var, value, f"use one of {', '.join(allowed)}")
        if self.safetensors_load_strategy in ROW_SHARD_READING_STRATEGIES:
            raise bad(
                "safetensors_load_strategy",
                self.safetensors_load_strategy,
                f"--safetensors-load-strategy={self.safetensors_load_strategy} "
                f"{ROW_SHARD_READING_STRATEGIES[self.safetensors_load_strategy]}, the PLE row "
                "shards the packed table replaces included: use lazy",
            )
        if not 0 <= self.mtp_depth <= MAX_MTP_DEPTH:
            raise bad("mtp_depth", self.mtp_depth, f"use 0 (off) .. {MAX_MTP_DEPTH}")
        if (
            self.mtp_depth
            and mtp_layers
            and self.mtp_depth > mtp_layers
            and self.mtp_depth % mtp_layers
        ):
            raise bad(
                "mtp_depth",
                self.mtp_depth,
                f"the checkpoint has {mtp_layers} MTP layers: a depth above it must be a "
                f"multiple of {mtp_layers} (vLLM reuses the layers)",
            )
        if mtp_layers == 0 and self.mtp_depth:
            raise bad("mtp_depth", self.mtp_depth, "the checkpoint has no MTP layers: set 0")
        self.check_extra_args()

    def check_extra_args(self) -> None:
        for arg in self.extra_args:
            if not isinstance(arg, str) or not arg:
                raise ServingError(
                    f"vllm_service_extra_args holds {arg!r}: each entry is one non-empty string"
                )
            if "\n" in arg or "\0" in arg:
                raise ServingError(
                    f"vllm_service_extra_args holds {arg!r}: no newlines or NUL bytes"
                )
            flag = arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else ""
            if flag in OWNED_FLAGS:
                raise ServingError(
                    f"vllm_service_extra_args sets {flag}, which the recipe sets from "
                    f"{OWNED_FLAGS[flag]}: change that instead and remove {arg!r}"
                )
        self.check_ple_servable()

    def check_ple_servable(self) -> None:
        """Refuse extra arguments that break the packed-table PLE path, naming the flag.

        Async scheduling and MTP are served: the PLE step copies the same device inputs the
        stock forward reads, drafts and rejections included.
        """
        short = {alias: flag for flag, (alias, _) in PLE_UNSERVABLE.items() if alias}
        args = list(self.extra_args)
        for i, arg in enumerate(args):
            name, eq, value = arg.partition("=")
            flag = short.get(name, name.replace("_", "-"))
            if flag not in PLE_UNSERVABLE:
                following = args[i + 1 : i + 2]
                if flag.startswith("--engram-config") and _turns_on(
                    arg, following, "embedding_across_dp"
                ):
                    raise ServingError(
                        f"vllm_service_extra_args has {arg!r}: embedding_across_dp shards the "
                        "table across ranks, which the packed PLE table cannot serve; remove it"
                    )
                if flag.startswith("--model-loader-extra-config") and _turns_on(
                    arg, following, "enable_multithread_load"
                ):
                    raise ServingError(
                        f"vllm_service_extra_args has {arg!r}: the multi-thread loader reads "
                        "every tensor, the PLE row shards the packed table replaces included; "
                        "remove it"
                    )
                continue
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                value = args[i + 1]
            if flag == "--enable-dbo" or not value.strip().isdigit() or int(value) > 1:
                raise ServingError(
                    f"vllm_service_extra_args has {arg!r}: {PLE_UNSERVABLE[flag][1]}, so the "
                    "packed PLE table cannot serve it; remove it from vllm_service_extra_args"
                )

    def yarn_overrides(self, rope: dict[str, Any] | None) -> dict[str, Any] | None:
        """--hf-overrides for a context above the native one (the checkpoint's rope kept).

        vLLM 0.33 does not multiply max_position_embeddings by a YaRN factor (it takes it as
        already scaled, as Transformers' YaRN does), so the scaled length goes in with it;
        without it vLLM's ModelConfig refuses the max_model_len."""
        if self.max_model_len <= NATIVE_MAX_MODEL_LEN:
            return None
        params = dict(rope or {})
        params.update(
            rope_type="yarn",
            factor=float(self.max_model_len // NATIVE_MAX_MODEL_LEN),
            original_max_position_embeddings=NATIVE_MAX_MODEL_LEN,
        )
        return {
            "text_config": {
                "max_position_embeddings": self.max_model_len,
                "rope_parameters": params,
            }
        }

    def argv(self, gpu_memory_utilization: float, rope: dict[str, Any] | None = None) -> list[str]:
        """The arguments of `vllm serve` (after the entrypoint's own words), one string each."""
        compact = {"separators": (",", ":"), "sort_keys": False}
        args = [
            self.model,
            f"--served-model-name={self.served_model_name}",
            f"--host={self.host}",
            f"--port={self.port}",
            f"--max-model-len={self.max_model_len}",
            f"--max-num-seqs={self.max_num_seqs}",
            f"--max-num-batched-tokens={self.max_num_batched_tokens}",
            f"--kv-cache-dtype={self.kv_cache_dtype}",
            f"--mamba-ssm-cache-dtype={self.mamba_ssm_cache_dtype}",
        ]
        if self.mtp_depth:
            spec = {"method": "mtp", "num_speculative_tokens": self.mtp_depth}
            args.append(f"--speculative-config={json.dumps(spec, **compact)}")
        if self.reasoning_parser:
            args.append(f"--reasoning-parser={self.reasoning_parser}")
        if self.tool_call_parser:
            args += ["--enable-auto-tool-choice", f"--tool-call-parser={self.tool_call_parser}"]
        args.append(
            "--enable-chunked-prefill" if self.chunked_prefill else "--disable-chunked-prefill"
        )
        args += [
            "--load-format=safetensors",
            f"--safetensors-load-strategy={self.safetensors_load_strategy}",
            "--compilation-config="
            + json.dumps({"cudagraph_mode": self.cudagraph_mode}, **compact),
            "--distributed-executor-backend=mp",
            f"--gpu-memory-utilization={gpu_memory_utilization}",
        ]
        overrides = self.yarn_overrides(rope)
        if overrides:
            args.append(f"--hf-overrides={json.dumps(overrides, **compact)}")
        return args + list(self.extra_args)


# --- the budget -----------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetKnobs:
    """The budget's inputs besides the snapshot and the recipe, in GiB."""

    overhead_gib: float = 5.6
    mtp_runtime_gib: float = 1.49
    kv_target_gib: float = 16.0
    reserve_gib: float = 26.0
    slack_gib: float = 8.0
    host_floor_gib: float = 16.0
    launch_margin_gib: float = 4.0


@dataclass(frozen=True)
class Budget:
    mem_total_gib: float
    weights_gib: float
    fixed_gib: float
    kv_need_gib: float
    wish_gib: float
    budget_gib: float
    gpu_memory_utilization: float
    kv_left_gib: float
    container_memory_mib: int
    launch_need_mib: int

    def summary(self) -> str:
        return (
            f"MemTotal {self.mem_total_gib:.2f} GiB; weights {self.weights_gib:.2f} + fixed "
            f"-> {self.fixed_gib:.2f} GiB; KV need {self.kv_need_gib:.2f} GiB; wish "
            f"{self.wish_gib:.2f} GiB; budget {self.budget_gib:.2f} GiB "
            f"(gpu_memory_utilization {self.gpu_memory_utilization}); KV left "
            f"{self.kv_left_gib:.2f} GiB; container {self.container_memory_mib} MiB; "
            f"launch needs MemAvailable >= {self.launch_need_mib} MiB"
        )


def kv_need_bytes(max_model_len: int, kv_cache_dtype: str) -> int:
    per_token = KV_BYTES_PER_TOKEN_BF16 * (FP8_KV_FACTOR if kv_cache_dtype == "fp8" else 1.0)
    return math.ceil(max_model_len * per_token)


def compute_budget(
    sizes: SnapshotSizes, recipe: Recipe, mem_total_bytes: int, knobs: BudgetKnobs
) -> Budget:
    """The budget (docs/reference-deployment.md#memory-budget); ServingError when it cannot work."""
    for name, value in asdict(knobs).items():
        if not isinstance(value, int | float) or value < 0 or math.isnan(value):
            raise ServingError(f"vllm_service_{name} is {value!r}: use a number >= 0")
    if mem_total_bytes <= 0:
        raise ServingError(f"MemTotal {mem_total_bytes} B is not a memory size")
    if sizes.table_bytes > sizes.weight_files_bytes:
        raise ServingError(
            f"the PLE shards ({sizes.table_bytes} B) exceed the weight files "
            f"({sizes.weight_files_bytes} B): the snapshot's headers are inconsistent"
        )
    mem_total = mem_total_bytes / GIB
    weights_b = sizes.weight_files_bytes - sizes.table_bytes
    if not recipe.mtp_depth:
        weights_b -= sizes.mtp_bytes
    weights = weights_b / GIB
    fixed = weights + knobs.overhead_gib + (knobs.mtp_runtime_gib if recipe.mtp_depth else 0.0)
    kv_need = kv_need_bytes(recipe.max_model_len, recipe.kv_cache_dtype) / GIB
    wish = fixed + max(kv_need, knobs.kv_target_gib)
    cap = mem_total - knobs.reserve_gib
    # vLLM takes a fraction of the device's memory (MemTotal on GB10), here with 3 decimals:
    # rounded up to cover the wish, but never above the cap
    util = min(math.ceil(wish / mem_total * 1000), math.floor(cap / mem_total * 1000)) / 1000
    effective = util * mem_total
    kv_left = effective - fixed
    numbers = (
        f"MemTotal {mem_total:.2f} GiB - reserve {knobs.reserve_gib:g} GiB caps the budget at "
        f"{cap:.2f} GiB; weights {weights:.2f} GiB + overhead "
        f"{knobs.overhead_gib:g} GiB"
        + (f" + MTP {knobs.mtp_runtime_gib:g} GiB" if recipe.mtp_depth else "")
        + f" = {fixed:.2f} GiB fixed"
    )
    if util <= 0 or kv_left < kv_need:
        raise ServingError(
            f"the KV cache left ({kv_left:.2f} GiB) cannot hold max_model_len "
            f"{recipe.max_model_len} ({kv_need:.2f} GiB at kv_cache_dtype "
            f"{recipe.kv_cache_dtype}): {numbers}. Lower vllm_service_max_model_len, set "
            "vllm_service_kv_cache_dtype to fp8, or lower vllm_service_memtotal_reserve_gib "
            "if the host really needs less"
        )
    container = effective + knobs.slack_gib
    ceiling = mem_total - knobs.host_floor_gib
    if container > ceiling:
        raise ServingError(
            f"the container memory ({container:.2f} GiB = budget {effective:.2f} + slack "
            f"{knobs.slack_gib:g}) is above MemTotal {mem_total:.2f} - host floor "
            f"{knobs.host_floor_gib:g} = {ceiling:.2f} GiB: {numbers}. Raise "
            "vllm_service_memtotal_reserve_gib or lower vllm_service_memory_slack_gib"
        )
    container_mib = math.ceil(container * 1024)
    return Budget(
        mem_total_gib=round(mem_total, 3),
        weights_gib=round(weights, 3),
        fixed_gib=round(fixed, 3),
        kv_need_gib=round(kv_need, 3),
        wish_gib=round(wish, 3),
        budget_gib=round(effective, 3),
        gpu_memory_utilization=util,
        kv_left_gib=round(kv_left, 3),
        container_memory_mib=container_mib,
        launch_need_mib=container_mib + math.ceil(knobs.launch_margin_gib * 1024),
    )


# --- /proc/meminfo and the launch gate ------------------------------------------------------


def meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    values: dict[str, int] = {}
    for line in path.read_text(encoding="ascii").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return values


def launch_gate(need_mib: int, path: Path = Path("/proc/meminfo")) -> tuple[bool, str]:
    available = meminfo(path).get("MemAvailable")
    if available is None:
        return False, f"{path} has no MemAvailable line"
    have = available // MIB
    if have < need_mib:
        return False, (
            f"MemAvailable {have} MiB < {need_mib} MiB (the container's memory + the launch "
            "margin): not starting vLLM, which could exhaust the unified memory. Free memory "
            "(stop other containers, drop caches) or lower the budget "
            "(vllm_service_memtotal_reserve_gib up, vllm_service_max_model_len down)"
        )
    return True, f"MemAvailable {have} MiB >= {need_mib} MiB"


# --- the plan and the command line ----------------------------------------------------------


def plan(
    snapshot: Path, recipe: Recipe, knobs: BudgetKnobs, mem_total_bytes: int
) -> dict[str, Any]:
    sizes = snapshot_sizes(snapshot)
    recipe.check(sizes.mtp_layers)
    budget = compute_budget(sizes, recipe, mem_total_bytes, knobs)
    return {
        "sizes": asdict(sizes),
        "budget": asdict(budget),
        "summary": budget.summary(),
        "argv": recipe.argv(budget.gpu_memory_utilization, sizes.rope_parameters),
    }


def _plan_cmd(args: argparse.Namespace) -> int:
    try:
        spec = json.loads(args.recipe)
    except json.JSONDecodeError as exc:
        raise ServingError(f"--recipe is not JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise ServingError("--recipe must be a JSON object")
    recipe_keys = set(Recipe.__dataclass_fields__)
    knob_keys = set(BudgetKnobs.__dataclass_fields__)
    unknown = sorted(set(spec) - recipe_keys - knob_keys)
    if unknown:
        raise ServingError(f"--recipe has unknown keys {unknown}")
    try:
        recipe = Recipe(**{k: v for k, v in spec.items() if k in recipe_keys})
        recipe = Recipe(**{**asdict(recipe), "extra_args": tuple(recipe.extra_args)})
        knobs = BudgetKnobs(**{k: float(v) for k, v in spec.items() if k in knob_keys})
    except (TypeError, ValueError) as exc:
        raise ServingError(f"--recipe: {exc}") from None
    total = args.mem_total_bytes or meminfo().get("MemTotal", 0)
    result = plan(Path(args.snapshot), recipe, knobs, total)
    print(json.dumps(result, indent=None if args.json else 2))
    return EXIT_OK


def _gate_cmd(args: argparse.Namespace) -> int:
    ok, message = launch_gate(args.need_mib, Path(args.meminfo))
    print(f"sparkple launch-gate: {message}", file=sys.stdout if ok else sys.stderr)
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def add_parser(sub: Any, name: str) -> None:
    if name == "serving-plan":
        p = sub.add_parser(name, help="vLLM's arguments and the memory budget for a snapshot")
        p.add_argument("snapshot", help="the snapshot directory (HF cache layout is fine)")
        p.add_argument("--recipe", required=True, help="the recipe and budget knobs as JSON")
        p.add_argument(
            "--mem-total-bytes", type=int, default=0, help="MemTotal (default: /proc/meminfo)"
        )
        p.add_argument("--json", action="store_true", help="one line of JSON")
        p.set_defaults(func=_plan_cmd)
    else:
        p = sub.add_parser(name, help="refuse a launch when MemAvailable is too low")
        p.add_argument("--need-mib", type=int, required=True, help="MemAvailable needed")
        p.add_argument("--meminfo", default="/proc/meminfo", help=argparse.SUPPRESS)
        p.set_defaults(func=_gate_cmd)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - through sparkple.cli
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
