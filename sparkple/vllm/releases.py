"""What differs between the vLLM releases the adapter serves: one function per release, named
by its minor version, and nothing else of the adapter asks which release it runs in.

0.33 may still run the V1 model runner, which never calls the model state's hooks; 0.34 has
only the V2 runner, and its own disk-backed PLE table, which a packed table replaces. What
the two agree on (the V2 model state's hooks, the shard loading, the TP split) is the
adapter's common code.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.config import VllmConfig
from vllm.version import __version__ as VLLM_VERSION


def _vllm_0_33(config: VllmConfig) -> list[str]:
    if not config.use_v2_model_runner:
        return [
            "the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0 or a feature only it supports): "
            "only the V2 runner's model state runs the host step before each forward"
        ]
    return []


def _vllm_0_34(config: VllmConfig) -> list[str]:
    engram = config.engram_config
    if engram is not None and engram.disk_offload:
        return [
            "--engram-config disk_offload=true: vLLM's own disk offload would read the same "
            "rows beside the packed table; drop disk_offload to serve the packed table, or "
            "unset SPARKPLE_PLE_TABLE_DIR (sparkple_ple_backend: vllm-disk) to serve vLLM's"
        ]
    return []


# The releases a patch profile exists for (templates/vllm/vllm-X.Y), by minor version.
RELEASE_CHECKS: dict[str, Callable[[VllmConfig], list[str]]] = {
    "0.33": _vllm_0_33,
    "0.34": _vllm_0_34,
}


def minor_version(version: str) -> str:
    """`0.34` of `0.34.0`, `0.34.1rc2` or `0.34.1.dev3+gabc`."""
    return ".".join(version.split(".")[:2])


def release_problems(config: VllmConfig, version: str = VLLM_VERSION) -> list[str]:
    """The settings of `config` this vLLM release cannot serve a packed table with."""
    check = RELEASE_CHECKS.get(minor_version(version))
    if check is None:
        return [
            f"vLLM {version}: the packed-table adapter serves vLLM "
            f"{', '.join(RELEASE_CHECKS)}; port a profile to it with `sparkple patch port`"
        ]
    return check(config)
