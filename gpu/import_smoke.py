"""Import smoke test before the GPU checks: vLLM's platform, and the patched modules import.

Usage: python import_smoke.py {cuda|cpu|cuda-path} RENDERED_DIR [DISTS_JSON]

vLLM's current platform must be CUDA (`cpu`: its CPU platform), and vLLM's CUDA platform
module imports in both modes (from the bundle's sources with the stand-ins in gpu/standins/
for the compiled modules it imports; importing it touches no device). The rendered files are
laid over the package (as the serving container's bind mounts lay them) and every module the
checks import is imported: the patched n-gram embedding, model state, loader filter and the
added packed-table backend, vLLM's model loader's weight iterators, the V2 runner's model
state base, and transformers' Qwen4Exp config; none of them needs vLLM's compiled ops.

`cpu` first runs `cuda-path` in a child process: on a machine without a GPU, the imports the
CUDA run makes, as it makes them. vLLM's current platform is the class its CUDA detection
names (`vllm.platforms.cuda.CudaPlatform`), set before anything resolves it, then the same
modules and the CUDA checks' own (the Triton decode kernel, the harness with a CUDA device),
then the first call that needs a device, which must fail for want of one (and is where it
stops). So a machine's missing package on the CUDA path is found on a CPU.

DISTS_JSON: where to write the installed distributions those imports loaded, the CUDA path's
included (the bundle carries the ones a target lacks).
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
from typing import Any

from harness.lay_over import lay_over_packages, load_loader_filter

CUDA_PLATFORM = "vllm.platforms.cuda"
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
# What vLLM's CUDA detection returns on a machine with a GPU (vllm/platforms/__init__.py,
# cuda_platform_plugin), and what the CUDA checks import beside MODULES.
CUDA_PLATFORM_CLASS = "vllm.platforms.cuda.CudaPlatform"
CUDA_CHECK_MODULES = ("sparkple.runtime.nvfp4_triton", "harness.ple_equivalence")


def lay_over(rendered: Path) -> None:
    """The rendered files first on the packages' paths, the loader filter from its file."""
    load_loader_filter(rendered)
    lay_over_packages(rendered)


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(dist: str) -> list[str]:
    """The distributions `dist` requires here: with no environment marker, or one this Python
    meets (CUDA torch requires cuda-bindings on Linux), extras aside."""
    from packaging.requirements import Requirement

    names = []
    for text in importlib.metadata.requires(dist) or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.append(normalized(requirement.name))
    return names


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
    whether they hold compiled code, whether torch brings them, their files (relative to
    `site`, the directory the distribution is installed in: a venv's own site-packages, or
    one it reads behind it, as the vLLM test venvs read their shared base's) and pins."""
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
        installed = importlib.metadata.distribution(dist)
        files = [str(f) for f in installed.files or []]
        reqs = installed.requires or []
        entry.update(
            version=installed.version,
            site=str(installed.locate_file("")),
            compiled=any(f.endswith((".so", ".pyd")) for f in files),
            with_torch=normalized(dist) in with_torch,
            files=[f for f in files if not f.startswith("..")],
            pins=[normalized(r.split("==")[0]) for r in reqs if "==" in r and ";" not in r],
            requires=[r for r in reqs if ";" not in r],
        )
    return found


# The reference GPU (one H200, sm_90) as vLLM's platform describes it: some modules ask for
# it while they import (quantization/utils/w8a8_utils.py: the device capability), and the
# CUDA path goes on past those questions to the first call that needs the device itself.
REFERENCE_GPU = {"get_device_capability": (9, 0), "get_device_name": "NVIDIA H200",
                 "device_count": 1}  # fmt: skip


def reference_platform(cls: type) -> Any:
    """vLLM's CUDA platform class answering REFERENCE_GPU's questions, each one it is asked
    noted in `asked` (the rest of the class is vLLM's own)."""
    from vllm.platforms.interface import DeviceCapability

    asked: list[str] = []

    def answer(name: str, value: Any):
        def method(_cls: type, *args: object, **kwargs: object) -> object:
            asked.append(name)
            return DeviceCapability(*value) if name == "get_device_capability" else value

        return classmethod(method)

    methods = {name: answer(name, value) for name, value in REFERENCE_GPU.items()}
    return type(f"Reference{cls.__name__}", (cls,), {**methods, "asked": asked})


def cuda_path(rendered: Path) -> str:
    """The CUDA run's imports without a GPU, up to its first device call (module doc)."""
    import vllm.platforms
    from vllm.utils.import_utils import resolve_obj_by_qualname

    platform = reference_platform(resolve_obj_by_qualname(CUDA_PLATFORM_CLASS))
    # what vllm.platforms' lazy `current_platform` returns once resolved, set before anything
    # resolves it (as its resolution on a GPU machine would set it)
    vllm.platforms._current_platform = platform()
    lay_over(rendered)
    for name in MODULES:
        importlib.import_module(name)
    sys.argv[1:2] = ["cuda"]  # the harness takes its device from argv[1], as the checks run it
    for name in CUDA_CHECK_MODULES:
        importlib.import_module(name)
    import torch
    from transformers import Qwen4ExpTextConfig  # noqa: F401

    asked = ", ".join(sorted(set(platform.asked))) or "none"
    try:
        torch.zeros(1, device="cuda")
    except (RuntimeError, AssertionError) as exc:  # torch's two ways of saying "no device"
        first_line = str(exc).strip().splitlines()[0]
        return (
            f"the reference GPU's answers given to {asked}; stopped at the first device "
            f"call: {first_line}"
        )
    raise SystemExit("import smoke: cuda-path found a CUDA device: run the CUDA mode here")


def with_cuda_path(rendered: Path, dists_path: Path | None) -> str | None:
    """Run cuda-path in a child (its platform is not this process's); its line, or None
    when it failed (its error printed)."""
    import os
    import subprocess

    # vLLM's CUDA detection as on a GPU machine (no CPU target), and no device visible:
    # vllm/triton_utils/importing.py then keeps Triton (it allows 0 active drivers where
    # CUDA_VISIBLE_DEVICES is empty), so its kernels' modules import as on the GPU
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, __file__, "cuda-path", str(rendered)]
    if dists_path is not None:
        dists_path.unlink(missing_ok=True)  # the child's are the first written there
        cmd.append(str(dists_path))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        print(f"import smoke: the CUDA path's imports failed:\n{proc.stderr}", file=sys.stderr)
        return None
    return proc.stdout.strip()


def write_dists(path: Path) -> None:
    """This process's loaded distributions, merged into what PATH holds (the child's)."""
    found = json.loads(path.read_text()) if path.is_file() else {}
    found.update(loaded_dists())
    path.write_text(json.dumps(found, indent=2, sort_keys=True))


def main() -> int:
    device, rendered = sys.argv[1], Path(sys.argv[2]).resolve()
    dists_path = Path(sys.argv[3]) if len(sys.argv) > 3 else None
    if device == "cuda-path":
        print(f"import smoke, CUDA path: {CUDA_PLATFORM_CLASS}; {cuda_path(rendered)}")
        if dists_path is not None:
            write_dists(dists_path)
        return 0
    if device == "cpu":
        cuda_line = with_cuda_path(rendered, dists_path)
        if cuda_line is None:
            return 1
        print(cuda_line)
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
        if name in RENDERED and not Path(str(module.__file__)).resolve().is_relative_to(rendered):
            print(f"import smoke: {name} is not the rendered file", file=sys.stderr)
            return 1
    from transformers import Qwen4ExpTextConfig  # noqa: F401

    vllm_modules = sorted(name for name in sys.modules if name.startswith("vllm"))
    print(
        f"import smoke: vLLM platform {type(current_platform).__name__}; CUDA platform module "
        f"imports; patched modules import from {rendered}; {len(vllm_modules)} vLLM modules "
        "loaded"
    )
    if dists_path is not None:
        write_dists(dists_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
