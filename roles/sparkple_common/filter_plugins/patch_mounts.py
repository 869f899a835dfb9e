"""patch_mounts: the bind mounts that lay patched vLLM files over the image's vllm package.

Both the patch role (from its fresh manifest) and the release role (from a recorded release)
mount the same way: each file of the patch directory over the same relative path in vllm.
"""

from __future__ import annotations

from collections.abc import Callable


def patch_mounts(paths: list[str], patch_dir: str, vllm_path: str) -> list[dict[str, str]]:
    paths = list(paths)
    if paths and not vllm_path:
        raise ValueError("patch_mounts needs the vllm package path inside the image")
    return [{"src": f"{patch_dir}/{path}", "dest": f"{vllm_path}/{path}"} for path in paths]


class FilterModule:
    def filters(self) -> dict[str, Callable[..., object]]:
        return {"patch_mounts": patch_mounts}
