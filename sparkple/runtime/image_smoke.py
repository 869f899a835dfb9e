"""The serving image's GPU smoke test: run inside the image right after container_runtime pulls
it, before hours go into the checkpoint, the table and the patches.

    docker run --rm --gpus all --entrypoint python3 -v PKG:/opt/sparkple:ro \
        -e PYTHONPATH=/opt/sparkple IMAGE -m sparkple.runtime.image_smoke

Prints one JSON object: the image's torch and its CUDA, whether CUDA sees a GPU, the GPU's name
and compute capability, and whether Triton compiles and runs the packed table's NVFP4 decode
kernel there with the numpy decode's values. Exit 0: all of that holds; 3: no GPU is visible
(the lab, or a container started without --gpus: reported, not a verdict on the image; also an
image without torch there, as the lab's stand-in is); 1: the image cannot serve (no torch, a
torch without CUDA, or the kernel fails or decodes wrong).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

NO_GPU = 3
HEAD_DIM = 160
GLOBAL_SCALE = 0.0123


def check() -> tuple[int, dict[str, Any]]:
    import numpy as np
    import torch

    report: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if torch.version.cuda is None:
        report["problem"] = "the image's torch is built without CUDA"
        return 1, report
    if not torch.cuda.is_available():
        report["problem"] = "no GPU visible in the container"
        return NO_GPU, report
    report["gpu"] = torch.cuda.get_device_name(0)
    report["capability"] = list(torch.cuda.get_device_capability(0))
    from .nvfp4 import dequantize_rows, torch_tables
    from .nvfp4_triton import decode_packed_rows

    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, size=(64, HEAD_DIM // 2 + HEAD_DIM // 16), dtype=np.uint8)
    packed[..., HEAD_DIM // 2 :] &= 0x7E  # block scales: finite E4M3 values
    try:
        device = torch.device("cuda")
        rows = torch.from_numpy(packed).to(device)
        got = decode_packed_rows(
            rows, "nvfp4", HEAD_DIM, GLOBAL_SCALE, torch_tables(device), torch.float32
        )
        want = torch.from_numpy(dequantize_rows(packed, GLOBAL_SCALE, HEAD_DIM))
        same = bool(torch.equal(got.cpu(), want))
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel is the verdict
        report["triton_decode"] = f"{type(exc).__name__}: {exc}"
        report["problem"] = "Triton could not compile or run the NVFP4 decode kernel"
        return 1, report
    report["triton_decode"] = "equal to the numpy decode" if same else "values differ"
    if not same:
        report["problem"] = "the NVFP4 decode kernel decodes wrong on this GPU"
        return 1, report
    return 0, report


def gpu_device_nodes() -> bool:
    """Whether the container was given an NVIDIA GPU (docker --gpus adds its device nodes)."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


def main() -> int:
    try:
        code, report = check()
    except ImportError as exc:
        # without a GPU (the lab's stand-in image has no torch either) that is the report
        code = 1 if gpu_device_nodes() else NO_GPU
        report = {"problem": f"the image lacks {exc.name}: {exc}"}
        if code == NO_GPU:
            report = {
                "problem": "no GPU visible in the container",
                "torch": f"missing ({exc})",
            }
    print(json.dumps(report, sort_keys=True))
    return code


if __name__ == "__main__":
    sys.exit(main())
