"""The forward's decode of packed PLE rows in one Triton pass, bit-identical to the torch path.

`nvfp4.dequantize_rows_torch` decodes a step's packed rows with table lookups through
int64 index tensors and float32 intermediates (about 8 kernels and 14 times the bytes the
result needs). This kernel reads each packed byte once and writes the model dtype directly:
per output element, E2M1 value (from the same [256, 2] byte-pair table) x E4M3 block scale
(from the same [256] table), times the global scale, in float32 and in that order, then one
cast (round to nearest even, written out for bfloat16), so its result equals the torch
path's bit for bit. FP8 rows (E4M3 bytes, the per-tensor scale applied by vLLM's PLE layer
afterwards) are converted exactly to the model dtype the same way.

Imports Triton: only used where the rows are on a CUDA device (the torch path stays for CPU);
tests run it on CPU with TRITON_INTERPRET=1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch

ROWS_PER_PROGRAM = 16


@triton.jit
def _decode_nvfp4(
    packed_ptr,
    pairs_ptr,
    e4m3_ptr,
    out_ptr,
    global_scale,
    n_rows,
    ROW_BYTES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (rows < n_rows) & (cols < HEAD_DIM)
    base = rows.to(tl.int64) * ROW_BYTES
    # low nibble: the even element, high nibble: the odd one (the pair table holds both)
    byte = tl.load(packed_ptr + base + cols // 2, mask=mask, other=0).to(tl.int32)
    value = tl.load(pairs_ptr + byte * 2 + cols % 2, mask=mask, other=0.0)
    code = tl.load(packed_ptr + base + HEAD_DIM // 2 + cols // 16, mask=mask, other=0)
    scale = tl.load(e4m3_ptr + code.to(tl.int32), mask=mask, other=0.0)
    out = (value * scale) * global_scale
    target = out_ptr + rows.to(tl.int64) * HEAD_DIM + cols
    if OUT_BF16:
        tl.store(target, _bfloat16_bits(out), mask=mask)
    else:
        tl.store(target, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bfloat16_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest even as torch's cast rounds (written out,
    so that the interpreter, which truncates, and the GPU agree); NaN stays a quiet NaN."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, (bits >> 16) | 0x40, rounded).to(tl.uint16)


@triton.jit
def _decode_fp8(
    packed_ptr,
    e4m3_ptr,
    out_ptr,
    n_values,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_values
    code = tl.load(packed_ptr + offsets, mask=mask, other=0).to(tl.int32)
    value = tl.load(e4m3_ptr + code, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)


def decode_packed_rows(
    packed: torch.Tensor,
    quant: str,
    head_dim: int,
    global_scale: float,
    tables: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Packed rows uint8[..., row_width] -> dtype[..., head_dim] on their device, one kernel.

    nvfp4: the decoded values (E2M1 x block scale x global scale); fp8: the E4M3 values,
    exactly (the layer applies the per-tensor scale). tables: (byte pairs [256, 2], E4M3
    [256]) as sparkple.runtime.nvfp4.torch_tables makes them, float32, on the rows' device.
    """
    import torch

    if packed.dtype != torch.uint8 or not packed.is_contiguous():
        raise ValueError("packed rows must be a contiguous torch.uint8 tensor")
    lead = packed.shape[:-1]
    out = torch.empty((*lead, head_dim), dtype=dtype, device=packed.device)
    bf16 = dtype == torch.bfloat16
    pairs, e4m3 = tables
    if quant == "nvfp4":
        row_bytes = head_dim // 2 + head_dim // 16
        if packed.shape[-1] != row_bytes:
            raise ValueError(f"packed rows are {packed.shape[-1]} B wide, expected {row_bytes}")
        n_rows = packed.numel() // row_bytes
        if n_rows:
            grid = (triton.cdiv(n_rows, ROWS_PER_PROGRAM),)
            _decode_nvfp4[grid](
                packed,
                pairs,
                e4m3,
                out.view(torch.uint16) if bf16 else out,
                float(global_scale),
                n_rows,
                ROW_BYTES=row_bytes,
                HEAD_DIM=head_dim,
                BLOCK_D=triton.next_power_of_2(head_dim),
                ROWS=ROWS_PER_PROGRAM,
                OUT_BF16=bf16,
            )
    elif quant == "fp8":
        if packed.shape[-1] != head_dim:
            raise ValueError(f"FP8 rows are {packed.shape[-1]} B wide, expected {head_dim}")
        n_values = packed.numel()
        if n_values:
            block = 1024
            _decode_fp8[(triton.cdiv(n_values, block),)](packed, e4m3, out, n_values, BLOCK=block)
    else:
        raise ValueError(f"quant must be nvfp4 or fp8, got {quant!r}")
    return out
