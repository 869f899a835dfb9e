"""NVFP4 (and FP8) codec for packed PLE rows.

A packed NVFP4 row of head_dim values is head_dim/2 bytes of E2M1 codes (low nibble = even
element) followed by head_dim/16 E4M3FN block scales; value = E2M1 x scale x global scale.
Quantization follows ModelOpt: global = amax / (6 x 448), block scale = block amax / (6 x global)
rounded to E4M3, codes rounded to nearest (ties to even) on the E2M1 grid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..geometry import NVFP4_BLOCK

if TYPE_CHECKING:
    import torch

BLOCK = NVFP4_BLOCK  # elements per scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def _e4m3_table() -> np.ndarray:
    """All 256 E4M3FN byte values as float32 (sign bit 7, exponent 6..3 bias 7, mantissa 2..0)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = (codes & 0x7).astype(np.float64)
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = (mantissa / 8.0) * 2.0**-6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3_TABLE = _e4m3_table()
# Signed E2M1 values of the 16 nibbles (bit 3 is the sign).
E2M1_TABLE = np.concatenate([E2M1_GRID, -E2M1_GRID]).astype(np.float32)
# Both nibbles of every byte: [256, 2] (even element, odd element).
_BYTE_PAIRS = np.stack([E2M1_TABLE[np.arange(256) & 0xF], E2M1_TABLE[np.arange(256) >> 4]], axis=1)


def e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """Exact E4M3FN decode of a uint8 array (subnormals included; 0x7F and 0xFF are NaN)."""
    return E4M3_TABLE[np.asarray(codes, dtype=np.uint8)]


def _round_to_grid(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest value of ascending `grid` for x >= 0; ties go to the even index."""
    hi = np.clip(np.searchsorted(grid, x, side="left"), 1, len(grid) - 1)
    lo = hi - 1
    d_lo = x - grid[lo]
    d_hi = grid[hi] - x
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return np.where(x >= grid[-1], len(grid) - 1, np.where(pick_hi, hi, lo))


_E4M3_POSITIVE = E4M3_TABLE[:0x7F].astype(np.float64)  # codes 0x00..0x7E, ascending


def float32_to_e4m3(values: np.ndarray) -> np.ndarray:
    """Round float values to E4M3FN codes (nearest, ties to even; saturating at +-448)."""
    v = np.asarray(values, dtype=np.float64)
    code = _round_to_grid(np.minimum(np.abs(v), E4M3_MAX), _E4M3_POSITIVE).astype(np.uint8)
    return np.where((v < 0) & (code != 0), code | 0x80, code).astype(np.uint8)


def global_scale_for(amax: float) -> float:
    """ModelOpt's weight_scale_2 for a tensor whose largest magnitude is amax (FP32)."""
    return float(np.float32(amax / (E2M1_MAX * E4M3_MAX))) if amax > 0 else 1.0


def quantize_rows(
    values: np.ndarray, global_scale: float | None = None
) -> tuple[np.ndarray, np.ndarray, float]:
    """ModelOpt NVFP4 quantization of float rows [N, head_dim].

    Returns (codes u8[N, head_dim/2], scales u8[N, head_dim/16] as E4M3 bytes, weight_scale_2).
    weight_scale_2 comes from the rows' amax unless given (to quantize a tensor in batches).
    """
    x = np.asarray(values, dtype=np.float32)
    n, dim = x.shape
    if dim % BLOCK:
        raise ValueError(f"head_dim {dim} is not a multiple of {BLOCK}")
    if global_scale is None:
        global_scale = global_scale_for(float(np.max(np.abs(x))) if x.size else 0.0)
    blocks = x.reshape(n, dim // BLOCK, BLOCK)
    block_amax = np.abs(blocks).max(axis=2)
    scales = float32_to_e4m3(block_amax / np.float32(E2M1_MAX * global_scale))
    step = (E4M3_TABLE[scales] * np.float32(global_scale))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(step > 0, np.abs(blocks) / step, 0.0)
    magnitude = _round_to_grid(np.minimum(scaled, E2M1_MAX), E2M1_GRID)
    nibbles = np.where((blocks < 0) & (magnitude != 0), magnitude | 8, magnitude)
    nibbles = nibbles.reshape(n, dim).astype(np.uint8)
    codes = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)
    return codes, scales, global_scale


def dequantize_rows(packed: np.ndarray, global_scale: float, head_dim: int = 160) -> np.ndarray:
    """Decode packed NVFP4 rows u8[..., head_dim/2 + head_dim/16] to float32[..., head_dim]."""
    packed = np.asarray(packed, dtype=np.uint8)
    cw = head_dim // 2
    if packed.shape[-1] != cw + head_dim // BLOCK:
        raise ValueError(
            f"packed rows are {packed.shape[-1]} B wide, expected {cw + head_dim // 16}"
        )
    lead = packed.shape[:-1]
    pairs = _BYTE_PAIRS[packed[..., :cw]].reshape(*lead, head_dim // BLOCK, BLOCK)
    scales = E4M3_TABLE[packed[..., cw:]][..., None]
    decoded: np.ndarray = ((pairs * scales) * np.float32(global_scale)).reshape(*lead, head_dim)
    return decoded


def dequantize_fp8_rows(rows: np.ndarray, scale: float) -> np.ndarray:
    """Decode FP8 (E4M3FN) rows with their per-tensor scale to float32."""
    return E4M3_TABLE[np.asarray(rows, dtype=np.uint8)] * np.float32(scale)


def torch_tables(device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode tables on `device`: E2M1 pairs of every byte [256, 2] and E4M3 values [256].

    A caller that decodes inside a CUDA graph makes them once, before capture, and passes them
    to dequantize_rows_torch: copying them to the device during a capture is not allowed.
    """
    import torch

    return (
        torch.from_numpy(_BYTE_PAIRS.copy()).to(device),
        torch.from_numpy(E4M3_TABLE.copy()).to(device),
    )


_torch_tables: dict[Any, tuple[Any, Any]] = {}


def dequantize_rows_torch(
    packed: torch.Tensor,
    global_scale: float,
    head_dim: int = 160,
    dtype: Any = None,
    *,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Torch version of dequantize_rows; runs on the tensor's device (CPU or CUDA).

    Device work only (no host synchronization), so it may run inside a captured CUDA graph
    when `tables` (from torch_tables) are passed.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed rows must be torch.uint8, got {packed.dtype}")
    cw = head_dim // 2
    if packed.shape[-1] != cw + head_dim // BLOCK:
        raise ValueError(
            f"packed rows are {packed.shape[-1]} B wide, expected {cw + head_dim // 16}"
        )
    if tables is None:
        if packed.device not in _torch_tables:
            _torch_tables[packed.device] = torch_tables(packed.device)
        tables = _torch_tables[packed.device]
    pairs_t, e4m3_t = tables
    lead = packed.shape[:-1]
    pairs = pairs_t[packed[..., :cw].long()].reshape(*lead, head_dim // BLOCK, BLOCK)
    scales = e4m3_t[packed[..., cw:].long()].unsqueeze(-1)
    # A Python number, not a tensor: building a device tensor per call would copy from pageable
    # host memory and make the host wait for the stream.
    out = (pairs * scales) * float(global_scale)
    return out.reshape(*lead, head_dim).to(dtype)
