"""The serving recipe: what `vllm serve` gets, each flag from the role variable that owns it.

Each field of `Recipe` names its variable and the flags it sets (`served`); from them come
vLLM's argv, the flags extra arguments may not repeat (OWNED_FLAGS), the variables the role
passes (sparkple.serving.cli.variables) and the flags the lab's stand-in server accepts
(ACCEPTED_FLAGS). A new served flag is one field here, plus the role's default and its
argument spec.

Standard library only: the role runs it with the host's python3 (`sparkple serving-plan`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import SparkpleError
from .served import (
    COMPACT,
    CUDAGRAPH_MODES,
    DISK_OFFLOAD_SINCE,
    KV_CACHE_DTYPES,
    MAMBA_SSM_CACHE_DTYPES,
    MAX_MTP_DEPTH,
    NATIVE_MAX_MODEL_LEN,
    PLE_BACKEND_KNOB,
    PLE_BACKENDS,
    ROW_SHARD_READING_STRATEGIES,
    SAFETENSORS_LOAD_STRATEGIES,
    YARN_MAX_MODEL_LEN,
    Served,
    chunked_prefill,
    cudagraph_mode,
    engram_config,
    from_var,
    load_strategy,
    mtp,
    one,
    profile_vllm_version,
    tool_parser,
)


class ServingError(SparkpleError):
    """The recipe or the budget cannot work on this host; the message names the knob."""


@dataclass(frozen=True)
class Recipe:
    """The serving recipe: what `vllm serve` gets besides the memory utilization, in argv order."""

    model: str = from_var(
        "vllm_service_model_path",
        served=Served({"--model": str}, lambda v: [v]),  # first, as `vllm serve <model>`
        owner="the model path (model_checkpoint)",
    )
    served_model_name: str = from_var(
        "sparkple_served_model_name", served=one("--served-model-name")
    )
    host: str = from_var("sparkple_api_host", "127.0.0.1", one("--host"))
    port: int = from_var("sparkple_api_port", 8000, one("--port", int))
    max_model_len: int = from_var(
        "vllm_service_max_model_len", NATIVE_MAX_MODEL_LEN, one("--max-model-len", int)
    )
    max_num_seqs: int = from_var("vllm_service_max_num_seqs", 4, one("--max-num-seqs", int))
    max_num_batched_tokens: int = from_var(
        "vllm_service_max_num_batched_tokens", 2048, one("--max-num-batched-tokens", int)
    )
    kv_cache_dtype: str = from_var("vllm_service_kv_cache_dtype", "auto", one("--kv-cache-dtype"))
    mamba_ssm_cache_dtype: str = from_var(
        "vllm_service_mamba_ssm_cache_dtype", "bfloat16", one("--mamba-ssm-cache-dtype")
    )
    mtp_depth: int = from_var(
        "vllm_service_mtp_depth", 3, Served({"--speculative-config": "json"}, mtp)
    )
    reasoning_parser: str = from_var(
        "vllm_service_reasoning_parser", "qwen3", one("--reasoning-parser", unless_empty=True)
    )
    tool_call_parser: str = from_var(
        "vllm_service_tool_call_parser",
        "qwen3_coder",
        Served({"--tool-call-parser": str, "--enable-auto-tool-choice": None}, tool_parser),
    )
    chunked_prefill: bool = from_var(
        "vllm_service_chunked_prefill",
        True,
        Served(
            {"--enable-chunked-prefill": None, "--disable-chunked-prefill": None}, chunked_prefill
        ),
    )
    safetensors_load_strategy: str = from_var(
        "vllm_service_safetensors_load_strategy",
        "lazy",
        Served({"--load-format": str, "--safetensors-load-strategy": str}, load_strategy),
    )
    cudagraph_mode: str = from_var(
        "vllm_service_cudagraph_mode",
        "FULL_DECODE_ONLY",
        Served({"--compilation-config": "json"}, cudagraph_mode),
    )
    # the role's default is the site knob's, "{{ sparkple_ple_backend | default('packed') }}"
    ple_backend: str = field(
        default="packed",
        metadata={
            "var": "vllm_service_ple_backend",
            "served": Served({"--engram-config": "json"}, engram_config, owned=False),
            "owner": f"{PLE_BACKEND_KNOB} (vllm_service_ple_backend)",
        },
    )
    extra_args: tuple[str, ...] = from_var("vllm_service_extra_args", ())

    @property
    def packed_table(self) -> bool:
        """Whether sparkple's packed table serves the PLE rows (SPARKPLE_PLE_TABLE_DIR, the
        table mounted), rather than one of vLLM's own backends."""
        return self.ple_backend == "packed"

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
        if self.ple_backend not in PLE_BACKENDS:
            raise ServingError(
                f"{PLE_BACKEND_KNOB} (vllm_service_ple_backend) is {self.ple_backend!r}: use one "
                f"of {', '.join(PLE_BACKENDS)}"
            )
        self.check_extra_args()

    def check_backend(self, patch_profile: str) -> None:
        """Refuse a PLE backend the vLLM of the patch profile does not have, naming both: vLLM's
        disk offload came with vLLM 0.34 (the vllm-0.33 profile's EngramConfig has no
        disk_offload, and vLLM would refuse the key at start)."""
        if self.ple_backend != "vllm-disk":
            return
        version = profile_vllm_version(patch_profile)
        if version is None or version < DISK_OFFLOAD_SINCE:
            vllm = f"vLLM {version[0]}.{version[1]}" if version else "its vLLM unknown"
            raise ServingError(
                f"{PLE_BACKEND_KNOB} is vllm-disk, but the vLLM patch profile is "
                f"{patch_profile or 'none'!r} ({vllm}; vllm_patches_profile, "
                "vllm_service_patch_profile): vLLM's disk offload (--engram-config disk_offload) "
                "needs vLLM 0.34 or later. Set vllm_patches_profile: vllm-0.34 (with its image), "
                f"or set {PLE_BACKEND_KNOB}: packed or vllm-pinned"
            )

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
            name = arg.split("=", 1)[0]
            flag = name.replace("_", "-") if arg.startswith("--") else PAIR_SHORT.get(name, "")
            if flag in OWNED_FLAGS:
                raise ServingError(
                    f"vllm_service_extra_args sets {flag}, which the recipe sets from "
                    f"{OWNED_FLAGS[flag]}: change that instead and remove {arg!r}"
                )
            if not self.packed_table and flag.startswith("--engram-config"):
                written = engram_config(self.ple_backend)[0]
                raise ServingError(
                    f"vllm_service_extra_args has {arg!r}, but the plan writes {written} for "
                    f"{PLE_BACKEND_KNOB} {self.ple_backend} (a second --engram-config would "
                    f"replace it): remove {arg!r} from vllm_service_extra_args, or set "
                    f"{PLE_BACKEND_KNOB}: packed"
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
                if (
                    self.packed_table
                    and flag.startswith("--engram-config")
                    and _turns_on(arg, following, "disk_offload")
                ):
                    raise ServingError(
                        f"vllm_service_extra_args has {arg!r}: vLLM's disk offload beside the "
                        f"packed PLE table ({PLE_BACKEND_KNOB} packed) is two backends for one "
                        "table: drop disk_offload from vllm_service_extra_args, or set "
                        f"{PLE_BACKEND_KNOB}: vllm-disk"
                    )
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
            if (
                flag in ("--enable-dbo", "--tensor-parallel-size")
                or not value.strip().isdigit()
                or int(value) > 1
            ):
                raise ServingError(
                    f"vllm_service_extra_args has {arg!r}: {PLE_UNSERVABLE[flag][1]}, so the "
                    "packed PLE table cannot serve it; remove it from vllm_service_extra_args"
                )

    def yarn_overrides(self, rope: dict[str, Any] | None) -> dict[str, Any] | None:
        """--hf-overrides for a context above the native one (the checkpoint's rope kept).

        vLLM 0.33 and 0.34 do not multiply max_position_embeddings by a YaRN factor (they take
        it as already scaled, as Transformers' YaRN does), so the scaled length goes in with it;
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

    def argv(
        self,
        gpu_memory_utilization: float,
        rope: dict[str, Any] | None = None,
        pair_args: tuple[str, ...] | list[str] = (),
    ) -> list[str]:
        """The arguments of `vllm serve` (after the entrypoint's own words), one string each;
        `pair_args`: a pair node's multi-node flags (sparkple.pair.plan.node_args)."""
        args: list[str] = []
        for f in fields(self):
            if f.metadata["served"] is not None:
                args += f.metadata["served"].words(getattr(self, f.name))
        args += [
            "--distributed-executor-backend=mp",
            *pair_args,
            f"--gpu-memory-utilization={gpu_memory_utilization}",
        ]
        overrides = self.yarn_overrides(rope)
        if overrides:
            args.append(f"--hf-overrides={json.dumps(overrides, **COMPACT)}")
        return args + list(self.extra_args)


# The flags the plan writes beside the fields' (flag -> how vLLM reads it, who sets it), and one
# it never writes but owns all the same (a KV size would override the budget's fraction).
PLAN_FLAGS: dict[str, tuple[Any, str]] = {
    "--distributed-executor-backend": (str, "the recipe (mp)"),
    "--gpu-memory-utilization": (
        float,
        "the budget (vllm_service_memtotal_reserve_gib and friends)",
    ),
    "--hf-overrides": ("json", "vllm_service_max_model_len (YaRN above 262144)"),
}
BUDGET_OWNED = {
    "--kv-cache-memory-bytes": "the budget (vllm_service_memtotal_reserve_gib and friends)"
}
# The flags a pair's node adds (flag -> how vLLM reads it; None: a switch): written by
# sparkple.pair.plan from the inventory's pair variables, here so that the tables below
# hold them without an import cycle (pair imports ServingError from this module).
PAIR_FLAGS: dict[str, Any] = {
    "--tensor-parallel-size": int,
    "--nnodes": int,
    "--node-rank": int,
    "--master-addr": str,
    "--master-port": int,
    "--headless": None,
}
PAIR_OWNER = "the pair (sparkple_pair and sparkple_pair_*; docs/two-sparks.md)"
# vLLM 0.33 and 0.34's short forms of the pair's flags (engine/arg_utils.py; -tp: PLE_UNSERVABLE
# below).
PAIR_SHORT = {"-n": "--nnodes", "-r": "--node-rank"}

# Every flag the plan may write: flag -> how vLLM reads its value (None: a switch).
ACCEPTED_FLAGS: dict[str, Any] = {
    **{
        flag: kind
        for f in fields(Recipe)
        if f.metadata["served"] is not None
        for flag, kind in f.metadata["served"].flags.items()
    },
    **{flag: kind for flag, (kind, _) in PLAN_FLAGS.items()},
    **PAIR_FLAGS,
}
# Flags the recipe sets itself; extra arguments may not repeat them (the last one would win
# silently). Each maps to what owns it.
OWNED_FLAGS: dict[str, str] = {
    **{
        flag: f.metadata["owner"]
        for f in fields(Recipe)
        if f.metadata["served"] is not None and f.metadata["served"].owned
        for flag in f.metadata["served"].flags
    },
    **{flag: owner for flag, (_, owner) in PLAN_FLAGS.items()},
    **BUDGET_OWNED,
    **{flag: PAIR_OWNER for flag in PAIR_FLAGS},
}
# What the packed-table PLE path cannot serve (the vLLM patch refuses them at start as well):
# a flag, its short form, and why. Sizes are refused above 1, switches whenever given, and the
# tensor-parallel size whenever given (a pair sets it: two Sparks, one rank each).
PLE_UNSERVABLE: dict[str, tuple[str, str]] = {
    "--pipeline-parallel-size": ("-pp", "later pipeline ranks do not see the token ids"),
    "--tensor-parallel-size": (
        "-tp",
        "the packed table serves one rank per Spark (TP 2 is two Sparks as a pair, which sets "
        "the size itself: sparkple_pair; docs/two-sparks.md)",
    ),
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
