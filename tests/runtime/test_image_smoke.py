"""sparkple.runtime.image_smoke, the serving image's GPU smoke test, run as container_runtime
runs it in the image (python3 -m, the package on PYTHONPATH): its verdict and exit status for a
torch without CUDA (this venv's CPU torch), a CUDA torch that sees no GPU (the vLLM test venv's:
exit 3, what the lab reports), and on a CUDA machine the decode kernel's check passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from skip_guard import skip_without_cuda

from harness import wheel_cache

ROOT = Path(__file__).resolve().parents[2]


def smoke(python: Path | str, **env: str) -> tuple[int, dict]:
    done = subprocess.run(
        [str(python), "-m", "sparkple.runtime.image_smoke"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout)


def test_a_torch_without_cuda_cannot_serve() -> None:
    import torch

    assert torch.version.cuda is None, "this venv's torch is the CPU build"
    code, report = smoke(sys.executable)
    assert code == 1 and report["problem"] == "the image's torch is built without CUDA"


def test_no_gpu_visible_is_reported_apart() -> None:
    """A CUDA torch in a container started without a GPU: exit 3, not a verdict on the image."""
    code, report = smoke(wheel_cache.vllm_venv(), CUDA_VISIBLE_DEVICES="")
    assert code == 3, report
    assert report["problem"] == "no GPU visible in the container" and report["torch_cuda"]


@pytest.mark.gpu
def test_on_a_gpu_the_decode_kernel_runs_and_decodes_right() -> None:
    skip_without_cuda()
    python = os.environ.get("SPARKPLE_VLLM_PYTHON") or str(wheel_cache.vllm_venv())
    code, report = smoke(python)
    assert code == 0, report
    assert report["triton_decode"] == "equal to the numpy decode" and len(report["capability"]) == 2


def test_an_image_without_torch_and_without_a_gpu_reports_no_gpu() -> None:
    """The lab's stand-in image (numpy, no torch) run without --gpus: exit 3, as preflight
    reports a missing GPU in the lab; the package alone on the path, no site-packages."""
    done = subprocess.run(
        [sys.executable, "-S", "-m", "sparkple.runtime.image_smoke"],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 3, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["problem"] == "no GPU visible in the container" and "missing" in report["torch"]
