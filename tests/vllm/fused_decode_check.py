"""Run with TRITON_INTERPRET=1 in the vLLM test venv (which has Triton): the fused decode of
sparkple.runtime.nvfp4_triton against the torch decode, bit for bit. Prints one JSON object."""

from __future__ import annotations

import json

import numpy as np
import torch

from sparkple.runtime.nvfp4 import dequantize_rows_torch, torch_tables
from sparkple.runtime.nvfp4_triton import decode_packed_rows


def bits(t: torch.Tensor) -> np.ndarray:
    view = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype]
    return t.contiguous().view(view).numpy()


def nvfp4_rows(rng, tokens: int, heads: int, head_dim: int) -> torch.Tensor:
    codes = rng.integers(0, 256, size=(tokens, heads, head_dim // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, size=(tokens, heads, head_dim // 16), dtype=np.uint8)
    scales[..., 0] = rng.integers(1, 8, size=(tokens, heads))  # subnormal E4M3 scales
    scales[0] = 0  # a token of zero scales
    scales[1, :, -1] = 0x7E  # the largest finite E4M3 scale (448)
    return torch.from_numpy(np.concatenate([codes, scales], axis=-1))


def main() -> None:
    rng = np.random.default_rng(9)
    tables = torch_tables("cpu")
    result: dict[str, object] = {}
    for head_dim, tokens in ((160, 37), (32, 5)):
        packed = nvfp4_rows(rng, tokens, 16, head_dim)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            for scale in (0.0123, 2.0**-20, 1.0):
                want = dequantize_rows_torch(packed, scale, head_dim, dtype=dtype, tables=tables)
                got = decode_packed_rows(packed, "nvfp4", head_dim, scale, tables, dtype)
                key = f"nvfp4/{head_dim}/{name}/{scale}"
                result[key] = {
                    "shape_equal": list(got.shape) == list(want.shape),
                    "bits_equal": bool(np.array_equal(bits(got), bits(want))),
                    "nonzero": bool((want != 0).any()),
                }
    fp8 = rng.integers(0, 256, size=(23, 16, 160), dtype=np.uint8)
    fp8[(fp8 & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    fp8[0, 0, :8] = [0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE]  # zeros, subnormals, max
    packed = torch.from_numpy(fp8)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        want = packed.view(torch.float8_e4m3fn).to(dtype)
        got = decode_packed_rows(packed, "fp8", 160, 1.0, tables, dtype)
        result[f"fp8/{name}"] = {
            "shape_equal": list(got.shape) == list(want.shape),
            "bits_equal": bool(np.array_equal(bits(got), bits(want))),
            "nonzero": bool((want != 0).any()),
        }
    empty = decode_packed_rows(packed[:0], "fp8", 160, 1.0, tables, torch.float32)
    result["empty_shape"] = list(empty.shape)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
