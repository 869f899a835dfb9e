"""The torch paths on a CUDA device give the same results as on the CPU (skipped without one).

torch itself is in the tools venv: without it this module is skipped at import, which
tests/skip_guard.py fails under CI=true.
"""

from __future__ import annotations

import numpy as np
import pytest
from skip_guard import NO_CUDA

from sparkple.builder.synth import make_config
from sparkple.geometry import PLEGeometry
from sparkple.runtime.ngram import row_ids, row_ids_torch
from sparkple.runtime.nvfp4 import dequantize_rows, dequantize_rows_torch

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
]


def test_row_ids_on_cuda_equal_numpy():
    g = PLEGeometry.from_config(make_config(vocab_base=20_000_000))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, g.vocab_size, size=32_768)
    ids[rng.integers(0, ids.size, size=200)] = g.eos_token_id
    qsl = np.array([0, 5, 2048, 30_000, 32_768])
    ctx = rng.integers(0, g.vocab_size, size=(4, 2))
    dev = [torch.from_numpy(a).cuda() for a in (ids, qsl, ctx)]
    got = row_ids_torch(*dev, g)
    assert got.is_cuda and np.array_equal(got.cpu().numpy(), row_ids(ids, qsl, ctx, g))


def test_dequantize_on_cuda_equals_numpy():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(4096, 16, 90), dtype=np.uint8)
    packed[..., 80:] &= 0x7E
    got = dequantize_rows_torch(torch.from_numpy(packed).cuda(), 0.0123)
    assert got.is_cuda and np.array_equal(got.cpu().numpy(), dequantize_rows(packed, 0.0123))
    bf16 = dequantize_rows_torch(torch.from_numpy(packed).cuda(), 0.0123, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
