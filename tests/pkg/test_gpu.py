"""The torch paths on a CUDA device give the same results as on the CPU (skipped without one).

torch itself is in the tools venv: without it this module is skipped at import, which
tests/skip_guard.py fails under CI=true.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from skip_guard import NO_CUDA

from sparkple.runtime.nvfp4 import dequantize_rows, dequantize_rows_torch

REPO = Path(__file__).resolve().parents[2]

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
]


def test_row_ids_on_cuda_equal_numpy():
    # the GPU check's torch tier holds the comparison (on the device, and equal to numpy)
    spec = importlib.util.spec_from_file_location("torch_tier", REPO / "gpu" / "torch_tier.py")
    assert spec is not None and spec.loader is not None
    torch_tier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_tier)
    assert torch_tier.check_row_ids(torch.device("cuda")) == {"row ids": True}


def test_dequantize_on_cuda_equals_numpy():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(4096, 16, 90), dtype=np.uint8)
    packed[..., 80:] &= 0x7E
    got = dequantize_rows_torch(torch.from_numpy(packed).cuda(), 0.0123)
    assert got.is_cuda and np.array_equal(got.cpu().numpy(), dequantize_rows(packed, 0.0123))
    bf16 = dequantize_rows_torch(torch.from_numpy(packed).cuda(), 0.0123, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
