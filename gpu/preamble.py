"""What the GPU check runs on, printed before anything runs, and the refusals (exit 2).

Usage: python preamble.py {cuda|cpu} RESULT_JSON [NEEDS_JSON]

Prints the GPU, its driver, the CUDA version torch was built for, and the torch, triton,
vLLM and Python versions; refuses, with one line and exit 2: a Python outside the vLLM
wheel's range, a torch that does not import, a torch without CUDA, a GPU torch cannot use
(no NVIDIA GPU, or a driver older than torch's CUDA build needs), and compiled packages the
checks import that do not import here (NEEDS_JSON, written by the bundle: those it carries,
laid on the path by carried.py, and those that must be the machine's own, each with why).
`cpu` (the smoke mode) needs torch only. Torch and triton other than vLLM 0.33.0's pins are
accepted and reported. Standard library only until torch is imported.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

# vLLM 0.33.0's Requires-Python and its torch pin (PyPI's torch 2.14.0 is a CUDA 13.0 build).
PYTHON_RANGE = ((3, 11), (3, 15))
VLLM_TORCH_PIN = "2.14.0"
EXIT_USAGE = 2


class Refusal(Exception):
    """The check cannot run on this machine; the message says why and what to do."""


def check_python(version: tuple[int, int]) -> None:
    low, high = PYTHON_RANGE
    if not low <= version < high:
        raise Refusal(
            f"Python {version[0]}.{version[1]} is outside vLLM 0.33.0's range "
            f"(>={low[0]}.{low[1]}, <{high[0]}.{high[1]}): set PYTHON to another interpreter"
        )


def check_needs(needs: dict[str, dict]) -> None:
    """The compiled packages the checks import must import here: the bundle's (carried.py
    laid them on the path) or the machine's own (the target has them, or they cannot be
    carried)."""
    missing = []
    for module, need in sorted(needs.items()):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(f"{need['requirement']} ({need['why']})")
    if missing:
        # no `pip install` advice: the machine the bundle is for is offline
        raise Refusal(
            f"this Python lacks compiled packages the checks import: {'; '.join(missing)}: "
            "add them to this Python (wheels for its platform and Python version), build the "
            "bundle for a target without them (`make gpu-bundle TARGET=ARCH-pyX.Y`), or run "
            "the check in the serving image"
        )


def nvidia_smi() -> dict[str, str]:
    """GPU name and driver version from nvidia-smi (empty when there is none)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    proc = subprocess.run(query, capture_output=True, text=True, timeout=30)
    if proc.returncode or not proc.stdout.strip():
        return {}
    name, _, driver = proc.stdout.splitlines()[0].rpartition(",")
    return {"gpu": name.strip(), "driver": driver.strip()}


def version_of(dist: str, module: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return str(importlib.import_module(module).__version__)
    except Exception:
        return None


def vllm_version() -> tuple[str | None, str | None]:
    """vLLM's version and where its package comes from (the sources on the path, or the
    installed one)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return None, None
    try:
        from vllm.version import __version__
    except Exception:
        return None, spec.origin
    return str(__version__), spec.origin


def collect(device: str, needs: dict[str, dict]) -> dict:
    info: dict = {"python": sys.version.split()[0], "executable": sys.executable}
    check_python(sys.version_info[:2])
    info.update(nvidia_smi())
    if device == "cuda" and "gpu" not in info:
        raise Refusal("no NVIDIA GPU here (nvidia-smi found none): run it on a CUDA machine")
    try:
        import torch
    except ImportError as exc:
        raise Refusal(f"{sys.executable} cannot import torch ({exc}): set PYTHON") from None
    info["torch"] = torch.__version__
    info["torch_cuda_build"] = torch.version.cuda
    info["triton"] = version_of("triton", "triton")
    info["vllm"], info["vllm_file"] = vllm_version()
    info["torch_is_vllm_pin"] = torch.__version__.split("+")[0] == VLLM_TORCH_PIN
    if device == "cuda":
        if torch.version.cuda is None:
            raise Refusal(
                f"torch {torch.__version__} is a build without CUDA: set PYTHON to a Python "
                "with CUDA torch, or run in the serving image"
            )
        if not torch.cuda.is_available():
            raise Refusal(
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot use the GPU "
                f"with driver {info.get('driver', '?')}: it needs a driver for CUDA "
                f"{torch.version.cuda} or later"
            )
        info["torch_device"] = torch.cuda.get_device_name()
    check_needs(needs)
    return info


def main() -> int:
    device, result_path = sys.argv[1], Path(sys.argv[2])
    needs = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else {}
    try:
        info = collect(device, needs)
    except Refusal as refusal:
        print(f"gpu-check: {refusal}", file=sys.stderr)
        return EXIT_USAGE
    result_path.write_text(json.dumps(info, indent=2))
    pins = "" if info["torch_is_vllm_pin"] else f" (vLLM 0.33.0 pins torch {VLLM_TORCH_PIN})"
    print(
        f"gpu-check: {info.get('gpu', 'no GPU')}, driver {info.get('driver', '-')}; "
        f"Python {info['python']}; torch {info['torch']} (CUDA build {info['torch_cuda_build']})"
        f"{pins}; triton {info['triton']}; vLLM {info['vllm']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
