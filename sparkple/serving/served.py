"""How a recipe field reaches `vllm serve`: the knobs' choices, the Served record (the flags a
field writes and the words for a value) and the words each knob writes. sparkple.serving.recipe
declares the fields with them.

Standard library only: the role runs it with the host's python3 (`sparkple serving-plan`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The model's native context and the longest YaRN context the recipe allows.
NATIVE_MAX_MODEL_LEN = 262_144
YARN_MAX_MODEL_LEN = 524_288
KV_CACHE_DTYPES = ("auto", "fp8")
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")
# vLLM 0.33 and 0.34's CUDAGraphMode names.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
SAFETENSORS_LOAD_STRATEGIES = ("lazy", "eager", "prefetch")
# The strategies vLLM 0.33 and 0.34's loaders read the PLE row shards with (only lazy asks its
# per-name skip before it reads a tensor), and why; the vLLM patch refuses them at start as well.
ROW_SHARD_READING_STRATEGIES = {
    "eager": "reads each whole file, then filters the names",
    "prefetch": "reads every file into the page cache",
}
MAX_MTP_DEPTH = 8
# The PLE table's backends (the site knob sparkple_ple_backend, the role's
# vllm_service_ple_backend) -> the --engram-config the plan writes for it. packed: sparkple's
# packed table on NVMe, read through mmap by the patched vLLM (selected by SPARKPLE_PLE_TABLE_DIR,
# no --engram-config). vLLM's own, for A/B runs on the same unit and checkpoint: vllm-disk, its
# disk offload (vLLM 0.34 and later; it takes precedence over cpu_offload), and vllm-pinned, its
# pinned-host table (the whole table pinned in host memory: the budget counts it).
PLE_BACKENDS: dict[str, dict[str, bool]] = {
    "packed": {},
    "vllm-disk": {"disk_offload": True},
    "vllm-pinned": {"cpu_offload": True},
}
PLE_BACKEND_KNOB = "sparkple_ple_backend"
# The first vLLM with the disk offload (EngramConfig.disk_offload), and where the patch profiles
# are (the host's package copy holds templates/ too): a profile's vllm_version says its vLLM.
DISK_OFFLOAD_SINCE = (0, 34)
PROFILES_DIR = Path(__file__).resolve().parents[2] / "templates" / "vllm"

# How JSON-valued flags are written (one word, no spaces).
COMPACT: dict[str, Any] = {"separators": (",", ":"), "sort_keys": False}


@dataclass(frozen=True)
class Served:
    """How one field reaches `vllm serve`: the flags it may write (flag -> how vLLM reads the
    value: str, int, float, "json", or None for a switch) and the words for a value."""

    flags: dict[str, Any]
    words: Callable[[Any], list[str]]
    # False: extra arguments may give these flags while the field writes none (OWNED_FLAGS
    # leaves them out; Recipe.check_extra_args refuses them once it writes one)
    owned: bool = True


def one(flag: str, kind: Any = str, *, unless_empty: bool = False) -> Served:
    """`flag=value` (left out for an empty value when unless_empty)."""
    return Served({flag: kind}, lambda v: [] if unless_empty and not v else [f"{flag}={v}"])


def mtp(depth: int) -> list[str]:
    spec = {"method": "mtp", "num_speculative_tokens": depth}
    return [f"--speculative-config={json.dumps(spec, **COMPACT)}"] if depth else []


def tool_parser(parser: str) -> list[str]:
    return ["--enable-auto-tool-choice", f"--tool-call-parser={parser}"] if parser else []


def chunked_prefill(on: bool) -> list[str]:
    return ["--enable-chunked-prefill" if on else "--disable-chunked-prefill"]


def load_strategy(strategy: str) -> list[str]:
    return ["--load-format=safetensors", f"--safetensors-load-strategy={strategy}"]


def cudagraph_mode(mode: str) -> list[str]:
    return ["--compilation-config=" + json.dumps({"cudagraph_mode": mode}, **COMPACT)]


def engram_config(backend: str) -> list[str]:
    config = PLE_BACKENDS.get(backend)
    return [f"--engram-config={json.dumps(config, **COMPACT)}"] if config else []


def profile_vllm_version(profile: str) -> tuple[int, int] | None:
    """The vLLM (major, minor) of a patch profile: its profile.yml's vllm_version (a profile is
    named, under templates/vllm/, or given as a path), else its name's `vllm-X.Y`; None when
    neither says (no profile: the image's vLLM unpatched)."""
    if not profile:
        return None
    where = Path(profile) if "/" in profile else PROFILES_DIR / profile
    found = None
    if (where / "profile.yml").is_file():
        text = (where / "profile.yml").read_text()
        found = re.search(r"^vllm_version:\s*[\"']?(\d+)\.(\d+)", text, re.M)
    found = found or re.search(r"\bvllm-(\d+)\.(\d+)", where.name)
    if found:
        return int(found.group(1)), int(found.group(2))
    return None


def from_var(name: str, default: Any = None, served: Served | None = None, owner: str = "") -> Any:
    """A recipe field read from role variable `name` (owner: who sets its flags, when that is
    not the variable itself)."""
    meta = {"var": name, "served": served, "owner": owner or name}
    if default is None:
        return field(metadata=meta)
    if isinstance(default, tuple):
        return field(default_factory=tuple, metadata=meta)
    return field(default=default, metadata=meta)
