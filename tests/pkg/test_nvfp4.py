"""NVFP4 codec: exact E4M3 decode, decode against an independent per-element decode, quantize."""

import math
import struct

import numpy as np
import pytest

from sparkple.runtime import nvfp4


def e4m3_reference(byte: int) -> float:
    """Per-element E4M3FN decode written from the format's definition."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0**-9  # subnormal: 0.mmm x 2^-6
    return sign * (8 + man) * 2.0 ** (exp - 10)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def decode_reference(row: bytes, gs: float, head_dim: int) -> list[float]:
    out = []
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]  # noqa: E731
    for j in range(head_dim):
        byte = row[j // 2]
        nib = byte & 0xF if j % 2 == 0 else byte >> 4
        mag = E2M1[nib & 7] * (-1.0 if nib & 8 else 1.0)
        scale = e4m3_reference(row[head_dim // 2 + j // 16])
        out.append(f32(f32(mag * scale) * f32(gs)))
    return out


def test_e4m3_table_is_exact_for_all_bytes():
    table = nvfp4.e4m3_to_float32(np.arange(256, dtype=np.uint8))
    for b in range(256):
        ref = e4m3_reference(b)
        if math.isnan(ref):
            assert math.isnan(table[b]), b
        else:
            assert table[b] == ref, b
    assert table[1] == 2.0**-9 and table[0x7E] == 448.0 and np.isnan(table[0x7F])


def test_e4m3_matches_torch_float8():
    torch = pytest.importorskip("torch")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = nvfp4.e4m3_to_float32(codes.numpy())
    theirs = codes.view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(ours, theirs, equal_nan=True)
    # and rounding float -> e4m3 agrees with torch's cast (round to nearest even)
    vals = np.random.default_rng(1).standard_normal(20000).astype(np.float32) * 60
    vals = np.concatenate(
        [vals, nvfp4.E4M3_TABLE[:0x7F] * 1.0000001, np.array([1e-4, 3e-3], dtype=np.float32)]
    )
    want = torch.from_numpy(vals).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(nvfp4.float32_to_e4m3(vals), want)


@pytest.mark.parametrize("head_dim", [160, 32])
def test_decode_matches_per_element_reference_with_subnormal_scales(head_dim):
    rng = np.random.default_rng(7)
    n = 40
    codes = rng.integers(0, 256, size=(n, head_dim // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, size=(n, head_dim // 16), dtype=np.uint8)
    scales[:, 0] = rng.integers(1, 8, size=n)  # subnormal E4M3 scales
    scales[0, :] = 0
    packed = np.concatenate([codes, scales], axis=1)
    gs = 0.0123
    got = nvfp4.dequantize_rows(packed, gs, head_dim)
    for i in range(n):
        assert got[i].tolist() == decode_reference(packed[i].tobytes(), gs, head_dim)


def test_torch_decode_equals_numpy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, size=(5, 7, 90), dtype=np.uint8)
    packed[..., 80:] &= 0x7E  # no NaN scales
    a = nvfp4.dequantize_rows(packed, 0.5)
    b = nvfp4.dequantize_rows_torch(torch.from_numpy(packed), 0.5)
    assert b.shape == (5, 7, 160) and np.array_equal(a, b.numpy())
    assert (
        nvfp4.dequantize_rows_torch(torch.from_numpy(packed), 0.5, dtype=torch.bfloat16).dtype
        == torch.bfloat16
    )


def test_quantize_modelopt_convention_and_roundtrip():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 160)).astype(np.float32)
    x[3, :16] = 0.0  # an all-zero block
    codes, scales, gs = nvfp4.quantize_rows(x)
    assert codes.shape == (64, 80) and scales.shape == (64, 10)
    assert gs == np.float32(np.abs(x).max() / (6 * 448))
    assert scales[3, 0] == 0
    y = nvfp4.dequantize_rows(np.concatenate([codes, scales], axis=1), gs)
    # every value lands on the nearest grid point of its block: error <= half the widest step
    blocks_amax = np.abs(x).reshape(64, 10, 16).max(axis=2)
    tol = np.repeat(blocks_amax / 6 * 1.0 * 1.07, 16, axis=1)  # step 2 at the top of the grid
    assert np.all(np.abs(y - x) <= tol + 1e-6)
    assert np.all(y[3, :16] == 0)
    # the largest element of a block maps to +-6 (or near it, after E4M3 rounding of the scale)
    assert np.corrcoef(x.ravel(), y.ravel())[0, 1] > 0.98


def test_e2m1_rounding_ties_to_even():
    # amax 6 x 448 x 2^-10 makes the global scale 2^-10 and the block step 7/16, both exact,
    # so these values sit exactly on midpoints of the E2M1 grid
    step = 448 * 2.0**-10
    x = np.zeros((1, 16), dtype=np.float32)
    x[0, :8] = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32) * step
    x[0, 8:] = -x[0, :8]
    codes, scales, gs = nvfp4.quantize_rows(x)
    assert gs == 2.0**-10 and nvfp4.e4m3_to_float32(scales)[0, 0] == 448
    y = nvfp4.dequantize_rows(np.concatenate([codes, scales], axis=1), gs, head_dim=16)[0] / step
    assert y[:8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert y[8:].tolist() == [-6.0, 0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
