"""Import smoke test before the GPU checks: vLLM's platform, and the patched modules import.

Usage: python import_smoke.py {cuda|cpu} RENDERED_DIR [DISTS_JSON]

vLLM's current platform must be CUDA (`cpu`: its CPU platform), and vLLM's CUDA platform
module imports in both modes (from the bundle's sources with the stand-ins in gpu/standins/
for the compiled modules it imports; importing it touches no device). The rendered files are
laid over the package (as the serving container's bind mounts lay them) and every module the
checks import is imported: the patched n-gram embedding, model state, loader filter and the
added packed-table backend, vLLM's model loader's weight iterators, the V2 runner's model
state base, and transformers' Qwen4Exp config; none of them needs vLLM's compiled ops.
DISTS_JSON: where to write the installed distributions those imports loaded (the bundle
copies the pure-Python ones and lists the compiled ones).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import re
import sys
from pathlib import Path

PATCHED_PACKAGES = ("vllm.models.qwen4_exp.nvidia", "vllm.models.qwen4_exp.common")
CUDA_PLATFORM = "vllm.platforms.cuda"
LOADER_FILTER = "vllm.model_executor.model_loader.ep_weight_filter"
MODULES = (
    "vllm.models.qwen4_exp.nvidia.ngram_embedding",
    "vllm.models.qwen4_exp.nvidia.model_state",
    "vllm.models.qwen4_exp.common.ple_mmap_embedding",
    "vllm.model_executor.model_loader.weight_utils",
    "vllm.v1.worker.gpu.model_states.mamba_hybrid",
    "vllm.distributed",
)
# The first three come from the rendered files.
RENDERED = MODULES[:3]


def lay_over(rendered: Path) -> None:
    """The rendered files first on the packages' paths, the loader filter from its file."""
    path = rendered / "model_executor" / "model_loader" / "ep_weight_filter.py"
    spec = importlib.util.spec_from_file_location(LOADER_FILTER, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[LOADER_FILTER] = module
    spec.loader.exec_module(module)
    for package in PATCHED_PACKAGES:
        sub = package.split(".", 1)[1].replace(".", "/")
        importlib.import_module(package).__path__.insert(0, str(rendered / sub))


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(dist: str) -> list[str]:
    """The distributions `dist` requires unconditionally (no environment marker)."""
    reqs = importlib.metadata.requires(dist) or []
    return [normalized(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0]) for r in reqs if ";" not in r]


def closure(dist: str) -> set[str]:
    """dist and everything it requires, recursively (the installed ones)."""
    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = normalized(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            todo += requirement_names(name)
    return seen


def loaded_dists() -> dict[str, dict]:
    """The installed distributions whose modules the imports loaded: version, modules,
    whether they hold compiled code, whether torch brings them, their files and pins."""
    owners = importlib.metadata.packages_distributions()
    tops = sorted({name.split(".")[0] for name in list(sys.modules)})
    with_torch = closure("torch")
    found: dict[str, dict] = {}
    for top in tops:
        for dist in owners.get(top, []):
            entry = found.setdefault(dist, {"modules": []})
            if top not in entry["modules"]:
                entry["modules"].append(top)
    for dist, entry in found.items():
        files = [str(f) for f in importlib.metadata.files(dist) or []]
        reqs = importlib.metadata.requires(dist) or []
        entry.update(
            version=importlib.metadata.version(dist),
            compiled=any(f.endswith((".so", ".pyd")) for f in files),
            with_torch=normalized(dist) in with_torch,
            files=[f for f in files if not f.startswith("..")],
            pins=[normalized(r.split("==")[0]) for r in reqs if "==" in r and ";" not in r],
        )
    return found


def main() -> int:
    device, rendered = sys.argv[1], Path(sys.argv[2]).resolve()
    from vllm.platforms import current_platform

    want = current_platform.is_cuda() if device == "cuda" else current_platform.is_cpu()
    if not want:
        print(
            f"import smoke: vLLM's current platform is {type(current_platform).__name__}, "
            f"not {device}",
            file=sys.stderr,
        )
        return 1
    importlib.import_module(CUDA_PLATFORM)
    lay_over(rendered)
    for name in MODULES:
        module = importlib.import_module(name)
        if name in RENDERED and not Path(module.__file__).resolve().is_relative_to(rendered):
            print(f"import smoke: {name} is not the rendered file", file=sys.stderr)
            return 1
    from transformers import Qwen4ExpTextConfig  # noqa: F401

    vllm_modules = sorted(name for name in sys.modules if name.startswith("vllm"))
    print(
        f"import smoke: vLLM platform {type(current_platform).__name__}; CUDA platform module "
        f"imports; patched modules import from {rendered}; {len(vllm_modules)} vLLM modules "
        "loaded"
    )
    if len(sys.argv) > 3:
        Path(sys.argv[3]).write_text(json.dumps(loaded_dists(), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
