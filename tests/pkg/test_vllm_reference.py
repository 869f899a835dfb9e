"""Cross-check with vLLM 0.33.0 itself: its hash, layout and NVFP4 decode, from the PyPI wheel.

The wheel is fetched once with `pip download --no-deps` into the git-ignored .cache/; the
functions that compute the layout, the row ids and the NVFP4 CPU decode are compiled from its
source and run on CPU next to ours. Skipped when the wheel cannot be had.
"""

from __future__ import annotations

import ast
import struct
import zipfile

import numpy as np
import pytest

from harness.wheel_cache import vllm_wheel
from sparkple.builder.synth import make_config
from sparkple.geometry import PLEGeometry
from sparkple.runtime.ngram import row_ids

torch = pytest.importorskip("torch")

SOURCE = "vllm/models/qwen4_exp/nvidia/ngram_embedding.py"
NVFP4_SOURCE = "vllm/model_executor/layers/quantization/utils/nvfp4_emulation_utils.py"
METHODS = {
    "_splitmix64",
    "_is_prime_64",
    "_nth_prime_after",
    "_make_layer_multipliers",
    "_make_vocab_layout",
    "_shift_precompute",
    "_shift_apply",
    "compute_ngram_ids",
}


@pytest.fixture(scope="module")
def wheel():
    try:
        return vllm_wheel()
    except RuntimeError as exc:
        pytest.skip(f"the vllm==0.33.0 wheel is not available (no PyPI access?): {exc}")


@pytest.fixture(scope="module")
def vllm_hash(wheel):
    source = zipfile.ZipFile(wheel).read(SOURCE).decode()
    tree = ast.parse(source)
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen4ExpNGramEmbedding"
    )
    body: list[ast.stmt] = [
        n
        for n in cls.body
        if isinstance(n, ast.Assign) or (isinstance(n, ast.FunctionDef) and n.name in METHODS)
    ]
    assert {n.name for n in body if isinstance(n, ast.FunctionDef)} == METHODS
    module = ast.Module(
        body=[ast.ClassDef(name="VllmHash", bases=[], keywords=[], body=body, decorator_list=[])],
        type_ignores=[],
    )
    ast.fix_missing_locations(module)
    namespace = {"torch": torch, "ple_ngram_ids": None}
    exec(compile(module, f"{wheel.name}/{SOURCE}", "exec"), namespace)
    return namespace["VllmHash"]


def vllm_instance(cls, g: PLEGeometry):
    obj = cls.__new__(cls)
    obj.ngram_size, obj.heads_per_ngram, obj.eos_token_id = (
        g.ngram_size,
        g.heads_per_ngram,
        g.eos_token_id,
    )
    obj.layer_multipliers = torch.tensor(g.multipliers, dtype=torch.long)
    obj.ngram_heads_vocab_sizes = torch.tensor(g.head_sizes, dtype=torch.long)
    obj.ngram_heads_offsets = torch.tensor(g.head_offsets, dtype=torch.long)
    return obj


CONFIGS = {
    "real": make_config(vocab_base=20_000_000),
    "small": make_config(vocab_base=1000, eos_token_id=5, vocab_size=11, hash_seed=7),
    "4gram": make_config(vocab_base=300, ngram_size=4, heads_per_ngram=2, head_dim=32),
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("layer", [0, 1])
def test_layout_and_multipliers_match_vllm(vllm_hash, name, layer):
    cfg = CONFIGS[name]
    g = PLEGeometry.from_config(cfg, ple_layer=layer)
    t = cfg["text_config"]
    heads = (t["ngram_size"] - 1) * t["heads_per_ngram"]
    assert list(g.multipliers) == vllm_hash._make_layer_multipliers(
        ngram_size=t["ngram_size"],
        unigram_vocab_size=t["vocab_size"],
        seed=t["seed"],
        ple_dense_layer_id=layer,
    )
    sizes, offsets, total = vllm_hash._make_vocab_layout(
        ngram_vocab_size_base=t["ngram_vocab_size_base"],
        ngram_heads=heads,
        ple_dense_layer_id=layer,
    )
    assert (list(g.head_sizes), list(g.head_offsets), g.addressed_rows) == (sizes, offsets, total)


@pytest.mark.parametrize("name", CONFIGS)
def test_row_ids_match_vllm_compute_ngram_ids(vllm_hash, name):
    g = PLEGeometry.from_config(CONFIGS[name])
    obj = vllm_instance(vllm_hash, g)
    rng = np.random.default_rng(11)
    c = g.ngram_size - 1
    for _ in range(30):
        reqs = int(rng.integers(1, 6))
        lengths = rng.integers(0, 40, size=reqs)
        total = int(lengths.sum())
        pad = int(rng.integers(0, 3))  # tokens past query_start_loc[-1], as CUDA graphs pad
        ids = rng.integers(
            0, min(g.vocab_size, 12 if name == "small" else g.vocab_size), size=total + pad
        )
        ids[rng.random(total + pad) < 0.1] = g.eos_token_id
        qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        ctx = rng.integers(0, g.vocab_size, size=(reqs, c))
        ctx[rng.random((reqs, c)) < 0.3] = g.eos_token_id
        if total + pad == 0:
            continue
        ours = row_ids(ids, qsl, ctx, g)
        theirs = obj.compute_ngram_ids(
            torch.from_numpy(ids), torch.from_numpy(qsl), torch.from_numpy(ctx)
        ).numpy()
        assert np.array_equal(ours, theirs)


@pytest.fixture(scope="module")
def vllm_dequantize(wheel):
    """vLLM's CPU NVFP4 decode (dequantize_to_dtype with its helpers)."""
    from types import SimpleNamespace

    tree = ast.parse(zipfile.ZipFile(wheel).read(NVFP4_SOURCE).decode())
    wanted = {"break_fp4_bytes", "convert_swizzled_to_linear", "dequantize_to_dtype"}
    body: list[ast.stmt] = [
        n
        for n in tree.body
        if (isinstance(n, ast.FunctionDef) and n.name in wanted)
        or (isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "kE2M1ToFloat_handle")
    ]
    assert len(body) == 4
    module = ast.Module(body=body, type_ignores=[])
    namespace = {"torch": torch, "SimpleNamespace": SimpleNamespace, "current_platform": None}
    exec(compile(module, f"{wheel.name}/{NVFP4_SOURCE}", "exec"), namespace)
    return namespace["dequantize_to_dtype"]


def ulps_apart(a: float, b: float) -> int:
    ia, ib = (struct.unpack("<i", struct.pack("<f", v))[0] for v in (a, b))
    return abs(ia - ib)


def test_nvfp4_decode_matches_vllm(vllm_dequantize):
    """vLLM's CPU path rounds e2m1 x (scale x global), its GPU kernel (e2m1 x scale) x global,
    which is ours: equal wherever e2m1 is a power of two, and within one ulp elsewhere."""
    from sparkple.runtime.nvfp4 import E2M1_TABLE, dequantize_rows

    rng = np.random.default_rng(5)
    packed = rng.integers(0, 256, size=(512, 90), dtype=np.uint8)
    packed[:, 80:] = rng.integers(0, 0x7F, size=(512, 10), dtype=np.uint8)  # finite scales
    packed[:64, 80:] = rng.integers(0, 8, size=(64, 10), dtype=np.uint8)  # subnormal scales
    gs = float(np.float32(0.0123456))
    ours = dequantize_rows(packed, gs)
    t = torch.from_numpy(packed)
    theirs = vllm_dequantize(
        t[:, :80].contiguous(),
        t[:, 80:].contiguous(),
        torch.tensor([gs]),
        torch.float32,
        swizzle=False,
    ).numpy()
    nibbles = np.stack([packed[:, :80] & 0xF, packed[:, :80] >> 4], axis=2).reshape(512, 160)
    mags = np.abs(E2M1_TABLE[nibbles])
    pow2 = np.isin(mags, [0.0, 0.5, 1.0, 2.0, 4.0])
    assert np.array_equal(ours[pow2], theirs[pow2])
    assert max(ulps_apart(a, b) for a, b in zip(ours[~pow2], theirs[~pow2], strict=True)) <= 1


@pytest.fixture(scope="module")
def vllm_ref_quant(wheel):
    """vLLM's reference NVFP4 quantizer (ref_nvfp4_quant with its helpers)."""
    tree = ast.parse(zipfile.ZipFile(wheel).read(NVFP4_SOURCE).decode())
    wanted = {"get_reciprocal", "cast_to_fp4", "ref_nvfp4_quant"}
    body: list[ast.stmt] = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted
    ]
    module = ast.Module(body=body, type_ignores=[])
    namespace = {"torch": torch, "FLOAT4_E2M1_MAX_RECIPROCAL": 1 / 6.0}
    exec(compile(module, f"{wheel.name}/{NVFP4_SOURCE}", "exec"), namespace)
    return namespace["ref_nvfp4_quant"]


def test_quantize_agrees_with_vllm_reference_quantizer(vllm_ref_quant):
    """Same ModelOpt convention and rounding. vLLM multiplies by reciprocals where we divide, so
    a value within an ulp of a tie could in principle round apart; on these inputs none does."""
    from sparkple.runtime.nvfp4 import E2M1_TABLE, e4m3_to_float32, quantize_rows

    rng = np.random.default_rng(9)
    x = rng.standard_normal((256, 160)).astype(np.float32)
    x *= np.exp2(rng.integers(-8, 3, size=(256, 1))).astype(np.float32)
    codes, scales, ws2 = quantize_rows(x)
    fp4, their_scales = vllm_ref_quant(
        torch.from_numpy(x), torch.tensor(1.0 / np.float32(ws2), dtype=torch.float32), 16
    )
    assert np.array_equal(e4m3_to_float32(scales), their_scales.numpy())
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=2).reshape(256, 160)
    ours = E2M1_TABLE[nibbles]
    assert np.array_equal(ours, fp4.numpy())
