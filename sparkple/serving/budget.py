"""The memory budget of one Spark: the snapshot's sizes, the budget and the launch gate.

  - the snapshot's sizes, read from its safetensors headers (weight files, the PLE row shards,
    the MTP weights), following the HF cache's symlinks;
  - the budget (docs/reference-deployment.md#memory-budget):
        weights = snapshot - table (- MTP weights when MTP is off)
        fixed   = weights + overhead (+ MTP runtime when MTP is on)
                  (+ the table with sparkple_ple_backend vllm-pinned: vLLM's pinned-host
                  backend pins the whole table in host memory, the unified memory of a GB10)
        KV need = max_model_len x 29,482 B/token (BF16 KV; x 0.58 with fp8)
        wish    = fixed + max(KV need, KV target)
        budget  = min(wish, MemTotal - reserve)
    GPU memory utilization = budget / MemTotal (floored to 3 decimals); refused when the KV
    cache left cannot hold max_model_len, or when the container memory (budget + slack) is
    above MemTotal - host floor;
  - the launch gate: MemAvailable >= container memory + margin, right before each start.

A pair (two Sparks at TP 2, one rank each) is budgeted per rank: each rank holds half the
weights (vLLM shards every layer, the MTP layers included, across the TP group; vllm-pinned pins
half the table on each, the rank's rows); the PLE rows stay on NVMe otherwise, and the
overhead, the MTP runtime and the KV need are kept at the single-Spark figures (measured on
one Spark; the KV heads are split across the ranks too, so the KV need is an upper bound per
rank).

Standard library only: the role runs it with the host's python3.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..builder.safetensors_io import INDEX_NAME, Snapshot
from ..geometry import text_config
from ..meminfo import MEMINFO, read_meminfo
from .recipe import Recipe, ServingError
from .served import PLE_BACKEND_KNOB, from_var

GIB = 1024**3
MIB = 1024**2
# BF16 KV bytes per context token and the fp8 factor (docs/reference-deployment.md#memory-budget).
KV_BYTES_PER_TOKEN_BF16 = 29_482
FP8_KV_FACTOR = 0.58
# Names of the PLE row-shard tensors (their bytes are the table, read from NVMe instead).
PLE_SHARD_MARK = ".ple.ple_embedding.ngram_embedding.shard_"


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


def snapshot_sizes(snapshot: Path) -> SnapshotSizes:
    """Read the sizes from the index, the safetensors headers and config.json (no tensor data).

    The headers are read by the table builder's strict reader: a file it refuses is refused."""
    index = snapshot / INDEX_NAME
    config_path = snapshot / "config.json"
    for required in (index, config_path):
        if not required.is_file():
            raise ServingError(
                f"{required} is missing (or a dangling symlink): the snapshot is incomplete; "
                "run model_checkpoint first"
            )
    snap = Snapshot(snapshot)
    if not snap.weight_map:
        raise ServingError(f"{index} has no weight_map")
    total = table = mtp = 0
    for name in snap.file_names:
        tensors = snap.header(name)
        total += snap.file_size(name)  # follows the HF cache's symlink into blobs/
        for tensor, info in tensors.items():
            if PLE_SHARD_MARK in tensor:
                table += info.nbytes
            elif _is_mtp(tensor):
                mtp += info.nbytes
    text = text_config(snap.config())
    layers = text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers"))
    rope = text.get("rope_parameters")
    return SnapshotSizes(
        weight_files_bytes=total,
        table_bytes=table,
        mtp_bytes=mtp,
        files=len(snap.file_names),
        mtp_layers=int(layers) if layers is not None else None,
        rope_parameters=dict(rope) if isinstance(rope, dict) else None,
    )


@dataclass(frozen=True)
class BudgetKnobs:
    """The budget's inputs besides the snapshot and the recipe, in GiB, each from its variable."""

    overhead_gib: float = from_var("vllm_service_overhead_gib", 5.6)
    mtp_runtime_gib: float = from_var("vllm_service_mtp_runtime_gib", 1.49)
    kv_target_gib: float = from_var("vllm_service_kv_target_gib", 16.0)
    reserve_gib: float = from_var("vllm_service_memtotal_reserve_gib", 26.0)
    slack_gib: float = from_var("vllm_service_memory_slack_gib", 8.0)
    host_floor_gib: float = from_var("vllm_service_host_floor_gib", 16.0)
    launch_margin_gib: float = from_var("vllm_service_launch_margin_gib", 4.0)


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
    # the PLE table pinned in host memory (sparkple_ple_backend vllm-pinned), part of fixed
    pinned_table_gib: float = 0.0

    def summary(self) -> str:
        pinned = self.pinned_table_gib
        return (
            f"MemTotal {self.mem_total_gib:.2f} GiB; weights {self.weights_gib:.2f} + "
            + (f"pinned PLE table {pinned:.2f} + " if pinned else "")
            + f"fixed "
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
    sizes: SnapshotSizes,
    recipe: Recipe,
    mem_total_bytes: int,
    knobs: BudgetKnobs,
    tp_size: int = 1,
) -> Budget:
    """The budget of one rank on its own Spark (docs/reference-deployment.md#memory-budget;
    tp_size 2: a pair's rank, holding half the weights); ServingError when it cannot work."""
    if tp_size not in (1, 2):
        raise ServingError(f"tensor parallel size {tp_size}: sparkple serves 1 (a Spark) or 2")
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
    weights = weights_b / tp_size / GIB
    # vLLM's pinned-host backend pins the rank's rows of the table in host memory, which on a
    # GB10 is the GPU's memory too; the packed table and vLLM's disk offload read them from NVMe
    pinned = sizes.table_bytes / tp_size / GIB if recipe.ple_backend == "vllm-pinned" else 0.0
    fixed = (
        weights + pinned + knobs.overhead_gib + (knobs.mtp_runtime_gib if recipe.mtp_depth else 0.0)
    )
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
        f"{cap:.2f} GiB; weights {weights:.2f} GiB + "
        + (
            f"the PLE table pinned in host memory {pinned:.2f} GiB ({PLE_BACKEND_KNOB} "
            "vllm-pinned) + "
            if pinned
            else ""
        )
        + f"overhead {knobs.overhead_gib:g} GiB"
        + (f" + MTP {knobs.mtp_runtime_gib:g} GiB" if recipe.mtp_depth else "")
        + f" = {fixed:.2f} GiB fixed"
    )
    # what to change when vllm-pinned's table is what does not fit
    unpin = (
        f" {PLE_BACKEND_KNOB} vllm-pinned pins "
        + ("the whole PLE table" if tp_size == 1 else "the rank's half of the PLE table")
        + f" ({pinned:.2f} GiB) in host memory beside the weights: set {PLE_BACKEND_KNOB}: "
        "packed or vllm-disk (the rows read from NVMe)"
        + (
            ", or serve vllm-pinned on a pair (half the table on each Spark)."
            if tp_size == 1
            else "."
        )
        if pinned
        else ""
    )
    if util <= 0 or kv_left < kv_need:
        raise ServingError(
            f"the KV cache left ({kv_left:.2f} GiB) cannot hold max_model_len "
            f"{recipe.max_model_len} ({kv_need:.2f} GiB at kv_cache_dtype "
            f"{recipe.kv_cache_dtype}): {numbers}.{unpin} Lower vllm_service_max_model_len, "
            "set vllm_service_kv_cache_dtype to fp8, or lower vllm_service_memtotal_reserve_gib "
            "if the host really needs less"
        )
    container = effective + knobs.slack_gib
    ceiling = mem_total - knobs.host_floor_gib
    if container > ceiling:
        raise ServingError(
            f"the container memory ({container:.2f} GiB = budget {effective:.2f} + slack "
            f"{knobs.slack_gib:g}) is above MemTotal {mem_total:.2f} - host floor "
            f"{knobs.host_floor_gib:g} = {ceiling:.2f} GiB: {numbers}.{unpin} Raise "
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
        pinned_table_gib=round(pinned, 3),
    )


def launch_gate(need_mib: int, path: Path = MEMINFO) -> tuple[bool, str]:
    """Whether MemAvailable covers the container's memory + the launch margin, right before a
    start; the message says why not and what to do."""
    available = read_meminfo(path).get("MemAvailable")
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
